"""Skinny GEMM for decode, y = x W^T (+ b) with at most 8 rows of x (csrc/gemv.cu): registry and
launcher. The caller (tileattn.api_layers.linear) checks shapes, dtypes and alignment."""

from __future__ import annotations

import numpy as np

from . import Family

FAMILY_NAME = "gemv"
SOURCE = "gemv.cu"
MAX_ROWS = (1, 2, 4, 8)  # kMaxM instantiations; M rows run the smallest that holds them
ROWS_PER_WARP = 4  # kGemvRows
WARPS = 4  # kGemvWarps
_BF16 = {True: "true", False: "false"}


def expression(bf16: bool, max_rows: int) -> str:
    return f"tileattn::gemv<{_BF16[bf16]}, {max_rows}>"


INSTANTIATIONS = tuple(expression(b, m) for b in (True, False) for m in MAX_ROWS)
FAMILIES = (Family(FAMILY_NAME, SOURCE, INSTANTIATIONS, archs=("sm_90a", "sm_80")),)

CACHE_LIMIT = 1024
_plans: dict[tuple, object] = {}


def launch_gemv(y, x, weight, bias) -> None:
    """y [M, N] <- x [M, K] @ weight[N, K]^T (+ bias [N]), 1 <= M <= 8, on the current stream."""
    rows, k = x.shape
    n = weight.shape[0]
    key = (x.device.index, x.shape, x.stride(), weight.shape, weight.stride(), y.stride(), x.dtype, bias is None)
    plan = _plans.get(key)
    if plan is None:
        import torch

        from ..runtime import LaunchPlan
        from . import load

        max_rows = next(m for m in MAX_ROWS if m >= rows)
        kern = load(FAMILY_NAME, expression(x.dtype == torch.bfloat16, max_rows), x.device.index)
        args = (y.data_ptr(), x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                np.int32(rows), np.int32(n), np.int32(k // 8), np.int64(x.stride(0) // 8),
                np.int64(weight.stride(0) // 8), np.int64(y.stride(0)))
        per_block = ROWS_PER_WARP * WARPS
        plan = LaunchPlan(kern, (-(-n // per_block), 1, 1), (WARPS * 32, 1, 1), args, dynamic=(0, 1, 2, 3))
        if len(_plans) >= CACHE_LIMIT:
            _plans.clear()
        _plans[key] = plan
    plan.launch(y.data_ptr(), x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr())


__all__ = ["FAMILIES", "INSTANTIATIONS", "MAX_ROWS", "launch_gemv"]
