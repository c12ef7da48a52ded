"""GPU tests of the decoder layer's fused steps (csrc/layer_ops.cu through tileattn.api_layers)
against float64 formulas and against the same ops' torch path run on CPU copies (which rounds
where the kernels do, so the two agree to a few 16-bit ulps)."""

from __future__ import annotations

import pytest
import torch

from tileattn import api_layers, api_paged

from ..test_layer_ops_cpu import fused_case, norm_rotary64, rel, rms_norm64, rotary_tables, split_qkv, two_step
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



# ---- norm_rotary_write_kv_cache_: the fused rotary + cache write -------------------------------

def fused_inputs(dtype, norm, tokens, q_heads, kv_heads, d, block_size, index_dtype, seed):
    """fused_case's tensors on the GPU: 2048 cache slots, 4096 positions."""
    case = fused_case(dtype, norm, tokens, q_heads, kv_heads, d, 2048 // block_size, block_size, seed, index_dtype,
                      max_positions=4096)
    return tuple(None if t is None else t.cuda() for t in case)


def run_fused(qkv, positions, cos, sin, qw, kw, caches, slots, q_heads, kv_heads, d):
    """The fused op on copies; returns (qkv, caches) after it."""
    qkv, caches = qkv.clone(), caches.clone()
    q, k, v = split_qkv(qkv, q_heads, kv_heads, d)
    api_layers.norm_rotary_write_kv_cache_(q, k, v, caches[0], caches[1], slots, positions, cos, sin, qw, kw)
    return qkv, caches


def assert_fused_equals_two_steps(inputs, q_heads, kv_heads, d, what):
    """Bitwise: q, the k/v columns of qkv (k left unrotated by the fused op, so it is compared with
    the input) and both caches, against norm_rotary_ + write_kv_cache on the GPU."""
    qkv, positions, cos, sin, qw, kw, caches, slots = inputs
    want_qkv, want_caches = two_step(qkv, positions, cos, sin, qw, kw, caches, slots, q_heads, kv_heads, d,
                                     api_paged.write_kv_cache)
    got_qkv, got_caches = run_fused(qkv, positions, cos, sin, qw, kw, caches, slots, q_heads, kv_heads, d)
    qd = q_heads * d
    bad_q = (got_qkv[:, :qd] != want_qkv[:, :qd]).any(-1).nonzero()
    assert bad_q.numel() == 0, f"{what}: q differs from norm_rotary_'s at tokens {bad_q[:8, 0].tolist()}"
    assert torch.equal(got_qkv[:, qd:], qkv[:, qd:]), f"{what}: the k or v columns of qkv were written"
    for i, name in enumerate(("k_cache", "v_cache")):
        bad = (got_caches[i] != want_caches[i]).flatten(0, 1).any(-1).any(-1).nonzero()
        assert bad.numel() == 0, f"{what}: {name} differs from write_kv_cache's at slots {bad[:8, 0].tolist()}"
    return got_qkv, got_caches


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qwen3-qk-norm"])
@pytest.mark.parametrize("q_heads, kv_heads, d", [(32, 8, 128), (16, 8, 128), (14, 2, 64), (8, 1, 256), (4, 4, 96)])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("tokens", [1, 33, 1000])
def test_norm_rotary_write_kv_cache_bitwise_vs_two_steps(dtype, tol, norm, q_heads, kv_heads, d, block_size, tokens):
    index_dtype = torch.int64 if tokens != 33 else torch.int32
    inputs = fused_inputs(dtype, norm, tokens, q_heads, kv_heads, d, block_size, index_dtype,
                          seed=tokens + d + block_size)
    what = f"{dtype} norm={norm} H={q_heads} Hkv={kv_heads} d={d} bs={block_size} T={tokens}"
    got_qkv, got_caches = assert_fused_equals_two_steps(inputs, q_heads, kv_heads, d, what)
    # And against float64, so the two paths cannot agree on a wrong answer.
    qkv, positions, cos, sin, qw, kw, caches, slots = inputs
    q, k, v = split_qkv(qkv, q_heads, kv_heads, d)
    q_want = norm_rotary64(q, positions, cos, sin, q_heads, qw, kw)
    assert rel(split_qkv(got_qkv, q_heads, kv_heads, d)[0], q_want) < tol, what
    keep = (slots >= 0) & (slots < 2048)
    if keep.any():
        s = slots[keep].long()
        k_want = norm_rotary64(k, positions, cos, sin, 0, kw, kw)[keep]  # [kept, Hkv, d]
        k_got = got_caches[0][s // block_size, s % block_size]
        assert rel(k_got, k_want) < tol, f"{what}: cached keys, relative error {rel(k_got, k_want):.2e}"
        assert torch.equal(got_caches[1][s // block_size, s % block_size], v[keep]), f"{what}: cached values"


def test_norm_rotary_write_kv_cache_positions_outside_the_table():
    """Positions -1 and P: q left alone, k written unrotated (as the two steps do), v written."""
    qkv, positions, cos, sin, qw, kw, caches, slots = fused_inputs(torch.bfloat16, True, 4, 4, 2, 64, 16,
                                                                 torch.int64, seed=5)
    slots = torch.tensor([3, 17, 40, 2047], device="cuda")
    positions = torch.tensor([-1, 4096, 7, 1 << 40], device="cuda")
    got_qkv, got_caches = assert_fused_equals_two_steps((qkv, positions, cos, sin, qw, kw, caches, slots), 4, 2, 64,
                                                        "positions outside the table")
    _, k, _ = split_qkv(qkv, 4, 2, 64)
    assert torch.equal(got_qkv[[0, 1, 3]], qkv[[0, 1, 3]]), "q of an out-of-table position was rotated"
    assert torch.equal(got_caches[0][1, 1], k[1]), "k of an out-of-table position must go to the cache as is"


@pytest.mark.sanitize
@pytest.mark.parametrize("norm", [False, True])
def test_norm_rotary_write_kv_cache_small_for_the_sanitizers(norm):
    inputs = fused_inputs(torch.float16, norm, 3, 2, 1, 64, 16, torch.int64, seed=1)
    assert_fused_equals_two_steps(inputs, 2, 1, 64, "sanitize case")
    torch.cuda.synchronize()


def test_norm_rotary_write_kv_cache_kernel_path_rejects_layouts():
    qkv, positions, cos, sin, qw, kw, caches, slots = fused_inputs(torch.bfloat16, False, 4, 4, 2, 64, 16,
                                                                 torch.int64, seed=2)
    q, k, v = split_qkv(qkv, 4, 2, 64)
    fused = api_layers.norm_rotary_write_kv_cache_
    with pytest.raises(ValueError, match="power of two"):
        fused(q, k, v, caches[0][:, :12], caches[1][:, :12], slots.clamp(max=95), positions, cos, sin)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        fused(q, k, v, caches[0], caches[1], torch.stack([slots, slots], 1)[:, 0], positions, cos, sin)
    with pytest.raises(ValueError, match="16-byte"):
        flat = torch.zeros(4 * 2 * 64 + 1, device="cuda", dtype=torch.bfloat16)
        fused(q, flat[1:].view(4, 2, 64), v, caches[0], caches[1], slots, positions, cos, sin)
    with pytest.raises(ValueError, match="one device"):
        fused(q, k, v, caches[0], caches[1], slots.cpu(), positions, cos, sin)


# ---- programmatic dependent launch (TILEATTN_PDL=1) ----------------------------------------------

def pdl_chain(x, w_qkv, norm_w, positions, cos, sin, qw, kw, caches, caches2, slots, q_heads, kv_heads, d):
    """A decode-like chain in which each of our kernels reads what the kernel just before it wrote:
    GEMM -> fused rotary + cache write -> add_rms_norm of q -> silu_mul -> write_kv_cache. With PDL
    every one of ours may start during its predecessor's tail; its griddepcontrol.wait is all that
    keeps it from reading stale data. Returns (q after rotary, normed, activation)."""
    tokens = x.shape[0]
    qkv = x @ w_qkv.t()  # [T, (H + 2 Hkv) d], cuBLAS
    q, k, v = split_qkv(qkv, q_heads, kv_heads, d)
    api_layers.norm_rotary_write_kv_cache_(q, k, v, caches[0], caches[1], slots, positions, cos, sin, qw, kw)
    normed = api_layers.add_rms_norm(q.reshape(tokens, q_heads * d), norm_w, 1e-6)  # [T, H d]
    act = api_layers.silu_mul(normed)  # [T, H d / 2]
    act_heads = act.view(tokens, -1, d)  # [T, H / 2, d]
    api_paged.write_kv_cache(act_heads, act_heads, caches2[0], caches2[1], slots)
    return q, normed, act


@pytest.mark.parametrize("tokens", [1, 33])
def test_pdl_gives_the_same_bits_eager_and_in_a_captured_graph(monkeypatch, tokens):
    """TILEATTN_PDL=1 gives the bits of plain launches: eagerly, and from a CUDA graph (PDL edges
    are captured since CUDA 12.3) replayed with three sets of new inputs, against a graph of plain
    launches replayed with the same inputs (so cuBLAS runs the same way in both). On sm_90+ the
    plans must really be PDL plans."""
    from tileattn.kernels import kv_cache, layer_ops

    q_heads, kv_heads, d, hidden, dtype = 8, 2, 128, 512, torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(tokens)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=gen)).to(dtype)

    w_qkv = rand((q_heads + 2 * kv_heads) * d, hidden, scale=hidden ** -0.5)
    norm_w, qw, kw = rand(q_heads * d, scale=0.1) + 1, rand(d, scale=0.1) + 1, rand(d, scale=0.1) + 1
    cos, sin = (t.cuda() for t in rotary_tables(4096, d))

    def fresh():
        return {"x": rand(tokens, hidden), "positions": torch.randint(0, 4096, (tokens,), device="cuda"),
                "slots": torch.randperm(1024, device="cuda")[:tokens], "caches": rand(2, 64, 16, kv_heads, d),
                "caches2": rand(2, 64, 16, q_heads // 2, d)}

    def chain(state):  # -> [q, normed, act] (the caches change in place)
        return list(pdl_chain(state["x"], w_qkv, norm_w, state["positions"], cos, sin, qw, kw, state["caches"],
                              state["caches2"], state["slots"], q_heads, kv_heads, d))

    def eager(state):
        state = {k: t.clone() for k, t in state.items()}
        return [t.clone() for t in chain(state)] + [state["caches"], state["caches2"]]

    def graph_results(inputs):
        static = {k: t.clone() for k, t in inputs[0].items()}
        chain(static)  # plans made outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain(static)
        results = []
        for state in inputs:
            for k, t in static.items():
                t.copy_(state[k])
            graph.replay()
            torch.cuda.synchronize()
            results.append([t.clone() for t in outs] + [static["caches"].clone(), static["caches2"].clone()])
        return results

    def expect_equal(got, want, what):
        for name, g, w in zip(("q", "normed", "act", "caches", "caches2"), got, want):
            assert torch.equal(g, w), f"{what}: {name} differs from the plain launches' ({(g != w).sum()} elements)"

    inputs = [fresh() for _ in range(3)]
    monkeypatch.setenv("TILEATTN_PDL", "0")
    want_eager = eager(inputs[0])
    want_graph = graph_results(inputs)

    monkeypatch.setenv("TILEATTN_PDL", "1")
    expect_equal(eager(inputs[0]), want_eager, "eager with PDL")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    for plans, family in ((layer_ops._plans, "layer_ops"), (kv_cache._plans, "kv_cache")):
        assert any(p.pdl for p in plans.values()) == hopper, f"{family}: PDL plans made: {hopper} expected"
    for i, (got, want) in enumerate(zip(graph_results(inputs), want_graph)):
        expect_equal(got, want, f"PDL graph replay {i}")
