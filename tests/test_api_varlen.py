"""CPU tests of tileattn.api_varlen.attention_varlen: argument checks, the varlen kernel registry,
the backward's workspace row map, and the custom ops' fake implementations and autograd wiring.

Nothing here needs a GPU: the checks run on CPU and meta tensors (metadata errors are reported for
CPU tensors before the "must be CUDA tensors" error), and shapes are checked with FakeTensorMode.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from tileattn.api_varlen import attention_varlen
from tileattn.kernels import attention_bwd_sm80, attention_fwd_sm80, family

BF16, FP16 = torch.bfloat16, torch.float16


def packed(lens_q=(5, 0, 11), lens_k=(7, 3, 11), h=4, hkv=2, d=64, dtype=BF16, device="cpu"):
    """q [Tq, H, d], k, v [Tk, Hkv, d], cu_seqlens_q / cu_seqlens_k int32, max lengths."""
    def offsets(lens):  # plain Python: the helper also runs under FakeTensorMode
        out = [0]
        for n in lens:
            out.append(out[-1] + n)
        return torch.tensor(out, dtype=torch.int32, device=device)

    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    q = torch.randn(sum(lens_q), h, d, dtype=dtype, device=device)
    k = torch.randn(sum(lens_k), hkv, d, dtype=dtype, device=device)
    v = torch.randn(sum(lens_k), hkv, d, dtype=dtype, device=device)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def raises(match, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        attention_varlen(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Argument checks, in the documented order
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("index,name", [(0, "q"), (1, "k"), (2, "v"), (3, "cu_seqlens_q"), (4, "cu_seqlens_k")])
def test_not_a_tensor(index, name):
    args = list(packed())
    args[index] = [1, 2, 3]
    raises(rf"^{name} must be a torch.Tensor, got list", *args)


@pytest.mark.parametrize("index,name", [(0, "q"), (1, "k"), (2, "v")])
def test_rank_of_packed_tensors(index, name):
    args = list(packed())
    args[index] = args[index].unsqueeze(0)
    raises(rf"^{name} must be rank-3 \[T", *args)


@pytest.mark.parametrize("index,name", [(3, "cu_seqlens_q"), (4, "cu_seqlens_k")])
def test_rank_of_cu_seqlens(index, name):
    args = list(packed())
    args[index] = args[index].view(1, -1)
    raises(rf"^{name} must be rank-1 \[B \+ 1\]", *args)


def test_dtypes():
    q, k, v, cq, ck, mq, mk = packed()
    raises(r"^q has dtype torch.float32", q.float(), k, v, cq, ck, mq, mk)
    raises(r"^q, k, v must share one dtype", q, k.half(), v, cq, ck, mq, mk)
    raises(r"^cu_seqlens_q must be int32, got torch.int64", q, k, v, cq.long(), ck, mq, mk)
    raises(r"^cu_seqlens_k must be int32, got torch.int64", q, k, v, cq, ck.long(), mq, mk)


def test_shapes():
    q, k, v, cq, ck, mq, mk = packed()
    raises(r"^k and v must have the same shape", q, k, v[:, :1], cq, ck, mq, mk)
    raises(r"^head dims differ: q has d=64, k and v have d=32", q, k[..., :32], v[..., :32], cq, ck, mq, mk)
    raises(r"^q head dim d=80 is not supported", q[..., :80].new_zeros(q.shape[0], 4, 80),
           k.new_zeros(k.shape[0], 2, 80), v.new_zeros(v.shape[0], 2, 80), cq, ck, mq, mk)
    raises(r"^k/v heads Hkv=3 must divide q heads H=4", q, k.new_zeros(k.shape[0], 3, 64),
           v.new_zeros(v.shape[0], 3, 64), cq, ck, mq, mk)
    raises(r"^q and k need at least one head", q[:, :0], k[:, :0], v[:, :0], cq, ck, mq, mk)
    raises(r"^cu_seqlens_q and cu_seqlens_k must both be \[B \+ 1\], got 4 and 3", q, k, v, cq, ck[:3], mq, mk)
    raises(r"^cu_seqlens_q must hold B \+ 1 >= 2 offsets", q, k, v, cq[:1], ck[:1], mq, mk)


def test_grid_limit_on_heads():
    q = torch.empty(2, 65536, 32, dtype=BF16, device="meta")
    k = torch.empty(2, 1, 32, dtype=BF16, device="meta")
    cu = torch.tensor([0, 2], dtype=torch.int32, device="meta")
    raises(r"^q has H=65536 heads", q, k, k, cu, cu, 2, 2)


def test_grid_limit_on_sequences_and_the_token_budget():
    """B + 1 offsets index the grid's y dimension (65535 at most); Tq + 132 B + 3 rows of the backward's
    workspace and Tk must stay below 2^31 (meta tensors: no memory)."""
    q = torch.empty(2, 4, 32, dtype=BF16, device="meta")
    k = torch.empty(2, 2, 32, dtype=BF16, device="meta")
    cu = torch.empty(65536, dtype=torch.int32, device="meta")
    raises(r"^B=65535 sequences; the launch grid allows at most 65534", q, k, k, cu, cu, 2, 2)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    big = torch.empty(2**31, 1, 32, dtype=BF16, device="meta")
    raises(r"^q has Tq=2 and k Tk=2147483648 tokens; Tq \+ 132 B \+ 3 and Tk must be below 2\^31",
           q[:, :1], big, big, cu, cu, 2, 2)


@pytest.mark.parametrize("bad", [True, 3.0, "7", torch.tensor(7)])
def test_max_seqlen_must_be_a_host_int(bad):
    q, k, v, cq, ck, mq, mk = packed()
    raises(r"^max_seqlen_q must be an int", q, k, v, cq, ck, bad, mk)
    raises(r"^max_seqlen_k must be an int", q, k, v, cq, ck, mq, bad)


def test_max_seqlen_range():
    q, k, v, cq, ck, mq, mk = packed()
    raises(r"^max_seqlen_q=-1 must be in \[0, 16\]", q, k, v, cq, ck, -1, mk)
    raises(r"^max_seqlen_k=22 must be in \[0, 21\]", q, k, v, cq, ck, mq, 22)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_scale(scale):
    raises(r"^scale must be finite and > 0", *packed(), scale=scale)


@pytest.mark.parametrize("scale", ["0.1", [0.1], {}])  # the unhashable ones escaped as a TypeError before
def test_bad_scale_type(scale):
    raises(r"^scale must be a positive finite number or None", *packed(), scale=scale)


def test_layout_checks():
    q, k, v, cq, ck, mq, mk = packed(d=64)
    raises(r"^q must have a contiguous last dim", q.transpose(1, 2).contiguous().transpose(1, 2)[..., :64],
           k, v, cq, ck, mq, mk)
    wide = torch.randn(q.shape[0], 4, 68, dtype=BF16)[..., :64]  # token/head strides 272 / 68: 68 % 8 != 0
    raises(r"^q.stride\(1\) = 68 is not a multiple of 8", wide, k, v, cq, ck, mq, mk)
    tok = torch.randn(q.shape[0], 1, 68, dtype=BF16)[..., :64]  # one head: only the token stride counts
    raises(r"^q.stride\(0\) = 68 is not a multiple of 8", tok, k[:, :1], v[:, :1], cq, ck, mq, mk)
    cq2 = torch.zeros(8, dtype=torch.int32)[::2]
    raises(r"^cu_seqlens_q must be contiguous", q, k, v, cq2, ck, mq, mk)


def test_padded_rows_pass_layout_checks():
    """q, k, v slices of wider [T, H, d + 8] buffers: strides multiples of 8, so only the device fails."""
    q, k, v, cq, ck, mq, mk = packed()
    qb = torch.randn(q.shape[0], 4, 72, dtype=BF16)[..., 8:]
    raises(r"^q, k, v, cu_seqlens_q, cu_seqlens_k must be CUDA tensors", qb, k, v, cq, ck, mq, mk)


def test_devices_differ():
    q, k, v, cq, ck, mq, mk = packed()
    raises(r"^q, k, v, cu_seqlens_q, cu_seqlens_k must be on one device, got q cpu, k meta", q, k.to("meta"), v, cq,
           ck, mq, mk)


def test_cpu_tensors_need_cuda():
    raises(r"^q, k, v, cu_seqlens_q, cu_seqlens_k must be CUDA tensors .*got device cpu", *packed())


# ---------------------------------------------------------------------------------------------
# Registry: every varlen table entry is registered, and nothing else of the varlen entry points
# ---------------------------------------------------------------------------------------------
def test_forward_varlen_instantiations_are_exactly_the_table():
    fam = family("attention_fwd_sm80")
    used = set()
    for arch in ("sm_90a", "sm_80", "sm_86"):
        for d in attention_fwd_sm80.HEAD_DIMS:
            for causal in (False, True):
                for bf16 in (False, True):
                    cfg = attention_fwd_sm80.default_varlen_config(d, causal, arch)
                    expr = attention_fwd_sm80.expression(d, cfg, causal, bf16, varlen=True)
                    assert fam.require(expr) == expr
                    used.add(expr)
    varlen = {e for e in fam.instantiations if e.startswith("tileattn::attention_fwd_varlen_sm80<")}
    assert used == varlen
    # The d=128 causal override (the dense 128x64 tile spills in the varlen kernel on sm_90a).
    assert attention_fwd_sm80.default_varlen_config(128, True, "sm_90a") == attention_fwd_sm80.FwdConfig(128, 48, 4, 2)


def test_backward_varlen_instantiations_cover_the_table():
    fam = family("attention_bwd_sm80")
    for arch in ("sm_90a", "sm_80"):
        for d in attention_bwd_sm80.HEAD_DIMS:
            for causal in (False, True):
                cfg = attention_bwd_sm80.default_config(d, causal, arch, varlen=True)
                for bf16 in (False, True):
                    for expr in (cfg.main_expr(bf16, True, True), cfg.main_expr(bf16, False, True),
                                 cfg.dq_expr(bf16, True), attention_bwd_sm80.preprocess_expr(d, bf16, True),
                                 attention_bwd_sm80.convert_expr(d, bf16, True)):
                        assert "_varlen_kernel<" in expr
                        assert fam.require(expr) == expr
    # A device with an A100's shared memory gets the small d=256 config, registered too.
    small = attention_bwd_sm80.default_config(256, True, "sm_90a", max_smem=163 * 1024, varlen=True)
    fam.require(small.main_expr(True, True, True))


def test_varlen_d128_forward_compiles_without_spills_for_sm90a():
    """Smoke test of the varlen benchmark instantiation (`tileattn check` covers all of them)."""
    from tileattn.runtime import compile_cuda

    fam = family("attention_fwd_sm80")
    cfg = attention_fwd_sm80.default_varlen_config(128, True, "sm_90a")
    expr = attention_fwd_sm80.expression(128, cfg, True, True, varlen=True)
    res = compile_cuda(fam.path, [expr], "sm_90a").resources[expr]
    assert res.spills == 0 and res.stack_bytes == 0, res


# ---------------------------------------------------------------------------------------------
# The backward's workspace rows (csrc/attention_bwd_sm80.cu, ws_row / seq_nq_pad)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lens", [(1,), (0, 0, 5), (129, 0, 1, 127, 128, 1000), (1, 1, 130, 2, 3),
                                  tuple(range(0, 300, 7))])
def test_workspace_rows_of_sequences_never_overlap(lens):
    """Sequence b's workspace rows [roundup(cu[b], 4) + 132 b, + roundup(n_b, 128)) (what its query
    blocks read and add into without bounds checks) start 16-byte aligned (the kernel cp.asyncs 4
    floats of lse2 / delta at a time), are disjoint from every other sequence's, and end inside a
    head's ws_pitch rows."""
    gap = attention_bwd_sm80.VARLEN_WS_GAP
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    pitch = -(-cu[-1] // 4) * 4 + gap * len(lens)
    assert pitch % 4 == 0
    spans = []
    for b, n in enumerate(lens):
        start = ((cu[b] + 3) & ~3) + gap * b
        assert start % 4 == 0
        spans.append((start, start + -(-n // 128) * 128))
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0, (a0, a1, b0, b1)
    assert spans[-1][1] <= pitch


# ---------------------------------------------------------------------------------------------
# Custom ops: fake implementations, torch.compile tracing, autograd wiring
# ---------------------------------------------------------------------------------------------
def test_ops_are_registered():
    assert hasattr(torch.ops.tileattn, "attention_varlen_fwd")
    assert hasattr(torch.ops.tileattn, "attention_varlen_bwd")


@pytest.mark.parametrize("causal", [False, True])
def test_fake_shapes_and_dtypes(causal):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v, cq, ck, mq, mk = packed(lens_q=(30, 70), lens_k=(50, 20), h=8, hkv=2, d=128, device="cuda")
        out, lse = attention_varlen(q, k, v, cq, ck, mq, mk, causal=causal, return_lse=True)
        assert out.shape == (100, 8, 128) and out.dtype == BF16 and out.device.type == "cuda"
        assert lse.shape == (8, 100) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert isinstance(attention_varlen(q, k, v, cq, ck, mq, mk), torch.Tensor)  # no lse unless asked


def test_torch_compile_fullgraph_traces_one_opaque_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v, cq, ck):
        return attention_varlen(q, k, v, cq, ck, 40, 40, causal=True, scale=0.125) * 2

    compiled = torch.compile(f, backend=capture, fullgraph=True)
    with FakeTensorMode():
        q, k, v, cq, ck, _, _ = packed(lens_q=(33, 7), lens_k=(40, 7), h=4, hkv=1, d=64, device="cuda")
        out = compiled(q, k, v, cq, ck)
        assert out.shape == q.shape
    code = graphs[0].code
    assert len(re.findall(r"tileattn\.attention_varlen_fwd", code)) == 1, code


def test_autograd_wiring_on_meta_tensors():
    """The op's backward calls tileattn::attention_varlen_bwd (its fake runs on meta)."""
    q, k, v, cq, ck, mq, mk = packed(device="meta")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = torch.ops.tileattn.attention_varlen_fwd(q, k, v, cq, ck, mq, mk, True, 0.125, False)
    assert out.requires_grad and not lse.requires_grad
    assert lse.shape == (q.shape[1], q.shape[0])
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert q.grad.dtype == BF16


def test_default_scale_is_inverse_sqrt_d():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        args = packed(d=96, device="cuda")
        gm = make_fx(lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck, args[5], args[6]))(*args[:5])
    assert repr(1 / math.sqrt(96)) in gm.code
