"""GPU tests of the attention forward (csrc/attention_fwd_sm80.cu) against tileattn.reference.

Every comparison is against the float64 reference computed from the *same quantized inputs*
(q, k, v already rounded to fp16/bf16), so the only error left is the kernel's own: P is rounded
to the input dtype before the P @ V tensor-core product (relative 2^-9 for bf16, 2^-12 for fp16
per element, averaging out over the keys) plus fp32 accumulation and ex2.approx. A lane-level CPU
emulation of the kernel measured ||out - ref|| / ||ref|| of about 2.5e-3 (bf16) and 3e-4 (fp16);
the tolerances below leave 4-7x headroom. lse is checked in absolute terms scaled by its size
(its error is fp32 rounding of the scores and the row sum).

Outputs are poisoned with NaN before every launch (the launch layer gets NaN-filled out/lse; on the
API path every torch.empty* the op calls returns NaN: tests/gpu/conftest.py) so an unwritten
element fails.
Inputs are fresh random draws (seeded per test for reproducibility), never zeros or ones.

Markers: `gpu` (all), `sanitize` (small cases re-run under compute-sanitizer by make gpu-check).
Runtime on an H200: the first run compiles each instantiation once (about 40 NVRTC compiles;
cached on disk afterwards); the tests themselves take well under a minute.
"""

from __future__ import annotations

import contextlib
import math
import zlib

import pytest
import torch

import tileattn
from tileattn import reference

from .conftest import poisoned_allocations

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
# Relative error bounds ||out - ref|| / ||ref|| (see the module docstring for why).
TOL = {BF16: 1e-2, FP16: 2e-3}
HEAD_DIMS = (32, 64, 96, 128, 256)


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
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), f"{what}: NaN in out (unwritten or NaN-producing)"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    err = rel_err(out, ref)
    tol = TOL[q.dtype] if tol is None else tol
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:g}"
    # lse: -inf exactly where the reference has -inf (fully masked rows), close elsewhere.
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{what}: lse -inf pattern differs from the reference"
    if seen.any():
        diff = (lse.double() - ref_lse)[seen].abs()
        bound = 2e-4 * (1.0 + ref_lse[seen].abs())
        assert bool((diff <= bound).all()), f"{what}: lse error {diff.max().item():.3e}"
    if (~seen).any():  # rows that see no key: exactly 0, and lse -inf
        assert bool((out[~seen] == 0).all()), f"{what}: fully masked rows must be 0"
        assert bool((lse[~seen] == float("-inf")).all())
    return err


def launch(q, k, v, causal, scale, config=None, out=None):
    """Launch layer directly, with NaN-poisoned outputs."""
    from tileattn.kernels.attention_fwd_sm80 import launch_forward

    if out is None:
        out = torch.full_like(q, float("nan"))
    else:
        out.fill_(float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda", dtype=torch.float32)
    launch_forward(q, k, v, out, lse, causal=causal, scale=scale, config=config)
    return out, lse


def api(q, k, v, causal, scale=None):
    """The public op, with every tensor it allocates poisoned (tests/gpu/conftest.py)."""
    with poisoned_allocations():
        out, lse = tileattn.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    return out, lse


# ---------------------------------------------------------------------------------------------
# The main grid: every head dim x causal x dtype x shapes (N in {1, 17, 127, 128, 129, 1000,
# 4097}, Nq != Nk both ways, GQA ratios 1, 4, 8). Small B*H for the big N keeps it fast.
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
    seed = zlib.crc32(repr((d, causal, str(dtype), shape)).encode())  # stable across processes
    q, k, v = make_qkv(b, h, hkv, nq, nk, d, dtype, seed)
    scale = 1.0 / math.sqrt(d)
    out, lse = launch(q, k, v, causal, scale)
    check(out, lse, q, k, v, causal, scale, what="launch layer")
    out2, lse2 = api(q, k, v, causal)
    check(out2, lse2, q, k, v, causal, scale, what="api")
    if _api_family(d, causal, dtype) == "attention_fwd_sm80":
        # The API ran the same kernel on the same inputs: bitwise reproducible.
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


def _api_family(d, causal, dtype) -> str:
    """The forward family tileattn.attention runs for these arguments on this GPU."""
    from tileattn.kernels import dispatch
    from tileattn.runtime import device_arch

    return dispatch.forward_family(device_arch(torch.cuda.current_device()), dtype, d, causal)


@pytest.mark.sanitize
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_small_for_sanitizer(d, causal):
    """Small irregular shapes: partial Q tile, partial K/V edge block, GQA, fully masked rows."""
    q, k, v = make_qkv(1, 4, 2, 70, 45, d, BF16, seed=d + causal)
    out, lse = launch(q, k, v, causal, 0.1)
    check(out, lse, q, k, v, causal, 0.1, what="small")


@pytest.mark.sanitize
def test_single_query_single_key():
    for causal in (False, True):
        q, k, v = make_qkv(1, 1, 1, 1, 1, 128, FP16, seed=7)
        out, lse = launch(q, k, v, causal, 0.3)
        torch.testing.assert_close(out.float(), v.float().expand_as(out), rtol=0, atol=0)  # softmax of one key = 1
        ref_lse = 0.3 * (q.double() * k.double()).sum(-1)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Layouts: [B, N, H, d] seen through transpose(1, 2), d-padded buffers, non-contiguous out
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
    out, lse = api(q, k, v, causal)
    assert out.stride() == q.stride()  # the output keeps the [B, N, H, d] memory layout
    check(out, lse, q, k, v, causal, 1 / math.sqrt(d), what="transposed")
    # Launch layer with a transposed (non-contiguous) output buffer too.
    out_t = torch.empty(b, nq, h, d, device="cuda", dtype=dtype).transpose(1, 2)
    out2, lse2 = launch(q, k, v, causal, 1 / math.sqrt(d), out=out_t)
    check(out2, lse2, q, k, v, causal, 1 / math.sqrt(d), what="transposed out")


@pytest.mark.parametrize("d", [64, 96, 128])
def test_sliced_padded_buffers(d):
    """q, k, v are slices of wider buffers: row pitch d + 24 elements (16-byte aligned)."""
    g = _gen(d)
    qb = torch.randn(2, 4, 150, d + 24, device="cuda", generator=g).to(BF16)
    kvb = torch.randn(2, 2, 2, 333, d + 24, device="cuda", generator=g).to(BF16)
    q, k, v = qb[..., 8:8 + d], kvb[0][..., :d], kvb[1][..., 16:16 + d]
    for causal in (False, True):
        out, lse = api(q, k, v, causal)
        check(out, lse, q, k, v, causal, 1 / math.sqrt(d), what="padded")


def test_huge_kv_row_stride_falls_back_to_a_copy():
    from tileattn.kernels.attention_fwd_sm80 import MAX_KV_ROW_STRIDE

    d, nk = 64, 3
    base = torch.randn(nk * MAX_KV_ROW_STRIDE // d + 1, d, device="cuda").to(BF16)  # ~2^24 * 3 elements
    k = base.as_strided((1, 1, nk, d), (0, 0, MAX_KV_ROW_STRIDE, 1))
    q = torch.randn(1, 1, 5, d, device="cuda").to(BF16)
    out, lse = api(q, k, k, False)
    check(out, lse, q, k, k, False, 1 / math.sqrt(d), what="huge stride")


def test_misaligned_pointer_is_rejected_before_launch():
    buf = torch.randn(4 * 64 * 64 + 8, device="cuda").to(BF16)
    q = buf[1:1 + 4 * 64 * 64].view(1, 4, 64, 64)
    k = buf[8:8 + 4 * 64 * 64].view(1, 4, 64, 64)
    with pytest.raises(ValueError, match="16-byte aligned"):
        tileattn.attention(q, k, k)


# ---------------------------------------------------------------------------------------------
# Numerics: extreme logits, fully masked rows, scale
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_extreme_logits(d, causal, dtype):
    """Scores around 1e4 (q, k scaled by 100): no overflow, no NaN, still the right softmax.
    The softmax is then nearly one-hot, so fp32 rounding of the ~1e4 scores (~1e-3 absolute)
    can move weight between near-tied keys: tolerance 2e-2."""
    q, k, v = make_qkv(1, 4, 2, 200, 300, d, dtype, seed=d + 17 * causal, scale_inputs=100.0)
    scale = 1.0 / math.sqrt(d)
    ref, _ = reference.attention(q, k, v, causal=causal, scale=scale, compute_dtype=torch.float64)
    scores = scale * (q.double()[:, :2] @ k.double()[:, :1].transpose(-1, -2))
    assert scores.abs().max().item() > 3e3  # the case really is extreme
    out, lse = launch(q, k, v, causal, scale)
    check(out, lse, q, k, v, causal, scale, tol=2e-2, what="extreme")


@pytest.mark.parametrize("d", [32, 128, 256])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_fully_masked_rows(d, dtype):
    """Causal with Nq > Nk: query i sees key j iff j <= i + Nk - Nq, so rows i < Nq - Nk see
    nothing: out exactly 0, lse -inf, and never NaN. Spans whole fully-masked query tiles (the
    kernel's early exit) and tiles that mix masked and unmasked rows."""
    nq, nk = 700, 150
    q, k, v = make_qkv(2, 2, 1, nq, nk, d, dtype, seed=d)
    out, lse = launch(q, k, v, True, 0.2)
    masked = nq - nk
    assert bool((out[:, :, :masked] == 0).all())
    assert bool((lse[:, :, :masked] == float("-inf")).all())
    assert bool(torch.isfinite(lse[:, :, masked:]).all())
    check(out, lse, q, k, v, True, 0.2, what="masked rows")


def test_custom_scale_and_lse_units():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, FP16, seed=3)
    out, lse = api(q, k, v, False, scale=0.37)
    check(out, lse, q, k, v, False, 0.37, what="scale")
    # lse is the natural-log log-sum-exp of the scaled scores.
    s = 0.37 * (q.double() @ k.double().transpose(-1, -2))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, dim=-1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("d", [64, 128])  # the Hopper forward on sm_90a, the sm80 kernel elsewhere
def test_calls_without_lse_share_one_unread_buffer(d):
    """A forward that needs no lse (no autograd, return_lse=False) writes it into the plan entry's own
    buffer instead of a fresh allocation: outputs stay right call after call, and calls that return
    lse still get fresh tensors, never that buffer."""
    from tileattn import api as api_module

    q, k, v = make_qkv(2, 4, 2, 77, 131, d, BF16, seed=11)
    q2 = make_qkv(2, 4, 2, 77, 131, d, BF16, seed=12)[0]
    ref, ref_lse = reference.attention(q, k, v, causal=True, compute_dtype=torch.float64)
    ref2 = reference.attention(q2, k, v, causal=True, compute_dtype=torch.float64)[0]
    api_module.clear_plans()
    with poisoned_allocations():
        out1 = tileattn.attention(q, k, v, causal=True)
        out2 = tileattn.attention(q2, k, v, causal=True)
        out3, lse3 = tileattn.attention(q, k, v, causal=True, return_lse=True)
    (entry,) = api_module._plans.values()
    assert entry.unread_lse is not None, "the no-lse calls did not use the entry's buffer"
    assert lse3.data_ptr() != entry.unread_lse.data_ptr(), "a returned lse aliases the shared buffer"
    for name, out, r in (("first", out1, ref), ("second", out2, ref2), ("with lse", out3, ref)):
        assert not torch.isnan(out).any(), f"{name} call: NaN in out"
        assert rel_err(out, r) <= TOL[BF16], f"{name} call: relative error {rel_err(out, r):.3e}"
    torch.testing.assert_close(lse3.double(), ref_lse, rtol=2e-4, atol=2e-4)


# ---------------------------------------------------------------------------------------------
# Every registered tile configuration (what the tuning benchmark may pick)
# ---------------------------------------------------------------------------------------------
def _all_candidates():
    from tileattn.kernels import attention_fwd_sm80 as af

    out = []
    for d in HEAD_DIMS:
        for causal in (False, True):
            for dtype in (BF16, FP16):
                for cfg in af.tuning_candidates(d, causal, dtype):
                    out.append((d, causal, dtype, cfg))
    return out


@pytest.mark.parametrize("d,causal,dtype,cfg", _all_candidates(), ids=lambda x: str(x))
def test_every_registered_config(d, causal, dtype, cfg):
    for (nq, nk) in ((1, 1), (200, 333), (333, 200)):
        q, k, v = make_qkv(1, 4, 2, nq, nk, d, dtype, seed=nq + d)
        out, lse = launch(q, k, v, causal, 1 / math.sqrt(d), config=cfg)
        check(out, lse, q, k, v, causal, 1 / math.sqrt(d), what=f"{cfg}")


# ---------------------------------------------------------------------------------------------
# torch.compile and CUDA graphs
# ---------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph():
    q, k, v = make_qkv(2, 8, 2, 257, 300, 128, BF16, seed=5)

    def f(q, k, v):
        return tileattn.attention(q, k, v, causal=True).float().sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    got = compiled(q, k, v)
    ref, _ = reference.attention(q, k, v, causal=True, compute_dtype=torch.float64)
    assert rel_err(got, ref.sum(-1)) <= 2e-2
    # New data of the same shape reuses the graph and still matches.
    q2, k2, v2 = make_qkv(2, 8, 2, 257, 300, 128, BF16, seed=6)
    got2 = compiled(q2, k2, v2)
    ref2, _ = reference.attention(q2, k2, v2, causal=True, compute_dtype=torch.float64)
    assert rel_err(got2, ref2.sum(-1)) <= 2e-2


def test_torch_compile_fullgraph_with_backward():
    pytest.importorskip("tileattn.kernels.attention_bwd_sm80")
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, 100, 130, 64, BF16, seed=8))

    def loss(q, k, v):
        return (tileattn.attention(q, k, v, causal=True).float() ** 2).sum()

    torch._dynamo.reset()
    torch.compile(loss, fullgraph=True)(q, k, v).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad.float()).all() for t in (q, k, v))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch.compile"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_autocast_runs_float32_inputs_in_the_autocast_dtype(dtype, compiled):
    """float32 q, k, v under torch.autocast("cuda", dtype): out comes back in that dtype and matches
    float64 attention of the inputs rounded to it; the gradients reach the float32 leaves (in float32)
    and match float64 autograd on the rounded inputs (the cast's gradient is the identity)."""
    pytest.importorskip("tileattn.kernels.attention_bwd_sm80")
    q, k, v = (t.float() for t in make_qkv(2, 4, 2, 127, 129, 64, dtype, seed=21))  # exactly representable
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(2, 4, 127, 64, device="cuda", generator=_gen(22)).to(dtype)

    def run(q, k, v):
        with torch.autocast("cuda", dtype=dtype):
            return tileattn.attention(q, k, v, causal=True)

    torch._dynamo.reset()
    fn = torch.compile(run, fullgraph=True) if compiled else run
    with contextlib.nullcontext() if compiled else poisoned_allocations():  # (poisoning patches torch.empty)
        out = fn(*leaves)
        assert out.dtype == dtype
        out.backward(dout)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = reference.attention(q64, k64, v64, causal=True, compute_dtype=torch.float64)
    ref.backward(dout.double())
    assert rel_err(out.detach(), ref.detach()) <= 2e-2
    for name, leaf, want in zip("qkv", leaves, (q64.grad, k64.grad, v64.grad)):
        assert leaf.grad.dtype == torch.float32, name
        assert rel_err(leaf.grad, want) <= 2e-2, f"d{name}: relative error {rel_err(leaf.grad, want):.3e}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_graph_capture_and_replay(causal):
    shape = (2, 8, 2, 300, 500, 128)
    q, k, v = make_qkv(*shape, BF16, seed=21)
    static_q, static_k, static_v = q.clone(), k.clone(), v.clone()
    # Warm up on a side stream (compiles and loads the kernel outside the capture).
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tileattn.attention(static_q, static_k, static_v, causal=causal, return_lse=True)
    torch.cuda.current_stream().wait_stream(s)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = tileattn.attention(static_q, static_k, static_v, causal=causal, return_lse=True)

    for seed in (22, 23):
        nq, nk, nv = make_qkv(*shape, BF16, seed=seed)
        static_q.copy_(nq)
        static_k.copy_(nk)
        static_v.copy_(nv)
        static_out.fill_(float("nan"))
        static_lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(static_out, static_lse, nq, nk, nv, causal, 1 / math.sqrt(128), what=f"graph replay {seed}")
