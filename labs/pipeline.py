"""Lab 4: asynchronous pipelines. Rung 9 of the GEMM ladder with 1, 2 and 3 cp.async stages.

    PYTHONPATH=src:. python -m labs.pipeline [--quick] [--json out.json]

The kernel is `hgemm_cp_async<kBF16, kStages, kAligned>` in labs/csrc/gemm.cu; its header comment
holds the timeline (prologue issues tiles 0..S-2; iteration t waits for tile t, barriers, issues
tile t+S-1 into the buffer freed by that barrier, computes tile t). Block tile 128 x 128 x 32,
bf16 in, fp32 accumulate, 20 KB of shared memory per stage.

1. Validation (small M, N; every synchronization path): for S = 1, 2, 3 (and 4, 6) and K chosen so
   that the tile count T = ceil(K / 32) is 1 (K < 32: a single partial tile), 1 full tile, T < S-1
   (prologue issues tiles past the end: empty groups), T = S-1 (everything issued in the prologue),
   T = S, T >> S (each buffer reused many times), with and without a partial last tile, and the
   unaligned-K path (synchronous loads in the same loop). Outputs are NaN-poisoned; each case runs
   twice and the two results must be bitwise equal (a race shows up as a moving result).
2. Timing at M = N = 4096, K = 64, 256, 1024, 4096, 16384: 1, 2, 3 stages (4 and 6 for the
   "deeper pipeline" question), cuBLAS bf16 beside them.
"""

from __future__ import annotations

import argparse
import time

import torch

from labs import gemm as lab
from labs.kernels import gemm as reg
from tileattn.runtime import require_gpu

STAGES = (1, 2, 3)
EXTRA_STAGES = (4, 6)
BENCH_K = (64, 256, 1024, 4096, 16384)
VALIDATE_K = (1, 8, 24, 32, 40, 64, 72, 96, 104, 200, 1000, 1032)
VALIDATE_K_UNALIGNED = (7, 33, 999)


def _tc_inputs(M, N, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    bt = torch.randn(N, K, device="cuda", generator=g).bfloat16()
    return a, bt


def validate(stage_set, quick: bool) -> list[dict]:
    records = []
    shapes = ((130, 250),) if quick else ((130, 250), (256, 128), (1, 1))
    for M, N in shapes:
        for K in VALIDATE_K + VALIDATE_K_UNALIGNED:
            a, bt = _tc_inputs(M, N, K, seed=M * 131 + N * 7 + K)
            ref = a.double() @ bt.double().T
            for S in stage_set:
                if K % 8 and S != reg.DEFAULT_STAGES:
                    continue  # the unaligned variant is registered at the default depth only
                outs = []
                for _ in range(2):
                    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                    lab.hgemm(a, bt, 9, out, stages=S)
                    outs.append(out)
                torch.cuda.synchronize()
                err = lab.rel_err(outs[0], ref)
                stable = torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
                tiles = -(-K // 32)
                records.append({"suite": "pipeline-validate", "M": M, "N": N, "K": K, "stages": S, "tiles": tiles,
                                "aligned": K % 8 == 0, "rel_err": err, "bitwise_repeatable": stable,
                                "correct": err < 1e-2 and stable})
    return records


def bench(stage_set, ks, reps: int) -> list[dict]:
    from tileattn.bench import measure

    records = []
    M = N = 4096
    for K in ks:
        a, bt = _tc_inputs(M, N, K, seed=K)
        ref = a.double() @ bt.double().T
        flops = 2.0 * M * N * K
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        t = measure(lambda: torch.matmul(a, bt.T), warmup=2, reps=reps, max_seconds=1.0, memory=False)
        cublas = t.median_ms
        records.append({"suite": "pipeline", "M": M, "N": N, "K": K, "impl": "cuBLAS bf16", "stages": None,
                        "tflops": flops / (t.median_ms * 1e-3) / 1e12, **t.as_dict()})
        for S in stage_set:
            call = lab._tc_call(a, bt, 9, out, stages=S)
            call()
            facts = lab.kernel_facts(call)
            out.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            err = lab.rel_err(out, ref)
            t = measure(call, warmup=2, reps=reps, max_seconds=1.0, memory=False)
            records.append({"suite": "pipeline", "M": M, "N": N, "K": K, "impl": f"{S} stage{'s' if S > 1 else ''}",
                            "stages": S, "tflops": flops / (t.median_ms * 1e-3) / 1e12,
                            "pct_cublas": 100 * cublas / t.median_ms, "rel_err": err, "correct": err < 1e-2,
                            **facts, **t.as_dict()})
        del ref
    return records


def main(argv=None) -> int:
    from tileattn.bench import environment, write_run

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="K = 64, 1024 only; fewer validation shapes")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args(argv)
    require_gpu()
    start = time.perf_counter()
    stage_set = STAGES + EXTRA_STAGES
    val = validate(stage_set, args.quick)
    bad = [r for r in val if not r["correct"]]
    print(f"validation: {len(val)} cases (stages {stage_set}, K {VALIDATE_K + VALIDATE_K_UNALIGNED}), "
          f"{len(bad)} failed, {time.perf_counter() - start:.1f} s")
    for r in bad:
        print(f"  FAILED M={r['M']} N={r['N']} K={r['K']} stages={r['stages']} tiles={r['tiles']} "
              f"rel_err={r['rel_err']:.3g} repeatable={r['bitwise_repeatable']}")
    recs = bench(stage_set, (64, 1024) if args.quick else BENCH_K, args.reps)
    if args.json:
        env = environment()
        env["wall_seconds"] = time.perf_counter() - start
        write_run(args.json, val + recs, env)
    print("\nM = N = 4096, bf16, TFLOP/s (median); regs / blocks per SM from the compiler and occupancy API")
    impls = ["cuBLAS bf16"] + [f"{s} stage{'s' if s > 1 else ''}" for s in stage_set]
    print("| K | " + " | ".join(impls) + " | 3 vs 2 stages |")
    print("|---|" + "---|" * (len(impls) + 1))
    for K in sorted({r["K"] for r in recs}):
        row = {r["impl"]: r for r in recs if r["K"] == K}
        cells = []
        for i in impls:
            r = row.get(i)
            if r is None:
                cells.append("-")
            else:
                mark = "" if r.get("correct", True) else " WRONG"
                cells.append(f"{r['tflops']:.0f}{mark}")
        ratio = row["3 stages"]["median_ms"] / row["2 stages"]["median_ms"] if "3 stages" in row and "2 stages" in row else None
        print(f"| {K} | " + " | ".join(cells) + f" | {'-' if ratio is None else f'{1 / ratio:.3f}x'} |")
    occ = {r["stages"]: r for r in recs if r.get("stages")}
    print("\nstages: dynamic smem KB, blocks/SM: " + ", ".join(
        f"{s}: {occ[s]['dynamic_smem'] // 1024} KB, {occ[s]['blocks_per_sm']}" for s in sorted(occ)))
    wrong = bad + [r for r in recs if r.get("correct") is False]
    print(f"\n{len(wrong)} failures, {time.perf_counter() - start:.0f} s")
    return 1 if wrong else 0


if __name__ == "__main__":
    from labs import run_lab

    raise SystemExit(run_lab(main, "pipeline"))
