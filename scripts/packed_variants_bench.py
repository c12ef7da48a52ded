"""Window, softcap and ALiBi on the packed layouts: the Hopper packed variant kernels against the sm80
variant kernels they replace and the Hopper plain kernel, in one process, rotated rounds.

    PYTHONPATH=src python scripts/packed_variants_bench.py [--rounds 3] [--reps 20] [--backward] > records.jsonl

Workloads (bf16, forward only, no autograd, through the public ops):
- varlen: issue #10's batch (64 sequences of 100..4096 tokens, seeded), causal, H = Hkv = 32, d = 128,
  and Gemma 2's head dim (d = 256, H = 8, Hkv = 4) with softcap 50;
- paged: 512-query chunks after a 4096-key cached prefix (B = 8, H = 32, Hkv = 8, d = 128,
  block_size 16), causal.
--dropout: dropout 0.1 (seeded) instead of the other variants, varlen only, d = 64 / 128 / 256 (the
Hopper varlen dropout forward and, at d = 64 / 128, backward).
--backward: the varlen workloads forward+backward (autograd, dout random), TFLOP/s counting 3.5x the
forward's useful FLOPs (the backward does 2.5x its matrix products), as `tileattn bench varlen`.
Implementations per (workload, variant): `hopper_variant` (as dispatched: attention_fwd_sm90's packed
variant kernel and, with --backward, attention_bwd_sm90's varlen variant kernel where it has one),
`sm80_variant` (the sm80 varlen / paged variant kernels they replace, both passes: the dispatcher's
packed-variant tables emptied for the measurement), with --backward `sm80_backward` (the Hopper
forward, the sm80 varlen variant backward: the dispatch before the Hopper backward's table) and
`hopper_plain` (the same call without the variant: the causal Hopper kernel, for scale). TFLOP/s
count useful FLOPs, 4 d H per (query, key) pair the call's mask leaves visible (the window's pairs
for a window, so the plain causal call counts more). One JSON line per (workload, variant,
implementation, round) with the harness's median of --reps (L2 flushed), then a table of medians
over rounds on stderr.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys


def visible_pairs(lens_q, lens_k, left: int, right: int) -> int:
    """(query, key) pairs a window (left, right) (-1: unbounded) leaves visible, bottom-right aligned
    per sequence."""
    import numpy as np

    total = 0
    for nq, nk in zip(lens_q, lens_k):
        i = np.arange(nq, dtype=np.int64)
        pos = i + nk - nq
        lo = np.zeros_like(pos) if left < 0 else np.maximum(0, pos - left)
        hi = np.full_like(pos, nk - 1) if right < 0 else np.minimum(nk - 1, pos + right)
        total += int(np.maximum(0, hi - lo + 1).sum())
    return total


def sm80_variant_kernels(forward: bool = True):
    """Within: varlen / paged calls with variants run the sm80 kernels (the dispatcher's packed-variant
    tables emptied: api.dispatch_tables); forward=False: the backward only."""
    from tileattn.api import dispatch_tables
    from tileattn.kernels import dispatch

    tables = [dispatch.SM90_VARLEN_VARIANT_BACKWARD, dispatch.SM90_VARLEN_DROPOUT_BACKWARD]
    if forward:
        tables += [dispatch.SM90_VARLEN_VARIANT_FORWARD, dispatch.SM90_PAGED_VARIANT_PREFILL,
                   dispatch.SM90_VARLEN_DROPOUT_FORWARD]
    return dispatch_tables((table, set()) for table in tables)


VARIANTS = {  # name -> (options, window (left, right) for the pair count; causal everywhere)
    "softcap50": ({"softcap": 50.0}, (-1, 0)),
    "window1024": ({"window": (1023, 0)}, (1023, 0)),
    "alibi": ({"alibi": True}, (-1, 0)),
    "dropout0.1": ({"dropout_p": 0.1, "seed": 1234, "offset": 0}, (-1, 0)),  # varlen only (--dropout)
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--backward", action="store_true", help="varlen forward+backward instead of the forwards")
    ap.add_argument("--dropout", action="store_true",
                    help="only dropout 0.1 on the varlen workloads (the Hopper varlen dropout forward; with "
                         "--backward the sm80 varlen dropout backward after it)")
    args = ap.parse_args(argv)

    import torch

    import tileattn
    from tileattn.bench.harness import measure

    dev = "cuda"
    gen = torch.Generator(device="cpu").manual_seed(0)
    records = []

    def varlen_workload(d, heads, kv_heads, variants):
        lens = torch.randint(100, 4097, (64,), generator=gen).tolist()
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        total = sum(lens)
        grad = args.backward
        q = torch.randn(total, heads, d, device=dev, dtype=torch.bfloat16, requires_grad=grad)
        k = torch.randn(total, kv_heads, d, device=dev, dtype=torch.bfloat16, requires_grad=grad)
        v = torch.randn(total, kv_heads, d, device=dev, dtype=torch.bfloat16, requires_grad=grad)
        dout = torch.randn(total, heads, d, device=dev, dtype=torch.bfloat16)
        slopes = torch.rand(heads, device=dev) * 0.1

        def call(options):
            opts = {key: val for key, val in options.items() if key != "alibi"}
            if options.get("alibi"):
                opts["alibi_slopes"] = slopes

            def step():
                out = tileattn.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), True, **opts)
                if grad:
                    torch.autograd.grad(out, (q, k, v), dout)

            return step

        return f"varlen d={d} H={heads}/{kv_heads}", lens, lens, d * heads, call, variants

    def paged_workload(d, heads, kv_heads, block_size, variants):
        b, chunk, prefix = 8, 512, 4096
        nk = prefix + chunk
        pages = -(-nk // block_size)
        k_cache = torch.randn(b * pages, block_size, kv_heads, d, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(b * pages, device=dev, dtype=torch.int32).view(b, pages)
        q = torch.randn(b * chunk, heads, d, device=dev, dtype=torch.bfloat16)
        cu = torch.arange(0, b * chunk + 1, chunk, device=dev, dtype=torch.int32)
        seqlens = torch.full((b,), nk, device=dev, dtype=torch.int32)
        slopes = torch.rand(heads, device=dev) * 0.1

        def call(options):
            opts = {key: val for key, val in options.items() if key != "alibi"}
            if options.get("alibi"):
                opts["alibi_slopes"] = slopes
            return lambda: tileattn.attention_paged(q, k_cache, v_cache, table, cu, seqlens, chunk, nk, causal=True,
                                                    **opts)

        return (f"paged d={d} H={heads}/{kv_heads} bs={block_size} {chunk} after {prefix}", [chunk] * b, [nk] * b,
                d * heads, call, variants)

    names = ("dropout0.1",) if args.dropout else ("softcap50", "window1024", "alibi")
    workloads = [varlen_workload(128, 32, 32, names), varlen_workload(64, 32, 32, names)]
    if args.dropout:
        workloads.append(varlen_workload(256, 8, 4, names))
    elif not args.backward:
        workloads += [varlen_workload(256, 8, 4, ("softcap50", "window1024")),
                      paged_workload(128, 32, 8, 16, ("softcap50", "window1024", "alibi")),
                      paged_workload(64, 32, 8, 256, ("softcap50", "window1024")),
                      paged_workload(256, 8, 4, 16, ("softcap50", "window1024"))]
    passes = 3.5 if args.backward else 1.0
    split = args.backward
    impls = ("hopper_variant", "sm80_variant", "hopper_plain") + (("sm80_backward",) if split else ())
    contexts = {"hopper_variant": contextlib.nullcontext, "sm80_variant": sm80_variant_kernels,
                "hopper_plain": contextlib.nullcontext, "sm80_backward": lambda: sm80_variant_kernels(forward=False)}
    with torch.set_grad_enabled(args.backward):
        for rnd in range(args.rounds):
            for name, lens_q, lens_k, dh, call, variants in workloads:
                for variant in variants:
                    options, (left, right) = VARIANTS[variant]
                    flops = {"hopper_plain": passes * 4 * dh * visible_pairs(lens_q, lens_k, -1, 0)}
                    flops["hopper_variant"] = flops["sm80_variant"] = flops["sm80_backward"] = (
                        passes * 4 * dh * visible_pairs(lens_q, lens_k, left, right))
                    order = impls[rnd % len(impls):] + impls[:rnd % len(impls)]
                    for impl in order:
                        fn = call({} if impl == "hopper_plain" else options)
                        with contexts[impl]():
                            t = measure(fn, reps=args.reps)
                        rec = {"workload": name, "variant": variant, "impl": impl, "round": rnd, "ms": t.median_ms,
                               "tflops": flops[impl] / t.median_ms / 1e9, "backward": args.backward}
                        records.append(rec)
                        print(json.dumps(rec), flush=True)
    med = collections.defaultdict(list)
    for r in records:
        med[(r["workload"], r["variant"], r["impl"])].append(r["tflops"])
    extra = " | Hopper forward, sm80 backward | hopper / that" if split else ""
    print(f"| workload | variant | hopper variant | sm80 variant | hopper plain (causal) | hopper / sm80 | "
          f"hopper variant / plain{extra} |", file=sys.stderr)
    print("|---" * (9 if split else 7) + "|", file=sys.stderr)
    for name, variant in dict.fromkeys((r["workload"], r["variant"]) for r in records):
        t = {impl: statistics.median(med[(name, variant, impl)]) for impl in impls}
        cols = f" | {t['sm80_backward']:.0f} | {t['hopper_variant'] / t['sm80_backward']:.2f}" if split else ""
        print(f"| {name} | {variant} | {t['hopper_variant']:.0f} | {t['sm80_variant']:.0f} | {t['hopper_plain']:.0f} | "
              f"{t['hopper_variant'] / t['sm80_variant']:.2f} | {t['hopper_variant'] / t['hopper_plain']:.2f}{cols} |",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
