"""GPU tests of the Hopper attention backward (tileattn.kernels.attention_bwd_sm90.BackwardPlan).

The sm80 backward's GPU tests (tests/gpu/test_attention_bwd.py), run on the sm90 kernel: out and lse
come from tileattn.reference in float64 (out cast to the input dtype), gradients are compared with
float64 autograd through the reference on the same quantized inputs by relative error
||g - ref|| / ||ref||, with the sm80 file's tolerances and helpers (the sm90 kernel rounds P^T and
dS^T to the input dtype before the dV / dK / dQ products exactly as the sm80 kernel does, and shares
its preprocess and dQ convert). Skipped with a reason on GPUs other than compute capability 9.0.

Every launch runs inside conftest.poisoned_allocations (the plan's workspace starts as NaN) with
dq, dk, dv NaN-filled, so an element the kernels forget to write, or a workspace row read before
it is written, fails the comparison. On a failure the message names the worst element and the
fraction of rows (by position in the 64/128-row tiles) that are off, which points at a layout or
masking error.
"""

from __future__ import annotations

import math

import pytest
import torch

from .conftest import poisoned_allocations, requires_sm90
from .test_attention_bwd import TOL, forward_reference, make_inputs, reference_grads, rel_err

pytestmark = [pytest.mark.gpu, requires_sm90]

BF16, FP16 = torch.bfloat16, torch.float16


def _mod():
    from tileattn.kernels import attention_bwd_sm90

    return attention_bwd_sm90


def run_backward(q, k, v, dout, *, causal, scale, deterministic, out=None, lse=None, config=None, grads=None,
                 rotate=None):
    """dq, dk, dv from the sm90 plan, every allocation poisoned; `grads` = preallocated outputs;
    `rotate` None = the ROTATE table's choice."""
    if out is None:
        out, lse = forward_reference(q, k, v, causal, scale)
    if grads is None:
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    dq, dk, dv = grads
    with poisoned_allocations():
        plan = _mod().BackwardPlan(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale,
                                   deterministic=deterministic, config=config, rotate=rotate)
        plan.launch(q, k, v, out, lse, dout, dq, dk, dv)
    torch.cuda.synchronize()
    return dq, dk, dv


def _where(g, r, tol) -> str:
    """Worst element and which key / query rows (mod 128) are off: a wrong fragment or descriptor
    layout shows up as a pattern of rows, a masking error as the rows near the diagonal or edge."""
    diff = (g.double() - r.double()).abs()
    if not torch.isfinite(diff).all():
        bad = (~torch.isfinite(g)).nonzero()
        return f"{bad.shape[0]} non-finite elements, first at {tuple(bad[0].tolist())}"
    idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    row_err = diff.norm(dim=-1) > tol * r.double().norm(dim=-1).clamp_min(1e-3) * 3
    rows = row_err.nonzero()[:, 2] % 128 if row_err.any() else torch.empty(0)
    return (f"worst at {idx}: got {float(g[idx]):.4g} want {float(r[idx]):.4g}; {int(row_err.sum())}/"
            f"{row_err.numel()} rows off, their positions mod 128: {sorted(set(rows.tolist()))[:32]}")


def assert_close(grads, refs, dtype, what, tol=None):
    tol = TOL[dtype] if tol is None else tol
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert torch.isfinite(g).all(), f"{what}: {name} has NaN/inf (unwritten elements?): {_where(g, r, tol)}"
        err = rel_err(g, r)
        assert err <= tol, f"{what}: {name} relative error {err:.3e} > {tol:.1e}; {_where(g, r, tol)}"


def check_case(batch, heads, kv_heads, nq, nk, d, dtype, causal, *, deterministic=False, layout="bhnd", scale=None,
               seed=0, config=None, rotate=None):
    q, k, v, dout = make_inputs(batch, heads, kv_heads, nq, nk, d, dtype, layout=layout, seed=seed)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    grads = run_backward(q, k, v, dout, causal=causal, scale=scale, deterministic=deterministic, config=config,
                         rotate=rotate)
    refs = reference_grads(q, k, v, dout, causal, scale)
    what = (f"sm90 B={batch} H={heads} Hkv={kv_heads} Nq={nq} Nk={nk} d={d} {dtype} causal={causal} "
            f"det={deterministic} layout={layout} cfg={config or 'default'} rotate={rotate}")
    assert_close(grads, refs, dtype, what)
    return grads, refs


# ---- every supported head dim x dtype x causal x mode, GQA 2 ---------------------------------------
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_head_dims(d, dtype, causal, deterministic):
    check_case(2, 4, 2, 129, 129, d, dtype, causal, deterministic=deterministic, seed=d)


def test_supports():
    mod = _mod()
    assert mod.supports(128, BF16, True) and mod.supports(64, FP16, False) and mod.supports(256, BF16, True)
    assert not mod.supports(96, BF16, False) and not mod.supports(32, FP16, False)
    assert not mod.supports_varlen(256, BF16, False)  # d = 256 varlen stays on the sm80 kernels
    assert not mod.supports(128, torch.float32, False)


# ---- lengths Nq = Nk in {1, 17, 127, 128, 129, 1000, 4097} ---------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "n,d,dtype",
    [
        (1, 128, BF16),
        (1, 64, FP16),
        (17, 128, BF16),
        (17, 64, FP16),
        (31, 64, BF16),
        (33, 128, FP16),
        (127, 128, FP16),
        (128, 128, BF16),
        (128, 64, FP16),
        (129, 64, BF16),
        (1000, 128, BF16),
        (1000, 64, FP16),
        (4097, 128, BF16),
        (4097, 64, FP16),
        (1, 256, FP16),
        (31, 256, BF16),
        (63, 256, FP16),
        (65, 256, BF16),
        (129, 256, FP16),
        (1000, 256, BF16),
        (4097, 256, BF16),
    ],
)
def test_lengths(n, d, dtype, causal):
    batch, heads = (1, 2) if n > 1000 else (2, 2)
    check_case(batch, heads, 1, n, n, d, dtype, causal, seed=n + d)


# ---- Nq != Nk both ways (causal bottom-right; Nq > Nk has fully masked rows) ---------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "nq,nk,d,dtype",
    [
        (1, 300, 128, BF16),
        (300, 1, 128, BF16),
        (17, 1000, 64, FP16),
        (1000, 17, 64, FP16),
        (129, 4097, 128, BF16),
        (4097, 129, 64, FP16),
        (200, 333, 128, FP16),
        (333, 200, 64, BF16),
        (1, 300, 256, BF16),
        (300, 1, 256, FP16),
        (129, 1000, 256, FP16),
        (1000, 129, 256, BF16),
    ],
)
def test_nq_ne_nk(nq, nk, d, dtype, causal):
    check_case(1, 2, 2, nq, nk, d, dtype, causal, seed=nq * 7 + nk)


# ---- GQA ratios 1, 4, 8 (dK / dV summed over the group in registers) --------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("d,dtype", [(128, FP16), (128, BF16), (64, BF16), (256, BF16), (256, FP16)])
def test_gqa(heads, kv_heads, d, dtype, causal):
    check_case(2, heads, kv_heads, 257, 190, d, dtype, causal, seed=heads * 10 + kv_heads + d)


# ---- non-contiguous inputs ([B, N, H, d] viewed through transpose(1, 2)) and a strided dO ----------
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("d,dtype,causal", [(128, BF16, True), (64, FP16, False), (256, BF16, True)])
def test_non_contiguous(d, dtype, causal, deterministic):
    q, _, _, _ = make_inputs(1, 4, 2, 8, 8, d, dtype, layout="bnhd")
    assert not q.is_contiguous() and q.stride(-1) == 1
    check_case(2, 4, 2, 300, 211, d, dtype, causal, deterministic=deterministic, layout="bnhd", seed=d)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_strided_dout_and_outputs(d):
    """dO a column slice of a wider tensor (row stride 2d), dk / dv views into taller NaN buffers:
    the rows past Nk (the edge block's TMA store bound) must stay NaN."""
    dtype, causal, scale = BF16, True, 1.0 / math.sqrt(d)
    q, k, v, _ = make_inputs(1, 4, 2, 190, 150, d, dtype, seed=4)
    wide = torch.randn(1, 4, 190, 2 * d, device="cuda", dtype=dtype)
    dout = wide[..., :d]
    assert dout.stride(2) == 2 * d
    out, lse = forward_reference(q, k, v, causal, scale)
    tall_k = torch.full((1, 2, 150 + 40, d), float("nan"), device="cuda", dtype=dtype)
    tall_v = torch.full_like(tall_k, float("nan"))
    dq = torch.full_like(q, float("nan"))
    grads = run_backward(q, k, v, dout, causal=causal, scale=scale, deterministic=False, out=out, lse=lse,
                         grads=(dq, tall_k[:, :, :150], tall_v[:, :, :150]))
    assert torch.isnan(tall_k[:, :, 150:]).all() and torch.isnan(tall_v[:, :, 150:]).all(), \
        "dk / dv rows past Nk were written"
    assert_close(grads, reference_grads(q, k, v, dout, causal, scale), dtype, f"strided dO / outputs d={d}")


def test_non_default_scale():
    check_case(1, 2, 1, 150, 150, 64, BF16, True, scale=0.37, seed=5)
    check_case(1, 2, 1, 150, 150, 128, FP16, False, scale=1.3, seed=6)


# ---- extreme logits (|scores| ~ 1e4) ---------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_extreme_logits(dtype, causal, deterministic, d):
    """As in the sm80 tests: scores around +-1e4 through a row-constant shift (component 0 of every
    key is 8, of every query large), small half-integer other components (Q K^T exact in fp32)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    b, h, nq, nk = 1, 2, 300, 257
    q = torch.randint(-4, 5, (b, h, nq, d), device="cuda", generator=g) / 2
    k = torch.randint(-4, 5, (b, h, nk, d), device="cuda", generator=g) / 2
    v = torch.randn(b, h, nk, d, device="cuda", generator=g)
    dout = torch.randn(b, h, nq, d, device="cuda", generator=g)
    sign = torch.randint(0, 2, (b, h, nq), device="cuda", generator=g) * 2 - 1
    q[..., 0] = (4096 + 512 * torch.randint(0, 8, (b, h, nq), device="cuda", generator=g)) * sign
    k[..., 0] = 8
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    scale = 0.25
    out, lse = forward_reference(q, k, v, causal, scale)
    finite = lse[torch.isfinite(lse)].abs()
    assert finite.min() > 5000, "the test must actually produce extreme logits"
    grads = run_backward(q, k, v, dout, causal=causal, scale=scale, deterministic=deterministic, out=out, lse=lse)
    refs = reference_grads(q, k, v, dout, causal, scale)
    assert_close(grads, refs, dtype, f"sm90 extreme logits d={d} {dtype} causal={causal} det={deterministic}")


# ---- fully masked rows (causal, Nq > Nk): zero gradients there, no NaN anywhere -------------------
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("nq,nk,d", [(200, 17, 128), (70, 3, 64), (5, 1, 128), (1000, 129, 64), (200, 17, 256),
                                     (130, 65, 256)])
def test_fully_masked_rows(nq, nk, d, deterministic):
    dtype, causal, scale = BF16, True, 1.0 / math.sqrt(d)
    q, k, v, dout = make_inputs(1, 4, 2, nq, nk, d, dtype, seed=nq)
    out, lse = forward_reference(q, k, v, causal, scale)
    masked = nq - nk  # queries 0 .. nq - nk - 1 see no key
    assert torch.isneginf(lse[:, :, :masked]).all() and torch.isfinite(lse[:, :, masked:]).all()
    grads = run_backward(q, k, v, dout, causal=causal, scale=scale, deterministic=deterministic, out=out, lse=lse)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert not torch.isnan(g).any(), f"{name} has NaN"
    assert (grads[0][:, :, :masked] == 0).all(), "fully masked query rows must get dq == 0"
    refs = reference_grads(q, k, v, dout, causal, scale)
    assert_close(grads, refs, dtype, f"sm90 fully masked rows Nq={nq} Nk={nk} d={d} det={deterministic}")


# ---- empty sequences: nothing to launch, the gradients that exist are zero -------------------------
@pytest.mark.parametrize("nq,nk", [(0, 50), (50, 0)])
def test_empty_sequences(nq, nk):
    q, k, v, dout = make_inputs(1, 2, 1, nq, nk, 128, BF16, seed=2)
    out = torch.zeros_like(q)
    lse = torch.full((1, 2, nq), float("-inf"), device="cuda")
    dq, dk, dv = run_backward(q, k, v, dout, causal=False, scale=0.1, deterministic=False, out=out, lse=lse)
    for name, g in zip(("dq", "dk", "dv"), (dq, dk, dv)):
        assert (g == 0).all(), f"Nq={nq} Nk={nk}: {name} must be all zero"


# ---- deterministic mode: 50 repeated backward passes bitwise equal -----------------------------------
@pytest.mark.parametrize(
    "nq,nk,d,dtype,causal,heads,kv_heads",
    [(1000, 1000, 128, BF16, True, 8, 2), (517, 300, 64, FP16, False, 4, 4), (300, 517, 128, BF16, False, 2, 1),
     (700, 700, 256, BF16, True, 4, 2), (300, 517, 256, FP16, False, 2, 1)],
)
def test_deterministic_bit_identical(nq, nk, d, dtype, causal, heads, kv_heads):
    q, k, v, dout = make_inputs(2, heads, kv_heads, nq, nk, d, dtype, seed=3)
    scale = 1.0 / math.sqrt(d)
    out, lse = forward_reference(q, k, v, causal, scale)
    first = run_backward(q, k, v, dout, causal=causal, scale=scale, deterministic=True, out=out, lse=lse)
    grads = tuple(torch.empty_like(t) for t in first)
    plan = _mod().BackwardPlan(q, k, v, out, lse, dout, *grads, causal=causal, scale=scale, deterministic=True)
    for rep in range(50):
        for t in grads:
            t.fill_(float("nan"))
        plan.launch(q, k, v, out, lse, dout, *grads)
        torch.cuda.synchronize()
        for name, a, b in zip(("dq", "dk", "dv"), first, grads):
            assert torch.equal(a, b), f"deterministic {name} differs from the first run at repetition {rep}"
    atomic = run_backward(q, k, v, dout, causal=causal, scale=scale, deterministic=False, out=out, lse=lse,
                          rotate=False)
    for name, a, b in zip(("dq", "dk", "dv"), first, atomic):
        err = rel_err(a, b)
        assert err <= TOL[dtype], f"deterministic vs atomic {name}: {err:.3e}"
    # dk and dv never use atomics: identical in both modes on the same (unrotated) walk.
    assert torch.equal(first[1], atomic[1]) and torch.equal(first[2], atomic[2]), "dk/dv differ between modes"
    assert_close(first, reference_grads(q, k, v, dout, causal, scale), dtype, "sm90 deterministic vs reference")


# ---- deterministic mode through the public op: the family the dispatcher picks ---------------------------
@pytest.mark.parametrize("d,dtype,causal", [(128, BF16, False), (128, FP16, True), (64, BF16, True), (64, FP16, False),
                                           (256, BF16, True), (256, FP16, False)])
def test_public_op_deterministic_backward(d, dtype, causal):
    """tileattn.attention(..., deterministic=True): three backward passes bitwise equal, gradients
    against the float64 reference, on the family dispatch.backward_family names (GQA, Nq != Nk)."""
    import tileattn
    from tileattn.kernels import dispatch
    from tileattn.runtime import device_arch

    q, k, v, dout = make_inputs(2, 8, 2, 333, 517, d, dtype, seed=5)
    scale = 1.0 / math.sqrt(d)
    family = dispatch.backward_family(device_arch(q.device.index), dtype, d, causal, True)
    expected = "attention_bwd_sm90" if (d, causal, True) in dispatch.SM90_BACKWARD else "attention_bwd_sm80"
    assert family == expected
    runs = []
    for _ in range(3):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with poisoned_allocations():
            out = tileattn.attention(*leaves, causal=causal, scale=scale, deterministic=True)
            runs.append(torch.autograd.grad(out, leaves, dout))
        torch.cuda.synchronize()
    for rep in (1, 2):
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], runs[rep]):
            assert torch.equal(a, b), f"{family}: deterministic {name} differs between pass 0 and pass {rep}"
    assert_close(runs[0], reference_grads(q, k, v, dout, causal, scale), dtype, f"{family} deterministic vs reference")


# ---- block order: L2 sections of (kv head, batch) pairs -----------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,dtype", [(128, BF16), (64, FP16), (256, BF16)])
def test_block_order_sections(d, dtype, causal):
    """Every section size (1, uneven 4 of 6 pairs with a short last section, all 6) gives correct
    gradients; dk / dv (register sums) and the deterministic dq are bitwise independent of the order
    in which the CTAs run."""
    q, k, v, dout = make_inputs(2, 6, 3, 700, 650, d, dtype, seed=31)
    scale = 1.0 / math.sqrt(d)
    out, lse = forward_reference(q, k, v, causal, scale)
    refs = reference_grads(q, k, v, dout, causal, scale)
    first = {}
    for section in (1, 4, 6):
        for deterministic in (False, True):
            grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
            with poisoned_allocations():
                plan = _mod().BackwardPlan(q, k, v, out, lse, dout, *grads, causal=causal, scale=scale,
                                           deterministic=deterministic, section=section)
                assert plan.section == section
                plan.launch(q, k, v, out, lse, dout, *grads)
            torch.cuda.synchronize()
            what = f"section={section} det={deterministic} d={d} causal={causal}"
            assert_close(grads, refs, dtype, what)
            names = ("dq", "dk", "dv") if deterministic else ("dk", "dv")
            for name, g in zip(("dq", "dk", "dv"), grads):
                if name in names:
                    base = first.setdefault((deterministic, name), g)
                    assert torch.equal(base, g), f"{what}: {name} differs from section 1's"


# ---- every tuning candidate is correct ----------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,dtype", [(128, BF16), (64, FP16)])
def test_tuning_candidates(d, dtype, causal):
    for deterministic in (False, True):
        for cfg in _mod().tuning_candidates(d, causal, deterministic):
            check_case(1, 4, 2, 333, 290, d, dtype, causal, deterministic=deterministic, config=cfg, seed=7)


# ---- the rotated walk (key block n starts n tiles further on; atomic modes only) ---------------------
@pytest.mark.parametrize("bulk", [False, True], ids=["red", "bulk"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "nq,nk,d,dtype,heads,kv_heads",
    [(1000, 1000, 128, BF16, 4, 2), (700, 650, 64, FP16, 4, 1), (129, 4097, 128, FP16, 2, 2),
     (4097, 300, 64, BF16, 2, 1), (333, 200, 128, BF16, 8, 1)],
)
def test_rotated_walk(nq, nk, d, dtype, heads, kv_heads, causal, bulk):
    """Every key block visits every query tile of its walk once whatever its rotation: gradients as
    the reference, in the RED and the staged bulk dQ modes, with GQA and both edges."""
    config = _mod().Sm90BwdConfig(_mod().DEFAULTS[(d, causal)].block_m, 2, bulk)
    check_case(1, heads, kv_heads, nq, nk, d, dtype, causal, seed=nq + nk + d, config=config, rotate=True)


def test_rotate_flag_and_deterministic_mode():
    """The plan reports its walk: rotate=True kept in the atomic mode, always off in deterministic mode
    (the turn order needs the unrotated walk), the ROTATE table's choice when None."""
    q, k, v, dout = make_inputs(1, 2, 1, 300, 300, 128, BF16, seed=3)
    out, lse = forward_reference(q, k, v, False, 0.1)
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    mk = _mod().BackwardPlan
    assert mk(q, k, v, out, lse, dout, *grads, causal=False, scale=0.1, deterministic=False, rotate=True).rotate
    assert not mk(q, k, v, out, lse, dout, *grads, causal=False, scale=0.1, deterministic=True, rotate=True).rotate
    default = mk(q, k, v, out, lse, dout, *grads, causal=False, scale=0.1, deterministic=False)
    assert default.rotate == _mod().ROTATE[(128, False)]


def test_launch_events_bracket_the_three_kernels():
    """benchmark()'s breakdown: launch(events=...) records four events in order, and the gradients
    are the same as without them."""
    q, k, v, dout = make_inputs(1, 4, 2, 500, 400, 128, BF16, seed=5)
    scale = 1.0 / math.sqrt(128)
    out, lse = forward_reference(q, k, v, True, scale)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    plan = _mod().BackwardPlan(q, k, v, out, lse, dout, *grads, causal=True, scale=scale, deterministic=False)
    events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(4))
    plan.launch(q, k, v, out, lse, dout, *grads, events=events)
    torch.cuda.synchronize()
    times = [events[i].elapsed_time(events[i + 1]) for i in range(3)]
    assert all(t > 0 for t in times), f"pre / main / convert times {times}"
    assert_close(grads, reference_grads(q, k, v, dout, True, scale), BF16, "launch with events")


# ---- small cases that compute-sanitizer re-runs (memcheck / racecheck / synccheck / initcheck) ---
# Few and small (racecheck is slow on wgmma kernels): each dQ mode (REDs, ordered bulk, unordered
# bulk), causal and not, both head dims, edge blocks (Nq, Nk not multiples of the tiles).
# Ids name the dQ mode first (atomic = REDs, det = ordered bulk, bulk = unordered bulk), so that
# `-k det` / `-k bulk` select a mode. Run 6 / 7's racecheck flagged the lse2 bulk copy (UBLKCP) against
# the lse2 ld.shared of an earlier use of the same ring slot (WAR) in the det-causal and bulk cases:
# the cases with a slot reused (3 query tiles, 2 stages). The `empty` barrier is now arrived on by
# every MMA thread after its own reads; the atomic 130x129 case has the same slot reuse in mode 0.
@pytest.mark.sanitize
@pytest.mark.parametrize(
    "nq,nk,d,dtype,causal,deterministic,bulk",
    [
        pytest.param(33, 17, 64, BF16, True, False, False, id="atomic-causal-d64-33x17"),
        pytest.param(17, 70, 128, FP16, False, True, False, id="det-d128-17x70"),
        pytest.param(130, 129, 128, BF16, True, True, False, id="det-causal-d128-130x129"),
        pytest.param(130, 129, 128, BF16, False, False, True, id="bulk-d128-130x129"),
        pytest.param(130, 129, 128, BF16, False, False, False, id="atomic-d128-130x129"),
        pytest.param(130, 256, 128, BF16, False, False, True, id="bulk-d128-130x256"),
        pytest.param(400, 300, 64, FP16, True, True, False, id="det-causal-d64-400x300"),
        # d = 256 (the role-split layout): 3 query tiles on 2 ring stages (slot reuse), edge key block.
        pytest.param(130, 100, 256, BF16, True, False, False, id="atomic-causal-d256-130x100"),
        pytest.param(130, 129, 256, FP16, False, True, False, id="det-d256-130x129"),
    ],
)
def test_sanitize_small(nq, nk, d, dtype, causal, deterministic, bulk):
    # explicit: the defaults' dQ mode differs by head dim (d = 256: 64-query tiles, REDs)
    config = _mod().Sm90BwdConfig(64 if d == 256 else 8192 // d, 2, bulk)
    check_case(1, 2, 1, nq, nk, d, dtype, causal, deterministic=deterministic, seed=1, config=config)


# ---- CUDA-graph capture of the three launches --------------------------------------------------------
def test_cuda_graph_capture():
    dtype, d, causal = BF16, 128, True
    q, k, v, dout = make_inputs(1, 4, 2, 300, 300, d, dtype, seed=9)
    scale = 1.0 / math.sqrt(d)
    out, lse = forward_reference(q, k, v, causal, scale)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    plan = _mod().BackwardPlan(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale, deterministic=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (loads kernels, encodes tensor maps) outside capture
        plan.launch(q, k, v, out, lse, dout, dq, dk, dv)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.launch(q, k, v, out, lse, dout, dq, dk, dv)
    for t in (dq, dk, dv):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close((dq, dk, dv), reference_grads(q, k, v, dout, causal, scale), dtype, "sm90 cuda graph replay")


# ---- end to end through tileattn.attention's autograd, with the dispatcher routed here -------------
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_end_to_end_autograd(d, deterministic, monkeypatch):
    """What the lead's routing will do: dispatch.attention_backward_plan returns this module's plan
    (same call as the sm80 one); the public op's forward + backward then match float64 autograd."""
    import tileattn.api
    from tileattn import attention
    from tileattn.kernels import dispatch

    monkeypatch.setattr(dispatch, "attention_backward_plan", _mod().backward_plan)
    monkeypatch.setattr(tileattn.api, "_plans", {})  # no plan entry made before the patch
    dtype, causal = BF16, True
    q, k, v, dout = make_inputs(2, 8, 2, 500, 700, d, dtype, layout="bnhd", seed=21)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with poisoned_allocations():  # outputs, gradients and workspaces all start as NaN
        out = attention(qg, kg, vg, causal=causal, deterministic=deterministic)
        out.backward(dout)
    refs = reference_grads(q, k, v, dout, causal, 1.0 / math.sqrt(d))
    assert_close((qg.grad, kg.grad, vg.grad), refs, dtype, f"tileattn.attention -> sm90 backward det={deterministic}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_autograd_runs_the_benchmarked_plan(d, causal, monkeypatch):
    """What `tileattn bench attention --backward-only` times is what attention_bwd_sm90.benchmark's
    sm90 column times: through the real dispatcher, the autograd backward of dense [B, H, N, d]
    inputs builds this module's plan with the same config, block order and walk, copies nothing
    (no TMA-incompatible operand, no dO contiguity copy) and launches only its three kernels."""
    import tileattn.api
    from tileattn import attention

    monkeypatch.setattr(tileattn.api, "_plans", {})  # only this call's plan entry
    dtype, scale = BF16, 1.0 / math.sqrt(d)
    q, k, v = (torch.randn(2, 4, 1000, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    torch.autograd.grad(out, (q, k, v), dout)
    plans = [p for e in tileattn.api._plans.values() for p in e.backward.values()]
    assert len(plans) == 1 and isinstance(plans[0], _mod().BackwardPlan), \
        f"the autograd backward ran {plans} instead of one sm90 plan (dispatcher routing?)"
    plan = plans[0]
    lse = torch.empty(2, 4, 1000, device="cuda", dtype=torch.float32)
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    direct = _mod().BackwardPlan(q.detach(), k.detach(), v.detach(), out.detach(), lse, dout, *grads,
                                 causal=causal, scale=scale, deterministic=False)
    for attr in ("config", "section", "rotate", "nq_pad", "copy", "copy_dk", "copy_dv"):
        assert getattr(plan, attr) == getattr(direct, attr), f"{attr}: autograd {getattr(plan, attr)} vs " \
                                                             f"benchmark {getattr(direct, attr)}"
    assert plan.copy == (False,) * 4 and not plan.copy_dk and not plan.copy_dv, "a copy in the autograd path"


def _route_backward_here(monkeypatch):
    import tileattn.api
    from tileattn.kernels import dispatch

    monkeypatch.setattr(dispatch, "attention_backward_plan", _mod().backward_plan)
    monkeypatch.setattr(tileattn.api, "_plans", {})


def test_torch_compile_fullgraph_forward_backward(monkeypatch):
    from tileattn import attention

    _route_backward_here(monkeypatch)
    dtype, d, causal = BF16, 128, True
    q, k, v, dout = make_inputs(1, 4, 2, 257, 300, d, dtype, seed=8)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return attention(q, k, v, causal=causal)

    torch._dynamo.reset()
    torch.compile(f, fullgraph=True)(qg, kg, vg).backward(dout)
    refs = reference_grads(q, k, v, dout, causal, 1.0 / math.sqrt(d))
    assert_close((qg.grad, kg.grad, vg.grad), refs, dtype, "torch.compile forward + sm90 backward")


def test_cuda_graph_forward_backward_through_the_api(monkeypatch):
    from tileattn import attention

    _route_backward_here(monkeypatch)
    dtype, d, causal = BF16, 64, False
    q, k, v, dout = make_inputs(2, 4, 4, 300, 300, d, dtype, seed=12)
    sq, sk, sv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    sdout = dout.clone()

    def step():
        for t in (sq, sk, sv):
            t.grad = None
        attention(sq, sk, sv, causal=causal).backward(sdout)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: plans, kernels, tensor maps outside the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for t in (sq, sk, sv):
        t.grad = None
    with torch.cuda.graph(graph):
        attention(sq, sk, sv, causal=causal).backward(sdout)
    grads = (sq.grad, sk.grad, sv.grad)
    for seed in (13, 14):  # new data in the captured buffers, replayed
        q2, k2, v2, dout2 = make_inputs(2, 4, 4, 300, 300, d, dtype, seed=seed)
        with torch.no_grad():
            for dst, src in ((sq, q2), (sk, k2), (sv, v2), (sdout, dout2)):
                dst.copy_(src)
        for g in grads:
            g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        refs = reference_grads(q2, k2, v2, dout2, causal, 1.0 / math.sqrt(d))
        assert_close(grads, refs, dtype, f"CUDA graph forward + sm90 backward replay {seed}")
