"""Dense attention in plain torch: the oracle every kernel is compared against.

It builds the full [B, H, Nq, Nk] score matrix, so it is for tests and small problems only.
It is differentiable with torch autograd; run it in float64 to get a gradient oracle.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention"]


def attention(q, k, v, causal=False, scale=None, *, compute_dtype=None):
    """Dense scaled-dot-product attention with GQA/MQA, causal masking and the log-sum-exp.

    Shapes:
        q: [B, H, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]; Hkv must divide H and query
        head h reads kv head h // (H // Hkv). Nq != Nk is allowed.
    Masking:
        ``causal`` is aligned bottom-right: query i sees key j iff j <= i + Nk - Nq. A query
        that sees no key (causal with Nq > Nk, or Nk == 0) gets output 0 and lse -inf, and
        zero (never NaN) autograd gradients.
    Scale: ``scale`` multiplies q . k; default 1 / sqrt(d).
    Dtypes:
        q, k, v share one floating dtype. The math runs in ``compute_dtype``: by default float32
        for 16-bit inputs (float16, bfloat16) and the input dtype otherwise; pass torch.float64
        for an oracle. ``out`` is returned in the input dtype, or in ``compute_dtype`` when one
        is given explicitly. ``lse`` is always in the compute dtype.
    Returns:
        (out [B, H, Nq, dv], lse [B, H, Nq]) with lse the natural-log log-sum-exp of the scaled,
        masked scores of each query row.
    Raises:
        ValueError: a non-tensor argument, rank other than 4, mismatched batch sizes, k and v
        with different head counts or key counts, Hkv not dividing H, q and k head dims that
        differ (or are 0), non-floating or mixed dtypes, tensors on different devices, or a
        non-floating ``compute_dtype``.
    Works on any device torch supports (CPU, CUDA); nothing here is device specific.
    """
    _check(q, k, v, compute_dtype)
    batch, heads, nq, d = q.shape
    kv_heads, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = heads // kv_heads
    if compute_dtype is None:
        compute_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        out_dtype = q.dtype
    else:
        out_dtype = compute_dtype
    if scale is None:
        scale = 1.0 / math.sqrt(d)

    # Query heads of one group share a kv head: view q as [B, Hkv, group, Nq, d] and broadcast
    # k and v over the group dimension instead of copying them.
    qc = q.to(compute_dtype).reshape(batch, kv_heads, group, nq, d)
    kc = k.to(compute_dtype).unsqueeze(2)  # [B, Hkv, 1, Nk, d]
    vc = v.to(compute_dtype).unsqueeze(2)  # [B, Hkv, 1, Nk, dv]
    scores = scale * (qc @ kc.transpose(-1, -2))  # [B, Hkv, group, Nq, Nk]

    if causal:
        rows = torch.arange(nq, device=q.device)  # [Nq]
        cols = torch.arange(nk, device=q.device)  # [Nk]
        visible = cols[None, :] <= rows[:, None] + (nk - nq)  # [Nq, Nk]
        scores = scores.masked_fill(~visible, float("-inf"))

    if nk > 0:
        row_max = scores.amax(dim=-1, keepdim=True).detach()  # [B, Hkv, group, Nq, 1]
    else:
        row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    # Fully masked rows have row_max = -inf; shift them by 0 so no -inf - (-inf) appears.
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    unnormalized = torch.exp(scores - shift)  # [B, Hkv, group, Nq, Nk], masked -> 0
    row_sum = unnormalized.sum(dim=-1, keepdim=True)  # [B, Hkv, group, Nq, 1]
    seen = row_sum > 0  # [B, Hkv, group, Nq, 1]
    # Dividing by 1 on unseen rows keeps their probabilities (and gradients) exactly 0.
    safe_sum = torch.where(seen, row_sum, torch.ones_like(row_sum))
    probs = unnormalized / safe_sum  # [B, Hkv, group, Nq, Nk]
    out = probs @ vc  # [B, Hkv, group, Nq, dv]
    lse = torch.where(seen, shift + torch.log(safe_sum), torch.full_like(shift, float("-inf")))

    out = out.reshape(batch, heads, nq, dv).to(out_dtype)  # [B, H, Nq, dv]
    lse = lse.reshape(batch, heads, nq)  # [B, H, Nq]
    return out, lse


def _check(q, k, v, compute_dtype) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be rank-4 [B, heads, seq, dim], got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must have a floating dtype, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(
            "k and v must have the same kv heads and keys, "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"kv heads ({kv_heads}) must divide query heads ({heads})")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k head dims differ: {q.shape[3]} vs {k.shape[3]}")
    if q.shape[3] == 0:
        raise ValueError("head dim must be >= 1")
    if compute_dtype is not None and not (
        isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
    ):
        raise ValueError(f"compute_dtype must be a floating torch.dtype, got {compute_dtype!r}")
