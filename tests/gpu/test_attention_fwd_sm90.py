"""GPU tests of the Hopper attention forward (csrc/attention_fwd_sm90.cu) against tileattn.reference.

Calls the launch layer `launch_forward_sm90` directly (the dispatcher that routes
`tileattn.attention` to it on sm_90 is tested with the API). Skipped with a reason on GPUs other
than compute capability 9.0 (wgmma, setmaxnreg and the sm_90a cubin exist only there).

Comparisons are against the float64 reference computed from the same 16-bit inputs, so the error
left is the kernel's own: P rounded to the input dtype before the P V wgmma (like the sm80 kernel),
fp32 accumulation and ex2.approx. Tolerances are the sm80 forward's (tests/gpu/test_attention_fwd.py:
bf16 1e-2, fp16 2e-3 relative; lse 2e-4 (1 + |lse|) absolute).

Outputs are poisoned with NaN before every launch, so an element the kernel does not write (a TMA
store clipped wrongly, a consumer that skipped its rows) fails; out rows past Nq are guarded by
padding the out buffer and checking the padding is untouched. Markers: `gpu` (all), `sanitize` (small
cases re-run under compute-sanitizer by make gpu-check).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from tileattn import reference

from .conftest import requires_sm90

pytestmark = [pytest.mark.gpu, requires_sm90]

BF16, FP16 = torch.bfloat16, torch.float16
TOL = {BF16: 1e-2, FP16: 2e-3}
HEAD_DIMS = (64, 128, 256)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


def make_qkv(b, h, hkv, nq, nk, d, dtype, seed, *, scale_inputs=1.0):
    g = _gen(seed)
    q = (torch.randn(b, h, nq, d, device="cuda", generator=g) * scale_inputs).to(dtype)
    k = (torch.randn(b, hkv, nk, d, device="cuda", generator=g) * scale_inputs).to(dtype)
    v = torch.randn(b, hkv, nk, d, device="cuda", generator=g).to(dtype)
    return q, k, v


def rel_err(out, ref) -> float:
    ref = ref.double()
    den = ref.norm().item()
    num = (out.double() - ref).norm().item()
    return num / den if den > 0 else num


def check(out, lse, q, k, v, causal, scale, *, tol=None, what=""):
    """Compare out [B, H, Nq, d] and lse [B, H, Nq] with the float64 reference."""
    ref, ref_lse = reference.attention(q, k, v, causal=causal, scale=scale, compute_dtype=torch.float64)
    assert out.shape == ref.shape and out.dtype == q.dtype, f"{what}: out {tuple(out.shape)} {out.dtype}"
    nan_out = torch.isnan(out)
    assert not nan_out.any(), (f"{what}: {int(nan_out.sum())} NaN in out (unwritten or NaN-producing), first at "
                               f"{tuple(nan_out.nonzero()[0].tolist())}")
    nan_lse = torch.isnan(lse)
    assert not nan_lse.any(), f"{what}: {int(nan_lse.sum())} NaN in lse, first at {tuple(nan_lse.nonzero()[0].tolist())}"
    err = rel_err(out, ref)
    tol = TOL[q.dtype] if tol is None else tol
    if err > tol:  # say where: the (b, h, row) with the largest error
        row_err = (out.double() - ref).norm(dim=-1)
        worst = tuple(torch.nonzero(row_err == row_err.max())[0].tolist())
        raise AssertionError(f"{what}: relative error {err:.3e} > {tol:g}; worst row (b, h, i) = {worst} "
                             f"with |out - ref| = {row_err.max().item():.3e}")
    seen = torch.isfinite(ref_lse)
    diff_pattern = torch.isfinite(lse) != seen
    assert not diff_pattern.any(), (f"{what}: lse -inf pattern differs from the reference at "
                                    f"{int(diff_pattern.sum())} rows, first {tuple(diff_pattern.nonzero()[0].tolist())}")
    if seen.any():
        diff = (lse.double() - ref_lse)[seen].abs()
        bound = 2e-4 * (1.0 + ref_lse[seen].abs())
        assert bool((diff <= bound).all()), f"{what}: lse error {diff.max().item():.3e} (bound {bound.max().item():.3e})"
    if (~seen).any():  # rows that see no key: exactly 0, and lse -inf
        assert bool((out[~seen] == 0).all()), f"{what}: fully masked rows must be exactly 0"
        assert bool((lse[~seen] == float("-inf")).all()), f"{what}: fully masked rows must have lse -inf"
    return err


def launch(q, k, v, causal, scale, config=None, out=None, pack_gqa=None):
    """launch_forward_sm90 with NaN-poisoned outputs."""
    from tileattn.kernels.attention_fwd_sm90 import launch_forward_sm90

    if out is None:
        out = torch.full_like(q, float("nan"))
    else:
        out.fill_(float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda", dtype=torch.float32)
    launch_forward_sm90(q, k, v, out, lse, causal=causal, scale=scale, config=config, pack_gqa=pack_gqa)
    return out, lse


# ---------------------------------------------------------------------------------------------
# The main grid: every head dim x causal x dtype x shapes (N in {1, 17, 127, 128, 129, 1000,
# 4097}, Nq != Nk both ways, GQA ratios 1, 4, 8)
# ---------------------------------------------------------------------------------------------
SHAPES = [  # (B, H, Hkv, Nq, Nk)
    (2, 4, 4, 1, 1),
    (1, 8, 1, 17, 17),        # GQA 8
    (2, 4, 1, 127, 129),      # GQA 4
    (1, 4, 4, 128, 128),
    (1, 8, 2, 129, 127),      # GQA 4
    (1, 2, 2, 1000, 17),      # Nq > Nk: causal rows 0..982 see nothing
    (1, 2, 1, 17, 1000),      # Nq < Nk
    (1, 1, 1, 4097, 4097),
    (1, 1, 1, 1, 4097),       # decode-like
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hkv{}_Nq{}_Nk{}".format(*s))
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_forward_matches_reference(d, causal, dtype, shape):
    b, h, hkv, nq, nk = shape
    seed = zlib.crc32(repr(("sm90", d, causal, str(dtype), shape)).encode())
    q, k, v = make_qkv(b, h, hkv, nq, nk, d, dtype, seed)
    scale = 1.0 / math.sqrt(d)
    out, lse = launch(q, k, v, causal, scale)
    check(out, lse, q, k, v, causal, scale, what=f"d={d} {shape}")
    out2, lse2 = launch(q, k, v, causal, scale)
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "same inputs, same kernel: must be bitwise equal"


GQA_SHAPES = [  # (B, H, Hkv, Nq, Nk): groups of 2, 4, 8, 16, 64 (packed: 64, 32, 16, 8, 2 positions per tile)
    (2, 4, 2, 1, 300),
    (1, 8, 2, 70, 45),
    (1, 16, 2, 33, 200),
    (2, 32, 2, 129, 129),
    (1, 64, 1, 5, 77),
]


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("shape", GQA_SHAPES, ids=lambda s: "B{}H{}Hkv{}_Nq{}_Nk{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gqa_packing_forced_both_ways(d, causal, shape, pack_gqa):
    """The same GQA inputs with the query heads of a group packed into one tile and not: both
    match the reference (packed tiles put (head, position) rows in one TMA box, mask by position
    and write lse per head)."""
    b, h, hkv, nq, nk = shape
    q, k, v = make_qkv(b, h, hkv, nq, nk, d, BF16, seed=zlib.crc32(repr(("gqa", d, causal, shape)).encode()))
    out, lse = launch(q, k, v, causal, 1 / math.sqrt(d), pack_gqa=pack_gqa)
    check(out, lse, q, k, v, causal, 1 / math.sqrt(d), what=f"pack_gqa={pack_gqa}")


@pytest.mark.sanitize
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_small_for_sanitizer(d, causal):
    """Small irregular shapes at the default tiles: partial Q tile, partial K/V edge block, GQA,
    fully masked rows (70 x 45); consumers releasing blocks unread (unseen_visits): 200 x 200 causal
    at d = 256 (64-key blocks: the first consumer's rows end a block before the tile's), 130 x 300
    (the second tile's second consumer has no rows; causal, the first consumer of a tile sees one
    128-key block fewer than the tile)."""
    for nq, nk in ((70, 45), (200, 200), (130, 300)):
        q, k, v = make_qkv(1, 4, 2, nq, nk, d, BF16, seed=d + causal + nq + nk)
        for pack_gqa in (False, True):
            out, lse = launch(q, k, v, causal, 0.1, pack_gqa=pack_gqa)
            check(out, lse, q, k, v, causal, 0.1, what=f"small {nq}x{nk} pack_gqa={pack_gqa}")


@pytest.mark.sanitize
def test_long_keys_tile_small_for_sanitizer():
    """LONG_DEFAULTS' tiles (dispatched from LONG_KEYS keys on) on a small shape: full blocks and an
    edge block, a partial Q tile, GQA, on the grid the dispatcher uses."""
    from dataclasses import replace

    from tileattn.kernels import attention_fwd_sm90 as af

    for (d, causal), cfg in af.LONG_DEFAULTS.items():
        q, k, v = make_qkv(1, 4, 2, 70, 258, d, BF16, seed=d + 258)
        out, lse = launch(q, k, v, causal, 0.1, config=replace(cfg, persistent=d in af.PERSISTENT_HEAD_DIMS))
        check(out, lse, q, k, v, causal, 0.1, what=f"{cfg} small")


def _three_consumer_configs():
    from tileattn.kernels import attention_fwd_sm90 as af

    return [(d, causal, cfg) for d in af.HEAD_DIMS for causal in (False, True)
            for cfg in af.tuning_candidates(d, causal, BF16) if cfg.consumers == 3]


@pytest.mark.parametrize("shape", SHAPES + [(1, 6, 2, 200, 333), (2, 6, 2, 1, 77), (1, 3, 1, 500, 129)],
                         ids=lambda s: "B{}H{}Hkv{}_Nq{}_Nk{}".format(*s))
@pytest.mark.parametrize("d,causal,cfg", _three_consumer_configs(), ids=lambda x: str(x))
def test_three_consumers_match_reference(d, causal, cfg, shape):
    """192-row tiles (three consumer warpgroups, d = 64 and 128) on the main grid's shapes, where the
    last tile's second and third consumers have partial rows or none, and GQA groups of 3 packed (64
    positions of each head per tile: one head per consumer) as well as unpacked."""
    b, h, hkv, nq, nk = shape
    q, k, v = make_qkv(b, h, hkv, nq, nk, d, BF16, seed=zlib.crc32(repr(("3wg", d, causal, str(cfg), shape)).encode()))
    for pack_gqa in (False, True) if h // hkv == 3 else (None,):
        out, lse = launch(q, k, v, causal, 0.125, config=cfg, pack_gqa=pack_gqa)
        check(out, lse, q, k, v, causal, 0.125, what=f"{cfg} {shape} pack_gqa={pack_gqa}")


@pytest.mark.sanitize
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_three_consumers_small_for_sanitizer(d, causal):
    """WIDE_DEFAULTS' three-consumer tile on a small shape: two query tiles per head (the second with
    6 of 192 rows), a partial K/V edge block, GQA 3 packed and not, several tiles per persistent CTA."""
    from dataclasses import replace

    from tileattn.kernels import attention_fwd_sm90 as af

    cfg = replace(af.WIDE_DEFAULTS[(d, causal)], persistent=True)
    q, k, v = make_qkv(1, 6, 2, 198, 300, d, BF16, seed=198 + causal + d)
    for pack_gqa in (False, True):
        out, lse = launch(q, k, v, causal, 0.1, config=cfg, pack_gqa=pack_gqa)
        check(out, lse, q, k, v, causal, 0.1, what=f"{cfg} small pack_gqa={pack_gqa}")


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_one_hot_rows_diagnose_layouts(d):
    """Query i = 40 x key i (orthogonal-ish random keys): each row's softmax is ~one-hot on key i,
    so out[i] ~= V[i]. On failure the message says, for the first wrong rows, which V row and which
    columns the kernel produced instead: a transposed or mis-swizzled operand (S, P or V) or a
    misplaced stmatrix/TMA store shows up as a recognizable permutation."""
    n = 256
    g = _gen(100 + d)
    k = torch.nn.functional.normalize(torch.randn(1, 1, n, d, device="cuda", generator=g), dim=-1)
    q = (k * 40.0).to(BF16)
    k = k.to(BF16)
    v = torch.randn(1, 1, n, d, device="cuda", generator=g).to(BF16)
    out, lse = launch(q, k, v, False, 1.0)
    ref, _ = reference.attention(q, k, v, causal=False, scale=1.0, compute_dtype=torch.float64)
    row_err = (out.double() - ref).norm(dim=-1)[0, 0] / ref.norm(dim=-1)[0, 0]
    bad = torch.nonzero(row_err > 2e-2).flatten().tolist()
    if bad:
        vd = v[0, 0].double()
        notes = []
        for i in bad[:4]:
            o = out[0, 0, i].double()
            j = int((vd - o).norm(dim=-1).argmin())
            cols = [int((vd[j] - o[c]).abs().argmin()) for c in range(min(d, 16))]
            notes.append(f"row {i}: closest V row {j} (err {row_err[i].item():.2e}); out[{i}, c] ~ V[{j}, {cols}] "
                         f"for c = 0..{min(d, 16) - 1}")
        raise AssertionError(f"d={d}: {len(bad)} of {n} rows wrong; " + "; ".join(notes))
    check(out, lse, q, k, v, False, 1.0, what="one-hot")


@pytest.mark.sanitize
def test_single_query_single_key():
    for causal in (False, True):
        q, k, v = make_qkv(1, 1, 1, 1, 1, 128, FP16, seed=7)
        out, lse = launch(q, k, v, causal, 0.3)
        torch.testing.assert_close(out.float(), v.float().expand_as(out), rtol=0, atol=0)  # softmax of one key = 1
        ref_lse = 0.3 * (q.double() * k.double()).sum(-1)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_no_keys_gives_zeros_and_minus_inf():
    q, k, v = make_qkv(1, 2, 2, 5, 0, 64, BF16, seed=4)
    for causal in (False, True):
        out, lse = launch(q, k, v, causal, 0.125)
        assert bool((out == 0).all()) and bool((lse == float("-inf")).all()), f"causal={causal}"


# ---------------------------------------------------------------------------------------------
# Layouts: [B, N, H, d] through transpose, padded rows, odd strides of size-1 dims, expanded K/V
# (zero strides: copied before TMA), a transposed output, and out rows past Nq never written
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bnhd_layout_through_transpose(dtype, causal):
    b, h, hkv, nq, nk, d = 2, 8, 2, 300, 257, 128
    g = _gen(11)
    q = torch.randn(b, nq, h, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(b, nk, hkv, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(b, nk, hkv, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
    assert not q.is_contiguous()
    out_t = torch.empty(b, nq, h, d, device="cuda", dtype=dtype).transpose(1, 2)
    out, lse = launch(q, k, v, causal, 1 / math.sqrt(d), out=out_t)
    assert out.data_ptr() == out_t.data_ptr()
    check(out, lse, q, k, v, causal, 1 / math.sqrt(d), what="transposed")


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_sliced_padded_buffers(d):
    """q, k, v are slices of wider buffers: row pitch d + 24 elements (16-byte aligned)."""
    g = _gen(d)
    qb = torch.randn(2, 4, 150, d + 24, device="cuda", generator=g).to(BF16)
    kvb = torch.randn(2, 2, 2, 333, d + 24, device="cuda", generator=g).to(BF16)
    q, k, v = qb[..., 8:8 + d], kvb[0][..., :d], kvb[1][..., 16:16 + d]
    for causal in (False, True):
        out, lse = launch(q, k, v, causal, 1 / math.sqrt(d))
        check(out, lse, q, k, v, causal, 1 / math.sqrt(d), what=f"padded causal={causal}")


def test_size_one_dims_with_odd_strides():
    """torch may give size-1 dimensions any stride; TMA needs 16-byte strides everywhere."""
    d = 64
    buf = torch.randn(4 * 8 * d, device="cuda").to(FP16)
    q = buf.as_strided((1, 4, 1, d), (3, d, 5, 1))
    k = buf.as_strided((1, 1, 8, d), (7, 1, d, 1))
    v = buf.as_strided((1, 1, 8, d), (11, 3, d, 1), storage_offset=8 * d)
    for causal in (False, True):
        out, lse = launch(q, k, v, causal, 0.2)
        check(out, lse, q, k, v, causal, 0.2, what=f"size-1 strides causal={causal}")


def test_expanded_kv_zero_strides():
    q, k, v = make_qkv(3, 4, 1, 65, 70, 128, BF16, seed=12)
    k, v = k[:1].expand(3, -1, -1, -1), v[:1].expand(3, -1, -1, -1)  # stride(0) == 0
    out, lse = launch(q, k, v, True, 0.09)
    check(out, lse, q, k, v, True, 0.09, what="expanded k/v")


@pytest.mark.parametrize("hkv", [8, 2], ids=["mha", "gqa4_packed"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_store_never_writes_past_nq(d, hkv):
    """out is a view of the first Nq rows of a taller buffer: the rows after it (the TMA store's
    box reaches up to 127 rows further; packed, up to 31 rows past each head's end) must keep their
    sentinel values."""
    b, h, nq, nk = 2, 8, 70, 90
    q, k, v = make_qkv(b, h, hkv, nq, nk, d, BF16, seed=d + 1)
    big = torch.full((b, h, nq + 128, d), 7.0, device="cuda", dtype=BF16)
    out, lse = launch(q, k, v, False, 0.1, out=big[:, :, :nq])
    check(out, lse, q, k, v, False, 0.1, what="store bound")
    assert bool((big[:, :, nq:] == 7.0).all()), "the TMA store wrote rows past Nq"


# ---------------------------------------------------------------------------------------------
# Numerics: extreme logits, fully masked rows, scale
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_extreme_logits(d, causal, dtype):
    """Scores around 1e4 (q, k scaled by 100): no overflow, no NaN, still the right softmax
    (nearly one-hot, so fp32 rounding of ~1e4 scores moves weight between near-ties: 2e-2)."""
    q, k, v = make_qkv(1, 4, 2, 200, 300, d, dtype, seed=d + 17 * causal, scale_inputs=100.0)
    scale = 1.0 / math.sqrt(d)
    scores = scale * (q.double()[:, :2] @ k.double()[:, :1].transpose(-1, -2))
    assert scores.abs().max().item() > 3e3  # the case really is extreme
    out, lse = launch(q, k, v, causal, scale)
    check(out, lse, q, k, v, causal, scale, tol=2e-2, what="extreme")


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_fully_masked_rows(d, dtype):
    """Causal with Nq > Nk: rows i < Nq - Nk see nothing: out exactly 0, lse -inf, never NaN.
    Spans whole fully masked query tiles (no K/V block visited) and tiles that mix both."""
    nq, nk = 700, 150
    q, k, v = make_qkv(2, 2, 1, nq, nk, d, dtype, seed=d)
    out, lse = launch(q, k, v, True, 0.2)
    masked = nq - nk
    assert bool((out[:, :, :masked] == 0).all()), "fully masked rows must be 0"
    assert bool((lse[:, :, :masked] == float("-inf")).all()), "fully masked rows must have lse -inf"
    assert bool(torch.isfinite(lse[:, :, masked:]).all()), "rows that see keys must have a finite lse"
    check(out, lse, q, k, v, True, 0.2, what="masked rows")


def test_custom_scale_and_lse_units():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, FP16, seed=3)
    out, lse = launch(q, k, v, False, 0.37)
    check(out, lse, q, k, v, False, 0.37, what="scale")
    s = 0.37 * (q.double() @ k.double().transpose(-1, -2))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, dim=-1), rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Every registered configuration; scheduler-shaped workloads
# ---------------------------------------------------------------------------------------------
def _all_configs():
    from tileattn.kernels import attention_fwd_sm90 as af

    return [(d, causal, dtype, cfg) for d in af.HEAD_DIMS for causal in (False, True) for dtype in (BF16, FP16)
            for cfg in af.tuning_candidates(d, causal, dtype)]


@pytest.mark.parametrize("d,causal,dtype,cfg", _all_configs(), ids=lambda x: str(x))
def test_every_registered_config(d, causal, dtype, cfg):
    for (nq, nk) in ((1, 1), (200, 333), (333, 200), (640, 641)):
        q, k, v = make_qkv(1, 4, 2, nq, nk, d, dtype, seed=nq + d)
        out, lse = launch(q, k, v, causal, 1 / math.sqrt(d), config=cfg)
        check(out, lse, q, k, v, causal, 1 / math.sqrt(d), what=f"{cfg} Nq={nq} Nk={nk}")


def _long_pairs():
    from tileattn.kernels import attention_fwd_sm90 as af

    return sorted(af.LONG_DEFAULTS)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("past", [-1, 1], ids=["below", "above"])
@pytest.mark.parametrize("d,causal", _long_pairs(), ids=lambda x: str(x))
def test_long_keys_take_their_own_config(d, causal, past, dtype):
    """From LONG_KEYS[(d, causal)] keys on, the pairs in LONG_DEFAULTS run its tile (one key past the
    switch ends in a short edge block; causal with 300 queries: only the last blocks, bottom-right);
    one key below it runs the short default. Through ForwardPlan, which the dispatcher builds, with
    NaN-poisoned outputs."""
    from dataclasses import replace

    from tileattn.kernels import attention_fwd_sm90 as af

    nk = af.LONG_KEYS[(d, causal)] + past
    q, k, v = make_qkv(1, 4, 2, 300, nk, d, dtype, seed=nk + d + causal)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda", dtype=torch.float32)
    plan = af.ForwardPlan(q, k, v, out, lse, causal=causal, scale=1 / math.sqrt(d))
    table = af.LONG_DEFAULTS if past > 0 else af.DEFAULTS
    assert plan.config == replace(table[(d, causal)], persistent=d in af.PERSISTENT_HEAD_DIMS), plan.config
    plan.launch(q, k, v, out, lse)
    check(out, lse, q, k, v, causal, 1 / math.sqrt(d), what=f"{plan.config} Nk={nk}")


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_wide_tiles_from_wide_min_queries(d, causal, dtype):
    """From WIDE_MIN_QUERIES[d] queries on the plan runs WIDE_DEFAULTS' three-consumer tile (d = 64 at
    2048 queries: the last of 11 tiles holds 128 of 192 rows; d = 128 at 8192: 32 of 192), one query
    fewer the two-consumer default; GQA 4, so the forced-packing plan keeps 128-row tiles. Through
    ForwardPlan, NaN-poisoned outputs."""
    from dataclasses import replace

    from tileattn.kernels import attention_fwd_sm90 as af

    n = af.WIDE_MIN_QUERIES[d]
    for nq, pack_gqa in ((n - 1, None), (n, None), (n, True)):
        q, k, v = make_qkv(1, 8, 2, nq, 1500, d, dtype, seed=nq + causal + d)
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device="cuda", dtype=torch.float32)
        plan = af.ForwardPlan(q, k, v, out, lse, causal=causal, scale=0.125, pack_gqa=pack_gqa)
        wide = nq >= n and not pack_gqa
        table = af.WIDE_DEFAULTS if wide else af.DEFAULTS
        assert plan.config == replace(table[(d, causal)], persistent=True), plan.config
        plan.launch(q, k, v, out, lse)
        check(out, lse, q, k, v, causal, 0.125, what=f"{plan.config} Nq={nq} pack_gqa={pack_gqa}")


def _persistent_configs():
    return [(d, cfg) for d, causal, dtype, cfg in _all_configs() if cfg.persistent and not causal and dtype == BF16]


@pytest.mark.parametrize("d,cfg", _persistent_configs(), ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_persistent_grid_walks_several_tiles(d, cfg, causal):
    """More query tiles than SMs, so each persistent CTA runs several tiles back to back (ring
    phases and the Q buffer carried across tiles); causal with Nq > Nk mixes in tiles that visit
    no K/V block at all."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (b, h, hkv, nq, nk) in ((2, 32, 8, 700, 700), (3, 16, 16, 900, 300)):
        assert -(-nq // 128) * h * b > sms
        q, k, v = make_qkv(b, h, hkv, nq, nk, d, BF16, seed=nq + nk + d)
        out, lse = launch(q, k, v, causal, 1 / math.sqrt(d), config=cfg)
        check(out, lse, q, k, v, causal, 1 / math.sqrt(d), what=f"{cfg} B{b} H{h} Nq={nq} Nk={nk}")


def test_tile_counter_on_two_streams_is_left_zero():
    """Persistent grids take tiles from their stream's counter pair (runtime.stream_counters): two
    streams running persistent launches at once each get the right result, over several launches
    in a row (each must find the pair zeroed by the one before), and both pairs read 0 after."""
    from tileattn.kernels import attention_fwd_sm90 as af
    from tileattn.runtime import launcher

    cfg = af.Sm90Config(af.DEFAULTS[(128, True)].block_n, af.DEFAULTS[(128, True)].stages, False, True)
    cases = [make_qkv(2, 32, 8, 700, 900, 128, BF16, seed=s) for s in (61, 62)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    results = [[], []]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(3):
        for j, (stream, (q, k, v)) in enumerate(zip(streams, cases)):
            with torch.cuda.stream(stream):
                results[j].append(launch(q, k, v, True, 1 / math.sqrt(128), config=cfg))
    torch.cuda.synchronize()
    for (q, k, v), runs in zip(cases, results):
        for n, (out, lse) in enumerate(runs):
            check(out, lse, q, k, v, True, 1 / math.sqrt(128), what=f"persistent launch {n} on its own stream")
    pairs = [pair for (dev, _), pair in launcher._stream_counters.items() if dev == 0]
    assert len(pairs) >= 2 and all(pair.tolist() == [0, 0] for pair in pairs), [p.tolist() for p in pairs]


def test_causal_tile_order_in_l2_groups():
    """Causal tiles run longest first inside groups of heads whose K/V fit half the L2: 16 heads of
    4096 keys (2 MB of K/V each) make groups of 15 and 1 on an H200, so a partial last group runs."""
    from tileattn.kernels import attention_fwd_sm90 as af

    b, h, n, d = 1, 16, 4096, 128
    geo = af._geometry(b, h, h, n, n, d, af.DEFAULTS[(d, True)], None, af._l2_bytes(0))
    assert 1 < geo.l2_group < h, f"expected a partial L2 group, got l2_group={geo.l2_group}"
    for cfg in (af.DEFAULTS[(d, True)], af.Sm90Config(128, 2, False, True)):
        q, k, v = make_qkv(b, h, h, n, n, d, BF16, seed=77)
        out, lse = launch(q, k, v, True, 1 / math.sqrt(d), config=cfg)
        check(out, lse, q, k, v, True, 1 / math.sqrt(d), what=f"L2 groups {cfg}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_many_heads_tiny_sequences(causal):
    q, k, v = make_qkv(4, 64, 8, 3, 5, 128, BF16, seed=31)
    out, lse = launch(q, k, v, causal, 0.1)
    check(out, lse, q, k, v, causal, 0.1, what="many heads")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_one_head_long_sequence(causal):
    q, k, v = make_qkv(1, 1, 1, 8192, 8192, 128, BF16, seed=32)
    out, lse = launch(q, k, v, causal, 1 / math.sqrt(128))
    check(out, lse, q, k, v, causal, 1 / math.sqrt(128), what="long")


# ---------------------------------------------------------------------------------------------
# CUDA graphs: the tensor maps are baked into the captured launch; replays see new data in place
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_graph_capture_and_replay(causal):
    from tileattn.kernels.attention_fwd_sm90 import launch_forward_sm90

    shape = (2, 8, 2, 300, 500, 128)
    q, k, v = make_qkv(*shape, BF16, seed=21)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile and load outside the capture
        launch_forward_sm90(q, k, v, out, lse, causal=causal, scale=1 / math.sqrt(128))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_forward_sm90(q, k, v, out, lse, causal=causal, scale=1 / math.sqrt(128))
    for seed in (22, 23):
        nq, nk, nv = make_qkv(*shape, BF16, seed=seed)
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, lse, nq, nk, nv, causal, 1 / math.sqrt(128), what=f"graph replay {seed}")


# ---------------------------------------------------------------------------------------------
# Bad arguments: clear ValueErrors before any launch
# ---------------------------------------------------------------------------------------------
def test_rejects_unsupported_arguments():
    from tileattn.kernels.attention_fwd_sm90 import launch_forward_sm90, supports

    q, _, _ = make_qkv(1, 2, 2, 8, 8, 64, BF16, seed=1)
    lse = torch.empty(1, 2, 8, device="cuda")
    with pytest.raises(ValueError, match="head_dim 96"):
        q96 = torch.randn(1, 2, 8, 96, device="cuda").to(BF16)
        launch_forward_sm90(q96, q96, q96, torch.empty_like(q96), lse, causal=False, scale=0.1)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        k3 = torch.randn(1, 3, 8, 64, device="cuda").to(BF16)
        launch_forward_sm90(q, k3, k3, torch.empty_like(q), lse, causal=False, scale=0.1)
    assert supports(128, BF16, device="cuda") and not supports(96, BF16) and not supports(64, torch.float32)
