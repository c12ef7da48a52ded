"""Small-M projections (csrc/gemv.cu): the registry, the launcher, and a validate-then-benchmark
main (`python -m tileattn.kernels.gemv [--json PATH]`).

The launcher trusts its caller (tileattn.api_layers.linear / add_rms_norm_linear check shapes,
dtypes, strides, alignment and the shared-memory fit) and keeps one LaunchPlan per (device,
shapes, strides, dtype, prologue, flags), only the data pointers rewritten per call. The kernel
waits for its predecessor's writes before reading x or the residual, so with TILEATTN_PDL=1
(runtime.pdl_enabled) the plans launch with programmatic dependent launch.
"""

from __future__ import annotations

import numpy as np

from . import Family

FAMILY_NAME = "gemv"
SOURCE = "gemv.cu"
THREADS = 512  # gemv_detail::kThreads
STATIC_SMEM_BYTES = 8 * 32 * 4  # the add_rms_norm prologue's warp partials, [kMaxM][32] fp32
PROLOGUE_NONE, PROLOGUE_SILU_MUL, PROLOGUE_ADD_RMS_NORM = 0, 1, 2
PROLOGUES = (PROLOGUE_NONE, PROLOGUE_SILU_MUL, PROLOGUE_ADD_RMS_NORM)
M_BUCKETS = (1, 4, 8)  # kMaxM: 1 row per warp task at M = 1, 2 up to M = 4, 4 up to M = 8
_BF16 = {True: "true", False: "false"}


def bucket(rows: int) -> int:
    """The smallest instantiated kMaxM >= rows (1 <= rows <= 8)."""
    return next(b for b in M_BUCKETS if rows <= b)


def expression(bf16: bool, prologue: int, max_rows: int) -> str:
    return f"tileattn::gemv<{_BF16[bf16]}, {prologue}, {max_rows}>"


INSTANTIATIONS = tuple(expression(b, p, m) for b in (True, False) for p in PROLOGUES for m in M_BUCKETS)
FAMILIES = (Family(FAMILY_NAME, SOURCE, INSTANTIATIONS, archs=("sm_90a", "sm_80")),)


def shared_memory_bytes(rows: int, dim: int) -> int:
    """Dynamic shared memory of a launch: the M prepared input rows as fp32."""
    return rows * dim * 4


def fits_shared_memory(rows: int, dim: int, device_index: int) -> bool:
    """Whether M rows of K fit in one block's shared memory on the device (else: composition)."""
    from ..runtime.launcher import device_smem_optin

    return shared_memory_bytes(rows, dim) + STATIC_SMEM_BYTES <= device_smem_optin(device_index)


CACHE_LIMIT = 1024
_plans: dict[tuple, object] = {}


def launch_gemv(prologue: int, y, x, weight, bias, *, residual=None, norm_weight=None, eps: float = 0.0,
                new_residual=None) -> None:
    """y [M, N] <- act(x) @ weight^T (+ bias); act by `prologue` (PROLOGUE_*). With
    PROLOGUE_ADD_RMS_NORM: norm_weight [K], eps, and new_residual [M, K] (contiguous) <- x +
    residual when residual is given."""
    import torch

    from ..runtime.launcher import device_sm_count, pdl_enabled

    rows, n = y.shape
    dim = weight.shape[1]
    device = x.device.index
    pdl = pdl_enabled(device)
    key = (device, prologue, x.shape, x.stride(), weight.shape, x.dtype, bias is not None,
           None if residual is None else residual.stride(), eps, pdl)
    plan = _plans.get(key)
    if plan is None:
        from ..runtime import LaunchPlan
        from . import load

        kern = load(FAMILY_NAME, expression(x.dtype == torch.bfloat16, prologue, bucket(rows)), device)
        rows_per_task = 1 if bucket(rows) == 1 else (2 if bucket(rows) <= 4 else 4)
        tasks = -(-n // rows_per_task)
        grid = min(device_sm_count(device), tasks)  # one long-lived block per SM (csrc/gemv.cu)
        args = (y.data_ptr(), x.data_ptr(), weight.data_ptr(), _ptr(bias), _ptr(residual), _ptr(norm_weight),
                _ptr(new_residual), np.int32(rows), np.int32(n), np.int32(dim // 8),
                np.int64(x.stride(0) // 8 if rows > 1 else 0), np.int64(0 if residual is None or rows == 1 else
                                                                          residual.stride(0) // 8),
                np.float32(eps))
        if len(_plans) >= CACHE_LIMIT:
            _plans.clear()
        plan = _plans[key] = LaunchPlan(kern, (grid, 1, 1), (THREADS, 1, 1), args,
                                        smem=shared_memory_bytes(rows, dim), dynamic=tuple(range(7)), pdl=pdl)
    plan.launch(y.data_ptr(), x.data_ptr(), weight.data_ptr(), _ptr(bias), _ptr(residual), _ptr(norm_weight),
                _ptr(new_residual))


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


__all__ = ["FAMILIES", "INSTANTIATIONS", "PROLOGUES", "fits_shared_memory", "launch_gemv"]
