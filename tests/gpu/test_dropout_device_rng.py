"""GPU tests of dropout with its rng state in device memory (issue #15): `seed` given as an int64
CUDA tensor [seed, offset] that the kernels read when they run, and the draw a dropout call makes on
the device while the current stream captures a CUDA graph, so that every replay applies a new mask.

Oracle: the same call with the state's values as int seed/offset, bitwise (out, lse, dk, dv; dq too in
the deterministic mode, within 1e-2 of its largest element in the atomic one, whose adds land in any
order), and that
call is checked against the float64 reference in tests/gpu/test_attention_variants.py. One case per
kernel family that draws dropout bits: the Hopper dropout forward and backward (d = 64, 128, 256;
atomic and deterministic), the sm_80 variant forward and backward (d = 96; d = 128 with ALiBi, which
the Hopper dropout forward does not take), the sm_80 varlen variant kernels. Every allocation the
ops make is poisoned (tests/gpu/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn import dropout as dr
from tileattn import reference

from .conftest import poisoned_allocations

pytestmark = pytest.mark.gpu
BF16, FP16 = torch.bfloat16, torch.float16

# name: (api, head dim, dtype, causal, GQA (h, hkv), deterministic, other options)
CASES = {
    "sm90_d64_causal": ("attention", 64, BF16, True, (4, 2), False, {}),
    "sm90_d128_gqa": ("attention", 128, FP16, False, (4, 1), False, {}),
    "sm90_d256": ("attention", 256, BF16, False, (2, 2), False, {}),
    "sm90_d64_deterministic": ("attention", 64, FP16, False, (2, 1), True, {"window": (40, 7)}),
    "sm80_d96": ("attention", 96, FP16, True, (2, 1), False, {}),
    "sm80_d128_alibi": ("attention", 128, BF16, False, (2, 2), False, {"alibi": True}),
    "varlen_d64": ("attention_varlen", 64, BF16, True, (4, 2), False, {}),
    # A seed tensor runs another tile or family here than the int seed: d = 128 causal the Hopper form at
    # 128 x 64 (128 x 128 by value), d = 256 causal the Hopper form with ping-pong (without it by value),
    # d = 256 causal ALiBi the sm80 form (the Hopper one by value). Checked against the float64 reference
    # instead of bitwise, with the forward kernel that ran (OTHER_KERNEL's expression fragment).
    "sm90_d128_causal_tile64": ("attention", 128, BF16, True, (4, 2), False, {}),
    "sm90_d256_causal_pingpong": ("attention", 256, FP16, True, (2, 1), False, {}),
    "sm80_d256_causal_alibi": ("attention", 256, BF16, True, (2, 1), False, {"alibi": True}),
}
OTHER_KERNEL = {"sm90_d128_causal_tile64": "attention_fwd_sm90<128, 64, 2, false, false, true, 2, 289,",
                "sm90_d256_causal_pingpong": "attention_fwd_sm90<256, 64, 2, true, false, false, 2, 289,",
                "sm80_d256_causal_alibi": "attention_fwd_variants_sm80<256,"}
LENS_Q, LENS_K = [70, 0, 129, 1], [100, 5, 129, 40]


def _two_complement(x: int) -> int:
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def _state(seed: int, offset: int) -> torch.Tensor:
    """The seed tensor [seed, offset] on the GPU."""
    return torch.tensor([_two_complement(seed), _two_complement(offset)], dtype=torch.int64, device="cuda")


def _inputs(case, seed):
    """(op, (q, k, v), dout): op(q, k, v, **dropout) -> (out, lse) for the case's API and options (the
    options, ALiBi slopes included, in op.options)."""
    api, d, dtype, causal, (h, hkv), deterministic, extra = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(seed)
    options = {k: v for k, v in extra.items() if k != "alibi"}
    if extra.get("alibi"):
        options["alibi_slopes"] = torch.rand(h, device="cuda", generator=g, dtype=torch.float32) * 0.5
    if api == "attention":
        shapes = ((2, h, 100, d), (2, hkv, 130, d), (2, hkv, 130, d), (2, h, 100, d))
    else:
        shapes = ((sum(LENS_Q), h, d), (sum(LENS_K), hkv, d), (sum(LENS_K), hkv, d), (sum(LENS_Q), h, d))
    q, k, v, dout = (torch.randn(s, device="cuda", generator=g).to(dtype) for s in shapes)
    if api == "attention":
        def op(q_, k_, v_, **dropout):
            return tileattn.attention(q_, k_, v_, causal, return_lse=True, deterministic=deterministic,
                                      **options, **dropout)
    else:
        cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
              for lens in (LENS_Q, LENS_K)]

        def op(q_, k_, v_, **dropout):
            return tileattn.attention_varlen(q_, k_, v_, *cu, max(LENS_Q), max(LENS_K), causal, return_lse=True,
                                             deterministic=deterministic, **options, **dropout)
    op.options = options
    return op, (q, k, v), dout


def _forward_backward(op, qkv, dout, **dropout):
    """(out, lse, dq, dk, dv) of one call with autograd; allocations poisoned."""
    q, k, v = (t.detach().requires_grad_() for t in qkv)
    with poisoned_allocations():
        out, lse = op(q, k, v, **dropout)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    return (out.detach(), lse, *grads)


def _assert_equal(got, want, what, case):
    """Bitwise, but dQ of an atomic-mode case (its fp32 adds land in any order, so two runs of the same mask
    may round an element differently: seen once in 102,400 at d = 256) to within 1e-2 of its largest element,
    while dK and dV (ordered sums of the same mask) stay exact."""
    deterministic = CASES[case][5]
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if name == "dq" and not deterministic:
            err = float((x.float() - y.float()).abs().max()) / max(float(y.float().abs().max()), 1e-30)
            assert err <= 1e-2, f"{what}: dq differs by {err:.2e} of its largest element"
            continue
        assert torch.equal(x, y), f"{what}: {name} differs in {int((x != y).sum())} of {x.numel()} elements"


@pytest.mark.parametrize("case", [c for c in CASES if c not in OTHER_KERNEL])
def test_seed_tensor_equals_the_same_int_seed(case):
    """A seed tensor [s, o] gives bitwise the outputs and gradients of seed=s, offset=o (which the
    variant tests check against the float64 reference), for seeds with the high bit set too."""
    op, qkv, dout = _inputs(case, 1)
    seed, offset = (1 << 63) + 12345, (1 << 33) + 7
    p = 0.3
    want = _forward_backward(op, qkv, dout, dropout_p=p, seed=seed, offset=offset)
    got = _forward_backward(op, qkv, dout, dropout_p=p, seed=_state(seed, offset))
    _assert_equal(got, want, f"{case}: seed tensor against the int seed", case)
    other = _forward_backward(op, qkv, dout, dropout_p=p, seed=_state(seed + 1, offset))
    assert not torch.equal(other[0], want[0]), f"{case}: another seed tensor gave the same output"


@pytest.mark.parametrize("case", ["sm90_d64_causal", "sm80_d96", "varlen_d64"])
def test_backward_applies_the_mask_the_forward_read(case):
    """A seed tensor rewritten between the forward and the backward does not change the backward's mask:
    the gradients are those of the values the forward read."""
    op, qkv, dout = _inputs(case, 10)
    state = _state(31, 2)
    q, k, v = (t.detach().requires_grad_() for t in qkv)
    with poisoned_allocations():
        out, lse = op(q, k, v, dropout_p=0.3, seed=state)
        state.copy_(_state(32, 2))
        grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    want = _forward_backward(op, qkv, dout, dropout_p=0.3, seed=31, offset=2)
    _assert_equal((out.detach(), lse, *grads), want, f"{case}: seed tensor rewritten before the backward", case)


def _warm_up(fn):
    """Run fn once on a side stream (plans built and kernels loaded outside any capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _captured(op, qkv, dout, **dropout):
    """(graph, static inputs, static results): forward and backward of op captured in one graph."""
    static = [t.detach().clone().requires_grad_() for t in qkv]

    def step():
        with poisoned_allocations():  # the poison fills are captured too: each replay starts from NaN
            out, lse = op(*static, **dropout)
            grads = torch.autograd.grad(out, static, dout)
        return (out.detach(), lse, *grads)

    _warm_up(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step()
    return graph, static, results


@pytest.mark.parametrize("case", ["sm90_d64_causal", "sm80_d96", "varlen_d64", "sm90_d64_deterministic"])
def test_captured_seed_tensor_is_read_at_each_replay(case):
    """A graph captured with a seed tensor applies, at each replay, the mask of what the tensor holds
    then: each replay equals the eager call with those values as ints."""
    op, qkv, dout = _inputs(case, 2)
    p = 0.25
    state = _state(5, 0)
    graph, static, results = _captured(op, qkv, dout, dropout_p=p, seed=state)
    for seed, offset in ((11, 3), ((1 << 64) - 1, (1 << 40) + 2), (11, 3)):
        state.copy_(_state(seed, offset))
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in results]
        want = _forward_backward(op, static, dout, dropout_p=p, seed=seed, offset=offset)
        _assert_equal(got, want, f"{case}: replay with seed {seed}, offset {offset}", case)


@pytest.mark.parametrize("case", ["sm90_d128_gqa", "sm80_d128_alibi", "varlen_d64"])
def test_capture_without_a_seed_draws_a_new_mask_per_replay(case, monkeypatch):
    """Captured without a seed, a dropout call draws [seed, offset] on the device from the default
    generator at each replay (graph-safe, as PyTorch's own dropout under capture): replays differ, each
    equals the eager call with the state it drew (recorded from the device), forward and backward read
    the same state, and the generator advances with every replay."""
    op, qkv, dout = _inputs(case, 3)
    p = 0.2
    drawn = []

    def recording_draw(generator, device):
        state = real_draw(generator, device)
        drawn.append(state)
        return state

    real_draw = dr.device_draw
    monkeypatch.setattr(dr, "device_draw", recording_draw)
    graph, static, results = _captured(op, qkv, dout, dropout_p=p)
    assert len(drawn) == 1, f"the captured call drew {len(drawn)} device states, want 1"
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    seen = []
    for replay in range(3):
        before = generator.get_offset()
        graph.replay()
        torch.cuda.synchronize()
        assert generator.get_offset() > before, "a replay did not advance the default generator"
        seed, offset = dr.rng_values(drawn[0])
        got = [t.clone() for t in results]
        want = _forward_backward(op, static, dout, dropout_p=p, seed=seed, offset=offset)
        _assert_equal(got, want, f"{case}: replay {replay} against its drawn state ({seed}, {offset})", case)
        seen.append(got[0])
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2]), "replays repeated a mask"


def test_capture_with_a_registered_generator():
    """A user CUDA generator registered with the graph draws there too; another generator with the same
    seed, registered with a second capture, replays the same sequence of masks."""
    op, qkv, dout = _inputs("sm90_d64_causal", 4)
    outs = []
    for _ in range(2):
        gen = torch.Generator(device="cuda").manual_seed(99)
        static = [t.clone() for t in qkv]
        _warm_up(lambda: op(*static, dropout_p=0.4, seed=1))  # loads the plan (a seeded call: gen untouched)
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(gen)
        with torch.cuda.graph(graph):
            out, _ = op(*static, dropout_p=0.4, generator=gen)
        replays = []
        for _ in range(2):
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        assert not torch.equal(replays[0], replays[1]), "two replays with a registered generator gave one mask"
        outs.append(replays)
    assert all(torch.equal(a, b) for a, b in zip(*outs)), "the same generator seed replayed other masks"


@pytest.mark.parametrize("case", ["sm90_d64_causal", *OTHER_KERNEL])
def test_seed_tensor_matches_the_reference(case):
    """Forward and backward with a seed tensor against the float64 reference given the same tensor (which
    reads its values): relative errors within the variant tests' tolerances (bf16 1e-2, fp16 2e-3
    forward / 3e-3 gradients), lse within 2e-3, for the kRngState forms at their own tiles too (the
    forward kernel that ran: OTHER_KERNEL)."""
    _check_against_the_reference(case)


def _check_against_the_reference(case):
    from tileattn import api

    op, qkv, dout = _inputs(case, 5)
    dtype = qkv[0].dtype
    state = _state((1 << 63) + 9, 4)
    api.clear_plans()
    out, lse, *grads = _forward_backward(op, qkv, dout, dropout_p=0.3, seed=state)
    if case in OTHER_KERNEL:
        ran = [e.forward.plan.kernel.expression for e in api._plans.values()]
        assert any(OTHER_KERNEL[case] in x for x in ran), f"{case}: expected {OTHER_KERNEL[case]!r}, ran {ran}"
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in qkv)
    ref, ref_lse = reference.attention(q64, k64, v64, CASES[case][3], compute_dtype=torch.float64, dropout_p=0.3,
                                       seed=state, **op.options)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    tol_fwd, tol_bwd = (1e-2, 1e-2) if dtype == BF16 else (2e-3, 3e-3)
    for name, x, y, tol in (("out", out, ref, tol_fwd), *(
            (n, g, r, tol_bwd) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads))):
        err = float((x.double() - y).norm() / max(float(y.norm()), 1e-3 * y.numel() ** 0.5))
        assert err < tol, f"{case}: {name} relative error {err:.2e} against the reference with the same state"
    assert torch.allclose(lse.double(), ref_lse, atol=2e-3, rtol=0), f"{case}: lse differs from the reference's"


def test_seed_tensor_errors():
    """A seed tensor on another device than q, or with an offset beside it, is refused before a launch."""
    op, qkv, _ = _inputs("sm90_d64_causal", 6)
    with pytest.raises(ValueError, match="must be on q's device"):
        op(*qkv, dropout_p=0.1, seed=torch.tensor([1, 2], dtype=torch.int64))
    with pytest.raises(ValueError, match="pass offset=None"):
        op(*qkv, dropout_p=0.1, seed=_state(1, 2), offset=3)
    with pytest.raises(ValueError, match="int64 of shape \\[2\\]"):
        op(*qkv, dropout_p=0.1, seed=_state(1, 2)[:1])


@pytest.mark.parametrize("api_case", ["sm90_d128_gqa", "varlen_d64"])
def test_torch_compile_with_a_seed_tensor(api_case):
    """Under torch.compile (fullgraph) a seed tensor is an input of the graph: compiled calls equal the
    eager ones with the same values, forward and backward, and follow its contents from call to call."""
    op, qkv, dout = _inputs(api_case, 7)
    torch._dynamo.reset()

    def f(q_, k_, v_, state):
        return op(q_, k_, v_, dropout_p=0.3, seed=state)

    compiled = torch.compile(f, fullgraph=True)
    for seed, offset in ((21, 0), (22, 5)):
        q, k, v = (t.detach().requires_grad_() for t in qkv)
        out, lse = compiled(q, k, v, _state(seed, offset))
        grads = torch.autograd.grad(out, (q, k, v), dout)
        want = _forward_backward(op, qkv, dout, dropout_p=0.3, seed=seed, offset=offset)
        _assert_equal((out.detach(), lse, *grads), want, f"compiled {api_case} with seed tensor ({seed}, {offset})",
                      api_case)


def test_opcheck_with_a_device_rng_state():
    """torch.library.opcheck of tileattn::attention_dropout_fwd/bwd with the rng state on the GPU: the
    fake implementation puts the returned state on the same device as the real one."""
    op, (q, k, v), dout = _inputs("sm90_d64_causal", 8)
    options = (0.125, False, 1 << 29, 0, 0.0, 0.3)  # scale, deterministic, window (causal), softcap, p
    fwd = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, _state(11, 4), *options)
    result = torch.library.opcheck(torch.ops.tileattn.attention_dropout_fwd.default, fwd)
    assert set(result.values()) == {"SUCCESS"}, f"attention_dropout_fwd: {result}"
    out, lse, used = torch.ops.tileattn.attention_dropout_fwd(*fwd)
    assert used.is_cuda and used.tolist() == [11, 4], f"rng state returned {used}"
    bwd = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, None, used, *options)
    result = torch.library.opcheck(torch.ops.tileattn.attention_dropout_bwd.default, bwd)
    assert set(result.values()) == {"SUCCESS"}, f"attention_dropout_bwd: {result}"


@pytest.mark.sanitize
@pytest.mark.parametrize("case", ["sm90_d64_causal", "sm80_d96", "varlen_d64"])
def test_sanitize_seed_tensor(case):
    """Small calls reading the rng state from device memory, for compute-sanitizer."""
    op, qkv, dout = _inputs(case, 9)
    want = _forward_backward(op, qkv, dout, dropout_p=0.2, seed=3, offset=1)
    got = _forward_backward(op, qkv, dout, dropout_p=0.2, seed=_state(3, 1))
    _assert_equal(got, want, f"sanitize {case}", case)


@pytest.mark.sanitize
def test_sanitize_seed_tensor_other_kernel():
    """The d = 256 causal kRngState form (its own ping-pong tile) against the reference, for compute-sanitizer."""
    _check_against_the_reference("sm90_d256_causal_pingpong")
