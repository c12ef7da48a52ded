"""GPU tests of the sm_80-path attention backward (tileattn.kernels.attention_bwd_sm80.launch_backward).

The kernels are called directly, with out and lse computed by tileattn.reference in float64 (out
then cast to the input dtype), so these tests do not depend on the forward kernel. Gradients are
compared with torch autograd through tileattn.reference in float64 on the same quantized inputs,
by relative error ||g - ref|| / ||ref|| (plus a tiny absolute floor for gradients that vanish
exactly, e.g. dq and dk when every query sees a single key).

Tolerances. The kernel rounds P and dS to the input dtype before their tensor-core products (as
FlashAttention-2 does), and computes D = rowsum(dO * O) from the rounded output. With a unit
roundoff u (bf16: 2^-8, fp16: 2^-11) each of these is a relative perturbation of about u / sqrt(3)
RMS per element that does not cancel, so the relative gradient error is a small multiple of
u / sqrt(3): about 2.5e-3 for bf16 and 3e-4 for fp16 in a lane-level emulation of the kernels on
random inputs (worst seen 3.5e-3 and 3.4e-4). The bounds below leave 3x (bf16) and 10x (fp16)
headroom: bf16 1e-2, fp16 3e-3. Extreme logits (|scores| ~ 1e4) add the fp32 resolution of
scores and lse at that magnitude (ulp ~ 1e-3, so P is off by up to ~1e-3 relative); emulation
gives 5.3e-3 (bf16) and 8.3e-4 (fp16), inside the same bounds.

Every output is poisoned with NaN before each launch, so an element the kernels forget to write
fails the comparison.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tileattn.reference import attention as reference_attention

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}
# Absolute floor (RMS per element, before the tolerance: the error may reach TOL x ATOL) for
# gradients that are exactly 0 in exact math: with a single visible key P = 1, so dS = dP - D = 0
# and dq, dk are pure rounding noise (dP and D are the same fp32 dot product summed in different
# orders). Its size grows with d and the number of queries summed into a dk row: measured on the
# H200 (2026-12-02, B=1 H=Hkv=2 Nq=300 Nk=1, dk RMS per element) 3.4e-6 at d=128 and 6.7e-6 at
# d=256 in fp16, 1.8e-6 / 4.4e-6 in bf16, bitwise the same in the sm80 and the sm90 backward. The
# inputs are unit normal, so a real gradient is ~0.1..1 per element and this floor never masks one.
ATOL = 1e-2
BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture(scope="module", autouse=True)
def _warm_compile_cache():
    """Compile every registered backward instantiation in parallel processes up front (NVRTC is
    single-threaded and holds the GIL); the tests then only load cubins from the disk cache."""
    if not torch.cuda.is_available() or os.environ.get("TILEATTN_SANITIZER"):
        return  # under compute-sanitizer the cache is already warm, and child processes crash racecheck
    from tileattn.kernels.attention_bwd_sm80 import precompile

    precompile()


def _bwd():
    from tileattn.kernels import attention_bwd_sm80

    return attention_bwd_sm80


def make_inputs(batch, heads, kv_heads, nq, nk, d, dtype, *, layout="bhnd", seed=0):
    """Fresh random q, k, v, dout on the GPU. layout 'bnhd': stored [B, N, H, d] and viewed as
    [B, H, N, d] through transpose(1, 2) (non-contiguous, no copy)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(b, h, n):
        if layout == "bnhd":
            return torch.randn(b, n, h, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
        return torch.randn(b, h, n, d, device="cuda", generator=g).to(dtype)

    q = rnd(batch, heads, nq)
    k = rnd(batch, kv_heads, nk)
    v = rnd(batch, kv_heads, nk)
    dout = rnd(batch, heads, nq)
    return q, k, v, dout


def forward_reference(q, k, v, causal, scale):
    """out in the input dtype and lse in fp32, from the float64 reference."""
    out64, lse64 = reference_attention(q, k, v, causal, scale, compute_dtype=torch.float64)
    return out64.to(q.dtype), lse64.to(torch.float32).contiguous()


def reference_grads(q, k, v, dout, causal, scale):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = reference_attention(q64, k64, v64, causal, scale, compute_dtype=torch.float64)
    out.backward(dout.double())
    return q64.grad, k64.grad, v64.grad


def run_backward(q, k, v, dout, *, causal, scale, deterministic, out=None, lse=None, config=None):
    if out is None:
        out, lse = forward_reference(q, k, v, causal, scale)
    dq = torch.full_like(q, float("nan"))
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    _bwd().launch_backward(
        q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale, deterministic=deterministic, config=config
    )
    torch.cuda.synchronize()
    return dq, dk, dv


def rel_err(g, ref) -> float:
    g, ref = g.double(), ref.double()
    floor = ATOL * math.sqrt(ref.numel())
    return float((g - ref).norm() / max(float(ref.norm()), floor))


def assert_close(grads, refs, dtype, what, tol=None):
    tol = TOL[dtype] if tol is None else tol
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert torch.isfinite(g).all(), f"{what}: {name} has NaN/inf (unwritten or overflowed elements)"
        err = rel_err(g, r)
        assert err <= tol, f"{what}: {name} relative error {err:.3e} > {tol:.1e}"


def check_case(batch, heads, kv_heads, nq, nk, d, dtype, causal, *, deterministic=False, layout="bhnd", scale=None,
               seed=0, config=None):
    q, k, v, dout = make_inputs(batch, heads, kv_heads, nq, nk, d, dtype, layout=layout, seed=seed)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    grads = run_backward(q, k, v, dout, causal=causal, scale=scale, deterministic=deterministic, config=config)
    refs = reference_grads(q, k, v, dout, causal, scale)
    what = (f"B={batch} H={heads} Hkv={kv_heads} Nq={nq} Nk={nk} d={d} {dtype} causal={causal} "
            f"det={deterministic} layout={layout} cfg={config.name if config else 'default'}")
    assert_close(grads, refs, dtype, what)
    return grads, refs


# ---- every head dim x dtype x causal, moderate length, GQA 2 ------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
def test_head_dims(d, dtype, causal):
    check_case(2, 4, 2, 129, 129, d, dtype, causal, seed=d)


# ---- lengths Nq = Nk in {1, 17, 127, 128, 129, 1000, 4097} (small B*H at big N) ---------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "n,d,dtype",
    [
        (1, 128, BF16),
        (1, 64, FP16),
        (17, 128, BF16),
        (17, 32, FP16),
        (127, 128, FP16),
        (128, 128, BF16),
        (128, 256, FP16),
        (129, 96, BF16),
        (1000, 128, BF16),
        (1000, 64, FP16),
        (4097, 128, BF16),
        (4097, 64, FP16),
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
        (4097, 129, 32, FP16),
        (200, 333, 96, FP16),
        (333, 200, 256, BF16),
        (300, 1, 256, FP16),  # dk, dq exactly 0: the ATOL floor's largest measured noise
    ],
)
def test_nq_ne_nk(nq, nk, d, dtype, causal):
    check_case(1, 2, 2, nq, nk, d, dtype, causal, seed=nq * 7 + nk)


# ---- GQA ratios 1, 4, 8 ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_gqa(heads, kv_heads, dtype, causal):
    check_case(2, heads, kv_heads, 257, 190, 128, dtype, causal, seed=heads * 10 + kv_heads)


# ---- non-contiguous q, k, v, dout ([B, N, H, d] viewed through transpose(1, 2)) --------------------
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("d,dtype,causal", [(128, BF16, True), (64, FP16, False), (96, BF16, False)])
def test_non_contiguous(d, dtype, causal, deterministic):
    q, _, _, _ = make_inputs(1, 4, 2, 8, 8, d, dtype, layout="bnhd")
    assert not q.is_contiguous() and q.stride(-1) == 1
    check_case(2, 4, 2, 300, 211, d, dtype, causal, deterministic=deterministic, layout="bnhd", seed=d)


def test_non_default_scale():
    check_case(1, 2, 1, 150, 150, 64, BF16, True, scale=0.37, seed=5)


# ---- extreme logits (|scores| ~ 1e4) ---------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_extreme_logits(dtype, causal, deterministic):
    """Scores around +-1e4 through a row-constant shift (every key has component 0 equal to 8, every
    query a large component 0), so softmax stays non-degenerate and gradients are O(1). The other
    components are small half-integers, so Q K^T is exact in fp32 and the only extra error is the
    fp32 resolution of scores and lse at 1e4."""
    g = torch.Generator(device="cuda").manual_seed(11)
    b, h, nq, nk, d = 1, 2, 300, 257, 64
    q = torch.randint(-4, 5, (b, h, nq, d), device="cuda", generator=g) / 2
    k = torch.randint(-4, 5, (b, h, nk, d), device="cuda", generator=g) / 2
    v = torch.randn(b, h, nk, d, device="cuda", generator=g)
    dout = torch.randn(b, h, nq, d, device="cuda", generator=g)
    sign = torch.randint(0, 2, (b, h, nq), device="cuda", generator=g) * 2 - 1
    q[..., 0] = (4096 + 512 * torch.randint(0, 8, (b, h, nq), device="cuda", generator=g)) * sign
    k[..., 0] = 8
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    scale = 0.25  # scores = 0.25 * 8 * q0 + O(10): |scores| in [8192, 15360]
    out, lse = forward_reference(q, k, v, causal, scale)
    finite = lse[torch.isfinite(lse)].abs()
    assert finite.min() > 5000, "the test must actually produce extreme logits"
    grads = run_backward(q, k, v, dout, causal=causal, scale=scale, deterministic=deterministic, out=out, lse=lse)
    refs = reference_grads(q, k, v, dout, causal, scale)
    assert_close(grads, refs, dtype, f"extreme logits {dtype} causal={causal} det={deterministic}")


# ---- fully masked rows (causal, Nq > Nk): zero gradients there, no NaN anywhere -------------------
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("nq,nk,d", [(200, 17, 128), (70, 3, 64), (5, 1, 256), (1000, 129, 32)])
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
    assert_close(grads, refs, dtype, f"fully masked rows Nq={nq} Nk={nk} d={d} det={deterministic}")


# ---- deterministic mode --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "nq,nk,d,dtype,causal,heads,kv_heads",
    [(1000, 1000, 128, BF16, True, 8, 2), (517, 300, 64, FP16, False, 4, 4), (300, 517, 256, BF16, True, 2, 1)],
)
def test_deterministic_bit_identical(nq, nk, d, dtype, causal, heads, kv_heads):
    q, k, v, dout = make_inputs(2, heads, kv_heads, nq, nk, d, dtype, seed=3)
    scale = 1.0 / math.sqrt(d)
    out, lse = forward_reference(q, k, v, causal, scale)
    first = run_backward(q, k, v, dout, causal=causal, scale=scale, deterministic=True, out=out, lse=lse)
    second = run_backward(q, k, v, dout, causal=causal, scale=scale, deterministic=True, out=out, lse=lse)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"deterministic {name} differs between two runs"
    atomic = run_backward(q, k, v, dout, causal=causal, scale=scale, deterministic=False, out=out, lse=lse)
    for name, a, b in zip(("dq", "dk", "dv"), first, atomic):
        err = rel_err(a, b)
        assert err <= TOL[dtype], f"deterministic vs atomic {name}: {err:.3e}"
    # dk and dv never use atomics: identical in both modes.
    assert torch.equal(first[1], atomic[1]) and torch.equal(first[2], atomic[2])
    assert_close(first, reference_grads(q, k, v, dout, causal, scale), dtype, "deterministic vs reference")


# ---- every tuning candidate is correct ----------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_tuning_candidates(dtype, causal):
    for cfg in _bwd().tuning_candidates(128, causal, dtype):
        for deterministic in (False, True):
            check_case(1, 4, 2, 333, 290, 128, dtype, causal, deterministic=deterministic, config=cfg, seed=7)


# ---- small cases that compute-sanitizer re-runs (memcheck / racecheck / synccheck / initcheck) ---
@pytest.mark.sanitize
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk,d,dtype", [(33, 17, 64, BF16), (17, 70, 128, FP16), (5, 40, 96, BF16)])
def test_sanitize_small(nq, nk, d, dtype, causal, deterministic):
    check_case(1, 2, 1, nq, nk, d, dtype, causal, deterministic=deterministic, seed=1)


# ---- launch on a side stream and under CUDA-graph capture ------------------------------------------
def test_cuda_graph_capture():
    dtype, d, causal = BF16, 128, True
    q, k, v, dout = make_inputs(1, 4, 2, 300, 300, d, dtype, seed=9)
    scale = 1.0 / math.sqrt(d)
    out, lse = forward_reference(q, k, v, causal, scale)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    bwd = _bwd()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (loads kernels) outside capture
        bwd.launch_backward(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale, deterministic=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bwd.launch_backward(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale, deterministic=False)
    for t in (dq, dk, dv):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close((dq, dk, dv), reference_grads(q, k, v, dout, causal, scale), dtype, "cuda graph replay")


# ---- end to end through the public API and torch autograd -------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_end_to_end_autograd(deterministic):
    from tileattn import attention

    from .conftest import poisoned_allocations

    dtype, d, causal = BF16, 128, True
    q, k, v, dout = make_inputs(2, 8, 2, 500, 700, d, dtype, layout="bnhd", seed=21)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with poisoned_allocations():  # outputs, gradients and workspaces all start as NaN
        out = attention(qg, kg, vg, causal=causal, deterministic=deterministic)
        out.backward(dout)
    refs = reference_grads(q, k, v, dout, causal, 1.0 / math.sqrt(d))
    assert_close((qg.grad, kg.grad, vg.grad), refs, dtype, f"tileattn.attention backward det={deterministic}")
