"""Where a short forward's time goes: exactly 1, 2 and 3 rounds of one tile per SM, beside cuDNN.

    PYTHONPATH=src python scripts/fwd_sm90_rounds.py --head-dim 128 --config 128x128/s2/persistent > rounds.jsonl
    PYTHONPATH=src python scripts/fwd_sm90_rounds.py --summary rounds.jsonl

With H heads of Nq = 33 x 128 queries (132 tiles per 4 heads on a 132-SM H200; in general
SMs / 4 tiles per head) each round gives every SM one 128-row tile of Nk keys, non-causal, bf16,
B = 1. T(r) for r = 1, 2, 3 rounds then separates the launch's fixed cost from the per-tile one:
T(r) = F + r (o + c Nk), so F = 2 T(1) - T(2) and T(2) - T(1), T(3) - T(2) are one round each.
cuDNN runs the same tensors (its tiles may differ, so its F and per-round times are its own).
One JSON line per (head dim, Nk, rounds, implementation, round of timing); the harness's median
of --reps repetitions, L2 flushed. Used for docs/attention_fwd_sm90.md, "Where the short
sequences' time goes".
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys

KEYS = (512, 2048, 8192)


def summary(paths) -> None:
    """Per (head dim, implementation, Nk): the fastest timing round at 1 / 2 / 3 rounds, F, and the
    two one-round differences."""
    times = collections.defaultdict(list)
    for path in paths:
        for line in open(path):
            if line.startswith("{"):
                r = json.loads(line)
                times[(r["d"], r["impl"], r["nk"], r["rounds"])].append(r["ms"] * 1e3)
    print("| d | implementation | Nk | 1 round us | 2 rounds | 3 rounds | F = 2 T1 - T2 | T2 - T1 | T3 - T2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d, impl, nk in sorted({key[:3] for key in times}):
        t = [min(times.get((d, impl, nk, r), [math.nan])) for r in (1, 2, 3)]
        print(f"| {d} | {impl} | {nk} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | {2 * t[0] - t[1]:.1f} | "
              f"{t[1] - t[0]:.1f} | {t[2] - t[1]:.1f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, action="append", choices=(64, 128, 256))
    ap.add_argument("--config", action="append", metavar="128xN/sK[/pp][/persistent]",
                    help="Hopper tiles to time (128-row only: a round is one tile per SM); default: the head dim's "
                         "128-row DEFAULTS entry on its default grid")
    ap.add_argument("--seq-k", type=int, action="append", help=f"Nk (repeatable; default {KEYS})")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds (implementation order rotated)")
    ap.add_argument("--summary", nargs="+", metavar="JSONL", help="print the table of earlier records and exit")
    args = ap.parse_args(argv)
    if args.summary:
        summary(args.summary)
        return 0

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fwd_sm90_configs import parse_config, timed_call
    from tileattn.bench.attention import round_order
    from tileattn.bench.harness import measure
    from tileattn.kernels import attention_fwd_sm90 as af
    from tileattn.runtime import device_sm_count

    sms = device_sm_count(torch.cuda.current_device())
    if sms % 4:
        raise SystemExit(f"{sms} SMs: not a multiple of 4 heads per round")
    n_q = sms // 4 * af.BLOCK_M  # one 128-row tile per SM with 4 heads
    for d in args.head_dim or (128,):
        # default: the head dim's 128-row tile (DEFAULTS on its default grid; seqlen_q below every wide switch)
        configs = ([parse_config(c) for c in args.config] if args.config
                   else [af.default_config(d, False, seqlen_q=af.BLOCK_M)])
        if any(cfg.block_m != af.BLOCK_M for cfg in configs):
            raise SystemExit("--config: 128-row tiles only (a round is one tile per SM)")
        for n_k in args.seq_k or KEYS:
            for rounds in (1, 2, 3):
                h = 4 * rounds
                q = torch.randn(1, h, n_q, d, device="cuda", dtype=torch.bfloat16)   # [1, H, Nq, d]
                k, v = (torch.randn(1, h, n_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                out = torch.empty_like(q)
                lse = torch.empty(1, h, n_q, device="cuda", dtype=torch.float32)     # [1, H, Nq]

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

                calls = {str(cfg): timed_call(q, k, v, out, lse, False, cfg, None) for cfg in configs}
                ref = cudnn().float()
                for name, call in calls.items():
                    out.fill_(float("nan"))
                    call()
                    err = float((out.float() - ref).norm() / ref.norm())
                    if not err < 1e-2:
                        raise SystemExit(f"{name} d={d} Nk={n_k}: relative error {err} against cuDNN")
                calls["cudnn"] = cudnn
                for rnd in range(args.rounds):
                    for name, call in round_order(calls, rnd):
                        t = measure(call, reps=args.reps, memory=False)
                        print(json.dumps({"d": d, "nq": n_q, "nk": n_k, "h": h, "rounds": rounds, "round": rnd,
                                          "impl": name, "ms": t.median_ms, "q1_ms": t.q1_ms, "q3_ms": t.q3_ms}),
                              flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])  # fwd_sm90_configs beside this file
    raise SystemExit(main())
