"""Time the Hopper forward's softcap kernels (online and fixed row max) beside the plain kernel.

    PYTHONPATH=TREE/src python scripts/fwd_sm90_softcap_kernels.py --label NAME --head-dim 64 --rounds 3 > NAME.jsonl

For each (N, causal): B=4 H=32 bf16 inputs, the plain kernel's plan at its default tile, and the
softcap 30 plans the dispatcher can build (`attention_fwd_sm90.ForwardPlan` with the online max,
and with the fixed max where it applies; causal on the kCausal kernel where it exists, as
`dispatch.sm90_variant_forward_kind` picks). Every softcap plan's output is checked against the
float32 softcap attention computed by torch (relative error < 1e-2); then all are timed with the
harness (L2 flushed, `--reps` repetitions) in `--rounds` rounds whose order rotates. One JSON line per
(plan, round); `--summary FILE...` prints each tree's median TFLOP/s and the ratio to plain measured
in the same process. The tileattn imported is whichever PYTHONPATH names, so two source trees (the
kernel's code differing) compare in alternating processes of one machine session.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict

CAP = 30.0


def reference(q, k, v, causal: bool):
    """softmax(30 tanh(q k^T / (30 sqrt d))) v in float32 by tileattn.reference.attention, one batch entry
    at a time ([H, N, N] scores: ~8.6 GB at N = 8192, H = 32), [B, H, N, d]."""
    import torch

    from tileattn import reference as ref

    return torch.cat([ref.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal, softcap=CAP,
                                    compute_dtype=torch.float32)[0] for b in range(q.shape[0])])


def plans(q, k, v, out, lse, causal: bool, fixed_configs=()):
    """{name: no-argument launch}: plain, then softcap online / fixed max, then (non-causal) the
    fixed max at each of `fixed_configs` (Sm90Config; registered instantiations)."""
    from tileattn.dropout import UNBOUNDED
    from tileattn.kernels import attention_fwd_sm90 as af
    from tileattn.kernels import dispatch
    from tileattn.kernels.attention_fwd_sm80 import VariantArgs

    scale = 1 / math.sqrt(q.shape[-1])
    plain = af.ForwardPlan(q, k, v, out, lse, causal=causal, scale=scale)
    calls = {"plain": lambda: plain.launch(q, k, v, out, lse)}
    va = VariantArgs(window_left=UNBOUNDED, window_right=0 if causal else UNBOUNDED, softcap=CAP)
    for name, inference in (("softcap_online", False), ("softcap_fixed", True)):
        fixed_max, causal_kernel = dispatch.sm90_variant_forward_kind(q.dtype, q.shape[-1], k.shape[2], va,
                                                                      inference=inference)
        if inference and not fixed_max:
            continue
        plan = af.ForwardPlan(q, k, v, out, lse, causal=False, scale=scale, variants=va, fixed_max=fixed_max,
                              causal_kernel=causal_kernel)
        calls[name] = (lambda p: lambda: p.launch(q, k, v, out, lse, 0, 0, 0, 0))(plan)
    if "softcap_fixed" in calls and not causal:
        for cfg in fixed_configs:
            plan = af.ForwardPlan(q, k, v, out, lse, causal=False, scale=scale, variants=va, fixed_max=True, config=cfg)
            calls[f"softcap_fixed@{cfg}"] = (lambda p: lambda: p.launch(q, k, v, out, lse, 0, 0, 0, 0))(plan)
    return calls


def run(args) -> None:
    import torch

    from fwd_sm90_configs import parse_config  # run as a script, its directory is on sys.path

    import tileattn
    from tileattn.bench.attention import flops, round_order
    from tileattn.bench.harness import measure

    print("tileattn from", tileattn.__file__, file=sys.stderr)
    b, h = 4, 32
    for d in args.head_dim or [64]:
        for causal in (False, True):
            for n in args.seq or [2048, 8192]:
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                out = torch.empty_like(q)                                       # [B, H, N, d]
                lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)  # [B, H, N]
                calls = plans(q, k, v, out, lse, causal, [parse_config(c) for c in args.fixed_config])
                ref = reference(q, k, v, causal)
                for name, call in calls.items():
                    if name == "plain":
                        continue
                    out.fill_(float("nan"))
                    call()
                    err = float((out.float() - ref).norm() / ref.norm())
                    if not err < 1e-2:
                        raise SystemExit(f"{name} d={d} causal={causal} N={n}: relative error {err}")
                del ref
                for rnd in range(args.rounds):
                    for name, call in round_order(calls, rnd):
                        t = measure(call, reps=args.reps, memory=False)
                        print(json.dumps({"tree": args.label, "d": d, "causal": causal, "n": n, "round": rnd,
                                          "impl": name, "ms": t.median_ms,
                                          "tflops": flops(b, h, n, n, d, causal, False) / (t.median_ms * 1e-3) / 1e12}),
                              flush=True)


def summary(paths) -> None:
    """Median TFLOP/s per (tree, d, causal, N, impl) and the ratio to that tree's plain."""
    med: dict[tuple, list] = defaultdict(list)
    for path in paths:
        for line in open(path):
            r = json.loads(line)
            med[(r["tree"], r["d"], r["causal"], r["n"], r["impl"])].append(r["tflops"])
    impls = sorted({key[4] for key in med} - {"plain"})
    print("| tree | d | causal | N | plain | " + " | ".join(f"{i} (ratio)" for i in impls) + " |")
    print("|---" * (5 + len(impls)) + "|")
    for tree, d, causal, n in sorted({key[:4] for key in med}):
        plain = statistics.median(med[(tree, d, causal, n, "plain")])
        cells = []
        for impl in impls:
            vals = med.get((tree, d, causal, n, impl))
            cells.append("-" if not vals else f"{statistics.median(vals):.0f} ({statistics.median(vals) / plain:.3f})")
        print(f"| {tree} | {d} | {'yes' if causal else 'no'} | {n} | {plain:.0f} | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", help="the tree's name in the records")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seq", type=int, action="append", help="N (repeatable; default 2048 and 8192)")
    ap.add_argument("--head-dim", type=int, action="append", choices=(64, 128), help="default 64")
    ap.add_argument("--fixed-config", action="append", default=[], metavar="{128,192}xN/sK[/pp][/persistent]",
                    help="also time the non-causal fixed-max kernel at this registered config (repeatable)")
    ap.add_argument("--summary", nargs="+", metavar="FILE", help="summarize records instead of timing")
    args = ap.parse_args(argv)
    if args.summary:
        summary(args.summary)
    elif not args.label:
        ap.error("--label is required when timing")
    else:
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
