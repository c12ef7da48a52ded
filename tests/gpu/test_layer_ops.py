"""GPU tests of the decoder layer's fused steps (csrc/layer_ops.cu through tileattn.api_layers)
against float64 formulas and against the same ops' torch path run on CPU copies (which rounds
where the kernels do, so the two agree to a few 16-bit ulps)."""

from __future__ import annotations

import pytest
import torch

from tileattn import api_layers

from ..test_layer_ops_cpu import norm_rotary64, rel, rms_norm64, rotary_tables
from .conftest import poisoned_allocations

pytestmark = pytest.mark.gpu
DTYPES = [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)]


def assert_within_ulps(got, want, ulps=2):
    """got and want (16-bit, same dtype) agree to `ulps` units in the last place of each element,
    or of the tensor's largest magnitude / 8 for elements near zero (a rotary output that cancels
    to ~0 inherits its inputs' last-place differences, not its own)."""
    eps = torch.finfo(want.dtype).eps
    got, want = got.float().cpu(), want.float().cpu()
    tolerance = ulps * eps * torch.maximum(want.abs(), want.abs().max() / 8)
    worst = ((got - want).abs() - tolerance).max()
    assert worst <= 0, f"kernel and torch path differ by more than {ulps} ulps (excess {worst:.3g})"


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("tokens, dim", [(1, 8), (31, 1024), (33, 4096), (127, 2048), (129, 5120), (1000, 896),
                                         (4, 32768), (4097, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, tol, tokens, dim, with_residual):
    torch.manual_seed(tokens * dim)
    x = (3 * torch.randn(tokens, dim, device="cuda")).to(dtype)
    w = (1 + 0.1 * torch.randn(dim, device="cuda")).to(dtype)
    r = torch.randn(tokens, dim, device="cuda").to(dtype) if with_residual else None
    r_before = None if r is None else r.clone()
    with poisoned_allocations():
        got = api_layers.add_rms_norm(x, w, 1e-5, residual=r)
    if with_residual:
        got, r_out = got
        assert r_out is r and torch.equal(r, x + r_before), "residual must become the rounded x + residual"
        want_cpu = api_layers.add_rms_norm(x.cpu(), w.cpu(), 1e-5, residual=r_before.cpu())[0]
        want64 = rms_norm64(x + r_before, w, 1e-5)
    else:
        want_cpu = api_layers.add_rms_norm(x.cpu(), w.cpu(), 1e-5)
        want64 = rms_norm64(x, w, 1e-5)
    assert not got.isnan().any(), "unwritten output"
    assert rel(got, want64) < tol, f"relative error {rel(got, want64):.2e} against float64"
    assert_within_ulps(got, want_cpu)


def test_add_rms_norm_strided_rows_and_extreme_values():
    big = torch.randn(64, 2 * 1024, device="cuda", dtype=torch.bfloat16)
    x = big[:, :1024]  # row stride 2048
    x[0] = 3e4
    x[1] = 1e-30
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    got = api_layers.add_rms_norm(x, w, 1e-6)
    assert got.isfinite().all()
    assert rel(got, rms_norm64(x, w, 1e-6)) < 1e-2


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("tokens", [1, 33, 1000])
def test_norm_rotary_in_a_fused_qkv_view(dtype, tol, head_dim, norm, tokens):
    q_heads, kv_heads = 8, 2
    torch.manual_seed(head_dim + tokens)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    x = qkv[:, :(q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)  # q and k heads
    v_before = qkv[:, (q_heads + kv_heads) * head_dim:].clone()
    cos, sin = (t.cuda() for t in rotary_tables(4096, head_dim))
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    qw = kw = None
    if norm:
        qw = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(dtype)
        kw = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(dtype)
    before = x.clone()
    want_cpu = api_layers.norm_rotary_(before.cpu(), positions.cpu(), cos.cpu(), sin.cpu(), q_heads,
                                       None if qw is None else qw.cpu(), None if kw is None else kw.cpu())
    want64 = norm_rotary64(before, positions, cos, sin, q_heads, qw, kw)
    api_layers.norm_rotary_(x, positions, cos, sin, q_heads, qw, kw)
    assert rel(x, want64) < tol, f"relative error {rel(x, want64):.2e}"
    assert_within_ulps(x, want_cpu, ulps=4 if norm else 2)  # the norm's rsqrt differs by an ulp on CPU
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim:], v_before), "v columns must be untouched"


def test_norm_rotary_leaves_out_of_range_positions_alone():
    cos, sin = (t.cuda() for t in rotary_tables(16, 64))
    x = torch.randn(4, 3, 64, device="cuda", dtype=torch.bfloat16)
    before = x.clone()
    api_layers.norm_rotary_(x, torch.tensor([-1, 16, 3, 1 << 40], device="cuda"), cos, sin)
    assert torch.equal(x[[0, 1, 3]], before[[0, 1, 3]])
    assert not torch.equal(x[2], before[2])


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("tokens, width", [(1, 8), (33, 3072), (129, 14336), (1000, 4864), (4097, 64)])
def test_silu_mul(dtype, tol, tokens, width):
    x = (4 * torch.randn(tokens, 2 * width, device="cuda")).to(dtype)
    with poisoned_allocations():
        got = api_layers.silu_mul(x)
    g, u = x.double().split(width, -1)
    assert not got.isnan().any()
    assert rel(got, g * torch.sigmoid(g) * u) < tol
    assert_within_ulps(got, api_layers.silu_mul(x.cpu()))


@pytest.mark.sanitize
def test_small_cases_for_the_sanitizers():
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    api_layers.add_rms_norm(x, torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-5, residual=r)
    cos, sin = (t.cuda() for t in rotary_tables(8, 64))
    q = torch.randn(3, 4, 64, device="cuda", dtype=torch.float16)
    w = torch.ones(64, device="cuda", dtype=torch.float16)
    api_layers.norm_rotary_(q, torch.tensor([0, 7, 9], device="cuda"), cos, sin, 2, w, w)
    api_layers.silu_mul(torch.randn(3, 16, device="cuda", dtype=torch.float16))
    torch.cuda.synchronize()


def test_captured_in_a_cuda_graph_and_replayed():
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    api_layers.add_rms_norm(x, w, 1e-5)  # plan built outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = api_layers.silu_mul(api_layers.add_rms_norm(x, w, 1e-5))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, api_layers.silu_mul(api_layers.add_rms_norm(x, w, 1e-5))) == 0


def test_kernel_path_rejects_layouts_it_cannot_read():
    with pytest.raises(ValueError, match="multiple of 8"):
        api_layers.add_rms_norm(torch.randn(2, 12, device="cuda", dtype=torch.bfloat16),
                                torch.ones(12, device="cuda", dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="contiguous last dim"):
        x = torch.randn(16, 4, device="cuda", dtype=torch.bfloat16).t()
        api_layers.silu_mul(x)
    with pytest.raises(ValueError, match="on"):
        api_layers.add_rms_norm(torch.randn(2, 16, device="cuda", dtype=torch.bfloat16), torch.ones(16), 1e-5)

