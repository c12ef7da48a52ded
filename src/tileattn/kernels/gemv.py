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


# Every (dtype, prologue, M bucket).
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


# Kernel parameters that change per call: the 7 tensor pointers (y ... new_residual, indices 0-6).
_DYNAMIC = tuple(range(7))


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
        rows_per_task = 1 if bucket(rows) == 1 else (2 if bucket(rows) <= 4 else 4)  # the kernel's kRows
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
                                        smem=shared_memory_bytes(rows, dim),
                                        dynamic=_DYNAMIC, pdl=pdl)
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



# (name, GEMV on, PDL) of chain_benchmark's modes.
CHAIN_MODES = (("composition", False, False), ("composition+pdl", False, True), ("gemv", True, False),
               ("gemv+pdl", True, True))


def _chain_weights(model: str, dtype):
    """One decoder layer's projection weights per layer of `model` (BENCH_SHAPES' sizes, distinct
    tensors, so no layer's weights are in L2 from the layer before) and the lm_head; returns
    (layers: list of {proj: [N, K]}, lm_head [V, H], norm weight [H], the o projection's K)."""
    import torch

    shapes = {proj: (dim, n) for m, proj, _, dim, n in BENCH_SHAPES if m == model}

    def weight(proj):
        dim, n = shapes[proj]
        return torch.empty(n, dim, device="cuda", dtype=dtype).normal_(std=dim**-0.5)  # [N, K]

    layers = [{proj: weight(proj) for proj in ("qkv", "o", "gate_up", "down")} for _ in range(LAYERS[model])]
    hidden = shapes["qkv"][0]
    return layers, weight("lm_head"), torch.ones(hidden, device="cuda", dtype=dtype), shapes["o"][0]


def chain_benchmark(rows: int = 1, dtype=None, reps: int = 20, models=tuple(LAYERS), json_path=None) -> list[dict]:
    """The per-token projection sequence of a decoder, back to back on one stream: per layer qkv
    (add + RMSNorm fused) -> o (on the first o-K columns of qkv: attention left out) -> gate_up
    (add + RMSNorm fused) -> down (SiLU * up fused), x layers, then the lm_head (final norm fused),
    at M = `rows`. Each CHAIN_MODES entry is captured as one CUDA graph (as the engine decodes;
    PDL edges are fixed at capture) and replayed with bench.harness.measure, the L2 flushed once
    before each chain. Prints ms per token and effective TB/s (weight bytes / time) per mode, and
    the logits' relative difference from the composition's (one rounding per projection apart,
    compounded over the layers: reported; a non-finite value marks the mode FAILED)."""
    import os

    import torch

    from ..bench.env import environment
    from ..bench.records import write_run
    from . import dispatch

    dtype = dtype or torch.bfloat16
    saved = dispatch.GEMV_ROWS_OVERRIDE, os.environ.get("TILEATTN_PDL")
    records: list[dict] = []
    try:
        for model in models:
            records += _chain_model(model, rows, dtype, reps)
            torch.cuda.empty_cache()
    finally:
        dispatch.GEMV_ROWS_OVERRIDE, pdl_env = saved
        if pdl_env is None:
            os.environ.pop("TILEATTN_PDL", None)
        else:
            os.environ["TILEATTN_PDL"] = pdl_env
    if json_path:
        write_run(json_path, records, environment())
    return records


def _chain_model(model: str, rows: int, dtype, reps: int) -> list[dict]:
    """chain_benchmark for one model: every CHAIN_MODES entry (sets the dispatch override and
    TILEATTN_PDL; the caller restores them)."""
    import os

    import torch

    import tileattn

    from ..bench.harness import measure
    from . import dispatch

    layers, lm_head, norm_weight, o_dim = _chain_weights(model, dtype)
    hidden = norm_weight.shape[0]
    nbytes = (sum(w.numel() for layer in layers for w in layer.values()) + lm_head.numel()) * lm_head.element_size()
    x0 = torch.randn(rows, hidden, device="cuda").to(dtype)  # [M, H]
    residual0 = torch.randn(rows, hidden, device="cuda").to(dtype)  # [M, H]

    def chain():
        x, residual = x0, residual0.clone()  # the composition updates the residual in place
        for w in layers:
            qkv, residual = tileattn.add_rms_norm_linear(x, residual, norm_weight, 1e-5, w["qkv"])  # [M, Nqkv]
            o = tileattn.linear(qkv[:, :o_dim], w["o"])  # [M, H]
            gate_up, residual = tileattn.add_rms_norm_linear(o, residual, norm_weight, 1e-5, w["gate_up"])
            x = tileattn.linear(gate_up, w["down"], activation="silu_mul")  # [M, H]
        return tileattn.add_rms_norm_linear(x, residual, norm_weight, 1e-5, lm_head)[0]  # [M, V]

    records, reference = [], None
    for name, on, pdl in CHAIN_MODES:
        dispatch.GEMV_ROWS_OVERRIDE = rows if on else 0
        os.environ["TILEATTN_PDL"] = "1" if pdl else "0"
        logits = chain().double()  # compiles, makes the plans, warms cuBLAS
        reference = logits if reference is None else reference
        err = ((logits - reference).norm() / reference.norm()).item()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            chain()
        t = measure(graph.replay, reps=reps, memory=False)
        ms = t.median_ms
        status = "ok" if logits.isfinite().all() and err == err else "FAILED (non-finite logits)"
        print(f"{model:11} M={rows} {name:16} {ms:7.3f} ms/token {nbytes / (ms * 1e-3) / 1e12:5.2f} TB/s "
              f"({nbytes / 1e9:.2f} GB)  logits rel diff vs composition {err:.1e} {status}", flush=True)
        records.append({"suite": "gemv-chain", "model": model, "m": rows, "mode": name, "pdl": pdl,
                        "dtype": str(dtype).removeprefix("torch."), "weight_bytes": nbytes, "status": status,
                        "timing": t.as_dict(), "ms_per_token": ms, "tbps": nbytes / (ms * 1e-3) / 1e12,
                        "rel_diff_vs_composition": err})
    return records


def main(argv=None) -> int:
    """`python -m tileattn.kernels.gemv [--chain] [--m 1 ...] [--dtype bf16|fp16] [--reps 20] [--json PATH]`:
    benchmark() (each projection alone), or with --chain chain_benchmark() at each --m (default 1)."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--m", type=int, action="append", choices=range(1, 9))
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--chain", action="store_true",
                        help="time each model's per-token chain of projections as one CUDA graph, per mode")
    a = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the GEMV benchmark needs a CUDA GPU; nothing measured")
        return 1
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    if a.chain:
        records = []
        for rows in a.m or (1,):
            records += chain_benchmark(rows, dtype=dtype, reps=a.reps)
        if a.json:
            from ..bench.env import environment
            from ..bench.records import write_run

            write_run(a.json, records, environment())
        return 0
    benchmark(rows_list=tuple(a.m or BENCH_ROWS), dtype=dtype, reps=a.reps, json_path=a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["BENCH_SHAPES", "CHAIN_MODES", "FAMILIES", "INSTANTIATIONS", "PROLOGUES", "benchmark", "chain_benchmark",
           "fits_shared_memory", "launch_gemv"]
