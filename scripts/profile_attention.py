"""Nsight Compute profile of tileattn's attention kernels beside SDPA's, one launch of each.

    python3 scripts/profile_attention.py --out DIR [--seq 4096] [--head-dim 128] [--causal]
                                         [--backward] [--bwd-config NAME] [--set full]
    python3 scripts/profile_attention.py --out DIR --sm90-variants [--seq 4096] [--head-dim 128]
    python3 scripts/profile_attention.py --out DIR --softcap-op|--alibi-op|--dropout-op [--seq 8192] [--head-dim 64] [--causal]

Runs itself under `ncu` (child mode: `--child`), which profiles exactly one launch of each kernel
named by KERNELS (tileattn's main kernel, with --bwd-config a tuning candidate's instead of the
default, and FlashAttention-2's and cuDNN's kernels as PyTorch
launches them), or with --sm90-variants the Hopper forward four times (the plain kernel as
dispatched, the plain tiles on one CTA per tile as the variant kernels run, ALiBi, softcap 30; in
that order, non-causal), or with --softcap-op / --alibi-op / --dropout-op `tileattn.attention` without
autograd, plain then softcap 30 / ALiBi (slopes [H], geometric) / dropout 0.1, as the dispatcher runs
them (bf16 softcap: the fixed-max kernel where it applies; a warm-up pair first, not profiled), and
writes into DIR:
  profile.ncu-rep   the report (open with `ncu-ui` or `ncu -i`),
  details.txt       every section, as text,
  raw.csv           every collected metric,
  source_*.csv      per-SASS-instruction counters of each kernel (stall samples, executed count),
                    when this ncu can print them.
ncu flags are the ones seen working on a Python process on the H200 (2026-11-29; clock
control off: the kernels run at the clocks the benchmarks see).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Substrings of the kernel function names to profile, per direction.
# "attention_fwd_sm" / "attn_bwd_main_kernel|attention_bwd_sm90": the Hopper kernel on sm_90, the
# sm_80 one elsewhere (whichever the dispatcher runs).
KERNELS = {
    "backward": ("attn_bwd_main_kernel|attention_bwd_sm90", "flash_bwd_dq_dk_dv", "cudnn"),
    "forward": ("attention_fwd_sm", "flash_fwd_kernel", "cudnn"),
    "sm90_variants": ("attention_fwd_sm90",) * 4,
    "variant_op": ("attention_fwd_sm90",) * 2,
}


def sm90_variants(args) -> None:
    """One launch each of the Hopper forward: plain (dispatched config), plain at the variant
    kernels' config, ALiBi ([H] slopes), softcap 30."""
    import math

    import torch

    from tileattn.bench.variants import geometric_alibi_slopes
    from tileattn.kernels import attention_fwd_sm90 as af
    from tileattn.kernels.attention_fwd_sm80 import VariantArgs

    b, h, n, d = args.batch, args.heads, args.seq, args.head_dim
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)                                        # [B, H, N, d]
    lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)   # [B, H, N]
    slopes = geometric_alibi_slopes(h)  # [H]
    scale = 1 / math.sqrt(d)
    plans = [
        (af.ForwardPlan(q, k, v, out, lse, causal=False, scale=scale), ()),
        (af.ForwardPlan(q, k, v, out, lse, causal=False, scale=scale, config=af.VARIANT_DEFAULTS[d]), ()),
        (af.ForwardPlan(q, k, v, out, lse, causal=False, scale=scale, variants=VariantArgs(alibi_batch_stride=0)),
         (slopes.data_ptr(), 0, 0, 0)),
        (af.ForwardPlan(q, k, v, out, lse, causal=False, scale=scale, variants=VariantArgs(softcap=30.0)),
         (0, 0, 0, 0)),
    ]
    for plan, extra in plans:
        plan.launch(q, k, v, out, lse, *extra)
    torch.cuda.synchronize()


def variant_op(args) -> None:
    """tileattn.attention without autograd, plain then the variant (softcap 30, ALiBi with the
    geometric slopes [H], or dropout 0.1 with a fixed seed), twice (compile and warm up, then the
    pair ncu profiles)."""
    import torch

    import tileattn
    from tileattn.bench.variants import geometric_alibi_slopes

    b, h, n, d = args.batch, args.heads, args.seq, args.head_dim
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    variant = ({"softcap": 30.0} if args.softcap_op else
               {"dropout_p": 0.1, "seed": 1234, "offset": 0} if args.dropout_op else
               {"alibi_slopes": geometric_alibi_slopes(h)})
    with torch.no_grad():
        for _ in range(2):
            tileattn.attention(q, k, v, causal=args.causal)
            tileattn.attention(q, k, v, causal=args.causal, **variant)
    torch.cuda.synchronize()


def child(args) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tileattn

    dtype = torch.bfloat16
    b, h, n, d = args.batch, args.heads, args.seq, args.head_dim
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, h, n, d, device="cuda", dtype=dtype)
    out = tileattn.attention(q, k, v, causal=args.causal)
    torch.cuda.synchronize()
    if args.backward and args.bwd_config:
        from tileattn.kernels import attention_bwd_sm80

        by_name = {c.name: c for c in attention_bwd_sm80.tuning_candidates(d, args.causal)}
        if args.bwd_config not in by_name:
            raise SystemExit(f"unknown --bwd-config {args.bwd_config}; candidates: {sorted(by_name)}")
        out, lse = torch.ops.tileattn.attention_fwd(q.detach(), k.detach(), v.detach(), args.causal, d**-0.5, False)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        attention_bwd_sm80.launch_backward(q.detach(), k.detach(), v.detach(), out.detach(), lse, dout, *grads,
                                      causal=args.causal, scale=d**-0.5, deterministic=False,
                                      config=by_name[args.bwd_config])
    elif args.backward:
        torch.autograd.grad(out, (q, k, v), dout)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
            if args.backward:
                torch.autograd.grad(o, (q, k, v), dout)
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true")
    p.add_argument("--bwd-config", default="", help="profile this backward tuning candidate (BwdConfig.name)")
    p.add_argument("--set", default="full", help="ncu section set")
    p.add_argument("--sm90-variants", action="store_true", help="the Hopper forward: plain, ALiBi, softcap")
    p.add_argument("--softcap-op", action="store_true", help="tileattn.attention without autograd: plain, softcap 30")
    p.add_argument("--alibi-op", action="store_true", help="tileattn.attention without autograd: plain, ALiBi [H]")
    p.add_argument("--dropout-op", action="store_true", help="tileattn.attention without autograd: plain, dropout 0.1")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    variant_ops = args.softcap_op + args.alibi_op + args.dropout_op  # how many of the variant-op modes
    if args.child:
        (variant_op if variant_ops else sm90_variants if args.sm90_variants else child)(args)
        return
    if args.out is None:
        p.error("--out is required")
    if variant_ops > 1:
        p.error("--softcap-op, --alibi-op, --dropout-op: one variant per profile")
    ncu = shutil.which("ncu")
    if ncu is None:
        sys.exit("ncu (Nsight Compute) is not on PATH")
    args.out.mkdir(parents=True, exist_ok=True)
    rep = args.out / "profile"
    mode = ("variant_op" if variant_ops else "sm90_variants" if args.sm90_variants
            else "backward" if args.backward else "forward")
    names = KERNELS[mode]
    regex = "regex:" + "|".join(sorted(set(names)))
    child_cmd = [sys.executable, os.path.abspath(__file__), "--child"] + [
        a for a in sys.argv[1:] if not a.startswith("--out") and a != str(args.out)
    ]
    # --softcap-op / --alibi-op / --dropout-op: skip the warm-up pair
    window = ["--launch-skip", "2", "--launch-count", "2"] if mode == "variant_op" else ["--launch-count", str(len(names) + 2)]
    cmd = [ncu, "--clock-control", "none", "--set", args.set, "--kernel-name", regex, *window,
           "--import-source", "no", "-f", "-o", str(rep)] + child_cmd
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    report = str(rep) + ".ncu-rep"
    with open(args.out / "details.txt", "w") as f:
        subprocess.run([ncu, "-i", report, "--page", "details"], stdout=f, check=True)
    with open(args.out / "raw.csv", "w") as f:
        subprocess.run([ncu, "-i", report, "--page", "raw", "--csv"], stdout=f, check=True)
    for i, name in enumerate(names):
        label = re.sub(r"\W+", "_", name)  # a file name without the regex's "|"
        path = args.out / (f"source_{label}.csv" if len(set(names)) == len(names) else f"source_{label}_{i}.csv")
        select = ["--launch-skip", str(i), "--launch-count", "1"] if len(set(names)) < len(names) else []
        with open(path, "w") as f:
            r = subprocess.run([ncu, "-i", report, "--page", "source", "--csv", "--print-source", "sass",
                                "--kernel-name", f"regex:{name}", *select], stdout=f, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            print(f"no source page for {name} (ncu exit {r.returncode}); see {path}")


if __name__ == "__main__":
    main()
