"""GPU tests of the compiled path (src/tileattn/runtime/host_launch.cpp): it loads on the
GPU machine, serves planned combinations with results that match the float64 reference, and
declines (returns None, leaving the call to the Python path) wherever it must.

Each comparison runs the compiled call on fresh inputs that no earlier launch saw, with its outputs
filled with NaN before the launch (host_launch.set_poison through poisoned_allocations), so a result
left over in reused memory cannot pass.
"""

from __future__ import annotations

import math

import pytest
import torch

import tileattn
from tileattn import api, reference
from tileattn.runtime import host_launch

from .conftest import poisoned_allocations

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
TOL = {BF16: 1e-2, FP16: 2e-3}


def _inputs(b, h, hkv, nq, nk, d, dtype, seed, layout="bhnd"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, d))
    if layout == "bnhd":  # [B, N, H, d] storage seen through .transpose(1, 2)
        return tuple(torch.randn(s[0], s[2], s[1], s[3], device="cuda", generator=g).to(dtype).transpose(1, 2)
                     for s in shapes)
    return tuple(torch.randn(*s, device="cuda", generator=g).to(dtype) for s in shapes)


def _rel(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


api_backward = api._backward  # the real one, called through test_compiled_backward's counting wrapper


def _reference_grads(q, k, v, dout, causal):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference.attention(q64, k64, v64, causal=causal, compute_dtype=torch.float64)[0].backward(dout.double())
    return q64.grad, k64.grad, v64.grad


def _module():
    module = host_launch.wait(600)
    assert module is not None, f"the compiled path did not load: {host_launch.status()}"
    return module


def _planned(q, k, v, causal, scale=None):
    """Plan (and register) the combination of these tensors with one Python-path call on inputs of
    the same layout."""
    module = _module()
    warm = tuple(torch.randn_like(t) for t in (q, k, v))
    tileattn.attention(*warm, causal=causal, scale=scale)
    assert api._host_forward is module.forward, "no combination was registered"
    return module


def test_the_module_loads_on_the_gpu_machine():
    module = _module()
    assert "loaded" in host_launch.status()
    assert module.record_count() >= 0


# d = 32 / 96: the sm80 forward (data pointers); 64 / 128: the Hopper forward on a persistent grid
# (tensor maps and the stream's tile counter); 256: the Hopper forward, one CTA per tile.
CASES = [
    # b, h, hkv, nq, nk, d, dtype, causal, layout
    (1, 8, 8, 128, 128, 64, BF16, True, "bhnd"),
    (2, 4, 2, 77, 131, 128, BF16, True, "bhnd"),
    (2, 8, 1, 1, 1000, 128, FP16, False, "bhnd"),
    (1, 6, 3, 129, 33, 256, BF16, True, "bhnd"),
    (3, 4, 4, 31, 4097, 64, FP16, False, "bnhd"),
    (2, 4, 4, 127, 127, 32, BF16, True, "bhnd"),
    (1, 2, 1, 1000, 1000, 96, FP16, False, "bnhd"),
]


@pytest.mark.parametrize("b, h, hkv, nq, nk, d, dtype, causal, layout", CASES)
def test_compiled_forward_matches_the_reference(b, h, hkv, nq, nk, d, dtype, causal, layout):
    q, k, v = _inputs(b, h, hkv, nq, nk, d, dtype, seed=nq * 7 + nk + d, layout=layout)
    module = _planned(q, k, v, causal)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, compute_dtype=torch.float64)
    with poisoned_allocations():
        served = module.forward(q, k, v, causal, None, 1)
        assert served is not None, "a planned combination was not served by the compiled path"
        out, lse = served
        public = tileattn.attention(q, k, v, causal=causal)  # the op's own no-lse call, same path
    torch.cuda.synchronize()
    what = f"b={b} h={h}/{hkv} nq={nq} nk={nk} d={d} {dtype} causal={causal} {layout}"
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32, what
    assert not torch.isnan(out).any() and not torch.isnan(public).any(), f"{what}: NaN left in an output"
    assert _rel(out, ref) <= TOL[dtype], f"{what}: relative error {_rel(out, ref):.3e}"
    assert torch.equal(out, public), f"{what}: the public call and the direct one differ"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse finite pattern"
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=2e-4, atol=2e-4)


def test_an_explicit_scale_and_return_lse_through_the_public_op():
    q, k, v = _inputs(2, 4, 4, 200, 300, 128, BF16, seed=3)
    scale = 0.05
    _planned(q, k, v, False, scale)
    ref, ref_lse = reference.attention(q, k, v, scale=scale, compute_dtype=torch.float64)
    with poisoned_allocations():
        out, lse = tileattn.attention(q, k, v, scale=scale, return_lse=True)
    assert _rel(out, ref) <= TOL[BF16]
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("d", [64, 256])
def test_autograd_forward_through_the_compiled_path(d):
    """With inputs that require grad the op runs the compiled path's C++ autograd node (want 3),
    whose first backward of a dout layout runs tileattn.api._backward on the entry's plans (later
    ones: test_compiled_backward_matches_the_reference): gradients match float64 autograd. want 2
    returns the entry the plan cache holds."""
    q, k, v = _inputs(2, 4, 2, 150, 190, d, BF16, seed=d)
    module = _planned(q, k, v, True)
    served = module.forward(q, k, v, True, None, 2)
    assert served is not None and isinstance(served[2], api._PlanEntry)
    assert served[2] in api._plans.values(), "the compiled path returned an entry the plan cache does not hold"
    dout = torch.randn_like(q)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with poisoned_allocations():
        out = tileattn.attention(qg, kg, vg, causal=True)
        assert out.grad_fn.name() == "tileattn::AttentionBackward", \
            f"the compiled path's autograd node did not run: {out.grad_fn.name()}"
        out.backward(dout)
    for name, got, want in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), _reference_grads(q, k, v, dout, True)):
        assert _rel(got, want) <= 2e-2, f"{name}: relative error {_rel(got, want):.3e}"


# The backward's families on the H200: d = 32 / 96 the sm80 backward (pointers; its deterministic mode
# has a dQ kernel instead of the accumulator), 64 / 128 / 256 the Hopper backward (tensor maps; its
# deterministic mode zeroes semaphores per call).
BACKWARD_CASES = [
    # b, h, hkv, nq, nk, d, causal, deterministic, layout
    (2, 4, 2, 150, 190, 64, True, False, "bhnd"),
    (1, 8, 1, 129, 1000, 128, False, False, "bnhd"),
    (2, 4, 4, 77, 33, 128, True, True, "bhnd"),
    (1, 4, 2, 200, 200, 256, False, True, "bhnd"),
    (2, 4, 2, 127, 129, 32, True, False, "bhnd"),
    (1, 6, 3, 100, 300, 96, False, True, "bnhd"),
]


@pytest.mark.parametrize("b, h, hkv, nq, nk, d, causal, deterministic, layout", BACKWARD_CASES)
def test_compiled_backward_matches_the_reference(b, h, hkv, nq, nk, d, causal, deterministic, layout):
    """The first backward after a compiled forward runs tileattn.api._backward, which registers the
    plan's launches; from then on the module runs them: op level (module.backward) and through the
    autograd node, on fresh inputs with every output and workspace poisoned, without calling
    _backward; gradients match float64 autograd; the deterministic mode is bitwise repeatable."""
    q, k, v = _inputs(b, h, hkv, nq, nk, d, BF16, seed=nq + nk + d, layout=layout)
    module = _planned(q, k, v, causal)
    warm = tuple(torch.randn_like(t).requires_grad_() for t in (q, k, v))
    tileattn.attention(*warm, causal=causal, deterministic=deterministic).backward(torch.randn_like(q))
    assert module.backward_record_count() >= 1, "the backward was not registered"
    dout = torch.randn_like(q)
    want = _reference_grads(q, k, v, dout, causal)
    what = f"b={b} h={h}/{hkv} nq={nq} nk={nk} d={d} causal={causal} deterministic={deterministic} {layout}"
    python_calls = []
    with pytest.MonkeyPatch.context() as mp, poisoned_allocations():
        mp.setattr(api, "_backward", lambda *args, **kw: python_calls.append(args) or api_backward(*args, **kw))
        out, lse = module.forward(q, k, v, causal, None, 1)
        op_level = module.backward(q, k, v, out, lse, dout, causal, None, deterministic)
        assert op_level is not None, f"{what}: the op-level backward was not served"
        again = module.backward(q, k, v, out, lse, dout, causal, None, deterministic)
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        tileattn.attention(qg, kg, vg, causal=causal, deterministic=deterministic).backward(dout)
    torch.cuda.synchronize()
    assert not python_calls, f"{what}: the autograd node called tileattn.api._backward"
    for name, got, autograd_got, expected in zip(("dq", "dk", "dv"), op_level, (qg.grad, kg.grad, vg.grad), want):
        assert not torch.isnan(got).any(), f"{what}: NaN left in {name}"
        assert _rel(got, expected) <= 2e-2, f"{what}: {name} relative error {_rel(got, expected):.3e}"
        assert _rel(autograd_got, expected) <= 2e-2, f"{what}: autograd {name} {_rel(autograd_got, expected):.3e}"
    if deterministic:
        assert all(torch.equal(x, y) for x, y in zip(op_level, again)), f"{what}: not repeatable"


@pytest.mark.parametrize("d", [64, 96])
def test_use_deterministic_algorithms_selects_the_deterministic_backward(d):
    """Under torch.use_deterministic_algorithms(True) a call without deterministic=True gets the
    deterministic backward (Hopper at d = 64, sm80 at d = 96): the first backward registers its
    launches, later ones run them through the node; gradients bitwise the same across three
    backwards and right against float64 (the reference runs outside the flag: cuBLAS needs a
    workspace setting under it)."""
    q, k, v = _inputs(2, 4, 2, 150, 190, d, BF16, seed=50 + d)
    module = _planned(q, k, v, True)
    dout = torch.randn_like(q)
    want = _reference_grads(q, k, v, dout, True)
    grads = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(3):
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            with poisoned_allocations():
                tileattn.attention(qg, kg, vg, causal=True).backward(dout)
            grads.append((qg.grad, kg.grad, vg.grad))
    finally:
        torch.use_deterministic_algorithms(False)
    out, lse = module.forward(q, k, v, True, None, 1)
    assert module.backward(q, k, v, out, lse, dout, True, None, True) is not None, \
        "no deterministic launches registered"
    for name, got, expected in zip(("dq", "dk", "dv"), grads[0], want):
        assert _rel(got, expected) <= 2e-2, f"d={d}: {name} relative error {_rel(got, expected):.3e}"
    for later in grads[1:]:
        assert all(torch.equal(x, y) for x, y in zip(grads[0], later)), f"d={d}: not bitwise repeatable"


def test_a_backward_layout_it_does_not_hold_takes_the_python_path():
    """A dout of another layout (transposed storage) or the stride-0 gradient of out.sum(): the
    op-level call declines, the autograd node runs tileattn.api._backward, gradients right."""
    q, k, v = _inputs(1, 4, 4, 96, 96, 128, BF16, seed=21)
    module = _planned(q, k, v, False)
    warm = tuple(torch.randn_like(t).requires_grad_() for t in (q, k, v))
    tileattn.attention(*warm).backward(torch.randn_like(q))
    out, lse = module.forward(q, k, v, False, None, 1)
    dout = torch.randn(q.shape[0], q.shape[2], q.shape[1], q.shape[3], device="cuda").to(BF16).transpose(1, 2)
    assert module.backward(q, k, v, out, lse, dout, False, None, False) is None
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    tileattn.attention(qg, kg, vg).backward(dout)
    want = _reference_grads(q, k, v, dout, False)
    for name, got, expected in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), want):
        assert _rel(got, expected) <= 2e-2, f"{name}: relative error {_rel(got, expected):.3e}"
    qg.grad = None
    tileattn.attention(qg, kg, vg).sum().backward()
    want = _reference_grads(q, k, v, torch.ones_like(q), False)
    assert _rel(qg.grad, want[0]) <= 2e-2


@pytest.mark.parametrize("d", [64, 128])
def test_the_node_under_compiled_autograd(d):
    """The compiled path's node (tileattn::AttentionBackward) under compiled autograd: its backward runs
    as an opaque call of the compiled graph (the registered launches) for two fresh inputs, gradients
    against float64 autograd, outputs poisoned as everywhere here."""
    from torch._dynamo import compiled_autograd

    q, k, v = _inputs(2, 4, 2, 130, 170, d, BF16, seed=40 + d)
    module = _planned(q, k, v, True)
    warm = tuple(torch.randn_like(t).requires_grad_() for t in (q, k, v))
    tileattn.attention(*warm, causal=True).backward(torch.randn_like(q))  # registers the backward
    assert module.backward_record_count() >= 1
    for seed in (1, 2):
        fresh = _inputs(2, 4, 2, 130, 170, d, BF16, seed=40 + d + seed)
        dout = torch.randn_like(fresh[0])
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in fresh)
        with poisoned_allocations():
            out = tileattn.attention(qg, kg, vg, causal=True)
            assert out.grad_fn.name() == "tileattn::AttentionBackward"
            with compiled_autograd._enable(torch.compile(backend="eager")):
                out.backward(dout)
        want = _reference_grads(*fresh, dout, True)
        for name, got, expected in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), want):
            assert _rel(got, expected) <= 2e-2, f"d={d} seed={seed}: {name} relative error {_rel(got, expected):.3e}"


@pytest.mark.parametrize("d", [64, 96])
def test_saved_tensors_offloaded_to_the_cpu(d):
    """torch.autograd.graph.save_on_cpu(pin_memory=True) returns every saved tensor contiguous: with
    q, k, v in [B, N, H, d] storage the backward's tensors are no longer in the layout the plans
    (and the registered launches) were made for; gradients still match float64 on the Python path
    (tileattn.api._backward copies them back) and through the compiled node (which declines them),
    on a first and a later backward."""
    q, k, v = _inputs(2, 4, 2, 100, 140, d, BF16, seed=30 + d, layout="bnhd")
    _planned(q, k, v, True)
    dout = torch.randn_like(q)
    want = _reference_grads(q, k, v, dout, True)
    for attempt, path in enumerate(("python", "compiled", "compiled")):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with pytest.MonkeyPatch.context() as mp, torch.autograd.graph.save_on_cpu(pin_memory=True):
            if path == "python":
                mp.setattr(api, "_host_forward", None)
            out = tileattn.attention(qg, kg, vg, causal=True)
        assert (out.grad_fn.name() == "tileattn::AttentionBackward") == (path == "compiled"), out.grad_fn.name()
        out.backward(dout)
        for name, got, expected in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), want):
            assert _rel(got, expected) <= 2e-2, f"{path} {attempt}: {name} relative error {_rel(got, expected):.3e}"


def test_a_side_stream_gets_its_own_tile_counter():
    """A persistent grid (d = 64 / 128 on the H200) launched on two streams: each stream's pair of
    counters, results right on both."""
    q, k, v = _inputs(2, 8, 8, 512, 512, 128, BF16, seed=5)
    q2 = torch.randn_like(q)
    module = _planned(q, k, v, True)
    ref = reference.attention(q, k, v, causal=True, compute_dtype=torch.float64)[0]
    ref2 = reference.attention(q2, k, v, causal=True, compute_dtype=torch.float64)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with poisoned_allocations():
        out = module.forward(q, k, v, True, None, 0)
        with torch.cuda.stream(side):
            out2 = module.forward(q2, k, v, True, None, 0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert out is not None and out2 is not None
    assert _rel(out, ref) <= TOL[BF16] and _rel(out2, ref2) <= TOL[BF16]


@pytest.mark.parametrize("d, causal, served", [(64, True, False), (256, False, True)], ids=["persistent", "per-tile"])
def test_cuda_graph_capture(d, causal, served):
    """Under capture a persistent grid (d = 64) needs a counter pair of the graph's own: the compiled
    path declines (None) and the Python path captures. One CTA per tile (d = 256, no counter): the
    compiled path's launch is captured. Replays with new inputs are right."""
    q, k, v = _inputs(1, 4, 4, 300, 300, d, BF16, seed=d)
    module = _planned(q, k, v, causal)
    static_q = q.clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tileattn.attention(static_q, k, v, causal=causal)  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=side):
            static_out = module.forward(static_q, k, v, causal, None, 0)
            assert (static_out is not None) == served
            if static_out is None:
                static_out = tileattn.attention(static_q, k, v, causal=causal)
    torch.cuda.current_stream().wait_stream(side)
    for seed in (7, 8):
        fresh = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).to(BF16)
        static_q.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.attention(fresh, k, v, causal=causal, compute_dtype=torch.float64)[0]
        assert _rel(static_out, ref) <= TOL[BF16], f"replay {seed}"


def test_many_output_addresses_cycle_the_tensor_map_cache():
    """More live outputs than a slot keeps encoded maps for (64): every one computed right."""
    q, k, v = _inputs(1, 2, 2, 64, 64, 128, BF16, seed=10)
    module = _planned(q, k, v, False)
    ref = reference.attention(q, k, v, compute_dtype=torch.float64)[0]
    outs = [module.forward(q, k, v, False, None, 0) for _ in range(150)]  # all alive: 150 addresses
    torch.cuda.synchronize()
    assert len({o.data_ptr() for o in outs}) == 150
    assert max(_rel(o, ref) for o in outs) <= TOL[BF16]


def test_a_misaligned_pointer_reaches_the_python_paths_error():
    q, k, v = _inputs(1, 2, 2, 64, 64, 64, BF16, seed=11)
    module = _planned(q, k, v, False)
    storage = torch.randn(q.numel() + 8, device="cuda").to(BF16)
    shifted = storage[1:1 + q.numel()].view(q.shape)  # same shape and strides, pointer off by 2 bytes
    assert module.forward(shifted, k, v, False, None, 0) is None
    with pytest.raises(ValueError, match="16-byte aligned"):
        tileattn.attention(shifted, k, v)


def test_declines_what_it_does_not_hold():
    q, k, v = _inputs(1, 2, 2, 72, 72, 64, BF16, seed=12)
    module = _planned(q, k, v, False)
    assert module.forward(q, k, v, False, None, 0) is not None
    assert module.forward(q, k, v, True, None, 0) is None, "causal is part of the key"
    assert module.forward(q, k, v, False, 1, 0) is None, "an int scale is not in the key"
    assert module.forward(q.cpu(), k.cpu(), v.cpu(), False, None, 0) is None
    assert module.forward(q.float(), k.float(), v.float(), False, None, 0) is None
    with pytest.raises(ValueError, match="want"):
        module.forward(q, k, v, False, None, 5)


def test_a_replaced_plan_cache_is_not_served_from_old_records():
    q, k, v = _inputs(1, 2, 2, 96, 96, 64, BF16, seed=13)
    module = _planned(q, k, v, False)
    assert module.forward(q, k, v, False, None, 0) is not None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "_plans", {})
        assert module.forward(q, k, v, False, None, 0) is None
        out = tileattn.attention(q, k, v)  # plans into the new cache and registers again
        (entry,) = api._plans.values()
        assert module.forward(q, k, v, False, None, 2)[2] is entry
    ref = reference.attention(q, k, v, compute_dtype=torch.float64)[0]
    assert _rel(out, ref) <= TOL[BF16]
    api.clear_plans()  # the restored cache and the records, together
    assert module.record_count() == 0 and module.forward(q, k, v, False, None, 0) is None


def test_scale_in_the_key_matches_the_python_key():
    """scale=None and scale=1/sqrt(d) are different keys on both paths (the same numbers)."""
    q, k, v = _inputs(1, 2, 2, 80, 80, 64, BF16, seed=14)
    module = _planned(q, k, v, False)
    assert module.forward(q, k, v, False, 1 / math.sqrt(64), 0) is None
