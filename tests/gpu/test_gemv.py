"""GPU tests of the small-M GEMV (csrc/gemv.cu through tileattn.linear / add_rms_norm_linear),
the kernel path forced on (kernels.dispatch.GEMV_ROWS_OVERRIDE = 8) and checked three ways:
- against float64 from the same rounded input rows (what the unfused op stores): only y's own
  rounding remains, so ||y - ref|| / ||ref|| <= the dtype's unit roundoff (2^-8 bf16, 2^-11 fp16);
- against float64 from the raw x (the formulas end to end), with layer_ops' tolerances;
- against the composition path (silu_mul / add_rms_norm kernels, then cuBLAS) elementwise to one
  unit in the last place: the inputs are bit for bit the same and only the order of the fp32 sum
  differs, which moves y by at most one rounding step.
Outputs are poisoned (NaN) before every launch; every case asserts that the kernel path ran."""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn import api_layers
from tileattn.kernels import dispatch
from tileattn.kernels import gemv as gemv_kernels

from ..test_gemv import rel, rms_norm64, silu_mul64
from .conftest import poisoned_allocations

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
END_TO_END_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # tests/gpu/test_layer_ops.py's
PROLOGUES = ("none", "silu_mul", "add_rms_norm")
EPS = 1e-5


@pytest.fixture(autouse=True)
def kernel_forced(monkeypatch):
    monkeypatch.setattr(dispatch, "GEMV_ROWS_OVERRIDE", 8)
    # cuBLAS may otherwise reduce split-K partials in 16 bits: the composition would then be off
    # by more than the one rounding it is compared at.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", False)


class Case:
    """Inputs of one call: x [M, K] ([M, 2K] with silu_mul), weight [N, K], bias [N] or None,
    residual [M, K] or None and norm_weight [K] (add_rms_norm)."""

    def __init__(self, prologue, rows, k, n, dtype, *, bias=True, residual=True, scale=1.0, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.prologue, self.dtype = prologue, dtype

        def randn(*shape):
            return torch.randn(*shape, device="cuda", generator=g)

        width = 2 * k if prologue == "silu_mul" else k
        self.x = (scale * randn(rows, width)).to(dtype)
        self.weight = (randn(n, k) / k**0.5).to(dtype)
        self.bias = randn(n).to(dtype) if bias else None
        norm = prologue == "add_rms_norm"
        self.residual = randn(rows, k).to(dtype) if norm and residual else None
        self.norm_weight = (1 + 0.1 * randn(k)).to(dtype) if norm else None

    def call(self, residual="copy"):
        """(y, new_residual) through the public API; the residual passed is a copy (consumed)."""
        if self.prologue == "add_rms_norm":
            r = None if self.residual is None else (self.residual.clone() if residual == "copy" else residual)
            return tileattn.add_rms_norm_linear(self.x, r, self.norm_weight, EPS, self.weight, self.bias)
        activation = "silu_mul" if self.prologue == "silu_mul" else None
        return tileattn.linear(self.x, self.weight, self.bias, activation=activation), None

    def kernel_takes(self) -> bool:
        dim = self.weight.shape[1]
        return api_layers._gemv_kernel_takes(self.x, dim, self.weight, self.bias)

    def rounded_input(self):
        """The 16-bit rows the unfused op stores (the kernel's shared-memory rows)."""
        if self.prologue == "silu_mul":
            return api_layers.silu_mul(self.x)
        if self.prologue == "add_rms_norm":
            s = self.x if self.residual is None else self.x + self.residual
            return api_layers.add_rms_norm(s, self.norm_weight, EPS)
        return self.x

    def reference64(self, act):
        return act.double() @ self.weight.double().T + (0 if self.bias is None else self.bias.double())

    def raw64(self):
        """float64 end to end from the raw inputs."""
        if self.prologue == "silu_mul":
            act = silu_mul64(self.x)
        elif self.prologue == "add_rms_norm":
            s = self.x if self.residual is None else self.x.double() + self.residual.double()
            act = rms_norm64(s, self.norm_weight, EPS)
        else:
            act = self.x.double()
        return self.reference64(act)


def composition(case: Case, monkeypatch):
    """The unfused path's y on the same inputs (kernel path off for the call)."""
    monkeypatch.setattr(dispatch, "GEMV_ROWS_OVERRIDE", 0)
    try:
        return case.call()[0]
    finally:
        monkeypatch.setattr(dispatch, "GEMV_ROWS_OVERRIDE", 8)


def assert_no_less_accurate(got, unfused, ref, what, ulps: int = 1):
    """Elementwise, the kernel is no farther from the float64 reference than the composition is,
    plus `ulps` units in the last place (finfo.eps x |ref| bounds one, floored at the largest
    magnitude / 8 for outputs that cancel to near zero). Against the composition directly the two
    may differ by a few ulps where cuBLAS rounds on its own path (a bias added after rounding, its
    summation order): observed 4 ulps at M = 4, N = 33, K = 1000 on the H200."""
    eps = torch.finfo(got.dtype).eps
    ref = ref.to(torch.float64)
    tolerance = ulps * eps * torch.maximum(ref.abs(), ref.abs().max() / 8)
    excess = (got.double() - ref).abs() - (unfused.double() - ref).abs() - tolerance
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"{what}: the kernel is more than {ulps} ulp farther from float64 than the "
                               f"composition at flat index {worst}: kernel {got.flatten()[worst].item()}, "
                               f"composition {unfused.flatten()[worst].item()}, float64 {ref.flatten()[worst].item()}")


def check(case: Case, monkeypatch):
    """Run the case on the kernel path and compare it every way the module docstring lists."""
    assert case.kernel_takes(), "the case must take the kernel path"
    residual_before = None if case.residual is None else case.residual.clone()
    passed = None if case.residual is None else case.residual.clone()
    with poisoned_allocations():
        y, new_residual = case.call(residual=passed)
    rows, n = case.x.shape[0], case.weight.shape[0]
    assert y.shape == (rows, n) and y.dtype == case.dtype
    assert not y.isnan().any(), f"unwritten outputs: {int(y.isnan().sum())} NaN of {y.numel()}"
    act = case.rounded_input()
    ref = case.reference64(act)
    err = rel(y, ref)
    assert err <= UNIT_ROUNDOFF[case.dtype], f"relative error {err:.3g} against float64 of the rounded rows"
    # End to end the 16-bit roundings of the prologue dominate; with few outputs (N = 1, 2) their
    # relative error can pass 1e-2 on the unfused path too, so the bound is the larger of the
    # tolerance and the composition's own error plus one unit roundoff.
    raw, unfused = case.raw64(), composition(case, monkeypatch)
    err_raw, err_unfused = rel(y, raw), rel(unfused, raw)
    bound = max(END_TO_END_TOL[case.dtype], err_unfused + UNIT_ROUNDOFF[case.dtype])
    assert err_raw <= bound, (f"relative error {err_raw:.3g} against float64 end to end (the composition's "
                              f"{err_unfused:.3g})")
    assert_no_less_accurate(y, unfused, ref, "y")
    if case.prologue == "add_rms_norm":
        if case.residual is None:
            assert new_residual is case.x
        else:
            assert torch.equal(new_residual, case.x + residual_before), "new_residual must be round(x + residual)"
            assert torch.equal(passed, residual_before), "the kernel path must leave the residual untouched"
    return y


# ---- edge sizes: small K, every awkward N, every M and prologue ------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("k", [8, 64, 1000])
@pytest.mark.parametrize("n", [1, 31, 33, 127, 129, 1000, 4097])
def test_edge_sizes(dtype, prologue, rows, k, n, monkeypatch):
    check(Case(prologue, rows, k, n, dtype, bias=(n + rows) % 2 == 1, residual=rows != 3, seed=k * n + rows),
          monkeypatch)


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("rows, k, n", [(1, 8, 1), (3, 64, 33), (8, 1000, 129), (2, 4096, 31)])
@pytest.mark.parametrize("bias", [False, True])
def test_small(dtype, prologue, rows, k, n, bias, monkeypatch):
    check(Case(prologue, rows, k, n, dtype, bias=bias, seed=rows + k + n), monkeypatch)


# ---- the models' shapes ----------------------------------------------------------------------------

MODEL_SHAPES = [  # (prologue, K, N): the projection and what runs before it in the decoder layer
    ("add_rms_norm", 4096, 6144),     # Llama-3-8B qkv
    ("none", 4096, 4096),             # Llama-3-8B o
    ("add_rms_norm", 4096, 28672),    # Llama-3-8B gate_up
    ("silu_mul", 14336, 4096),        # Llama-3-8B down
    ("add_rms_norm", 1024, 4096),     # Qwen3-0.6B qkv (16 + 2 x 8 heads of 128)
    ("none", 2048, 1024),             # Qwen3-0.6B o
    ("add_rms_norm", 1024, 6144),     # Qwen3-0.6B gate_up
    ("silu_mul", 3072, 1024),         # Qwen3-0.6B down
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prologue, k, n", MODEL_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_model_shapes(dtype, prologue, k, n, rows, bias, monkeypatch):
    case = Case(prologue, rows, k, n, dtype, bias=bias, seed=k + n + rows)
    if not case.kernel_takes():  # M x K x 4 bytes over the block's shared memory: the composition
        assert not gemv_kernels.fits_shared_memory(rows, k, case.x.get_device())
        want = composition(case, monkeypatch)
        assert rel(case.call()[0], want) == 0.0
        return
    check(case, monkeypatch)


@pytest.mark.parametrize("prologue, k, n", [("none", 4096, 128256), ("add_rms_norm", 1024, 151936)])
def test_lm_heads(prologue, k, n, monkeypatch):
    check(Case(prologue, 1, k, n, torch.bfloat16, bias=False, seed=n), monkeypatch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("rows", [1, 4])
def test_k_14336_every_prologue(dtype, prologue, rows, monkeypatch):
    """K = 14336 (the down projection's width) through each prologue: the norm prologue's
    sum of squares runs its 1024-thread layout with 2 chunks per thread."""
    check(Case(prologue, rows, 14336, 129, dtype, seed=rows), monkeypatch)


# ---- values --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_large_magnitudes(dtype, prologue, monkeypatch):
    """Inputs near 1e4 (K = 64, weights ~ 1/sqrt(K): fp16's outputs stay below 65504). With
    silu_mul the activation is gate x up, so the inputs are ~30 for products near 1e4."""
    check(Case(prologue, 2, 64, 129, dtype, scale=30.0 if prologue == "silu_mul" else 1e4, seed=7), monkeypatch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_zero_inputs_give_the_bias(dtype, prologue, monkeypatch):
    case = Case(prologue, 3, 1000, 33, dtype, residual=False, seed=3)
    case.x.zero_()
    with poisoned_allocations():
        y, _ = case.call()
    assert torch.equal(y, case.bias.expand(3, -1)), "zero rows must give y = bias exactly"


def test_strided_rows(monkeypatch):
    """x rows inside a wider buffer (row stride K + 8): the kernel reads its row stride."""
    case = Case("none", 4, 1000, 129, torch.bfloat16, seed=11)
    buffer = torch.randn(4, 1008, device="cuda").to(torch.bfloat16)
    buffer[:, :1000] = case.x
    case.x = buffer[:, :1000]
    check(case, monkeypatch)


def test_layouts_the_kernel_cannot_read_take_the_composition():
    x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(33, 64, device="cuda", dtype=torch.bfloat16)
    assert api_layers._gemv_kernel_takes(x, 64, w, None)
    assert not api_layers._gemv_kernel_takes(x, 64, w.T.contiguous().T, None)  # weight not contiguous
    assert not api_layers._gemv_kernel_takes(x[:, 1:57], 56, w[:, :56].contiguous(), None)  # x misaligned
    assert not api_layers._gemv_kernel_takes(torch.randn(9, 64, device="cuda", dtype=torch.bfloat16), 64, w, None)
    assert not api_layers._gemv_kernel_takes(x.float(), 64, w.float(), None)


def test_programmatic_dependent_launch_chain(monkeypatch):
    """With TILEATTN_PDL=1 (sm_90), each GEMV lets the next one start early and issues its first
    weight loads before griddepcontrol.wait: a chain of three, each reading the one before, must
    equal the same chain launched plainly."""
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(2, 1024, device="cuda", generator=g).to(dtype)
    weights = [(torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
               for n, k in ((4096, 1024), (2048, 4096), (1000, 2048))]
    residual = torch.randn(2, 4096, device="cuda", generator=g).to(dtype)
    norm_weight = torch.ones(4096, device="cuda", dtype=dtype)

    def chain():
        h = tileattn.linear(x, weights[0])
        h, _ = tileattn.add_rms_norm_linear(h, residual, norm_weight, EPS, weights[1])
        return tileattn.linear(h, weights[2], activation=None)

    monkeypatch.setenv("TILEATTN_PDL", "0")  # PDL is on by default on sm_90
    plain = chain()
    monkeypatch.setenv("TILEATTN_PDL", "1")
    for _ in range(3):
        assert torch.equal(chain(), plain), "the PDL-launched chain differs from the plain one"


def test_cuda_graph_capture_and_replay():
    """Captured with fixed buffers, replayed on new inputs: the same y as eager calls."""
    dtype = torch.bfloat16
    case_lin = Case("silu_mul", 1, 1000, 4097, dtype, seed=5)
    case_norm = Case("add_rms_norm", 2, 1024, 1000, dtype, seed=6)
    case_lin.call(), case_norm.call()  # compile and make the plans outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y_lin, _ = case_lin.call()
        y_norm, new_res = case_norm.call(residual=case_norm.residual)
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for t in (case_lin.x, case_norm.x, case_norm.residual):
            t.copy_(torch.randn(t.shape, device="cuda", generator=g).to(dtype))
        residual_before = case_norm.residual.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_lin, case_lin.call()[0]), "replayed linear differs from an eager call"
        want_norm, want_res = case_norm.call()
        assert torch.equal(y_norm, want_norm), "replayed add_rms_norm_linear differs from an eager call"
        assert torch.equal(new_res, want_res) and torch.equal(case_norm.residual, residual_before)


# ---- the attention input stage (api_layers.add_rms_norm_qkv_rope_) ------------------------------
# add_rms_norm_qkv_rope_ runs add_rms_norm_linear's GEMV into qkv, then norm_rotary_write_kv_cache_
# on qkv's column views; it must leave exactly what those two public calls leave: qkv (q rotated,
# k and v as projected), the new residual and both caches, bit for bit. (The GEMV's rotary +
# KV-cache epilogue, which once did both in one launch, was removed on 2026-12-02: docs/gemv.md.)

def spy_gemv_launches(monkeypatch) -> list:
    """Record the prologue of each launch_gemv call from here on."""
    launched = []
    real = gemv_kernels.launch_gemv

    def spy(prologue, *args, **kwargs):
        launched.append(prologue)
        return real(prologue, *args, **kwargs)

    monkeypatch.setattr(gemv_kernels, "launch_gemv", spy)
    return launched


class RopeCase:
    """x [M, hidden], weight [(H + 2 Hkv) d, hidden], caches [blocks, block_size, Hkv, d] filled with
    random values, one slot and one position per token (either may be outside its range on
    purpose), q/k norm weights [d] when qk_norm."""

    def __init__(self, dtype, heads, kv_heads, d, hidden, block_size, *, bias, residual, slots, positions,
                 slot_dtype=torch.int64, qk_norm=False, blocks=5, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, device="cuda", generator=g)

        rows = len(slots)
        self.heads, self.kv_heads, self.d = heads, kv_heads, d
        self.x = randn(rows, hidden).to(dtype)
        self.residual = randn(rows, hidden).to(dtype) if residual else None
        self.norm_weight = (1 + 0.1 * randn(hidden)).to(dtype)
        self.weight = (randn((heads + 2 * kv_heads) * d, hidden) / hidden**0.5).to(dtype)
        self.bias = randn(self.weight.shape[0]).to(dtype) if bias else None
        self.k_cache = randn(blocks, block_size, kv_heads, d).to(dtype)
        self.v_cache = randn(blocks, block_size, kv_heads, d).to(dtype)
        self.slot_mapping = torch.tensor(slots, dtype=slot_dtype, device="cuda")
        self.positions = torch.tensor(positions, dtype=torch.int64, device="cuda")
        inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda").float() / d)
        freqs = torch.arange(64, device="cuda").float()[:, None] * inv_freq[None, :]  # [P = 64, d / 2]
        self.cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)
        self.sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        self.q_weight = (1 + 0.1 * randn(d)).to(dtype) if qk_norm else None
        self.k_weight = (1 + 0.1 * randn(d)).to(dtype) if qk_norm else None

    def _copies(self):
        return (self.k_cache.clone(), self.v_cache.clone(),
                None if self.residual is None else self.residual.clone())

    def fused(self, monkeypatch):
        """(qkv, new_residual, k_cache, v_cache, the GEMV launches' prologues) of the op, on copies
        of the caches and the residual, with every allocation poisoned."""
        launched = spy_gemv_launches(monkeypatch)
        k_cache, v_cache, residual = self._copies()
        with poisoned_allocations():
            qkv, new_residual = api_layers.add_rms_norm_qkv_rope_(
                self.x, residual, self.norm_weight, EPS, self.weight, self.bias, heads=self.heads,
                kv_heads=self.kv_heads, k_cache=k_cache, v_cache=v_cache, slot_mapping=self.slot_mapping,
                positions=self.positions, cos=self.cos, sin=self.sin, q_weight=self.q_weight,
                k_weight=self.k_weight, qk_eps=EPS)
        torch.cuda.synchronize()
        return qkv, new_residual, k_cache, v_cache, launched

    def two_calls(self):
        """The same through add_rms_norm_linear, then norm_rotary_write_kv_cache_ on qkv's views."""
        k_cache, v_cache, residual = self._copies()
        qkv, new_residual = tileattn.add_rms_norm_linear(self.x, residual, self.norm_weight, EPS, self.weight,
                                                         self.bias)  # [M, (H + 2 Hkv) d]
        rows, hq, hkv, d = qkv.shape[0], self.heads * self.d, self.kv_heads * self.d, self.d
        q = qkv[:, :hq].view(rows, self.heads, d)  # [M, H, d]
        k = qkv[:, hq:hq + hkv].view(rows, self.kv_heads, d)  # [M, Hkv, d]
        v = qkv[:, hq + hkv:].view(rows, self.kv_heads, d)  # [M, Hkv, d]
        api_layers.norm_rotary_write_kv_cache_(q, k, v, k_cache, v_cache, self.slot_mapping, self.positions,
                                               self.cos, self.sin, self.q_weight, self.k_weight, EPS)
        torch.cuda.synchronize()
        return qkv, new_residual, k_cache, v_cache


def check_rope(case: RopeCase, monkeypatch):
    *got, launched = case.fused(monkeypatch)
    assert launched == [gemv_kernels.PROLOGUE_ADD_RMS_NORM], f"the GEMV did not run once: {launched}"
    want = case.two_calls()
    for name, a, b in zip(("qkv", "new residual", "k_cache", "v_cache"), got, want):
        assert not a.isnan().any(), f"{name}: NaN (an element nothing wrote)"
        assert torch.equal(a, b), f"{name}: the op differs from the two calls ({(a != b).sum()} elements)"


ROPE_SHAPES = [  # (heads, kv_heads, d, hidden)
    (4, 2, 64, 256),
    (3, 3, 128, 1024),    # MHA, an odd head count
    (8, 1, 96, 768),      # MQA, d = 96
    (2, 1, 256, 512),     # d = 256
    (32, 8, 128, 4096),   # Llama-3-8B
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, d, hidden", ROPE_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("block_size", [16, 256])
def test_qkv_rope_matches_the_two_calls(dtype, heads, kv_heads, d, hidden, bias, block_size, monkeypatch):
    check_rope(RopeCase(dtype, heads, kv_heads, d, hidden, block_size, bias=bias, residual=bias,
                        slots=[block_size + 3], positions=[37], seed=heads + d + block_size), monkeypatch)


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot, slot_dtype", [(0, torch.int64), (79, torch.int32), (-1, torch.int64),
                                              (80, torch.int64), (2**31 - 1, torch.int32)])
@pytest.mark.parametrize("position", [0, 63, 64, -1])
def test_qkv_rope_edges(dtype, slot, slot_dtype, position, monkeypatch):
    """Slots at both ends of a 5 x 16 cache and outside it (skipped), int32 and int64 slot
    mappings, positions at both ends of a 64-row table and outside it (q and k unrotated)."""
    check_rope(RopeCase(dtype, 4, 2, 64, 256, 16, bias=True, residual=False, slots=[slot], positions=[position],
                        slot_dtype=slot_dtype, seed=slot % 97 + position), monkeypatch)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_qk_norm_and_several_tokens(qk_norm, monkeypatch):
    """Qwen3's per-head q/k norm, and M = 3 tokens (one of them padding, slot -1)."""
    check_rope(RopeCase(torch.bfloat16, 4, 2, 64, 256, 16, bias=False, residual=True, slots=[5, -1, 40],
                        positions=[3, 4, 63], qk_norm=qk_norm, seed=7), monkeypatch)
