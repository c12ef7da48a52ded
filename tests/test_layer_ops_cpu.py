"""tileattn.api_layers on CPU: the torch path (what the engine's CPU runs and what the GPU tests
compare the kernels with) against float64 formulas, and the argument checks."""

from __future__ import annotations

import pytest
import torch

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

