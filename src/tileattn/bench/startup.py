"""`tileattn bench startup`: a fresh process, from `import tileattn` to the first forward+backward.

    tileattn bench startup [--runs 3] [--profile out.txt] [--json out.json]

Each run is a new Python process that records, on one clock: the start, `import torch`, the CUDA
context (torch.zeros on the GPU, synchronized), `import tileattn`, and the first forward+backward
result (B=1 H=8 N=256 d=128 bf16, causal, synchronized). Reported: the time beyond `import torch`
and context creation, with a warm kernel cache (the runs after a first that fills it) and with an
empty one (a fresh $TILEATTN_CACHE each run: NVRTC compiles the three to four instantiations the
call needs, and the compiled attention path starts building in the background). The warm cache is
filled by a first process that also waits for the compiled path's library (runtime.host_launch),
as any later process finds it. `--profile` writes a cProfile of the first call in a warm-cache
process (cumulative time, top 40 entries; Python 3.12's cProfile sees every thread): where the time
goes. Targets (issue #9): warm < 0.5 s, empty < 15 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from .harness import positive_int

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t_ctx = time.perf_counter()
import tileattn
t_import = time.perf_counter()
q, k, v = (torch.randn(1, 8, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
torch.cuda.synchronize()
t_inputs = time.perf_counter()
profile_path, fill = sys.argv[1], sys.argv[2] == "fill"
if profile_path:
    import cProfile, pstats, io
    prof = cProfile.Profile(); prof.enable()
out = tileattn.attention(q, k, v, causal=True)
out.sum().backward()
torch.cuda.synchronize()
t_first = time.perf_counter()
from tileattn.runtime import host_launch
if profile_path:
    prof.disable()
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
    open(profile_path, "w").write(s.getvalue())
state = host_launch.status()
if fill:  # the warm cache holds the compiled attention path too (built in the background, tens of seconds)
    host_launch.wait(600)
print(json.dumps({"import_torch_s": t_torch - t0, "cuda_context_s": t_ctx - t_torch,
                  "import_tileattn_s": t_import - t_ctx, "first_fwd_bwd_s": t_first - t_inputs,
                  "beyond_torch_and_context_s": (t_import - t_ctx) + (t_first - t_inputs),
                  "host_launch": state}))
"""


def _child(cache: str, profile: str = "", fill: bool = False) -> dict:
    env = dict(os.environ, TILEATTN_CACHE=cache)
    out = subprocess.run([sys.executable, "-c", CHILD, profile, "fill" if fill else ""], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"startup child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(runs: int, profile: str | None) -> list[dict]:
    records = []
    with tempfile.TemporaryDirectory() as warm_cache:
        _child(warm_cache, fill=True)  # fills the cache, the compiled attention path's library included
        for _ in range(runs):
            records.append({"suite": "startup", "cache": "warm", **_child(warm_cache)})
        if profile:
            _child(warm_cache, profile)
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as empty_cache:
            records.append({"suite": "startup", "cache": "empty", **_child(empty_cache)})
    return records


def table(records: list[dict]) -> str:
    lines = ["| kernel cache | import torch s | CUDA context s | import tileattn s | first fwd+bwd s | "
             "beyond torch + context s (median) | target |", "|---|---|---|---|---|---|---|"]
    for cache, target in (("warm", 0.5), ("empty", 15.0)):
        rows = [r for r in records if r["cache"] == cache]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_s")}
        lines.append(f"| {cache} | {med['import_torch_s']:.2f} | {med['cuda_context_s']:.2f} | "
                     f"{med['import_tileattn_s']:.3f} | {med['first_fwd_bwd_s']:.3f} | "
                     f"{med['beyond_torch_and_context_s']:.3f} | < {target:g} s: "
                     f"{'met' if med['beyond_torch_and_context_s'] < target else 'NOT met'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tileattn bench startup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=positive_int, default=3, help="processes per cache state")
    ap.add_argument("--profile", help="write a cProfile of a warm-cache first call here")
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args(argv)
    from ..runtime import require_gpu

    require_gpu()
    records = run(args.runs, args.profile)
    if args.json:
        from .records import write_run

        write_run(args.json, records)
    print(table(records))
    for cache in ("warm", "empty"):  # the compiled path builds in the background; its state when the result came
        states = sorted({r["host_launch"].split(" (")[0] for r in records if r["cache"] == cache})
        print(f"compiled attention path at the first result, {cache} cache: {', '.join(states)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
