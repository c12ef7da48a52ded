"""tileattn.api_layers on CPU: the torch path (what the engine's CPU runs and what the GPU tests
compare the kernels with) against float64 formulas, and the argument checks."""

from __future__ import annotations

import re

import pytest
import torch

import tileattn
from tileattn import api_layers


def rms_norm64(s, weight, eps):
    s = s.double()
    return weight.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps)


def rotary_tables(positions, head_dim, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(positions).float()[:, None] * inv[None, :]
    return torch.cat((freqs.cos(), freqs.cos()), -1), torch.cat((-freqs.sin(), freqs.sin()), -1)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("tokens, dim", [(1, 8), (33, 64), (5, 4096)])
def test_add_rms_norm_matches_float64(dtype, tol, tokens, dim):
    x, r = torch.randn(tokens, dim).to(dtype), torch.randn(tokens, dim).to(dtype)
    w = (1 + 0.1 * torch.randn(dim)).to(dtype)
    out = api_layers.add_rms_norm(x, w, 1e-5)
    assert rel(out, rms_norm64(x, w, 1e-5)) < tol
    res = r.clone()
    out, res_out = api_layers.add_rms_norm(x, w, 1e-5, residual=res)
    assert res_out is res and torch.equal(res, x + r)  # the rounded sum, in place
    assert rel(out, rms_norm64(x + r, w, 1e-5)) < tol


def norm_rotary64(x, positions, cos, sin, q_heads=None, q_weight=None, k_weight=None, eps=1e-6):
    """float64: optional per-head RMSNorm, then y = (x1 c - x2 s, x2 c + x1 s) per frequency."""
    half = x.shape[-1] // 2
    base = x.double()
    if q_weight is not None:
        weight = torch.cat([q_weight.expand(q_heads, -1), k_weight.expand(x.shape[1] - q_heads, -1)]).double()
        base = weight * base / torch.sqrt(base.pow(2).mean(-1, keepdim=True) + eps)
    c = cos[positions, :half].double()[:, None]  # [T, 1, d/2]
    s = sin[positions, half:].double()[:, None]
    b1, b2 = base[..., :half], base[..., half:]
    return torch.cat([b1 * c - b2 * s, b2 * c + b1 * s], -1)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("norm", [False, True])
def test_norm_rotary_matches_float64(dtype, tol, norm):
    tokens, q_heads, k_heads, d = 7, 4, 2, 64
    cos, sin = rotary_tables(100, d)
    positions = torch.randint(0, 100, (tokens,))
    x = torch.randn(tokens, q_heads + k_heads, d).to(dtype)
    qw = kw = None
    if norm:
        qw, kw = (1 + 0.1 * torch.randn(d)).to(dtype), (1 + 0.1 * torch.randn(d)).to(dtype)
    want = norm_rotary64(x, positions, cos, sin, q_heads, qw, kw)
    got = x.clone()
    assert api_layers.norm_rotary_(got, positions, cos, sin, q_heads, qw, kw) is got
    assert rel(got, want) < tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_mul_matches_float64(dtype, tol):
    x = torch.randn(9, 2 * 48).to(dtype)
    g, u = x.double().split(48, -1)
    assert rel(api_layers.silu_mul(x), g * torch.sigmoid(g) * u) < tol


def test_bad_arguments_raise_before_work():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="weight"):
        api_layers.add_rms_norm(x, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        api_layers.add_rms_norm(x, torch.ones(16), 1e-5, residual=torch.randn(4, 8))
    with pytest.raises(ValueError, match="x must be"):
        api_layers.add_rms_norm(torch.randn(16), torch.ones(16), 1e-5)
    cos, sin = rotary_tables(10, 8)
    q = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="positions"):
        api_layers.norm_rotary_(q, torch.zeros(3, dtype=torch.int32), cos, sin)
    with pytest.raises(ValueError, match="cos"):
        api_layers.norm_rotary_(q, torch.zeros(3, dtype=torch.int64), cos.double(), sin)
    with pytest.raises(ValueError, match="q_weight, k_weight and q_heads"):
        api_layers.norm_rotary_(q, torch.zeros(3, dtype=torch.int64), cos, sin, q_weight=torch.ones(8))
    with pytest.raises(ValueError, match="head dim"):
        api_layers.norm_rotary_(torch.randn(3, 2, 7), torch.zeros(3, dtype=torch.int64), cos, sin)
    with pytest.raises(ValueError, match="odd width"):
        api_layers.silu_mul(torch.randn(3, 7))
    for eps in (-1e-6, float("nan"), float("inf"), "1e-6", None, True):
        with pytest.raises(ValueError, match=f"^eps must be a finite number >= 0, got {re.escape(repr(eps))}"):
            api_layers.add_rms_norm(x, torch.ones(16), eps)
        with pytest.raises(ValueError, match="^eps must be a finite number >= 0"):
            tileattn.add_rms_norm_linear(x, None, torch.ones(16), eps, torch.ones(4, 16))
    big = 10**30  # a valid eps, but an int past int64: torch's fallback raised OverflowError adding it to a tensor
    assert torch.equal(api_layers.add_rms_norm(x, torch.ones(16), big), api_layers.add_rms_norm(x, torch.ones(16), 1e30))
    assert tileattn.add_rms_norm_linear(x, None, torch.ones(16), big, torch.ones(4, 16))[0].shape == (x.shape[0], 4)
    for weight in (None, [1.0] * 16):  # not a tensor: an AttributeError before
        with pytest.raises(ValueError, match=r"^weight must be \[D\] = \[16\], got (NoneType|list)"):
            api_layers.add_rms_norm(x, weight, 1e-5)
    pos, w = torch.zeros(3, dtype=torch.int64), torch.ones(8)
    for call, match in (
            (lambda: api_layers.norm_rotary_(q[0], pos, cos, sin), r"^x must be a \[T, heads, d\] tensor"),
            (lambda: api_layers.norm_rotary_(torch.randn(3, 8, 2).transpose(1, 2), pos, cos, sin),
             "^x's last dim must be contiguous"),
            (lambda: api_layers.norm_rotary_(q, pos, cos, sin[:5]), "^cos and sin must have one shape"),
            (lambda: api_layers.norm_rotary_(q, pos, cos.t().contiguous().t(), sin), "^cos must be contiguous"),
            (lambda: api_layers.norm_rotary_(q, pos.to("meta"), cos, sin), "^positions is on meta, x on cpu"),
            (lambda: api_layers.norm_rotary_(q, pos, cos, sin, q_weight=w, k_weight=w),
             "^a per-head norm needs q_weight, k_weight and q_heads together"),
            (lambda: api_layers.norm_rotary_(q, pos, cos, sin, q_heads=3, q_weight=w, k_weight=w),
             r"^q_heads must be in \[0, 2\], got 3"),
            (lambda: api_layers.norm_rotary_(q, pos, cos, sin, q_heads=1, q_weight=w, k_weight=w, eps=-1.0),
             "^eps must be a finite number >= 0, got -1.0")):
        before = q.clone()
        with pytest.raises(ValueError, match=match):
            call()
        assert torch.equal(q, before), "a refused call changed x"



def fused_case(dtype, norm, tokens=9, q_heads=4, kv_heads=2, d=32, num_blocks=6, block_size=4, seed=0,
               index_dtype=torch.int64, max_positions=64):
    """A fused qkv buffer, positions, tables, weights, random caches and distinct slots (every
    third from the third on -1, the second one past the cache) for norm_rotary_write_kv_cache_;
    the tensors are created on CPU."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    cos, sin = rotary_tables(max_positions, d)
    positions = torch.randint(0, max_positions, (tokens,), generator=gen)
    qw = kw = None
    if norm:
        qw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype)
        kw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype)
    caches = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[2::3] = -1
    if tokens > 1:
        slots[1] = num_blocks * block_size  # past the cache: skipped
    return qkv, positions, cos, sin, qw, kw, caches, slots.to(index_dtype)


def split_qkv(qkv, q_heads, kv_heads, d):
    """[T, (H + 2 Hkv) d] -> q [T, H, d], k and v [T, Hkv, d]: strided views of the buffer."""
    tokens = qkv.shape[0]
    q = qkv[:, :q_heads * d].view(tokens, q_heads, d)
    k = qkv[:, q_heads * d:(q_heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (q_heads + kv_heads) * d:].view(tokens, kv_heads, d)
    return q, k, v


def two_step(qkv, positions, cos, sin, qw, kw, caches, slots, q_heads, kv_heads, d, write_kv_cache):
    """norm_rotary_ of the q and k heads in place, then write_kv_cache: what the fused op replaces.
    Returns (qkv, caches) after the two steps, on copies of the inputs."""
    qkv, caches = qkv.clone(), caches.clone()
    qk = qkv[:, :(q_heads + kv_heads) * d].view(qkv.shape[0], q_heads + kv_heads, d)
    api_layers.norm_rotary_(qk, positions, cos, sin, q_heads, qw, kw)
    _, k, v = split_qkv(qkv, q_heads, kv_heads, d)
    write_kv_cache(k, v, caches[0], caches[1], slots)
    return qkv, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_norm_rotary_write_kv_cache_equals_the_two_steps(dtype, norm, index_dtype):
    from tileattn import reference

    q_heads, kv_heads, d = 4, 2, 32
    qkv, positions, cos, sin, qw, kw, caches, slots = fused_case(dtype, norm, index_dtype=index_dtype)
    want_qkv, want_caches = two_step(qkv, positions, cos, sin, qw, kw, caches, slots, q_heads, kv_heads, d,
                                     reference.write_kv_cache)
    k_before = qkv[:, q_heads * d:(q_heads + kv_heads) * d].clone()
    q, k, v = split_qkv(qkv, q_heads, kv_heads, d)
    got = api_layers.norm_rotary_write_kv_cache_(q, k, v, caches[0], caches[1], slots, positions, cos, sin, qw, kw)
    assert got is q
    assert torch.equal(q, want_qkv[:, :q_heads * d].view_as(q)), "q differs from norm_rotary_'s"
    assert torch.equal(k.reshape(k_before.shape), k_before), "k must be left as it was"
    assert torch.equal(caches, want_caches), "caches differ from norm_rotary_ + write_kv_cache"
    written = slots[(slots >= 0) & (slots < caches.shape[1] * caches.shape[2])]
    assert written.numel() >= 3  # the case writes some slots and skips others


def test_norm_rotary_write_kv_cache_rejects_bad_arguments():
    q_heads, kv_heads, d = 4, 2, 32
    qkv, positions, cos, sin, qw, kw, caches, slots = fused_case(torch.float32, True)
    q, k, v = split_qkv(qkv, q_heads, kv_heads, d)
    kc, vc = caches[0], caches[1]
    fused = api_layers.norm_rotary_write_kv_cache_
    with pytest.raises(ValueError, match="slot_mapping must be int64 or int32"):
        fused(q, k, v, kc, vc, slots.to(torch.int16), positions, cos, sin)
    with pytest.raises(ValueError, match="slot_mapping must be an integer"):
        fused(q, k, v, kc, vc, slots.float(), positions, cos, sin)
    with pytest.raises(ValueError, match="k, v and slot_mapping must have one token count"):
        fused(q, k, v, kc, vc, slots[:-1], positions, cos, sin)
    with pytest.raises(ValueError, match="k_cache is torch.float64; q, k, v, k_cache and v_cache must share"):
        fused(q, k, v, kc.double(), vc.double(), slots, positions, cos, sin)
    with pytest.raises(ValueError, match="k_cache and v_cache must share"):
        fused(q, k, v, kc, vc[:, :2], slots, positions, cos, sin)
    with pytest.raises(ValueError, match=r"k \(9, 2, 32\) must be \[T, Hkv, dim\] matching k_cache"):
        fused(q, k, v, kc[..., :1, :], vc[..., :1, :], slots, positions, cos, sin)
    with pytest.raises(ValueError, match="k must be \\[T, Hkv, d\\] with q's T and d"):
        fused(q[:-1], k, v, kc, vc, slots, positions[:-1], cos, sin)
    with pytest.raises(ValueError, match="positions must be int64"):
        fused(q, k, v, kc, vc, slots, positions.int(), cos, sin)
    with pytest.raises(ValueError, match="q_weight, k_weight and q_heads"):
        fused(q, k, v, kc, vc, slots, positions, cos, sin, qw, None)
    with pytest.raises(ValueError, match="k_weight must be"):
        fused(q, k, v, kc, vc, slots, positions, cos, sin, qw, kw[:-2])
    with pytest.raises(ValueError, match="q: head dim must be even"):
        fused(torch.randn(9, 4, 7), k, v, kc, vc, slots, positions, cos, sin)
    with pytest.raises(ValueError, match="^eps must be a finite number >= 0, got nan"):
        fused(q, k, v, kc, vc, slots, positions, cos, sin, qw, kw, eps=float("nan"))
    with pytest.raises(ValueError, match=r"^v must have k's shape \[9, 2, 32\]"):  # a v cache of another width
        fused(q, k, v[..., :16], kc, vc[..., :16], slots, positions, cos, sin)
    with pytest.raises(ValueError, match="^k, v, caches and slot_mapping are on cpu, q on meta"):
        fused(q.to("meta"), k, v, kc, vc, slots, *(t.to("meta") for t in (positions, cos, sin)))
    before = (qkv.clone(), caches.clone())
    with pytest.raises(ValueError):
        fused(q, k, v, kc, vc.double(), slots, positions, cos, sin, qw, kw)
    assert torch.equal(qkv, before[0]) and torch.equal(caches, before[1]), "a refused call changed its inputs"
