"""CPU tests of the attention variants (issue #15): the Philox dropout mask, the reference's window,
softcap, ALiBi and dropout, and the argument checks of the CUDA ops (which run before any device
work). The kernels themselves are tested in tests/gpu/test_attention_variants.py."""

from __future__ import annotations

import functools
import math
import operator
import random

import numpy as np
import pytest
import torch

import tileattn
from tileattn import reference
from tileattn.dropout import UNBOUNDED, dropout_mask, philox4x32_7

F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# Philox and the mask
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "counter, key, expected",
    [
        # Random123's known-answer vectors for philox4x32 with 7 rounds (kat_vectors).
        ((0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    ],
)
def test_philox_known_answers(counter, key, expected):
    got = tuple(int(w) for w in philox4x32_7(counter, key))
    assert got == expected, f"philox4x32_7{counter, key} = {[hex(w) for w in got]}, expected {[hex(w) for w in expected]}"


def _keep_scalar(seed, offset, b, h, heads, i, j, p):
    """One element of the mask straight from the documented formula (independent of the vectorized layout)."""
    key = (seed & 0xFFFFFFFF, ((seed >> 32) + (offset >> 32)) & 0xFFFFFFFF)
    ctr = (4 * (j >> 5) + ((j >> 1) & 3), i, b * heads + h, offset & 0xFFFFFFFF)
    word = int(philox4x32_7(ctr, key)[(j >> 3) & 3])
    bits = (word >> 16) if j & 1 else (word & 0xFFFF)
    return bits >= round(p * 65536)


def test_mask_matches_the_documented_formula():
    seed, offset, p = 0x1234_5678_9ABC_DEF0, (7 << 32) + 12, 0.3
    mask = dropout_mask(seed, offset, 2, 3, 9, 70, p)
    rng = np.random.default_rng(0)
    for _ in range(200):
        b, h, i, j = (int(rng.integers(n)) for n in (2, 3, 9, 70))
        assert bool(mask[b, h, i, j]) == _keep_scalar(seed, offset, b, h, 3, i, j, p), f"element {(b, h, i, j)}"


def test_mask_is_a_pure_function_of_its_indices():
    big = dropout_mask(5, 3, 3, 2, 40, 100, 0.2)
    assert big.shape == (3, 2, 40, 100) and big.dtype == torch.bool
    assert torch.equal(dropout_mask(5, 3, 3, 2, 40, 100, 0.2), big), "two calls differ"
    assert torch.equal(dropout_mask(5, 3, 3, 2, 17, 33, 0.2), big[:, :, :17, :33]), "not independent of the shape"
    assert torch.equal(dropout_mask(5, 3, 1, 2, 40, 100, 0.2, batch_start=2), big[2:3]), "batch_start"


@pytest.mark.parametrize("change,match", [
    ({"seed": -1}, r"^seed must be an int in \[0, 2\^64\), got -1"),
    ({"offset": 2**64}, r"^offset must be an int in \[0, 2\^64\)"),
    ({"seed": 1.0}, "^seed must be an int"),
    ({"batch": -1}, "^batch must be an int >= 0, got -1"),
    ({"heads": 1.5}, "^heads must be an int >= 0, got 1.5"),
    ({"seqlen_q": True}, "^seqlen_q must be an int >= 0, got True"),
    ({"batch_start": -2}, "^batch_start must be an int >= 0"),
    ({"p": 1.0}, r"^p must be a number in \[0, 1\), got 1.0"),
    ({"p": "0.1"}, r"^p must be a number in \[0, 1\), got '0.1'"),
    ({"device": "gpu"}, "^device 'gpu' is not a torch device"),  # torch's RuntimeError before
    ({"device": [0]}, r"^device \[0\] is not a torch device"),  # torch's TypeError before
])
def test_mask_refuses_bad_arguments(change, match):
    args = {"seed": 5, "offset": 3, "batch": 1, "heads": 2, "seqlen_q": 4, "seqlen_k": 4, "p": 0.2, **change}
    with pytest.raises(ValueError, match=match):
        dropout_mask(**args)


def test_mask_statistics_and_seeds():
    n = 2 * 4 * 256 * 256
    for p in (0.1, 0.5, 0.9):
        kept = dropout_mask(11, 0, 2, 4, 256, 256, p).double().mean().item()
        expected = 1 - round(p * 65536) / 65536
        sigma = math.sqrt(expected * (1 - expected) / n)
        assert abs(kept - expected) < 6 * sigma, f"p={p}: kept fraction {kept:.5f}, expected {expected:.5f}"
    a = dropout_mask(1, 0, 1, 2, 64, 64, 0.5)
    for other in (dropout_mask(2, 0, 1, 2, 64, 64, 0.5), dropout_mask(1, 4, 1, 2, 64, 64, 0.5),
                  dropout_mask(1 + (1 << 32), 0, 1, 2, 64, 64, 0.5)):
        agree = (a == other).double().mean().item()
        assert 0.4 < agree < 0.6, f"masks of different seeds/offsets agree on {agree:.3f} (independent: 0.5)"
    assert dropout_mask(1, 0, 1, 1, 8, 8, 0.0).all(), "p = 0 drops something"


@pytest.mark.parametrize("bad", [{"seed": -1}, {"seed": 1 << 64}, {"p": 1.0}, {"p": -0.1}, {"seqlen_q": -1}])
def test_mask_argument_checks(bad):
    args = {"seed": 1, "offset": 0, "batch": 1, "heads": 1, "seqlen_q": 4, "seqlen_k": 4, "p": 0.5} | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        dropout_mask(**args)


# ---------------------------------------------------------------------------------------------
# Reference semantics, against a direct per-element computation
# ---------------------------------------------------------------------------------------------
def _qkv(b=2, h=4, hkv=2, nq=13, nk=21, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, nq, d, generator=g, dtype=F64), torch.randn(b, hkv, nk, d, generator=g, dtype=F64),
            torch.randn(b, hkv, nk, d, generator=g, dtype=F64))


def _naive(q, k, v, *, causal=False, window=None, softcap=None, slopes=None, keep=None, scale=None):
    """Loops over (b, h): explicit scores, bias, mask, softmax; fully masked rows -> 0, -inf."""
    batch, heads, nq, d = q.shape
    nk, group = k.shape[2], heads // k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros_like(q)
    lse = torch.full((batch, heads, nq), -math.inf, dtype=F64)
    left, right = (-1, -1) if window is None else window
    for b in range(batch):
        for h in range(heads):
            s = scale * q[b, h] @ k[b, h // group].T
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            for i in range(nq):
                for j in range(nk):
                    dist = i + nk - nq - j
                    if slopes is not None:
                        s[i, j] -= (slopes[b, h] if slopes.dim() == 2 else slopes[h]) * abs(dist)
                    hidden = (causal and dist < 0) or (left >= 0 and dist > left) or (right >= 0 and -dist > right)
                    if hidden:
                        s[i, j] = -math.inf
            for i in range(nq):
                if torch.isinf(s[i]).all():
                    continue
                lse[b, h, i] = torch.logsumexp(s[i], 0)
                p = torch.softmax(s[i], 0)
                if keep is not None:
                    p = p * keep[b, h, i]
                out[b, h, i] = p @ v[b, h // group]
    return out, lse


@pytest.mark.parametrize(
    "options",
    [
        {"window": (3, 2)},
        {"window": (0, 0)},
        {"window": (5, -1)},
        {"window": (-1, 4), "causal": True},
        {"window": (2, 3), "causal": True},
        {"window": (100, 100)},
        {"softcap": 0.7},
        {"slopes": "h"},
        {"slopes": "bh", "window": (4, 1), "softcap": 2.0},
    ],
)
@pytest.mark.parametrize("nq, nk", [(13, 21), (21, 13), (1, 7)])
def test_reference_variants_match_naive(options, nq, nk):
    q, k, v = _qkv(nq=nq, nk=nk)
    options = dict(options)
    slopes = options.pop("slopes", None)
    if slopes is not None:
        g = torch.Generator().manual_seed(1)
        slopes = torch.rand((4,) if slopes == "h" else (2, 4), generator=g, dtype=F64)
    ref_opts = {"alibi_slopes": slopes, **{k_: v_ for k_, v_ in options.items() if k_ != "causal"}}
    out, lse = reference.attention(q, k, v, options.get("causal", False), compute_dtype=F64, **ref_opts)
    exp_out, exp_lse = _naive(q, k, v, slopes=slopes, **options)
    assert torch.allclose(out, exp_out, atol=1e-12), f"{options}: out differs by {(out - exp_out).abs().max():.3e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(exp_lse)), f"{options}: -inf rows differ"
    fin = torch.isfinite(exp_lse)
    assert torch.allclose(lse[fin], exp_lse[fin], atol=1e-12), f"{options}: lse differs"


def test_reference_dropout_uses_the_mask():
    q, k, v = _qkv()
    p, seed, offset = 0.3, 99, 8
    out, lse = reference.attention(q, k, v, True, compute_dtype=F64, dropout_p=p, seed=seed, offset=offset)
    keep = dropout_mask(seed, offset, 2, 4, 13, 21, p).to(F64) / (1 - p)
    exp_out, exp_lse = _naive(q, k, v, causal=True, keep=keep)
    assert torch.allclose(out, exp_out, atol=1e-12), f"dropout out differs by {(out - exp_out).abs().max():.3e}"
    plain_lse = reference.attention(q, k, v, True, compute_dtype=F64)[1]
    assert torch.equal(lse, plain_lse), "dropout changed lse (it must be the undropped softmax's)"


def test_reference_fully_masked_rows_have_zero_output_and_gradients():
    q, k, v = _qkv(nq=9, nk=5)
    for t in (q, k, v):
        t.requires_grad_(True)
    # Window (0, 0) with Nq > Nk: queries 0..3 have diagonal keys < 0 -> see nothing.
    out, lse = reference.attention(q, k, v, compute_dtype=F64, window=(0, 0), softcap=3.0)
    assert torch.isinf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()
    assert (out[:, :, :4] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v)), "NaN/inf gradient"
    assert (q.grad[:, :, :4] == 0).all(), "fully masked rows got a query gradient"


def test_reference_softcap_gradient_matches_finite_differences():
    q, k, v = _qkv(b=1, h=2, hkv=1, nq=4, nk=6, d=8)
    q.requires_grad_(True)
    slopes = torch.tensor([0.5, 0.25], dtype=F64)

    def f(x):
        return (reference.attention(x, k, v, compute_dtype=F64, softcap=1.5, alibi_slopes=slopes,
                                    window=(2, 1))[0] ** 2).sum()

    assert torch.autograd.gradcheck(f, (q,)), "softcap/alibi/window reference gradient"


def test_reference_varlen_variants_match_dense_per_sequence():
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k, heads, d = [5, 0, 9], [7, 3, 9], 4, 16
    q = torch.randn(sum(lens_q), heads, d, generator=g, dtype=F64)
    k = torch.randn(sum(lens_k), 2, d, generator=g, dtype=F64)
    v = torch.randn(sum(lens_k), 2, d, generator=g, dtype=F64)
    cu_q = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 10, 19], dtype=torch.int32)
    slopes = torch.rand(3, heads, generator=g, dtype=F64)
    opts = {"window": (3, 1), "softcap": 2.0, "dropout_p": 0.25, "seed": 7, "offset": 4}
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, True, None, True, compute_dtype=F64,
                                          alibi_slopes=slopes, **opts)
    for b, (q0, k0) in enumerate(((0, 0), (5, 7), (5, 10))):
        nq, nk = lens_q[b], lens_k[b]
        if nq == 0:
            continue
        qb = q[q0:q0 + nq].transpose(0, 1)[None]
        kb, vb = (t[k0:k0 + nk].transpose(0, 1)[None] for t in (k, v))
        keep = dropout_mask(7, 4, 1, heads, nq, nk, 0.25, batch_start=b).to(F64) / 0.75
        exp_out, exp_lse = _naive(qb, kb, vb, causal=True, window=(3, 1), softcap=2.0, slopes=slopes[b:b + 1],
                                  keep=keep)
        got = out[q0:q0 + nq].transpose(0, 1)[None]
        assert torch.allclose(got, exp_out, atol=1e-12), f"sequence {b}: out differs"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window": (1,)}, "window"),
        ({"window": (-2, 0)}, r"window\[0\]"),
        ({"window": (0, 1.5)}, r"window\[1\]"),
        ({"softcap": -1.0}, "softcap"),
        ({"softcap": float("inf")}, "softcap"),
        ({"dropout_p": 1.0}, "dropout_p"),
        ({"dropout_p": 0.1, "seed": -3}, "seed"),
        ({"dropout_p": 0.1, "offset": 3}, "offset needs a seed"),
        ({"dropout_p": 0.1, "generator": 5}, "generator"),
        ({"dropout_p": 0.1, "generator": torch.Generator(), "seed": 3}, "^pass either generator or seed"),
        ({"dropout_p": 0.1, "seed": 2**64}, r"^seed must be None or an int in \[0, 2\^64\)"),
        ({"alibi_slopes": torch.ones(3)}, "alibi_slopes"),
        ({"alibi_slopes": torch.ones(4, dtype=torch.int32)}, "^alibi_slopes must have a floating dtype"),
        ({"alibi_slopes": torch.ones(4, device="meta")}, "^alibi_slopes must be on q's device cpu, got meta"),
    ],
)
def test_reference_variant_argument_errors(kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        reference.attention(q, k, v, **kwargs)


# ---------------------------------------------------------------------------------------------
# The CUDA ops' variant checks (they run before the device check, so CPU tensors reach them)
# ---------------------------------------------------------------------------------------------
def _cpu16(b=1, h=4, hkv=2, n=64, d=64):
    return (torch.randn(b, h, n, d).half(), torch.randn(b, hkv, n, d).half(), torch.randn(b, hkv, n, d).half())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window": (3, -2)}, r"window\[1\]"),
        ({"window": "wide"}, "window"),
        ({"window": [[1], 2]}, r"window\[0\]"),
        ({"softcap": -2}, "softcap"),
        ({"dropout_p": 1.5}, "dropout_p"),
        ({"dropout_p": "0.1"}, "dropout_p"),
        ({"alibi_slopes": torch.ones(4, dtype=torch.float64)}, "alibi_slopes must be float32"),
        ({"alibi_slopes": torch.ones(2, 4)}, r"alibi_slopes must have shape"),
        ({"alibi_slopes": [0.5] * 4}, "alibi_slopes"),
        ({"window": (3, 0)}, "CUDA"),  # valid variants: the device check reports
    ],
)
def test_op_variant_argument_errors(kwargs, match):
    q, k, v = _cpu16()
    with pytest.raises(ValueError, match=match):
        tileattn.attention(q, k, v, **kwargs)


def test_varlen_op_variant_argument_errors():
    q, k, v = (torch.randn(10, 4, 64).half(), torch.randn(10, 2, 64).half(), torch.randn(10, 2, 64).half())
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        tileattn.attention_varlen(q, k, v, cu, cu, 6, 6, alibi_slopes=torch.ones(3, 4))
    with pytest.raises(ValueError, match="softcap"):
        tileattn.attention_varlen(q, k, v, cu, cu, 6, 6, softcap=float("nan"))
    with pytest.raises(ValueError, match="^alibi_slopes must be None or a torch.Tensor, got list"):
        tileattn.attention_varlen(q, k, v, cu, cu, 6, 6, alibi_slopes=[0.5] * 4)
    with pytest.raises(ValueError, match="CUDA"):
        tileattn.attention_varlen(q, k, v, cu, cu, 6, 6, alibi_slopes=torch.ones(2, 4), window=(2, 2))


def test_variant_kernels_are_registered_once_per_head_dim():
    from tileattn.kernels import attention_bwd_sm80, attention_fwd_sm80

    fwd = [e for e in attention_fwd_sm80.INSTANTIATIONS if "_variants_" in e]
    bwd = [e for e in attention_bwd_sm80.INSTANTIATIONS if "_variants_" in e]
    # (head dim x dtype x dense/varlen x seed by value / kRngState) forward; main atomic + main deterministic
    # + dQ backward.
    assert len(fwd) == len(set(fwd)) == 5 * 2 * 2 * 2, fwd
    assert len(bwd) == len(set(bwd)) == 5 * 2 * 2 * 2 * 3, bwd
    assert sum(e.endswith(", true>") and "_variants_sm80<" in e and e.count("true") >= 1 for e in fwd) >= 20
    for cfg in attention_fwd_sm80.VARIANT_DEFAULTS.values():
        assert cfg.block_n % 32 == 0, f"{cfg}: dropout bits come per 32 keys"


def test_sm90_variant_instantiations_cover_every_flag_set():
    from tileattn.kernels import attention_fwd_sm90 as k90

    exprs = k90.VARIANT_INSTANTIATIONS
    # (head dim x dtype x the 7 non-empty sets of window / softcap / ALiBi), all in the checked registry.
    assert len(exprs) == len(set(exprs)) == 3 * 2 * 7, exprs
    assert set(exprs) <= set(k90.INSTANTIATIONS)
    for d, cfg in k90.VARIANT_DEFAULTS.items():
        for bf16 in (False, True):
            for flags in range(1, 8):
                e = k90.variant_expression(d, cfg, bf16, flags)
                assert e in exprs, e
                # The plain template with kCausal false, then kConsumers 2, kVariant and VARIANT_PARAMS' eleven
                # types (the last: the dropout rng state's pointer).
                assert e.startswith(k90.expression(d, cfg, False, bf16)[:-1] + f", 2, {flags}, const float*"), e
                assert e.count(",") == 5 + 2 + 11 and e.endswith("float, const unsigned long long*>"), e
    # The plain instantiations keep their names (six template arguments: 3 head dims x causal x
    # dtype, and the long-keys tiles in both dtypes); the three-consumer ones add kConsumers; the
    # others (the variants above, and the varlen / paged / dropout bits, which their own model tests
    # check) name kConsumers 2 and a kVariant after a plain one.
    plain = [e for e in k90.INSTANTIATIONS if e.count(",") == 5]
    assert len(plain) == 2 * (len(k90.DEFAULTS) + len(k90.LONG_DEFAULTS)) == 16, plain
    wide = [e for e in k90.INSTANTIATIONS if e.endswith(", 3>")]
    assert len(wide) == 2 * len(k90.WIDE_DEFAULTS) == 8, wide
    assert not set(plain) & set(exprs), plain
    # ALiBi alone and softcap alone also at the non-causal three-consumer tiles (d = 64, 128, both
    # dtypes): kConsumers 3, kVariant 4 or 2.
    variant_wide = k90.VARIANT_WIDE_INSTANTIATIONS
    assert len(variant_wide) == len(set(variant_wide)) == 8 and set(variant_wide) <= set(k90.INSTANTIATIONS), variant_wide
    for flags in (k90.ALIBI, k90.SOFTCAP):
        these = [e for e in variant_wide if f", 3, {flags}, const float*" in e]
        assert len(these) == 4 and all(
            e.startswith(tuple(w[:-1] + f", {flags}, const float*" for w in wide if ", false, false, " in w))
            for e in these), these
    fixed_max = k90.FIXED_MAX_INSTANTIATIONS  # test_sm90_softcap_fixed_max_kernels checks them
    causal_variants = k90.CAUSAL_VARIANT_INSTANTIATIONS  # test_sm90_causal_variant_kernels checks them
    causal_fixed_max = k90.CAUSAL_FIXED_MAX_INSTANTIATIONS  # test_sm90_causal_fixed_max_kernels checks them
    # The kRngState forms at their own tiles: test_rng_state_kernel_forms_are_registered_where_they_fit.
    rng_tiles = {k90.variant_expression(d, cfg, bf16, flags) for (d, flags), cfg in k90.RNG_STATE_TILES.items()
                 for bf16 in (False, True)}
    varlen_dropout = k90.VARLEN_DROPOUT_INSTANTIATIONS  # test_sm90_varlen_dropout_kernels checks them
    assert all(e.startswith(tuple(p[:-1] + ", 2, " for p in plain)) for e in k90.INSTANTIATIONS
               if e not in plain and e not in wide and e not in variant_wide and e not in fixed_max
               and e not in causal_variants and e not in causal_fixed_max and e not in rng_tiles
               and e not in varlen_dropout)


def test_sm90_softcap_fixed_max_kernels():
    """The fixed-max kernels: bf16 SOFTCAP and WINDOW | SOFTCAP at the variant tiles, SOFTCAP at the
    three-consumer ones, each the online kernel's expression with FIXED_MAX added to kVariant;
    fixed_max_applies holds exactly for bf16 softcap (alone or windowed) within the exponent budget;
    ForwardPlan refuses fixed_max anywhere else, before touching a GPU."""
    import math

    from tileattn.kernels import attention_fwd_sm80, attention_fwd_sm90 as k90

    exprs = k90.FIXED_MAX_INSTANTIATIONS
    assert len(exprs) == len(set(exprs)) == 3 * 2 + 2 + len(k90.FIXED_MAX_WIDE) and set(exprs) <= set(k90.INSTANTIATIONS), exprs
    for d, cfg in k90.VARIANT_DEFAULTS.items():
        for flags in k90.FIXED_MAX_FLAGS:
            online = k90.variant_expression(d, cfg, True, flags)
            assert online.replace(f", 2, {flags}, ", f", 2, {flags | k90.FIXED_MAX}, ") in exprs, online
    for d, cfg in k90.VARIANT_WIDE.items():
        online = k90.variant_expression(d, cfg, True, k90.SOFTCAP)
        assert online.replace(f", 3, {k90.SOFTCAP}, ", f", 3, {k90.SOFTCAP | k90.FIXED_MAX}, ") in exprs, online
    for d, cfg in k90.FIXED_MAX_WIDE.items():
        assert cfg.consumers == 3 and k90.variant_expression(d, cfg, True, k90.SOFTCAP | k90.FIXED_MAX) in exprs
    assert all(", true, 2, " in e or ", true, 3, " in e for e in exprs), "bf16 only"

    bf16, fp16 = torch.bfloat16, torch.float16
    applies = k90.fixed_max_applies
    assert applies(bf16, k90.SOFTCAP, 30.0, 8192) and applies(bf16, k90.WINDOW | k90.SOFTCAP, 30.0, 8192)
    assert applies(bf16, k90.SOFTCAP, 30.0, 1 << 27) and not applies(bf16, k90.SOFTCAP, 30.0, 1 << 28)
    assert not applies(bf16, k90.SOFTCAP, 50.0, 1)  # Gemma 2's attention cap: 2 x 72 > 114
    assert not applies(fp16, k90.SOFTCAP, 30.0, 8192)
    for flags in (k90.ALIBI | k90.SOFTCAP, k90.WINDOW, k90.DROPOUT | k90.WINDOW | k90.SOFTCAP, 0):
        assert not applies(bf16, flags, 30.0, 8192), flags
    cap = (k90.FIXED_MAX_LOG2_BUDGET - 12) / (2 * math.log2(math.e))
    assert applies(bf16, k90.SOFTCAP, cap, 4096) and not applies(bf16, k90.SOFTCAP, cap, 4097)

    def va(left=UNBOUNDED, right=UNBOUNDED, softcap=0.0, alibi=None, p=0.0):
        return attention_fwd_sm80.VariantArgs(left, right, softcap, alibi, p)

    q, lse = torch.empty(1, 2, 64, 128, dtype=bf16), torch.empty(1, 2, 64)
    for bad_q, bad in ((q, va(softcap=50.0)), (q, va(softcap=30.0, alibi=0)), (q, va(right=0)),
                       (q, va(softcap=30.0, p=0.1)), (q.half(), va(softcap=30.0))):
        with pytest.raises(ValueError, match="fixed_max"):
            k90.ForwardPlan(bad_q, bad_q, bad_q, bad_q, lse, causal=False, scale=1.0, variants=bad, fixed_max=True)


def test_sm90_causal_fixed_max_kernels():
    """Causal bf16 softcap with the fixed max on the kCausal kernel: one instantiation per kCausal
    softcap tile (d = 64, 128; two and three consumers), each the online kCausal softcap kernel's
    expression with FIXED_MAX added; ForwardPlan takes fixed_max and causal_kernel together only for
    causal softcap where the fixed max applies, and refuses anything else before touching a GPU."""
    from tileattn.kernels import attention_fwd_sm80, attention_fwd_sm90 as k90

    exprs = k90.CAUSAL_FIXED_MAX_INSTANTIATIONS
    assert len(exprs) == len(set(exprs)) == 4 and set(exprs) <= set(k90.INSTANTIATIONS), exprs
    flags = k90.SOFTCAP | k90.FIXED_MAX
    for d in k90.CAUSAL_VARIANT_HEAD_DIMS:
        for cfg in (k90.DEFAULTS[(d, True)], k90.CAUSAL_VARIANT_WIDE[d]):
            online = k90.variant_expression(d, cfg, True, k90.SOFTCAP, causal=True)
            want = online.replace(f", {cfg.consumers}, {k90.SOFTCAP}, ", f", {cfg.consumers}, {flags}, ")
            assert want != online and want in exprs, online
    for bad_flags in (k90.ALIBI | k90.FIXED_MAX, k90.WINDOW | k90.SOFTCAP | k90.FIXED_MAX):
        with pytest.raises(ValueError, match="kCausal"):
            k90.variant_expression(128, k90.DEFAULTS[(128, True)], True, bad_flags, causal=True)

    def va(left=UNBOUNDED, right=UNBOUNDED, softcap=0.0, alibi=None, p=0.0):
        return attention_fwd_sm80.VariantArgs(left, right, softcap, alibi, p)

    q, lse = torch.empty(1, 2, 64, 128, dtype=torch.bfloat16), torch.empty(1, 2, 64)
    for bad_q, bad, match in ((q, va(right=0, alibi=0), "fixed_max"), (q, va(right=0, softcap=50.0), "fixed_max"),
                              (q.half(), va(right=0, softcap=30.0), "fixed_max"),
                              (q, va(100, 0, softcap=30.0), "causal_kernel"),
                              (q, va(softcap=30.0), "causal_kernel")):
        with pytest.raises(ValueError, match=match):
            k90.ForwardPlan(bad_q, bad_q, bad_q, bad_q, lse, causal=False, scale=1.0, variants=bad, fixed_max=True,
                            causal_kernel=True)


def test_sm90_softcap_three_consumer_switch():
    """Softcap alone switches to three consumers at SOFTCAP_WIDE_MIN_QUERIES' queries (d = 128: 2048,
    where the plain kernel and ALiBi wait for 8192), causal and not, with the online and the fixed
    max alike, unless GQA packing needs the 128-row tile; d = 64 keeps the plain switch; every choice
    names a registered instantiation of both kinds of max."""
    from tileattn.kernels import attention_fwd_sm90 as k90

    registered = set(k90.INSTANTIATIONS)
    assert k90.SOFTCAP_WIDE_MIN_QUERIES[128] < k90.WIDE_MIN_QUERIES[128]
    for d in (64, 128):
        switch = k90.SOFTCAP_WIDE_MIN_QUERIES.get(d, k90.WIDE_MIN_QUERIES[d])
        for nq in (1, switch - 1, switch, k90.WIDE_MIN_QUERIES[d], 1 << 15):
            for heads, kv_heads, pack in ((32, 32, None), (32, 8, None), (24, 2, True)):
                kw = dict(seqlen_q=nq, heads=heads, kv_heads=kv_heads, pack_gqa=pack)
                causal = k90.causal_variant_config(d, nq, softcap=True, **kw)
                full = k90.variant_config(d, k90.SOFTCAP, nq, **kw)
                want = 3 if nq >= switch and k90.default_config(d, False, nq, wide_min_queries=switch, **kw).consumers == 3 else 2
                assert full.consumers == want, (d, nq, heads, kv_heads, str(full))
                assert causal.consumers == k90.default_config(d, True, nq, wide_min_queries=switch, **kw).consumers
                for extra in (0, k90.FIXED_MAX):
                    assert k90.variant_expression(d, causal, True, k90.SOFTCAP | extra, causal=True) in registered
                    assert k90.variant_expression(d, full, True, k90.SOFTCAP | extra) in registered
                # ALiBi alone keeps the plain kernel's switch
                assert k90.causal_variant_config(d, nq, **kw) == k90.causal_variant_config(d, nq, softcap=d != 128, **kw)
                assert k90.variant_config(d, k90.ALIBI, nq, **kw).consumers == k90.default_config(d, False, nq, **kw).consumers
                # the non-causal fixed max: FIXED_MAX_WIDE's 96-key tile in place of the 128-key one
                fixed = k90.fixed_max_tile(d, full)
                assert k90.variant_expression(d, fixed, True, k90.SOFTCAP | k90.FIXED_MAX) in registered
                if d in k90.FIXED_MAX_WIDE and full.consumers == 3:
                    assert (fixed.block_n, fixed.consumers, fixed.persistent) == (96, 3, full.persistent), str(fixed)
                else:
                    assert fixed == full
    kw = dict(seqlen_q=2048, heads=32, kv_heads=32)
    assert k90.causal_variant_config(128, 2048, softcap=True, **kw).consumers == 3
    assert k90.causal_variant_config(128, 2048, **kw).consumers == 2
    assert k90.variant_config(128, k90.SOFTCAP, 2048, **kw).consumers == 3
    assert k90.variant_config(128, k90.ALIBI, 2048, **kw).consumers == 2
    assert k90.variant_config(128, k90.SOFTCAP | k90.WINDOW, 2048, **kw).consumers == 2
    assert k90.variant_config(128, k90.SOFTCAP, 2047, seqlen_q=2047).consumers == 2


def test_sm90_bwd_split_masked_kernels():
    """The split softcap backward: softcap alone, atomic dQ, d = 64 / 128, both dtypes, each the
    registered softcap kernel's expression with SPLIT_MASKED added; BackwardPlan refuses it for other
    variants, the deterministic mode and d = 256, before touching a GPU; the dispatcher asks for it
    only where SM90_SOFTCAP_BWD_SPLIT lists the head dim, which is every head dim it implements."""
    from tileattn.kernels import attention_bwd_sm90 as ab, attention_fwd_sm80, dispatch

    exprs = ab.SPLIT_MASKED_INSTANTIATIONS
    assert len(exprs) == len(set(exprs)) == 4 and set(exprs) <= set(ab.INSTANTIATIONS), exprs
    bits = ab.WINDOW | ab.SOFTCAP
    for d in ab.SPLIT_MASKED_HEAD_DIMS:
        for bf16 in (False, True):
            plain = ab.variant_expression(d, ab.VARIANT_DEFAULTS[d], bf16, bits, False)
            assert plain in ab.INSTANTIATIONS and plain[:-2] + f"{bits | ab.SPLIT_MASKED}>" in exprs, plain

    def va(left=UNBOUNDED, right=UNBOUNDED, softcap=0.0, alibi=None):
        return attention_fwd_sm80.VariantArgs(left, right, softcap, alibi, 0.0)

    for d, opts, det in ((128, va(softcap=30.0, alibi=0), False), (128, va(right=0), False),
                         (128, va(softcap=30.0), True), (256, va(softcap=30.0), False)):
        t = torch.empty(1, 2, 64, d, dtype=torch.bfloat16)
        lse = torch.empty(1, 2, 64)
        with pytest.raises(ValueError, match="split_masked"):
            ab.BackwardPlan(t, t, t, t, lse, t, t, t, t, causal=False, scale=1.0, deterministic=det, variants=opts,
                            split_masked=True)
    assert dispatch.SM90_SOFTCAP_BWD_SPLIT == set(ab.SPLIT_MASKED_HEAD_DIMS)

def test_sm90_causal_variant_kernels():
    """ALiBi alone and softcap alone with the causal window have kCausal kernels (d = 64, 128) at the
    plain causal kernel's two-consumer tile and at CAUSAL_VARIANT_WIDE's; causal_variant_flags finds
    exactly those calls; causal_variant_config follows the plain causal kernel's consumer count and
    always names a registered instantiation; ForwardPlan refuses causal_kernel for anything else."""
    from dataclasses import replace

    from tileattn.kernels import attention_fwd_sm80, attention_fwd_sm90 as k90

    exprs = k90.CAUSAL_VARIANT_INSTANTIATIONS
    assert len(exprs) == len(set(exprs)) == 2 * 2 * 2 * 2 and set(exprs) <= set(k90.INSTANTIATIONS), exprs
    for d in k90.CAUSAL_VARIANT_HEAD_DIMS:
        for bf16 in (False, True):
            for flags in k90.CAUSAL_VARIANT_FLAGS:
                two = k90.variant_expression(d, k90.DEFAULTS[(d, True)], bf16, flags, causal=True)
                assert two.startswith(k90.expression(d, k90.DEFAULTS[(d, True)], True, bf16)[:-1]
                                      + f", 2, {flags}, const float*") and two in exprs, two
                wide = k90.variant_expression(d, k90.CAUSAL_VARIANT_WIDE[d], bf16, flags, causal=True)
                assert k90.CAUSAL_VARIANT_WIDE[d].consumers == 3
                assert wide.startswith(k90.expression(d, k90.CAUSAL_VARIANT_WIDE[d], True, bf16)[:-1]
                                       + f", {flags}, const float*") and wide in exprs, wide
    for flags in (k90.WINDOW, k90.WINDOW | k90.ALIBI, k90.ALIBI | k90.SOFTCAP, k90.DROPOUT | k90.ALIBI):
        with pytest.raises(ValueError, match="kCausal"):
            k90.variant_expression(128, k90.DEFAULTS[(128, True)], True, flags, causal=True)

    def va(left, right, softcap=0.0, alibi=None, p=0.0):
        return attention_fwd_sm80.VariantArgs(left, right, softcap, alibi, p)

    assert k90.causal_variant_flags(va(UNBOUNDED, 0, alibi=0)) == k90.ALIBI
    assert k90.causal_variant_flags(va(UNBOUNDED, 0, softcap=30.0)) == k90.SOFTCAP
    for other in (va(UNBOUNDED, 0), va(UNBOUNDED, 0, 30.0, 0), va(100, 0, alibi=0), va(UNBOUNDED, 5, alibi=0),
                  va(UNBOUNDED, UNBOUNDED, alibi=0), va(UNBOUNDED, UNBOUNDED, softcap=30.0),
                  va(UNBOUNDED, 0, alibi=0, p=0.1)):
        assert k90.causal_variant_flags(other) is None, other

    registered = set(k90.INSTANTIATIONS)
    seen_consumers = set()
    for d in k90.CAUSAL_VARIANT_HEAD_DIMS:
        switch = k90.WIDE_MIN_QUERIES[d]
        for nq in (None, 1, 129, switch - 1, switch, switch + 76, 1 << 16):
            for heads, kv_heads in ((1, 1), (32, 32), (32, 8), (3, 1), (24, 2)):
                for pack_gqa in (None, False, True):
                    kw = dict(seqlen_q=nq, heads=heads, kv_heads=kv_heads, pack_gqa=pack_gqa)
                    plain = k90.default_config(d, True, 4096, **kw)
                    got = k90.causal_variant_config(d, 4096, **kw)
                    want = (replace(k90.CAUSAL_VARIANT_WIDE[d], persistent=plain.persistent)
                            if plain.consumers == 3 else plain)
                    assert got == want, (d, nq, heads, kv_heads, pack_gqa, str(got))
                    seen_consumers.add(got.consumers)
                    for flags in k90.CAUSAL_VARIANT_FLAGS:
                        assert k90.variant_expression(d, got, True, flags, causal=True) in registered, str(got)
    assert seen_consumers == {2, 3}

    q = torch.empty(1, 2, 64, 128, dtype=torch.bfloat16)
    lse = torch.empty(1, 2, 64)
    for bad in (va(UNBOUNDED, 0), va(10, 0, alibi=0), va(UNBOUNDED, 0, 30.0, 0)):
        with pytest.raises(ValueError, match="causal_kernel"):
            k90.ForwardPlan(q, q, q, q, lse, causal=False, scale=1.0, variants=bad, causal_kernel=True)
    with pytest.raises(ValueError, match="causal_kernel"):
        q256 = torch.empty(1, 2, 64, 256, dtype=torch.bfloat16)
        k90.ForwardPlan(q256, q256, q256, q256, lse, causal=False, scale=1.0, variants=va(UNBOUNDED, 0, alibi=0),
                        causal_kernel=True)


@pytest.mark.parametrize(
    "window, softcap, alibi, expected",
    [
        ((UNBOUNDED, UNBOUNDED), 0.0, None, 0),
        ((UNBOUNDED, 0), 0.0, None, 1),        # causal alone is a window
        ((4095, 0), 0.0, None, 1),
        ((UNBOUNDED, UNBOUNDED), 30.0, None, 2),
        ((UNBOUNDED, UNBOUNDED), 0.0, 0, 4),
        ((7, UNBOUNDED), 50.0, 8, 7),
    ],
)
def test_sm90_variant_flags(window, softcap, alibi, expected):
    from tileattn.kernels import attention_fwd_sm80, attention_fwd_sm90

    va = attention_fwd_sm80.VariantArgs(*window, softcap, alibi, 0.0)
    assert attention_fwd_sm90.variant_flags(va) == expected, va


def test_sm90_variant_config_gives_alibi_or_softcap_alone_the_plain_wide_tile():
    """variant_config: ALiBi alone and softcap alone (non-causal) take the plain non-causal kernel's
    default tile where that is the three-consumer one (from WIDE_MIN_QUERIES[d] queries, where GQA
    packing allows 192-row tiles); every other flag set, and those two elsewhere, VARIANT_DEFAULTS'
    tile (never LONG_DEFAULTS'). Whatever it picks must be a registered instantiation."""
    from dataclasses import replace

    from tileattn.kernels import attention_fwd_sm90 as k90

    registered = set(k90.INSTANTIATIONS)
    widened = 0
    for d in k90.HEAD_DIMS:
        flag_sets = (*range(1, 8), *k90.DROPOUT_FLAG_SETS[d])  # the registered sets (dropout: per head dim)
        variant_tile = replace(k90.VARIANT_DEFAULTS[d], persistent=d in k90.PERSISTENT_HEAD_DIMS)
        switch = k90.WIDE_MIN_QUERIES.get(d, 2048)
        for nq in (None, 1, 129, switch - 1, switch, switch + 76, 1 << 16):
            for nk in (1, *k90.LONG_KEYS.values(), 4096, 1 << 16):
                for heads, kv_heads in ((1, 1), (32, 32), (32, 8), (8, 1), (6, 2), (3, 1), (24, 2)):
                    group = heads // kv_heads
                    for pack_gqa in (None, False, True):
                        kw = dict(seqlen_q=nq, heads=heads, kv_heads=kv_heads, pack_gqa=pack_gqa)
                        for flags in flag_sets:
                            # softcap alone: SOFTCAP_WIDE_MIN_QUERIES where listed; ALiBi: the plain switch
                            own = k90.SOFTCAP_WIDE_MIN_QUERIES.get(d) if flags == k90.SOFTCAP else None
                            plain = k90.default_config(d, False, nk, wide_min_queries=own, **kw)
                            got = k90.variant_config(d, flags, nk, **kw)
                            what = (d, flags, nq, nk, heads, kv_heads, pack_gqa, str(got))
                            if flags in (k90.ALIBI, k90.SOFTCAP) and plain.consumers == 3:
                                assert got == plain, what
                                # the switch (own or WIDE_MIN_QUERIES), a packing that fits 192 rows
                                assert nq is None or nq >= (own or k90.WIDE_MIN_QUERIES[d]), what
                                packs = (pack_gqa and group > 1) if pack_gqa is not None else (
                                    nq is not None and k90.gqa_pack(heads, kv_heads, nq) > 1)
                                assert not packs or k90.packable(group, 192), what
                                widened += 1
                            else:
                                assert got == variant_tile, what
                            assert got.persistent == (d in k90.PERSISTENT_HEAD_DIMS), what
                            assert k90.variant_expression(d, got, False, flags) in registered, what
                            assert k90.variant_expression(d, got, True, flags) in registered, what
    assert widened > 0
    # the switch itself, MHA and GQA 3 (packs 3 heads x 64 positions into 192 rows), and where it stays narrow
    for d in (64, 128):
        wide = replace(k90.WIDE_DEFAULTS[(d, False)], persistent=True)
        narrow = replace(k90.VARIANT_DEFAULTS[d], persistent=True)
        assert (wide.consumers, narrow.consumers) == (3, 2)
        for flags in (k90.ALIBI, k90.SOFTCAP):
            n = (k90.SOFTCAP_WIDE_MIN_QUERIES.get(d) if flags == k90.SOFTCAP else None) or k90.WIDE_MIN_QUERIES[d]
            for heads, kv_heads in ((4, 4), (3, 1)):
                pick = functools.partial(k90.variant_config, d, flags, n + 76, heads=heads, kv_heads=kv_heads)
                assert pick(seqlen_q=n - 1) == narrow and pick(seqlen_q=n) == wide and pick(seqlen_q=n + 76) == wide
                if heads > kv_heads:
                    assert pick(seqlen_q=n + 76, pack_gqa=True) == wide
        n = k90.WIDE_MIN_QUERIES[d]
        assert k90.gqa_pack(3, 1, n + 76, 192) == 3  # GQA 3 past the switch: packed on the wide tile
        assert k90.variant_config(d, k90.ALIBI, seqlen_q=n, heads=32, kv_heads=8, pack_gqa=True) == narrow
        assert k90.variant_config(d, k90.ALIBI | k90.WINDOW, seqlen_q=n) == narrow  # causal ALiBi: windowed
        assert k90.variant_config(d, k90.SOFTCAP | k90.WINDOW, seqlen_q=n) == narrow  # causal softcap: windowed
        assert k90.variant_config(d, k90.ALIBI | k90.SOFTCAP, seqlen_q=n) == narrow
    # three consumers: ALiBi alone, softcap alone and the varlen layout only among the flavoured kernels
    cfg = k90.WIDE_DEFAULTS[(128, False)]
    for flags in (*range(1, 8), *k90.DROPOUT_FLAG_SETS[128]):
        if flags not in (k90.ALIBI, k90.SOFTCAP):
            with pytest.raises(ValueError, match="three-consumer"):
                k90.variant_expression(128, cfg, True, flags)


def test_variant_forward_routing():
    from tileattn.kernels import dispatch

    bf16, fp16 = torch.bfloat16, torch.float16
    for d in (64, 128, 256):
        for dtype in (bf16, fp16):
            assert dispatch.variant_forward_family("sm_90a", dtype, d, 0.0) == "attention_fwd_sm90", (d, dtype)
            assert dispatch.variant_forward_family("sm_90a", dtype, d, 0.1) == "attention_fwd_sm80", "dropout"
            assert dispatch.variant_forward_family("sm_80", dtype, d, 0.0) == "attention_fwd_sm80", "A100"
            assert dispatch.variant_forward_family("sm_86", dtype, d, 0.0) == "attention_fwd_sm80", "sm_86"
    for d in (32, 96):
        assert dispatch.variant_forward_family("sm_90a", bf16, d, 0.0) == "attention_fwd_sm80", d


def _trunc_div(a: int, b: int) -> int:
    """C++ int division (toward zero)."""
    return abs(a) // b if a >= 0 else -(abs(a) // b)


def _window_range(m_block, rows, nq, nk, left, right, block_n):
    """attention_fwd_sm90.cu window_range, restated (change them together): (n_end, n_masked,
    n_begin, n_unmasked_end)."""
    diag = nk - nq

    def lo(i):
        return max(0, i + diag - left)

    def hi(i):
        return min(nk - 1, i + diag + right)

    first, last = m_block * rows, min(m_block * rows + rows, nq) - 1
    if hi(last) < lo(first):
        return 0, 0, 0, 0
    n_begin, n_end = _trunc_div(lo(first), block_n), _trunc_div(hi(last), block_n) + 1
    iters = n_end - n_begin
    hi_first = hi(first)
    hi_cut = 0 if hi_first < 0 else _trunc_div(hi_first + 1, block_n)
    masked = n_end - max(hi_cut, n_begin)
    lo_from = n_end - _trunc_div(lo(last) + block_n - 1, block_n)
    if lo_from <= 0:
        masked = iters
    return n_end, masked, n_begin, max(min(lo_from, iters), masked)


def test_sm90_window_block_range_covers_every_visible_key_and_masks_every_cut_block():
    # The Hopper forward visits blocks [n_begin, n_end) from the top and skips the per-score window test
    # on visits [n_masked, n_unmasked_end): every visible key must lie in a visited block, and every
    # visited block holding an invisible (row, key) pair of the tile must be a masked visit.
    rng = random.Random(15)
    for _ in range(3000):
        block_n = rng.choice([64, 128])
        nq, nk = rng.randint(1, 600), rng.randint(1, 600)
        left = rng.choice([UNBOUNDED, 0, rng.randint(0, 300)])
        right = rng.choice([UNBOUNDED, 0, rng.randint(0, 300)])
        rows = rng.choice([128, 64, 16, 1])  # GQA packing: 128 / pack positions per tile
        m_block = rng.randint(0, (nq + rows - 1) // rows - 1)
        n_end, masked, n_begin, unmasked_end = _window_range(m_block, rows, nq, nk, left, right, block_n)
        case = (nq, nk, left, right, rows, m_block, block_n)
        iters = n_end - n_begin
        assert iters == 0 or 0 <= masked <= unmasked_end <= iters, case
        diag = nk - nq
        positions = np.arange(m_block * rows, min(m_block * rows + rows, nq))[:, None]
        for n in range((nk + block_n - 1) // block_n):
            keys = np.arange(n * block_n, n * block_n + block_n)[None, :]
            visible = (keys >= positions + diag - left) & (keys <= positions + diag + right) & (keys < nk)
            if not n_begin <= n < n_end:
                assert not visible.any(), f"{case}: block {n} holds visible keys but is skipped"
                continue
            it = n_end - 1 - n
            if not visible.all():
                assert it < masked or it >= unmasked_end, f"{case}: block {n} (visit {it}) needs the window test"


def test_softcap_kernel_arguments_give_the_capped_logit_in_log2_units():
    # Every softcap kernel forms the log2-unit logit as cap_out * tanh(q.k * cap_in) (variants.cuh
    # softcap_tanh, the hardware tanh); the host's two parameters must make that cap * tanh(scale q.k /
    # cap) * log2(e), the reference's logit in log2 units, for any scale and cap.
    from tileattn.kernels.attention_fwd_sm80 import VariantArgs

    qk = np.linspace(-400, 400, 4001)
    for scale, cap in ((0.125, 30.0), (0.0883883, 5.0), (1.0, 50.0), (0.05, 0.5)):
        args = VariantArgs(softcap=cap).kernel_args(scale)
        cap_in, cap_out = float(args[6]), float(args[7])
        got = cap_out * np.tanh(qk * cap_in)
        want = cap * np.tanh(scale * qk / cap) * math.log2(math.e)
        assert np.abs(got - want).max() <= 1e-6 * cap, f"scale={scale} cap={cap}: cap_in={cap_in} cap_out={cap_out}"
    assert float(VariantArgs().kernel_args(0.125)[6]) == 0.0, "softcap off must pass cap_in = 0"


def _alibi_scores(s, n, pos, t, diag, side, slope_raw, block_n):
    """fp32 model of attention_fwd_sm90.cu alibi_scores for one thread: s [2, block_n / 4] (row h =
    g or g + 8, its columns 2t + 8j + e in j, e order); returns (x, shift)."""
    f32 = np.float32
    c = np.array([8 * j + e for j in range(block_n // 8) for e in range(2)], dtype=f32)
    xs, shifts = [], []
    for h in range(2):
        dist0 = f32(pos[h] + diag - (n * block_n + 2 * t))
        if side == 0:
            x = (np.float64(slope_raw[h]) * np.abs(dist0 - c) + s[h]).astype(f32)  # fmaf: one rounding
            shift = f32(0)
        else:
            k = -slope_raw[h] if side > 0 else slope_raw[h]
            x = (np.float64(k) * c + s[h]).astype(f32)
            shift = f32(-k * dist0)
        xs.append(x)
        shifts.append(shift)
    return np.stack(xs), np.array(shifts)


def test_sm90_alibi_one_sided_blocks_give_the_exact_bias():
    # The Hopper forward's ALiBi alone works in raw q.k units: on a block wholly on one side of every tile
    # row's diagonal key it adds k * (8j + e) per score and leaves the row constant to the softmax's shift.
    # The side rule must never call a block one-sided that some (row, key) pair crosses, and x + shift must
    # equal s - slope / scale * |i + diag - j| to fp32 rounding of the row's largest term.
    rng = np.random.default_rng(151)
    f32 = np.float32
    one_sided = 0
    for _ in range(400):
        block_n = int(rng.choice([64, 80, 128]))
        block_m = int(rng.choice([128, 192]))  # two or three consumer warpgroups (ALiBi alone has both)
        rows = int(rng.choice([block_m, 64, 16, 1]))
        nq, nk = int(rng.integers(1, 3000)), int(rng.integers(1, 3000))
        diag = nk - nq
        m_block = int(rng.integers(0, (nq + rows - 1) // rows))
        diag_lo = m_block * rows + diag
        diag_hi = diag_lo + rows - 1
        slope_raw = -f32(rng.choice([2.0**-8, 0.0625, 0.5, rng.random()])) / f32(rng.choice([0.125, 0.088388]))
        n = int(rng.integers(0, (nk + block_n - 1) // block_n))
        side = 1 if (n + 1) * block_n - 1 <= diag_lo else -1 if n * block_n >= diag_hi else 0
        positions = np.arange(m_block * rows, m_block * rows + rows)
        dists = positions[:, None] + diag - np.arange(n * block_n, n * block_n + block_n)[None, :]
        if side > 0:
            assert (dists >= 0).all(), (block_n, rows, nq, nk, m_block, n)
        if side < 0:
            assert (dists <= 0).all(), (block_n, rows, nq, nk, m_block, n)
        one_sided += side != 0
        for g in (0, 3, 7):
            r0 = int(rng.integers(0, block_m // 16)) * 16 + g  # a warp's row g of one of the consumers' warps
            pos = [m_block * rows + r0 % rows, m_block * rows + (r0 + 8) % rows]
            row_max = [[], []]  # per thread t of the quad: max of its shifted scores (what quad_max takes)
            true_max = [-np.inf, -np.inf]
            big = 1.0  # the largest |shift| of the quad
            for t in range(4):
                s = rng.normal(0, 4, (2, block_n // 4)).astype(f32)
                x, shift = _alibi_scores(s, n, pos, t, diag, side, [slope_raw, slope_raw], block_n)
                cols = np.array([n * block_n + 8 * j + 2 * t + e for j in range(block_n // 8) for e in range(2)])
                for h in range(2):
                    want = s[h].astype(np.float64) + np.float64(slope_raw) * np.abs(pos[h] + diag - cols)
                    got = x[h].astype(np.float64) + np.float64(shift[h])
                    bound = 4 * np.finfo(f32).eps * (1 + np.abs(want).max() + abs(float(shift[h])))
                    assert np.abs(got - want).max() <= bound, (block_n, rows, nq, nk, m_block, n, side)
                    row_max[h].append(float(x[h].max()) + float(shift[h]))
                    big = max(big, abs(float(shift[h])))
                    true_max[h] = max(true_max[h], float(want.max()))
            # softmax_step's row max: the shift differs between the quad's threads (dist0 holds 2t), so it
            # is added before the quad reduction; the max of the unshifted scores plus one thread's shift is not it
            for h in range(2):
                assert abs(max(row_max[h]) - true_max[h]) <= 4 * np.finfo(f32).eps * (abs(true_max[h]) + big)
    assert one_sided > 100, f"only {one_sided} one-sided blocks drawn"


# ---------------------------------------------------------------------------------------------
# The traced path (torch.compile, fake tensors): window / softcap / ALiBi as one custom op
# ---------------------------------------------------------------------------------------------
def test_variants_trace_as_one_custom_op_with_autograd():
    import re

    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v, slopes):
        return tileattn.attention(q, k, v, True, window=(16, -1), softcap=30.0, alibi_slopes=slopes) * 2

    compiled = torch.compile(f, backend=capture, fullgraph=True)
    with FakeTensorMode():
        q = torch.empty(1, 4, 33, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(1, 2, 40, 64, dtype=torch.bfloat16, device="cuda")
        slopes = torch.empty(4, dtype=torch.float32, device="cuda")
        out = compiled(q, k, k, slopes)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        with pytest.raises(NotImplementedError, match="generator"):
            tileattn.attention(q, k, k, dropout_p=0.1, generator=torch.Generator())
        with pytest.raises(ValueError, match="alibi_slopes must be float32"):
            tileattn.attention(q, k, k, alibi_slopes=slopes.double())
    code = graphs[0].code
    assert len(re.findall(r"tileattn\.attention_variants_fwd", code)) == 1, code
    # causal folded into the window: right edge 0, left 16; traced without grad: inference (no backward)
    assert "16, 0, 30.0, True" in code, code

    q, k, v = (torch.empty(2, 4, 20, 64, dtype=torch.bfloat16, device="meta").requires_grad_() for _ in range(3))
    out, lse = torch.ops.tileattn.attention_variants_fwd(q, k, v, None, 0.125, False, 3, 0, 0.0, False)
    assert out.requires_grad and not lse.requires_grad
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_dropout_traces_as_one_custom_op_with_its_rng_state():
    import re

    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def drawn(q, k, v):  # seed drawn at run time inside the op
        return tileattn.attention(q, k, v, True, dropout_p=0.1, window=(8, -1))

    def seeded(q, k, v):  # a fixed (uint64) seed: a constant rng tensor of the graph
        return tileattn.attention(q, k, v, dropout_p=0.25, seed=(1 << 64) - 1, offset=12)

    with FakeTensorMode():
        q = torch.empty(1, 4, 33, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(1, 2, 40, 64, dtype=torch.bfloat16, device="cuda")
        for f in (drawn, seeded):
            out = torch.compile(f, backend=capture, fullgraph=True)(q, k, k)
            assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert len(graphs) == 2
    for gm in graphs:
        assert len(re.findall(r"tileattn\.attention_dropout_fwd", gm.code)) == 1, gm.code
        assert "attention_variants_fwd" not in gm.code, gm.code
    assert "None, 0.125, False, 8, 0, 0.0, 0.1" in graphs[0].code, graphs[0].code  # rng None: drawn in the op

    q, k, v = (torch.empty(2, 4, 20, 64, dtype=torch.bfloat16, device="meta").requires_grad_() for _ in range(3))
    out, lse, rng = torch.ops.tileattn.attention_dropout_fwd(q, k, v, None, None, 0.125, False, 3, 0, 0.0, 0.1)
    assert out.requires_grad and not lse.requires_grad and not rng.requires_grad
    assert rng.shape == (2,) and rng.dtype == torch.int64 and rng.device.type == "cpu"
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("seed, offset", [(0, 0), ((1 << 63) - 1, 4), (1 << 63, (1 << 64) - 4), ((1 << 64) - 1, 8)])
def test_dropout_rng_state_round_trips_uint64(seed, offset):
    from tileattn.dropout import rng_state, rng_values

    t = rng_state(seed, offset)
    assert t.dtype == torch.int64 and t.device.type == "cpu"
    assert rng_values(t) == (seed, offset), t


def test_a_generator_under_torch_compile_is_drawn_eagerly_on_every_call():
    # traced_rng with a generator under Dynamo: drawn_rng_state breaks the graph and draws at run time, so
    # each call of the compiled function advances the generator as the eager draw_seed does; outside
    # Dynamo (fake tensors alone) a draw would become a graph constant, which stays refused.
    from tileattn.dropout import check_dropout, draw_seed, rng_values, traced_rng

    def traced(x, generator):  # the API's order: the argument checks, then the rng
        return x + check_dropout(0.1, generator, None, None), traced_rng(generator, None, None, x.device)

    torch._dynamo.reset()
    compiled = torch.compile(traced, backend="eager")
    gen, twin = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    drawn = [rng_values(compiled(torch.zeros(3), gen)[1]) for _ in range(3)]
    assert drawn == [draw_seed(twin, None, None, "cpu") for _ in range(3)], drawn
    assert len(set(drawn)) == 3, drawn
    with pytest.raises(NotImplementedError, match="generator under fake tensors outside torch.compile"):
        traced_rng(gen, None, None, "cpu")
    assert traced_rng(None, 5, None, "cpu").tolist() == [5, 0] and traced_rng(None, None, None, "cpu") is None


def test_varlen_variants_trace_with_autograd():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(50, 4, 64, dtype=torch.float16, device="cuda")
        k = torch.empty(60, 2, 64, dtype=torch.float16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        slopes = torch.empty(2, 4, dtype=torch.float32, device="cuda")
        out, lse = tileattn.attention_varlen(q, k, k, cu, cu, 30, 30, True, return_lse=True, window=(8, 8),
                                             softcap=5.0, alibi_slopes=slopes)
        assert out.shape == q.shape and lse.shape == (4, 50)
    # Autograd wiring on meta tensors (no CUDA autograd device here).
    q, k, v = (torch.empty(n, h, 64, dtype=torch.float16, device="meta").requires_grad_()
               for n, h in ((50, 4), (60, 2), (60, 2)))
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = torch.ops.tileattn.attention_varlen_variants_fwd(q, k, v, cu, cu, None, 30, 30, 0.125, False, 8, 0,
                                                                 5.0)
    assert out.requires_grad and not lse.requires_grad
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


# ---------------------------------------------------------------------------------------------
# Varlen dropout on the traced path: tileattn::attention_varlen_dropout_fwd/bwd
# ---------------------------------------------------------------------------------------------
def _varlen_fake_cuda():
    """q [50, 4, 64], k [60, 2, 64] bf16, cu_seqlens [3] int32, slopes [2, 4] fp32 as fake CUDA tensors
    (call inside FakeTensorMode)."""
    q = torch.empty(50, 4, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.empty(60, 2, 64, dtype=torch.bfloat16, device="cuda")
    cu = torch.empty(3, dtype=torch.int32, device="cuda")
    slopes = torch.empty(2, 4, dtype=torch.float32, device="cuda")
    return q, k, cu, slopes


def test_varlen_dropout_traces_as_one_custom_op_with_its_rng_state():
    """torch.compile(fullgraph=True) (a graph break would raise) records one varlen dropout node: rng
    None when drawn at run time, a constant [seed, offset] (int64 two's complement) when seeded."""
    import re

    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def drawn(q, k, cu, slopes):
        return tileattn.attention_varlen(q, k, k, cu, cu, 30, 30, True, 0.125, dropout_p=0.1, window=(8, -1))

    def seeded(q, k, cu, slopes):
        return tileattn.attention_varlen(q, k, k, cu, cu, 40, 40, dropout_p=0.25, seed=(1 << 64) - 1, offset=12,
                                         alibi_slopes=slopes, return_lse=True)

    with FakeTensorMode():
        q, k, cu, slopes = _varlen_fake_cuda()
        out = torch.compile(drawn, backend=capture, fullgraph=True)(q, k, cu, slopes)
        assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.device.type == "cuda"
        out, lse = torch.compile(seeded, backend=capture, fullgraph=True)(q, k, cu, slopes)
        assert out.shape == q.shape and lse.shape == (4, 50) and lse.dtype == torch.float32
        with pytest.raises(NotImplementedError, match="generator"):
            tileattn.attention_varlen(q, k, k, cu, cu, 30, 30, dropout_p=0.1, generator=torch.Generator())
        with pytest.raises(ValueError, match="dropout_p"):
            tileattn.attention_varlen(q, k, k, cu, cu, 30, 30, dropout_p=1.0)
    assert len(graphs) == 2, f"{len(graphs)} graphs for 2 compiled functions"
    for gm in graphs:
        assert len(re.findall(r"tileattn\.attention_varlen_dropout_fwd", gm.code)) == 1, gm.code
        assert not re.search(r"attention_varlen_variants_fwd|attention_dropout_fwd", gm.code), gm.code
    # drawn: alibi None, rng None (drawn in the op), causal folded into the window (8, 0)
    assert "None, None, 30, 30, 0.125, False, 8, 0, 0.0, 0.1)" in graphs[0].code, graphs[0].code
    # seeded: seed 2^64 - 1 is -1 in two's complement; no window (both edges UNBOUNDED)
    assert "torch.tensor([-1, 12], dtype = torch.int64)" in graphs[1].code, graphs[1].code
    assert f"rng, 40, 40, 0.125, False, {UNBOUNDED}, {UNBOUNDED}, 0.0, 0.25)" in graphs[1].code, graphs[1].code


def _dense_dropout_loss(q, k, v):
    out, _, _ = torch.ops.tileattn.attention_dropout_fwd(q, k, v, None, None, 0.125, False, 8, 0, 0.0, 0.1)
    return out.float().sum()


def _varlen_dropout_loss(q, k, v):
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out, _, _ = torch.ops.tileattn.attention_varlen_dropout_fwd(q, k, v, cu, cu, None, None, 30, 30, 0.125, False, 8,
                                                                0, 0.0, 0.1)
    return out.float().sum()


@pytest.mark.parametrize("name, loss, shapes", [
    ("attention_dropout", _dense_dropout_loss, ((2, 4, 20, 64), (2, 2, 24, 64))),
    ("attention_varlen_dropout", _varlen_dropout_loss, ((50, 4, 64), (60, 2, 64))),
])
def test_dropout_backward_takes_the_forwards_rng_state(name, loss, shapes):
    """AOTAutograd (on meta tensors: no CUDA autograd here) splits forward and backward: the forward
    graph holds one <name>_fwd, the backward graph one <name>_bwd whose rng argument is the state
    the forward returned (saved between the graphs), so both passes apply one mask."""
    from functorch.compile import aot_function, make_boxed_func

    graphs = {}

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compile_graph

    q = torch.empty(shapes[0], dtype=torch.float16, device="meta", requires_grad=True)
    k, v = (torch.empty(shapes[1], dtype=torch.float16, device="meta", requires_grad=True) for _ in range(2))
    aot_function(loss, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))(q, k, v).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape

    def op_nodes(gm, op):
        return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == op]

    (fwd,) = op_nodes(graphs["fw"], getattr(torch.ops.tileattn, f"{name}_fwd").default)
    (bwd,) = op_nodes(graphs["bw"], getattr(torch.ops.tileattn, f"{name}_bwd").default)
    saved = list(graphs["fw"].graph.output_node().args[0][1:])  # forward outputs after the loss
    inputs = [n for n in graphs["bw"].graph.nodes if n.op == "placeholder"]
    rng_arg = bwd.args[9 if name == "attention_varlen_dropout" else 7]
    assert rng_arg.op == "placeholder", graphs["bw"].code
    held = saved[inputs.index(rng_arg)]
    assert held.target is operator.getitem and held.args == (fwd, 2), (graphs["fw"].code, graphs["bw"].code)


def _meta_dropout_args(name, rng):
    q = torch.empty(50, 4, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k, v = (torch.empty(60, 2, 64, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in range(2))
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    fwd = (q, k, v, cu, cu, None, rng, 30, 30, 0.125, False, 8, 0, 0.0, 0.1)
    if name == "fwd":
        return fwd
    out, lse, used = torch.ops.tileattn.attention_varlen_dropout_fwd(*fwd)
    return (torch.empty_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, cu, cu, None, used, 30, 30,
            0.125, False, 8, 0, 0.0, 0.1)


@pytest.mark.parametrize("name, rng", [("fwd", None), ("fwd", (5, 8)), ("bwd", ((1 << 64) - 1, 4))],
                         ids=["fwd-drawn", "fwd-seeded", "bwd"])
def test_varlen_dropout_opcheck(name, rng):
    """torch.library.opcheck on meta tensors (the only device here; meta runs the fake
    implementation): schema, autograd registration, fake-tensor propagation, AOT dispatch."""
    from tileattn.dropout import rng_state

    op = getattr(torch.ops.tileattn, f"attention_varlen_dropout_{name}").default
    args = _meta_dropout_args(name, None if rng is None else rng_state(*rng))
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_varlen_dropout_fake_outputs():
    out, lse, rng = torch.ops.tileattn.attention_varlen_dropout_fwd(*_meta_dropout_args("fwd", None))
    assert out.shape == (50, 4, 64) and out.dtype == torch.bfloat16 and lse.shape == (4, 50)
    assert lse.dtype == torch.float32 and rng.shape == (2,) and rng.dtype == torch.int64 and rng.device.type == "cpu"
    assert out.requires_grad and not lse.requires_grad and not rng.requires_grad
    grads = torch.ops.tileattn.attention_varlen_dropout_bwd(*_meta_dropout_args("bwd", None))
    assert [g.shape for g in grads] == [(50, 4, 64), (60, 2, 64), (60, 2, 64)]


def test_sm90_variant_forward_kind():
    """Which Hopper variant forward a call takes: bf16 softcap (alone, causal or windowed) the fixed
    max within its exponent budget; causal ALiBi and the causal softcap the fixed max leaves (fp16, cap
    50) the kCausal kernel at d = 64 / 128; everything else (a window of its own, ALiBi with softcap,
    dropout, d = 256 causal ALiBi) neither."""
    from tileattn.kernels import attention_fwd_sm80, dispatch

    def va(left=UNBOUNDED, right=UNBOUNDED, softcap=0.0, alibi=None, p=0.0):
        return attention_fwd_sm80.VariantArgs(left, right, softcap, alibi, p)

    bf16, fp16 = torch.bfloat16, torch.float16

    def kind(*args):
        return dispatch.sm90_variant_forward_kind(*args, inference=True)

    for d in (64, 128, 256):
        # a forward a backward may follow never takes the fixed max (the kCausal online kernel for
        # causal softcap where SM90_CAUSAL_VARIANT_FORWARD lists the head dim)
        for opts in (va(softcap=30.0), va(right=0, softcap=30.0), va(100, 7, softcap=30.0)):
            want = (False, opts.window_right == 0 and opts.window_left == UNBOUNDED
                    and d in dispatch.SM90_CAUSAL_VARIANT_FORWARD)
            assert dispatch.sm90_variant_forward_kind(bf16, d, 8192, opts, inference=False) == want, (d, opts)
        assert kind(bf16, d, 8192, va(softcap=30.0)) == (True, False), d
        assert kind(bf16, d, 8192, va(right=0, softcap=30.0)) == (True, d in dispatch.SM90_CAUSAL_FIXED_MAX), d
        assert kind(bf16, d, 8192, va(100, 7, softcap=30.0)) == (True, False), d
        assert kind(bf16, d, 8192, va(softcap=50.0)) == (False, False), d
        assert kind(bf16, d, 8192, va(softcap=30.0, alibi=0)) == (False, False), d
        assert kind(bf16, d, 8192, va(right=0, softcap=30.0, p=0.1)) == (False, False), d
    for d, causal_kernel in ((64, True), (128, True), (256, False)):
        for dtype in (bf16, fp16):
            assert kind(dtype, d, 8192, va(right=0, alibi=0)) == (False, causal_kernel), (d, dtype)
        assert kind(fp16, d, 8192, va(right=0, softcap=30.0)) == (False, causal_kernel), d
        assert kind(bf16, d, 8192, va(right=0, softcap=50.0)) == (False, causal_kernel), d
        assert kind(bf16, d, 8192, va(100, 0, alibi=0)) == (False, False), d
        assert kind(fp16, d, 8192, va(softcap=30.0)) == (False, False), d
    # With SM90_CAUSAL_FIXED_MAX holding d = 64 and 128 (what its kernels implement): causal bf16
    # softcap within the budget takes the kCausal kernel with the fixed max; a window of its own, a
    # cap past the budget and d = 256 do not.
    saved = set(dispatch.SM90_CAUSAL_FIXED_MAX)
    dispatch.SM90_CAUSAL_FIXED_MAX.clear()
    dispatch.SM90_CAUSAL_FIXED_MAX.update({64, 128})
    try:
        for d, both in ((64, True), (128, True), (256, False)):
            assert kind(bf16, d, 8192, va(right=0, softcap=30.0)) == (True, both), d
            assert kind(bf16, d, 8192, va(100, 0, softcap=30.0)) == (True, False), d
            assert kind(bf16, d, 8192, va(right=0, softcap=50.0)) == (False, d != 256), d
            assert kind(fp16, d, 8192, va(right=0, softcap=30.0)) == (False, d != 256), d
    finally:
        dispatch.SM90_CAUSAL_FIXED_MAX.clear()
        dispatch.SM90_CAUSAL_FIXED_MAX.update(saved)


def _exp2_poly_model(x: np.ndarray) -> np.ndarray:
    """attention_fwd_sm90.cu's exp2_poly in float32, step by step (its coefficients read from the
    source): the rint by adding 1.5 * 2^23, the reduced argument, the degree-3 polynomial by fused
    multiply-adds (each one rounding: the float32 product is exact in float64), and the integer add
    of rint(x) << 23 to the result's bits."""
    import re

    from tileattn.kernels import attention_fwd_sm90 as k90

    body = k90.FAMILIES[0].path.read_text().split("__device__ __forceinline__ float exp2_poly(float x)")[1].split("\n}\n")[0]
    coeffs = [np.float32(c) for c in re.findall(r"(\d\.\d+)f", body.split("const float p =")[1].split(";")[0])]
    assert len(coeffs) == 4, body
    c3, c2, c1, c0 = coeffs
    f32 = np.float32
    x = x.astype(f32)
    rnd = f32(12582912.0)
    t = (x + rnd).astype(f32)
    f = (x - (t - rnd).astype(f32)).astype(f32)

    def fma(a, b, c):
        return (a.astype(np.float64) * b.astype(np.float64) + np.float64(c)).astype(f32)

    p = fma(fma(fma(np.full_like(f, c3), f, c2), f, c1), f, c0)
    bits = p.view(np.int32).astype(np.int64) + (t.view(np.int32).astype(np.int64) << 23)
    return ((bits + 2**31) % 2**32 - 2**31).astype(np.int32).view(f32)


def test_sm90_exp2_poly_error_bound():
    """exp2_poly (softcap's exponentials on the FP32 pipe at d = 64) is within 7.5e-5 relative of 2^x
    over [-125, 40] (its domain is [-125, 2^22); the fixed max keeps x >= -114), the half-integers
    (f = +-0.5, where rint rounds to even) included. A wrong coefficient or a wrong exponent shift
    breaks the bound (checked by mutating the model)."""
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-125.0, 40.0, 400_001), rng.uniform(-125.0, 0.0, 200_000),
                        np.arange(-125, 40) + 0.5, np.arange(-125, 40) - 0.5, np.arange(-125, 40, dtype=float)])
    x = x[x >= -125.0].astype(np.float32)
    exact = np.exp2(x.astype(np.float64))
    got = _exp2_poly_model(x).astype(np.float64)
    rel = np.abs(got - exact) / exact
    assert rel.max() <= 7.6e-5, (float(rel.max()), float(x[rel.argmax()]))
    # mutations the bound catches: the model itself must be able to fail
    shifted = _exp2_poly_model(x).view(np.int32) + (1 << 23)  # one power of two off
    assert np.abs(shifted.view(np.float32) / exact - 1).max() > 0.5
    assert np.abs(np.float32(1.0001) * _exp2_poly_model(x) / exact - 1).max() > 7.6e-5


def test_sm90_exp2_poly_only_in_softcap_d64_kernels():
    """kExp2FmaPer8 is non-zero only for the fixed-max softcap kernels at d = 64 (kFixed implies softcap,
    alone or windowed, bf16) but those at the three-consumer 128-key tile, softmax_step refuses it
    without the fixed max, and takes it only on unmasked visits (masked scores are -inf, which the
    polynomial does not map to 0)."""
    from tileattn.kernels import attention_fwd_sm90 as k90

    src = k90.FAMILIES[0].path.read_text()
    assert 'static_assert(kFmaPer8 == 0 || kFixed, "exp2_poly' in src
    assert "constexpr int kExp2FmaPer8 = kFixed && kHeadDim == 64 && (kConsumers == 2 || kBlockN <= 96) ? 3 : 0;" in src
    assert "static_assert(!kFixed || (kIsBF16 && ((kVariant & ~kFixedMax) == kSoftcap ||" in src
    assert src.count("softmax_step<kBlockN, kAlibiRaw, kFixed, kExp2FmaPer8>(s, m, l, alpha, sl2, shift, !masked)") == 1
    assert src.count("softmax_step<kBlockN, kAlibiRaw, kFixed>(") == 1  # the first visit: MUFU only


# ---------------------------------------------------------------------------------------------
# Dropout's rng state in device memory (a seed tensor; the draw under CUDA graph capture): the host
# side. The kernels' kRngState forms are compiled by `tileattn check`; their GPU tests are
# tests/gpu/test_dropout_device_rng.py.
# ---------------------------------------------------------------------------------------------
def test_seed_tensor_arguments_are_checked():
    from tileattn.dropout import check_dropout, check_seed_device

    ok = torch.tensor([1, -2], dtype=torch.int64)
    assert check_dropout(0.1, None, ok, None) == 0.1
    for bad in (ok.to(torch.int32), torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)[::2],
                torch.zeros(1, 2, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"int64 of shape \[2\]"):
            check_dropout(0.1, None, bad, None)
    with pytest.raises(ValueError, match="pass offset=None"):
        check_dropout(0.1, None, ok, 3)
    with pytest.raises(ValueError, match="not both"):
        check_dropout(0.1, torch.Generator(), ok, None)
    check_seed_device(ok, "cpu")
    with pytest.raises(ValueError, match="must be on q's device cuda:0"):
        check_seed_device(ok, torch.device("cuda:0"))


def test_device_state_is_wanted_for_a_seed_tensor_only_outside_capture():
    from tileattn.dropout import dropout_state, kernel_values, wants_device_state

    state = torch.tensor([7, 9], dtype=torch.int64)
    assert wants_device_state(None, state, "cpu")
    assert not wants_device_state(None, 5, "cpu") and not wants_device_state(None, None, "cpu")
    assert not wants_device_state("not a generator", None, "cpu")
    assert dropout_state(None, state, None, "cpu") == (0, 0, state)
    assert dropout_state(None, 5, 3, "cpu") == (5, 3, None)
    assert kernel_values(5, 3, None) == (5, 3, 0)
    assert kernel_values(0, 0, state) == (0, 0, state.data_ptr())


def test_reference_reads_a_seed_tensor():
    """The reference's mask for a seed tensor [s, o] is that of the ints s, o (uint64 two's complement)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 33, 16, generator=g, dtype=torch.float64) for _ in range(3))
    seed, offset = (1 << 63) + 5, (1 << 40) + 1
    state = torch.tensor([seed - (1 << 64), offset], dtype=torch.int64)
    want = reference.attention(q, k, v, True, dropout_p=0.4, seed=seed, offset=offset)
    got = reference.attention(q, k, v, True, dropout_p=0.4, seed=state)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_op_rng_states_keep_their_device():
    from tileattn.dropout import op_state, rng_state, rng_state_fake, used_rng_state

    cpu = rng_state(11, 4)
    assert op_state(cpu, "cpu") == (11, 4, None)
    assert used_rng_state(11, 4, None).tolist() == [11, 4]
    assert rng_state_fake(None).device.type == "cpu" and rng_state_fake(cpu).device == cpu.device
    copy = used_rng_state(0, 0, cpu)
    assert copy.tolist() == cpu.tolist() and copy.data_ptr() != cpu.data_ptr(), "an op output must not alias rng"


def test_rng_state_kernel_forms_are_registered_where_they_fit():
    """Which instantiation a call with a device rng state runs: the kRngState forms of the sm80 variant
    kernels (every head dim, dense and varlen), of the Hopper forward (the sets RNG_STATE_FLAG_SETS lists,
    d = 128 windowed at 128 x 64, d = 256 windowed at 128 x 64 with ping-pong) and of the Hopper backward (WINDOW | DROPOUT); the by-value calls keep
    their instantiations."""
    from tileattn.kernels import attention_bwd_sm80 as b80
    from tileattn.kernels import attention_bwd_sm90 as b90
    from tileattn.kernels import attention_fwd_sm80 as f80
    from tileattn.kernels import attention_fwd_sm90 as af
    from tileattn.kernels import family

    VariantArgs = f80.VariantArgs
    rng = VariantArgs(UNBOUNDED, 0, dropout_p=0.1, rng_state=True)  # causal: the window (unbounded, 0)
    assert rng.reads_rng_state and not VariantArgs(rng_state=True).reads_rng_state  # p = 0: nothing to read
    assert f"constexpr int kRngState = {af.RNG_STATE};" in family(af.FAMILY_NAME).path.read_text()
    assert f"constexpr int kRngState = {b90.RNG_STATE};" in family(b90.FAMILY_NAME).path.read_text()
    for d in f80.HEAD_DIMS:
        for varlen in (False, True):
            table = f80.VARLEN_VARIANT_DEFAULTS if varlen else f80.VARIANT_DEFAULTS
            expr = f80.variant_expression(d, table[d], True, varlen, rng_state=True)
            assert expr.endswith(", true, true>") and expr in f80.INSTANTIATIONS
        cfg = b80.VARIANT_CONFIGS[d]
        for varlen in (False, True):
            assert cfg.main_expr(True, True, varlen, True, True).endswith(", true>")
            assert {cfg.main_expr(True, dq, varlen, True, True) for dq in (False, True)} <= set(b80.INSTANTIATIONS)
            assert cfg.dq_expr(False, varlen, True, True) in b80.INSTANTIATIONS
    flags = af.variant_flags(rng)
    assert flags == af.DROPOUT | af.WINDOW | af.RNG_STATE
    assert af.dropout_kernel_flags(128, flags) == flags and af.variant_config(128, flags).block_n == 64
    assert af.dropout_kernel_flags(256, flags) == flags and af.variant_config(256, flags) == af.Sm90Config(
        64, 2, pingpong=True), "causal dropout at d = 256 with a device state: the Hopper form on ping-pong"
    assert af.variant_config(128, af.dropout_kernel_flags(128, af.variant_flags(VariantArgs(UNBOUNDED, 0, dropout_p=0.1)))) \
        == af.variant_config(128, af.DROPOUT | af.WINDOW), "the by-value kernel keeps its tile"
    for d, sets in af.RNG_STATE_FLAG_SETS.items():
        for kflags in sets:
            cfg = af.RNG_STATE_TILES.get((d, kflags), af.VARIANT_DEFAULTS[d])
            assert af.variant_expression(d, cfg, True, kflags) in af.INSTANTIATIONS
    bf = torch.bfloat16
    alibi_rng = VariantArgs(alibi_batch_stride=0, dropout_p=0.1, rng_state=True)
    assert af.supports_dropout(256, bf, VariantArgs(alibi_batch_stride=0, dropout_p=0.1))
    assert not af.supports_dropout(256, bf, alibi_rng), "d = 256 ALiBi's kRngState forms spill: sm80 runs them"
    assert af.supports_dropout(64, bf, alibi_rng) and af.supports_dropout(128, bf, rng)
    assert b90.variant_bits(rng) == b90.WINDOW | b90.DROPOUT | b90.RNG_STATE
    assert all(b90.supports_variants(d, bf, rng, det) for d in (64, 128, 256) for det in (False, True)
               if (d, det) != (256, True))
    assert not b90.supports_variants(256, bf, rng, True), "d = 256's deterministic kRngState form spills: sm80 runs it"
    assert b90.variant_expression(128, b90.VARIANT_DEFAULTS[128], True, b90.variant_bits(rng)) in b90.INSTANTIATIONS


def test_sm90_packed_variant_kernels():
    """The packed layouts' variant kernels: VARLEN or PAGED | each flag set of window, softcap and ALiBi,
    at VARIANT_DEFAULTS' tiles, both dtypes, every head dim, with the layout's parameter types then
    VARIANT_PARAMS'; dropout and causal are refused before anything reaches a GPU; the dispatcher's
    tables list every head dim and paged block size they implement."""
    from tileattn.kernels import attention_fwd_sm80, attention_fwd_sm90 as k90, dispatch

    exprs = k90.PACKED_VARIANT_INSTANTIATIONS
    assert len(exprs) == len(set(exprs)) == 2 * 3 * 2 * 7 and set(exprs) <= set(k90.INSTANTIATIONS), len(exprs)
    for layout, plain in ((k90.VARLEN, k90.varlen_expression), (k90.PAGED, k90.paged_expression)):
        for d, cfg in k90.VARIANT_DEFAULTS.items():
            for flags in k90.PACKED_VARIANT_FLAGS:
                e = k90.packed_variant_expression(d, cfg, True, layout, flags)
                base = plain(d, cfg, False, True)  # "..., 2, <layout>, <layout types>>"
                assert e == base.replace(f", 2, {layout}, ", f", 2, {layout | flags}, ")[:-1] + (
                    ", const float*, unsigned long long, unsigned long long, long long, int, int, float, float, "
                    "unsigned int, float, const unsigned long long*>"), e
                assert e in exprs
    for layout, flags in ((k90.VARLEN, 0), (k90.VARLEN, k90.DROPOUT), (k90.PAGED, k90.DROPOUT | k90.WINDOW),
                          (k90.VARLEN, k90.SOFTCAP | k90.FIXED_MAX)):
        with pytest.raises(ValueError, match="the packed layouts take window, softcap and ALiBi"):
            k90.packed_variant_expression(128, k90.VARIANT_DEFAULTS[128], True, layout, flags)
    va = attention_fwd_sm80.VariantArgs
    q = torch.empty(10, 4, 64, dtype=torch.bfloat16)
    lse = torch.empty(4, 10)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    q256 = torch.empty(10, 4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not variant flags 36 at head_dim 256"):  # ALiBi + dropout: no d = 256 form
        k90.VarlenPlan(q256, q256, q256, q256, lse, cu, cu, 10, causal=False, scale=1.0,
                       variants=va(dropout_p=0.1, alibi_batch_stride=0))
    with pytest.raises(ValueError, match="causal must be folded"):
        k90.VarlenPlan(q, q, q, q, lse, cu, cu, 10, causal=True, scale=1.0, variants=va(window_right=0, softcap=3.0))
    cache = torch.empty(4, 16, 4, 64, dtype=torch.bfloat16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="not variant flags 32"):
        k90.PagedPlan(q, cache, cache, table, max_seqlen_q=10, causal=False, scale=1.0, return_lse=True,
                      variants=va(dropout_p=0.1))
    assert dispatch.SM90_VARLEN_VARIANT_FORWARD == set(k90.HEAD_DIMS)
    assert dispatch.SM90_PAGED_VARIANT_PREFILL == dispatch.SM90_PAGED_PREFILL


def test_sm90_varlen_variant_backward_kernels():
    """The varlen backward's variant kernels: the sets without dropout and dropout with the window bit
    (with and without kRngState) at d = 64 and 128, atomic dQ, both dtypes, at the dense variant tiles;
    supports_varlen_variants and BackwardVarlenPlan refuse dropout with softcap or ALiBi, causal, the
    deterministic mode and d = 256 before anything reaches a GPU; the dispatcher's tables list every
    head dim they implement."""
    from tileattn.kernels import attention_bwd_sm90 as ab
    from tileattn.kernels import attention_fwd_sm80, dispatch

    exprs = ab.VARLEN_VARIANT_INSTANTIATIONS
    assert len(exprs) == len(set(exprs)) == 2 * 2 * (4 + 2) and set(exprs) <= set(ab.INSTANTIATIONS), exprs
    assert ab.varlen_variant_expression(128, ab.VARIANT_DEFAULTS[128], True, ab.WINDOW | ab.ALIBI) == (
        "tileattn::attention_bwd_sm90_varlen_variants<128, 64, 2, true, 0, 5>")
    va = attention_fwd_sm80.VariantArgs
    assert ab.supports_varlen_variants(64, torch.float16, va(softcap=3.0, alibi_batch_stride=0))
    assert ab.supports_varlen_variants(128, torch.bfloat16, va(dropout_p=0.1, rng_state=True))
    for d, variants, det in ((128, va(dropout_p=0.1, softcap=3.0), False), (256, va(softcap=3.0), False),
                             (128, va(softcap=3.0), True), (128, va(), False)):
        assert not ab.supports_varlen_variants(d, torch.bfloat16, variants, det), (d, variants, det)
    q = torch.empty(10, 4, 64, dtype=torch.bfloat16)
    lse = torch.empty(4, 10)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    for variants, causal in ((va(dropout_p=0.1, alibi_batch_stride=0), False), (va(window_right=0, softcap=3.0), True)):
        with pytest.raises(ValueError, match="supports_varlen_variants"):
            ab.BackwardVarlenPlan(q, q, q, q, lse, q, q, q, q, cu, 10, 10, causal=causal, scale=1.0,
                                  variants=variants)
    assert dispatch.SM90_VARLEN_VARIANT_BACKWARD == dispatch.SM90_VARLEN_DROPOUT_BACKWARD == set(ab.VARLEN_HEAD_DIMS)


def test_sm90_varlen_dropout_kernels():
    """Dropout on the Hopper forward's varlen layout: the sets VARLEN_DROPOUT_FLAG_SETS lists (with the
    window bit, with and without kRngState) at packed_variant_config's tiles, both dtypes; a call's
    flags map to the windowed set (packed_kernel_flags) or to None where nothing is registered (ALiBi
    with dropout at d = 256, any dropout on the paged layout); the dispatcher's table lists every head dim."""
    from tileattn.kernels import attention_fwd_sm80, attention_fwd_sm90 as k90, dispatch

    exprs = k90.VARLEN_DROPOUT_INSTANTIATIONS
    assert len(exprs) == len(set(exprs)) == 2 * (6 + 6 + 4) and set(exprs) <= set(k90.INSTANTIATIONS), len(exprs)
    assert not set(exprs) & set(k90.PACKED_VARIANT_INSTANTIATIONS)
    for d, sets in k90.VARLEN_DROPOUT_FLAG_SETS.items():
        for flags in sets:
            assert flags & k90.DROPOUT and flags & k90.WINDOW, flags
            cfg = k90.packed_variant_config(d, flags)
            assert cfg == k90.VARLEN_DROPOUT_TILES.get(d, k90.VARIANT_DEFAULTS[d]) and cfg.block_n % 64 == 0
            e = k90.packed_variant_expression(d, cfg, True, k90.VARLEN, flags)
            assert e in exprs and f", 2, {k90.VARLEN | flags}, const int*, const int*" in e, e
    va = attention_fwd_sm80.VariantArgs
    assert k90.packed_kernel_flags(128, k90.VARLEN, va(dropout_p=0.1)) == k90.DROPOUT | k90.WINDOW
    assert k90.packed_kernel_flags(64, k90.VARLEN, va(dropout_p=0.1, rng_state=True, alibi_batch_stride=0)) == (
        k90.DROPOUT | k90.WINDOW | k90.ALIBI | k90.RNG_STATE)
    assert k90.packed_kernel_flags(256, k90.VARLEN, va(dropout_p=0.1, alibi_batch_stride=0)) is None
    assert k90.packed_kernel_flags(128, k90.VARLEN, va(dropout_p=0.1, softcap=3.0, alibi_batch_stride=0)) is None
    assert k90.packed_kernel_flags(128, k90.PAGED, va(dropout_p=0.1)) is None
    assert k90.packed_kernel_flags(128, k90.PAGED, va(softcap=3.0)) == k90.SOFTCAP
    assert dispatch.SM90_VARLEN_DROPOUT_FORWARD == set(k90.VARLEN_DROPOUT_FLAG_SETS)
