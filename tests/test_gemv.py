"""tileattn.linear / add_rms_norm_linear on CPU: the composition path (what the engine's CPU runs
and what tests/gpu/test_gemv.py compares the kernel with) against float64 formulas, the residual
contract, the argument checks, and the GEMV family's registry entries."""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn import api_layers


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def silu_mul64(x):
    gate, up = x.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def rms_norm64(s, weight, eps):
    s = s.double()
    return weight.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps)


# Tolerances: float32 keeps ~7 digits; the 16-bit paths round the activation (and h) once and the
# output once: a few units of the dtype's 2^-8 (bf16) / 2^-11 (fp16) relative step over the norm.
TOLS = [(torch.float32, 1e-5), (torch.bfloat16, 1.5e-2), (torch.float16, 2e-3)]


@pytest.mark.parametrize("dtype, tol", TOLS)
@pytest.mark.parametrize("rows, k, n", [(1, 8, 1), (3, 64, 33), (8, 1000, 129)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_float64(dtype, tol, rows, k, n, with_bias):
    x, w = torch.randn(rows, k).to(dtype), (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype) if with_bias else None
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert rel(tileattn.linear(x, w, b), ref) < tol


@pytest.mark.parametrize("dtype, tol", TOLS)
@pytest.mark.parametrize("rows, k, n", [(1, 8, 31), (4, 1000, 127)])
def test_linear_silu_mul_matches_float64(dtype, tol, rows, k, n):
    x, w = torch.randn(rows, 2 * k).to(dtype), (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype)
    y = tileattn.linear(x, w, b, activation="silu_mul")
    assert y.shape == (rows, n) and y.dtype == dtype
    assert rel(y, silu_mul64(x) @ w.double().T + b.double()) < tol
    # Exactly the unfused steps on this path.
    assert torch.equal(y, torch.nn.functional.linear(api_layers.silu_mul(x), w, b))


@pytest.mark.parametrize("dtype, tol", TOLS)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_add_rms_norm_linear_matches_float64(dtype, tol, with_residual, with_bias):
    rows, k, n = 3, 64, 33
    x, r = torch.randn(rows, k).to(dtype), torch.randn(rows, k).to(dtype)
    nw = (1 + 0.1 * torch.randn(k)).to(dtype)
    w, b = (torch.randn(n, k) / k**0.5).to(dtype), torch.randn(n).to(dtype) if with_bias else None
    residual = r.clone() if with_residual else None
    y, new_residual = tileattn.add_rms_norm_linear(x, residual, nw, 1e-5, w, b)
    s = x + r if with_residual else x  # the rounded sum
    assert torch.equal(new_residual, s)
    ref = rms_norm64(s, nw, 1e-5) @ w.double().T + (0 if b is None else b.double())
    assert rel(y, ref) < tol
    # The unfused steps, bit for bit.
    h = api_layers.add_rms_norm(s, nw, 1e-5)
    assert torch.equal(y, torch.nn.functional.linear(h, w, b))


def test_add_rms_norm_linear_residual_contract():
    """Composition path: the residual is updated in place and returned; None returns x itself."""
    x, r = torch.randn(2, 16), torch.randn(2, 16)
    nw, w = torch.ones(16), torch.randn(4, 16)
    residual = r.clone()
    _, new_residual = tileattn.add_rms_norm_linear(x, residual, nw, 1e-6, w)
    assert new_residual is residual and torch.equal(residual, x + r)
    _, new_residual = tileattn.add_rms_norm_linear(x, None, nw, 1e-6, w)
    assert new_residual is x


def _rope_inputs(dtype, tokens=2, heads=3, kv_heads=1, d=8, hidden=16, block_size=4, blocks=3):
    g = torch.Generator().manual_seed(tokens + heads)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    w = (torch.randn((heads + 2 * kv_heads) * d, hidden, generator=g) / hidden**0.5).to(dtype)
    k_cache = torch.zeros(blocks, block_size, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(tokens, dtype=torch.int64) + 5
    slot_mapping = torch.tensor([2 * block_size + 1, -1, 3][:tokens], dtype=torch.int64)
    freqs = torch.arange(16).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
    cos, sin = torch.cat((freqs.cos(), freqs.cos()), -1), torch.cat((-freqs.sin(), freqs.sin()), -1)
    return dict(x=x, residual=residual, norm_weight=nw, eps=1e-5, weight=w, bias=None, heads=heads, kv_heads=kv_heads,
                k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, positions=positions, cos=cos, sin=sin)


@pytest.mark.parametrize("dtype, tol", TOLS)
def test_add_rms_norm_qkv_rope_matches_float64(dtype, tol):
    """qkv = the projection with q rotated (k, v as projected); k rotated and v in the cache at each
    token's slot (slot -1 skipped), nothing else of the caches touched."""
    a = _rope_inputs(dtype)
    heads, kv_heads, d = a["heads"], a["kv_heads"], a["k_cache"].shape[-1]
    residual = a["residual"].clone()
    qkv, new_residual = api_layers.add_rms_norm_qkv_rope_(**{**a, "residual": residual})
    s = a["x"] + a["residual"]
    assert torch.equal(new_residual, s)
    y64 = rms_norm64(s, a["norm_weight"], 1e-5) @ a["weight"].double().T  # [T, (H + 2 Hkv) d]

    def rotate64(t, pos):  # t [T, n, d] float64
        c, sn = a["cos"][pos].double()[:, None], a["sin"][pos].double()[:, None]
        return t * c + t.roll(d // 2, dims=-1) * sn

    q64 = rotate64(y64[:, :heads * d].view(-1, heads, d), a["positions"])
    k64 = rotate64(y64[:, heads * d:(heads + kv_heads) * d].view(-1, kv_heads, d), a["positions"])
    v64 = y64[:, (heads + kv_heads) * d:].view(-1, kv_heads, d)
    assert rel(qkv[:, :heads * d].view(-1, heads, d), q64) < tol
    assert rel(qkv[:, heads * d:], y64[:, heads * d:]) < tol
    block_size = a["k_cache"].shape[1]
    for t, slot in enumerate(a["slot_mapping"].tolist()):
        cached_k = a["k_cache"].view(-1, kv_heads, d)[slot] if slot >= 0 else None
        if cached_k is not None:
            assert rel(cached_k, k64[t]) < tol
            assert rel(a["v_cache"].view(-1, kv_heads, d)[slot], v64[t]) < tol
    written = {slot for slot in a["slot_mapping"].tolist() if slot >= 0}
    untouched = [i for i in range(a["k_cache"].shape[0] * block_size) if i not in written]
    assert a["k_cache"].view(-1, kv_heads, d)[untouched].abs().sum() == 0
    assert a["v_cache"].view(-1, kv_heads, d)[untouched].abs().sum() == 0


@pytest.mark.parametrize("change, match", [
    (dict(heads=0), "heads must be"),
    (dict(heads=True), "heads must be"),
    (dict(kv_heads="1"), "kv_heads must be"),
    (dict(k_cache=torch.zeros(3, 4, 8)), "k_cache must be"),
    (dict(heads=2), "weight must be"),
    (dict(positions=torch.zeros(3, dtype=torch.int64)), "positions must be"),
    (dict(norm_weight=torch.ones(15)), "norm_weight must"),
])
def test_add_rms_norm_qkv_rope_bad_arguments(change, match):
    a = _rope_inputs(torch.float32)
    with pytest.raises(ValueError, match=match):
        api_layers.add_rms_norm_qkv_rope_(**{**a, **change})


def test_add_rms_norm_qkv_rope_checks_the_cache_arguments_before_it_runs():
    """A bad cache-side argument raises before the projection runs: the residual (which the
    composition path updates in place) and the caches are left as they were."""
    a = _rope_inputs(torch.float32)
    residual = a["residual"].clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        api_layers.add_rms_norm_qkv_rope_(**{**a, "residual": residual,
                                             "slot_mapping": a["slot_mapping"].to(torch.float32)})
    assert torch.equal(residual, a["residual"])
    assert a["k_cache"].abs().sum() == 0 and a["v_cache"].abs().sum() == 0


def test_empty_rows():
    y = tileattn.linear(torch.randn(0, 8), torch.randn(5, 8))
    assert y.shape == (0, 5)


def test_kernel_not_chosen_off_cuda(monkeypatch):
    """CPU tensors take the composition even with the GEMV forced on."""
    from tileattn.kernels import dispatch

    monkeypatch.setattr(dispatch, "GEMV_ROWS_OVERRIDE", 8)
    x = torch.randn(1, 8, dtype=torch.bfloat16)
    assert not api_layers._gemv_kernel_takes(x, 8, torch.randn(4, 8, dtype=torch.bfloat16), None)


def test_gemv_max_rows_override(monkeypatch):
    from tileattn.kernels import dispatch

    monkeypatch.setattr(dispatch, "GEMV_ROWS_OVERRIDE", 4)
    assert dispatch.gemv_max_rows(0) == 4
    for bad in (9, "x", -1):
        monkeypatch.setattr(dispatch, "GEMV_ROWS_OVERRIDE", bad)
        with pytest.raises(ValueError, match="TILEATTN_GEMV_MAX_ROWS"):
            dispatch.gemv_max_rows(0)
    assert set(dispatch.GEMV_MAX_ROWS) == {"sm_90a", "sm_80"}


@pytest.mark.parametrize("call, match", [
    (lambda: tileattn.linear(torch.randn(2, 3, 8), torch.randn(4, 8)), "x must be"),
    (lambda: tileattn.linear(torch.randn(2, 8), torch.randn(4, 16)), "weight must be"),
    (lambda: tileattn.linear(torch.randn(2, 8), torch.randn(4, 8, 1)), "weight must be"),
    (lambda: tileattn.linear(torch.randn(2, 8), torch.randn(4, 8), torch.randn(5)), "bias must be"),
    (lambda: tileattn.linear(torch.randn(2, 8), torch.randn(4, 8, dtype=torch.float64)), "weight is"),
    (lambda: tileattn.linear(torch.randn(2, 8), torch.randn(4, 8), torch.randn(4, dtype=torch.float64)), "bias is"),
    (lambda: tileattn.linear(torch.randn(2, 8), torch.randn(4, 8), activation="gelu"), "activation"),
    (lambda: tileattn.linear(torch.randn(2, 9), torch.randn(4, 4), activation="silu_mul"), "odd width"),
    (lambda: tileattn.linear(torch.randn(2, 16), torch.randn(4, 16), activation="silu_mul"), "weight must be"),
    (lambda: tileattn.add_rms_norm_linear(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6,
                                          torch.randn(4, 8)), "residual must"),
    (lambda: tileattn.add_rms_norm_linear(torch.randn(2, 8), torch.randn(2, 8, 1), torch.ones(8), 1e-6,
                                          torch.randn(4, 8)), "residual must"),
    (lambda: tileattn.add_rms_norm_linear(torch.randn(2, 8), None, torch.ones(9), 1e-6, torch.randn(4, 8)),
     "norm_weight must"),
    (lambda: tileattn.add_rms_norm_linear(torch.randn(2, 8), None, torch.ones(8, dtype=torch.float64), 1e-6,
                                          torch.randn(4, 8)), "norm_weight is"),
    (lambda: tileattn.add_rms_norm_linear(torch.randn(2, 8), None, torch.ones(8), 1e-6, torch.randn(4, 7)),
     "weight must be"),
    (lambda: tileattn.add_rms_norm_linear(torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float16),
                                          torch.ones(8), 1e-6, torch.randn(4, 8)), "residual is"),
    (lambda: tileattn.add_rms_norm_linear(torch.randn(8), None, torch.ones(8), 1e-6, torch.randn(4, 8)),
     "x must be"),
])
def test_bad_arguments_raise_before_running(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_device_mismatch_is_named():
    meta = torch.randn(4, 8, device="meta")
    with pytest.raises(ValueError, match="weight is"):
        tileattn.linear(torch.randn(2, 8), meta)
    with pytest.raises(ValueError, match="bias is"):
        tileattn.linear(torch.randn(2, 8), torch.randn(4, 8), torch.randn(4, device="meta"))


def test_registry_lists_every_instantiation_once():
    """Two dtypes x three prologues x three M buckets, each a name the launcher builds (the rotary
    + KV-cache epilogue's two instantiations were removed on 2026-12-02)."""
    from tileattn import kernels
    from tileattn.kernels import dispatch, gemv

    fam = kernels.family("gemv")
    assert fam.archs == ("sm_90a", "sm_80") and fam.path.exists()
    assert len(set(fam.instantiations)) == len(fam.instantiations) == 2 * 3 * 3
    for bf16 in (True, False):
        for prologue in gemv.PROLOGUES:
            for rows in range(1, 9):
                assert fam.require(gemv.expression(bf16, prologue, gemv.bucket(rows)))
    assert [gemv.bucket(m) for m in range(1, 9)] == [1, 4, 4, 4, 8, 8, 8, 8]
    assert gemv.M_BUCKETS[-1] == dispatch.GEMV_KERNEL_MAX_ROWS


def test_shared_memory_cap():
    """The staged rows are M x K fp32: Llama's down projection (K = 14336) fits up to M = 4 in an
    H200's 227 KB, so M = 5..8 there takes the composition."""
    from tileattn.kernels import gemv

    optin = 232448  # H200 per-block opt-in bytes
    assert gemv.shared_memory_bytes(4, 14336) + gemv.STATIC_SMEM_BYTES <= optin
    assert gemv.shared_memory_bytes(5, 14336) + gemv.STATIC_SMEM_BYTES > optin
    assert gemv.shared_memory_bytes(8, 4096) + gemv.STATIC_SMEM_BYTES <= optin
