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


# ---- validate, then benchmark: python -m tileattn.kernels.gemv [--json PATH] ----------------------

# (model, projection, prologue, K, N): each decode projection and the step fused before it.
BENCH_SHAPES = (
    ("llama-3-8b", "qkv", PROLOGUE_ADD_RMS_NORM, 4096, 6144),
    ("llama-3-8b", "o", PROLOGUE_NONE, 4096, 4096),
    ("llama-3-8b", "gate_up", PROLOGUE_ADD_RMS_NORM, 4096, 28672),
    ("llama-3-8b", "down", PROLOGUE_SILU_MUL, 14336, 4096),
    ("llama-3-8b", "lm_head", PROLOGUE_ADD_RMS_NORM, 4096, 128256),
    ("qwen3-0.6b", "qkv", PROLOGUE_ADD_RMS_NORM, 1024, 4096),
    ("qwen3-0.6b", "o", PROLOGUE_NONE, 2048, 1024),
    ("qwen3-0.6b", "gate_up", PROLOGUE_ADD_RMS_NORM, 1024, 6144),
    ("qwen3-0.6b", "down", PROLOGUE_SILU_MUL, 3072, 1024),
    ("qwen3-0.6b", "lm_head", PROLOGUE_ADD_RMS_NORM, 1024, 151936),
)
BENCH_ROWS = (1, 2, 4, 8)
LAYERS = {"llama-3-8b": 32, "qwen3-0.6b": 28}
_PROLOGUE_NAMES = {PROLOGUE_NONE: "none", PROLOGUE_SILU_MUL: "silu_mul", PROLOGUE_ADD_RMS_NORM: "add_rms_norm"}


def _bench_calls(prologue: int, rows: int, dim: int, n: int, dtype):
    """(the tileattn call, F.linear alone on the prepared rows, reset) for one shape. The call runs
    the kernel or the composition as dispatch.GEMV_ROWS_OVERRIDE says; the composition updates the
    residual in place, so reset() restores it before a validation call."""
    import torch

    import tileattn
    from .. import api_layers

    dev = "cuda"
    width = 2 * dim if prologue == PROLOGUE_SILU_MUL else dim
    x = torch.randn(rows, width, device=dev).to(dtype)  # [M, K] or [M, 2K]
    weight = (torch.randn(n, dim, device=dev) / dim**0.5).to(dtype)  # [N, K]
    residual = torch.randn(rows, dim, device=dev).to(dtype)  # [M, K]
    saved = residual.clone()
    if prologue == PROLOGUE_ADD_RMS_NORM:
        norm_weight = torch.ones(dim, device=dev, dtype=dtype)

        def fused():
            return tileattn.add_rms_norm_linear(x, residual, norm_weight, 1e-5, weight)[0]

        prepared = api_layers.add_rms_norm(x + residual, norm_weight, 1e-5)
    elif prologue == PROLOGUE_SILU_MUL:
        def fused():
            return tileattn.linear(x, weight, activation="silu_mul")

        prepared = api_layers.silu_mul(x)
    else:
        def fused():
            return tileattn.linear(x, weight)

        prepared = x
    return fused, (lambda: torch.nn.functional.linear(prepared, weight)), (lambda: residual.copy_(saved))


def benchmark(rows_list=BENCH_ROWS, shapes=BENCH_SHAPES, dtype=None, reps: int = 20, json_path=None) -> list[dict]:
    """For each shape and M: validate the kernel against the composition (relative error at most
    the dtype's unit roundoff, no NaN), then time it, F.linear (cuBLAS) on the prepared rows, and
    the unfused composition (silu_mul / add_rms_norm, then F.linear) with bench.harness.measure
    (CUDA events, L2 flushed before each repetition). Prints one line per case and the M = 1
    projection time per token of each model; returns the records (json_path: written with the
    environment, like the other benchmarks)."""
    import torch

    from ..bench.env import environment
    from ..bench.harness import measure
    from ..bench.records import write_run
    from . import dispatch

    dtype = dtype or torch.bfloat16
    unit_roundoff = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    saved = dispatch.GEMV_ROWS_OVERRIDE
    records: list[dict] = []
    per_token: dict[str, dict[str, float]] = {}
    print(f"{'model':11} {'proj':8} {'prologue':12} {'M':>2} {'K':>6} {'N':>7} | {'kernel us':>9} {'TB/s':>5} | "
          f"{'cuBLAS us':>9} {'TB/s':>5} {'x':>5} | {'unfused us':>10} {'x':>5}")
    try:
        for model, proj, prologue, dim, n in shapes:
            for rows in rows_list:
                dispatch.GEMV_ROWS_OVERRIDE = 0
                fused, cublas, reset = _bench_calls(prologue, rows, dim, n, dtype)
                reset()
                want = fused()  # the composition (kernel off)
                dispatch.GEMV_ROWS_OVERRIDE = dispatch.GEMV_KERNEL_MAX_ROWS
                reset()
                got = fused()
                width = dim * (2 if prologue == PROLOGUE_SILU_MUL else 1)
                takes = fits_shared_memory(rows, dim, got.get_device())
                err = ((got.double() - want.double()).norm() / want.double().norm()).item()
                ok = takes and not got.isnan().any() and err <= unit_roundoff
                base = {"suite": "gemv", "model": model, "proj": proj, "prologue": _PROLOGUE_NAMES[prologue],
                        "m": rows, "k": dim, "n": n, "dtype": str(dtype).removeprefix("torch."),
                        "rel_err_vs_composition": err}
                if not ok:
                    why = "composition (shared memory)" if not takes else f"FAILED validation (rel err {err:.2e})"
                    print(f"{model:11} {proj:8} {_PROLOGUE_NAMES[prologue]:12} {rows:>2} {dim:>6} {n:>7} | {why}")
                    records.append({**base, "impl": "tileattn", "status": why})
                    continue
                nbytes = (n * dim + rows * (width + n)) * torch.finfo(dtype).bits // 8
                times = {"tileattn": measure(fused, reps=reps, memory=False)}
                times["cublas"] = measure(cublas, reps=reps, memory=False)
                if prologue != PROLOGUE_NONE:
                    dispatch.GEMV_ROWS_OVERRIDE = 0
                    times["composition"] = measure(fused, reps=reps, memory=False)
                    dispatch.GEMV_ROWS_OVERRIDE = dispatch.GEMV_KERNEL_MAX_ROWS
                us = {k: t.median_ms * 1e3 for k, t in times.items()}
                for impl, t in times.items():
                    records.append({**base, "impl": impl, "timing": t.as_dict(), "us": us[impl],
                                    "tbps": nbytes / (us[impl] * 1e-6) / 1e12})
                unfused = us.get("composition", us["cublas"])
                print(f"{model:11} {proj:8} {_PROLOGUE_NAMES[prologue]:12} {rows:>2} {dim:>6} {n:>7} | "
                      f"{us['tileattn']:9.1f} {nbytes / us['tileattn'] / 1e6:5.2f} | {us['cublas']:9.1f} "
                      f"{nbytes / us['cublas'] / 1e6:5.2f} {us['cublas'] / us['tileattn']:5.2f} | "
                      f"{unfused:10.1f} {unfused / us['tileattn']:5.2f}")
                if rows == 1:
                    count = 1 if proj == "lm_head" else LAYERS[model]
                    totals = per_token.setdefault(model, {"tileattn": 0.0, "unfused": 0.0})
                    totals["tileattn"] += count * us["tileattn"]
                    totals["unfused"] += count * unfused
    finally:
        dispatch.GEMV_ROWS_OVERRIDE = saved
    for model, totals in per_token.items():
        print(f"{model}, M = 1, projections + fused steps per token (layers x per-call medians, L2 flushed): "
              f"{totals['tileattn'] / 1e3:.3f} ms with the kernel, {totals['unfused'] / 1e3:.3f} ms unfused")
    if json_path:
        write_run(json_path, records, environment())
    return records



def main(argv=None) -> int:
    """`python -m tileattn.kernels.gemv [--m 1 ...] [--dtype bf16|fp16] [--reps 20] [--json PATH]`."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--m", type=int, action="append", choices=range(1, 9))
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json")
    a = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the GEMV benchmark needs a CUDA GPU; nothing measured")
        return 1
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    benchmark(rows_list=tuple(a.m or BENCH_ROWS), dtype=dtype, reps=a.reps, json_path=a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["BENCH_SHAPES", "FAMILIES", "INSTANTIATIONS", "PROLOGUES", "benchmark", "fits_shared_memory",
           "launch_gemv"]
