"""GPU tests of the Hopper variant backward (attention_bwd_sm90.variant_backward_plan; issue #15).

Each case runs the dispatcher's variant forward (dispatch.variant_forward_plan: on sm_90a the Hopper
forward for d = 64 / 128) and then this family's variant backward plan on its out and lse, launched
as tileattn.api launches a variant backward (alibi pointer, seed, offset after the tensors). The
gradients are compared by relative error ||g - ref|| / ||ref|| with float64 autograd through
tileattn.reference.attention with the same window / softcap / alibi_slopes on the same quantized
inputs (the tolerances of tests/gpu/test_attention_variants.py), and with the sm80 variant
backward's gradients on the same out / lse. Every allocation is poisoned (conftest) and dq, dk, dv
start as NaN, so an element the kernels forget to write fails. Rows whose window holds no key must
get dq exactly 0. Skipped with a reason on GPUs other than compute capability 9.0.

Dropout (options dropout_p / seed / offset, as tileattn.attention and reference.attention take
them): the forward is the dispatcher's variant forward (what tileattn.attention runs: the Hopper
dropout forward where SM90_DROPOUT_FORWARD lists the head dim, else the sm80 one) or the Hopper dropout forward
(attention_fwd_sm90.ForwardPlan with variants); the reference applies tileattn.dropout.dropout_mask,
so a keep bit of the backward that differs from the forward's shows up as a gradient error.
"""

from __future__ import annotations

import pytest
import torch

from tileattn import dropout as dr
from tileattn import reference

from .conftest import poisoned_allocations, requires_sm90
from .test_attention_variants import _opts, make, rel_err

pytestmark = [pytest.mark.gpu, requires_sm90]

BF16, FP16 = torch.bfloat16, torch.float16
F64 = torch.float64
TOL = {BF16: 1e-2, FP16: 3e-3}


def _ab():
    from tileattn.kernels import attention_bwd_sm90

    return attention_bwd_sm90


def variant_args(q, causal, opts):
    """attention_fwd_sm80.VariantArgs of the options (causal folded into the window, as tileattn.api)."""
    from tileattn.kernels.attention_fwd_sm80 import VariantArgs

    left, right = dr.check_window(opts.get("window"), causal)
    slopes = opts.get("alibi_slopes")
    sb = None if slopes is None else dr.check_alibi(slopes, q.shape[0], q.shape[1], q.device, dtype_strict=True)
    return VariantArgs(left, right, dr.check_softcap(opts.get("softcap")), sb, dr.check_dropout(
        opts.get("dropout_p", 0.0), None, opts.get("seed"), opts.get("offset")))


def run(q, k, v, dout, causal, opts, deterministic=False, forward="dispatch", split_masked=False):
    """(out, lse, (dq, dk, dv), (sm80 dq, dk, dv)): the variant forward (`forward`: "dispatch" the
    dispatcher's, "sm90" attention_fwd_sm90.ForwardPlan), this family's variant backward and the
    sm80 variant backward on the same out / lse, every allocation poisoned and every gradient
    NaN-filled before its launch. Dropout: seed / offset from opts (0 if absent) for all three.
    split_masked: this family's softcap kernel with its masked / unmasked passes compiled apart."""
    from tileattn.kernels import attention_bwd_sm80, attention_fwd_sm90, dispatch

    va = variant_args(q, causal, opts)
    scale = q.shape[-1] ** -0.5
    slopes = opts.get("alibi_slopes")
    extra = (0 if slopes is None else slopes.data_ptr(), opts.get("seed") or 0, opts.get("offset") or 0, 0)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=q.device, dtype=torch.float32)  # [B, H, Nq]
    with poisoned_allocations():
        if forward == "sm90":
            fwd = attention_fwd_sm90.ForwardPlan(q, k, v, out, lse, causal=False, scale=scale, variants=va)
        else:
            fwd = dispatch.variant_forward_plan(q, k, v, out, lse, scale=scale, variants=va)
        fwd.launch(q, k, v, out, lse, *extra)
        grads, grads80 = ([torch.full_like(t, float("nan")) for t in (q, k, v)] for _ in range(2))
        plan = _ab().variant_backward_plan(q, k, v, out, lse, dout, *grads, scale=scale,
                                           deterministic=deterministic, variants=va, split_masked=split_masked)
        bits = _ab().variant_bits(va) | (_ab().SPLIT_MASKED if split_masked else 0)
        assert plan.variant_values == (bits != 0)
        assert plan.main.kernel.expression.endswith(f", {bits}>") or bits == 0, plan.main.kernel.expression
        assert ("_variants<" in plan.main.kernel.expression) == (bits != 0), plan.main.kernel.expression
        plan.launch(q, k, v, out, lse, dout, *grads, *extra)
        plan80 = attention_bwd_sm80.backward_plan(q, k, v, out, lse, dout, *grads80, causal=False, scale=scale,
                                                  deterministic=False, variants=va)
        plan80.launch(q, k, v, out, lse, dout, *grads80, *extra)
    torch.cuda.synchronize()
    return out, lse, tuple(grads), tuple(grads80)


def reference_grads(q, k, v, dout, causal, opts):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = reference.attention(q64, k64, v64, causal, compute_dtype=F64, **opts)
    out.backward(dout.double())
    return lse, (q64.grad, k64.grad, v64.grad)


def check(q, k, v, dout, causal, opts, dtype, what, deterministic=False, forward="dispatch", split_masked=False):
    """Gradients against float64 autograd and against the sm80 variant backward; dq rows of queries
    that see no key exactly 0. Returns this family's gradients."""
    _, lse, grads, grads80 = run(q, k, v, dout, causal, opts, deterministic, forward, split_masked)
    rlse, rgrads = reference_grads(q, k, v, dout, causal, opts)
    for name, g, r, g80 in zip(("dq", "dk", "dv"), grads, rgrads, grads80):
        bad = ~torch.isfinite(g)
        assert not bad.any(), (f"{what}: {name} has {int(bad.sum())} NaN/inf elements (unwritten?), first at "
                               f"{tuple(bad.nonzero()[0].tolist())}")
        e = rel_err(g, r)
        assert e <= TOL[dtype], f"{what}: {name} relative error {e:.3e} > {TOL[dtype]:g} against float64 autograd"
        e80 = rel_err(g, g80)
        assert e80 <= TOL[dtype], f"{what}: {name} differs from the sm80 variant backward's by {e80:.3e}"
    empty = ~torch.isfinite(rlse)
    assert torch.equal(~torch.isfinite(lse), empty), f"{what}: the forward's lse -inf rows differ from the reference's"
    if empty.any():
        rows = grads[0][empty]
        assert (rows == 0).all(), f"{what}: dq of rows that see no key is not 0 (max {float(rows.abs().max()):.3g})"
    return grads


# (causal, options, input scale).
CASES = {
    "window": (False, {"window": (37, 5)}, 1.0),
    "window_causal": (True, {"window": (64, -1)}, 1.0),
    "window_left_only": (False, {"window": (20, -1)}, 1.0),
    "window_eq_n": (False, {"window": (200, 200)}, 1.0),
    "window_gt_n": (True, {"window": (5000, 3)}, 1.0),
    "softcap_extreme": (False, {"softcap": 5.0}, 8.0),  # |scale q.k| ~ 90: tanh saturated, 1 - tanh^2 ~ 0
    "softcap_causal": (True, {"softcap": 30.0}, 2.0),
    "softcap_window": (False, {"softcap": 20.0, "window": (48, 16)}, 2.0),
    "alibi_h": (False, {"alibi": "h"}, 1.0),
    "alibi_bh_causal": (True, {"alibi": "bh"}, 1.0),
    "alibi_window": (False, {"alibi": "bh", "window": (40, 40)}, 1.0),
    "window_softcap_alibi": (True, {"window": (48, 16), "softcap": 20.0, "alibi": "bh"}, 2.0),
    "window_unbounded": (False, {"window": (-1, -1)}, 1.0),  # nothing on: the plain kernel
}


def _supported(d, dtype, causal, options, b, h):
    q = torch.empty(b, h, 1, d, device="cuda", dtype=dtype)
    return _ab().supports_variants(d, dtype, variant_args(q, causal, _opts(options, b, h)), False)


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_variants_dims_dtypes_gqa(d, dtype, case):
    """Every case at d = 64 / 128 / 256, fp16 / bf16, MHA and GQA 4, Nq = 129 != Nk = 200 (edge tiles)."""
    causal, options, s = CASES[case]
    for h, hkv in ((2, 2), (4, 1)):
        b = 2
        assert _supported(d, dtype, causal, options, b, h), f"{case} at d={d} should run on the sm90 backward"
        q, k, v, dout = make(b, h, hkv, 129, 200, d, dtype, seed=d + h, scale_inputs=s)
        check(q, k, v, dout, causal, _opts(options, b, h), dtype, f"d={d} {dtype} {case} GQA {h}/{hkv}")


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 1000), (31, 33), (127, 129), (129, 127), (300, 100), (100, 300),
                                   (1000, 1000), (4097, 4097)])
@pytest.mark.parametrize("case", ["window_causal", "softcap_window", "alibi_bh_causal", "window_softcap_alibi"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_variants_lengths(d, nq, nk, case):
    """Lengths around the 64 / 128-row tiles, Nq != Nk both ways, one-query rows, 4097 (bf16)."""
    causal, options, s = CASES[case]
    q, k, v, dout = make(1, 2, 1, nq, nk, d, BF16, seed=nq + 7 * nk, scale_inputs=s)
    check(q, k, v, dout, causal, _opts(options, 1, 2), BF16, f"d={d} {case} Nq={nq} Nk={nk}")


# Softcap alone with its passes compiled apart for masked and unmasked tiles (split_masked:
# attention_bwd_sm90.SPLIT_MASKED_INSTANTIATIONS): tiles of both kinds in every call below.
SPLIT_CASES = {"full": (False, {"softcap": 30.0}, 2.0), "causal": (True, {"softcap": 30.0}, 2.0),
               "extreme": (False, {"softcap": 5.0}, 8.0), "window": (False, {"softcap": 20.0, "window": (300, 40)}, 2.0)}


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 1000), (127, 129), (300, 100), (1000, 1000), (4097, 4097)])
@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
def test_softcap_split_masked(d, dtype, case, nq, nk):
    causal, options, s = SPLIT_CASES[case]
    q, k, v, dout = make(1, 2, 1, nq, nk, d, dtype, seed=nq + 5 * nk + d, scale_inputs=s)
    check(q, k, v, dout, causal, _opts(options, 1, 2), dtype, f"split d={d} {dtype} {case} Nq={nq} Nk={nk}",
          split_masked=True)


@pytest.mark.parametrize("n", [200, 1000])
@pytest.mark.parametrize("window,causal", [((0, 0), False), ((1, 1), False), ((31, 33), False), ((127, 0), True),
                                           ((128, 128), False), ((999, -1), True), ((1000, 1000), False),
                                           ((4096, 0), True)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_window_sizes(d, n, window, causal):
    """Windows far smaller than, equal to and larger than N, edges on and off the 64 / 128 boundaries,
    causal and not (fp16: the tighter tolerance)."""
    q, k, v, dout = make(2, 4, 2, n, n, d, FP16, seed=n + window[0])
    check(q, k, v, dout, causal, {"window": window}, FP16, f"d={d} N={n} window={window} causal={causal}")


@pytest.mark.parametrize("nq,nk,window,causal,extra", [
    (300, 129, (0, 0), False, {}),                       # rows 0 .. 170 see no key
    (300, 129, (20, -1), True, {}),                      # causal with Nq > Nk, and a window
    (300, 129, (30, 0), False, {"alibi": "bh"}),
    (200, 100, (10, 0), False, {"softcap": 5.0}),
    (64, 300, (0, -1), True, {}),                        # causal window (0, 0): one key per row, Nq < Nk
])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fully_masked_rows(d, nq, nk, window, causal, extra):
    """Rows whose window holds no key: out 0 / lse -inf in the forward, dq exactly 0 here, and the
    keys no query sees get dk = dv = 0 (checked against autograd, which gives exact zeros)."""
    q, k, v, dout = make(1, 2, 1, nq, nk, d, BF16, seed=nq * 3 + nk)
    opts = _opts({"window": window, **extra}, 1, 2)
    check(q, k, v, dout, causal, opts, BF16, f"d={d} Nq={nq} Nk={nk} window={window} causal={causal} {extra}")


def test_sliding_window_skips_blocks_and_matches_at_long_n():
    """A 512-key causal sliding window at N = 8192 (d = 128 bf16, GQA 4): each key block walks ~10
    of the 128 query tiles (window_tiles); the gradients match float64 autograd and the sm80
    kernels at that length."""
    q, k, v, dout = make(1, 4, 1, 8192, 8192, 128, BF16, seed=3)
    check(q, k, v, dout, True, {"window": (511, 0)}, BF16, "N=8192 window 512 causal")


@pytest.mark.parametrize("case", ["window_causal", "softcap_window", "alibi_window", "window_softcap_alibi",
                                  "window_gt_n"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic_bitwise_and_correct(d, case):
    """deterministic=True (ordered dQ, the turn counters of a windowed tile starting at its first
    visiting key block): right against float64 autograd, and dq, dk, dv bitwise equal over 5 runs
    (GQA 4, Nq = 600 != Nk = 700: several key blocks per tile, some tiles not visited by block 0)."""
    causal, options, s = CASES[case]
    q, k, v, dout = make(1, 4, 1, 600, 700, d, BF16, seed=d + 5, scale_inputs=s)
    opts = _opts(options, 1, 4)
    first = check(q, k, v, dout, causal, opts, BF16, f"deterministic d={d} {case}", deterministic=True)
    for rep in range(4):
        again = run(q, k, v, dout, causal, opts, deterministic=True)[2]
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            diff = int((a != b).sum())
            assert diff == 0, (f"deterministic d={d} {case}: {name} differs from the first run in {diff} elements "
                               f"(run {rep + 2})")


def test_unsupported_variants_raise_before_launching():
    """Dropout with softcap or ALiBi is not this family's (not registered): variant_backward_plan
    raises ValueError naming the sm90 variant backward (the dispatcher keeps it on sm80)."""
    from tileattn.kernels.attention_fwd_sm80 import VariantArgs

    for d, va, det in ((128, VariantArgs(softcap=30.0, dropout_p=0.1), False),
                       (64, VariantArgs(64, 0, 0.0, 0, 0.2), False),
                       (128, VariantArgs(64, 0, 30.0, None, 0.5), True)):
        q, k, v, dout = make(1, 2, 2, 64, 64, d, BF16, seed=1)
        out, lse = torch.empty_like(q), torch.empty(1, 2, 64, device="cuda")
        with pytest.raises(ValueError, match="sm90 variant backward"):
            _ab().variant_backward_plan(q, k, v, out, lse, dout, *(torch.empty_like(t) for t in (q, k, v)),
                                        scale=d ** -0.5, deterministic=det, variants=va)


# ---- dropout (kDropout) ----------------------------------------------------------------------------
SEED_HI = 2**63 + 2**40 + 12345  # a 64-bit seed: both key words used
OFFSET_HI = 3 * 2**32 + 17       # the offset's high word enters the key, the low one the counter


def _dropout_opts(p, window=None, seed=SEED_HI, offset=OFFSET_HI):
    opts = {"dropout_p": p, "seed": seed, "offset": offset}
    if window is not None:
        opts["window"] = window
    return opts


def _hopper_dropout_forward(d, dtype, causal, opts, b, h) -> bool:
    """Whether attention_fwd_sm90.ForwardPlan runs this dropout call (its registered flag sets)."""
    from tileattn.kernels import attention_fwd_sm90

    q = torch.empty(b, h, 1, d, device="cuda", dtype=dtype)
    return attention_fwd_sm90.supports_dropout(d, dtype, variant_args(q, causal, opts))


@pytest.mark.parametrize("forward", ["dispatch", "sm90"])
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dropout_dims_dtypes_gqa(d, dtype, causal, p, forward):
    """Dropout alone (the window bit with unbounded edges; causal: right edge 0) after the dispatcher's
    variant forward (tileattn.attention's) or the Hopper dropout forward: dq, dk, dv against float64
    autograd of reference.attention with the same dropout_p / seed / offset (dropout_mask's mask)
    and against the sm80 variant backward; MHA and GQA 4, Nq = 129 != Nk = 200 and Nq = 200 > Nk = 129."""
    for h, hkv in ((2, 2), (4, 1)):
        b = 2
        opts = _dropout_opts(p)
        q0 = torch.empty(b, h, 1, d, device="cuda", dtype=dtype)
        assert _ab().supports_variants(d, dtype, variant_args(q0, causal, opts)), f"dropout d={d} should run here"
        if forward == "sm90" and not _hopper_dropout_forward(d, dtype, causal, opts, b, h):
            pytest.skip(f"no Hopper dropout forward registered for d={d} {dtype}")
        for nq, nk in ((129, 200), (200, 129)):
            q, k, v, dout = make(b, h, hkv, nq, nk, d, dtype, seed=d + h + nq)
            check(q, k, v, dout, causal, opts, dtype,
                  f"dropout p={p} d={d} {dtype} causal={causal} GQA {h}/{hkv} Nq={nq} Nk={nk} forward={forward}",
                  forward=forward)


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("window,causal", [((37, 5), False), ((64, -1), True), ((300, 0), False)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dropout_with_window(d, window, causal, p):
    """Dropout with a sliding window (the walk visits only window_tiles; masked tiles' window masks
    before the dropout), bf16, GQA 4, Nq = 300 != Nk = 400."""
    q, k, v, dout = make(1, 4, 1, 300, 400, d, BF16, seed=d + window[0])
    check(q, k, v, dout, causal, _dropout_opts(p, window), BF16, f"dropout p={p} d={d} window={window} causal={causal}")


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 1000), (31, 33), (127, 129), (129, 127), (1000, 1000), (4097, 4097)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dropout_lengths(d, nq, nk):
    """Lengths around the 64 / 128-row tiles and 32-key Philox groups, one-query rows, 4097 (causal
    bf16, p = 0.5, small seed / offset)."""
    q, k, v, dout = make(1, 2, 1, nq, nk, d, BF16, seed=nq + 3 * nk)
    check(q, k, v, dout, True, _dropout_opts(0.5, seed=7, offset=0), BF16, f"dropout d={d} Nq={nq} Nk={nk}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,nq", [(64, 60), (128, 100), (256, 100)])
def test_dropout_mask_read_back_exactly(d, nq, causal):
    """The backward's keep mask element for element: with dO[i, i] = 1 (one-hot rows), dV[j, i] =
    P[i, j] keep[i, j] / (1 - p), so dv[..., :Nq] != 0 is the mask the kernel applied (P > 0 where
    visible); it must equal dropout_mask at every visible (b, h, i, j) (MHA, 64-bit seed, p = 0.4,
    atomic and deterministic)."""
    b, h, nk, pdrop = 2, 2, 150, 0.4
    q, k, v, _ = make(b, h, h, nq, nk, d, BF16, seed=4)
    dout = torch.zeros(b, h, nq, d, device="cuda", dtype=BF16)  # [B, H, Nq, d]
    dout[:, :, torch.arange(nq), torch.arange(nq)] = 1
    opts = _dropout_opts(pdrop)
    mask = dr.dropout_mask(SEED_HI, OFFSET_HI, b, h, nq, nk, pdrop, device="cuda")  # [B, H, Nq, Nk]
    i = torch.arange(nq, device="cuda")[:, None]
    visible = (torch.arange(nk, device="cuda")[None, :] <= i + nk - nq) if causal else torch.ones(
        nq, nk, dtype=torch.bool, device="cuda")
    for deterministic in (False, True):
        grads = run(q, k, v, dout, causal, opts, deterministic)[2]
        kept = (grads[2][..., :nq] != 0).transpose(-1, -2)  # [B, H, Nq, Nk]
        bad = (kept != (mask & visible)).nonzero()
        assert bad.shape[0] == 0, (f"d={d} causal={causal} deterministic={deterministic}: {bad.shape[0]} keep bits "
                                   f"differ from dropout_mask, first (b, h, i, j) {bad[:4].tolist()}")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_dropout_seed_matters(d):
    """The backward with the forward's seed matches; with another seed its gradients are far from the
    float64 reference (so the comparisons above do see the mask)."""
    q, k, v, dout = make(1, 2, 2, 256, 256, d, BF16, seed=d)
    opts = _dropout_opts(0.5)
    check(q, k, v, dout, False, opts, BF16, f"dropout d={d} same seed")
    _, _, grads, _ = run(q, k, v, dout, False, {**opts, "seed": SEED_HI + 1})
    _, rgrads = reference_grads(q, k, v, dout, False, opts)
    e = rel_err(grads[2], rgrads[2])
    assert e > 0.1, f"d={d}: dv with the forward of seed + 1 is within {e:.3e} of seed's reference: mask not used?"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dropout_deterministic_bitwise_and_correct(d, causal):
    """deterministic=True with dropout: right against float64 autograd and bitwise equal over 3 runs
    (GQA 4, Nq = 600 != Nk = 700)."""
    q, k, v, dout = make(1, 4, 1, 600, 700, d, BF16, seed=d + 9)
    opts = _dropout_opts(0.1)
    first = check(q, k, v, dout, causal, opts, BF16, f"dropout deterministic d={d} causal={causal}",
                  deterministic=True)
    for rep in range(2):
        again = run(q, k, v, dout, causal, opts, deterministic=True)[2]
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            diff = int((a != b).sum())
            assert diff == 0, f"dropout deterministic d={d}: {name} differs from the first run in {diff} elements"


# ---- small cases that compute-sanitizer re-runs -------------------------------------------------
@pytest.mark.sanitize
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("d,case", [(128, "softcap_window"), (128, "alibi_window"), (64, "window_causal"),
                                    (64, "window_softcap_alibi"), (128, "dropout_causal"), (64, "dropout"),
                                    (256, "window_softcap_alibi"), (256, "dropout_causal")])
def test_sanitize_small(d, case, deterministic):
    # deterministic: the windowed dQ turn counters (window_first_blocks) under the sanitizers too.
    if case.startswith("dropout"):
        causal, options, s = case.endswith("causal"), _dropout_opts(0.5), 1.0
    else:
        causal, options, s = CASES[case]
    q, k, v, dout = make(1, 2, 1, 130, 70, d, FP16, seed=11, scale_inputs=s)
    check(q, k, v, dout, causal, _opts(options, 1, 2), FP16, f"sanitize d={d} {case} deterministic={deterministic}",
          deterministic=deterministic)


@pytest.mark.sanitize
@pytest.mark.parametrize("d", [64, 128])
def test_sanitize_small_split_masked(d):
    """The split softcap kernel: 300 queries x 200 keys, causal, masked (diagonal, edge) and unmasked tiles."""
    causal, options, s = SPLIT_CASES["causal"]
    q, k, v, dout = make(1, 2, 1, 300, 200, d, FP16, seed=13, scale_inputs=s)
    check(q, k, v, dout, causal, _opts(options, 1, 2), FP16, f"sanitize split d={d}", split_masked=True)
