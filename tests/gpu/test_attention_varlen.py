"""GPU tests of variable-length attention (tileattn.api_varlen.attention_varlen, the *_varlen entry
points of csrc/attention_fwd_sm80.cu and attention_bwd_sm80.cu).

Oracle: tileattn.reference.attention_varlen in float64 on the same quantized inputs (one dense
problem per sequence), and its float64 autograd for the gradients. Errors are relative,
||x - ref|| / ||ref||, with the bounds of the dense tests (tests/gpu/test_attention_fwd.py and
test_attention_bwd.py explain them): forward 1e-2 (bf16) / 2e-3 (fp16), gradients 1e-2 / 3e-3 with
an absolute floor of 1e-3 RMS for gradients that vanish exactly.

A second oracle is bitwise: a varlen batch of B equal-length sequences holds the same numbers as a
dense [B, N, H, d] batch seen through transpose(1, 2), and where both paths use the same tiles the
varlen kernels must reproduce the dense kernels' outputs (and deterministic gradients) bit for bit.
That pins every offset the varlen path adds.

Every output and workspace starts as NaN (the calls run inside conftest's poisoned_allocations),
so an element no kernel writes fails. Sequence lengths include 0 (a sequence that produces
nothing), 1, 31, 33, 127, 129 and 1000, Nq != Nk per sequence both ways (causal rows that see no
key), GQA ratios 1, 4, 8, every head dim, fp16 and bf16, and rows past cu_seqlens[B].

Markers: `gpu` (all), `sanitize` (small cases re-run under compute-sanitizer by make gpu-check).
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

from tileattn import reference
from tileattn.api_varlen import attention_varlen

from .conftest import poisoned_allocations

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
HEAD_DIMS = (32, 64, 96, 128, 256)
TOL_FWD = {BF16: 1e-2, FP16: 2e-3}
TOL_BWD = {BF16: 1e-2, FP16: 3e-3}
ATOL = 1e-3  # RMS floor for gradients that are 0 in exact math (one visible key: dS = 0)
DEVICE = "cuda"


@pytest.fixture(scope="module", autouse=True)
def _warm_compile_cache():
    """Compile the varlen backward instantiations in parallel processes up front (NVRTC holds the
    GIL); the forward's compile lazily, one per (d, causal, dtype)."""
    if not torch.cuda.is_available() or os.environ.get("TILEATTN_SANITIZER"):
        return
    from tileattn.kernels import attention_bwd_sm80

    exprs = [e for e in attention_bwd_sm80.FAMILIES[0].instantiations if "_varlen_kernel<" in e]
    attention_bwd_sm80.precompile(expressions=exprs)


HOPPER = os.environ.get("TILEATTN_TEST_HOPPER_INFERENCE") == "1"


@pytest.fixture(scope="module", autouse=True)
def _hopper_varlen_tables():
    """TILEATTN_TEST_HOPPER_INFERENCE=1: every case of this file with the Hopper varlen kernels
    switched on in the dispatcher (api.hopper_kernels_forced), wherever the device and the
    call allow."""
    if not HOPPER:
        yield
        return
    from tileattn.api import hopper_kernels_forced

    with hopper_kernels_forced():
        yield


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def offsets(lens):
    """cu_seqlens int32 on the GPU for these lengths."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)


class Case:
    """Packed q [Tq, H, d], k/v [Tk, Hkv, d] (fresh unit normals in the input dtype) and dout, plus
    `pad_q` / `pad_k` token rows past the last sequence (rows no sequence owns)."""

    def __init__(self, lens_q, lens_k, heads, kv_heads, d, dtype, seed, *, pad_q=0, pad_k=0):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        self.lens_q, self.lens_k = tuple(lens_q), tuple(lens_k)
        tq, tk = sum(lens_q) + pad_q, sum(lens_k) + pad_k
        self.q = torch.randn(tq, heads, d, device=DEVICE, generator=g).to(dtype)
        self.k = torch.randn(tk, kv_heads, d, device=DEVICE, generator=g).to(dtype)
        self.v = torch.randn(tk, kv_heads, d, device=DEVICE, generator=g).to(dtype)
        self.dout = torch.randn(tq, heads, d, device=DEVICE, generator=g).to(dtype)
        self.cu_q, self.cu_k = offsets(lens_q), offsets(lens_k)
        self.max_q, self.max_k = max(lens_q), max(lens_k)
        self.dtype = dtype
        self.what = f"lens_q={self.lens_q} lens_k={self.lens_k} H={heads} Hkv={kv_heads} d={d} {dtype}"

    def args(self):
        return self.q, self.k, self.v, self.cu_q, self.cu_k, self.max_q, self.max_k

    def run(self, causal, *, scale=None, deterministic=False, grad=False):
        """(out, lse) and, with grad, (dq, dk, dv) through the public op; all allocations poisoned."""
        q, k, v = (t.detach().requires_grad_(grad) for t in (self.q, self.k, self.v))
        with poisoned_allocations():
            out, lse = attention_varlen(q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k, causal=causal,
                                        scale=scale, return_lse=True, deterministic=deterministic)
            grads = None
            if grad:
                grads = torch.autograd.grad(out, (q, k, v), self.dout)
        torch.cuda.synchronize()
        return out.detach(), lse, grads

    def reference(self, causal, scale=None):
        """float64 (out, lse, (dq, dk, dv)) from tileattn.reference on the same quantized inputs."""
        q, k, v = (t.detach().double().requires_grad_() for t in (self.q, self.k, self.v))
        out, lse = reference.attention_varlen(q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k, causal=causal,
                                              scale=scale, return_lse=True, compute_dtype=torch.float64)
        grads = torch.autograd.grad(out, (q, k, v), self.dout.double()) if out.numel() else None
        return out.detach(), lse.detach(), grads


def rel_err(x, ref) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    floor = ATOL * math.sqrt(max(ref.numel(), 1))
    return float((x - ref).norm() / max(float(ref.norm()), floor))


def check_forward(out, lse, ref_out, ref_lse, dtype, what):
    assert out.shape == ref_out.shape and out.dtype == dtype, f"{what}: out {out.shape} {out.dtype}"
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32, f"{what}: lse {lse.shape} {lse.dtype}"
    assert not torch.isnan(out).any(), f"{what}: NaN in out (an unwritten or NaN-producing element)"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    err = rel_err(out, ref_out)
    assert err <= TOL_FWD[dtype], f"{what}: out relative error {err:.3e} > {TOL_FWD[dtype]:g}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{what}: lse -inf pattern differs from the reference"
    if seen.any():
        diff = (lse.double() - ref_lse)[seen].abs()
        bound = 2e-4 * (1.0 + ref_lse[seen].abs())
        assert bool((diff <= bound).all()), f"{what}: lse error {diff.max().item():.3e}"
    rows = (~seen).all(dim=0)  # query rows that see nothing in every head (incl. rows past cu_q[B])
    assert bool((out[rows] == 0).all()), f"{what}: rows that see no key must be exactly 0"


def check_grads(grads, refs, dtype, what):
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert g.shape == r.shape, f"{what}: {name} shape {tuple(g.shape)} != {tuple(r.shape)}"
        assert torch.isfinite(g).all(), f"{what}: {name} has NaN/inf (unwritten or overflowed elements)"
        err = rel_err(g, r)
        assert err <= TOL_BWD[dtype], f"{what}: {name} relative error {err:.3e} > {TOL_BWD[dtype]:.1e}"


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())  # stable across processes


# ---------------------------------------------------------------------------------------------
# Forward against the reference: every head dim x causal x dtype x batch shape
# ---------------------------------------------------------------------------------------------
BATCHES = {  # (lens_q, lens_k, H, Hkv)
    "ragged_mha": ((0, 1, 31, 33, 127, 129, 1000), (0, 1, 31, 33, 127, 129, 1000), 4, 4),
    "nq_ne_nk_gqa4": ((1, 33, 129, 0, 17, 127, 5), (31, 1, 127, 5, 0, 1000, 3), 8, 2),
    "decode_like_gqa8": ((1, 1, 4, 1, 33), (1000, 17, 129, 1, 33), 8, 1),
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_forward_matches_reference(d, causal, dtype, batch):
    lens_q, lens_k, h, hkv = BATCHES[batch]
    case = Case(lens_q, lens_k, h, hkv, d, dtype, seed_of(d, causal, str(dtype), batch))
    out, lse, _ = case.run(causal)
    ref_out, ref_lse, _ = case.reference(causal)
    check_forward(out, lse, ref_out, ref_lse, dtype, f"{case.what} causal={causal}")


# ---------------------------------------------------------------------------------------------
# Backward against float64 autograd (atomic and deterministic dQ)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backward_matches_reference(d, causal, dtype, deterministic):
    lens_q, lens_k, h, hkv = BATCHES["nq_ne_nk_gqa4"]
    case = Case(lens_q, lens_k, h, hkv, d, dtype, seed_of("bwd", d, causal, str(dtype)))
    out, lse, grads = case.run(causal, deterministic=deterministic, grad=True)
    ref_out, ref_lse, refs = case.reference(causal)
    what = f"{case.what} causal={causal} deterministic={deterministic}"
    check_forward(out, lse, ref_out, ref_lse, dtype, what)
    check_grads(grads, refs, dtype, what)


@pytest.mark.parametrize("batch", ["ragged_mha", "decode_like_gqa8"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_batches(batch, causal):
    lens_q, lens_k, h, hkv = BATCHES[batch]
    case = Case(lens_q, lens_k, h, hkv, 128, BF16, seed_of("bwd-batch", batch, causal))
    _, _, grads = case.run(causal, grad=True)
    _, _, refs = case.reference(causal)
    check_grads(grads, refs, BF16, f"{case.what} causal={causal}")


def test_deterministic_backward_is_bitwise_repeatable():
    lens_q, lens_k, h, hkv = BATCHES["ragged_mha"]
    case = Case(lens_q, lens_k, h, hkv, 128, BF16, seed=3)
    runs = [case.run(True, deterministic=True, grad=True)[2] for _ in range(3)]
    for other in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), f"deterministic {name} differs between runs"


# ---------------------------------------------------------------------------------------------
# Rows past the last sequence, empty batches, custom scale
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_rows_past_the_last_sequence(deterministic):
    """cu_seqlens_q[B] < Tq and cu_seqlens_k[B] < Tk (a padded token buffer): those query rows get
    out 0 and lse -inf, and the gradients of all those rows are 0."""
    case = Case((5, 0, 70), (9, 3, 64), 4, 2, 64, BF16, seed=11, pad_q=37, pad_k=200)
    out, lse, grads = case.run(True, deterministic=deterministic, grad=True)
    ref_out, ref_lse, refs = case.reference(True)
    check_forward(out, lse, ref_out, ref_lse, BF16, case.what)
    check_grads(grads, refs, BF16, case.what)
    assert bool((out[75:] == 0).all()) and bool((lse[:, 75:] == float("-inf")).all())
    dq, dk, dv = grads
    assert bool((dq[75:] == 0).all()) and bool((dk[76:] == 0).all()) and bool((dv[76:] == 0).all())


def test_all_sequences_empty():
    """Tq = 0 (every sequence empty): empty outputs, no launch; gradients of k and v are 0."""
    case = Case((0, 0), (3, 5), 4, 2, 64, BF16, seed=2)
    out, lse, grads = case.run(False, grad=True)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)
    assert grads[0].shape == (0, 4, 64)
    assert bool((grads[1] == 0).all()) and bool((grads[2] == 0).all())


def test_no_keys_at_all():
    """Tk = 0 with queries present: every query sees nothing (out 0, lse -inf, dq 0)."""
    case = Case((3, 7), (0, 0), 4, 2, 64, FP16, seed=4)
    out, lse, grads = case.run(False, grad=True)
    assert bool((out == 0).all()) and bool((lse == float("-inf")).all())
    assert bool((grads[0] == 0).all())


def test_custom_scale():
    case = Case((17, 200), (40, 150), 4, 4, 128, FP16, seed=5)
    out, lse, _ = case.run(True, scale=0.37)
    ref_out, ref_lse, _ = case.reference(True, scale=0.37)
    check_forward(out, lse, ref_out, ref_lse, FP16, case.what + " scale=0.37")


def test_saved_tensors_offloaded_to_the_cpu():
    """q, k, v as slices of one fused [T, 3H, d] projection (strided, not dense) under
    torch.autograd.graph.save_on_cpu(pin_memory=True), which hands the backward contiguous copies:
    the backward copies them back into the layout its plans were made for; gradients match float64."""
    lens = (17, 200, 33)
    case = Case(lens, lens, 4, 4, 64, BF16, seed=6)
    fused = torch.cat((case.q, case.k, case.v), dim=1)  # [T, 3H, d]
    q, k, v = (fused[:, i * 4:(i + 1) * 4].detach().requires_grad_() for i in range(3))
    assert not q.is_contiguous()
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        out = attention_varlen(q, k, v, case.cu_q, case.cu_k, case.max_q, case.max_k, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), case.dout)
    _, _, refs = case.reference(True)
    check_grads(grads, refs, BF16, case.what + " save_on_cpu")


def test_misaligned_pointer_is_rejected_before_launch():
    buf = torch.randn(64 * 4 * 64 + 8, device=DEVICE).to(BF16)
    q = buf[1:1 + 64 * 4 * 64].view(64, 4, 64)
    cu = offsets((64,))
    with pytest.raises(ValueError, match="16-byte aligned"):
        attention_varlen(q, q, q, cu, cu, 64, 64)


# ---------------------------------------------------------------------------------------------
# Bitwise against the dense kernels (equal lengths: the same numbers in both layouts)
# ---------------------------------------------------------------------------------------------
def _same_tiles(d, causal):
    """Whether the varlen forward and backward tables use the dense ones' tiles on this GPU."""
    from tileattn.kernels import attention_bwd_sm80 as B, attention_fwd_sm80 as F
    from tileattn.runtime import device_arch, device_smem_optin

    arch, index = device_arch(torch.cuda.current_device()), torch.cuda.current_device()
    fwd = F.default_config(d, causal, arch) == F.default_varlen_config(d, causal, arch)
    smem = device_smem_optin(index)
    bwd = B.default_config(d, causal, arch, max_smem=smem) == B.default_config(d, causal, arch, max_smem=smem,
                                                                                varlen=True)
    return fwd, bwd


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_equal_lengths_match_the_dense_kernels_bitwise(d, causal, monkeypatch):
    """The dense sm80 launch layers (not tileattn.attention, whose dispatcher may pick the Hopper
    kernel) on [B, N, H, d] data seen through transpose(1, 2), against the sm80 varlen kernels on the
    same memory (the dispatcher's Hopper varlen table emptied, and a fresh plan cache, for this test)."""
    from tileattn import api_varlen
    from tileattn.kernels import attention_bwd_sm80, attention_fwd_sm80, dispatch

    monkeypatch.setattr(dispatch, "SM90_VARLEN_FORWARD", set())
    monkeypatch.setattr(api_varlen, "_plans", {})

    b, n, h, hkv = 3, 300, 4, 2
    scale = 1 / math.sqrt(d)
    g = torch.Generator(device=DEVICE).manual_seed(d + causal)
    q = torch.randn(b, n, h, d, device=DEVICE, generator=g).to(BF16)  # [B, N, H, d]
    k = torch.randn(b, n + 50, hkv, d, device=DEVICE, generator=g).to(BF16)
    v = torch.randn(b, n + 50, hkv, d, device=DEVICE, generator=g).to(BF16)
    dout = torch.randn(b, n, h, d, device=DEVICE, generator=g).to(BF16)
    cu_q, cu_k = offsets((n,) * b), offsets((n + 50,) * b)
    same_fwd, same_bwd = _same_tiles(d, causal)

    qd, kd, vd, dd = (t.transpose(1, 2) for t in (q, k, v, dout))  # dense [B, H, N, d] views
    out_d = torch.full_like(qd, float("nan"))
    lse_d = torch.full((b, h, n), float("nan"), device=DEVICE)
    attention_fwd_sm80.launch_forward(qd, kd, vd, out_d, lse_d, causal=causal, scale=scale)
    grads_d = [torch.full_like(t, float("nan")) for t in (qd, kd, vd)]
    attention_bwd_sm80.launch_backward(qd, kd, vd, out_d, lse_d, dd, *grads_d, causal=causal, scale=scale,
                                       deterministic=True)
    qv, kv, vv = (t.reshape(-1, t.shape[2], d).detach().requires_grad_() for t in (q, k, v))  # same memory
    with poisoned_allocations():
        out_v, lse_v = attention_varlen(qv, kv, vv, cu_q, cu_k, n, n + 50, causal=causal, return_lse=True,
                                        deterministic=True)
        grads_v = torch.autograd.grad(out_v, (qv, kv, vv), dout.reshape(-1, h, d))
    torch.cuda.synchronize()

    out_d = out_d.transpose(1, 2).reshape(-1, h, d)
    lse_d = lse_d.permute(1, 0, 2).reshape(h, -1)
    out_v = out_v.detach()
    if same_fwd:
        assert torch.equal(out_v, out_d), f"d={d} causal={causal}: varlen out differs from the dense kernel's"
        assert torch.equal(lse_v, lse_d), f"d={d} causal={causal}: varlen lse differs from the dense kernel's"
    else:
        assert rel_err(out_v, out_d) <= TOL_FWD[BF16], f"d={d} causal={causal}: out far from the dense kernel's"
    dense = [gd.transpose(1, 2).reshape(-1, gd.shape[1], d) for gd in grads_d]
    for name, gv, gd in zip(("dq", "dk", "dv"), grads_v, dense):
        if same_fwd and same_bwd:
            assert torch.equal(gv, gd), f"d={d} causal={causal}: varlen {name} differs from the dense kernel's"
        else:
            assert rel_err(gv, gd) <= TOL_BWD[BF16], f"d={d} causal={causal}: {name} far from the dense kernel's"


# ---------------------------------------------------------------------------------------------
# torch.compile and CUDA graphs
# ---------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph_with_backward():
    case = Case((100, 0, 37), (130, 5, 37), 4, 2, 64, BF16, seed=8)
    q, k, v = (t.detach().requires_grad_() for t in (case.q, case.k, case.v))

    def loss(q, k, v, cu_q, cu_k):
        return (attention_varlen(q, k, v, cu_q, cu_k, 100, 130, causal=True).float() * case.dout.float()).sum()

    torch._dynamo.reset()
    torch.compile(loss, fullgraph=True)(q, k, v, case.cu_q, case.cu_k).backward()
    _, _, refs = case.reference(True)
    check_grads((q.grad, k.grad, v.grad), refs, BF16, "torch.compile " + case.what)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_graph_capture_and_replay_with_new_lengths(causal):
    """One graph, captured with some lengths, replayed with other lengths (same B, Tq, Tk and max
    lengths): the lengths live in the cu_seqlens device tensors the graph reads."""
    lens = [((200, 0, 56), (300, 10, 46)), ((56, 100, 100), (156, 100, 100)), ((1, 254, 1), (100, 255, 1))]
    h, hkv, d = 8, 2, 128
    first = Case(*lens[0], h, hkv, d, BF16, seed=21)
    static = [t.clone() for t in first.args()[:5]]
    max_q, max_k = 256, 300
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile and build the plan outside the capture
        attention_varlen(*static, max_q, max_k, causal=causal, return_lse=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = attention_varlen(*static, max_q, max_k, causal=causal, return_lse=True)

    for i, (lq, lk) in enumerate(lens):
        case = Case(lq, lk, h, hkv, d, BF16, seed=30 + i)
        for dst, src in zip(static, case.args()[:5]):
            dst.copy_(src)
        static_out.fill_(float("nan"))
        static_lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse, _ = case.reference(causal)
        check_forward(static_out, static_lse, ref_out, ref_lse, BF16, f"graph replay {i}: {case.what}")


# ---------------------------------------------------------------------------------------------
# Small cases that compute-sanitizer re-runs (memcheck / racecheck / synccheck / initcheck)
# ---------------------------------------------------------------------------------------------
@pytest.mark.sanitize
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_sanitize_small(d, causal, deterministic):
    case = Case((0, 1, 33, 70), (5, 0, 31, 45), 4, 2, d, BF16, seed=d + causal, pad_q=3, pad_k=2)
    out, lse, grads = case.run(causal, deterministic=deterministic, grad=True)
    ref_out, ref_lse, refs = case.reference(causal)
    what = f"{case.what} causal={causal} deterministic={deterministic}"
    check_forward(out, lse, ref_out, ref_lse, BF16, what)
    check_grads(grads, refs, BF16, what)
