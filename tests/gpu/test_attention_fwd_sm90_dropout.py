"""GPU tests of dropout in the Hopper forward (attention_fwd_sm90.ForwardPlan with
VariantArgs(dropout_p > 0), kVariant bit kDropout; issue #15). Skipped unless the GPU has compute
capability 9.0. The plan is launched directly (not through the dispatcher, which does not route
dropout here until these pass).

Oracles, all on the same quantized inputs:
- the mask, exactly: with V rows one-hot (V = identity on d keys at a time, one launch per d keys)
  out[i, c] = P_ij keep_ij / (1 - p) / l_i for key j = k0 + c, so the nonzero pattern of out is the
  kernel's keep mask (inputs scaled by 0.25: no probability underflows). It must equal
  tileattn.dropout.dropout_mask(seed, offset, B, H, Nq, Nk, p) on every visible key, and the mask the
  sm_80 variant forward applies (read back the same way);
- out against tileattn.reference.attention in float64 with the same dropout_p / seed / offset (the
  reference builds its mask with dropout_mask): ||out - ref|| / ||ref|| within the plain kernels'
  tolerances (bf16 1e-2, fp16 2e-3), and every row within ROW_TOL of its reference row. A row's
  rounding error is ~1e-3 (bf16: P and O rounded to 8 mantissa bits) or ~3e-4 (fp16) of its norm;
  one wrong keep bit in a row with K kept keys of similar weight moves it by ~1 / sqrt(K) (0.1 at
  K = 100, 0.03 at K = 1000), which the extreme-p cases (p = 0.5 / 0.9, inputs x 0.25: near-uniform
  P) keep far above ROW_TOL;
- lse against the reference's, which is the undropped softmax's (dropout must not change it);
- gradients: the sm_80 variant backward (what the dispatcher pairs with this forward) run on this
  forward's out / lse must match float64 autograd through the reference (tolerances of the plain
  backward tests: bf16 1e-2, fp16 3e-3, RMS floor 1e-3).
Every output and gradient is NaN-filled before its launch and the plans' own allocations are
poisoned (poisoned_allocations). Markers: gpu (all), sanitize (the small cases).

    python -m pytest -q -m gpu tests/gpu/test_attention_fwd_sm90_dropout.py
    python -m pytest -q -m "gpu and sanitize" tests/gpu/test_attention_fwd_sm90_dropout.py   # under compute-sanitizer
"""

from __future__ import annotations

import math

import pytest
import torch

from tileattn import dropout as dr
from tileattn import reference
from tileattn.dropout import dropout_mask
from tileattn.kernels import attention_fwd_sm90 as af
from tileattn.kernels.attention_fwd_sm80 import VariantArgs

from .conftest import poisoned_allocations, requires_sm90
from .test_attention_variants import _opts, assert_lse_matches, make, rel_err

pytestmark = pytest.mark.gpu

BF16, FP16, F64 = torch.bfloat16, torch.float16, torch.float64
TOL_FWD = {BF16: 1e-2, FP16: 2e-3}
TOL_BWD = {BF16: 1e-2, FP16: 3e-3}
ROW_TOL = {BF16: 1.2e-2, FP16: 4e-3}
ATOL = 1e-3


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def variant_args(q, causal, opts, p) -> VariantArgs:
    """attention_fwd_sm80.VariantArgs of the options (causal folded into the window, as tileattn.api)."""
    left, right = dr.check_window(opts.get("window"), causal)
    sl = opts.get("alibi_slopes")
    sb = None if sl is None else dr.check_alibi(sl, q.shape[0], q.shape[1], q.device, dtype_strict=True)
    return VariantArgs(left, right, dr.check_softcap(opts.get("softcap")), sb, float(p))


def run_sm90(q, k, v, causal, opts, p, seed, offset, *, pack_gqa=None):
    """(out [B, H, Nq, d], lse [B, H, Nq]) of the Hopper forward with dropout, outputs NaN-filled."""
    va = variant_args(q, causal, opts, p)
    assert af.supports_dropout(q.shape[-1], q.dtype, va), f"no sm90 dropout instantiation for d={q.shape[-1]} {va}"
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=q.device, dtype=torch.float32)
    sl = opts.get("alibi_slopes")
    with poisoned_allocations():
        plan = af.ForwardPlan(q, k, v, out, lse, causal=False, scale=q.shape[-1] ** -0.5, pack_gqa=pack_gqa,
                              variants=va)
        expr = plan.plan.kernel.expression
        kernel_flags = af.dropout_kernel_flags(q.shape[-1], af.variant_flags(va))
        assert plan.variant_values and f", {kernel_flags}, const float*" in expr, f"not a dropout kernel: {expr}"
        plan.launch(q, k, v, out, lse, 0 if sl is None else sl.data_ptr(), seed, offset, 0)
    torch.cuda.synchronize()
    return out, lse


def run_sm80(q, k, v, causal, opts, p, seed, offset):
    """out of the sm_80 variant forward with the same dropout (what the mask must agree with)."""
    from tileattn.kernels import attention_fwd_sm80

    va = variant_args(q, causal, opts, p)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=q.device, dtype=torch.float32)
    sl = opts.get("alibi_slopes")
    plan = attention_fwd_sm80.forward_plan(q, k, v, out, lse, causal=False, scale=q.shape[-1] ** -0.5, variants=va)
    plan.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                0 if sl is None else sl.data_ptr(), seed, offset, 0)
    torch.cuda.synchronize()
    return out


def check_forward(got, ref, dtype, what):
    """out (global and per row) and lse against the float64 reference; rows that see no key: out
    exactly 0 and lse -inf."""
    out, lse = got
    rout, rlse = ref
    bad = ~torch.isfinite(out)
    assert not bad.any(), f"{what}: {int(bad.sum())} NaN/inf in out (unwritten?), first at {bad.nonzero()[0].tolist()}"
    err = rel_err(out, rout)
    assert err <= TOL_FWD[dtype], f"{what}: out relative error {err:.3e} > {TOL_FWD[dtype]:g}"
    d = out.shape[-1]
    rows = (out.double() - rout).norm(dim=-1) / rout.norm(dim=-1).clamp_min(ATOL * math.sqrt(d))  # [B, H, Nq]
    worst = rows.max().item()
    assert worst <= ROW_TOL[dtype], (
        f"{what}: row {tuple((rows == rows.max()).nonzero()[0].tolist())} off by {worst:.3e} of its norm "
        f"> {ROW_TOL[dtype]:g} (a wrong keep bit?); {int((rows > ROW_TOL[dtype]).sum())} rows over")
    seen = assert_lse_matches(lse, rlse, what, " against the undropped reference lse")
    if (~seen).any():
        assert (out[~seen] == 0).all(), f"{what}: rows that see no key are not exactly 0"


def reference_fwd(q, k, v, causal, opts, p, seed, offset):
    q64, k64, v64 = (t.double() for t in (q, k, v))
    return reference.attention(q64, k64, v64, causal, compute_dtype=F64, dropout_p=p, seed=seed, offset=offset,
                               **opts)


def check_case(q, k, v, causal, opts, p, seed, offset, dtype, what, *, pack_gqa=None):
    got = run_sm90(q, k, v, causal, opts, p, seed, offset, pack_gqa=pack_gqa)
    ref = reference_fwd(q, k, v, causal, opts, p, seed, offset)
    check_forward(got, ref, dtype, what)
    return got, ref


def visible(nq, nk, causal, window):
    """bool [Nq, Nk]: keys query i sees (window edges from dr.check_window, causal folded in)."""
    left, right = dr.check_window(window, causal)
    i = torch.arange(nq, device="cuda")[:, None] + (nk - nq)
    j = torch.arange(nk, device="cuda")[None, :]
    return (j >= i - left) & (j <= i + right)


def kept_pattern(run, q, k, d):
    """bool [B, H, Nq, Nk]: the keep mask a forward applied, read back with one-hot V rows, d keys
    per launch (run(v) -> out)."""
    b, h, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    kept = torch.zeros(b, h, nq, nk, dtype=torch.bool, device="cuda")
    for k0 in range(0, nk, d):
        keys = torch.arange(k0, min(k0 + d, nk), device="cuda")
        v = torch.zeros(b, hkv, nk, d, device="cuda", dtype=q.dtype)
        v[:, :, keys, keys - k0] = 1
        out = run(v)
        assert torch.isfinite(out).all(), "NaN/inf in out of a one-hot launch"
        kept[..., keys] = out[..., : len(keys)] != 0
    return kept


# ---------------------------------------------------------------------------------------------
# the mask, read back exactly
# ---------------------------------------------------------------------------------------------
@requires_sm90
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(
    "b, h, hkv, nq, nk, causal, pack_gqa, p, seed, offset",
    [
        (2, 3, 3, 77, 200, False, None, 0.5, 0, 0),
        (1, 4, 1, 33, 130, True, True, 0.9, 123456789, 16),           # GQA 4 packed: rows 32 per head
        (1, 16, 1, 5, 64, False, True, 0.5, (1 << 63) + 12345, (1 << 35) + 20),  # 8 rows per head: g, g + 8 differ
        (2, 4, 2, 129, 100, True, False, 0.3, 99, 4),
    ],
    ids=["mha", "gqa4_packed_causal", "gqa16_packed_high_seed", "gqa2_unpacked_causal"])
def test_mask_is_dropout_mask_and_sm80s(d, dtype, b, h, hkv, nq, nk, causal, pack_gqa, p, seed, offset):
    q, k, _, _ = make(b, h, hkv, nq, nk, d, dtype, seed=d + nq, scale_inputs=0.25)
    what = f"d={d} {dtype} B={b} H={h}/{hkv} Nq={nq} Nk={nk} causal={causal} p={p} seed={seed} offset={offset}"
    kept = kept_pattern(lambda v: run_sm90(q, k, v, causal, {}, p, seed, offset, pack_gqa=pack_gqa)[0], q, k, d)
    want = dropout_mask(seed, offset, b, h, nq, nk, p, device="cuda") & visible(nq, nk, causal, None)
    bad = kept != want
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {want.numel()} keep bits differ from dropout_mask, first at "
                           f"(b, h, i, j) = {tuple(bad.nonzero()[0].tolist())}")
    kept80 = kept_pattern(lambda v: run_sm80(q, k, v, causal, {}, p, seed, offset), q, k, d)
    assert torch.equal(kept, kept80), f"{what}: the sm80 variant forward's mask differs in {int((kept != kept80).sum())}"


@requires_sm90
def test_reruns_are_bitwise_equal_and_seeds_change_the_mask():
    b, h, nq, nk, d, p = 1, 2, 300, 300, 128, 0.5
    q, k, v, _ = make(b, h, h, nq, nk, d, BF16, seed=7)
    first = run_sm90(q, k, v, False, {}, p, 1, 0)
    again = run_sm90(q, k, v, False, {}, p, 1, 0)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]), "a rerun with the same seed differs"
    other = run_sm90(q, k, v, False, {}, p, 2, 0)
    assert torch.equal(first[1], other[1]), "lse depends on the seed (it must be the undropped softmax's)"
    changed = (first[0] != other[0]).any(dim=-1).double().mean().item()  # rows whose output moved
    assert changed > 0.99, f"seeds 1 and 2 changed only {changed:.3f} of the rows (each has ~150 of 300 keys kept)"


# ---------------------------------------------------------------------------------------------
# out and lse against the float64 reference
# ---------------------------------------------------------------------------------------------
@requires_sm90
@pytest.mark.parametrize("p", [0.17, 0.5, 0.9])
@pytest.mark.parametrize("hkv", [4, 1], ids=["mha", "gqa4"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_matches_reference(d, dtype, causal, hkv, p):
    b, h, nq, nk = 2, 4, 129, 200
    scale_inputs = 1.0 if p < 0.3 else 0.25  # extreme p: near-uniform P, every keep bit moves its row
    q, k, v, _ = make(b, h, hkv, nq, nk, d, dtype, seed=d * 7 + hkv + int(p * 100), scale_inputs=scale_inputs)
    seed, offset = 1234 + d, 8 * hkv
    check_case(q, k, v, causal, {}, p, seed, offset, dtype,
               f"d={d} {dtype} causal={causal} GQA {h}/{hkv} p={p} Nq={nq} Nk={nk}")


@requires_sm90
@pytest.mark.parametrize("p", [0.5, 0.9])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "nq, nk", [(1, 1), (1, 1000), (31, 33), (33, 31), (127, 129), (129, 127), (1000, 1000), (4097, 4097), (300, 100),
               (100, 300), (1, 4097)])
def test_lengths(nq, nk, causal, p):
    b, h, d = 1, 2, 128
    q, k, v, _ = make(b, h, h, nq, nk, d, BF16, seed=nq * 7 + nk, scale_inputs=0.25)
    check_case(q, k, v, causal, {}, p, (1 << 40) + nq, (1 << 33) + 4, BF16, f"Nq={nq} Nk={nk} causal={causal} p={p}")


@requires_sm90
@pytest.mark.parametrize("pack_gqa", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("nq", [1, 5, 33, 129])
@pytest.mark.parametrize("hkv", [1, 2])
def test_gqa_packing(hkv, nq, pack_gqa):
    # Packed tiles hold H / Hkv heads: a thread's two rows can belong to different heads (other counters).
    b, h, nk, d = 2, 8, 300, 128
    q, k, v, _ = make(b, h, hkv, nq, nk, d, BF16, seed=nq + hkv, scale_inputs=0.25)
    check_case(q, k, v, True, {}, 0.5, 31, 0, BF16, f"GQA {h}/{hkv} Nq={nq} pack_gqa={pack_gqa}", pack_gqa=pack_gqa)


# Dropout with the other variants: (causal, options, input scale). Cases whose flag set has no
# instantiation at a head dim (d = 128 with ALiBi: spills under NVRTC 13.0) are left out.
COMPOSED = {
    "window": (False, {"window": (37, 5)}, 1.0),
    "window_causal": (True, {"window": (64, -1)}, 1.0),
    "softcap_extreme": (False, {"softcap": 5.0}, 8.0),  # |scale q.k| ~ 90: tanh saturated
    "softcap_causal": (True, {"softcap": 30.0}, 2.0),
    "alibi_h": (False, {"alibi": "h"}, 1.0),
    "alibi_bh_causal": (True, {"alibi": "bh"}, 1.0),
    "softcap_alibi": (False, {"softcap": 20.0, "alibi": "bh"}, 1.0),
    "all": (True, {"window": (48, 16), "softcap": 20.0, "alibi": "h"}, 1.0),
}


def _composed_params():
    out = []
    for d in (64, 128, 256):
        for case, (causal, opts, _) in COMPOSED.items():
            left, right = dr.check_window(opts.get("window"), causal)
            va = VariantArgs(left, right, float(opts.get("softcap", 0.0)), 0 if "alibi" in opts else None, 0.5)
            if af.supports_dropout(d, BF16, va):
                out += [pytest.param(d, dtype, case, id=f"d{d}-{name}-{case}") for dtype, name in ((FP16, "fp16"),
                                                                                                  (BF16, "bf16"))]
    return out


@requires_sm90
@pytest.mark.parametrize("d, dtype, case", _composed_params())
def test_with_other_variants(d, dtype, case):
    causal, opts, scale_inputs = COMPOSED[case]
    b, h, hkv, nq, nk = 2, 4, 2, 129, 200
    q, k, v, _ = make(b, h, hkv, nq, nk, d, dtype, seed=d + 3 * len(case), scale_inputs=scale_inputs)
    check_case(q, k, v, causal, _opts(opts, b, h), 0.3, 555, 12, dtype, f"d={d} {dtype} dropout + {case}")


@requires_sm90
@pytest.mark.parametrize(
    "nq, nk, window, causal",
    [
        (300, 100, (8, -1), True),   # rows 0..199 see no key: out 0, lse -inf
        (200, 64, (0, 0), False),    # rows i < 136 see no key; the others exactly one (kept or dropped)
        (129, 1000, (0, 0), False),  # every row sees exactly one key
        (64, 300, (10, -1), False),  # blocks below the window skipped
    ],
)
def test_fully_masked_rows_and_windows(nq, nk, window, causal):
    b, h, d = 2, 2, 64
    q, k, v, _ = make(b, h, h, nq, nk, d, BF16, seed=nq + 2 * nk)
    (out, lse), (_, rlse) = check_case(q, k, v, causal, {"window": window}, 0.5, 3, 0, BF16,
                                       f"Nq={nq} Nk={nk} window={window} causal={causal}")
    masked = ~torch.isfinite(rlse)
    assert torch.equal(lse[masked], torch.full_like(lse[masked], float("-inf"))), "masked rows: lse is not -inf"
    assert (out[masked] == 0).all(), "masked rows: out is not exactly 0"


# ---------------------------------------------------------------------------------------------
# the sm_80 variant backward on this forward's out / lse (the pairing the dispatcher will make)
# ---------------------------------------------------------------------------------------------
@requires_sm90
@pytest.mark.parametrize("hkv", [4, 1], ids=["mha", "gqa4"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm80_backward_on_this_forward(d, dtype, causal, hkv):
    from tileattn.kernels import attention_bwd_sm80

    b, h, nq, nk, p, seed, offset = 2, 4, 129, 200, 0.3, (1 << 40) + 3, (1 << 33) + 4
    q, k, v, dout = make(b, h, hkv, nq, nk, d, dtype, seed=d + hkv + 11)
    what = f"d={d} {dtype} causal={causal} GQA {h}/{hkv} p={p}"
    out, lse = run_sm90(q, k, v, causal, {}, p, seed, offset)
    va = variant_args(q, causal, {}, p)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    with poisoned_allocations():
        plan = attention_bwd_sm80.backward_plan(q, k, v, out, lse, dout, *grads, causal=False, scale=d ** -0.5,
                                                deterministic=False, variants=va)
        plan.launch(q, k, v, out, lse, dout, *grads, 0, seed, offset, 0)
    torch.cuda.synchronize()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    rout, rlse = reference.attention(q64, k64, v64, causal, compute_dtype=F64, dropout_p=p, seed=seed, offset=offset)
    rout.backward(dout.double())
    check_forward((out, lse), (rout.detach(), rlse), dtype, what)
    for name, g, r in zip(("dq", "dk", "dv"), grads, (q64.grad, k64.grad, v64.grad)):
        bad = ~torch.isfinite(g)
        assert not bad.any(), f"{what}: {name} has {int(bad.sum())} NaN/inf elements, first at {bad.nonzero()[0].tolist()}"
        e = rel_err(g, r)
        assert e <= TOL_BWD[dtype], f"{what}: {name} relative error {e:.3e} > {TOL_BWD[dtype]:g} against float64 autograd"


# ---------------------------------------------------------------------------------------------
# small cases for compute-sanitizer
# ---------------------------------------------------------------------------------------------
@requires_sm90
@pytest.mark.sanitize
@pytest.mark.parametrize("d, nq, nk, causal, opts, pack_gqa", [
    (64, 33, 70, False, {}, None),
    (128, 1, 70, True, {"softcap": 10.0}, True),
    (256, 70, 33, True, {"window": (20, -1), "alibi": "h"}, None),
])
def test_sanitize_small(d, nq, nk, causal, opts, pack_gqa):
    b, h, hkv = 1, 4, 1
    q, k, v, _ = make(b, h, hkv, nq, nk, d, FP16, seed=13 + nq)
    check_case(q, k, v, causal, _opts(opts, b, h), 0.5, 77, 4, FP16, f"sanitize d={d} Nq={nq} Nk={nk} {opts}",
               pack_gqa=pack_gqa)
