"""Tests for the dense torch oracle, tileattn.reference.attention.

Checked against the NumPy lab (per head, float64), against PyTorch SDPA's math backend, and
against itself with repeated kv heads. Inputs are fresh random draws each run; every assertion
message carries the seed (replay with TILEATTN_TEST_SEED=<seed>).
"""

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from labs import attention as lab
from tileattn.reference import attention

pytestmark = pytest.mark.filterwarnings("error")


@pytest.fixture
def seed():
    return int(os.environ.get("TILEATTN_TEST_SEED", np.random.SeedSequence().generate_state(1)[0]))


def draw(seed, b, h, hkv, nq, nk, d, dv=None, dtype=torch.float64, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=gen, dtype=torch.float64)  # [B, H, Nq, d]
    k = torch.randn(b, hkv, nk, d, generator=gen, dtype=torch.float64)  # [B, Hkv, Nk, d]
    v = torch.randn(b, hkv, nk, dv or d, generator=gen, dtype=torch.float64)  # [B, Hkv, Nk, dv]
    return tuple(x.to(dtype).requires_grad_(grad) for x in (q, k, v))


def randn_like_seeded(t, seed):
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed), dtype=t.dtype)


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def lab_per_head(q, k, v, grad_out, causal):
    """(out, lse, dq, dk, dv) from the NumPy lab, head by head, bottom-right causal alignment."""
    b, h, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    dv_dim = v.shape[-1]
    out = np.zeros((b, h, nq, dv_dim))  # [B, H, Nq, dv]
    lse = np.full((b, h, nq), -np.inf)  # [B, H, Nq]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    # query i sees key j iff j <= i + (nk - nq): rows i < nq - nk see nothing, the rest are the
    # lab with query_offset = max(nk - nq, 0) on the remaining rows.
    first = max(nq - nk, 0) if causal else 0
    offset = max(nk - nq, 0) if causal else 0
    qn, kn, vn, gn = (x.detach().double().numpy() for x in (q, k, v, grad_out))
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hkv)
            args = (qn[bi, hi, first:], kn[bi, kh], vn[bi, kh])
            o, l = lab.online_attention(*args, tile=8, causal=causal, query_offset=offset)
            gq, gk, gv = lab.attention_backward(
                *args, o, l, gn[bi, hi, first:], tile=8, causal=causal, query_offset=offset
            )
            out[bi, hi, first:], lse[bi, hi, first:] = o, l
            dq[bi, hi, first:] = gq
            dk[bi, kh] += gk
            dv[bi, kh] += gv
    return out, lse, dq, dk, dv


@pytest.mark.parametrize(
    "nq,nk,causal", [(9, 9, False), (9, 9, True), (5, 12, True), (12, 5, False), (12, 5, True)]
)
def test_matches_lab_forward_and_gradients(seed, nq, nk, causal):
    q, k, v = draw(seed, 2, 4, 2, nq, nk, 8, 6, grad=True)
    out, lse = attention(q, k, v, causal=causal)
    grad_out = randn_like_seeded(out, seed + 1)  # [B, H, Nq, dv]
    out.backward(grad_out)
    l_out, l_lse, l_dq, l_dk, l_dv = lab_per_head(q, k, v, grad_out, causal)
    msg = f"seed={seed}"
    torch.testing.assert_close(out, torch.from_numpy(l_out), rtol=1e-10, atol=1e-12, msg=msg)
    torch.testing.assert_close(lse, torch.from_numpy(l_lse), rtol=1e-10, atol=1e-12, msg=msg)
    for name, t, ref in (("dq", q, l_dq), ("dk", k, l_dk), ("dv", v, l_dv)):
        torch.testing.assert_close(
            t.grad, torch.from_numpy(ref), rtol=1e-9, atol=1e-11, msg=f"{name} {msg}"
        )


def sdpa_math(q, k, v, causal, scale=None):
    """SDPA (math backend) with repeated kv heads and a bottom-right causal boolean mask."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    nq, nk = q.shape[2], k.shape[2]
    mask = None
    if causal:
        mask = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)  # [Nq, Nk]
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize(
    "h,hkv,nq,nk,causal,scale",
    [(4, 4, 16, 16, False, None), (4, 2, 7, 19, False, 0.3), (4, 1, 5, 13, True, None),
     (8, 2, 13, 13, True, 1.7), (2, 2, 1, 9, True, None)],
)
def test_matches_sdpa_math(seed, h, hkv, nq, nk, causal, scale):
    q, k, v = draw(seed, 2, h, hkv, nq, nk, 16, 8)
    out, _ = attention(q, k, v, causal=causal, scale=scale)
    expected = sdpa_math(q, k, v, causal, scale)
    assert rel_err(out, expected) < 1e-12, f"seed={seed}"
    if causal and nq == nk:  # SDPA's own is_causal is top-left aligned: equal only when square
        with sdpa_kernel(SDPBackend.MATH):
            kr, vr = (x.repeat_interleave(h // hkv, dim=1) for x in (k, v))
            top_left = F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=scale)
        assert rel_err(out, top_left) < 1e-12, f"seed={seed}"


@pytest.mark.parametrize("hkv", [8, 2, 1])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_equals_repeated_kv(seed, hkv, causal):
    q, k, v = draw(seed, 2, 8, hkv, 6, 11, 8, 4, grad=True)
    group = 8 // hkv
    k_rep = k.detach().repeat_interleave(group, dim=1).requires_grad_()  # [B, H, Nk, d]
    v_rep = v.detach().repeat_interleave(group, dim=1).requires_grad_()  # [B, H, Nk, dv]
    q2 = q.detach().clone().requires_grad_()
    out, lse = attention(q, k, v, causal=causal)
    out_rep, lse_rep = attention(q2, k_rep, v_rep, causal=causal)
    msg = f"seed={seed}"
    torch.testing.assert_close(out, out_rep, rtol=1e-12, atol=1e-13, msg=msg)
    torch.testing.assert_close(lse, lse_rep, rtol=1e-12, atol=1e-13, msg=msg)
    g = randn_like_seeded(out, seed + 1)  # [B, H, Nq, dv]
    (out * g).sum().backward()
    (out_rep * g).sum().backward()
    # kv head j serves query heads j*group .. j*group+group-1: its gradient is their sum.
    sum_groups = lambda t: t.unflatten(1, (hkv, group)).sum(2)  # noqa: E731
    torch.testing.assert_close(q.grad, q2.grad, rtol=1e-12, atol=1e-13, msg=msg)
    torch.testing.assert_close(k.grad, sum_groups(k_rep.grad), rtol=1e-11, atol=1e-12, msg=msg)
    torch.testing.assert_close(v.grad, sum_groups(v_rep.grad), rtol=1e-11, atol=1e-12, msg=msg)
    assert rel_err(out, sdpa_math(q, k, v, causal)) < 1e-12, msg


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fully_masked_rows_zero_output_and_gradients(seed, dtype):
    nq, nk = 9, 4  # causal, bottom-right: rows 0..4 see no key
    q, k, v = draw(seed, 1, 2, 1, nq, nk, 8, dtype=dtype, grad=True)
    out, lse = attention(q, k, v, causal=True)
    dead = nq - nk
    assert torch.all(out[:, :, :dead] == 0) and torch.all(torch.isneginf(lse[:, :, :dead]))
    assert torch.all(torch.isfinite(out)) and torch.all(torch.isfinite(lse[:, :, dead:]))
    # Gradients through both out and the finite part of lse.
    loss = out.float().sum() + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).sum()
    loss.backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert torch.all(torch.isfinite(t.grad)), f"d{name} not finite, seed={seed}"
    assert torch.all(q.grad[:, :, :dead] == 0), f"dq of masked rows not 0, seed={seed}"
    assert torch.any(q.grad[:, :, dead:] != 0), f"seed={seed}"


def test_zero_keys_all_rows_masked(seed):
    q, k, v = draw(seed, 1, 2, 2, 3, 0, 4, grad=True)
    out, lse = attention(q, k, v)
    assert out.shape == (1, 2, 3, 4) and torch.all(out == 0) and torch.all(torch.isneginf(lse))
    out.sum().backward()
    assert torch.all(q.grad == 0)


@pytest.mark.parametrize("causal,nq,nk", [(False, 3, 4), (True, 4, 4), (True, 3, 5), (True, 5, 3)])
def test_gradcheck_float64(causal, nq, nk):
    q, k, v = draw(1234 + nq * nk, 1, 2, 1, nq, nk, 3, 2, grad=True)

    def fn(q, k, v):
        out, lse = attention(q, k, v, causal=causal)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_logits(seed, dtype):
    # Scores of order 1e4: naive exp overflows; the max-shifted softmax must not.
    q, k, v = draw(seed, 1, 2, 2, 8, 10, 16)
    q, k = 100 * q / q.norm(dim=-1, keepdim=True) * 4, 100 * k / k.norm(dim=-1, keepdim=True) * 4
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, lse = attention(q, k, v, causal=True)
    assert torch.all(torch.isfinite(out)) and torch.all(torch.isfinite(lse)), f"seed={seed}"
    assert lse.abs().max() > 1e3, "the test should actually produce large scores"
    l_out, l_lse, *_ = lab_per_head(q, k, v, torch.zeros(out.shape), causal=True)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_err(out, torch.from_numpy(l_out)) < tol * 100, f"seed={seed}"
    assert rel_err(lse, torch.from_numpy(l_lse)) < tol, f"seed={seed}"


def test_extreme_logits_closed_form():
    # d = 1, scale 1: scores are exactly 1e4 + (0, -1, -2); lse = 1e4 + log(1 + e^-1 + e^-2).
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    k = torch.tensor([1e4, 1e4 - 1, 1e4 - 2], dtype=torch.float64).view(1, 1, 3, 1)
    v = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64).view(1, 1, 3, 1)
    out, lse = attention(q, k, v, scale=1.0)
    w = torch.tensor([1.0, math.exp(-1), math.exp(-2)], dtype=torch.float64)
    torch.testing.assert_close(lse[0, 0, 0], 1e4 + torch.log(w.sum()))
    torch.testing.assert_close(out[0, 0, 0, 0], (w * v.flatten()).sum() / w.sum())


@pytest.mark.parametrize("nq", [1, 17, 33, 127])
@pytest.mark.parametrize("nk", [1, 17, 33, 127])
def test_edge_sizes(seed, nq, nk):
    q, k, v = draw(seed, 1, 2, 1, nq, nk, 8, 5)
    for causal in (False, True):
        out, lse = attention(q, k, v, causal=causal)
        l_out, l_lse, *_ = lab_per_head(q, k, v, torch.zeros(out.shape), causal)
        assert torch.equal(torch.isneginf(lse), torch.from_numpy(np.isneginf(l_lse)))
        tol = dict(rtol=1e-10, atol=1e-12, msg=f"causal={causal} seed={seed}")
        torch.testing.assert_close(out, torch.from_numpy(l_out), **tol)
        torch.testing.assert_close(lse, torch.from_numpy(l_lse), **tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)])
def test_half_precision_inputs(seed, dtype, tol):
    q, k, v = draw(seed, 2, 4, 2, 19, 23, 16, dtype=dtype, grad=True)
    out, lse = attention(q, k, v, causal=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = attention(*(x.detach().double() for x in (q, k, v)), causal=True)
    assert rel_err(out, ref_out) < tol, f"seed={seed}"
    assert rel_err(lse, ref_lse) < 1e-5, f"seed={seed}"
    out.float().sum().backward()
    assert q.grad.dtype == dtype and all(torch.all(torch.isfinite(t.grad)) for t in (q, k, v))
    out64, lse64 = attention(q, k, v, causal=True, compute_dtype=torch.float64)
    assert out64.dtype == lse64.dtype == torch.float64
    assert rel_err(out64, ref_out) < 1e-12, f"seed={seed}"


@pytest.mark.parametrize(
    "dtype,compute,out_dtype,lse_dtype",
    [(torch.float32, None, torch.float32, torch.float32),
     (torch.float64, None, torch.float64, torch.float64),
     (torch.float32, torch.float64, torch.float64, torch.float64),
     (torch.float64, torch.float32, torch.float32, torch.float32)],
)
def test_dtype_rules(seed, dtype, compute, out_dtype, lse_dtype):
    q, k, v = draw(seed, 1, 2, 1, 3, 4, 8, dtype=dtype)
    out, lse = attention(q, k, v, compute_dtype=compute)
    assert out.dtype == out_dtype and lse.dtype == lse_dtype
    assert out.shape == (1, 2, 3, 8) and lse.shape == (1, 2, 3)


def _bad_cases():
    t = lambda *s, **kw: torch.zeros(*s, **kw)  # noqa: E731
    q, k, v = t(2, 4, 3, 8), t(2, 2, 5, 8), t(2, 2, 5, 6)
    return [
        ("not a tensor", (np.zeros((2, 4, 3, 8)), k, v), {}, "q must be a torch.Tensor"),
        ("rank 3 q", (t(4, 3, 8), k, v), {}, "q must be rank-4"),
        ("rank 5 v", (q, k, t(2, 2, 5, 6, 1)), {}, "v must be rank-4"),
        ("batch", (q, t(1, 2, 5, 8), t(1, 2, 5, 6)), {}, "batch sizes differ"),
        ("k/v heads", (q, k, t(2, 1, 5, 6)), {}, "same kv heads and keys"),
        ("k/v keys", (q, k, t(2, 2, 4, 6)), {}, "same kv heads and keys"),
        ("hkv not dividing h", (q, t(2, 3, 5, 8), t(2, 3, 5, 6)), {}, r"kv heads \(3\) must"),
        ("zero kv heads", (q, t(2, 0, 5, 8), t(2, 0, 5, 6)), {}, r"kv heads \(0\) must divide"),
        ("head dim", (q, t(2, 2, 5, 7), v), {}, "head dims differ"),
        ("zero head dim", (t(2, 4, 3, 0), t(2, 2, 5, 0), v), {}, "head dim must be >= 1"),
        ("int dtype", (q.long(), k, v), {}, "q must have a floating dtype"),
        ("bool dtype", (q, k, v.bool()), {}, "v must have a floating dtype"),
        ("mixed dtypes", (q, k.double(), v), {}, "share one dtype"),
        ("devices", (q, k, t(2, 2, 5, 6, device="meta")), {}, "one device"),
        ("compute dtype int", (q, k, v), {"compute_dtype": torch.int32}, "compute_dtype"),
        ("compute dtype str", (q, k, v), {"compute_dtype": "float64"}, "compute_dtype"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_value_errors(case):
    _, args, kwargs, message = case
    with pytest.raises(ValueError, match=message):
        attention(*args, **kwargs)


@pytest.mark.gpu
def test_cuda_matches_cpu(seed):
    q, k, v = draw(seed, 1, 4, 2, 9, 12, 16)
    out, lse = attention(q, k, v, causal=True)
    out_c, lse_c = attention(*(x.cuda() for x in (q, k, v)), causal=True)
    assert out_c.is_cuda and rel_err(out_c.cpu(), out) < 1e-12 and rel_err(lse_c.cpu(), lse) < 1e-12
