"""Attention in plain torch: the oracle every kernel is compared against.

``attention`` is dense; ``attention_varlen``, ``attention_paged`` and ``write_kv_cache`` are the
inference ops with the CUDA ops' signatures (the engine's CPU path runs them). They build full
score matrices (per sequence for the packed ops), so they are for tests and small problems.
It is differentiable with torch autograd; run it in float64 to get a gradient oracle.
"""

from __future__ import annotations

import itertools
import math
import numbers

import torch

from . import dropout as _dropout

__all__ = ["attention", "attention_paged", "attention_varlen", "write_kv_cache"]


def attention(q, k, v, causal=False, scale=None, *, compute_dtype=None, window=None, softcap=None,
              alibi_slopes=None, dropout_p=0.0, generator=None, seed=None, offset=None):
    """Dense scaled-dot-product attention with GQA/MQA, causal masking and the log-sum-exp.

    Shapes:
        q: [B, H, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]; Hkv must divide H and query
        head h reads kv head h // (H // Hkv). Nq != Nk is allowed.
    Masking:
        ``causal`` is aligned bottom-right: query i sees key j iff j <= i + Nk - Nq. A query
        that sees no key (causal with Nq > Nk, or Nk == 0) gets output 0 and lse -inf, and
        zero (never NaN) autograd gradients.
    Scale: ``scale`` multiplies q . k; default 1 / sqrt(d).
    Variants (as tileattn.attention; docs/attention_variants.md), applied to s = scale * q . k in
    this order: ``softcap`` c > 0: s = c * tanh(s / c); ``alibi_slopes`` [H] or [B, H]: s -=
        slope[b, h] * |i + Nk - Nq - j|; ``window`` (left, right) (-1: unbounded; causal is right = 0):
        keys outside [i + Nk - Nq - left, i + Nk - Nq + right] are masked; ``dropout_p`` p: the
        probabilities are multiplied by tileattn.dropout.dropout_mask(seed, offset, ...) / (1 - p)
        (seed/offset given, ints or a seed tensor [seed, offset] on any device, or drawn from
        ``generator`` / the default generator of q's device as the CUDA op draws them outside graph
        capture); lse stays that of the undropped softmax.
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
        non-floating ``compute_dtype``; a malformed window, softcap, alibi_slopes, dropout_p,
        generator, seed or offset (the message names it); a ``causal`` that is no bool.
    Works on any device torch supports (CPU, CUDA); nothing here is device specific.
    """
    _check(q, k, v, compute_dtype)
    causal = _dropout.check_flag("causal", causal)
    keep = None
    if _dropout.check_dropout(dropout_p, generator, seed, offset):
        seed, offset = _dropout.draw_seed(generator, seed, offset, q.device)
        keep = _keep_scale(seed, offset, q.shape[0], q.shape[1], q.shape[2], k.shape[2], dropout_p, q.device)
    return _attention(q, k, v, causal, scale, compute_dtype, window, softcap, alibi_slopes, keep)


def _keep_scale(seed, offset, batch, heads, nq, nk, p, device, batch_start=0):
    """float64 [B, H, Nq, Nk]: 1 / (1 - p) where tileattn.dropout_mask keeps the score, 0 elsewhere."""
    mask = _dropout.dropout_mask(seed, offset, batch, heads, nq, nk, p, device=device, batch_start=batch_start)
    return mask.to(torch.float64) / (1.0 - p)


def _attention(q, k, v, causal, scale, compute_dtype, window, softcap, alibi_slopes, keep):
    """``attention`` after the checks of q, k, v; keep: None or the dropout multipliers [B, H, Nq, Nk]."""
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

    cap = _dropout.check_softcap(softcap)
    if cap > 0:
        scores = cap * torch.tanh(scores / cap)
    rows = torch.arange(nq, device=q.device)  # [Nq]
    cols = torch.arange(nk, device=q.device)  # [Nk]
    if alibi_slopes is not None:
        sb = _dropout.check_alibi(alibi_slopes, batch, heads, q.device, dtype_strict=False)
        slopes = alibi_slopes.to(compute_dtype).reshape(batch if sb else 1, kv_heads, group, 1, 1)
        distance = (rows[:, None] + (nk - nq) - cols[None, :]).abs().to(compute_dtype)  # [Nq, Nk]
        scores = scores - slopes * distance
    if causal or window is not None:
        left, right = _dropout.check_window(window, causal)
        diag = rows[:, None] + (nk - nq)  # [Nq, 1]
        visible = (cols[None, :] >= diag - left) & (cols[None, :] <= diag + right)  # [Nq, Nk]
        scores = scores.masked_fill(~visible, float("-inf"))
    if keep is not None:
        keep = keep.to(compute_dtype).reshape(batch, kv_heads, group, nq, nk)
    out, lse = _softmax_times_v(scores, vc, keep)  # [B, Hkv, group, Nq, dv], [B, Hkv, group, Nq, 1]

    out = out.reshape(batch, heads, nq, dv).to(out_dtype)  # [B, H, Nq, dv]
    lse = lse.reshape(batch, heads, nq)  # [B, H, Nq]
    return out, lse


def _softmax_times_v(scores, vc, keep=None):
    """softmax(scores) @ vc and the row log-sum-exp, for scores whose masked entries are -inf.

    scores [..., Nq, Nk], vc [..., Nk, dv] (broadcast over the leading dims); keep (optional,
    [..., Nq, Nk]) multiplies the probabilities before the product (dropout). Rows with no
    visible key get out 0 and lse -inf, and zero gradients. Returns (out [..., Nq, dv],
    lse [..., Nq, 1]).
    """
    if scores.shape[-1] > 0:
        row_max = scores.amax(dim=-1, keepdim=True).detach()  # [..., Nq, 1]
    else:
        row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    # Fully masked rows have row_max = -inf; shift them by 0 so no -inf - (-inf) appears.
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    unnormalized = torch.exp(scores - shift)  # [..., Nq, Nk], masked -> 0
    row_sum = unnormalized.sum(dim=-1, keepdim=True)  # [..., Nq, 1]
    seen = row_sum > 0  # [..., Nq, 1]
    # Dividing by 1 on unseen rows keeps their probabilities (and gradients) exactly 0.
    safe_sum = torch.where(seen, row_sum, torch.ones_like(row_sum))
    probs = unnormalized / safe_sum  # [..., Nq, Nk]
    if keep is not None:
        probs = probs * keep
    out = probs @ vc  # [..., Nq, dv]
    lse = torch.where(seen, shift + torch.log(safe_sum), torch.full_like(shift, float("-inf")))
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
    _check_compute_dtype(compute_dtype)


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal=False,
    scale=None,
    return_lse=False,
    deterministic=False,
    *,
    compute_dtype=None,
    window=None,
    softcap=None,
    alibi_slopes=None,
    dropout_p=0.0,
    generator=None,
    seed=None,
    offset=None,
):
    """Attention over B packed sequences of different lengths (the oracle of tileattn's varlen op).

    Shapes:
        q: [Tq, H, d], k: [Tk, Hkv, d], v: [Tk, Hkv, dv]; sequence b owns query rows
        cu_seqlens_q[b]:cu_seqlens_q[b+1] and key rows cu_seqlens_k[b]:cu_seqlens_k[b+1].
        cu_seqlens_q / cu_seqlens_k: integer [B+1], starting at 0, non-decreasing, ending at or
        below Tq / Tk. Hkv divides H; query head h reads kv head h // (H // Hkv).
    Masking: ``causal`` is aligned bottom-right per sequence (as ``attention``). A sequence of
        length 0 produces nothing; query rows that see no key, and rows past cu_seqlens_q[B],
        get out 0 and lse -inf.
    max_seqlen_q / max_seqlen_k: upper bounds on the sequence lengths (the CUDA op sizes its grid
        from them); a longer sequence raises. ``deterministic`` is accepted for signature parity
        and has no effect here (this code is deterministic).
    Variants: as ``attention``, per sequence (i, j count within it); ``alibi_slopes`` [H] or
        [B, H] (row b for sequence b); dropout's batch index is the sequence index.
    Dtypes: as ``attention``: out in the input dtype (or ``compute_dtype`` when given), lse in the
        compute dtype (float32 for 16-bit inputs by default).
    Returns: out [Tq, H, dv], or (out, lse [H, Tq]) when ``return_lse``. Differentiable in q, k, v.
    Raises:
        ValueError: non-tensors, wrong ranks, mismatched heads/dims/dtypes/devices, non-integer or
        malformed cu_seqlens (wrong length, not starting at 0, decreasing, past the packed
        length), a sequence longer than max_seqlen_q / max_seqlen_k, bad compute_dtype; malformed
        variants (as ``attention``); a causal / return_lse / deterministic that is no bool.
    Works on any device; the cu_seqlens are read on the host (one sync on CUDA).
    """
    _check_packed(q, k, v, compute_dtype)
    starts_q = _read_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q.shape[0])
    starts_k = _read_cu_seqlens("cu_seqlens_k", cu_seqlens_k, len(starts_q) - 1, k.shape[0])
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, starts_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, starts_k)
    batch, heads = len(starts_q) - 1, q.shape[1]
    if alibi_slopes is not None:
        _dropout.check_alibi(alibi_slopes, batch, heads, q.device, dtype_strict=False)
    causal, return_lse, _ = _dropout.check_flags(causal=causal, return_lse=return_lse, deterministic=deterministic)
    if _dropout.check_dropout(dropout_p, generator, seed, offset):
        seed, offset = _dropout.draw_seed(generator, seed, offset, q.device)
    outs, lses = [], []
    for b in range(batch):
        # [n, heads, d] -> [1, heads, n, d]: one dense problem per sequence.
        qb = q[starts_q[b] : starts_q[b + 1]].transpose(0, 1).unsqueeze(0)
        kb = k[starts_k[b] : starts_k[b + 1]].transpose(0, 1).unsqueeze(0)
        vb = v[starts_k[b] : starts_k[b + 1]].transpose(0, 1).unsqueeze(0)
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        keep = None
        if dropout_p:
            keep = _keep_scale(seed, offset, 1, heads, qb.shape[2], kb.shape[2], dropout_p, q.device, batch_start=b)
        ob, lb = _attention(qb, kb, vb, causal, scale, compute_dtype, window, softcap, slopes, keep)
        outs.append(ob[0].transpose(0, 1))  # [nq_b, H, dv]
        lses.append(lb[0])  # [H, nq_b]
    return _assemble(q, v.shape[-1], starts_q[-1], outs, lses, compute_dtype, return_lse)


def attention_paged(
    q,
    k_cache,
    v_cache,
    block_table,
    cu_seqlens_q,
    seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal=True,
    scale=None,
    return_lse=False,
    num_splits=None,
    validate=False,
    *,
    compute_dtype=None,
    window=None,
    softcap=None,
    alibi_slopes=None,
):
    """Attention of packed queries against a paged KV cache (the oracle of tileattn's paged op).

    Shapes:
        q: [Tq, H, d] packed queries of B sequences, sequence b owning rows
        cu_seqlens_q[b]:cu_seqlens_q[b+1]; k_cache: [num_blocks, block_size, Hkv, d],
        v_cache: [num_blocks, block_size, Hkv, dv]; block_table: integer [B, max_blocks];
        cu_seqlens_q: integer [B+1]; seqlens_k: integer [B], the key length of each sequence
        INCLUDING its query tokens (they are its last keys, already in the cache).
        Key j of sequence b lives at k_cache[block_table[b, j // block_size], j % block_size].
    Masking: ``causal`` is aligned bottom-right per sequence: query row i of a sequence with nq
        queries and nk keys sees key j iff j <= i + nk - nq. Keys whose block id is outside
        [0, num_blocks), or whose position is past the table's capacity max_blocks * block_size,
        are masked (never read); a negative seqlens_k counts as 0. Rows that see no key, and rows
        past cu_seqlens_q[B], get out 0 and lse -inf.
    Variants (as ``attention``, per sequence, query row i at key position i + nk - nq):
        ``softcap`` c: s = c * tanh(s / c); ``alibi_slopes`` [H] or [B, H] (row b for sequence b):
        s -= slope[b, h] * |i + nk - nq - j|; ``window`` (left, right) (-1: unbounded; causal is
        right = 0): keys outside [i + nk - nq - left, i + nk - nq + right] are masked.
    ``num_splits`` is accepted for signature parity (the CUDA op's split-KV count) and does not
        change the result. ``validate=True`` also checks the index contents as the CUDA op does
        (see ``check_paged_contents``).
    Dtypes: as ``attention``: out in the input dtype (or ``compute_dtype`` when given), lse in the
        compute dtype.
    Returns: out [Tq, H, dv], or (out, lse [H, Tq]) when ``return_lse``.
    Raises:
        ValueError: bad shapes, dtypes or devices (``check_paged_args``), malformed cu_seqlens_q,
        a query length above max_seqlen_q, a malformed window, softcap or alibi_slopes, a
        causal / return_lse / validate that is no bool, or (validate=True) bad index contents.
    Works on any device; the index tensors are read on the host (one sync on CUDA).
    """
    check_paged_args(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, compute_dtype)
    causal, return_lse, validate = _dropout.check_flags(causal=causal, return_lse=return_lse, validate=validate)
    left, right = _dropout.check_window(window, causal)  # causal alone: (unbounded, 0)
    cap = _dropout.check_softcap(softcap)
    if alibi_slopes is not None:
        _dropout.check_alibi(alibi_slopes, block_table.shape[0], q.shape[1], q.device, dtype_strict=False)
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    max_blocks = block_table.shape[1]
    starts_q = _read_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q.shape[0])
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, starts_q)
    if validate:
        check_paged_contents(
            k_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k
        )
    table = block_table.to("cpu", torch.int64)  # [B, max_blocks]
    key_lens = seqlens_k.to("cpu", torch.int64).clamp_min(0).tolist()  # [B]
    flat_k = k_cache.flatten(0, 1)  # [num_blocks * block_size, Hkv, d]
    flat_v = v_cache.flatten(0, 1)  # [num_blocks * block_size, Hkv, dv]
    outs, lses = [], []
    for b in range(len(starts_q) - 1):
        nq, nk = starts_q[b + 1] - starts_q[b], key_lens[b]
        pos = torch.arange(nk)  # [nk] key positions
        page = (pos // block_size).clamp_max(max(max_blocks - 1, 0))  # [nk]
        block = table[b, page] if max_blocks > 0 else torch.full((nk,), -1)  # [nk]
        readable = (pos < max_blocks * block_size) & (block >= 0) & (block < num_blocks)  # [nk]
        slot = torch.where(readable, block * block_size + pos % block_size, 0)  # [nk]
        if num_blocks == 0:
            kb = k_cache.new_zeros(nk, kv_heads, k_cache.shape[-1])
            vb = v_cache.new_zeros(nk, kv_heads, v_cache.shape[-1])
        else:
            kb = flat_k[slot.to(k_cache.device)]  # [nk, Hkv, d]
            vb = flat_v[slot.to(v_cache.device)]  # [nk, Hkv, dv]
        qpos = torch.arange(nq)[:, None] + (nk - nq)  # [nq, 1] key position of each query
        visible = readable[None, :] & (pos[None, :] >= qpos - left) & (pos[None, :] <= qpos + right)  # [nq, nk]
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes  # [H]
        qb = q[starts_q[b] : starts_q[b + 1]].transpose(0, 1)  # [H, nq, d]
        ob, lb = _attend_one(
            qb, kb.transpose(0, 1), vb.transpose(0, 1), visible, scale, compute_dtype, cap, slopes,
            (qpos - pos[None, :]).abs(),
        )
        outs.append(ob.transpose(0, 1))  # [nq, H, dv]
        lses.append(lb)  # [H, nq]
    return _assemble(q, v_cache.shape[-1], starts_q[-1], outs, lses, compute_dtype, return_lse)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """Store the keys and values of T tokens into their cache slots, in place.

    Shapes:
        k: [T, Hkv, d], v: [T, Hkv, dv]; k_cache: [num_blocks, block_size, Hkv, d],
        v_cache: [num_blocks, block_size, Hkv, dv]; slot_mapping: integer [T].
    Token t goes to k_cache[s // block_size, s % block_size] with s = slot_mapping[t]; a
    negative slot skips the token, and so does a slot at or past num_blocks * block_size (the
    CUDA op never writes outside the caches). Two tokens with one slot: one of them wins.
    Values are cast to the cache dtype. Returns None.
    Raises:
        ValueError: non-tensors, wrong ranks, k/v not matching the caches' heads and dims,
        mismatched token counts, non-integer slot_mapping, k_cache and v_cache of different
        dtypes or block shapes, tensors on different devices.
    """
    check_write_kv_args(k, v, k_cache, v_cache, slot_mapping)
    num_blocks, block_size = k_cache.shape[:2]
    slots = slot_mapping.to(torch.int64)  # [T]
    keep = (slots >= 0) & (slots < num_blocks * block_size)  # [T]
    slots = slots[keep]
    k_cache[slots // block_size, slots % block_size] = k[keep].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = v[keep].to(v_cache.dtype)


def check_write_kv_args(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Shape/dtype/device checks shared by the reference and the CUDA ``write_kv_cache``.

    Raises ValueError naming the argument; see ``write_kv_cache`` for the expected shapes.
    """
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        _require_tensor(name, t, 4 if name.endswith("cache") else 3)
    _require_tensor("slot_mapping", slot_mapping, 1)
    if _is_float_dtype(slot_mapping.dtype) or slot_mapping.dtype == torch.bool:
        raise ValueError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            "k_cache and v_cache must share [num_blocks, block_size, Hkv] and dtype, got "
            f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if t.shape[1:] != cache.shape[2:]:
            raise ValueError(
                f"{name} {tuple(t.shape)} must be [T, Hkv, dim] matching {name}_cache "
                f"{tuple(cache.shape)}"
            )
    if not (k.shape[0] == v.shape[0] == slot_mapping.shape[0]):
        raise ValueError(
            f"k, v and slot_mapping must have one token count, got {k.shape[0]}, {v.shape[0]}, "
            f"{slot_mapping.shape[0]}"
        )
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(
            f"k, v, k_cache, v_cache, slot_mapping must be on one device, got {devices}"
        )


def check_paged_args(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, compute_dtype=None):
    """Shape/dtype/device checks shared by the reference and the CUDA ``attention_paged``.

    Raises ValueError naming the argument; see ``attention_paged`` for the expected shapes.
    """
    _require_tensor("q", q, 3)
    _require_tensor("k_cache", k_cache, 4)
    _require_tensor("v_cache", v_cache, 4)
    _require_tensor("block_table", block_table, 2)
    _require_tensor("cu_seqlens_q", cu_seqlens_q, 1)
    _require_tensor("seqlens_k", seqlens_k, 1)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must have a floating dtype, got {t.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"q, k_cache, v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, "
            f"{v_cache.dtype}"
        )
    for name, t in (
        ("block_table", block_table),
        ("cu_seqlens_q", cu_seqlens_q),
        ("seqlens_k", seqlens_k),
    ):
        if _is_float_dtype(t.dtype) or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            "k_cache and v_cache must share [num_blocks, block_size, Hkv], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"k_cache kv heads ({kv_heads}) must divide q heads ({heads})")
    if q.shape[2] != k_cache.shape[3] or q.shape[2] == 0:
        raise ValueError(
            f"q and k_cache head dims must match and be >= 1: {q.shape[2]} vs {k_cache.shape[3]}"
        )
    if k_cache.shape[1] == 0:
        raise ValueError("k_cache block_size (dim 1) must be >= 1")
    batch = block_table.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"cu_seqlens_q must have B+1 = {batch + 1} entries (block_table has B = {batch} rows), "
            f"got {cu_seqlens_q.shape[0]}"
        )
    if seqlens_k.shape[0] != batch:
        raise ValueError(f"seqlens_k must have B = {batch} entries, got {seqlens_k.shape[0]}")
    devices = {t.device for t in (q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k)}
    if len(devices) != 1:
        raise ValueError(
            f"q, caches, block_table, cu_seqlens_q, seqlens_k must be on one device, got {devices}"
        )
    _check_compute_dtype(compute_dtype)


def check_paged_contents(k_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k):
    """Host-side checks of the index contents of a paged-attention call (one sync on CUDA).

    Checks that cu_seqlens_q starts at 0 and does not decrease, that every query length is at most
    max_seqlen_q and at most its key length, that 0 <= seqlens_k[b] <= max_seqlen_k and fits the
    table's capacity (max_blocks * block_size), and that the block ids a sequence uses (the first
    ceil(seqlens_k[b] / block_size) of its row) lie in [0, num_blocks).
    Raises ValueError naming the argument and the first offending sequence.
    """
    num_blocks, block_size = k_cache.shape[:2]
    max_blocks = block_table.shape[1]
    cu = cu_seqlens_q.to("cpu", torch.int64).tolist()
    key_lens = seqlens_k.to("cpu", torch.int64).tolist()
    table = block_table.to("cpu", torch.int64)  # [B, max_blocks]
    if cu and cu[0] != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {cu[0]}")
    for b, nk in enumerate(key_lens):
        nq = cu[b + 1] - cu[b]
        if nq < 0:
            raise ValueError(f"cu_seqlens_q decreases at sequence {b}: {cu[b]} -> {cu[b + 1]}")
        if nq > max_seqlen_q:
            raise ValueError(
                f"sequence {b} has {nq} queries, more than max_seqlen_q = {max_seqlen_q}"
            )
        if not nq <= nk <= max_seqlen_k:
            raise ValueError(
                f"seqlens_k[{b}] = {nk} must be >= its query length {nq} and <= max_seqlen_k = "
                f"{max_seqlen_k}"
            )
        if nk > max_blocks * block_size:
            raise ValueError(
                f"seqlens_k[{b}] = {nk} exceeds the block table's capacity "
                f"{max_blocks} * {block_size}"
            )
        used = table[b, : -(-nk // block_size)]
        bad = (used < 0) | (used >= num_blocks)
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"block_table[{b}, {j}] = {int(used[j])} is outside [0, num_blocks = {num_blocks})"
            )


def _attend_one(q, k, v, visible, scale, compute_dtype, softcap=0.0, slopes=None, distance=None):
    """One sequence: q [H, nq, d], k [Hkv, nk, d], v [Hkv, nk, dv], visible bool [nq, nk];
    softcap (0: off); slopes [H] or None and distance [nq, nk] (|query position - key|) for ALiBi.

    Returns (out [H, nq, dv] in the output dtype, lse [H, nq] in the compute dtype).
    """
    heads, nq, d = q.shape
    kv_heads = k.shape[0]
    cdtype, out_dtype = _dtypes(q.dtype, compute_dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    qc = q.to(cdtype).reshape(kv_heads, heads // kv_heads, nq, d)  # [Hkv, group, nq, d]
    kc = k.to(cdtype).unsqueeze(1)  # [Hkv, 1, nk, d]
    vc = v.to(cdtype).unsqueeze(1)  # [Hkv, 1, nk, dv]
    scores = scale * (qc @ kc.transpose(-1, -2))  # [Hkv, group, nq, nk]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if slopes is not None:
        slopes_c = slopes.to(cdtype).reshape(kv_heads, heads // kv_heads, 1, 1)  # [Hkv, group, 1, 1]
        scores = scores - slopes_c * distance.to(device=scores.device, dtype=cdtype)
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    out, lse = _softmax_times_v(scores, vc)  # [Hkv, group, nq, dv], [Hkv, group, nq, 1]
    return out.reshape(heads, nq, v.shape[-1]).to(out_dtype), lse.reshape(heads, nq)  # nq may be 0


def _assemble(q, dv, covered, outs, lses, compute_dtype, return_lse):
    """Concatenate per-sequence results and pad rows past ``covered`` with out 0 / lse -inf."""
    cdtype, out_dtype = _dtypes(q.dtype, compute_dtype)
    tq, heads = q.shape[:2]
    outs.append(torch.zeros(tq - covered, heads, dv, dtype=out_dtype, device=q.device))
    lses.append(torch.full((heads, tq - covered), float("-inf"), dtype=cdtype, device=q.device))
    out = torch.cat(outs, dim=0)  # [Tq, H, dv]
    if not return_lse:
        return out
    return out, torch.cat(lses, dim=1)  # [H, Tq]


def _dtypes(dtype, compute_dtype):
    """(compute dtype, output dtype) following ``attention``'s convention."""
    if compute_dtype is not None:
        return compute_dtype, compute_dtype
    return (torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype), dtype


def _check_packed(q, k, v, compute_dtype) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_tensor(name, t, 3)
    # As [1, heads, tokens, dim] the dense checks cover heads, dims, token counts, dtypes, devices.
    _check(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), compute_dtype)


def _read_cu_seqlens(name, cu, batch, total):
    """cu_seqlens as a host list, checked: B+1 entries from 0, non-decreasing, last <= total."""
    _require_tensor(name, cu, 1)
    if _is_float_dtype(cu.dtype) or cu.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {cu.dtype}")
    if cu.shape[0] < 1 or (batch is not None and cu.shape[0] != batch + 1):
        want = "at least 1" if batch is None else str(batch + 1)
        raise ValueError(f"{name} must have {want} entries (B+1), got {cu.shape[0]}")
    starts = cu.to("cpu", torch.int64).tolist()
    if starts[0] != 0 or any(b < a for a, b in itertools.pairwise(starts)) or starts[-1] > total:
        raise ValueError(
            f"{name} must start at 0, never decrease and end at or below {total}, got {starts}"
        )
    return starts


def _check_max_seqlen(name, bound, starts):
    longest = max((b - a for a, b in itertools.pairwise(starts)), default=0)
    if isinstance(bound, bool) or not isinstance(bound, numbers.Integral) or bound < longest:
        raise ValueError(
            f"{name} must be an int >= the longest sequence ({longest}), got {bound!r}"
        )


def _require_tensor(name, t, rank) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must be rank-{rank}, got shape {tuple(t.shape)}")


def _is_float_dtype(dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _check_compute_dtype(compute_dtype) -> None:
    if compute_dtype is not None and not (
        isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
    ):
        raise ValueError(f"compute_dtype must be a floating torch.dtype, got {compute_dtype!r}")
