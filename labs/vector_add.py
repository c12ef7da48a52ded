"""Lab 0: vector add through the tileattn runtime; validate every version, then time it.

    python -m labs.vector_add [--n 268435456] [--json out.json]

Useful bandwidth = 3 streams (read a, read b, write c) x 4 bytes x n / time, beside torch's
`a + b` measured in the same run. The device copy ceiling is 4.3 TB/s on the H200 (a torch device-to-device copy, measured 2026-11-29).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from tileattn import kernels
from labs.kernels.vector_add import VEC4_UNROLL
from tileattn.runtime import launch, require_gpu

# version -> elements one thread handles per loop trip (float4 loads x unroll)
ELEMENTS_PER_THREAD = {"vector_add_scalar": 1, "vector_add_vec4<1>": 4, f"vector_add_vec4<{VEC4_UNROLL}>": 4 * VEC4_UNROLL}
VERSIONS = tuple(ELEMENTS_PER_THREAD)
BLOCK = 256
_BLOCKS_PER_SM = 8  # persistent grid: 8 resident blocks of 256 threads fill an SM (2048 threads)


def vector_add(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *, version: str | None = None,
               persistent: bool = False) -> torch.Tensor:
    """c = a + b for 1-D contiguous fp32 CUDA tensors of equal length (any length >= 0).

    Uses 16-byte loads when a, b and out are 16-byte aligned, else the scalar kernel.
    `persistent`: cap the grid at 8 blocks per SM and loop (grid-stride) instead of one pass
    with a block per 256 x elements-per-thread.
    Raises ValueError for another dtype, rank, length, device or a non-contiguous tensor.
    """
    for name, t in (("a", a), ("b", b)) + ((("out", out),) if out is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)} strides {t.stride()}")
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if a.shape != b.shape or (out is not None and out.shape != a.shape):
        raise ValueError(f"length mismatch: a {tuple(a.shape)}, b {tuple(b.shape)}, out {None if out is None else tuple(out.shape)}")
    if len({a.device, b.device} | ({out.device} if out is not None else set())) != 1:
        raise ValueError("a, b and out must be on the same device")
    out = torch.empty_like(a) if out is None else out
    n = a.numel()
    if n == 0:
        return out
    require_gpu()
    if version is None:
        aligned = all(t.data_ptr() % 16 == 0 for t in (a, b, out))
        version = VERSIONS[2] if aligned else VERSIONS[0]
    kernel = kernels.load("vector_add", version)
    per_thread = ELEMENTS_PER_THREAD[version]
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = max(1, -(-n // (BLOCK * per_thread)))
    if persistent:
        grid = min(grid, sms * _BLOCKS_PER_SM)
    launch(kernel, (grid,), (BLOCK,), (a.data_ptr(), b.data_ptr(), out.data_ptr(), np.int64(n)))
    return out


def main(argv=None) -> int:
    import os
    import tempfile

    from tileattn.bench import cold_start, measure, write_run
    from tileattn.bench.report import markdown_table, plot

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1 << 28)
    ap.add_argument("--sweep", default="16,20,24,28", help="log2 lengths for the bandwidth-vs-length plot")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--markdown", help="write the Markdown table here")
    ap.add_argument("--plot", help="write the bandwidth-vs-length PNG here")
    args = ap.parse_args(argv)
    require_gpu()
    a, b = torch.randn(args.n, device="cuda"), torch.randn(args.n, device="cuda")
    expected = a + b
    records = []

    # Cold start: a private, empty kernel cache, so the first call includes the NVRTC compile.
    os.environ["TILEATTN_CACHE"] = tempfile.mkdtemp(prefix="tileattn-cold-")
    cold_s = cold_start(lambda: vector_add(a, b))
    compiled = kernels.load("vector_add", VERSIONS[-1]).module
    records.append({"suite": "vector_add_cold", "impl": VERSIONS[-1], "first_call_s": cold_s,
                    "nvrtc_compile_s": compiled.compile_seconds, "from_cache": compiled.from_cache})
    print(f"cold start of {VERSIONS[-1]}: first call {cold_s * 1e3:.1f} ms, of which NVRTC compile "
          f"{compiled.compile_seconds * 1e3:.1f} ms (empty cache)")

    nbytes = 3 * 4 * args.n
    impls = {v: (lambda v=v: vector_add(a, b, version=v)) for v in VERSIONS}
    impls[VERSIONS[-1] + " persistent"] = lambda: vector_add(a, b, version=VERSIONS[-1], persistent=True)
    impls["torch a + b"] = lambda: a + b
    copy_dst = torch.empty_like(a)
    copy_t = measure(lambda: copy_dst.copy_(a), reps=30)
    copy_tbs = 2 * 4 * args.n / (copy_t.median_ms * 1e-3) / 1e12  # read + write
    print(f"vector add, n = {args.n}, {nbytes / 1e9:.2f} GB moved per call; device copy ceiling in this run "
          f"{copy_tbs:.3f} TB/s")
    print(f"{'version':<30}{'median ms':>11}{'min-max ms':>18}{'TB/s':>8}{'% copy':>8}  check")
    for name, fn in impls.items():
        got = fn()
        ok = torch.equal(got, expected)  # fp32 add is exact-to-rounding: same op, same result
        t = measure(fn, reps=30)
        tbs = nbytes / (t.median_ms * 1e-3) / 1e12
        records.append({"suite": "vector_add", "impl": name, "n": args.n, "tbps": tbs, "pct_of_copy": 100 * tbs / copy_tbs,
                        "copy_tbps": copy_tbs, "correct": ok, **t.as_dict()})
        print(f"{name:<30}{t.median_ms:>11.4f}{t.min_ms:>9.4f}-{t.max_ms:<8.4f}{tbs:>8.3f}{100 * tbs / copy_tbs:>8.1f}  "
              f"{'ok' if ok else 'WRONG'}")
        if not ok:
            raise SystemExit(f"{name} gave a wrong result")

    for log2n in (int(x) for x in args.sweep.split(",") if x):
        n = 1 << log2n
        if n > args.n:
            continue
        x, y = a[:n], b[:n]
        for name, fn in ((VERSIONS[-1], lambda: vector_add(x, y)), ("torch a + b", lambda: x + y)):  # noqa: B023
            t = measure(fn, reps=30, memory=False)
            records.append({"suite": "vector_add_sweep", "impl": name, "n": n,
                            "tbps": 12 * n / (t.median_ms * 1e-3) / 1e12, **t.as_dict()})
    if args.json:
        write_run(args.json, records)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(records, ["impl"], "n", "tbps", where={"suite": "vector_add"}) + "\n")
    if args.plot:
        plot(records, "n", "impl", "tbps", args.plot, where={"suite": "vector_add_sweep"},
             title="vector add fp32: useful bandwidth", ylabel="TB/s (12 bytes per element)")
    return 0


if __name__ == "__main__":
    from labs import run_lab

    raise SystemExit(run_lab(main, "vector_add"))
