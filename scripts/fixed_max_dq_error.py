"""What softcap's fixed row max costs the backward's dq, emulated on the CPU (no GPU needed).

    python3 scripts/fixed_max_dq_error.py [--seeds 20]

The Hopper forward's fixed max (docs/attention_variants.md, "Softcap with a fixed row max") takes
p = 2^(cap log2 e (t - 1)) against the online max's p = 2^(logit - row max): both round p to bf16 for
P V, but only the online max keeps a row's largest p exactly 1. The backward recomputes P in fp32
from the forward's lse and forms dS = P (dP - rowsum(dO O)) (1 - t^2), so an ulp in O shows up in dq
where dP and the row sum nearly cancel. This emulates the forward (fp32 scores, tanh, exp2, bf16 P,
the row sum l over the fp32 p or, `fixed_rsum`, over the bf16 ones; O rounded to bf16) and the
backward's dq in fp32 for one (batch, head), and prints the median / largest relative error of dq
against float64 autograd over `seeds` random inputs (d = 128, cap 20, inputs x2), per shape.
The emulation's arithmetic order is not the kernels': compare the modes, not single figures.
"""

from __future__ import annotations

import argparse
import math

import torch

LOG2E = 1.0 / math.log(2.0)
MODES = ("online", "fixed", "fixed_rsum")


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def dq_errors(nq: int, nk: int, window, seeds: int, d: int = 128, cap: float = 20.0) -> dict[str, list[float]]:
    """Relative dq error per mode and seed; window (left, right) bottom-right aligned, or None."""
    errors: dict[str, list[float]] = {m: [] for m in MODES}
    scale = d ** -0.5
    rows = torch.arange(nq)[:, None] + nk - nq
    cols = torch.arange(nk)[None, :]
    visible = (torch.ones(nq, nk, dtype=torch.bool) if window is None
               else (cols >= rows - window[0]) & (cols <= rows + window[1]))
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        q, k = (bf16(2.0 * torch.randn(n, d, generator=g, dtype=torch.float64)) for n in (nq, nk))
        v, dout = (bf16(torch.randn(n, d, generator=g, dtype=torch.float64)) for n in (nk, nq))
        q_ref = q.clone().requires_grad_()
        logits = (cap * torch.tanh(q_ref @ k.T * scale / cap)).masked_fill(~visible, float("-inf"))
        (torch.softmax(logits, -1) @ v).backward(dout)
        t = torch.tanh((q @ k.T).float() * (scale / cap))  # [Nq, Nk] fp32, as the kernels
        logit2 = ((cap * LOG2E) * t).masked_fill(~visible, float("-inf"))  # log2 units
        for mode in MODES:
            m = logit2.max(-1, keepdim=True).values if mode == "online" else torch.full((nq, 1), cap * LOG2E)
            p = torch.exp2(logit2 - m)
            l = (bf16(p) if mode == "fixed_rsum" else p).sum(-1, keepdim=True)
            out = bf16((bf16(p).double() @ v) / l.double()).float()
            prob = torch.exp2(logit2 - (m + torch.log2(l)))  # the backward's P^T, from lse
            ds = prob * (dout.float() @ v.float().T - (dout.float() * out).sum(-1, keepdim=True)) * (1 - t * t)
            dq = (ds @ k.float()) * scale
            errors[mode].append(float((dq.double() - q_ref.grad).norm() / q_ref.grad.norm().clamp_min(1e-300)))
    return errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    args = ap.parse_args()
    print("| Nq | Nk | window | " + " | ".join(f"{m} median / max" for m in MODES) + " |")
    print("|---|---|---|" + "---|" * len(MODES))
    for nq, nk, window in ((1, 1000, (48, 16)), (1, 1000, None), (64, 300, None), (128, 128, (1 << 30, 0))):
        errors = dq_errors(nq, nk, window, args.seeds)
        cells = [f"{sorted(e)[len(e) // 2]:.2e} / {max(e):.2e}" for e in errors.values()]
        print(f"| {nq} | {nk} | {window if window is None or window[0] < 1 << 30 else 'causal'} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
