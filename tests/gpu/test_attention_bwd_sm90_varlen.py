"""GPU tests of the Hopper varlen backward (tileattn.kernels.attention_bwd_sm90.BackwardVarlenPlan).

The forward runs through the public op (tileattn.attention_varlen: its out and lse are what the
backward consumes); the sm90 varlen plan then runs directly, inside conftest.poisoned_allocations
(its workspace starts as NaN) with dq, dk, dv NaN-filled, so an element no kernel writes fails.
Oracle: float64 autograd of tileattn.reference.attention_varlen on the same quantized inputs,
relative error ||g - ref|| / ||ref|| per gradient with test_attention_varlen.py's bounds (1e-2 bf16,
3e-3 fp16, an RMS floor of 1e-3 for gradients that are 0 in exact math); a second comparison
against the sm80 varlen backward's gradients on the same out / lse. After the forward, the rows of
q, k, v and dout past the last sequence are overwritten with NaN: the kernel's TMA boxes read them
(and a neighbouring sequence's rows) and must zero them before use, so they never reach a
gradient. Failure messages name the gradient, the worst sequence and its lengths.

Sequence lengths include 0, 1, 31, 33, 127, 129, 1000 and 4097, Nq != Nk per sequence both ways,
GQA 1/4/8, d 64/128, fp16/bf16, causal and not, non-contiguous dout / q and strided dk / dv whose
other columns must stay NaN, the tuning candidates, the rotated walk, a captured CUDA graph replayed
with new lengths. Skipped with a reason on GPUs other than compute capability 9.0.

Markers: `gpu` (all), `sanitize` (small cases, re-run under compute-sanitizer).
"""

from __future__ import annotations

import math

import pytest
import torch

from .conftest import poisoned_allocations, requires_sm90
from .test_attention_fwd_sm90_varlen import dropout_values, spec_options, variant_args
from .test_attention_varlen import TOL_BWD, Case, offsets, rel_err, seed_of

pytestmark = [pytest.mark.gpu, requires_sm90]

BF16, FP16 = torch.bfloat16, torch.float16


def _mod():
    from tileattn.kernels import attention_bwd_sm90

    return attention_bwd_sm90


def forward(case: Case, causal: bool):
    """(out, lse) of the public varlen op (no autograd) on the case's clean inputs."""
    with torch.no_grad():
        out, lse = case.run(causal)[:2]
    return out, lse


def poison_tails(case: Case):
    """Copies of q, k, v, dout with NaN in every row past the last sequence (the backward must not let
    them reach a gradient; the reference keeps the clean values, whose gradient rows there are 0)."""
    tq, tk = sum(case.lens_q), sum(case.lens_k)
    q, k, v, dout = (t.clone() for t in (case.q, case.k, case.v, case.dout))
    for t, start in ((q, tq), (dout, tq), (k, tk), (v, tk)):
        t[start:] = float("nan")
    return q, k, v, dout


def run_sm90(case: Case, causal: bool, out, lse, *, dout=None, grads=None, config=None, rotate=None,
             nan_tails: bool = True):
    """dq, dk, dv from the sm90 varlen plan (all allocations poisoned); `grads`: preallocated outputs
    (default NaN-filled like q, k, v); `dout`: a layout of the case's dout to use instead."""
    q, k, v, d_o = poison_tails(case) if nan_tails else (case.q, case.k, case.v, case.dout)
    if dout is not None:
        dout.copy_(d_o)
        d_o = dout
    if grads is None:
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    dq, dk, dv = grads
    scale = 1.0 / math.sqrt(q.shape[-1])
    with poisoned_allocations():
        if rotate is None:
            plan = _mod().backward_varlen_plan(q, k, v, out, lse, d_o, dq, dk, dv, case.cu_q, case.max_q, case.max_k,
                                               causal=causal, scale=scale, deterministic=False, config=config)
        else:
            plan = _mod().BackwardVarlenPlan(q, k, v, out, lse, d_o, dq, dk, dv, case.cu_q, case.max_q, case.max_k,
                                             causal=causal, scale=scale, config=config, rotate=rotate)
        plan.launch(q, k, v, out, lse, d_o, dq, dk, dv, case.cu_q, case.cu_k)
    torch.cuda.synchronize()
    return dq, dk, dv


def run_sm80(case: Case, causal: bool, out, lse):
    """dq, dk, dv from the sm80 varlen backward (atomic mode) on the same out / lse."""
    from tileattn.kernels import attention_bwd_sm80

    q, k, v, dout = case.q, case.k, case.v, case.dout
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    with poisoned_allocations():
        plan = attention_bwd_sm80.backward_varlen_plan(q, k, v, out, lse, dout, dq, dk, dv, case.cu_q, case.max_q,
                                                       case.max_k, causal=causal, scale=scale, deterministic=False)
        plan.launch(q, k, v, out, lse, dout, dq, dk, dv, case.cu_q, case.cu_k)
    torch.cuda.synchronize()
    return dq, dk, dv


def _worst_sequence(g, r, cu, lens_q, lens_k) -> str:
    """Which sequence's rows differ most (relative), with its lengths, and whether the rows past the
    last sequence are off: points at an edge / offset error."""
    cu = cu.tolist()
    worst, where = -1.0, "none"
    for b in range(len(cu) - 1):
        err = rel_err(g[cu[b]:cu[b + 1]], r[cu[b]:cu[b + 1]]) if cu[b + 1] > cu[b] else 0.0
        if err > worst:
            worst, where = err, f"sequence {b} (Nq={lens_q[b]}, Nk={lens_k[b]}): {err:.3e}"
    tail = g[cu[-1]:]
    tail_msg = f"; rows past the last sequence not 0: {int((tail != 0).any(-1).any(-1).sum())}" if (tail != 0).any() else ""
    return f"worst {where}{tail_msg}"


def check_grads(case: Case, grads, refs, what, tol=None):
    tol = TOL_BWD[case.dtype] if tol is None else tol
    for name, g, r, cu in zip(("dq", "dk", "dv"), grads, refs, (case.cu_q, case.cu_k, case.cu_k)):
        assert g.shape == r.shape, f"{what}: {name} shape {tuple(g.shape)} != {tuple(r.shape)}"
        if not torch.isfinite(g).all():
            bad = (~torch.isfinite(g)).nonzero()
            raise AssertionError(f"{what}: {name} has {bad.shape[0]} NaN/inf elements (unwritten, or a row past a "
                                 f"sequence leaked in), first at {tuple(bad[0].tolist())}")
        err = rel_err(g, r)
        assert err <= tol, (f"{what}: {name} relative error {err:.3e} > {tol:.1e}; "
                            f"{_worst_sequence(g.double(), r.double(), cu, case.lens_q, case.lens_k)}")


def check_case(case: Case, causal: bool, *, against_sm80: bool = False, **kw):
    out, lse = forward(case, causal)
    grads = run_sm90(case, causal, out, lse, **kw)
    refs = case.reference(causal)[2]
    check_grads(case, grads, refs, f"{case.what} causal={causal}")
    if against_sm80:
        sm80 = run_sm80(case, causal, out, lse)
        check_grads(case, grads, [g.double() for g in sm80], f"{case.what} causal={causal} sm90 vs sm80")
    return grads


# ---------------------------------------------------------------------------------------------
# Against the reference (and the sm80 varlen backward): ragged batches x d x causal x dtype
# ---------------------------------------------------------------------------------------------
BATCHES = {  # (lens_q, lens_k, H, Hkv, pad_q, pad_k)
    "ragged_mha": ((0, 1, 31, 33, 127, 129, 1000), (0, 1, 31, 33, 127, 129, 1000), 4, 4, 0, 0),
    "nq_ne_nk_gqa4": ((1, 33, 129, 0, 17, 127, 5), (31, 1, 127, 5, 0, 1000, 3), 8, 2, 3, 5),
    "gqa8_tails": ((1, 1, 4, 1, 33), (1000, 17, 129, 1, 33), 8, 1, 7, 130),
    "long": ((4097, 1, 130), (4097, 129, 1), 2, 1, 1, 0),
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_backward_matches_reference_and_sm80(d, causal, dtype, batch):
    lens_q, lens_k, h, hkv, pad_q, pad_k = BATCHES[batch]
    case = Case(lens_q, lens_k, h, hkv, d, dtype, seed_of("sm90v", d, causal, dtype, batch), pad_q=pad_q, pad_k=pad_k)
    check_case(case, causal, against_sm80=True)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_gqa_groups(d, causal, group):
    case = Case((200, 64, 129), (129, 300, 64), 8, 8 // group, d, BF16, seed_of("gqa", d, causal, group))
    check_case(case, causal)


@pytest.mark.sanitize
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_small_edges(d, causal):
    """Small ragged batch with tails past the last sequence (also run under compute-sanitizer)."""
    case = Case((0, 1, 31, 33), (1, 33, 0, 31), 2, 1, d, FP16, seed_of("small", d, causal), pad_q=2, pad_k=3)
    check_case(case, causal)


@pytest.mark.sanitize
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sequences_without_queries_get_zero_dk_dv(causal):
    """Keys but no queries (every sequence, and one of several): dK = dV = 0 for those rows."""
    for lens_q, lens_k, pad_q in (((0, 0), (65, 130), 3), ((0, 40), (200, 40), 0)):
        case = Case(lens_q, lens_k, 2, 2, 128, BF16, seed_of("noq", causal, lens_q), pad_q=pad_q)
        dq, dk, dv = check_case(case, causal)
        if lens_q[0] == 0:
            assert (dk[:lens_k[0]] == 0).all() and (dv[:lens_k[0]] == 0).all(), \
                f"{case.what}: dK / dV of a sequence without queries are not exactly 0"


@pytest.mark.sanitize
def test_no_keys_gives_zero_dq():
    """Every sequence without keys, Tk > 0 (tail rows only): dq = 0 (fully masked rows), dk = dv = 0."""
    case = Case((5, 33), (0, 0), 2, 1, 64, BF16, seed_of("nok"), pad_k=2)
    out, lse = forward(case, True)
    dq, dk, dv = run_sm90(case, True, out, lse)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert (g == 0).all(), f"{case.what}: {name} must be exactly 0 without keys, got {g.abs().max().item()}"


@pytest.mark.sanitize
def test_causal_rows_that_see_no_key():
    """Nq > Nk causal: the first Nq - Nk queries of a sequence see no key (lse -inf): dq rows 0."""
    case = Case((100, 7), (3, 200), 2, 1, 128, FP16, seed_of("masked"))
    dq = check_case(case, True)[0]
    assert (dq[:97] == 0).all(), "dq of query rows that see no key must be exactly 0"


# ---------------------------------------------------------------------------------------------
# Layouts: non-contiguous dout / q, strided dk / dv buffers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["wide_rows", "expanded"])
def test_non_contiguous_dout(layout):
    """dout as a view into wider rows (TMA reads it in place) and as a stride-0 expansion (TMA cannot
    describe it: the plan copies it)."""
    case = Case((129, 1000, 31), (127, 1000, 33), 4, 2, 128, BF16, seed_of("dout", layout))
    out, lse = forward(case, True)
    if layout == "wide_rows":
        dout = torch.empty(case.dout.shape[0], 4, 256, device="cuda", dtype=BF16)[:, :, :128]
        grads = run_sm90(case, True, out, lse, dout=dout)
    else:
        row = case.dout[:1].clone()
        case.dout = row.expand_as(case.dout)  # the reference uses the same (expanded) values
        grads = run_sm90(case, True, out, lse, nan_tails=False)
    check_grads(case, grads, case.reference(True)[2], f"{case.what} dout {layout}")


def test_transposed_q_and_strided_gradients():
    """q seen through a transpose ([H, Tq, d] storage), dk / dv as views into rows twice as wide whose
    other half must stay NaN (the edge boxes' row stores and the TMA stores use the views' strides)."""
    case = Case((33, 129, 0, 300), (65, 129, 7, 300), 4, 2, 64, FP16, seed_of("layout"), pad_k=5)
    case.q = case.q.transpose(0, 1).contiguous().transpose(0, 1)
    out, lse = forward(case, False)
    hkv = case.k.shape[1]
    dq = torch.full_like(case.q, float("nan"))
    wide = [torch.full((case.k.shape[0], hkv, 128), float("nan"), device="cuda", dtype=FP16) for _ in range(2)]
    grads = run_sm90(case, False, out, lse, grads=(dq, wide[0][:, :, :64], wide[1][:, :, :64]))
    check_grads(case, grads, case.reference(False)[2], f"{case.what} transposed q, strided dk / dv")
    for name, w in zip(("dk", "dv"), wide):
        assert torch.isnan(w[:, :, 64:]).all(), f"{name}: a store wrote the columns beside the gradient view"


# ---------------------------------------------------------------------------------------------
# Tuning candidates, the rotated walk, CUDA graphs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_tuning_candidates(d, causal):
    case = Case((0, 129, 1000, 31), (5, 129, 999, 33), 4, 2, d, BF16, seed_of("tune", d, causal), pad_q=1)
    out, lse = forward(case, causal)
    refs = case.reference(causal)[2]
    default = _mod().VARLEN_DEFAULTS[(d, causal)]  # the dense candidates but this one (the other tests run it)
    for config in (c for c in _mod().tuning_candidates(d, causal) if c != default):
        check_grads(case, run_sm90(case, causal, out, lse, config=config), refs, f"{case.what} config {config}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rotated_walk(causal):
    case = Case((1000, 129, 300), (1000, 300, 129), 4, 4, 128, BF16, seed_of("rot", causal))
    out, lse = forward(case, causal)
    grads = run_sm90(case, causal, out, lse, rotate=True)
    check_grads(case, grads, case.reference(causal)[2], f"{case.what} rotated walk")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_graph_replay_with_new_lengths(causal):
    """One captured launch serves any lengths within B and the max lengths (they live in cu_seqlens)."""
    lens_a, lens_b = (300, 0, 129, 64), (1, 200, 64, 228)
    total = sum(lens_a)
    assert sum(lens_b) == total
    case = Case(lens_a, lens_a, 4, 2, 128, BF16, seed_of("graph", causal))
    case_b = Case(lens_b, lens_b, 4, 2, 128, BF16, seed_of("graph", causal))
    for t_a, t_b in ((case.q, case_b.q), (case.k, case_b.k), (case.v, case_b.v), (case.dout, case_b.dout)):
        t_b.copy_(t_a)
    max_q = max(max(lens_a), max(lens_b))
    case.max_q = case.max_k = case_b.max_q = case_b.max_k = max_q
    out_a, lse_a = forward(case, causal)
    out_b, lse_b = forward(case_b, causal)
    q, k, v, dout = case.q, case.k, case.v, case.dout
    out, lse = out_a.clone(), lse_a.clone()
    cu_q, cu_k = case.cu_q.clone(), case.cu_k.clone()
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    plan = _mod().backward_varlen_plan(q, k, v, out, lse, dout, dq, dk, dv, cu_q, max_q, max_q, causal=causal,
                                       scale=scale, deterministic=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (plan caches, allocator) on a side stream, then capture
        plan.launch(q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.launch(q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k)
    for c, o, l_ in ((case, out_a, lse_a), (case_b, out_b, lse_b)):
        out.copy_(o)
        lse.copy_(l_)
        cu_q.copy_(c.cu_q)
        cu_k.copy_(c.cu_k)
        for g in (dq, dk, dv):
            g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_grads(c, (dq, dk, dv), c.reference(causal)[2], f"{c.what} CUDA graph replay")


# ---------------------------------------------------------------------------------------------
# Host-side contract
# ---------------------------------------------------------------------------------------------
def test_deterministic_is_refused_with_a_pointer_to_sm80():
    case = Case((3,), (3,), 1, 1, 64, BF16, seed_of("det"))
    out, lse = forward(case, False)
    grads = tuple(torch.empty_like(t) for t in (case.q, case.k, case.v))
    with pytest.raises(ValueError, match="attention_bwd_sm80"):
        _mod().backward_varlen_plan(case.q, case.k, case.v, out, lse, case.dout, *grads, case.cu_q, 3, 3,
                                    causal=False, scale=0.125, deterministic=True)
    assert not _mod().supports_varlen(64, BF16, False, True)


def test_empty_packed_tensors():
    """Tq = 0: dk = dv = 0; Tk = 0: dq = 0 (nothing launched)."""
    q = torch.randn(0, 2, 64, device="cuda", dtype=BF16)
    k = torch.randn(9, 1, 64, device="cuda", dtype=BF16)
    cu_q, cu_k = offsets([0, 0]), offsets([4, 5])
    out, lse = torch.empty_like(q), torch.empty(2, 0, device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.full_like(k, float("nan")), torch.full_like(k, float("nan"))
    plan = _mod().backward_varlen_plan(q, k, k, out, lse, q, dq, dk, dv, cu_q, 0, 5, causal=True, scale=0.125,
                                       deterministic=False)
    plan.launch(q, k, k, out, lse, q, dq, dk, dv, cu_q, cu_k)
    assert (dk == 0).all() and (dv == 0).all(), "Tq = 0: dk / dv must be 0"
    q2 = torch.randn(6, 2, 64, device="cuda", dtype=BF16)
    k2 = torch.randn(0, 1, 64, device="cuda", dtype=BF16)
    dq2 = torch.full_like(q2, float("nan"))
    lse2 = torch.full((2, 6), -math.inf, device="cuda")
    plan = _mod().backward_varlen_plan(q2, k2, k2, q2, lse2, q2, dq2, torch.empty_like(k2), torch.empty_like(k2),
                                       offsets([6]), 6, 0, causal=False, scale=0.125, deterministic=False)
    plan.launch(q2, k2, k2, q2, lse2, q2, dq2, torch.empty_like(k2), torch.empty_like(k2), offsets([6]), offsets([0]))
    torch.cuda.synchronize()
    assert (dq2 == 0).all(), "Tk = 0: dq must be 0"


# ---------------------------------------------------------------------------------------------
# Variants (window, softcap, ALiBi: the varlen variant kernels, VARLEN_VARIANT_INSTANTIATIONS)
# ---------------------------------------------------------------------------------------------
# name -> (options, causal, q multiplier): every set of VARLEN_VARIANT_SETS (softcap alone runs with the
# window bit, both edges unbounded), windows smaller than the sequences, two-sided without causal,
# softcap 5 with q x 8 (saturated tanh), ALiBi [B, H] by sequence.
VARIANT_CASES = {
    "window_causal": ({"window": (40, 0)}, True, 1.0),
    "window_two_sided": ({"window": (100, 7)}, False, 1.0),
    "softcap_extreme": ({"softcap": 5.0}, False, 8.0),
    "alibi_bh_causal": ({"alibi": "bh"}, True, 1.0),
    "softcap_alibi": ({"softcap": 20.0, "alibi": "h"}, False, 2.0),
    "all": ({"window": (64, 0), "softcap": 20.0, "alibi": "bh"}, True, 2.0),
}


def variant_case(name, lens_q, lens_k, h, hkv, d, dtype, seed, **kw):
    """(Case with q scaled by the variant's multiplier, options, causal)."""
    spec, causal, mult = VARIANT_CASES[name]
    case = Case(lens_q, lens_k, h, hkv, d, dtype, seed, **kw)
    if mult != 1.0:
        case.q = (case.q.float() * mult).to(dtype)
    return case, spec_options(spec, len(lens_q), h, seed), causal


def run_variant_backward(case: Case, options, causal, out, lse, *, sm80: bool = False):
    """dq, dk, dv of the sm90 (or sm80) varlen variant backward plan on the forward's out / lse; the
    sm90 run gets NaN in every row past the last sequence and NaN-filled gradients."""
    from tileattn.kernels import attention_bwd_sm80

    variants, alibi = variant_args(options, causal, len(case.lens_q), case.q.shape[1])
    q, k, v, dout = (case.q, case.k, case.v, case.dout) if sm80 else poison_tails(case)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    module = attention_bwd_sm80 if sm80 else _mod()
    with poisoned_allocations():
        plan = module.backward_varlen_plan(q, k, v, out, lse, dout, dq, dk, dv, case.cu_q, case.max_q, case.max_k,
                                           causal=False, scale=1.0 / math.sqrt(q.shape[-1]), deterministic=False,
                                           variants=variants)
        plan.launch(q, k, v, out, lse, dout, dq, dk, dv, case.cu_q, case.cu_k, alibi, *dropout_values(options))
    torch.cuda.synchronize()
    return dq, dk, dv


def variant_reference_grads(case: Case, options, causal):
    q, k, v = (t.detach().double().requires_grad_() for t in (case.q, case.k, case.v))
    from tileattn import reference

    out = reference.attention_varlen(q, k, v, case.cu_q, case.cu_k, case.max_q, case.max_k, causal=causal,
                                     compute_dtype=torch.float64, **options)
    return torch.autograd.grad(out, (q, k, v), case.dout.double())


def variant_forward(case: Case, options, causal):
    from tileattn import attention_varlen

    with torch.no_grad():
        return attention_varlen(case.q, case.k, case.v, case.cu_q, case.cu_k, case.max_q, case.max_k, causal=causal,
                                return_lse=True, **options)


@pytest.mark.parametrize("batch", ["nq_ne_nk_gqa4", "gqa8_tails", "long"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(VARIANT_CASES))
@pytest.mark.parametrize("d", [64, 128])
def test_variant_backward_matches_reference_and_sm80(d, name, dtype, batch):
    lens_q, lens_k, h, hkv, pad_q, pad_k = BATCHES[batch]
    seed = seed_of("sm90v-variants", d, name, dtype, batch)
    case, options, causal = variant_case(name, lens_q, lens_k, h, hkv, d, dtype, seed, pad_q=pad_q, pad_k=pad_k)
    out, lse = variant_forward(case, options, causal)
    grads = run_variant_backward(case, options, causal, out, lse)
    what = f"{case.what} {name} causal={causal}"
    check_grads(case, grads, variant_reference_grads(case, options, causal), what)
    sm80 = run_variant_backward(case, options, causal, out, lse, sm80=True)
    check_grads(case, grads, [g.double() for g in sm80], f"{what} sm90 vs sm80")


def test_variant_backward_through_the_public_op():
    """attention_varlen with variants and autograd as the dispatcher runs it (SM90_VARLEN_VARIANT_BACKWARD):
    the Hopper plan runs and the gradients match the reference."""
    from tileattn import api, attention_varlen

    lens_q, lens_k, h, hkv, pad_q, pad_k = BATCHES["nq_ne_nk_gqa4"]
    case, options, causal = variant_case("all", lens_q, lens_k, h, hkv, 128, BF16, seed_of("public-vbwd"))
    q, k, v = (t.detach().requires_grad_() for t in (case.q, case.k, case.v))
    with poisoned_allocations():
        out = attention_varlen(q, k, v, case.cu_q, case.cu_k, case.max_q, case.max_k, causal=causal, **options)
        grads = torch.autograd.grad(out, (q, k, v), case.dout)
    plans = [p for e in api._plans.values() for p in getattr(e, "backward", {}).values()]
    assert any(isinstance(p, _mod().BackwardVarlenPlan) for p in plans), plans
    check_grads(case, grads, variant_reference_grads(case, options, causal), "public op with variants")


def test_variant_backward_refusals():
    from tileattn.kernels import attention_fwd_sm80

    va = attention_fwd_sm80.VariantArgs
    case = Case((3,), (3,), 2, 1, 64, BF16, seed_of("vrefuse"))
    out, lse = forward(case, False)
    grads = tuple(torch.empty_like(t) for t in (case.q, case.k, case.v))
    for variants, causal in ((va(dropout_p=0.1, softcap=3.0), False), (va(softcap=3.0), True)):
        with pytest.raises(ValueError, match="supports_varlen_variants"):
            _mod().backward_varlen_plan(case.q, case.k, case.v, out, lse, case.dout, *grads, case.cu_q, 3, 3,
                                        causal=causal, scale=0.125, deterministic=False, variants=variants)
    assert not _mod().supports_varlen_variants(256, BF16, va(softcap=3.0))
    assert not _mod().supports_varlen_variants(128, BF16, va(softcap=3.0), deterministic=True)
    assert _mod().supports_varlen_variants(128, FP16, va(window_left=5, window_right=0))


# Dropout (VARLEN_DROPOUT_SETS, dispatched by SM90_VARLEN_DROPOUT_BACKWARD).
@pytest.mark.parametrize("seed_tensor", [False, True], ids=["int_seed", "seed_tensor"])
@pytest.mark.parametrize("window", [None, (60, 5)], ids=["no_window", "window"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_dropout_backward_matches_reference_and_sm80(d, causal, window, seed_tensor):
    """The varlen dropout backward (the same mask as the forward's, regenerated from the seed and
    offset, or from a seed tensor read on the device) against the float64 reference's gradients with
    that seed and the sm80 varlen dropout backward's."""
    lens_q, lens_k, h, hkv, pad_q, pad_k = BATCHES["nq_ne_nk_gqa4"]
    seed = seed_of("vdrop", d, causal, window, seed_tensor)
    case = Case(lens_q, lens_k, h, hkv, d, BF16, seed, pad_q=pad_q, pad_k=pad_k)
    options = {"dropout_p": 0.2, "seed": 1000 + seed % 997, "offset": 8, "window": window}
    out, lse = variant_forward(case, options, causal)
    kernel_options = options
    if seed_tensor:
        state = torch.tensor([options["seed"], options["offset"]], dtype=torch.int64, device="cuda")
        kernel_options = {"dropout_p": 0.2, "seed": state, "window": window}
    grads = run_variant_backward(case, kernel_options, causal, out, lse)
    what = f"{case.what} dropout window={window} causal={causal} seed_tensor={seed_tensor}"
    check_grads(case, grads, variant_reference_grads(case, options, causal), what)
    sm80 = run_variant_backward(case, kernel_options, causal, out, lse, sm80=True)
    check_grads(case, grads, [g.double() for g in sm80], f"{what} sm90 vs sm80")


@pytest.mark.sanitize
@pytest.mark.parametrize("name", ["all", "window_two_sided"])
@pytest.mark.parametrize("d", [64, 128])
def test_variant_backward_sanitize_small(d, name):
    seed = seed_of("vsan", d, name)
    case, options, causal = variant_case(name, (0, 1, 33, 70), (3, 1, 31, 129), 4, 2, d, BF16, seed, pad_q=3,
                                         pad_k=9)
    out, lse = variant_forward(case, options, causal)
    grads = run_variant_backward(case, options, causal, out, lse)
    check_grads(case, grads, variant_reference_grads(case, options, causal), f"sanitize {name} d={d}")


@pytest.mark.sanitize
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_dropout_backward_sanitize_small(d):
    case = Case((0, 1, 33, 70), (3, 1, 31, 129), 4, 2, d, BF16, seed_of("vdsan", d), pad_q=3, pad_k=9)
    options = {"dropout_p": 0.3, "seed": 77, "offset": 8}
    out, lse = variant_forward(case, options, True)
    grads = run_variant_backward(case, options, True, out, lse)
    check_grads(case, grads, variant_reference_grads(case, options, True), f"sanitize dropout d={d}")
