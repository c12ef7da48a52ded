"""`tileattn bench variants`: the attention variants (issue #15) against the plain kernels and peers.

    tileattn bench variants [--suite window|overhead|all] [--head-dim 128] [--dtype bf16] [--reps N]
                            [--rounds R] [--variant NAME ...] [--forward-only] [--quick] [--hopper-forced]
                            [--json PATH] [--markdown PATH]

window: a sliding window of 4096 keys (causal, window=(4095, -1)) at N = 32768, B=1, H=32, against
    the work it does as dense attention: non-causal N = 4096 with 8x the batch (8 * 4096^2 query-key
    pairs, the window's 32768 * 4096 minus the first 4096 rows' triangle), through the same-family
    sm80 plain kernel and through tileattn.attention as dispatched (target: window time <= 1.2x
    dense); peers: FlexAttention with the sliding-window block mask under torch.compile (PyTorch's
    SDPA has no window argument) and SDPA flash with the full causal mask (no window: more work).
overhead: softcap (30), ALiBi ([H] slopes), dropout (p = 0.1), and the variant kernel with no
    variant on, against the plain kernels, every row as the dispatcher picks its plans, B=4 H=32,
    N = 2048 and 8192, causal and not, forward and forward+backward (targets: softcap and ALiBi within
    10% of the plain kernel's TFLOP/s, dropout within 15%). Both sides are timed as launch plans (no
    host overhead), in --rounds rounds (default 3) whose order rotates; the table shows each
    case's median. --hopper-forced: the Hopper kernels that wait for their device run (the variant
    backward, ...) switched on, as they will be dispatched once measured.
Throughput counts visible (query, key) pairs: 4 d H per pair forward, 3.5x that forward+backward.
Timing: tileattn.bench.harness.measure (CUDA events, L2 flushed before each repetition).
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from ..api import SUPPORTED_HEAD_DIMS, hopper_kernels_forced
from .harness import measure, positive_int
from .records import save_run
from .report import environment_line, fmt_number, median_rounds

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _timed(fn, flops: float, reps: int) -> dict:
    t = measure(fn, warmup=2, reps=reps, max_seconds=5.0, memory=False)
    return {"status": "ok", "ms": t.median_ms, "tflops": flops / (t.median_ms * 1e-3) / 1e12, **t.as_dict()}


def window_pairs(n: int, left: int) -> int:
    """Visible pairs of a causal sliding window of left + 1 keys over n tokens."""
    w = left + 1
    full = max(0, n - w) * w
    head = min(n, w)
    return full + head * (head + 1) // 2


class _Plans:
    """Forward and backward launch plans of one problem, plain or with variants, as the dispatcher
    picks them (on an H200: the Hopper forward, plain or with window/softcap/ALiBi; the variant
    backward of the family dispatch.variant_backward_plan picks: sm80 until the Hopper one is in its
    table, or under --hopper-forced). Forward-only rows time the forward a call without autograd
    runs (fwd_inference: softcap's fixed max where it applies), forward+backward rows the one a
    backward follows."""

    def __init__(self, q, k, v, dout, *, causal: bool, variants=None, extra=(0, 0, 0, 0)):
        from ..kernels import dispatch

        self.t = (q, k, v, dout)
        self.out, self.lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        self.dq, self.dk, self.dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        scale = q.shape[-1] ** -0.5
        self.extra = extra if variants is not None else ()
        if variants is None:
            self.fwd = dispatch.attention_forward_plan(q, k, v, self.out, self.lse, causal=causal, scale=scale)
            self.bwd = dispatch.attention_backward_plan(q, k, v, self.out, self.lse, dout, self.dq, self.dk, self.dv,
                                                        causal=causal, scale=scale, deterministic=False)
            self.fwd_inference = self.fwd
        else:
            self.fwd = dispatch.variant_forward_plan(q, k, v, self.out, self.lse, scale=scale, variants=variants)
            self.fwd_inference = dispatch.variant_forward_plan(q, k, v, self.out, self.lse, scale=scale,
                                                               variants=variants, inference=True)
            self.bwd = dispatch.variant_backward_plan(q, k, v, self.out, self.lse, dout, self.dq, self.dk, self.dv,
                                                      scale=scale, deterministic=False, variants=variants)

    def forward(self):
        q, k, v, _ = self.t
        self.fwd_inference.launch(q, k, v, self.out, self.lse, *self.extra)

    def forward_backward(self):
        q, k, v, dout = self.t
        self.fwd.launch(q, k, v, self.out, self.lse, *self.extra)
        self.bwd.launch(q, k, v, self.out, self.lse, dout, self.dq, self.dk, self.dv, *self.extra)


def geometric_alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's standard slopes 2^(-8 (i + 1) / H), i < H, fp32 [H] on the current CUDA device (the
    slopes every variant benchmark and profile times). ValueError for heads < 1."""
    if heads < 1:
        raise ValueError(f"geometric_alibi_slopes: heads must be >= 1, got {heads}")
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device="cuda")


def _rnd(gen, dtype, *shape):
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


def run_window(head_dim, dtype, reps, quick) -> list[dict]:
    n, left, heads = (8192, 1023, 8) if quick else (32768, 4095, 32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = {"suite": "window", "n": n, "window": left + 1, "h": heads, "d": head_dim,
            "dtype": str(dtype).removeprefix("torch.")}
    q, k, v, dout = (_rnd(gen, dtype, 1, heads, n, head_dim) for _ in range(4))
    work = 4.0 * head_dim * heads * window_pairs(n, left)
    records = []
    from ..kernels.attention_fwd_sm80 import VariantArgs

    plans = _Plans(q, k, v, dout, causal=False, variants=VariantArgs(window_left=left, window_right=0))
    records.append(dict(base, impl="tileattn_window", mode="fwd", **_timed(plans.forward, work, reps)))
    records.append(dict(base, impl="tileattn_window", mode="fwd+bwd",
                        **_timed(plans.forward_backward, 3.5 * work, reps)))
    ref = plans.out.clone()
    del plans

    records += _dense_records(base, left + 1, n // (left + 1), heads, head_dim, dtype, reps, gen)
    torch.cuda.empty_cache()

    # FlexAttention with a sliding-window block mask, compiled.
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def sliding(b, h, qi, kj):
            return (qi >= kj) & (qi - kj <= left)

        mask = create_block_mask(sliding, None, None, n, n, device="cuda")
        flex = torch.compile(flex_attention)
        with torch.no_grad():
            out = flex(q, k, v, block_mask=mask)
            err = float((out.double() - ref.double()).norm() / ref.double().norm())
            records.append(dict(base, impl="flex_sliding_compiled", mode="fwd", rel_err_vs_tileattn=err,
                                **_timed(lambda: flex(q, k, v, block_mask=mask), work, reps)))
        grads = tuple(t.detach().requires_grad_() for t in (q, k, v))

        def flex_fb():
            return torch.autograd.grad(flex(*grads, block_mask=mask), grads, dout)

        records.append(dict(base, impl="flex_sliding_compiled", mode="fwd+bwd",
                            **_timed(flex_fb, 3.5 * work, reps)))
    except Exception as exc:  # no FlexAttention / no compiler toolchain on this machine
        records.append(dict(base, impl="flex_sliding_compiled", mode="fwd", status=f"error: {str(exc)[:100]}"))
    torch.cuda.empty_cache()

    # SDPA flash, full causal (no window: 2 * n / window times the pairs; timed as its own work).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    causal_work = 4.0 * head_dim * heads * n * (n + 1) / 2
    try:
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            records.append(dict(base, impl="sdpa_flash_full_causal", mode="fwd", **_timed(
                lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), causal_work,
                reps)))
    except RuntimeError as exc:
        records.append(dict(base, impl="sdpa_flash_full_causal", mode="fwd", status=f"error: {str(exc)[:100]}"))
    return records


def _dense_records(base, dense_n, dense_b, heads, head_dim, dtype, reps, gen) -> list[dict]:
    """The window's work as dense attention: non-causal N = window, batch n / window; through the
    sm80 plain kernel (like for like) and tileattn.attention as dispatched (forward)."""
    import tileattn

    q, k, v, dout = (_rnd(gen, dtype, dense_b, heads, dense_n, head_dim) for _ in range(4))
    work = 4.0 * head_dim * heads * dense_b * dense_n * dense_n
    base = dict(base, dense_b=dense_b, dense_n=dense_n)
    plain = _Plans(q, k, v, dout, causal=False)
    records = [dict(base, impl="dense_plain", mode="fwd", **_timed(plain.forward, work, reps)),
               dict(base, impl="dense_plain", mode="fwd+bwd", **_timed(plain.forward_backward, 3.5 * work, reps))]
    with torch.no_grad():
        records.append(dict(base, impl="dense_dispatched", mode="fwd",
                            **_timed(lambda: tileattn.attention(q, k, v), work, reps)))
    return records


OVERHEAD_VARIANTS = ("variant_kernel_none", "softcap", "alibi", "dropout")


def run_overhead(head_dim, dtype, reps, quick, rounds=3, timed=OVERHEAD_VARIANTS,
                 backward=True) -> list[dict]:
    """Records of suite overhead: per (N, mask) the plain plans and each variant's, timed in
    `rounds` rounds whose order rotates (bench.attention.round_order), one record per case, mode and
    round (key "round"); render reports the medians. Under the H200's power cap the kernel timed
    first after a pause, or the one doing less work per joule, reads a different clock (the variant
    kernel with nothing on, the plain kernel's own plan, read 0.93-1.01 of plain when every row was
    timed once in a fixed order with plain first: docs/attention_variants.md). `timed`: the
    cases timed beside plain; backward=False: forward only."""
    from ..kernels.attention_fwd_sm80 import UNBOUNDED, VariantArgs
    from .attention import round_order

    batch, heads = (2, 8) if quick else (4, 32)
    records = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    slopes = geometric_alibi_slopes(heads)
    for n in ((1024,) if quick else (2048, 8192)):
        q, k, v, dout = (_rnd(gen, dtype, batch, heads, n, head_dim) for _ in range(4))
        for causal in (False, True):
            work = 4.0 * head_dim * heads * batch * (n * (n + 1) / 2 if causal else n * n)
            right = 0 if causal else UNBOUNDED
            cases = {
                "plain": None,
                "variant_kernel_none": (VariantArgs(window_right=right), (0, 0, 0, 0)),
                "softcap": (VariantArgs(window_right=right, softcap=30.0), (0, 0, 0, 0)),
                "alibi": (VariantArgs(window_right=right, alibi_batch_stride=0), (slopes.data_ptr(), 0, 0, 0)),
                "dropout": (VariantArgs(window_right=right, dropout_p=0.1), (0, 1234, 0, 0)),
            }
            base = {"suite": "overhead", "b": batch, "h": heads, "n": n, "d": head_dim, "causal": causal,
                    "dtype": str(dtype).removeprefix("torch.")}
            cases = {name: spec for name, spec in cases.items() if name == "plain" or name in timed}
            plans = {}
            for name, spec in cases.items():
                variants, extra = spec if spec is not None else (None, (0, 0, 0, 0))
                plans[name] = _Plans(q, k, v, dout, causal=causal, variants=variants, extra=extra)
            for rnd in range(rounds):
                for name, plan in round_order(plans, rnd):
                    records.append(dict(base, impl=name, mode="fwd", round=rnd, **_timed(plan.forward, work, reps)))
                    if backward:
                        records.append(dict(base, impl=name, mode="fwd+bwd", round=rnd,
                                            **_timed(plan.forward_backward, 3.5 * work, reps)))
            del plans
        del q, k, v, dout
        torch.cuda.empty_cache()
    return records


def render(records: list[dict]) -> str:
    lines = []
    window = [r for r in records if r["suite"] == "window"]
    if window:
        r0 = window[0]
        lines += [f"### sliding window {r0['window']} at N={r0['n']}, H={r0['h']}, d={r0['d']}, {r0['dtype']}: "
                  "ms (TFLOP/s of visible pairs)", "", "| impl | fwd | fwd+bwd |", "|---|---|---|"]
        table: dict[str, dict[str, dict]] = {}
        for r in window:
            table.setdefault(r["impl"], {})[r["mode"]] = r
        for impl, passes in table.items():
            lines.append(f"| {impl} | {_cell(passes.get('fwd'))} | {_cell(passes.get('fwd+bwd'))} |")
        for mode in ("fwd", "fwd+bwd"):
            mine = table.get("tileattn_window", {}).get(mode, {}).get("ms")
            dense = table.get("dense_plain", {}).get(mode, {}).get("ms")
            if mine and dense:
                lines.append(f"\n{mode}: window / dense plain (same pairs) time {mine / dense:.3f} (target <= 1.2)")
    over = median_rounds([r for r in records if r["suite"] == "overhead"])  # each case's median round
    if over:
        lines += ["", "### variants against the plain kernel (dispatched): TFLOP/s, median of the rotated rounds (ratio to "
                  "plain; targets softcap/alibi >= 0.9, dropout >= 0.85)", "", "| N | causal | mode | plain | variant kernel, none | softcap | "
                  "alibi | dropout |", "|---|---|---|---|---|---|---|---|"]
        keys = sorted({(r["n"], r["causal"], r["mode"]) for r in over})
        for n, causal, mode in keys:
            row = {r["impl"]: r for r in over if (r["n"], r["causal"], r["mode"]) == (n, causal, mode)}
            plain = row.get("plain", {}).get("tflops")
            cells = []
            for impl in ("plain", "variant_kernel_none", "softcap", "alibi", "dropout"):
                t = row.get(impl, {}).get("tflops")
                ratio = f" ({t / plain:.3f})" if t and plain and impl != "plain" else ""
                cells.append(f"{fmt_number(t)}{ratio}")
            lines.append(f"| {n} | {causal} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(r):
    if r is None:
        return "-"
    if r.get("status") != "ok":
        return r.get("status", "-")
    return f"{fmt_number(r['ms'])} ({fmt_number(r['tflops'])})"


def main(argv=None) -> int:
    from ..runtime import require_gpu
    from .env import environment

    ap = argparse.ArgumentParser(prog="tileattn bench variants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=("window", "overhead", "all"), default="all")
    ap.add_argument("--head-dim", type=int, default=128, choices=SUPPORTED_HEAD_DIMS)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--reps", type=positive_int, default=10)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="overhead suite: timing rounds, the cases' order rotated (median reported)")
    ap.add_argument("--variant", action="append", choices=OVERHEAD_VARIANTS, dest="variants",
                    help="overhead suite: time only these variants beside plain (repeatable; default all)")
    ap.add_argument("--forward-only", action="store_true", help="overhead suite: no forward+backward rows")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--markdown", help="write the tables here")
    ap.add_argument("--hopper-forced", action="store_true",
                    help="with the Hopper kernels not yet in the dispatcher's tables switched on "
                         "(tileattn.api.hopper_kernels_forced; records carry hopper_forced)")
    args = ap.parse_args(argv)
    require_gpu()
    env = environment()
    env["hopper_forced"] = args.hopper_forced
    print(environment_line(env) + ("; Hopper kernels forced on" if args.hopper_forced else ""))
    dtype = DTYPES[args.dtype]
    records = []
    with hopper_kernels_forced() if args.hopper_forced else contextlib.nullcontext():
        if args.suite in ("window", "all"):
            records += run_window(args.head_dim, dtype, args.reps, args.quick)
        if args.suite in ("overhead", "all"):
            records += run_overhead(args.head_dim, dtype, args.reps, args.quick, args.rounds,
                                    tuple(args.variants or OVERHEAD_VARIANTS), not args.forward_only)
    for r in records:
        r["hopper_forced"] = args.hopper_forced
    text = render(records)
    save_run(records, env, text, args.json, args.markdown)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
