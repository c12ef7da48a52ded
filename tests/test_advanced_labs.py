"""Tests for the CPU attention lab, labs/attention.py (run with `-k attention`).

Inputs are fresh random draws each run; every assertion message carries the seed. To replay a
failure, set TILEATTN_TEST_SEED=<seed>.
"""

import math
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from labs import attention as lab

ROOT = Path(__file__).resolve().parents[1]

# Any NumPy RuntimeWarning (0 * inf, -inf - -inf, ...) fails the test.
pytestmark = pytest.mark.filterwarnings("error")
RAISE = dict(divide="raise", invalid="raise", over="raise")


@pytest.fixture
def seed():
    return int(os.environ.get("TILEATTN_TEST_SEED", np.random.SeedSequence().generate_state(1)[0]))


def draw(seed, nq, nk, d, dv):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((nq, d))  # (queries, dim)
    k = rng.standard_normal((nk, d))  # (keys, dim)
    v = rng.standard_normal((nk, dv))  # (keys, value_dim)
    grad_out = rng.standard_normal((nq, dv))  # (queries, value_dim)
    return q, k, v, grad_out


def dense(q, k, v, grad_out, causal=False, offset=0):
    """Independent dense forward and backward (every row must see at least one key)."""
    s = q @ k.T / math.sqrt(q.shape[1])  # (queries, keys)
    if causal:
        visible = np.arange(k.shape[0])[None, :] <= np.arange(q.shape[0])[:, None] + offset
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=1, keepdims=True)  # (queries, 1)
    e = np.exp(s - m)  # (queries, keys)
    p = e / e.sum(axis=1, keepdims=True)  # (queries, keys)
    out = p @ v  # (queries, value_dim)
    lse = m[:, 0] + np.log(e.sum(axis=1))  # (queries,)
    dp = grad_out @ v.T  # (queries, keys)
    ds = p * (dp - (p * dp).sum(axis=1, keepdims=True))  # softmax Jacobian, not via dO . O
    scale = 1 / math.sqrt(q.shape[1])
    return out, lse, (scale * ds @ k, scale * ds.T @ q, p.T @ grad_out)


def run_lab(q, k, v, grad_out, **kw):
    out, lse = lab.online_attention(q, k, v, **kw)
    return out, lse, lab.attention_backward(q, k, v, out, lse, grad_out, **kw)


def close(actual, expected, seed, what, tol=1e-11):
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol, err_msg=f"{what}, seed={seed}")


@pytest.mark.parametrize("causal", [False, True])
def test_attention_tile_sizes_agree(seed, causal):
    q, k, v, g = draw(seed, 13, 19, 8, 5)
    ref_out, ref_lse, ref_grads = run_lab(q, k, v, g, tile=1, causal=causal, query_offset=2)
    for tile in (4, 19 + 7):
        out, lse, grads = run_lab(q, k, v, g, tile=tile, causal=causal, query_offset=2)
        close(out, ref_out, seed, f"output tile={tile}")
        close(lse, ref_lse, seed, f"lse tile={tile}")
        for name, a, b in zip("qkv", grads, ref_grads):
            close(a, b, seed, f"d{name} tile={tile}")


@pytest.mark.parametrize("nq,nk,tile", [(16, 16, 4), (7, 23, 5), (23, 7, 32), (1, 1, 1)])
def test_attention_matches_dense(seed, nq, nk, tile):
    q, k, v, g = draw(seed, nq, nk, 6, 3)
    out, lse, grads = run_lab(q, k, v, g, tile=tile)
    d_out, d_lse, d_grads = dense(q, k, v, g)
    close(out, d_out, seed, "output")
    close(lse, d_lse, seed, "lse")
    for name, a, b in zip("qkv", grads, d_grads):
        close(a, b, seed, f"d{name}")


@pytest.mark.parametrize(
    "nq,nk,offset", [(9, 9, 0), (6, 14, 8), (14, 6, 0), (5, 11, 3), (4, 4, 10)]
)
def test_attention_causal_with_and_without_offset(seed, nq, nk, offset):
    q, k, v, g = draw(seed, nq, nk, 4, 7)
    out, lse, grads = run_lab(q, k, v, g, tile=4, causal=True, query_offset=offset)
    d_out, d_lse, d_grads = dense(q, k, v, g, causal=True, offset=offset)
    close(out, d_out, seed, "output")
    close(lse, d_lse, seed, "lse")
    for name, a, b in zip("qkv", grads, d_grads):
        close(a, b, seed, f"d{name}")
    # Causal must actually mask: the last key is invisible to query 0 whenever nk - 1 > offset.
    if nk - 1 > offset:
        out_all, _ = lab.online_attention(q, k, v, tile=4)
        assert not np.allclose(out[0], out_all[0]), f"causal mask had no effect, seed={seed}"


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("causal,offset", [(False, 0), (True, 0), (True, 3)])
def test_attention_finite_differences(seed, which, causal, offset):
    q, k, v, g = draw(seed, 7, 10, 5, 4)
    kw = dict(tile=3, causal=causal, query_offset=offset)
    inputs = dict(q=q, k=k, v=v)
    out, lse = lab.online_attention(q, k, v, **kw)
    grad = dict(zip("qkv", lab.attention_backward(q, k, v, out, lse, g, **kw)))[which]

    def loss(x):  # scalar <grad_out, output(inputs with `which` replaced by x)>
        return np.sum(g * lab.online_attention(**{**inputs, which: x}, **kw)[0])

    rng = np.random.default_rng(seed + 1)
    for _ in range(3):
        direction = rng.standard_normal(inputs[which].shape)
        direction /= np.linalg.norm(direction)
        step = 1e-5 * direction
        numeric = (loss(inputs[which] + step) - loss(inputs[which] - step)) / 2e-5
        analytic = np.sum(grad * direction)
        assert abs(numeric - analytic) <= 1e-7 * (1 + abs(analytic)), (
            f"d{which}: finite difference {numeric} vs <grad, dir> {analytic}, seed={seed}"
        )


@pytest.mark.parametrize("causal", [False, True])
def test_attention_fully_masked_rows_zero_keys(seed, causal):
    """With query_offset >= 0 a row can only see nothing when there are no keys at all."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((5, 3))  # (queries, dim)
    k, v = np.zeros((0, 3)), np.zeros((0, 2))  # (0, dim), (0, value_dim)
    g = rng.standard_normal((5, 2))  # (queries, value_dim)
    with np.errstate(**RAISE):
        out, lse = lab.online_attention(q, k, v, tile=2, causal=causal)
        dq, dk, dv = lab.attention_backward(q, k, v, out, lse, g, tile=2, causal=causal)
    assert out.shape == (5, 2) and np.array_equal(out, np.zeros((5, 2)))
    assert lse.shape == (5,) and np.all(np.isneginf(lse))
    assert np.array_equal(dq, np.zeros_like(q)) and dk.shape == (0, 3) and dv.shape == (0, 2)


def test_attention_fully_masked_tiles_in_step(seed):
    """The step function itself: a row whose tiles are all -inf keeps m=-inf, l=0, o=0, then
    recovers cleanly when a later tile shows it a key; finalize gives 0 / -inf for unseen rows."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((2, 3))  # (tile_keys, value_dim)
    state = lab.initial_state(3, 3)
    masked = np.array([[-np.inf, -np.inf], [0.5, -np.inf], [-np.inf, -np.inf]])  # (rows, tile)
    with np.errstate(**RAISE):
        state = lab.online_softmax_step(state, masked, values)
        assert np.isneginf(state.m[0]) and state.l[0] == 0 and not state.o[0].any()
        later = np.array([[2.0, -np.inf], [0.5, 0.5], [-np.inf, -np.inf]])  # (rows, tile)
        state = lab.online_softmax_step(state, later, values)
        out, lse = lab.finalize(state)
    close(out[0], values[0], seed, "row 0 saw exactly one key")
    close(lse[0], 2.0, seed, "row 0 lse")
    close(out[1], (2 * values[0] + values[1]) / 3, seed, "row 1 mean of seen values")
    assert np.array_equal(out[2], np.zeros(3)) and np.isneginf(lse[2])


def test_attention_backward_ignores_rows_marked_masked(seed):
    """Backward policy: a row with log_normalizer -inf gets zero gradient and adds nothing."""
    q, k, v, g = draw(seed, 4, 6, 3, 2)
    out, lse = lab.online_attention(q, k, v)
    lse[1], out[1] = -np.inf, 0.0
    with np.errstate(**RAISE):
        dq, dk, dv = lab.attention_backward(q, k, v, out, lse, g)
    keep = [0, 2, 3]
    _, _, (dq3, dk3, dv3) = dense(q[keep], k, v, g[keep])
    assert np.array_equal(dq[1], np.zeros(3))
    close(dq[keep], dq3, seed, "dq of live rows")
    close(dk, dk3, seed, "dk without the masked row")
    close(dv, dv3, seed, "dv without the masked row")


def test_attention_two_tile_scalar_example(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    v1, v2 = rng.standard_normal((1, 3)), rng.standard_normal((1, 3))  # (1 key, value_dim)
    e = math.exp(-1)

    state = lab.online_softmax_step(lab.initial_state(1, 3), np.array([[1000.0]]), v1)
    assert state.m[0] == 1000.0 and state.l[0] == 1.0
    close(state.o, v1, seed, "o after tile 1")
    state = lab.online_softmax_step(state, np.array([[1001.0]]), v2)
    assert state.m[0] == 1001.0
    close(state.l[0], e + 1, seed, "l after tile 2")
    close(state.o, e * v1 + v2, seed, "o after tile 2: first contribution rescaled by exp(-1)")

    # The same through online_attention, spying on the states its steps produce.
    seen = []

    def spy(state, scores, values):
        new = real_step(state, scores, values)
        seen.append(new)
        return new

    real_step = lab.online_softmax_step
    monkeypatch.setattr(lab, "online_softmax_step", spy)
    q, k = np.array([[1.0]]), np.array([[1000.0], [1001.0]])  # dim 1: scale 1, scores 1000, 1001
    out, lse = lab.online_attention(q, k, np.vstack([v1, v2]), tile=1)
    assert [s.m[0] for s in seen] == [1000.0, 1001.0]
    assert [s.l[0] for s in seen][0] == 1.0
    close(seen[1].l[0], e + 1, seed, "l in online_attention")
    close(out[0], (e * v1[0] + v2[0]) / (e + 1), seed, "output")
    close(lse[0], 1001 + math.log1p(e), seed, "log-normalizer")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_attention_accepts_float_dtypes_returns_float64(seed, dtype):
    q, k, v, g = (x.astype(dtype) for x in draw(seed, 5, 6, 4, 3))
    out, lse, grads = run_lab(q, k, v, g, tile=4, causal=True)
    up = [x.astype(np.float64) for x in (q, k, v, g)]
    d_out, d_lse, d_grads = dense(*up, causal=True)
    assert out.dtype == lse.dtype == np.float64 and all(x.dtype == np.float64 for x in grads)
    close(out, d_out, seed, "output")
    for name, a, b in zip("qkv", grads, d_grads):
        close(a, b, seed, f"d{name}")


def test_attention_memory_is_linear_in_sequence_length(seed):
    """A queries x keys float64 matrix would take 8 MiB; the tiled passes stay far below."""
    q, k, v, g = draw(seed, 1024, 1024, 4, 4)
    tracemalloc.start()
    try:
        out, lse = lab.online_attention(q, k, v, tile=32, causal=True)
        _, fwd_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        lab.attention_backward(q, k, v, out, lse, g, tile=32, causal=True)
        _, bwd_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    full = 1024 * 1024 * 8
    assert fwd_peak < full / 8 and bwd_peak < full / 8, (fwd_peak, bwd_peak)


def _bad_forward_cases():
    q, k, v = np.ones((3, 4)), np.ones((5, 4)), np.ones((5, 2))
    nan_k, inf_v = k.copy(), v.copy()
    nan_k[1, 1], inf_v[0, 0] = np.nan, np.inf
    return [
        ("rank-1 q", dict(q=np.ones(4), k=k, v=v), "q must be rank-2"),
        ("rank-3 k", dict(q=q, k=np.ones((1, 5, 4)), v=v), "k must be rank-2"),
        ("integer q", dict(q=np.ones((3, 4), dtype=int), k=k, v=v), "q must be a floating"),
        ("complex v", dict(q=q, k=k, v=v + 0j), "v must be a floating"),
        ("NaN in k", dict(q=q, k=nan_k, v=v), "k must be finite"),
        ("inf in v", dict(q=q, k=k, v=inf_v), "v must be finite"),
        ("dim mismatch", dict(q=q, k=np.ones((5, 3)), v=v), "same dim"),
        ("key mismatch", dict(q=q, k=k, v=np.ones((4, 2))), "same number of keys"),
        ("zero dim", dict(q=np.ones((3, 0)), k=np.ones((5, 0)), v=v), "dim >= 1"),
        ("tile 0", dict(q=q, k=k, v=v, tile=0), "tile must be an int >= 1"),
        ("tile float", dict(q=q, k=k, v=v, tile=2.0), "tile must be an int"),
        ("tile bool", dict(q=q, k=k, v=v, tile=True), "tile must be an int"),
        ("negative offset", dict(q=q, k=k, v=v, query_offset=-1), "query_offset must be an int >="),
        ("float offset", dict(q=q, k=k, v=v, query_offset=1.0), "query_offset must be an int"),
    ]


@pytest.mark.parametrize("case", _bad_forward_cases(), ids=lambda c: c[0])
def test_attention_invalid_inputs_forward_and_backward(case):
    _, kwargs, message = case
    with pytest.raises(ValueError, match=message):
        lab.online_attention(**kwargs)
    o, lse = np.zeros((3, 2)), np.zeros(3)
    with pytest.raises(ValueError, match=message):
        lab.attention_backward(output=o, log_normalizer=lse, grad_output=o, **kwargs)


@pytest.mark.parametrize(
    "what,message",
    [
        (dict(output=np.zeros((3, 3))), "output must have shape"),
        (dict(output=np.full((3, 2), np.nan)), "output must be finite"),
        (dict(grad_output=np.zeros((2, 2))), "grad_output shape"),
        (dict(grad_output=np.zeros((3, 2), dtype=np.int32)), "grad_output must be a floating"),
        (dict(log_normalizer=np.zeros(4)), r"log_normalizer must have shape \(3,\)"),
        (dict(log_normalizer=np.zeros((3, 1))), "log_normalizer must have shape"),
        (dict(log_normalizer=np.array([0.0, np.nan, 0.0])), "log_normalizer must not contain NaN"),
        (dict(log_normalizer=np.array([0.0, np.inf, 0.0])), r"\+inf"),
    ],
    ids=lambda x: str(x)[:40],
)
def test_attention_invalid_backward_only_inputs(what, message):
    args = dict(
        q=np.ones((3, 4)), k=np.ones((5, 4)), v=np.ones((5, 2)),
        output=np.zeros((3, 2)), log_normalizer=np.zeros(3), grad_output=np.zeros((3, 2)),
    )
    with pytest.raises(ValueError, match=message):
        lab.attention_backward(**{**args, **what})


def test_attention_module_runs_as_script():
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "labs.attention"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "output (6, 4)" in result.stdout and "dk (10, 8)" in result.stdout, result.stdout
