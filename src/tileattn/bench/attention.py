"""`tileattn bench attention`: the seed table, tileattn beside every peer in one process.

    tileattn bench attention [--dtype bf16|fp16] [--head-dim 128] [--quick] [--json out.json]
                             [--markdown out.md] [--plot out.png] [--tune] [--demo]

Workload: B=4, H=32, d=128, N = 1024 ... 32768, forward and backward, causal and not.
Peers: PyTorch naive (matmul, softmax in fp32, matmul) until it runs out of memory, and each SDPA
backend (flash = FlashAttention-2, cudnn, efficient). FLOPs: forward 4*B*H*N^2*d, halved when
causal; backward 2.5x forward (the convention of every attention benchmark). Backward is timed
alone: the forward runs once outside the timed region and torch.autograd.grad replays the graph.
Peak extra memory: the allocator's peak during one call above what was allocated before it.
`--rounds R` times every point R times, the implementations interleaved within each round and the
order rotated from round to round (A B C, B C A, C A B, ...), and reports per implementation the
median of its R round medians (the lower middle one for even R): on the H200 the power controller
moves a single ~0.1 s measurement by up to ~5-10 % (docs/BENCHMARKS.md, 2026-12-02), and
interleaving gives every implementation the same share of those states. The rotation matters at
short points, where the first implementation timed after a new point's inputs are made read
faster than in its other rounds (cuDNN, always first before the rotation, 14-21 % above its other
round at N = 2048, d = 128 and 256, on 2026-12-03, while tileattn's rounds mostly agreed within 1 %;
a clock still high after the pause is the likely cause, not measured): with the rotation every
implementation gets that slot once in len(impls) rounds. The records keep each round (field `round`).
`--tune` times every registered tile configuration of the tileattn kernels instead.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

import torch

from ..api import SUPPORTED_HEAD_DIMS
from .harness import host_overhead_us, measure, positive_int
from .records import save_run, write_run
from .report import environment_line, markdown_table, median_rounds, plot

SEQ_LENS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_SEQ_LENS = (1024, 4096, 16384)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def flops(batch: int, heads: int, n_q: int, n_k: int, d: int, causal: bool, backward: bool) -> float:
    """4 * B * H * d per visible (query, key) pair, x2.5 for the backward. Causal (bottom-right
    aligned, as tileattn's mask) counts the pairs below the diagonal in full and the diagonal's
    half: m (Nk - m) + m^2 / 2 pairs with m = min(Nq, Nk), i.e. N^2 / 2 at Nq = Nk (the halving
    convention) and the exact count minus m / 2 otherwise. Halving Nq * Nk instead, as before,
    read 0.53x the visible pairs at Nq = 512, Nk = 4608 and 2.7x at Nq = 3 Nk."""
    if causal:
        m = min(n_q, n_k)
        pairs = m * (n_k - m) + m * m / 2
    else:
        pairs = n_q * n_k
    f = 4.0 * batch * heads * pairs * d
    return f * (2.5 if backward else 1.0)


def naive_attention(q, k, v, causal: bool):
    """The unfused baseline: scores materialized as [B, H, N, N] in fp32."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale  # [B, H, Nq, Nk] fp32
    if causal:
        n_q, n_k = scores.shape[-2:]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def implementations() -> dict[str, Callable]:
    from torch.nn.attention import SDPBackend

    import tileattn

    impls = {
        "naive": naive_attention,
        "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "tileattn": lambda q, k, v, causal: tileattn.attention(q, k, v, causal=causal),
        "tileattn_sm80": _forced_forward("attention_fwd_sm80", "launch_forward"),
    }
    from tileattn.runtime import device_arch

    if device_arch(torch.cuda.current_device()) == "sm_90a":
        impls["tileattn_sm90"] = _forced_forward("attention_fwd_sm90", "launch_forward_sm90")
    return impls


# Every name implementations() may return (--impl's choices): tileattn_sm90 only on sm_90a.
IMPL_NAMES = ("naive", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "tileattn", "tileattn_sm80", "tileattn_sm90")
# Columns that run one forward kernel family whatever the dispatcher would pick (forward only):
# the family the dispatcher does not choose stays visible beside the one it does.
FORCED = ("tileattn_sm80", "tileattn_sm90")


def _forced_forward(module: str, function: str):
    def run(q, k, v, causal):
        import importlib

        launch = getattr(importlib.import_module(f"tileattn.kernels.{module}"), function)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        launch(q, k, v, out, lse, causal=causal, scale=1.0 / math.sqrt(q.shape[-1]))
        return out

    return run


def _inputs(b, h, n, d, dtype, grad: bool):
    return [torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(3)]


def bench_case(impl: str, fn, *, b, h, n, d, dtype, causal, backward, reps) -> dict:
    rec = {"suite": "attention", "impl": impl, "pass": "bwd" if backward else "fwd", "b": b, "h": h, "n": n,
           "d": d, "dtype": str(dtype).removeprefix("torch."), "causal": causal}
    try:
        q, k, v = _inputs(b, h, n, d, dtype, backward)
        if backward:
            out = fn(q, k, v, causal)
            dout = torch.randn_like(out)
            call = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
        else:
            call = lambda: fn(q, k, v, causal)  # noqa: E731
        with torch.no_grad() if not backward else torch.enable_grad():
            t = measure(call, warmup=2, reps=reps, max_seconds=3.0)
    except torch.OutOfMemoryError:
        rec.update(status="out of memory")
        return rec
    except RuntimeError as exc:  # e.g. an SDPA backend that refuses this shape
        rec.update(status=f"error: {str(exc).splitlines()[0][:120]}")
        return rec
    finally:
        torch.cuda.empty_cache()
    rec.update(status="ok", tflops=flops(b, h, n, n, d, causal, backward) / (t.median_ms * 1e-3) / 1e12,
               peak_extra_mib=t.peak_extra_bytes / 2**20, **t.as_dict())
    return rec


def host_overhead_records(q, k, v) -> list[dict]:
    """Host microseconds per forward call (harness.host_overhead_us) of SDPA flash and tileattn on
    (q, k, v), non-causal. SDPA's backend is chosen once, outside the timed loop, as in `tileattn
    bench overhead`: entering and leaving sdpa_kernel costs ~7.5 us per call on a CPU of this
    project's (torch 2.13), host time that is the benchmark's, not SDPA's (the timed column
    `sdpa_flash` enters it around every call; that is hidden behind the device there)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tileattn

    F = torch.nn.functional
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa = host_overhead_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=False))
    ours = host_overhead_us(lambda: tileattn.attention(q, k, v, causal=False))
    return [{"suite": "host_overhead", "impl": "sdpa_flash", "host_us_per_call": sdpa},
            {"suite": "host_overhead", "impl": "tileattn", "host_us_per_call": ours}]


def round_order(impls: dict, rnd: int) -> list:
    """The (name, fn) pairs of `impls` in round `rnd`'s order: rotated left by rnd, so that over
    len(impls) rounds each implementation is timed first at a point once."""
    items = list(impls.items())
    shift = rnd % len(items) if items else 0
    return items[shift:] + items[:shift]


def correctness_check(dtype) -> list[str]:
    """tileattn against the float64 reference on a few irregular shapes before anything is timed."""
    import tileattn
    from tileattn import reference

    lines = []
    for (b, h, hkv, nq, nk, d, causal) in ((2, 8, 2, 129, 1000, 128, True), (1, 4, 4, 1000, 1000, 64, False),
                                             (1, 8, 1, 33, 4097, 128, False)):
        q = torch.randn(b, h, nq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype)
        out = tileattn.attention(q, k, v, causal=causal)
        ref, _ = reference.attention(q, k, v, causal=causal, compute_dtype=torch.float64)
        err = float((out.double() - ref).norm() / ref.norm())
        tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
        lines.append(f"check B={b} H={h} Hkv={hkv} Nq={nq} Nk={nk} d={d} causal={causal}: rel. error {err:.2e} "
                     f"({'ok' if err <= tol else 'FAIL'}, tol {tol:g})")
        if not err <= tol:
            raise SystemExit("\n".join(lines) + "\ntileattn disagrees with the reference: not benchmarking")
    return lines


def _backward_error(cfg, small, out, lse, dout, causal: bool, scale: float, grads_ref) -> float:
    """Largest relative error of one backward config's dq, dk, dv against float64 autograd."""
    from tileattn.kernels import attention_bwd_sm80

    grads = [torch.full_like(t, float("nan")) for t in small]
    attention_bwd_sm80.launch_backward(*small, out, lse, dout, *grads, causal=causal, scale=scale, deterministic=False,
                                  config=cfg)
    return max(float((g.double() - r).norm() / r.norm()) for g, r in zip(grads, grads_ref))


def _forward_candidates(head_dim: int, causal: bool, dtype):
    """(family, config, launch function) of every registered forward candidate on this GPU: the sm80
    family's, and on sm_90a the Hopper family's where it supports the head dim."""
    from tileattn.kernels import attention_fwd_sm80
    from tileattn.runtime import device_arch

    out = [("sm80", c, attention_fwd_sm80.launch_forward)
           for c in attention_fwd_sm80.tuning_candidates(head_dim, causal, dtype)]
    if device_arch(torch.cuda.current_device()) == "sm_90a":
        from tileattn.kernels import attention_fwd_sm90

        if attention_fwd_sm90.supports(head_dim, dtype):
            out += [("sm90", c, attention_fwd_sm90.launch_forward_sm90)
                    for c in attention_fwd_sm90.tuning_candidates(head_dim, causal, dtype)]
    return out


def tune(dtype, head_dim: int, seq_lens, reps: int, forward: bool = True, backward: bool = True) -> list[dict]:
    """Time every registered candidate tile config of the forward and/or backward kernels, each
    validated first on a small irregular slice (relative error against float64, in the record)."""
    from tileattn import reference
    from tileattn.kernels import attention_fwd_sm80

    records = []
    b, h = 4, 32
    for causal in (False, True):
        for n in seq_lens:
            q, k, v = _inputs(b, h, n, head_dim, dtype, False)
            out = torch.empty_like(q)
            lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)
            dout = torch.randn_like(q)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            scale = 1.0 / math.sqrt(head_dim)
            small = [t[:1, :2, :257] for t in (q, k, v)]
            ref, _ = reference.attention(*small, causal=causal, compute_dtype=torch.float64)
            for family, cfg, launch in _forward_candidates(head_dim, causal, dtype) if forward else ():
                o_small = torch.full_like(small[0], float("nan"))
                l_small = torch.empty(1, 2, 257, device="cuda", dtype=torch.float32)
                launch(*small, o_small, l_small, causal=causal, scale=scale, config=cfg)
                err = float((o_small.double() - ref).norm() / ref.norm())
                t = measure(lambda: launch(q, k, v, out, lse, causal=causal, scale=scale, config=cfg),  # noqa: B023
                            reps=reps, memory=False)
                records.append({"suite": "tune", "pass": "fwd", "config": f"{family}:{cfg}", "n": n,
                                "causal": causal, "rel_err": err,
                                "tflops": flops(b, h, n, n, head_dim, causal, False) / (t.median_ms * 1e-3) / 1e12,
                                **t.as_dict()})
            attention_fwd_sm80.launch_forward(q, k, v, out, lse, causal=causal, scale=scale)
            if not backward:
                continue
            from tileattn.kernels import attention_bwd_sm80

            # Reference gradients of the small slice: float64 autograd through tileattn.reference.
            small64 = [t.detach().double().requires_grad_() for t in small]
            dout_small = dout[:1, :2, :257]
            ref64, _ = reference.attention(*small64, causal=causal, compute_dtype=torch.float64)
            grads_ref = torch.autograd.grad(ref64, small64, dout_small.double())
            o_small = torch.empty_like(small[0])
            l_small = torch.empty(1, 2, 257, device="cuda", dtype=torch.float32)
            attention_fwd_sm80.launch_forward(*small, o_small, l_small, causal=causal, scale=scale)
            for cfg in attention_bwd_sm80.tuning_candidates(head_dim, causal, dtype):
                err = _backward_error(cfg, small, o_small, l_small, dout_small, causal, scale, grads_ref)
                t = measure(lambda: attention_bwd_sm80.launch_backward(q, k, v, out, lse, dout, dq, dk, dv, causal=causal,
                                                                  scale=scale, deterministic=False, config=cfg),
                            reps=reps, memory=False)
                records.append({"suite": "tune", "pass": "bwd", "config": str(cfg), "n": n, "causal": causal,
                                "rel_err": err, "tflops": flops(b, h, n, n, head_dim, causal, True) / (t.median_ms * 1e-3) / 1e12,
                                **t.as_dict()})
            torch.cuda.empty_cache()
    return records


def main(argv=None) -> int:
    from tileattn.runtime import require_gpu

    from .env import environment

    ap = argparse.ArgumentParser(prog="tileattn bench attention", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--head-dim", type=int, default=128, choices=SUPPORTED_HEAD_DIMS)
    ap.add_argument("--batch", type=positive_int, default=4)
    ap.add_argument("--heads", type=positive_int, default=32)
    ap.add_argument("--seq", type=positive_int, action="append", help="sequence length (repeatable)")
    ap.add_argument("--quick", action="store_true", help=f"N in {QUICK_SEQ_LENS}")
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--backward-only", action="store_true", help="only the backward pass (with --tune: its configs)")
    ap.add_argument("--impl", action="append", choices=IMPL_NAMES,
                    help="only these implementations (repeatable; tileattn_sm90 on sm_90a only)")
    ap.add_argument("--reps", type=positive_int, default=10)
    ap.add_argument("--rounds", type=positive_int,
                    help="time each point this many times, implementations interleaved (each first in turn); "
                         "report the median round (default 3, 1 with --demo: on the H200 the first measurement "
                         "after light work can run at a 20 %% higher clock than the rest, docs/BENCHMARKS.md "
                         "session 28)")
    ap.add_argument("--json", help="write records here")
    ap.add_argument("--markdown", help="write the Markdown tables here")
    ap.add_argument("--plot", help="write a PNG plot of forward TFLOP/s here")
    ap.add_argument("--tune", action="store_true", help="time every registered tileattn tile configuration")
    ap.add_argument("--demo", action="store_true", help="correctness check + a quick forward table")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.demo else 3
    if args.forward_only and args.backward_only:
        ap.error("--forward-only and --backward-only exclude each other")
    require_gpu()
    dtype = DTYPES[args.dtype]
    env = environment()
    print(environment_line(env))
    for line in correctness_check(dtype):
        print(line)
    seq_lens = tuple(args.seq or (QUICK_SEQ_LENS if args.quick or args.demo else SEQ_LENS))
    if args.tune:
        records = tune(dtype, args.head_dim, seq_lens, args.reps, forward=not args.backward_only,
                       backward=not args.forward_only)
        if args.json:
            write_run(args.json, records, env)
        for r in records:
            if r.get("rel_err", 0.0) > 2e-2:
                print(f"WARNING: config {r['config']} causal={r['causal']} n={r['n']}: rel. error {r['rel_err']:.2e}")
        for p in ("fwd",) if args.forward_only else ("bwd",) if args.backward_only else ("fwd", "bwd"):
            for causal in (False, True):
                print(f"\n{p} causal={causal}: TFLOP/s by config")
                print(markdown_table(records, ["config"], "n", "tflops", where={"pass": p, "causal": causal}))
        return 0

    impls = implementations()
    q, k, v = _inputs(1, 1, 128, args.head_dim, dtype, False)
    records = host_overhead_records(q, k, v)
    for r in records:
        print(f"host time per forward call, {r['impl']}: {r['host_us_per_call']:.1f} us (B=1 H=1 N=128)")
    if args.impl:
        unknown = set(args.impl) - set(impls)
        if unknown:
            raise SystemExit(f"implementation(s) {sorted(unknown)} do not run on this GPU; here: {sorted(impls)}")
        impls = {k: v for k, v in impls.items() if k in args.impl}
    passes = (False,) if args.forward_only or args.demo else (True,) if args.backward_only else (False, True)
    oom_naive: set[tuple] = set()
    for backward in passes:
        for causal in (False, True):
            for n in seq_lens:
                for rnd in range(args.rounds):
                    for name, fn in round_order(impls, rnd):
                        if backward and name in FORCED:
                            continue
                        if name == "naive" and (backward, causal) in oom_naive:
                            records.append({"suite": "attention", "impl": name, "pass": "bwd" if backward else "fwd",
                                            "n": n, "causal": causal, "round": rnd,
                                            "status": "out of memory (smaller N did)"})
                            continue
                        rec = bench_case(name, fn, b=args.batch, h=args.heads, n=n, d=args.head_dim, dtype=dtype,
                                         causal=causal, backward=backward, reps=args.reps)
                        if name == "naive" and rec["status"] == "out of memory":
                            oom_naive.add((backward, causal))
                        records.append(dict(rec, round=rnd))
    points = median_rounds(records)  # one record per point; the JSON keeps every round
    text = render(points, args)
    save_run(records, env, text, args.json, args.markdown)
    if args.plot:
        plot(points, "n", "impl", "tflops", args.plot, where={"pass": "fwd", "causal": False, "status": "ok"},
             title=f"attention forward, B={args.batch} H={args.heads} d={args.head_dim} {args.dtype}",
             ylabel="TFLOP/s")
    print(text)
    return 0


def render(records: list[dict], args) -> str:
    """The tables of one record per point (median_rounds already applied)."""
    parts = []
    for p in ("fwd", "bwd"):
        for causal in (False, True):
            sel = {"pass": p, "causal": causal}
            if not any(all(r.get(k) == v for k, v in sel.items()) for r in records):
                continue
            rows = [dict(r, tflops=r.get("tflops"), cell=_cell(r)) for r in records if all(r.get(k) == v for k, v in sel.items())]
            title = f"{'forward' if p == 'fwd' else 'backward'}, causal={causal}, B={args.batch} H={args.heads} d={args.head_dim} {args.dtype}"
            if args.rounds > 1:
                title += f", median of {args.rounds} interleaved rounds"
            parts.append(f"### {title}: TFLOP/s (median ms [min-max], peak extra MiB)\n\n" + markdown_table(rows, ["n"], "impl", "cell"))
            parts.append(_ratio_table(rows))
    return "\n\n".join(parts)


def _cell(r: dict) -> str:
    if r.get("status") != "ok":
        return r.get("status", "-")
    cell = f"{r['tflops']:.0f} ({r['median_ms']:.3g} [{r['min_ms']:.3g}-{r['max_ms']:.3g}], {r['peak_extra_mib']:.0f})"
    if "tflops_rounds" in r:
        cell += f" rounds {min(r['tflops_rounds']):.0f}-{max(r['tflops_rounds']):.0f}"
    if r.get("gpu_clocks"):  # TILEATTN_BENCH_CLOCKS (bench/harness.py)
        cell += f" SM {r['gpu_clocks']['sm_mhz']['median']:.0f} MHz"
    return cell


def _ratio_table(rows: list[dict]) -> str:
    by_n: dict[int, dict[str, float]] = {}
    for r in rows:
        if r.get("status") == "ok":
            by_n.setdefault(r["n"], {})[r["impl"]] = r["tflops"]
    lines = ["| n | tileattn / flash | tileattn / cudnn | tileattn / best peer |", "|---|---|---|---|"]
    for n, t in by_n.items():
        if "tileattn" not in t:
            continue
        peers = [v for k, v in t.items() if not k.startswith("tileattn")]
        f = lambda key: f"{t['tileattn'] / t[key]:.2f}" if key in t else "-"  # noqa: E731
        best = f"{t['tileattn'] / max(peers):.2f}" if peers else "-"
        lines.append(f"| {n} | {f('sdpa_flash')} | {f('sdpa_cudnn')} | {best} |")
    return "\n".join(lines)
