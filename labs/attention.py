"""Tiled online-softmax attention in NumPy: forward and memory-efficient backward.

Single head. q is (queries, dim), k is (keys, dim), v is (keys, value_dim); the scale is
1/sqrt(dim). Query i may see key j always, or, with ``causal=True``, only when
j <= i + query_offset (absolute query positions start at ``query_offset``).

Forward (``online_attention``)
    Keys are visited one tile of ``tile`` keys at a time. Every query row keeps three numbers
    (well, two numbers and a vector):

    * m: the running maximum of the scores seen so far (-inf before any visible key),
    * l: the normalizer, sum_j exp(s_j - m),
    * o: the unnormalized accumulator, sum_j exp(s_j - m) * v_j.

    For a new tile with scores s (masked scores already set to -inf, so they never raise the
    maximum and add exp(-inf) = 0 to the sums):

        m_new = max(m_old, max_j s_j)
        l_new = exp(m_old - m_new) * l_old + sum_j exp(s_j - m_new)
        o_new = exp(m_old - m_new) * o_old + sum_j exp(s_j - m_new) * v_j

    The factor exp(m_old - m_new) <= 1 rescales what was accumulated against the old maximum,
    so no exponent is ever positive and nothing overflows. At the end output = o / l and the
    log-normalizer (log-sum-exp of the row's scores) is m + log(l). Only O(queries * tile)
    scores exist at any time; the queries x keys matrix is never built.

Backward (``attention_backward``)
    With P = softmax(S), S = scale * Q K^T and dO the gradient of the output:

        dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D),  dQ = scale * dS K,  dK = scale * dS^T Q

    where D_i = sum_j P_ij dP_ij = sum_c dO[i, c] * O[i, c] (the row correction, computed once
    from O and dO). Each (query tile, key tile) block of P is recomputed from the saved
    log-normalizer as exp(S_block - log_normalizer), so again no queries x keys array exists.

Fully masked rows (a query that sees no key; with query_offset >= 0 this happens only when there
are zero keys, or inside ``online_softmax_step`` when a tile is entirely masked): output 0,
log-normalizer -inf, gradients 0, and no NaN or NumPy RuntimeWarning on the way.

Dtypes: inputs may be any floating dtype (float16/32/64); everything is computed in float64 and
**all results are returned as float64**, so the lab can serve as a high-precision oracle.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "SoftmaxState",
    "initial_state",
    "online_softmax_step",
    "finalize",
    "online_attention",
    "attention_backward",
]


class SoftmaxState(NamedTuple):
    """Running online-softmax state for a block of query rows."""

    m: np.ndarray  # (rows,) running max of scores seen; -inf while a row has seen nothing
    l: np.ndarray  # (rows,) sum of exp(score - m)
    o: np.ndarray  # (rows, value_dim) sum of exp(score - m) * value


def initial_state(rows: int, value_dim: int) -> SoftmaxState:
    """The state before any key: m = -inf, l = 0, o = 0 (float64)."""
    return SoftmaxState(
        m=np.full(rows, -np.inf),  # (rows,)
        l=np.zeros(rows),  # (rows,)
        o=np.zeros((rows, value_dim)),  # (rows, value_dim)
    )


def online_softmax_step(
    state: SoftmaxState, scores_tile: np.ndarray, values_tile: np.ndarray
) -> SoftmaxState:
    """Fold one tile of keys into the running state.

    scores_tile is (rows, tile_keys), already scaled, with masked entries set to -inf;
    values_tile is (tile_keys, value_dim). Returns the new state (the old one is not modified).
    A row whose every score so far is -inf keeps m = -inf, l = 0, o = 0.
    """
    m_old, l_old, o_old = state
    tile_max = scores_tile.max(axis=1, initial=-np.inf)  # (rows,)
    m_new = np.maximum(m_old, tile_max)  # (rows,)
    # Rows that still have seen nothing have m_new = -inf; shift them by 0 instead, so that
    # -inf - (-inf) = NaN never happens. Their exponentials are exp(-inf) = 0 either way.
    shift = np.where(np.isneginf(m_new), 0.0, m_new)  # (rows,)
    rescale = np.exp(m_old - shift)  # (rows,) = exp(m_old - m_new), 0 when m_old = -inf
    p = np.exp(scores_tile - shift[:, None])  # (rows, tile_keys), masked -> 0
    l_new = rescale * l_old + p.sum(axis=1)  # (rows,)
    o_new = rescale[:, None] * o_old + p @ values_tile  # (rows, value_dim)
    return SoftmaxState(m_new, l_new, o_new)


def finalize(state: SoftmaxState) -> tuple[np.ndarray, np.ndarray]:
    """Turn a state into (output (rows, value_dim), log_normalizer (rows,)).

    Rows that saw no key get output 0 and log-normalizer -inf.
    """
    seen = state.l > 0  # (rows,)
    l_safe = np.where(seen, state.l, 1.0)  # (rows,)
    output = state.o / l_safe[:, None]  # (rows, value_dim); o is 0 on unseen rows
    log_normalizer = np.where(seen, state.m + np.log(l_safe), -np.inf)  # (rows,)
    return output, log_normalizer


def online_attention(q, k, v, tile=32, causal=False, query_offset=0):
    """Tiled online-softmax attention forward for one head.

    q: (queries, dim), k: (keys, dim), v: (keys, value_dim); any floating dtype, finite.
    Keys are processed ``tile`` at a time. With ``causal``, query i sees key j iff
    j <= i + query_offset. Returns (output (queries, value_dim), log_normalizer (queries,)),
    both float64; log_normalizer[i] = logsumexp_j(scale * q_i . k_j) over visible keys
    (-inf for a row that sees none, whose output is 0).

    Raises ValueError for non-floating, non-rank-2 or non-finite inputs, incompatible shapes,
    tile not an int >= 1, or query_offset not an int >= 0.
    """
    q, k, v = _check_qkv(q, k, v)
    _check_int("tile", tile, minimum=1)
    _check_int("query_offset", query_offset, minimum=0)
    queries, dim = q.shape
    scale = 1.0 / math.sqrt(dim)
    rows = np.arange(queries)  # (queries,)
    # Under the causal mask no query sees a key at position >= queries + query_offset.
    keys = min(k.shape[0], queries + query_offset) if causal else k.shape[0]

    state = initial_state(queries, v.shape[1])
    for start in range(0, keys, tile):
        stop = min(start + tile, keys)
        scores = scale * (q @ k[start:stop].T)  # (queries, stop - start)
        if causal:
            visible = _causal_visible(rows, start, stop, query_offset)  # (queries, stop - start)
            scores = np.where(visible, scores, -np.inf)
        state = online_softmax_step(state, scores, v[start:stop])
    return finalize(state)


def attention_backward(
    q, k, v, output, log_normalizer, grad_output, tile=32, causal=False, query_offset=0
):
    """Memory-efficient attention backward for one head.

    Takes the forward's inputs, its ``output`` (queries, value_dim) and ``log_normalizer``
    (queries,), and ``grad_output`` (queries, value_dim). Probability blocks of tile x tile are
    recomputed as exp(scores - log_normalizer); no queries x keys array is allocated. Rows with
    log_normalizer = -inf (fully masked) contribute nothing. Returns (dq, dk, dv) shaped like
    q, k, v, in float64.

    Raises ValueError as ``online_attention`` does, and also when output or grad_output is not
    (queries, value_dim) and finite, or log_normalizer is not (queries,) without NaN or +inf.
    """
    q, k, v = _check_qkv(q, k, v)
    _check_int("tile", tile, minimum=1)
    _check_int("query_offset", query_offset, minimum=0)
    queries, dim = q.shape
    keys, value_dim = v.shape
    output = _check_matrix("output", output)  # (queries, value_dim)
    grad_output = _check_matrix("grad_output", grad_output)  # (queries, value_dim)
    if output.shape != (queries, value_dim):
        raise ValueError(
            f"output must have shape (queries, value_dim) = {(queries, value_dim)}, "
            f"got {output.shape}"
        )
    if grad_output.shape != output.shape:
        raise ValueError(
            f"grad_output shape {grad_output.shape} must equal output shape {output.shape}"
        )
    lse = _check_log_normalizer(log_normalizer, queries)  # (queries,)

    scale = 1.0 / math.sqrt(dim)
    row_correction = np.sum(grad_output * output, axis=1)  # (queries,) D_i = dO_i . O_i
    # exp(s - inf) = 0 (also for s = -inf), so fully masked rows get all-zero probabilities.
    lse_safe = np.where(np.isneginf(lse), np.inf, lse)  # (queries,)
    dq = np.zeros_like(q)  # (queries, dim)
    dk = np.zeros_like(k)  # (keys, dim)
    dv = np.zeros_like(v)  # (keys, value_dim)

    for k0 in range(0, keys, tile):
        k1 = min(k0 + tile, keys)
        k_tile, v_tile = k[k0:k1], v[k0:k1]  # (tk, dim), (tk, value_dim)
        for q0 in range(0, queries, tile):
            q1 = min(q0 + tile, queries)
            if causal and k0 > q1 - 1 + query_offset:
                continue  # the whole block lies above the diagonal: every score masked
            q_tile, do_tile = q[q0:q1], grad_output[q0:q1]  # (tq, dim), (tq, value_dim)
            scores = scale * (q_tile @ k_tile.T)  # (tq, tk)
            if causal:
                visible = _causal_visible(np.arange(q0, q1), k0, k1, query_offset)  # (tq, tk)
                scores = np.where(visible, scores, -np.inf)
            p = np.exp(scores - lse_safe[q0:q1, None])  # (tq, tk)
            dv[k0:k1] += p.T @ do_tile
            dp = do_tile @ v_tile.T  # (tq, tk)
            ds = p * (dp - row_correction[q0:q1, None])  # (tq, tk)
            dq[q0:q1] += scale * (ds @ k_tile)
            dk[k0:k1] += scale * (ds.T @ q_tile)
    return dq, dk, dv


def _causal_visible(query_rows: np.ndarray, start: int, stop: int, offset: int) -> np.ndarray:
    """(len(query_rows), stop - start) bool: key j visible to query i iff j <= i + offset."""
    key_cols = np.arange(start, stop)  # (stop - start,)
    return key_cols[None, :] <= query_rows[:, None] + offset


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")


def _check_matrix(name: str, x) -> np.ndarray:
    """Validate a rank-2 finite floating array and return it as float64."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be rank-2, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must be finite, but it contains NaN or inf")
    return x.astype(np.float64, copy=False)


def _check_qkv(q, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q, k, v = _check_matrix("q", q), _check_matrix("k", k), _check_matrix("v", v)
    if q.shape[1] < 1:
        raise ValueError(f"q must have dim >= 1, got shape {q.shape}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"q and k must have the same dim, got q {q.shape} and k {k.shape}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v and k must have the same number of keys, got v {v.shape}, k {k.shape}")
    return q, k, v


def _check_log_normalizer(log_normalizer, queries: int) -> np.ndarray:
    lse = np.asarray(log_normalizer)
    if not np.issubdtype(lse.dtype, np.floating):
        raise ValueError(f"log_normalizer must be floating point, got dtype {lse.dtype}")
    if lse.shape != (queries,):
        raise ValueError(f"log_normalizer must have shape ({queries},), got {lse.shape}")
    if np.isnan(lse).any() or np.isposinf(lse).any():
        raise ValueError("log_normalizer must not contain NaN or +inf (-inf marks masked rows)")
    return lse.astype(np.float64, copy=False)


def _demo() -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 8))  # (queries, dim)
    k = rng.standard_normal((10, 8))  # (keys, dim)
    v = rng.standard_normal((10, 4))  # (keys, value_dim)
    kw = dict(tile=4, causal=True, query_offset=4)
    out, lse = online_attention(q, k, v, **kw)
    grad_out = rng.standard_normal(out.shape)  # (queries, value_dim)
    dq, dk, dv = attention_backward(q, k, v, out, lse, grad_out, **kw)
    print("causal attention, 6 queries at positions 4..9 over 10 keys, tile 4")
    print(f"output {out.shape}  log_normalizer {lse.shape}")
    print(f"dq {dq.shape}  dk {dk.shape}  dv {dv.shape}")


if __name__ == "__main__":
    _demo()
