"""Time the Hopper forward at a few tile / grid configs beside SDPA cuDNN, interleaved in rounds.

    PYTHONPATH=src python scripts/fwd_sm90_configs.py --label new --rounds 2 --seq 2048 --seq 4096 > new.jsonl
    PYTHONPATH=OLD_TREE/src python scripts/fwd_sm90_configs.py --label old --rounds 2 ... > old.jsonl
    python scripts/fwd_sm90_configs.py --summary new.jsonl

One JSON line per (head dim, mask, N, round, config): B=4 H=32 bf16, TFLOP/s from the harness's
median. The tileattn imported is whichever PYTHONPATH names, so two trees (e.g. a `git archive` of
an older commit) can be compared in alternating processes of one machine session; cuDNN, timed in
each process, anchors them. Each config's output is checked against cuDNN's first (relative error
< 1e-2). Used for docs/attention_fwd_sm90.md, "O in its own buffer".
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import tileattn
from tileattn.bench.attention import flops, round_order
from tileattn.bench.harness import measure
from tileattn.kernels import attention_fwd_sm90 as af

C = af.Sm90Config
# The default tiles of d = 128 / 64: one CTA per tile, persistent, ping-pong + persistent (--config
# names others: they must be registered instantiations or tuning candidates).
CONFIGS = {128: (C(128, 2), C(128, 2, False, True), C(128, 2, True, True)),
           64: (C(128, 3), C(128, 3, False, True), C(128, 3, True, True)),
           256: (C(64, 2), C(64, 2, False, True), C(64, 2, True))}


def parse_config(text: str) -> af.Sm90Config:
    """'128x192/s2/pp/persistent' -> Sm90Config(192, 2, True, True), '192x128/s2' -> three consumer
    warpgroups (the inverse of its str)."""
    match = re.fullmatch(r"(128|192)x(\d+)/s(\d+)((?:/pp)?)((?:/persistent)?)", text)
    if match is None:
        raise SystemExit(f"--config {text!r}: expected {{128,192}}xN/sK[/pp][/persistent]")
    try:
        cfg = C(int(match[2]), int(match[3]), bool(match[4]), bool(match[5]), int(match[1]) // 64)
    except ValueError as err:
        raise SystemExit(f"--config {text!r}: {err}") from None
    if str(cfg) != text:
        raise SystemExit(f"--config {text!r}: write it as {cfg}")
    return cfg


def timed_call(q, k, v, out, lse, causal: bool, cfg: af.Sm90Config, variant: str | None):
    """A no-argument call launching the Hopper forward at `cfg`: launch_forward_sm90 for the plain
    kernel, a ForwardPlan with VariantArgs for a variant."""
    d = q.shape[-1]
    if variant is None:
        return lambda: af.launch_forward_sm90(q, k, v, out, lse, causal=causal, scale=1 / math.sqrt(d), config=cfg)
    from tileattn.dropout import UNBOUNDED
    from tileattn.kernels.attention_fwd_sm80 import VariantArgs

    slopes = torch.exp2(-8.0 * torch.arange(1, q.shape[1] + 1, device=q.device) / q.shape[1])  # [H] fp32
    va = VariantArgs(window_left=UNBOUNDED, window_right=0 if causal else UNBOUNDED,
                     softcap=30.0 if variant == "softcap" else 0.0,
                     alibi_batch_stride=0 if variant == "alibi" else None)
    plan = af.ForwardPlan(q, k, v, out, lse, causal=False, scale=1 / math.sqrt(d), config=cfg, variants=va)
    # (alibi pointer, dropout seed, offset, rng state pointer); the closure keeps the slopes alive
    return lambda: plan.launch(q, k, v, out, lse, slopes.data_ptr() if variant == "alibi" else 0, 0, 0, 0)


def summary(paths) -> None:
    """Per (head dim, mask, N): each config's median TFLOP/s over the rounds, its ratio to cuDNN's median in the
    same records and its range."""
    tf = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                tf[(r["d"], r["causal"], r["n"], r["impl"])].append(r["tflops"])
    for d, causal, n in sorted({key[:3] for key in tf}):
        cudnn = statistics.median(tf[(d, causal, n, "cudnn")]) if (d, causal, n, "cudnn") in tf else math.nan
        medians = {impl: (statistics.median(v), v) for (dd, cc, nn, impl), v in tf.items()
                   if (dd, cc, nn) == (d, causal, n) and impl != "cudnn"}
        cells = [f"{impl} {med:.0f} ({med / cudnn:.3f}; {min(v):.0f}-{max(v):.0f})" for impl, (med, v) in medians.items()]
        print(f"d={d} {'causal' if causal else 'nc'} N={n} cudnn {cudnn:.0f}: " + "; ".join(cells))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", help="the tree's name in the records (required unless --summary)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per implementation and round")
    ap.add_argument("--seq", type=int, action="append", help="N (repeatable; default 2048, 4096, 8192)")
    ap.add_argument("--head-dim", type=int, action="append", choices=sorted(CONFIGS))
    ap.add_argument("--grids-only", action="store_true", help="one CTA per tile and persistent only, no cuDNN")
    ap.add_argument("--variant", choices=("softcap", "alibi"),
                    help="time the variant kernel (softcap 30 / ALiBi slopes [H]; causal as the window's right edge 0)")
    ap.add_argument("--config", action="append", metavar="{128,192}xN/sK[/pp][/persistent]",
                    help="time these configs (as Sm90Config prints them) instead of the defaults' three; repeatable")
    ap.add_argument("--summary", nargs="+", metavar="JSONL", help="print the table of earlier records and exit")
    args = ap.parse_args(argv)
    if args.summary:
        summary(args.summary)
        return 0
    if args.label is None:
        ap.error("--label is required (unless --summary)")
    print("tileattn from", tileattn.__file__, file=sys.stderr)
    b, h = 4, 32
    for d in args.head_dim or (128, 64):
        configs = CONFIGS[d][:2] if args.grids_only else CONFIGS[d]
        if args.config:
            configs = tuple(parse_config(text) for text in args.config)
        for causal in (False, True):
            for n in args.seq or (2048, 4096, 8192):
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                out = torch.empty_like(q)                                   # [B, H, N, d]
                lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)  # [B, H, N]

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

                calls = {str(cfg): timed_call(q, k, v, out, lse, causal, cfg, args.variant) for cfg in configs}
                # Plain: every config against cuDNN; a variant (cuDNN has none): against the first config,
                # whose output the GPU tests check against the float64 reference.
                ref = cudnn().float() if args.variant is None else None
                for cfg, call in calls.items():
                    out.fill_(float("nan"))
                    call()
                    if ref is None:
                        ref = out.float().clone()
                    err = float((out.float() - ref).norm() / ref.norm())
                    if not err < 1e-2:
                        raise SystemExit(f"{cfg} d={d} causal={causal} N={n}: relative error {err} against the reference")
                if not args.grids_only and args.variant is None:
                    calls["cudnn"] = cudnn
                for rnd in range(args.rounds):
                    for name, call in round_order(calls, rnd):  # each first in turn (bench attention's docstring)
                        t = measure(call, reps=args.reps, memory=False)
                        print(json.dumps({"tree": args.label, "variant": args.variant, "d": d, "causal": causal,
                                          "n": n, "round": rnd,
                                          "impl": name, "ms": t.median_ms,
                                          "tflops": flops(b, h, n, n, d, causal, False) / (t.median_ms * 1e-3) / 1e12,
                                          # with TILEATTN_BENCH_CLOCKS=MS: the SM clock's median over the measurement
                                          "sm_mhz": (t.gpu_clocks or {}).get("sm_mhz", {}).get("median")}),
                              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
