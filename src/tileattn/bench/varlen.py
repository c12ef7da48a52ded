"""`tileattn bench varlen`: packed variable-length attention beside dense and padded peers.

    tileattn bench varlen [--seqs 64] [--min-len 100] [--max-len 4096] [--heads 32] [--kv-heads 32]
                          [--head-dim 128] [--dtype bf16] [--full] [--reps N] [--seed S]
                          [--json PATH] [--markdown PATH]

The workload (issue #10): B = 64 sequences with lengths drawn uniformly from [100, 4096] (seeded),
causal, bf16, d = 128, H = Hkv = 32, forward and forward+backward. Implementations:
- tileattn_varlen: `tileattn.api_varlen.attention_varlen` on the packed batch q [Tq, H, d], as
  dispatched (the Hopper varlen kernels on sm_90a, the sm80 varlen entry points elsewhere).
- tileattn_dense_sm80 / tileattn_dense: a dense [B', H, N, d] batch of the same total work
  (N = the root mean square of the lengths, rounded to a multiple of 64, B' chosen so that
  B' * N(N+1)/2 is closest to the varlen batch's query-key pairs), through `tileattn.attention`
  (whatever its dispatcher runs, the Hopper kernels at d = 128 on an H200: varlen / dense is the
  cost of raggedness, target >= 0.95) and through the sm80 launch layers (for scale).
- sdpa_<backend>: torch SDPA (flash, cudnn, efficient, each where it runs) on the padded batch
  [B, H, max_len, d] with is_causal (for Nq = Nk per sequence, top-left and bottom-right causal
  are the same mask, so its rows inside each sequence are the exact result; the padding rows are
  wasted work, which is what the comparison measures); non-causal (--full) with a key-padding mask
  (padded_sdpa). GQA through enable_gqa when Hkv < H.
Throughput counts useful FLOPs only: 4 d H per visible (query, key) pair, n(n+1)/2 pairs for a
causal sequence of n tokens (n^2 non-causal); forward+backward counts 3.5x the forward (the
backward does 2.5x the forward's matrix products). Before timing, every implementation's output
is compared with tileattn_varlen's on the rows they share (rel_err in the record).
Timing: tileattn.bench.harness.measure (CUDA events, L2 flushed before each repetition).
"""

from __future__ import annotations

import argparse
import math

import torch

from ..api import SUPPORTED_HEAD_DIMS
from .harness import measure, positive_int
from .records import save_run
from .report import environment_line, fmt_number

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def draw_lengths(seqs: int, lo: int, hi: int, seed: int) -> list[int]:
    """`seqs` lengths uniform in [lo, hi] (inclusive), reproducible from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (seqs,), generator=gen).tolist()


def pairs(n: int, causal: bool) -> int:
    """Visible (query, key) pairs of one sequence of n tokens (Nq = Nk)."""
    return n * (n + 1) // 2 if causal else n * n


def dense_equivalent(lengths: list[int], causal: bool) -> tuple[int, int]:
    """(B', N): a dense batch with about the same number of visible pairs as `lengths`."""
    n = max(64, round(math.sqrt(sum(x * x for x in lengths) / len(lengths)) / 64) * 64)
    batch = max(1, round(sum(pairs(x, causal) for x in lengths) / pairs(n, causal)))
    return batch, n


def rel_err(out, ref) -> float:
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm())


def _timed(fn, flops: float, reps: int) -> dict:
    t = measure(fn, warmup=2, reps=reps, max_seconds=5.0, memory=False)
    return {"status": "ok", "ms": t.median_ms, "tflops": flops / (t.median_ms * 1e-3) / 1e12, **t.as_dict()}


def _fwd_bwd(attn, inputs, dout):
    """A callable running attn(*inputs) forward and backward (gradients returned, not accumulated)."""

    def call():
        out = attn(*inputs)
        return torch.autograd.grad(out, inputs[:3], dout)

    return call


def padded_sdpa(q, k, v, valid, causal: bool, backend):
    """SDPA (`backend` forced) on a padded batch q, k, v [B, H(kv), L, d] whose first n_b positions of
    sequence b are real (valid [B, L] bool): causal, the mask alone keeps every real query off the
    padding keys (they come after it); non-causal, a key-padding mask [B, 1, 1, L] does (without it the
    zero keys took softmax weight and the output was wrong; the flash backend takes no mask and is
    reported as refusing the shape)."""
    from torch.nn.attention import sdpa_kernel

    mask = None if causal else valid[:, None, None, :]
    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                enable_gqa=k.shape[1] != q.shape[1])


def _dense_records(base, lengths, heads, kv_heads, head_dim, dtype, causal, reps, gen) -> list[dict]:
    """A dense batch of the same work (dense_equivalent), fwd and fwd+bwd, twice: through
    tileattn.attention (its dispatcher may pick the Hopper kernels: the ratio of the target) and
    through the sm80 launch layers."""
    import tileattn

    from ..kernels import attention_bwd_sm80, attention_fwd_sm80

    d_batch, d_len = dense_equivalent(lengths, causal)
    work = 4.0 * head_dim * heads * d_batch * pairs(d_len, causal)
    scale = 1.0 / math.sqrt(head_dim)
    q = torch.randn(d_batch, heads, d_len, head_dim, device="cuda", generator=gen).to(dtype)  # [B', H, N, d]
    k = torch.randn(d_batch, kv_heads, d_len, head_dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(d_batch, kv_heads, d_len, head_dim, device="cuda", generator=gen).to(dtype)
    dout = torch.randn_like(q)
    records = []

    def dense(q_, k_, v_):
        return tileattn.attention(q_, k_, v_, causal=causal)

    rec = dict(base, impl="tileattn_dense", dense_b=d_batch, dense_n=d_len)
    with torch.no_grad():
        records.append(dict(rec, mode="fwd", work_tflop=work / 1e12, **_timed(lambda: dense(q, k, v), work, reps)))
    grads = tuple(t.detach().requires_grad_() for t in (q, k, v))
    records.append(dict(rec, mode="fwd+bwd", work_tflop=3.5 * work / 1e12,
                        **_timed(_fwd_bwd(dense, grads, dout), 3.5 * work, reps)))

    def sm80_forward():
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        attention_fwd_sm80.launch_forward(q, k, v, out, lse, causal=causal, scale=scale)
        return out, lse

    def sm80_forward_backward():
        out, lse = sm80_forward()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        attention_bwd_sm80.launch_backward(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale,
                                           deterministic=False)
        return dq, dk, dv

    rec = dict(base, impl="tileattn_dense_sm80", dense_b=d_batch, dense_n=d_len)
    records.append(dict(rec, mode="fwd", work_tflop=work / 1e12, **_timed(sm80_forward, work, reps)))
    records.append(dict(rec, mode="fwd+bwd", work_tflop=3.5 * work / 1e12,
                        **_timed(sm80_forward_backward, 3.5 * work, reps)))
    return records


def run(lengths, heads, kv_heads, head_dim, dtype, causal, reps, seed) -> list[dict]:
    from torch.nn.attention import SDPBackend

    from ..api_varlen import attention_varlen

    batch, total, longest = len(lengths), sum(lengths), max(lengths)
    useful = 4.0 * head_dim * heads * sum(pairs(n, causal) for n in lengths)
    base = {"suite": "varlen", "seqs": batch, "tokens": total, "max_len": longest, "h": heads, "hkv": kv_heads,
            "d": head_dim, "dtype": str(dtype).removeprefix("torch."), "causal": causal}
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(total, heads, head_dim, device="cuda", generator=gen).to(dtype)  # [Tq, H, d]
    k = torch.randn(total, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)  # [Tk, Hkv, d]
    v = torch.randn(total, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    dout = torch.randn(total, heads, head_dim, device="cuda", generator=gen).to(dtype)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device="cuda")
    records = []

    # tileattn varlen, as dispatched (the Hopper varlen kernels on sm_90a)
    qv, kv, vv = (t.detach().requires_grad_() for t in (q, k, v))

    def varlen(q_, k_, v_):
        return attention_varlen(q_, k_, v_, cu_seqlens, cu_seqlens, longest, longest, causal=causal)

    with torch.no_grad():
        ref = varlen(q, k, v)  # [Tq, H, d]
        rec = dict(base, impl="tileattn_varlen", mode="fwd", work_tflop=useful / 1e12)
        rec.update(_timed(lambda: varlen(q, k, v), useful, reps))
        records.append(rec)
    rec = dict(base, impl="tileattn_varlen", mode="fwd+bwd", work_tflop=3.5 * useful / 1e12)
    rec.update(_timed(_fwd_bwd(varlen, (qv, kv, vv), dout), 3.5 * useful, reps))
    records.append(rec)

    records += _dense_records(base, lengths, heads, kv_heads, head_dim, dtype, causal, reps, gen)

    # SDPA on the padded batch [B, H, max_len, d]
    def pad(t):  # [T, h, d] -> [B, h, max_len, d], zeros past each sequence
        out = t.new_zeros(batch, longest, t.shape[1], head_dim)
        for b, n in enumerate(lengths):
            out[b, :n] = t[cu[b]:cu[b + 1]]
        return out.transpose(1, 2)

    qp, kp, vp, dp = pad(q), pad(k), pad(v), pad(dout)
    valid = torch.zeros(batch, longest, dtype=torch.bool, device="cuda")
    for b, n in enumerate(lengths):
        valid[b, :n] = True
    ref_padded = pad(ref).transpose(1, 2)[valid]  # [Tq, H, d] in packed order
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, backend in backends.items():

        def sdpa(q_, k_, v_, backend=backend):
            return padded_sdpa(q_, k_, v_, valid, causal, backend)

        sbase = dict(base, impl=f"sdpa_{name}", padded_len=longest)
        mode = "fwd"
        try:
            with torch.no_grad():
                err = rel_err(sdpa(qp, kp, vp).transpose(1, 2)[valid], ref_padded)
                records.append(dict(sbase, mode=mode, work_tflop=useful / 1e12, rel_err_vs_varlen=err,
                                    **_timed(lambda: sdpa(qp, kp, vp), useful, reps)))
            mode = "fwd+bwd"
            grads = tuple(t.detach().requires_grad_() for t in (qp, kp, vp))
            records.append(dict(sbase, mode=mode, work_tflop=3.5 * useful / 1e12,
                                **_timed(_fwd_bwd(sdpa, grads, dp), 3.5 * useful, reps)))
        except RuntimeError as exc:  # a backend that refuses this shape or dtype
            records.append(dict(sbase, mode=mode, status=f"error: {str(exc).splitlines()[0][:100]}"))
        torch.cuda.empty_cache()
    return records


def render(records: list[dict]) -> str:
    """Markdown: TFLOP/s of useful work per implementation and pass, with the two ratios."""
    first = records[0]
    head = (f"### varlen: {first['seqs']} sequences, lengths {first['min_len']}..{first['max_len_arg']} "
            f"(max drawn {first['max_len']}, {first['tokens']} tokens), H/Hkv {first['h']}/{first['hkv']}, "
            f"d={first['d']}, {first['dtype']}, {'causal' if first['causal'] else 'full'}: useful TFLOP/s (ms)")
    lines = [head, "", "| impl | fwd | fwd+bwd |", "|---|---|---|"]
    table: dict[str, dict[str, dict]] = {}
    for r in records:
        table.setdefault(r["impl"], {})[r["mode"]] = r

    def cell(r):
        if r is None:
            return "-"
        if r.get("status") != "ok":
            return r.get("status", "-")
        return f"{fmt_number(r['tflops'])} ({fmt_number(r['ms'])})"

    for impl, passes in table.items():
        label = impl
        if impl.startswith("tileattn_dense"):
            any_r = next(iter(passes.values()))
            label += f" (B={any_r['dense_b']}, N={any_r['dense_n']})"
        lines.append(f"| {label} | {cell(passes.get('fwd'))} | {cell(passes.get('fwd+bwd'))} |")
    ours = table.get("tileattn_varlen", {})
    for p in ("fwd", "fwd+bwd"):
        mine = ours.get(p, {}).get("tflops")

        def ratio(impl, p=p, mine=mine):
            other = table.get(impl, {}).get(p, {}).get("tflops")
            return mine / other if mine and other else None

        peers = [r[p]["tflops"] for impl, r in table.items() if impl.startswith("sdpa") and p in r
                 and r[p].get("status") == "ok"]
        vs_sdpa = mine / max(peers) if mine and peers else None
        lines.append(f"\n{p}: varlen / dense as dispatched {fmt_number(ratio('tileattn_dense'))} (target >= 0.95), "
                     f"varlen / dense sm80 {fmt_number(ratio('tileattn_dense_sm80'))}, varlen / best SDPA padded "
                     f"{fmt_number(vs_sdpa)} (target > 1)")
    return "\n".join(lines)


def main(argv=None) -> int:
    from ..runtime import require_gpu
    from .env import environment

    ap = argparse.ArgumentParser(prog="tileattn bench varlen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=positive_int, default=64, help="number of sequences (default 64)")
    ap.add_argument("--min-len", type=positive_int, default=100)
    ap.add_argument("--max-len", type=positive_int, default=4096)
    ap.add_argument("--heads", type=positive_int, default=32)
    ap.add_argument("--kv-heads", type=positive_int, default=32)
    ap.add_argument("--head-dim", type=int, default=128, choices=SUPPORTED_HEAD_DIMS)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--full", action="store_true", help="non-causal (default: causal)")
    ap.add_argument("--reps", type=positive_int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="seed of the lengths and the data")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--markdown", help="write the table here")
    args = ap.parse_args(argv)
    if args.min_len > args.max_len:
        ap.error(f"--min-len {args.min_len} is above --max-len {args.max_len}")
    if args.heads % args.kv_heads:
        ap.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    require_gpu()
    env = environment()
    print(environment_line(env))
    lengths = draw_lengths(args.seqs, args.min_len, args.max_len, args.seed)
    records = run(lengths, args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype], not args.full, args.reps,
                  args.seed)
    for r in records:
        r.update(min_len=args.min_len, max_len_arg=args.max_len, lengths_seed=args.seed)
        err = r.get("rel_err_vs_varlen")
        if err is not None and err > 2e-2:
            print(f"WARNING: {r['impl']} differs from tileattn_varlen: rel. error {err:.2e}")
    text = render(records)
    save_run(records, env, text, args.json, args.markdown)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
