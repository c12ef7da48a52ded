"""GPU tests of the attention variants (issue #15): window, softcap, ALiBi, dropout, through
tileattn.attention / attention_varlen (forward and backward, dense and varlen) on whatever kernels
the dispatcher picks (on an H200: the Hopper forward for dense calls without dropout at d = 64, 128,
256, whose lse the sm_80 variant backward then consumes; the sm_80 variant kernels otherwise; each
failure message names the forward family), and the Hopper variant forward on its own (ForwardPlan
with variants: lengths, GQA packing, windows, extreme softcap, fully masked rows; skipped off sm_90).

Oracle: tileattn.reference in float64 with the same options, on the same quantized inputs; dropout
against the reference with the same seed/offset (the reference builds its mask with
tileattn.dropout.dropout_mask). Errors are relative, ||x - ref|| / ||ref||, with the tolerances of
the plain kernels' tests (the variant code adds fp32 work only: the logit transform, an exact bias,
a mask): forward bf16 1e-2 / fp16 2e-3, gradients bf16 1e-2 / fp16 3e-3 (see test_attention_fwd.py
and test_attention_bwd.py for the derivation), with an RMS floor of 1e-3 for gradients that are 0 in
exact math.

The dropout mask is also read back exactly: with V = identity (one-hot value rows) the output is
P * keep / (1 - p), so its zero pattern is the kernel's mask; with dO = identity, dV's is the
backward's. Both must equal dropout_mask(...) element for element.

Every allocation the ops make is poisoned (NaN) by tests/gpu/conftest.py's poisoned_allocations.
Markers: gpu (all), sanitize (the small cases).
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

import tileattn
from tileattn import reference
from tileattn.dropout import dropout_mask

from .conftest import poisoned_allocations

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
F64 = torch.float64
TOL_FWD = {BF16: 1e-2, FP16: 2e-3}
TOL_BWD = {BF16: 1e-2, FP16: 3e-3}
ATOL = 1e-3
HEAD_DIMS = (32, 64, 96, 128, 256)


@pytest.fixture(scope="module", autouse=True)
def _warm_compile_cache():
    """Compile the variant backward instantiations (60) in parallel processes up front (NVRTC holds
    the GIL); the forward's (21) compile lazily."""
    if not torch.cuda.is_available() or os.environ.get("TILEATTN_SANITIZER"):
        return
    from tileattn.kernels import attention_bwd_sm80

    exprs = [e for e in attention_bwd_sm80.FAMILIES[0].instantiations if "_variants_kernel<" in e]
    attention_bwd_sm80.precompile(expressions=exprs)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def make(b, h, hkv, nq, nk, d, dtype, seed, *, scale_inputs=1.0):
    g = _gen(seed)
    q = (torch.randn(b, h, nq, d, device="cuda", generator=g) * scale_inputs).to(dtype)
    k = (torch.randn(b, hkv, nk, d, device="cuda", generator=g) * scale_inputs).to(dtype)
    v = torch.randn(b, hkv, nk, d, device="cuda", generator=g).to(dtype)
    dout = torch.randn(b, h, nq, d, device="cuda", generator=g).to(dtype)
    return q, k, v, dout


def rel_err(x, ref) -> float:
    x, ref = x.double(), ref.double()
    floor = ATOL * math.sqrt(max(ref.numel(), 1))
    return float((x - ref).norm() / max(float(ref.norm()), floor))


def alibi(kind, b, h):
    """ALiBi slopes: 'h' the standard geometric [H] (2^(-8 (i + 1) / H)), 'bh' random [B, H] fp32."""
    if kind == "h":
        return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda", dtype=torch.float32)
    return torch.rand(b, h, device="cuda", generator=_gen(b * 100 + h), dtype=torch.float32) * 0.5


def run_op(q, k, v, dout, causal, opts, *, deterministic=False, grad=True):
    """out, lse (and dq, dk, dv) from tileattn.attention with every allocation poisoned."""
    q, k, v = (t.detach().requires_grad_(grad) for t in (q, k, v))
    with poisoned_allocations():
        out, lse = tileattn.attention(q, k, v, causal, return_lse=True, deterministic=deterministic, **opts)
        if grad:
            out.backward(dout)
    torch.cuda.synchronize()
    return out.detach(), lse, (q.grad, k.grad, v.grad) if grad else None


def run_ref(q, k, v, dout, causal, opts):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = reference.attention(q64, k64, v64, causal, compute_dtype=F64, **opts)
    out.backward(dout.double())
    return out.detach(), lse, (q64.grad, k64.grad, v64.grad)


def assert_lse_matches(lse, rlse, what, against="") -> torch.Tensor:
    """lse against the float64 reference's: the same -inf rows, the others within 2e-4 (1 + max |lse|);
    returns the mask of rows that see a key. `against` names the reference in the message."""
    seen = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), seen), (
        f"{what}: lse -inf pattern differs ({int((torch.isfinite(lse) != seen).sum())} rows)")
    if seen.any():
        diff = (lse.double() - rlse)[seen].abs().max().item()
        bound = 2e-4 * (1.0 + rlse[seen].abs().max().item())
        assert diff <= bound, f"{what}: lse max error {diff:.3e} > {bound:.3e}{against}"
    return seen


def check(got, ref, dtype, what, *, grads=True):
    out, lse, g = got
    rout, rlse, rg = ref
    assert not torch.isnan(out).any(), f"{what}: NaN in out"
    err = rel_err(out, rout)
    assert err <= TOL_FWD[dtype], f"{what}: out relative error {err:.3e} > {TOL_FWD[dtype]:g}"
    seen = assert_lse_matches(lse, rlse, what)
    if (~seen).any():
        rows = out.transpose(0, 1)[~seen] if out.dim() == 3 else out[~seen]  # varlen out [Tq, H, d], lse [H, Tq]
        assert (rows == 0).all(), f"{what}: fully masked rows are not exactly 0"
    if grads:
        for name, x, r in zip(("dq", "dk", "dv"), g, rg):
            assert torch.isfinite(x).all(), f"{what}: {name} has NaN/inf"
            e = rel_err(x, r)
            assert e <= TOL_BWD[dtype], f"{what}: {name} relative error {e:.3e} > {TOL_BWD[dtype]:g}"


# Cases: (name, causal, options for both the op and the reference, input scale).
CASES = {
    "window": (False, {"window": (37, 5)}, 1.0),
    "window_causal": (True, {"window": (64, -1)}, 1.0),
    "window_left_only": (False, {"window": (20, -1)}, 1.0),
    "window_eq_n": (False, {"window": (200, 200)}, 1.0),
    "window_gt_n": (True, {"window": (5000, 3)}, 1.0),
    "softcap_extreme": (False, {"softcap": 5.0}, 8.0),
    "softcap_causal": (True, {"softcap": 30.0}, 2.0),
    "alibi_h": (False, {"alibi": "h"}, 1.0),
    "alibi_bh_causal": (True, {"alibi": "bh"}, 1.0),
    "dropout": (False, {"dropout_p": 0.17, "seed": 1234, "offset": 8}, 1.0),
    "dropout_causal": (True, {"dropout_p": 0.5, "seed": (1 << 40) + 3, "offset": (1 << 33) + 4}, 1.0),
    "everything": (True, {"window": (48, 16), "softcap": 20.0, "alibi": "h", "dropout_p": 0.1, "seed": 77}, 1.0),
    # Without dropout (on an H200 the Hopper forward, every variant flag at once, + the sm_80 backward).
    "window_softcap_alibi": (True, {"window": (48, 16), "softcap": 20.0, "alibi": "bh"}, 2.0),
    "window_unbounded": (False, {"window": (-1, -1)}, 1.0),  # a variant call with nothing on
}


def _forward_family(d, opts) -> str:
    """The family the dispatcher runs a dense variant forward on (for failure messages)."""
    from tileattn.kernels import dispatch
    from tileattn.runtime import device_arch

    return dispatch.variant_forward_family(device_arch(torch.cuda.current_device()), BF16, d,
                                           opts.get("dropout_p", 0.0))


def _opts(options, b, h):
    options = dict(options)
    kind = options.pop("alibi", None)
    if kind is not None:
        options["alibi_slopes"] = alibi(kind, b, h)
    return options


# ---------------------------------------------------------------------------------------------
# forward + backward against the float64 reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_variants_match_reference(d, dtype, case):
    causal, options, scale_inputs = CASES[case]
    b, h, hkv, nq, nk = 2, 4, 2, 129, 200
    q, k, v, dout = make(b, h, hkv, nq, nk, d, dtype, seed=d * 31 + len(case), scale_inputs=scale_inputs)
    opts = _opts(options, b, h)
    what = f"d={d} {dtype} {case} causal={causal} Nq={nq} Nk={nk} forward={_forward_family(d, opts)}"
    check(run_op(q, k, v, dout, causal, opts), run_ref(q, k, v, dout, causal, opts), dtype, what)


@pytest.mark.parametrize("case", ["window_causal", "softcap_extreme", "alibi_bh_causal", "dropout_causal", "everything"])
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_backward(d, case):
    causal, options, scale_inputs = CASES[case]
    b, h, hkv, nq, nk = 2, 4, 1, 150, 97
    q, k, v, dout = make(b, h, hkv, nq, nk, d, BF16, seed=d + 5, scale_inputs=scale_inputs)
    opts = _opts(options, b, h)
    got = run_op(q, k, v, dout, causal, opts, deterministic=True)
    check(got, run_ref(q, k, v, dout, causal, opts), BF16, f"d={d} {case} deterministic")
    again = run_op(q, k, v, dout, causal, opts, deterministic=True)
    for name, x, y in zip(("dq", "dk", "dv"), got[2], again[2]):
        assert torch.equal(x, y), f"d={d} {case}: deterministic {name} differs between two runs"


@pytest.mark.parametrize(
    "nq, nk, window, causal",
    [
        (1, 1, (0, 0), False), (31, 33, (3, 3), False), (33, 31, (0, -1), True), (127, 129, (16, 0), False),
        (129, 127, (-1, 2), True), (1000, 1000, (100, 0), True), (4097, 4097, (256, 0), False),
        (300, 100, (8, -1), True),  # rows 0..199 see no key: out 0, lse -inf, zero gradients
        (200, 64, (0, 0), False),   # window (0, 0): rows i < 136 see no key
    ],
)
def test_window_lengths_and_masked_rows(nq, nk, window, causal):
    b, h, d = 1, 2, 128
    q, k, v, dout = make(b, h, h, nq, nk, d, BF16, seed=nq + nk)
    opts = {"window": window}
    got = run_op(q, k, v, dout, causal, opts)
    ref = run_ref(q, k, v, dout, causal, opts)
    check(got, ref, BF16, f"Nq={nq} Nk={nk} window={window} causal={causal}")
    masked = ~torch.isfinite(ref[1])  # [B, H, Nq]
    if masked.any():
        assert (got[2][0][masked] == 0).all(), "fully masked rows got a nonzero dq"


# ---------------------------------------------------------------------------------------------
# dropout: the mask read back exactly, reproducibility, seeds
# ---------------------------------------------------------------------------------------------
def _onehot_v(b, h, nk, d, dtype):
    eye = torch.zeros(nk, d, device="cuda", dtype=dtype)
    eye[torch.arange(nk), torch.arange(nk)] = 1
    return eye.expand(b, h, nk, d).contiguous()


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seed, offset", [(0, 0), (123456789, 16), ((1 << 63) + 12345, (1 << 35) + 20)])
def test_forward_mask_is_the_helpers(seed, offset, dtype):
    b, h, nq, nk, d, p = 2, 3, 77, 100, 128, 0.3
    q, k, _, _ = make(b, h, h, nq, nk, d, dtype, seed=3, scale_inputs=0.5)  # no probability underflows
    v = _onehot_v(b, h, nk, d, dtype)
    with poisoned_allocations():
        out = tileattn.attention(q, k, v, dropout_p=p, seed=seed, offset=offset)  # [B, H, Nq, d]
    kept = out[..., :nk] != 0
    mask = dropout_mask(seed, offset, b, h, nq, nk, p, device="cuda")
    bad = int((kept != mask).sum())
    assert bad == 0, f"seed={seed} offset={offset}: {bad} of {mask.numel()} mask elements differ from dropout_mask"
    frac = mask.double().mean().item()
    assert abs(frac - 0.7) < 6 * math.sqrt(0.21 / mask.numel()), f"kept fraction {frac:.4f}, expected 0.7"
    assert torch.equal(tileattn.attention(q, k, v, dropout_p=p, seed=seed, offset=offset), out), "rerun differs"


def test_backward_mask_is_the_helpers():
    b, h, nq, nk, d, p, seed, offset = 2, 2, 100, 150, 128, 0.4, 99, 4
    q, k, v, _ = make(b, h, h, nq, nk, d, BF16, seed=4)
    dout = torch.zeros(b, h, nq, d, device="cuda", dtype=BF16)
    dout[:, :, torch.arange(nq), torch.arange(nq)] = 1  # dV[j, i] = P[i, j] keep[i, j] / (1 - p)
    mask = dropout_mask(seed, offset, b, h, nq, nk, p, device="cuda")
    for deterministic in (False, True):
        vv = v.detach().requires_grad_()
        with poisoned_allocations():
            out = tileattn.attention(q, k, vv, deterministic=deterministic, dropout_p=p, seed=seed, offset=offset)
            out.backward(dout)
        kept = (vv.grad[..., :nq] != 0).transpose(-1, -2)  # [B, H, Nq, Nk]
        bad = int((kept != mask).sum())
        assert bad == 0, f"deterministic={deterministic}: {bad} backward mask elements differ from dropout_mask"


def test_mask_does_not_depend_on_the_tiles():
    from tileattn.kernels import attention_fwd_sm80 as fwd

    b, h, nq, nk, d, p, seed, offset = 1, 2, 130, 100, 128, 0.5, 5, 0
    q, k, _, _ = make(b, h, h, nq, nk, d, BF16, seed=6)
    v = _onehot_v(b, h, nk, d, BF16)
    va = fwd.VariantArgs(dropout_p=p)
    outs = []
    for config in (fwd.VARIANT_DEFAULTS[128], fwd.FwdConfig(128, 32, 4, 2)):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, nq), float("nan"), device="cuda")
        plan = fwd.forward_plan(q, k, v, out, lse, causal=False, scale=d ** -0.5, config=config, variants=va)
        plan.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), 0, seed, offset, 0)
        outs.append(out[..., :nk] != 0)
    assert torch.equal(outs[0], outs[1]), f"BLOCK_N 64 and 32 give masks differing in {int((outs[0] != outs[1]).sum())}"
    assert torch.equal(outs[0], dropout_mask(seed, offset, b, h, nq, nk, p, device="cuda"))


def test_different_seeds_give_different_masks_and_generators_advance():
    b, h, nq, nk, d, p = 1, 2, 64, 64, 64, 0.5
    q, k, _, _ = make(b, h, h, nq, nk, d, BF16, seed=7)
    v = _onehot_v(b, h, nk, d, BF16)

    def kept(**kw):
        return tileattn.attention(q, k, v, dropout_p=p, **kw)[..., :nk] != 0

    a, b2 = kept(seed=1), kept(seed=2)
    agree = (a == b2).double().mean().item()
    assert 0.4 < agree < 0.6, f"masks of seeds 1 and 2 agree on {agree:.3f} (independent: 0.5)"
    g = torch.Generator(device="cuda").manual_seed(42)
    off0 = g.get_offset()
    first, second = kept(generator=g), kept(generator=g)
    assert torch.equal(first, kept(seed=42, offset=off0)), "generator: not its seed and offset"
    assert torch.equal(second, kept(seed=42, offset=off0 + 4)), "generator: offset not advanced by 4"
    assert not torch.equal(first, second), "two draws from one generator gave one mask"


def test_dropout_zero_is_the_plain_kernel():
    q, k, v, _ = make(2, 4, 2, 100, 120, 64, BF16, seed=8)
    plain = tileattn.attention(q, k, v, True)
    assert torch.equal(tileattn.attention(q, k, v, True, dropout_p=0.0), plain), "dropout_p=0.0 changed the result"


def test_alibi_slopes_changed_in_place_before_the_backward_are_an_error():
    """The backward reads the slopes again: autograd's version check refuses a backward after an
    in-place change (a refilled slopes buffer), dense and varlen, instead of computing with the new
    values; unchanged, the backward runs."""
    q, k, v, dout = make(1, 4, 4, 64, 64, 64, BF16, seed=9)
    slopes = torch.rand(4, device="cuda", dtype=torch.float32)
    qg = q.detach().requires_grad_()
    out = tileattn.attention(qg, k, v, True, alibi_slopes=slopes)
    slopes.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(dout)
    out = tileattn.attention(qg, k, v, True, alibi_slopes=slopes)
    out.backward(dout)
    assert torch.isfinite(qg.grad).all()
    pq, pk, pv, pdout, cu_q, cu_k = _packed((20, 44), (30, 34), 4, 4, 64, BF16, seed=10)
    pq.requires_grad_()
    out = tileattn.attention_varlen(pq, pk, pv, cu_q, cu_k, 44, 34, causal=True, alibi_slopes=slopes)
    slopes.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(pdout)


# ---------------------------------------------------------------------------------------------
# varlen
# ---------------------------------------------------------------------------------------------
def _packed(lens_q, lens_k, h, hkv, d, dtype, seed):
    g = _gen(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, h, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(tk, hkv, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(tk, hkv, d, device="cuda", generator=g).to(dtype)
    dout = torch.randn(tq, h, d, device="cuda", generator=g).to(dtype)

    def cu(lens):
        return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")

    return q, k, v, dout, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("case", ["window_causal", "softcap_extreme", "alibi_bh_causal", "dropout", "everything"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_varlen_variants_match_reference(d, case, deterministic):
    causal, options, _ = CASES[case]
    lens_q, lens_k, h, hkv, dtype = [70, 0, 129, 1], [100, 5, 129, 40], 4, 2, BF16
    q, k, v, dout, cu_q, cu_k = _packed(lens_q, lens_k, h, hkv, d, dtype, seed=d + len(case))
    opts = _opts(options, len(lens_q), h)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    with poisoned_allocations():
        out, lse = tileattn.attention_varlen(qg, kg, vg, cu_q, cu_k, max(lens_q), max(lens_k), causal,
                                             return_lse=True, deterministic=deterministic, **opts)
        out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    rout, rlse = reference.attention_varlen(q64, k64, v64, cu_q, cu_k, max(lens_q), max(lens_k), causal,
                                            return_lse=True, compute_dtype=F64, **opts)
    rout.backward(dout.double())
    what = f"varlen d={d} {case} det={deterministic}"
    check((out.detach(), lse, (qg.grad, kg.grad, vg.grad)), (rout.detach(), rlse, (q64.grad, k64.grad, v64.grad)),
          dtype, what)


# ---------------------------------------------------------------------------------------------
# torch.compile (window / softcap / ALiBi trace as the attention_variants custom ops)
# ---------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph_with_backward():
    b, h, hkv, nq, nk, d = 1, 4, 2, 100, 130, 64
    q, k, v, dout = make(b, h, hkv, nq, nk, d, BF16, seed=21)
    slopes = alibi("h", b, h)
    opts = {"window": (32, -1), "softcap": 20.0, "alibi_slopes": slopes}

    def loss(q, k, v):
        return (tileattn.attention(q, k, v, True, **opts).float() * dout.float()).sum()

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    torch._dynamo.reset()
    torch.compile(loss, fullgraph=True)(qg, kg, vg).backward()
    ref = run_ref(q, k, v, dout, True, opts)
    for name, x, r in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), ref[2]):
        e = rel_err(x, r)
        assert e <= TOL_BWD[BF16], f"torch.compile: {name} relative error {e:.3e}"


@pytest.mark.parametrize("seeded", [True, False], ids=["seed", "default_generator"])
def test_torch_compile_dropout_matches_eager(seeded):
    # The traced dropout op (tileattn::attention_dropout_fwd/bwd) must give the eager call's output and
    # gradients bit for bit with the same seed/offset; without a seed it draws them from the default
    # CUDA generator at run time (offset + 4 per call), so two calls differ.
    b, h, hkv, nq, nk, d, p = 1, 4, 2, 100, 130, 64, 0.2
    q, k, v, dout = make(b, h, hkv, nq, nk, d, BF16, seed=22)
    # deterministic: the atomic dQ backward is not bitwise reproducible between two runs.
    opts = {"window": (40, -1), "alibi_slopes": alibi("h", b, h), "dropout_p": p, "deterministic": True}
    if seeded:
        opts.update(seed=(1 << 63) + 5, offset=8)
    gen = torch.cuda.default_generators[torch.cuda.current_device()]

    def run(fn):
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = fn(qg, kg, vg)
        out.backward(dout)
        return out.detach(), (qg.grad, kg.grad, vg.grad)

    def op(q_, k_, v_):
        return tileattn.attention(q_, k_, v_, True, **opts)

    torch._dynamo.reset()
    compiled = torch.compile(op, fullgraph=True)
    off0 = gen.get_offset()
    got = run(compiled)
    if seeded:
        want = run(op)
    else:
        assert gen.get_offset() == off0 + 4, f"generator offset {gen.get_offset()}, expected {off0 + 4}"
        eager_opts = {**opts, "seed": gen.initial_seed(), "offset": off0}
        want = run(lambda q_, k_, v_: tileattn.attention(q_, k_, v_, True, **eager_opts))
        again = run(compiled)
        assert not torch.equal(again[0], got[0]), "two compiled calls without a seed gave the same output"
    assert torch.equal(got[0], want[0]), "compiled dropout output differs from eager with the same seed/offset"
    for name, x, y in zip(("dq", "dk", "dv"), got[1], want[1]):
        assert torch.equal(x, y), f"compiled dropout {name} differs from eager with the same seed/offset"


@pytest.mark.parametrize("seeded", [True, False], ids=["seed", "default_generator"])
def test_torch_compile_varlen_dropout_matches_eager(seeded):
    """attention_varlen with dropout under torch.compile(fullgraph=True) runs the
    tileattn::attention_varlen_dropout_fwd/bwd custom ops: out, lse and gradients equal the eager
    call's bit for bit with the same seed/offset, and match the float64 reference, whose mask is
    tileattn.dropout_mask(..., batch_start=b) per sequence. Without a seed the op draws seed/offset
    at run time from the default CUDA generator as the eager call does (initial seed, offset + 4 per
    call), so two compiled calls differ."""
    lens_q, lens_k, h, hkv, d, p = [70, 0, 129, 1], [100, 5, 129, 40], 4, 2, 64, 0.2
    q, k, v, dout, cu_q, cu_k = _packed(lens_q, lens_k, h, hkv, d, BF16, seed=23)
    # deterministic: the atomic dQ backward is not bitwise reproducible between two runs.
    opts = {"window": (40, -1), "alibi_slopes": alibi("bh", len(lens_q), h), "dropout_p": p, "deterministic": True}
    if seeded:
        opts.update(seed=(1 << 63) + 5, offset=(1 << 33) + 8)
    gen = torch.cuda.default_generators[torch.cuda.current_device()]

    def op(q_, k_, v_, **kw):
        return tileattn.attention_varlen(q_, k_, v_, cu_q, cu_k, max(lens_q), max(lens_k), True, return_lse=True,
                                         **{**opts, **kw})

    def run(fn, poison=True):
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        with poisoned_allocations() if poison else contextlib.nullcontext():
            out, lse = fn(qg, kg, vg)
            out.backward(dout)
        torch.cuda.synchronize()
        return out.detach(), lse, (qg.grad, kg.grad, vg.grad)

    torch._dynamo.reset()
    compiled = torch.compile(op, fullgraph=True)
    run(compiled, poison=False)  # compiles the forward and backward graphs outside the poisoned block
    off0 = gen.get_offset()
    got = run(compiled)
    if seeded:
        seed, offset = opts["seed"], opts["offset"]
    else:
        assert gen.get_offset() == off0 + 4, f"generator offset {gen.get_offset()}, expected {off0 + 4}"
        seed, offset = gen.initial_seed(), off0
        again = run(compiled)
        assert not torch.equal(again[0], got[0]), "two compiled varlen calls without a seed gave the same output"
    want = run(lambda q_, k_, v_: op(q_, k_, v_, seed=seed, offset=offset))
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), (got[0], got[1], *got[2]), (want[0], want[1], *want[2])):
        assert torch.equal(x, y), (f"compiled varlen dropout {name} differs from eager with seed={seed} "
                                   f"offset={offset}: {int((x != y).sum())} of {x.numel()} elements")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    rout, rlse = reference.attention_varlen(q64, k64, v64, cu_q, cu_k, max(lens_q), max(lens_k), True,
                                            return_lse=True, compute_dtype=F64, **{**opts, "seed": seed,
                                                                                   "offset": offset})
    rout.backward(dout.double())
    check(got, (rout.detach(), rlse, (q64.grad, k64.grad, v64.grad)), BF16,
          f"compiled varlen dropout seeded={seeded} seed={seed} offset={offset}")


@pytest.mark.parametrize("api", ["attention", "attention_varlen"])
def test_torch_compile_dropout_with_a_generator_draws_eagerly_per_call(api):
    """A torch.Generator under torch.compile: the compiled function breaks its graph to draw the seed
    and offset from it eagerly (tileattn.dropout.drawn_rng_state), so each call advances the generator by
    4 as the eager call does and draws a new mask; out and gradients equal the eager call's bit for bit
    with a generator in the same state."""
    lens_q, lens_k, h, hkv, d, p = [70, 0, 129], [100, 5, 129], 4, 2, 64, 0.2
    if api == "attention":
        q, k, v, dout = make(1, h, hkv, 100, 130, d, BF16, seed=25)

        def op(q_, k_, v_, generator):
            return tileattn.attention(q_, k_, v_, True, dropout_p=p, generator=generator, deterministic=True)
    else:
        q, k, v, dout, cu_q, cu_k = _packed(lens_q, lens_k, h, hkv, d, BF16, seed=25)

        def op(q_, k_, v_, generator):
            return tileattn.attention_varlen(q_, k_, v_, cu_q, cu_k, max(lens_q), max(lens_k), True,
                                             dropout_p=p, generator=generator, deterministic=True)

    def run(fn, generator):
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = fn(qg, kg, vg, generator)
        out.backward(dout)
        return out.detach(), (qg.grad, kg.grad, vg.grad)

    torch._dynamo.reset()
    compiled = torch.compile(op)
    gen, twin = (torch.Generator(device="cuda").manual_seed(1234) for _ in range(2))
    for call in range(2):
        offset = gen.get_offset()
        got = run(compiled, gen)
        want = run(op, twin)
        assert gen.get_offset() == twin.get_offset() == offset + 4, (
            f"call {call}: generator offsets {gen.get_offset()} (compiled) and {twin.get_offset()} (eager), "
            f"expected {offset + 4}")
        for name, x, y in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1])):
            assert torch.equal(x, y), (f"call {call}: compiled {api} dropout {name} with a generator differs from "
                                       f"eager: {int((x != y).sum())} of {x.numel()} elements")
        if call == 0:
            first = got[0]
    assert not torch.equal(got[0], first), "two compiled calls with a generator gave the same output"


@pytest.mark.parametrize("api", ["attention", "attention_varlen"])
def test_dropout_under_cuda_graph_capture(api):
    """With seed/offset given as ints, a captured dropout call replays that mask: each replay equals the eager
    call with the same seed on the new inputs. (Without a seed, or with a seed tensor, the kernels read the
    state from device memory at each replay: tests/gpu/test_dropout_device_rng.py.)"""
    lens_q, lens_k, h, hkv, d, p = [70, 0, 129], [100, 5, 129], 4, 2, 64, 0.2
    seeded = {"dropout_p": p, "seed": (1 << 63) + 3, "offset": 12}
    if api == "attention":
        make_inputs = lambda seed: make(1, h, hkv, 100, 130, d, BF16, seed=seed)[:3]  # noqa: E731

        def op(q_, k_, v_, **kw):
            return tileattn.attention(q_, k_, v_, True, return_lse=True, **kw)
    else:
        packed = _packed(lens_q, lens_k, h, hkv, d, BF16, seed=26)
        cu_q, cu_k = packed[4], packed[5]
        make_inputs = lambda seed: _packed(lens_q, lens_k, h, hkv, d, BF16, seed=seed)[:3]  # noqa: E731

        def op(q_, k_, v_, **kw):
            return tileattn.attention_varlen(q_, k_, v_, cu_q, cu_k, max(lens_q), max(lens_k), True, return_lse=True,
                                             **kw)

    static = [t.clone() for t in make_inputs(26)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # loads the kernel outside the capture
        op(*static, **seeded)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = op(*static, **seeded)
    for seed in (27, 28):
        for dst, src in zip(static, make_inputs(seed)):
            dst.copy_(src)
        static_out.fill_(float("nan"))
        graph.replay()
        want_out, want_lse = op(*static, **seeded)
        torch.cuda.synchronize()
        assert torch.equal(static_out, want_out) and torch.equal(static_lse, want_lse), (
            f"replay on inputs {seed} differs from the eager call with the same seed")



def test_varlen_dropout_opcheck_on_cuda():
    """torch.library.opcheck of tileattn::attention_varlen_dropout_fwd/bwd on CUDA tensors: the real
    implementation against the fake one (shapes, dtypes, strides, devices of every output, the CPU
    rng state included), the schema (no input mutated), autograd registration, AOT dispatch."""
    from tileattn.dropout import rng_state

    lens_q, lens_k = [33, 0, 17], [40, 3, 17]
    q, k, v, dout, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 64, FP16, seed=24)
    options = (33, 40, 0.125, True, 16, 0, 0.0, 0.3)  # max lengths, scale, deterministic, window, softcap, p
    fwd = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu_q, cu_k, None, rng_state(11, 4), *options)
    result = torch.library.opcheck(torch.ops.tileattn.attention_varlen_dropout_fwd.default, fwd)
    assert set(result.values()) == {"SUCCESS"}, f"attention_varlen_dropout_fwd: {result}"
    out, lse, used = torch.ops.tileattn.attention_varlen_dropout_fwd(*fwd)
    assert used.tolist() == [11, 4], f"rng state returned {used.tolist()}, given [11, 4]"
    bwd = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, cu_q, cu_k, None, used, *options)
    result = torch.library.opcheck(torch.ops.tileattn.attention_varlen_dropout_bwd.default, bwd)
    assert set(result.values()) == {"SUCCESS"}, f"attention_varlen_dropout_bwd: {result}"


# ---------------------------------------------------------------------------------------------
# small cases for compute-sanitizer
# ---------------------------------------------------------------------------------------------
@pytest.mark.sanitize
@pytest.mark.parametrize("case", ["everything"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_sanitize_small(case, deterministic):
    causal, options, scale_inputs = CASES[case]
    b, h, hkv, nq, nk, d = 1, 2, 1, 33, 70, 64
    q, k, v, dout = make(b, h, hkv, nq, nk, d, FP16, seed=11, scale_inputs=scale_inputs)
    opts = _opts(options, b, h)
    check(run_op(q, k, v, dout, causal, opts, deterministic=deterministic), run_ref(q, k, v, dout, causal, opts),
          FP16, f"sanitize {case} det={deterministic}")
    lens = [17, 0, 33]
    qv, kv_, vv, dv_, cu_q, cu_k = _packed(lens, [20, 3, 33], h, hkv, d, FP16, seed=12)
    qv.requires_grad_()
    with poisoned_allocations():
        out = tileattn.attention_varlen(qv, kv_, vv, cu_q, cu_k, 33, 33, causal, deterministic=deterministic, **opts)
        out.backward(dv_)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(qv.grad).all(), "sanitize varlen: NaN"


# ---------------------------------------------------------------------------------------------
# The Hopper variant forward on its own (attention_fwd_sm90.ForwardPlan with variants)
# ---------------------------------------------------------------------------------------------
def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="the Hopper forward needs a compute capability 9.0 GPU")

# (causal, options) of the Hopper cases; window sizes relative to N are chosen per test.
SM90_CASES = {
    "window_small": (False, {"window": (16, 7)}),
    "window_causal": (True, {"window": (100, -1)}),
    "softcap_extreme": (False, {"softcap": 5.0}),       # with inputs x8: |scale q.k| ~ 90, tanh saturated
    "softcap_causal": (True, {"softcap": 30.0}),
    "alibi_h": (False, {"alibi": "h"}),
    "alibi_bh_window": (True, {"alibi": "bh", "window": (64, -1)}),
    "all": (False, {"window": (40, 40), "softcap": 20.0, "alibi": "bh"}),
}


def _sm90_variant_args(q, causal, opts):
    """attention_fwd_sm80.VariantArgs of a call's options (no dropout), causal folded into the window."""
    from tileattn import dropout as dr
    from tileattn.kernels import attention_fwd_sm80

    left, right = dr.check_window(opts.get("window"), causal)
    slopes = opts.get("alibi_slopes")
    sb = None if slopes is None else dr.check_alibi(slopes, q.shape[0], q.shape[1], q.device, dtype_strict=True)
    return attention_fwd_sm80.VariantArgs(left, right, dr.check_softcap(opts.get("softcap")), sb, 0.0)


def run_sm90(q, k, v, causal, opts, *, pack_gqa=None, config=None, want_consumers=None, want_block_n=None,
             fixed_max=False, causal_kernel=False):
    """(out, lse) of the Hopper variant forward, outputs poisoned with NaN; checks the plan runs a
    variant instantiation (or, for a call with nothing on, the plain kernel). `config` forces a tile;
    `want_consumers`, `want_block_n`: the consumer warpgroups and key block the plan's tile must have;
    `fixed_max`, `causal_kernel`: ForwardPlan's (softcap's fixed row max; the kCausal ALiBi / softcap
    kernel)."""
    from tileattn.kernels import attention_fwd_sm90

    slopes = opts.get("alibi_slopes")
    va = _sm90_variant_args(q, causal, opts)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=q.device, dtype=torch.float32)
    plan = attention_fwd_sm90.ForwardPlan(q, k, v, out, lse, causal=False, scale=q.shape[-1] ** -0.5,
                                          config=config, pack_gqa=pack_gqa, variants=va, fixed_max=fixed_max,
                                          causal_kernel=causal_kernel)
    assert plan.variant_values == (attention_fwd_sm90.variant_flags(va) != 0)
    assert want_consumers is None or plan.config.consumers == want_consumers, plan.config
    assert want_block_n is None or plan.config.block_n == want_block_n, plan.config
    plan.launch(q, k, v, out, lse, 0 if slopes is None else slopes.data_ptr(), 0, 0, 0)
    torch.cuda.synchronize()
    return out, lse


def check_sm90(q, k, v, causal, opts, dtype, what, *, pack_gqa=None, config=None, want_consumers=None,
               want_block_n=None, fixed_max=False, causal_kernel=False):
    got = run_sm90(q, k, v, causal, opts, pack_gqa=pack_gqa, config=config, want_consumers=want_consumers,
                   want_block_n=want_block_n, fixed_max=fixed_max, causal_kernel=causal_kernel)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    ref = reference.attention(q64, k64, v64, causal, compute_dtype=F64, **opts)
    check((got[0], got[1], None), (ref[0], ref[1], None), dtype, what, grads=False)
    return got, ref


@needs_sm90
@pytest.mark.parametrize("case", list(SM90_CASES))
@pytest.mark.parametrize(
    "nq, nk", [(1, 1), (1, 1000), (127, 129), (129, 127), (1000, 1000), (4097, 4097), (300, 100), (100, 300)])
def test_sm90_variants_lengths(nq, nk, case):
    causal, options = SM90_CASES[case]
    b, h, d = 1, 2, 128
    scale_inputs = 8.0 if case == "softcap_extreme" else 1.0
    q, k, v, _ = make(b, h, h, nq, nk, d, BF16, seed=nq * 7 + nk, scale_inputs=scale_inputs)
    check_sm90(q, k, v, causal, _opts(options, b, h), BF16, f"sm90 {case} causal={causal} Nq={nq} Nk={nk}")


@needs_sm90
@pytest.mark.parametrize("case", list(SM90_CASES))
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm90_variants_dims_dtypes_gqa(d, dtype, case):
    causal, options = SM90_CASES[case]
    b, h, hkv, nq, nk = 2, 4, 2, 129, 200
    scale_inputs = 8.0 if case == "softcap_extreme" else 1.0
    q, k, v, _ = make(b, h, hkv, nq, nk, d, dtype, seed=d + 3 * len(case), scale_inputs=scale_inputs)
    check_sm90(q, k, v, causal, _opts(options, b, h), dtype, f"sm90 d={d} {dtype} {case} GQA {h}/{hkv}")


@needs_sm90
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm90_variants_take_the_variant_tile_at_any_length(d):
    """The dense defaults switch tiles with the lengths (three consumers from WIDE_MIN_QUERIES[d]
    queries at d = 64 and 128, LONG_DEFAULTS from LONG_KEYS keys at d = 256); the variant kernels exist
    only at VARIANT_DEFAULTS' tile, which a variant plan must take at any length."""
    from dataclasses import replace

    from tileattn.kernels import attention_fwd_sm90 as af

    nq, nk = af.WIDE_MIN_QUERIES.get(d, 0) + 76, max(af.LONG_KEYS.values()) + 1
    q, k, v, _ = make(1, 1, 1, nq, nk, d, BF16, seed=d + nk)
    got, _ = check_sm90(q, k, v, True, {"window": (300, -1)}, BF16, f"sm90 d={d} Nq={nq} Nk={nk} window")
    assert replace(af.default_config(d, False, nk, seqlen_q=nq), persistent=False) != af.VARIANT_DEFAULTS[d]  # covered
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    va = _sm90_variant_args(q, True, {"window": (300, -1)})
    plan = af.ForwardPlan(q, k, v, out, lse, causal=False, scale=d ** -0.5, variants=va)
    assert plan.config == replace(af.VARIANT_DEFAULTS[d], persistent=d in af.PERSISTENT_HEAD_DIMS), plan.config


# The variants that run the three-consumer tile alone (attention_fwd_sm90.WIDE_VARIANT_FLAGS).
WIDE_VARIANT_OPTIONS = {"alibi": {"alibi": "h"}, "softcap": {"softcap": 20.0}}


@needs_sm90
@pytest.mark.parametrize("h, hkv", [(2, 2), (3, 1)], ids=["MHA", "GQA3"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", sorted(WIDE_VARIANT_OPTIONS))
def test_sm90_alibi_or_softcap_alone_takes_the_wide_tile_past_the_switch(variant, d, dtype, h, hkv):
    """ALiBi alone and softcap alone (non-causal) run the plain kernel's three-consumer tile from
    WIDE_MIN_QUERIES[d] queries on (variant_config); GQA 3 packs three heads x 64 positions into its
    192 rows. Nk about Nq / 2: the tiles see keys on both sides of their diagonal (ALiBi: one-sided
    blocks of both signs)."""
    from tileattn.kernels import attention_fwd_sm90 as af

    nq = af.WIDE_MIN_QUERIES[d] + 76
    nk = nq // 2 + 37
    assert hkv == h or af.gqa_pack(h, hkv, nq, 192) == 3
    q, k, v, _ = make(1, h, hkv, nq, nk, d, dtype, seed=d + nq + h)
    check_sm90(q, k, v, False, _opts(WIDE_VARIANT_OPTIONS[variant], 1, h), dtype,
               f"sm90 {variant} alone d={d} {dtype} H={h}/{hkv} Nq={nq} Nk={nk}", want_consumers=3)


# Softcap with the fixed row max (ForwardPlan(fixed_max=True): attention_fwd_sm90.FIXED_MAX, bf16).
FIXED_MAX_MASKS = {"full": (False, None), "causal": (True, None), "window": (False, (16, 7)),
                   "window_causal": (True, (100, -1))}


@needs_sm90
@pytest.mark.parametrize("nq, nk", [(1, 1), (1, 1000), (31, 33), (127, 129), (300, 100), (100, 300), (1000, 1000),
                                    (4097, 4097)])
@pytest.mark.parametrize("mask", sorted(FIXED_MAX_MASKS))
@pytest.mark.parametrize("cap, scale_inputs", [(5.0, 8.0), (30.0, 1.0), (30.0, 40.0)], ids=["cap5x8", "cap30", "cap30x40"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm90_softcap_fixed_max(d, cap, scale_inputs, mask, nq, nk):
    """The fixed-max softmax against the float64 reference: saturated tanh (inputs x8 at cap 5, x40 at
    cap 30: rows whose every logit is near -cap, the fixed max's worst case), fully masked rows
    (Nq > Nk causal; the window), both edges; and within bf16 rounding of the online-max kernel."""
    causal, window = FIXED_MAX_MASKS[mask]
    opts = {"softcap": cap} if window is None else {"softcap": cap, "window": window}
    q, k, v, _ = make(1, 2, 2, nq, nk, d, BF16, seed=nq + 3 * nk + d, scale_inputs=scale_inputs)
    check_fixed_max(q, k, v, causal, opts, f"sm90 fixed max d={d} cap={cap} x{scale_inputs} {mask} Nq={nq} Nk={nk}")


def check_fixed_max(q, k, v, causal, opts, what, **plan):
    """The fixed-max forward (ForwardPlan(fixed_max=True, **plan)) against the float64 reference, and
    within bf16 rounding of the online-max windowed kernel; rows without keys lse -inf in both."""
    got, _ = check_sm90(q, k, v, causal, opts, BF16, what, fixed_max=True, **plan)
    online = run_sm90(q, k, v, causal, opts)
    e = rel_err(got[0].double(), online[0].double())
    assert e <= 1e-2, f"{what}: fixed max vs online max: out differs by {e:.3e}"
    finite = torch.isfinite(online[1])
    assert torch.equal(finite, torch.isfinite(got[1])), f"{what}: rows without keys: lse -inf in both"
    assert torch.allclose(got[1][finite], online[1][finite], rtol=0, atol=1e-4), f"{what}: lse"


@needs_sm90
@pytest.mark.parametrize("nq, nk", [(1, 1), (1, 1000), (300, 300)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_fixed_max_runs_only_without_autograd(causal, nq, nk):
    """tileattn.attention with bf16 softcap: a call without autograd runs the fixed-max kernel (the
    plan entry's inference plan), a call with autograd the online-max one, whose out and lse the
    backward reads (dispatch.SM90_SOFTCAP_FIXED_MAX says why); both against the float64 reference,
    the gradients too (Nq = Nk = 1: dq ~ 0, which the fixed max's out would not give)."""
    from tileattn import api
    from tileattn.kernels import attention_fwd_sm90 as af

    opts = {"softcap": 20.0}
    q, k, v, dout = make(1, 2, 2, nq, nk, 128, BF16, seed=nq + nk + causal)
    ref = run_ref(q, k, v, dout, causal, opts)
    api.clear_plans()
    got = run_op(q, k, v, dout, causal, opts, grad=False)
    check(got, ref, BF16, f"softcap no autograd causal={causal} Nq={nq} Nk={nk}", grads=False)
    (entry,) = api._plans.values()
    fixed = f", {af.SOFTCAP | af.FIXED_MAX}, const float*"
    assert fixed in entry.inference.plan.kernel.expression, entry.inference.plan.kernel.expression
    assert fixed not in entry.forward.plan.kernel.expression, entry.forward.plan.kernel.expression
    got = run_op(q, k, v, dout, causal, opts)
    check(got, ref, BF16, f"softcap autograd causal={causal} Nq={nq} Nk={nk}")


# Causal softcap with the fixed max on the kCausal kernel (ForwardPlan(fixed_max=True,
# causal_kernel=True): attention_fwd_sm90.CAUSAL_FIXED_MAX_INSTANTIATIONS).
@needs_sm90
@pytest.mark.parametrize("nq, nk", [(1, 1), (1, 1000), (31, 33), (127, 129), (129, 127), (300, 100), (100, 300),
                                    (1000, 1000), (4097, 4097)])
@pytest.mark.parametrize("cap, scale_inputs", [(5.0, 8.0), (30.0, 1.0), (30.0, 40.0)], ids=["cap5x8", "cap30", "cap30x40"])
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_causal_fixed_max(d, cap, scale_inputs, nq, nk):
    """Bottom-right causal edges for any Nq, Nk (Nq > Nk: rows without keys, out 0 and lse -inf),
    saturated tanh; two consumers below 2048 queries, three at 4097 (causal_variant_config for
    softcap)."""
    q, k, v, _ = make(1, 2, 2, nq, nk, d, BF16, seed=nq + 5 * nk + d, scale_inputs=scale_inputs)
    check_fixed_max(q, k, v, True, {"softcap": cap}, f"sm90 causal fixed max d={d} cap={cap} x{scale_inputs} "
                    f"Nq={nq} Nk={nk}", causal_kernel=True)


@needs_sm90
@pytest.mark.parametrize("h, hkv", [(2, 2), (3, 1)], ids=["MHA", "GQA3"])
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_causal_fixed_max_three_consumers(d, h, hkv):
    """From WIDE_MIN_QUERIES[d] queries the causal fixed-max kernel takes CAUSAL_VARIANT_WIDE's
    192-row tile, unseen visits skipped; Nq > Nk and Nq < Nk."""
    from tileattn.kernels import attention_fwd_sm90 as af

    for nq, nk in ((af.WIDE_MIN_QUERIES[d] + 76, af.WIDE_MIN_QUERIES[d] + 300),
                   (af.WIDE_MIN_QUERIES[d] + 76, af.WIDE_MIN_QUERIES[d] - 500)):
        q, k, v, _ = make(1, h, hkv, nq, nk, d, BF16, seed=d + nq + nk + h)
        check_fixed_max(q, k, v, True, {"softcap": 20.0}, f"sm90 causal fixed max d={d} H={h}/{hkv} Nq={nq} Nk={nk}",
                        causal_kernel=True, want_consumers=3)


@needs_sm90
@pytest.mark.parametrize("cap, nk", [(30.0, 1000), (35.0, 4096)])
def test_sm90_softcap_fixed_max_every_logit_near_minus_cap(cap, nk):
    """The fixed max's worst case: every key of every row scores near -cap (keys close to one direction,
    queries opposite), so every p is near 2^(-2 cap log2 e) (2^-87 at cap 30, 2^-101 at cap 35, with
    log2 Nk = 12 the edge of FIXED_MAX_LOG2_BUDGET): the output is still the average of V the
    reference gives, not 0."""
    from tileattn.kernels import attention_fwd_sm90 as af

    d = 128
    assert af.fixed_max_applies(BF16, af.SOFTCAP, cap, nk)
    g = _gen(nk)
    u = torch.randn(d, device="cuda", generator=g)
    k = (u + 0.05 * torch.randn(1, 2, nk, d, device="cuda", generator=g)).to(BF16)
    q = (-8.0 * u + 0.05 * torch.randn(1, 2, 100, d, device="cuda", generator=g)).to(BF16)
    v = torch.randn(1, 2, nk, d, device="cuda", generator=g).to(BF16)
    got, ref = check_sm90(q, k, v, False, {"softcap": cap}, BF16, f"sm90 fixed max, logits near -{cap}",
                          fixed_max=True)
    assert float(ref[0].abs().max()) > 0 and float(got[0].abs().max()) > 0


# ALiBi alone and softcap alone, causal, on the kCausal kernel (ForwardPlan(causal_kernel=True):
# attention_fwd_sm90.CAUSAL_VARIANT_INSTANTIATIONS), against the float64 reference.
CAUSAL_KERNEL_OPTIONS = {"alibi_h": {"alibi": "h"}, "alibi_bh": {"alibi": "bh"}, "softcap": {"softcap": 20.0},
                         "softcap_extreme": {"softcap": 5.0}}


@needs_sm90
@pytest.mark.parametrize("nq, nk", [(1, 1), (1, 1000), (31, 33), (127, 129), (129, 127), (300, 100), (100, 300),
                                    (1000, 1000), (4097, 4097)])
@pytest.mark.parametrize("variant", sorted(CAUSAL_KERNEL_OPTIONS))
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_causal_variant_kernel_lengths(d, variant, nq, nk):
    """Bottom-right causal edges for any Nq, Nk (Nq > Nk: the first Nq - Nk rows see no key, out 0 and
    lse -inf); two consumers below WIDE_MIN_QUERIES[d] queries (softcap: SOFTCAP_WIDE_MIN_QUERIES[d]),
    d = 64 and softcap at d = 128 at 4097 on three."""
    b, h = 1, 2
    scale_inputs = 8.0 if variant == "softcap_extreme" else 1.0
    q, k, v, _ = make(b, h, h, nq, nk, d, BF16, seed=nq * 5 + nk + d, scale_inputs=scale_inputs)
    check_sm90(q, k, v, True, _opts(CAUSAL_KERNEL_OPTIONS[variant], b, h), BF16,
               f"sm90 causal kernel {variant} d={d} Nq={nq} Nk={nk}", causal_kernel=True)


@needs_sm90
@pytest.mark.parametrize("h, hkv", [(2, 2), (3, 1)], ids=["MHA", "GQA3"])
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_softcap_fixed_max_three_consumers(d, h, hkv):
    """Past WIDE_MIN_QUERIES[d] queries softcap alone takes the three-consumer tile, fixed max too (at
    d = 64 FIXED_MAX_WIDE's 96-key blocks, whose exponentials are partly exp2_poly); Nk not a multiple
    of the key block."""
    from tileattn.kernels import attention_fwd_sm90 as af

    nq = af.WIDE_MIN_QUERIES[d] + 76
    nk = nq // 2 + 37
    q, k, v, _ = make(1, h, hkv, nq, nk, d, BF16, seed=d + nq + h)
    check_sm90(q, k, v, False, {"softcap": 20.0}, BF16, f"sm90 fixed max wide d={d} H={h}/{hkv}", want_consumers=3,
               want_block_n=af.FIXED_MAX_WIDE.get(d, af.VARIANT_WIDE[d]).block_n, fixed_max=True)


@needs_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h, hkv", [(2, 2), (3, 1)], ids=["MHA", "GQA3"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_sm90_softcap_online_three_consumers_from_its_own_switch(dtype, h, hkv, causal):
    """Softcap alone with the online max (the forward autograd runs) takes the three-consumer tile from
    SOFTCAP_WIDE_MIN_QUERIES[128] queries at d = 128, the plain kernel's and ALiBi's switch being
    higher: non-causal (variant_config) and causal (the kCausal kernel, causal_variant_config), Nq > Nk
    and Nq < Nk, against float64."""
    from tileattn.kernels import attention_fwd_sm90 as af

    d, n = 128, af.SOFTCAP_WIDE_MIN_QUERIES[128]
    assert n < af.WIDE_MIN_QUERIES[d]
    for nq, nk in ((n + 76, n + 300), (n + 76, n - 500)):
        q, k, v, _ = make(1, h, hkv, nq, nk, d, dtype, seed=d + nq + nk + h + causal)
        check_sm90(q, k, v, causal, {"softcap": 20.0}, dtype, f"sm90 online softcap d={d} {dtype} H={h}/{hkv} "
                   f"Nq={nq} Nk={nk} causal={causal}", want_consumers=3, causal_kernel=causal)


@needs_sm90
@pytest.mark.parametrize("h, hkv", [(2, 2), (3, 1)], ids=["MHA", "GQA3"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", ["alibi_bh", "softcap"])
def test_sm90_causal_variant_kernel_three_consumers(variant, d, dtype, h, hkv):
    """From WIDE_MIN_QUERIES[d] queries the kCausal kernel takes CAUSAL_VARIANT_WIDE's 192-row tile
    (causal_variant_config); the first consumers of the last tiles skip the visits past their rows'
    diagonal (unseen visits). Nq > Nk and Nq < Nk both (bottom-right alignment)."""
    from tileattn.kernels import attention_fwd_sm90 as af

    for nq, nk in ((af.WIDE_MIN_QUERIES[d] + 76, af.WIDE_MIN_QUERIES[d] + 300),
                   (af.WIDE_MIN_QUERIES[d] + 76, af.WIDE_MIN_QUERIES[d] - 500)):
        q, k, v, _ = make(1, h, hkv, nq, nk, d, dtype, seed=d + nq + nk + h)
        check_sm90(q, k, v, True, _opts(CAUSAL_KERNEL_OPTIONS[variant], 1, h), dtype,
                   f"sm90 causal kernel {variant} d={d} {dtype} H={h}/{hkv} Nq={nq} Nk={nk}", want_consumers=3,
                   causal_kernel=True)


@needs_sm90
@pytest.mark.sanitize
@pytest.mark.parametrize("d, mask, tile", [(64, "full", "variant_wide"), (64, "full", "fixed_max_wide"),
                                           (128, "window_causal", None), (256, "causal", None)])
def test_sm90_softcap_fixed_max_sanitize_small(d, mask, tile):
    from dataclasses import replace

    from tileattn.kernels import attention_fwd_sm90 as af

    causal, window = FIXED_MAX_MASKS[mask]
    opts = {"softcap": 20.0} if window is None else {"softcap": 20.0, "window": window}
    wide = {"variant_wide": af.VARIANT_WIDE, "fixed_max_wide": af.FIXED_MAX_WIDE}.get(tile)
    cfg = None if wide is None else replace(wide[d], persistent=True)
    q, k, v, _ = make(1, 2, 2, 200, 70, d, BF16, seed=29 + d)
    check_sm90(q, k, v, causal, opts, BF16, f"sm90 sanitize fixed max d={d} {mask} {tile}", config=cfg,
               want_consumers=3 if wide else None, fixed_max=True)


@needs_sm90
@pytest.mark.sanitize
@pytest.mark.parametrize("d, consumers", [(64, 3), (128, 2)])
def test_sm90_causal_fixed_max_sanitize_small(d, consumers):
    from dataclasses import replace

    from tileattn.kernels import attention_fwd_sm90 as af

    cfg = replace(af.CAUSAL_VARIANT_WIDE[d], persistent=True) if consumers == 3 else af.DEFAULTS[(d, True)]
    q, k, v, _ = make(1, 2, 2, 200, 170, d, BF16, seed=31 + d)
    check_sm90(q, k, v, True, {"softcap": 20.0}, BF16, f"sm90 sanitize causal fixed max d={d}", config=cfg,
               want_consumers=consumers, fixed_max=True, causal_kernel=True)


@needs_sm90
@pytest.mark.sanitize
@pytest.mark.parametrize("d, variant, consumers", [(64, "alibi_bh", 3), (128, "softcap", 3), (64, "softcap", 2),
                                                   (128, "alibi_h", 2)])
def test_sm90_causal_variant_kernel_sanitize_small(d, variant, consumers):
    """The kCausal kernels on small shapes, each tile forced (persistent): 200 queries after 70 keys
    (130 rows see no key; a 192-row tile's first consumers skip everything) and GQA 3 (packed into the
    192-row tile; unpacked in the 128-row one, which 3 does not divide)."""
    from dataclasses import replace

    from tileattn.kernels import attention_fwd_sm90 as af

    cfg = replace(af.CAUSAL_VARIANT_WIDE[d] if consumers == 3 else af.DEFAULTS[(d, True)], persistent=True)
    for h, hkv, nq, nk in ((2, 2, 200, 70), (3, 1, 70, 200)):
        q, k, v, _ = make(1, h, hkv, nq, nk, d, FP16, seed=23 + nq + d)
        check_sm90(q, k, v, True, _opts(CAUSAL_KERNEL_OPTIONS[variant], 1, h), FP16,
                   f"sm90 sanitize causal kernel {variant} d={d} consumers={consumers} Nq={nq} Nk={nk}",
                   pack_gqa=hkv < h and consumers == 3, config=cfg, want_consumers=consumers, causal_kernel=True)


@needs_sm90
@pytest.mark.parametrize(
    "n, window, causal",
    [
        (1000, (999, 999), False), (1000, (1000, 1000), False),  # window equal to N: every key
        (1000, (5000, 5000), False), (1000, (5000, -1), True),   # larger than N
        (1000, (0, 0), False),                                    # only the diagonal key
        (4097, (127, 0), False), (4097, (128, 0), False),         # window edges on block edges
        (4097, (4096, -1), True), (4097, (3, 200), False),
    ],
)
def test_sm90_window_sizes(n, window, causal):
    b, h, d = 1, 2, 128
    q, k, v, _ = make(b, h, h, n, n, d, FP16, seed=n + window[0])
    check_sm90(q, k, v, causal, {"window": window}, FP16, f"sm90 N={n} window={window} causal={causal}")


@needs_sm90
@pytest.mark.parametrize(
    "nq, nk, window, causal",
    [
        (300, 100, (8, -1), True),   # rows 0..199 see no key
        (200, 64, (0, 0), False),    # rows i < 136 see no key
        (129, 1000, (0, 0), False),  # every row sees exactly one key
        (64, 300, (10, -1), False),  # no row is fully masked, blocks below the window skipped
    ],
)
@pytest.mark.parametrize("extra", [{}, {"softcap": 10.0, "alibi": "h"}], ids=["window", "window_softcap_alibi"])
def test_sm90_fully_masked_rows(nq, nk, window, causal, extra):
    b, h, d = 2, 2, 64
    q, k, v, _ = make(b, h, h, nq, nk, d, BF16, seed=nq + 2 * nk)
    opts = _opts({"window": window, **extra}, b, h)
    (out, lse), (_, rlse) = check_sm90(q, k, v, causal, opts, BF16, f"sm90 Nq={nq} Nk={nk} window={window} {extra}")
    masked = ~torch.isfinite(rlse)
    assert torch.equal(lse[masked], torch.full_like(lse[masked], float("-inf"))), "masked rows: lse is not -inf"
    assert (out[masked] == 0).all(), "masked rows: out is not exactly 0"


@needs_sm90
@pytest.mark.parametrize("pack_gqa", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("nq", [1, 5, 33, 129])
@pytest.mark.parametrize("hkv", [1, 2])
@pytest.mark.parametrize("causal, options", [(True, {"window": (50, -1), "softcap": 15.0}), (False, {}), (True, {})],
                         ids=["window_softcap", "alone", "causal"])
def test_sm90_gqa_packing_per_head_alibi(hkv, nq, pack_gqa, causal, options):
    # Packed tiles hold H / Hkv heads: a thread's two rows can belong to different heads, each with its slope.
    # ALiBi alone runs the raw-unit path (one-sided blocks: the tile's position range decides the side).
    b, h, nk, d = 2, 8, 300, 128
    q, k, v, _ = make(b, h, hkv, nq, nk, d, BF16, seed=nq + hkv)
    opts = _opts({"alibi": "bh", **options}, b, h)
    check_sm90(q, k, v, causal, opts, BF16, f"sm90 GQA {h}/{hkv} Nq={nq} pack_gqa={pack_gqa} causal={causal} {options}",
               pack_gqa=pack_gqa)


@needs_sm90
@pytest.mark.sanitize
@pytest.mark.parametrize("case, nq, nk, pack_gqa", [("all", 33, 70, None), ("alibi_bh_window", 1, 70, True),
                                                    ("window_causal", 70, 33, None), ("softcap_extreme", 33, 70, None),
                                                    ("alibi_h", 70, 33, None)])
def test_sm90_sanitize_small(case, nq, nk, pack_gqa):
    causal, options = SM90_CASES[case]
    b, h, hkv, d = 1, 4, 1, 64
    q, k, v, _ = make(b, h, hkv, nq, nk, d, FP16, seed=13 + nq)
    check_sm90(q, k, v, causal, _opts(options, b, h), FP16, f"sm90 sanitize {case} Nq={nq} Nk={nk}",
               pack_gqa=pack_gqa)


@needs_sm90
@pytest.mark.sanitize
@pytest.mark.parametrize("h, hkv, nq, nk", [(2, 2, 200, 70), (3, 1, 70, 200)], ids=["MHA_200x70", "GQA3_70x200"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", sorted(WIDE_VARIANT_OPTIONS))
def test_sm90_variant_wide_sanitize_small(variant, d, h, hkv, nq, nk):
    """The three-consumer ALiBi-alone and softcap-alone kernels (VARIANT_WIDE, forced) on small shapes:
    200 queries are a full 192-row tile and one of 8 rows (its first consumer's 8, the other two wholly
    past Nq); GQA 3 packed, 70 queries are two tiles of 3 heads x 64 positions (the second with 6 per
    head)."""
    from dataclasses import replace

    from tileattn.kernels import attention_fwd_sm90 as af

    cfg = replace(af.VARIANT_WIDE[d], persistent=True)
    q, k, v, _ = make(1, h, hkv, nq, nk, d, FP16, seed=17 + nq + d)
    check_sm90(q, k, v, False, _opts(WIDE_VARIANT_OPTIONS[variant], 1, h), FP16,
               f"sm90 sanitize {variant} wide d={d} Nq={nq} Nk={nk}",
               pack_gqa=True if hkv < h else None, config=cfg, want_consumers=3)
