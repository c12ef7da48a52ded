"""Lab 1b: reductions (sum and max of a 1-D fp32 array); validate every version, then time it.

    python -m labs.reduction [--n 1073741824] [--versions v5_vec4_b256_u4,...] [--no-sweep] [--json out.json]

Kernels and the idea each version adds: labs/csrc/reduction.cu (header comment). Correctness at
n = 1, 31, 32, 33, 1003 and --n (default 2^30): sum against a float64 torch sum by relative error,
max exactly against torch.amax. Bandwidth = 4 bytes x n / time (each input element read once),
beside torch.sum and torch.amax measured in the same run. Then a sweep of n for the sum (plot).
The broken versions (names starting with `bug_`) are never run here: see `python -m labs.sanitize`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from tileattn import kernels
from labs.kernels.reduction import BLOCK, BROKEN, VEC4_CONFIGS, expression
from tileattn.runtime import launch, load_kernel, require_gpu

OPS = {"sum": "SumOp", "max": "MaxOp"}
CHECK_LENGTHS = (1, 31, 32, 33, 1003)
DEFAULT_N = 1 << 30


@dataclass(frozen=True)
class Version:
    """One row of the ladder: which kernel, how the host drives it, what is wrong with it (if anything).

    scheme: "multipass" (launch on x, then on the partials, until one value is left),
            "twopass" (one wave of grid-stride blocks, then one block on their partials),
            "onepass" (last-block-done counter), "padded_final" (broken: pass 1 with
            reduce_sequential, final pass over a padded partials buffer).
    owns: kernel template names used only by this version (the sanitizer lab attributes a report
          to a version by kernel name).
    """

    key: str
    kernel: str
    params: tuple[int, ...]
    scheme: str
    per_block: int = 0  # elements per block in one multipass launch
    broken: str | None = None

    @property
    def block(self) -> int:
        return self.params[0]

    @property
    def owns(self) -> tuple[str, ...]:
        return (self.kernel,)

    def expr(self, op: str) -> str:
        return expression(self.kernel, OPS[op], *self.params)


def _versions() -> dict[str, Version]:
    vs = [
        Version("v1_interleaved", "reduce_interleaved", (BLOCK,), "multipass", BLOCK),
        Version("v2_sequential", "reduce_sequential", (BLOCK,), "multipass", BLOCK),
        Version("v3_first_add", "reduce_first_add", (BLOCK,), "multipass", 2 * BLOCK),
        Version("v4_warp_shuffle", "reduce_warp_shuffle", (BLOCK,), "multipass", 2 * BLOCK),
    ]
    vs += [Version(f"v5_vec4_b{b}_u{u}", "reduce_vec4", (b, u), "twopass") for b, u in VEC4_CONFIGS]
    vs += [Version(f"v6_onepass_b{b}_u{u}", "reduce_vec4_onepass", (b, u), "onepass") for b, u in VEC4_CONFIGS]
    for kernel, what in BROKEN.items():
        scheme = "padded_final" if kernel == "reduce_bug_final_reads_all" else "multipass"
        vs.append(Version(kernel.removeprefix("reduce_"), kernel, (BLOCK,), scheme, BLOCK, broken=what))
    return {v.key: v for v in vs}


VERSIONS = _versions()
CORRECT = tuple(k for k, v in VERSIONS.items() if v.broken is None)
BROKEN_VERSIONS = tuple(k for k, v in VERSIONS.items() if v.broken is not None)
b0, u0 = VEC4_CONFIGS[0]
DEFAULT_VERSION = f"v6_onepass_b{b0}_u{u0}"
TWO_PASS_DEFAULT = f"v5_vec4_b{b0}_u{u0}"
# The padded final pass of bug_final_reads_all holds one block of partials.
PADDED_FINAL_MAX_N = BLOCK * BLOCK


def check_args(x, op: str, version: str, allow_broken: bool = False, out=None) -> Version:
    """Validate a call before anything reaches the GPU; returns the Version. Raises ValueError."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 1-D tensor, got shape {tuple(x.shape)} strides {x.stride()}")
    if not x.is_cuda:
        raise ValueError(f"x must be a CUDA tensor, got device {x.device}")
    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    if version not in VERSIONS:
        raise ValueError(f"unknown version {version!r}; known: {', '.join(VERSIONS)}")
    v = VERSIONS[version]
    if v.broken is not None and not allow_broken:
        raise ValueError(f"{version} is deliberately broken ({v.broken}); pass allow_broken=True to run it")
    if x.numel() == 0 and op == "max":
        raise ValueError("max of an empty tensor has no identity to return (torch.amax raises too)")
    if v.scheme == "padded_final" and x.numel() > PADDED_FINAL_MAX_N:
        raise ValueError(f"{version} handles n <= {PADDED_FINAL_MAX_N}, got {x.numel()}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.numel() != 1 or not out.is_contiguous():
            raise ValueError("out must be a contiguous float32 tensor with one element")
        if out.device != x.device:
            raise ValueError(f"out is on {out.device}, x on {x.device}")
    return v


# ---- launching ----------------------------------------------------------------------------------
def _compile_options():
    """`TILEATTN_LINEINFO=1` (set by labs.sanitize) compiles with -lineinfo so reports name lines."""
    import os

    return {"lineinfo": True} if os.environ.get("TILEATTN_LINEINFO") == "1" else None


_loaded: dict = {}


def _kernel(expr: str):
    """The loaded kernel for `expr` on the current device (memoized: the benchmark times host
    overhead too, whenever it exceeds the GPU work queued ahead of it)."""
    opts = _compile_options()
    key = (expr, torch.cuda.current_device(), opts is not None)
    k = _loaded.get(key)
    if k is None:
        fam = kernels.family("reduction")
        k = _loaded[key] = load_kernel(fam.path, fam.require(expr), compile_options=opts)
    return k


@lru_cache(maxsize=None)
def _one_wave(expr: str, block: int, device_index: int) -> int:
    """Blocks that fit on the GPU at once (occupancy API), so a grid-stride grid is one full wave."""
    k = _kernel(expr)
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    try:
        per_sm = int(k.kernel.occupancy.max_active_blocks_per_multiprocessor(block, 0))
    except Exception:  # older cuda.core: estimate from the ptxas register count (64K regs, 2048 threads)
        regs = k.resources.registers if k.resources else 32
        per_sm = max(1, min(2048 // block, 65536 // (math.ceil(regs * 32 / 256) * 256 * (block // 32))))
    return sms * max(per_sm, 1)


_counters: dict[int, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """The one-pass kernel's ticket counter: zero between launches (the kernel resets it)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    c = _counters.get(idx)
    if c is None:
        c = _counters[idx] = torch.zeros(1, dtype=torch.int32, device=device)
    return c


def _grid_stride_grid(v: Version, expr: str, n: int, device: torch.device) -> int:
    b, u = v.params
    wanted = math.ceil(n / (b * 4 * u))  # at least U float4 per thread when n is small
    return max(1, min(wanted, _one_wave(expr, b, device.index)))  # a CUDA tensor's device always has an index


def reduce(x: torch.Tensor, op: str = "sum", version: str = DEFAULT_VERSION, *, out: torch.Tensor | None = None,
           allow_broken: bool = False) -> torch.Tensor:
    """Sum or max of a contiguous 1-D float32 CUDA tensor x of shape (n,), as a 0-dim float32
    tensor on x's device (a view of `out` when given: a one-element float32 tensor).

    version: a key of VERSIONS (default: the one-launch float4 kernel). An empty x sums to 0; its
    max raises ValueError. Raises ValueError for another dtype, rank, layout, device or version.
    """
    v = check_args(x, op, version, allow_broken, out)
    n = x.numel()
    f32 = dict(dtype=torch.float32, device=x.device)
    out = torch.empty(1, **f32) if out is None else out
    if n == 0:
        return out.fill_(0).reshape(())
    require_gpu()
    expr = v.expr(op)
    kernel = _kernel(expr)
    if v.scheme == "multipass":
        src, m = x, n
        while True:
            grid = math.ceil(m / v.per_block)
            dst = out if grid == 1 else torch.empty(grid, **f32)
            launch(kernel, (grid,), (v.block,), (src.data_ptr(), dst.data_ptr(), np.int64(m)))
            if grid == 1:
                return out.reshape(())
            src, m = dst, grid
    if v.scheme == "twopass":
        grid = _grid_stride_grid(v, expr, n, x.device)
        if grid == 1:
            launch(kernel, (1,), (v.block,), (x.data_ptr(), out.data_ptr(), np.int64(n)))
            return out.reshape(())
        partials = torch.empty(grid, **f32)  # [grid]
        launch(kernel, (grid,), (v.block,), (x.data_ptr(), partials.data_ptr(), np.int64(n)))
        launch(kernel, (1,), (v.block,), (partials.data_ptr(), out.data_ptr(), np.int64(grid)))
        return out.reshape(())
    if v.scheme == "onepass":
        grid = _grid_stride_grid(v, expr, n, x.device)
        partials = torch.empty(grid, **f32)  # [grid] workspace
        args = (x.data_ptr(), out.data_ptr(), partials.data_ptr(), _counter(x.device).data_ptr(), np.int64(n))
        launch(kernel, (grid,), (v.block,), args)
        return out.reshape(())
    if v.scheme == "padded_final":  # broken on purpose: see reduce_bug_final_reads_all
        grid = math.ceil(n / v.block)
        partials = torch.empty(v.block, **f32)  # padded to one full block; only `grid` get written
        first = _kernel(expression("reduce_sequential", OPS[op], v.block))
        launch(first, (grid,), (v.block,), (x.data_ptr(), partials.data_ptr(), np.int64(n)))
        launch(kernel, (1,), (v.block,), (partials.data_ptr(), out.data_ptr(), np.int64(grid)))
        return out.reshape(())
    raise AssertionError(v.scheme)


# ---- validation ---------------------------------------------------------------------------------
def sum_tolerance(n: int) -> float:
    """Relative-error budget of an fp32 sum against float64. Tree levels add ~eps each
    (log2 n * 6e-8 < 2e-6); the grid-stride kernels also add up to n / (threads * 4U) terms in
    sequence per accumulator (~250 at 2^30 on 132 SMs: worst case 250 * 6e-8 = 1.5e-5)."""
    return 2e-6 if n <= 4096 else 1e-4


def random_input(n: int, device="cuda", generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform in [-0.5, 1.5): mixed signs, mean 0.5, so the sum (~n/2) is far from 0 and the
    relative error is meaningful."""
    return torch.rand(n, device=device, generator=generator) * 2 - 0.5


def check_result(x: torch.Tensor, op: str, got: torch.Tensor, ref: torch.Tensor | None = None) -> dict:
    """Compare one result with the reference; returns {'correct', 'rel_err' or 'exact', 'got', 'ref'}."""
    g = float(got)
    if op == "sum":
        r = float(x.sum(dtype=torch.float64)) if ref is None else float(ref)
        err = abs(g - r) / abs(r) if r != 0 else abs(g - r)
        return {"correct": bool(math.isfinite(g) and err <= sum_tolerance(x.numel())), "rel_err": err, "got": g, "ref": r}
    r = float(torch.amax(x)) if ref is None else float(ref)
    return {"correct": g == r, "exact": g == r, "got": g, "ref": r}


def self_check(version: str, n: int, op: str, *, allow_broken: bool = False, seed: int | None = None) -> dict:
    """Run one version once on fresh random input of length n; the record of check_result.
    (Used by labs.sanitize to exercise a version under compute-sanitizer.)"""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
    x = random_input(n, generator=gen)
    got = reduce(x, op, version, allow_broken=allow_broken)
    torch.cuda.synchronize()
    return check_result(x, op, got)


# ---- the lab ------------------------------------------------------------------------------------
def _fmt_err(rec: dict) -> str:
    return f"{rec['rel_err']:.1e}" if "rel_err" in rec else ("exact" if rec.get("exact") else "DIFF")


def main(argv=None) -> int:
    from tileattn.bench import measure, write_run

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=DEFAULT_N, help="large length for correctness and bandwidth (default 2^30)")
    ap.add_argument("--versions", help="comma-separated version keys (default: every correct version)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true", help="skip the bandwidth-vs-n sweep")
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args(argv)
    versions = args.versions.split(",") if args.versions else list(CORRECT)
    for k in versions:
        if k not in VERSIONS:
            ap.error(f"unknown version {k!r}; known: {', '.join(VERSIONS)}")
        if VERSIONS[k].broken:
            ap.error(f"{k} is deliberately broken; run it through `python -m labs.sanitize`")
    if args.n < 1:
        ap.error("--n must be >= 1")
    require_gpu()
    records: list[dict] = []
    failures: list[str] = []

    # 1. correctness at the edge lengths and at n
    print(f"correctness: sum vs float64 torch sum (relative error, budget {sum_tolerance(1):.0e} / {sum_tolerance(1 << 30):.0e}), max exact")
    lengths = list(CHECK_LENGTHS) + [args.n]
    inputs = {m: random_input(m) for m in lengths}
    refs = {(m, "sum"): inputs[m].sum(dtype=torch.float64) for m in lengths}
    refs.update({(m, "max"): torch.amax(inputs[m]) for m in lengths})
    print(f"{'version':<24}" + "".join(f"{f'n={m} sum/max':>19}" for m in lengths))
    for k in versions:
        cells = []
        for m in lengths:
            cell = []
            for op in OPS:
                got = reduce(inputs[m], op, k)
                rec = check_result(inputs[m], op, got, refs[(m, op)])
                records.append({"suite": "reduction", "kind": "correctness", "impl": k, "op": op, "n": m, **rec})
                cell.append(_fmt_err(rec) + ("" if rec["correct"] else "!"))
                if not rec["correct"]:
                    failures.append(f"{k} {op} n={m}: got {rec['got']!r}, expected {rec['ref']!r}")
            cells.append("/".join(cell))
        print(f"{k:<24}" + "".join(f"{c:>19}" for c in cells))
    for m in lengths:  # torch's own fp32 sum, for scale
        rec = check_result(inputs[m], "sum", torch.sum(inputs[m]), refs[(m, "sum")])
        records.append({"suite": "reduction", "kind": "correctness", "impl": "torch.sum", "op": "sum", "n": m, **rec})
    del inputs
    if failures:
        print("\nWRONG RESULTS:\n  " + "\n  ".join(failures))

    # 2. bandwidth at n, beside torch in the same process
    x = random_input(args.n)
    nbytes = 4 * args.n
    rows = []
    for op in OPS:
        impls = {k: (lambda k=k, op=op: reduce(x, op, k)) for k in versions}
        impls["torch.sum" if op == "sum" else "torch.amax"] = (lambda: torch.sum(x)) if op == "sum" else (lambda: torch.amax(x))
        for name, fn in impls.items():
            t = measure(fn, reps=args.reps)
            tbps = nbytes / (t.median_ms * 1e-3) / 1e12
            rec = {"suite": "reduction", "kind": "bandwidth", "impl": name, "op": op, "n": args.n, "tbps": tbps, **t.as_dict()}
            records.append(rec)
            rows.append(rec)
    for op in OPS:
        peer = next(r for r in rows if r["op"] == op and r["impl"].startswith("torch"))
        for r in rows:
            if r["op"] == op:
                r["ratio_to_torch"] = r["tbps"] / peer["tbps"]

    # 3. sweep of n (sum): launch overhead at small n, bandwidth at large n
    if not args.no_sweep:
        sweep = [k for k in ("v4_warp_shuffle", TWO_PASS_DEFAULT, DEFAULT_VERSION) if k in versions]
        for e in range(16, int(math.log2(args.n)) + 1, 2):
            m = 1 << e
            xs = x[:m]
            for name, fn in [(k, lambda k=k, xs=xs: reduce(xs, "sum", k)) for k in sweep] + [("torch.sum", lambda xs=xs: torch.sum(xs))]:
                t = measure(fn, reps=args.reps, memory=False)
                records.append({"suite": "reduction", "kind": "sweep", "impl": name, "op": "sum", "n": m,
                                "tbps": 4 * m / (t.median_ms * 1e-3) / 1e12, **t.as_dict()})

    if args.json:
        write_run(args.json, records)
    # the table last
    print(f"\nbandwidth at n = {args.n} ({nbytes / 2**30:.2f} GiB read per call), median of up to {args.reps} reps, L2 flushed")
    print(f"{'version':<24}{'op':>5}{'median ms':>11}{'IQR ms':>17}{'TB/s':>8}{'x torch':>9}")
    for r in rows:
        print(f"{r['impl']:<24}{r['op']:>5}{r['median_ms']:>11.4f}{r['q1_ms']:>8.4f}-{r['q3_ms']:<8.4f}{r['tbps']:>8.3f}{r['ratio_to_torch']:>9.3f}")
    best = max((r for r in rows if r["op"] == "sum" and not r["impl"].startswith("torch")), key=lambda r: r["tbps"])
    print(f"best multi-block sum: {best['impl']} at {best['ratio_to_torch']:.3f}x torch.sum (target >= 0.95)")
    if failures:
        print(f"{len(failures)} wrong results (listed above)")
        return 1
    return 0


if __name__ == "__main__":
    from labs import run_lab

    raise SystemExit(run_lab(main, "reduction"))
