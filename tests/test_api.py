"""CPU tests of tileattn.attention's public surface: argument checks, the forward kernel registry,
config selection, and the custom op's fake (meta) implementation and autograd wiring.

Nothing here needs a GPU: the checks run on CPU and meta tensors (see the order of checks in
tileattn/api.py: metadata errors are reported for CPU tensors before the "needs a CUDA tensor"
error), and shapes are checked with FakeTensorMode / meta tensors.
"""

from __future__ import annotations

import contextlib
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import tileattn
from tileattn import api
from tileattn.kernels import attention_fwd_sm80, family

BF16, FP16 = torch.bfloat16, torch.float16


def qkv(b=2, h=4, hkv=2, nq=16, nk=24, d=64, dtype=BF16, device="cpu"):
    q = torch.randn(b, h, nq, d, dtype=dtype, device=device)
    k = torch.randn(b, hkv, nk, d, dtype=dtype, device=device)
    v = torch.randn(b, hkv, nk, d, dtype=dtype, device=device)
    return q, k, v


def raises(match, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        tileattn.attention(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Argument checks, in the documented order
# ---------------------------------------------------------------------------------------------
def test_public_surface():
    assert set(tileattn.__all__) >= {"__version__", "attention", "attention_paged", "write_kv_cache"}
    assert isinstance(tileattn.__version__, str)
    assert not torch.cuda.is_initialized()  # importing tileattn must not initialise CUDA


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_not_a_tensor(name):
    args = dict(zip("qkv", qkv()))
    args[name] = args[name].float().numpy()
    raises(rf"^{name} must be a torch.Tensor", args["q"], args["k"], args["v"])


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_rank(name):
    args = dict(zip("qkv", qkv()))
    args[name] = args[name][0]
    raises(rf"^{name} must be rank-4", args["q"], args["k"], args["v"])


@pytest.mark.parametrize("name,dim", [("q", 0), ("q", 1), ("q", 2), ("k", 2), ("v", 0), ("q", 3)])
def test_empty_dimension(name, dim):
    args = dict(zip("qkv", qkv()))
    t = args[name]
    args[name] = t.narrow(dim, 0, 0)
    raises(rf"^{name} has an empty dimension", args["q"], args["k"], args["v"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.float8_e4m3fn])
def test_unsupported_dtype_reported_for_cpu_tensors(dtype):
    q, k, v = (t.to(dtype) for t in qkv())
    raises(r"^q has dtype .*float16 and torch.bfloat16", q, k, v)


def test_mixed_dtypes():
    q, k, v = qkv()
    raises(r"^q, k, v must share one dtype", q, k.to(FP16), v)


def test_batch_mismatch():
    q, k, v = qkv()
    raises(r"^batch sizes differ", q, k[:1], v[:1])


def test_kv_shape_mismatch():
    q, k, v = qkv()
    raises(r"^k and v must have the same shape", q, k, v[:, :, :5])


def test_head_dim_mismatch():
    q, k, v = qkv(d=64)
    k2, v2 = torch.randn(2, 2, 24, 128, dtype=BF16), torch.randn(2, 2, 24, 128, dtype=BF16)
    raises(r"^head dims differ: q has d=64, k and v have d=128", q, k2, v2)


@pytest.mark.parametrize("d", [16, 48, 80, 160, 512])
def test_unsupported_head_dim(d):
    raises(r"^q head dim d=%d is not supported" % d, *qkv(d=d))


@pytest.mark.parametrize("h,hkv", [(4, 3), (6, 4), (1, 2)])
def test_kv_heads_must_divide_heads(h, hkv):
    raises(rf"^k/v heads Hkv={hkv} must divide q heads H={h}", *qkv(h=h, hkv=hkv))


def test_grid_limits_batch_and_heads():
    q, k, v = qkv(b=65536, h=1, hkv=1, nq=1, nk=1, device="meta")
    raises(r"B=65536, H=1; the launch grid allows at most 65535", q, k, v)


def test_sequence_lengths_fit_int32():
    """An expanded (stride-0) k of 2^31 keys passed every check and overflowed np.int32 at planning."""
    q, k, v = qkv(b=1, h=1, hkv=1, nq=1, nk=2**31, device="meta")
    raises(r"Nq=1 and Nk=2147483648 must be at most 2\^31 - 1", q, k, v)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan"), 1e39, 1e-47])  # the last two: inf / 0 in float32
def test_bad_scale_value(scale):
    raises(r"^scale must be finite and > 0", *qkv(), scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True, torch.tensor(0.1), [0.1], {}])  # unhashable: a TypeError before
def test_bad_scale_type(scale):
    raises(r"^scale must be a positive finite number or None", *qkv(), scale=scale)


@pytest.mark.parametrize("scale", [1, 0.1, np.float32(0.1)])
def test_good_scale_passes(scale):
    raises(r"must be CUDA tensors", *qkv(), scale=scale)  # only the device check is left


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_last_dim_must_be_contiguous(name):
    args = dict(zip("qkv", qkv()))
    t = args[name]
    args[name] = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # same shape, stride(-1) != 1
    raises(rf"^{name} must have a contiguous last dim", args["q"], args["k"], args["v"])


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_row_stride_must_be_16_byte_aligned(name):
    args = dict(zip("qkv", qkv(d=64)))
    t = args[name]
    padded = torch.randn(*t.shape[:-1], 68, dtype=t.dtype)[..., :64]  # row pitch 68 elements
    args[name] = padded
    raises(rf"^{name}.stride\(2\) = 68 is not a multiple of 8 elements.*16-byte", args["q"], args["k"], args["v"])


def test_stride_of_size_one_dims_is_ignored():
    q, k, v = qkv(b=1)
    # A size-1 batch dim may carry any stride (torch does not normalise it); it is never used.
    q = torch.as_strided(q, q.shape, (3, *q.stride()[1:]))
    raises(r"must be CUDA tensors", q, k, v)  # passes the layout checks, fails only on the device


def test_padded_rows_with_aligned_pitch_pass_layout_checks():
    buf = torch.randn(2, 4, 16, 72, dtype=BF16)  # d=64 inside a 72-wide buffer: pitch 144 bytes
    q = buf[..., :64]
    k, v = buf[:, :2, :, :64], buf[:, 2:, :, :64]
    raises(r"must be CUDA tensors", q, k, v)


def test_transposed_bnhd_layout_passes_layout_checks():
    q = torch.randn(2, 16, 4, 64, dtype=BF16).transpose(1, 2)  # [B, H, N, d] view of [B, N, H, d]
    k = torch.randn(2, 24, 2, 64, dtype=BF16).transpose(1, 2)
    raises(r"must be CUDA tensors", q, k, k)


def test_devices_differ():
    q, k, v = qkv()
    raises(r"^q, k, v must be on one device, got q cpu, k meta", q, k.to("meta"), v)


def test_cpu_tensors_need_cuda():
    raises(r"^q, k, v must be CUDA tensors .*got device cpu", *qkv())


def test_pointer_alignment_check():
    n = 2 * 4 * 16 * 64
    buf = torch.randn(n + 8, dtype=BF16)
    assert buf.data_ptr() % 16 == 0
    misaligned = buf[1:1 + n].view(2, 4, 16, 64)  # data pointer 2 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match=r"^q.data_ptr\(\) = 0x[0-9a-f]+ is not 16-byte aligned"):
        api._check_pointer("q", misaligned)
    api._check_pointer("q", buf[8:].view(2, 4, 16, 64))  # 16 bytes in: fine
    assert not api._kernel_layout_ok(misaligned)
    assert api._kernel_layout_ok(buf[8:].view(2, 4, 16, 64))
    assert not api._kernel_layout_ok(torch.ones(1, dtype=BF16).expand(2, 4, 16, 64))  # stride(-1) 0
    assert not api._kernel_layout_ok(torch.ones(2, 4, 16, 64, dtype=BF16).expand(2, 4, 16, 64).transpose(2, 3))


# ---------------------------------------------------------------------------------------------
# Registry and config selection
# ---------------------------------------------------------------------------------------------
def test_registry_builds_exactly_the_dispatched_forward_instantiations():
    """Every instantiation is the table default of some (arch, d, causal, dtype), every default is
    registered, and the tuning candidates are registered apart (compiled only by --tuning)."""
    fam = family("attention_fwd_sm80")
    assert fam.source == "attention_fwd_sm80.cu" and fam.path.exists()
    assert fam.archs == ("sm_90a", "sm_80")
    used = set()
    for arch in ("sm_90a", "sm_80", "sm_86"):
        for d in (32, 64, 96, 128, 256):
            for causal in (False, True):
                for dtype in (FP16, BF16):
                    cfg = attention_fwd_sm80.default_config(d, causal, arch)
                    expr = attention_fwd_sm80.expression(d, cfg, causal, dtype == BF16)
                    assert expr in fam.instantiations, (arch, d, causal, dtype)
                    used.add(expr)
    dense = {e for e in fam.instantiations if e.startswith("tileattn::attention_fwd_sm80<")}
    assert used == dense, "a dense instantiation no table uses is compiled for nothing"
    assert len(fam.instantiations) == len(set(fam.instantiations))
    # The H200's measured d=128 default, spelled out: a table edit that drops it fails here.
    assert "tileattn::attention_fwd_sm80<128, 128, 64, 4, 2, false, true>" in fam.instantiations
    assert fam.tuning and not set(fam.tuning) & set(fam.instantiations)
    assert all(e.endswith(", true>") for e in fam.tuning), "tuning candidates are bf16-only"


def test_every_config_is_valid_for_the_kernel():
    """The kernel's static_asserts, checked here so a bad table entry fails without a compiler."""
    tables = [(key, (cfg,)) for table in attention_fwd_sm80.DEFAULTS.values() for key, cfg in table.items()]
    for (d, _), cfgs in tables + list(attention_fwd_sm80.EXTRA_BF16.items()):
        for c in cfgs:
            rows = c.block_m // c.warps
            assert c.block_m % (16 * c.warps) == 0 and rows in (16, 32), c
            assert c.block_n % 16 == 0 and c.stages >= 2, c
            assert (rows * d // 8) % 32 == 0, c
            assert not (rows == 32 and d == 256), "O alone would need 256 registers"
            assert c.smem_bytes(d) <= 160 * 1024, "must fit an A100 (163 KB) as well as an H100/H200"


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_a_config_is_picked_for_every_case(d, causal, dtype):
    fam = family("attention_fwd_sm80")
    cfg = attention_fwd_sm80.default_config(d, causal, "sm_90a")
    expr = attention_fwd_sm80.expression(d, cfg, causal, dtype == BF16)
    assert fam.require(expr) == expr
    cands = attention_fwd_sm80.tuning_candidates(d, causal, dtype)
    assert cands[0] == cfg
    for c in cands:
        fam.require(attention_fwd_sm80.expression(d, c, causal, dtype == BF16))
    if dtype == BF16 and d in (64, 128):
        assert len(cands) > 1  # tuning candidates for the benchmarked head dims


def test_tuning_candidates_reject_bad_arguments():
    with pytest.raises(ValueError, match="head dim 80"):
        attention_fwd_sm80.tuning_candidates(80, False, BF16)
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        attention_fwd_sm80.tuning_candidates(128, False, torch.float32)
    assert attention_fwd_sm80.tuning_candidates(128, True, "bf16") == attention_fwd_sm80.tuning_candidates(128, True, BF16)


def test_config_geometry():
    c = attention_fwd_sm80.FwdConfig(128, 32, 4, 2)
    assert c.threads == 128 and c.rows_per_warp == 32
    assert c.smem_bytes(128) == 2 * 128 * (128 + 2 * 2 * 32)
    assert str(c) == "128x32/w4/s2"


def test_default_d128_compiles_without_spills_for_sm90a():
    """Smoke test of the benchmark instantiation (`tileattn check` covers all of them)."""
    from tileattn.runtime import compile_cuda

    fam = family("attention_fwd_sm80")
    expr = attention_fwd_sm80.expression(128, attention_fwd_sm80.default_config(128, False, "sm_90a"), False, True)
    mod = compile_cuda(fam.path, [expr], "sm_90a")
    res = mod.resources[expr]
    assert res.spills == 0 and res.stack_bytes == 0, res
    assert res.registers <= 255


# ---------------------------------------------------------------------------------------------
# Custom op: fake implementation, torch.compile tracing, autograd wiring
# ---------------------------------------------------------------------------------------------
def test_ops_are_registered():
    assert hasattr(torch.ops.tileattn, "attention_fwd")
    assert hasattr(torch.ops.tileattn, "attention_bwd")


@pytest.mark.parametrize("causal", [False, True])
def test_fake_shapes_dtypes_and_layout(causal):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = qkv(b=2, h=8, hkv=2, nq=100, nk=70, d=128, dtype=BF16, device="cuda")
        out, lse = tileattn.attention(q, k, v, causal=causal, return_lse=True)
        assert out.shape == (2, 8, 100, 128) and out.dtype == BF16 and out.device.type == "cuda"
        assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert out.is_contiguous()
        # A [B, N, H, d] tensor seen through transpose(1, 2): the output keeps that layout.
        qt = torch.empty(2, 100, 8, 64, dtype=FP16, device="cuda").transpose(1, 2)
        kt = torch.empty(2, 70, 2, 64, dtype=FP16, device="cuda").transpose(1, 2)
        o = tileattn.attention(qt, kt, kt)
        assert o.shape == qt.shape and o.stride() == qt.stride() and o.dtype == FP16
        assert isinstance(tileattn.attention(q, k, v), torch.Tensor)  # no lse unless asked


def test_torch_compile_fullgraph_traces_one_opaque_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v):
        return tileattn.attention(q, k, v, causal=True, scale=0.125) * 2

    compiled = torch.compile(f, backend=capture, fullgraph=True)
    with FakeTensorMode():
        q, k, v = qkv(b=1, h=4, hkv=1, nq=33, nk=40, d=64, device="cuda")
        out = compiled(q, k, v)
        assert out.shape == q.shape
    code = graphs[0].code
    assert len(re.findall(r"tileattn\.attention_fwd", code)) == 1, code


def test_autograd_wiring_on_meta_tensors():
    """The op's backward calls tileattn::attention_bwd (its fake runs on meta); lse has no grad."""
    q, k, v = (t.requires_grad_() for t in qkv(b=2, h=8, hkv=2, nq=20, nk=30, d=64, device="meta"))
    out, lse = torch.ops.tileattn.attention_fwd(q, k, v, True, 0.125, False)
    assert out.requires_grad and not lse.requires_grad
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert q.grad.dtype == BF16


def test_default_scale_is_inverse_sqrt_d():
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = qkv(d=96, device="cuda")
        gm = make_fx(lambda q, k, v: tileattn.attention(q, k, v))(q, k, v)
    assert repr(1 / math.sqrt(96)) in gm.code


def _nbhd(b, h, n, d, dtype=torch.float16):
    """[B, H, N, d] view of [N, B, H, d] storage (sequence first: K/V row stride B * H * d)."""
    return torch.empty(n, b, h, d, dtype=dtype, device="meta").permute(1, 2, 0, 3)


@pytest.mark.parametrize("kv_layout", ["both past the limit", "only k past the limit", "under the limit"])
@pytest.mark.parametrize("op", ["attention_bwd", "attention_variants_bwd", "attention_dropout_bwd"])
def test_backward_fakes_lay_out_gradients_as_the_eager_entries_plan(monkeypatch, op, kv_layout):
    """torch.compile builds the backward against the fake's strides: they must be the layouts the
    eager entry allocates (grad_specs), including dk / dv of the contiguous K / V copies an entry
    makes when a row stride is past the kernels' 32-bit offsets (copy_kv)."""
    from tileattn.kernels import dispatch

    b, h, n, d = (128, 1024, 2, 128) if kv_layout != "under the limit" else (2, 4, 8, 64)  # B*H*d = 2^24 / 2^9
    q, k, v = _nbhd(b, h, n, d), _nbhd(b, h, n, d), _nbhd(b, h, n, d)
    if kv_layout == "only k past the limit":
        v = torch.empty(b, n, h, d, dtype=torch.float16, device="meta").transpose(1, 2)
    out, dout, lse = torch.empty_like(q), torch.empty_like(q), torch.empty(b, h, n, device="meta")
    monkeypatch.setattr(api, "_check_args", lambda *a: None)  # its CUDA-device rule; the shapes are valid
    monkeypatch.setattr(dispatch, "attention_forward_plan", lambda *a, **kw: None)
    monkeypatch.setattr(dispatch, "variant_forward_plan", lambda *a, **kw: None)
    monkeypatch.setattr(dispatch, "inference_forward_differs", lambda *a: False)
    monkeypatch.setattr(torch.cuda, "device", lambda *a: contextlib.nullcontext())
    scale = 1 / math.sqrt(d)
    if op == "attention_bwd":
        entry = api._PlanEntry(q, k, v, False, scale)
        fake = torch.ops.tileattn.attention_bwd(dout, q, k, v, out, lse, False, scale, False)
    else:
        entry = api._VariantEntry(q, k, v, False, scale, (64, 0), 0.0, None, 0.0)
        tail = (None, scale, False, 64, 0, 0.0)
        if op == "attention_variants_bwd":
            fake = torch.ops.tileattn.attention_variants_bwd(dout, q, k, v, out, lse, *tail)
        else:
            rng = torch.zeros(2, dtype=torch.int64)
            fake = torch.ops.tileattn.attention_dropout_bwd(dout, q, k, v, out, lse, None, rng, scale, False, 64, 0,
                                                            0.0, 0.1)
    assert entry.copy_kv == (kv_layout != "under the limit")
    assert [(t.shape, t.stride()) for t in fake] == list(entry.grad_specs)


@pytest.mark.parametrize("transform", ["vmap", "grad"])
@pytest.mark.parametrize("which", ["plain", "softcap", "varlen"])
def test_torch_func_transforms_are_refused_clearly(transform, which):
    """Inside torch.func.vmap or torch.func.grad the ops raise NotImplementedError naming torch.func
    (they used to fail on a wrapper tensor (a shape or device error about the unwrapped view), or with
    autograd.Function's setup_context message); outside a transform the usual checks run again."""
    seqlens = torch.tensor([0, 8], dtype=torch.int32)
    op = {"plain": lambda x: tileattn.attention(x, x, x),
          "softcap": lambda x: tileattn.attention(x, x, x, softcap=30.0),
          "varlen": lambda x: tileattn.attention_varlen(x[0], x[0], x[0], seqlens, seqlens, 8, 8)}[which]
    q = torch.randn(2, 4, 8, 64, dtype=torch.float16)
    call = {"vmap": lambda: torch.func.vmap(op)(q), "grad": lambda: torch.func.grad(lambda x: op(x).float().sum())(q)}
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        call[transform]()
    with pytest.raises(ValueError):  # CPU tensors, outside a transform
        op(q)


@pytest.mark.parametrize("which", ["dense", "varlen"])
def test_use_deterministic_algorithms_selects_the_deterministic_backward(which):
    """torch.use_deterministic_algorithms(True), read when the backward runs, plans the deterministic
    backward whatever the call's own flag (the dense and the varlen _backward; the compiled path's node:
    tests/test_host_launch.py)."""
    from tileattn import api_varlen

    modes = []

    class Planned(Exception):
        pass

    def backward_plan(*args):
        modes.append(args[-1])
        raise Planned

    q = torch.randn(8, 2, 64, dtype=torch.float16)
    entry = SimpleNamespace(input_strides=(q.stride(),) * 3, out_spec=(q.shape, q.stride()),
                            lse_spec=((2, 8), (8, 1)), out_strides=q.stride(), copy_kv=False, device=q.device,
                            grad_specs=((q.shape, q.stride()),) * 3, backward_plan=backward_plan)
    lse, cu = torch.zeros(2, 8), torch.tensor([0, 8], dtype=torch.int32)
    run = {"dense": lambda: api._backward(entry, q, q, q, q, q, lse, False),
           "varlen": lambda: api_varlen._backward(entry, q, q, q, q, q, lse.t(), cu, cu, False)}[which]
    for flag in (False, True):
        torch.use_deterministic_algorithms(flag)
        try:
            with pytest.raises(Planned):
                run()
        finally:
            torch.use_deterministic_algorithms(False)
    assert modes == [False, True]


@pytest.fixture
def cuda_autocast():
    """torch.autocast("cuda")'s thread state switched on by hand (the context manager disables itself
    without a GPU), restored afterwards."""
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    yield lambda dtype: torch.set_autocast_dtype("cuda", dtype)
    torch.set_autocast_enabled("cuda", enabled)
    torch.set_autocast_dtype("cuda", dtype)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_a_call_with_a_float32_input(cuda_autocast, autocast_dtype):
    """Under CUDA autocast a call with a float32 (or float64) input runs in the autocast dtype, every
    floating input cast (a bfloat16 one included, as SDPA casts it); all-float16 / bfloat16 calls and
    integer tensors are left as they are; without autocast nothing is cast (and the dtype error stays)."""
    from tileattn.api import _autocast_inputs

    cuda_autocast(autocast_dtype)
    q32 = torch.randn(1, 2, 8, 64)
    k16, v64 = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16), torch.randn(1, 2, 8, 64, dtype=torch.float64)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    cast = _autocast_inputs(q32.requires_grad_(), k16, v64)
    assert [t.dtype for t in cast] == [autocast_dtype] * 3
    assert cast[0].grad_fn is not None, "the cast is differentiable: gradients reach the float32 input"
    half_precision = (k16, k16.half(), k16)
    assert all(a is b for a, b in zip(_autocast_inputs(*half_precision), half_precision))
    got = _autocast_inputs(q32, cu, "not a tensor")  # an integer tensor and a non-tensor: left for the checks
    assert got[0].dtype == autocast_dtype and got[1] is cu and got[2] == "not a tensor"
    # through the public ops: the dtype error gives way to the next check (these CPU tensors' device)
    with pytest.raises(ValueError, match="CUDA"):
        tileattn.attention(q32, q32, q32)
    with pytest.raises(ValueError, match="CUDA"):
        tileattn.attention(q32, q32, q32, softcap=30.0)
    with pytest.raises(ValueError, match="CUDA"):
        tileattn.attention_varlen(q32[0].transpose(0, 1), q32[0].transpose(0, 1), q32[0].transpose(0, 1), cu, cu, 8, 8)
    torch.set_autocast_enabled("cuda", False)
    assert _autocast_inputs(q32, k16, v64)[0] is q32
    with pytest.raises(ValueError, match="dtype"):
        tileattn.attention(q32, q32, q32)


@pytest.mark.parametrize("which", ["attention", "attention_varlen"])
def test_forward_mode_ad_is_refused_not_dropped(which):
    """An input with a forward-mode tangent gets a NotImplementedError (the kernels have no jvp)
    rather than a result whose tangent is silently missing; without a dual level nothing is checked."""
    import torch.autograd.forward_ad as fwad

    q = torch.randn(2, 4, 8, 64, dtype=torch.float16)
    call = {
        "attention": lambda q: tileattn.attention(q, q, q),
        "attention_varlen": lambda q: tileattn.attention_varlen(
            q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1),
            torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), 8, 8),
    }[which]
    with fwad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        call(fwad.make_dual(q, torch.ones_like(q)))
    with pytest.raises(ValueError):  # the usual checks (CPU tensors) once no tangent is involved
        call(q)


FUZZ_VALUES = [None, "x", 1.5, True, [], {}, float("nan"), -1, 10**30, object(), torch.tensor(1.0)]
FUZZ_KEYWORDS = ["causal", "scale", "return_lse", "deterministic", "window", "softcap", "alibi_slopes", "dropout_p",
                 "generator", "seed", "offset"]


@pytest.mark.parametrize("keyword", FUZZ_KEYWORDS)
def test_a_keyword_of_any_wrong_type_gets_a_value_error(keyword):
    """Each keyword of tileattn.attention and attention_varlen set to each of FUZZ_VALUES (CPU tensors:
    every argument check runs before the device check): a ValueError, never a TypeError or
    AttributeError from deeper code (an unhashable scale once escaped from the plan cache)."""
    q, k = torch.randn(1, 4, 16, 64).half(), torch.randn(1, 2, 16, 64).half()
    cu = torch.tensor([0, 16], dtype=torch.int32)
    packed = (q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous())
    for value in FUZZ_VALUES:
        with pytest.raises(ValueError):
            tileattn.attention(q, k, k, **{keyword: value})
        with pytest.raises(ValueError):
            tileattn.attention_varlen(packed[0], packed[1], packed[1], cu, cu, 16, 16, **{keyword: value})


NOT_BOOLS = ["false", "", 1, 0, 1.5, None, [], torch.tensor(True)]


@pytest.mark.parametrize("flag", ["causal", "return_lse", "deterministic"])
def test_a_flag_that_is_no_bool_is_refused_not_read_by_truthiness(flag):
    """causal="false" once ran causal attention (the string is truthy): a flag of tileattn.attention
    and attention_varlen must be True or False (numpy's bool too; SDPA's is_causal takes only bool)."""
    q, k = torch.randn(1, 4, 16, 64).half(), torch.randn(1, 2, 16, 64).half()
    cu = torch.tensor([0, 16], dtype=torch.int32)
    packed = (q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous())
    calls = (lambda **kw: tileattn.attention(q, k, k, **kw),
             lambda **kw: tileattn.attention_varlen(packed[0], packed[1], packed[1], cu, cu, 16, 16, **kw))
    for call in calls:
        for value in NOT_BOOLS:
            with pytest.raises(ValueError, match=f"^{flag} must be a bool"):
                call(**{flag: value})
        for value in (True, False, np.True_):  # accepted: the device check comes next
            with pytest.raises(ValueError, match="CUDA"):
                call(**{flag: value})


@pytest.mark.parametrize("change,match", [
    ({"softcap": ""}, "^softcap must be"), ({"softcap": []}, "^softcap must be"), ({"dropout_p": ""}, "^dropout_p must"),
    ({"dropout_p": {}}, "^dropout_p must"), ({"dropout_p": None}, "^dropout_p must"), ({"seed": "x"}, "^seed must"),
    ({"seed": 1, "offset": -1}, "^offset must"), ({"generator": 7}, "^generator must"), ({"offset": 3}, "offset needs a seed"),
])
def test_variant_arguments_read_as_off_are_still_checked(change, match):
    """The plain path took a falsy softcap or dropout_p of any type ("", [], None) as off and ignored a
    malformed generator / seed / offset when dropout_p = 0: each is named now. Off values pass."""
    q = torch.randn(1, 4, 16, 64).half()
    cu = torch.tensor([0, 16], dtype=torch.int32)
    packed = q[0].transpose(0, 1).contiguous()
    with pytest.raises(ValueError, match=match):
        tileattn.attention(q, q, q, **change)
    with pytest.raises(ValueError, match=match):
        tileattn.attention_varlen(packed, packed, packed, cu, cu, 16, 16, **change)
    for off in ({"softcap": 0.0}, {"softcap": 0}, {"dropout_p": 0}, {"seed": 3, "offset": 5}, {"seed": 3},
                {"generator": torch.Generator()}):
        with pytest.raises(ValueError, match="CUDA"):
            tileattn.attention(q, q, q, **off)


def test_dispatch_tables_swaps_and_restores_tables():
    """api.dispatch_tables: the named dispatcher tables hold the given keys within and their old
    contents after (an exception inside included); hopper_kernels_forced fills the unmeasured ones; a
    set that is not a dispatcher table is refused before anything changes."""
    from tileattn.api import dispatch_tables, hopper_kernels_forced
    from tileattn.kernels import dispatch

    table = dispatch.SM90_VARLEN_VARIANT_FORWARD
    before = set(table)
    with pytest.raises(RuntimeError, match="inside"):
        with dispatch_tables([(table, {1})]):
            assert table == {1}
            raise RuntimeError("inside")
    assert table == before
    unmeasured = [(t, set(t), implemented) for t, implemented in dispatch.UNMEASURED_SM90_TABLES]
    with hopper_kernels_forced():
        assert all(t == old | implemented for t, old, implemented in unmeasured)
    assert all(t == old for t, old, _ in unmeasured)
    with pytest.raises(ValueError, match="not a table"):
        with dispatch_tables([(table, set()), ({1, 2}, set())]):
            pass
    assert table == before
