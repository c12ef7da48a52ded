"""GPU tests of paged attention (csrc/attention_paged_sm80.cu, tileattn.api_paged.attention_paged)
against the float64 reference (tileattn.reference.attention_paged) on the same quantized inputs.

Cases are built like an engine's: a cache of random blocks (unused blocks random too), block tables
with shuffled non-contiguous blocks, a block shared by two sequences (prefix caching), and junk
(random int32, mostly far out of range) in every table entry past a sequence's length, which the
kernel must never use (it may read ahead the entries of a split's first tiles). Sequences mix
decode (1 query), speculative runs (a few), chunked prefill (a chunk after a cached prefix) and
key lengths 1, block_size - 1, block_size, block_size + 1 and long ones. Outputs are NaN-poisoned before each launch (passed to the launch layer; the API path
allocates inside tests/gpu/conftest.py's poisoned_allocations, workspaces too) so an unwritten
element fails. Only rows covered by cu_seqlens_q are compared.

Tolerances as tests/gpu/test_attention_fwd.py: P is rounded to the input dtype before P @ V, so
||out - ref|| / ||ref|| <= 1e-2 (bf16) / 2e-3 (fp16); split-KV partials and their combine are fp32.

Markers: `gpu` (all), `sanitize` (small cases re-run under compute-sanitizer by make gpu-check).
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

from tileattn import api_paged, reference
from tileattn.runtime import device_arch
from tileattn.kernels import attention_paged_sm80 as paged

from .conftest import poisoned_allocations

HOPPER = os.environ.get("TILEATTN_TEST_HOPPER_INFERENCE") == "1"


@pytest.fixture(scope="module", autouse=True)
def _hopper_paged_table():
    """TILEATTN_TEST_HOPPER_INFERENCE=1: every case of this file that goes through attention_paged
    with the Hopper paged prefill switched on in the dispatcher (api.hopper_kernels_forced),
    wherever the call is prefill-shaped; launch-layer cases are unchanged."""
    if not HOPPER:
        yield
        return
    from tileattn.api import hopper_kernels_forced

    with hopper_kernels_forced():
        yield

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
TOL = {BF16: 1e-2, FP16: 2e-3}


class Case:
    """A paged-attention problem: packed q, caches, block table and lengths (CUDA tensors)."""

    def __init__(self, seqs, heads, kv_heads, head_dim, dtype, block_size, seed, *, share=True, spare=3, pad=2,
                 pad_tokens=0):
        cpu = torch.Generator().manual_seed(seed)
        gpu = torch.Generator(device="cuda").manual_seed(seed)
        self.seqs, self.dtype, self.block_size = seqs, dtype, block_size
        pages = [-(-nk // block_size) for _, nk in seqs]
        self.num_blocks = sum(pages) + spare
        order = torch.randperm(self.num_blocks, generator=cpu).tolist()
        max_blocks = max(pages, default=0) + pad
        # Junk everywhere first: past a sequence's length the kernel must not use the table.
        table = torch.randint(-(2**31), 2**31 - 1, (len(seqs), max_blocks), generator=cpu, dtype=torch.int64)
        table = table.to(torch.int32)
        for b, n in enumerate(pages):
            table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
        if share and len(seqs) > 1 and min(seqs[0][1], seqs[1][1]) > block_size:
            table[1, 0] = table[0, 0]  # a prefix-cache hit: both sequences read one block
        shape = (self.num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = torch.randn(shape, device="cuda", generator=gpu).to(dtype)
        self.v_cache = torch.randn(shape, device="cuda", generator=gpu).to(dtype)
        tq = sum(nq for nq, _ in seqs)
        # [Tq, H, d]; pad_tokens rows past cu_seqlens_q[B] (an engine's CUDA-graph padding)
        self.q = torch.randn(tq + pad_tokens, heads, head_dim, device="cuda", generator=gpu).to(dtype)
        self.block_table = table.cuda()
        cu = [0]
        for nq, _ in seqs:
            cu.append(cu[-1] + nq)
        self.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device="cuda")
        self.seqlens_k = torch.tensor([nk for _, nk in seqs], dtype=torch.int32, device="cuda")
        self.max_seqlen_q = max((nq for nq, _ in seqs), default=0)
        self.max_seqlen_k = max((nk for _, nk in seqs), default=0)

    def tensors(self):
        return self.q, self.k_cache, self.v_cache, self.block_table, self.cu_seqlens_q, self.seqlens_k

    def reference(self, causal=True, scale=None, **variants):
        return reference.attention_paged(
            *self.tensors(), self.max_seqlen_q, self.max_seqlen_k, causal=causal, scale=scale,
            return_lse=True, compute_dtype=torch.float64, **variants,
        )  # fmt: skip

    def api(self, causal=True, num_splits=None, **variants):
        """The public op with every allocation NaN-poisoned: (out, lse)."""
        with poisoned_allocations():
            return api_paged.attention_paged(*self.tensors(), self.max_seqlen_q, self.max_seqlen_k, causal=causal,
                                             return_lse=True, num_splits=num_splits, **variants)

    def launch(self, causal=True, scale=None, num_splits=None, config=None):
        """The launch layer with NaN-poisoned out / lse (and NaN-filled workspace blocks); `config`:
        a tile config given explicitly (tuning candidates), else the dispatcher's choice."""
        scale = 1.0 / math.sqrt(self.q.shape[-1]) if scale is None else scale
        launch = paged.PagedLaunch(
            self.q, self.k_cache, self.v_cache, self.block_table, max_seqlen_q=self.max_seqlen_q, causal=causal,
            scale=scale, return_lse=True, num_splits=num_splits, config=config,
        )  # fmt: skip
        out = torch.full_like(self.q, float("nan"))
        lse = torch.full((self.q.shape[1], self.q.shape[0]), float("nan"), device="cuda")
        with poisoned_allocations():  # the split-KV workspaces start as NaN
            launch(*self.tensors(), out=out, lse=lse)
        return out, lse, launch


def rel_err(out, ref) -> float:
    ref = ref.double()
    den = ref.norm().item()
    num = (out.double() - ref).norm().item()
    return num / den if den > 0 else num


def check(case, out, lse, ref_out, ref_lse, what):
    """Covered rows of out [Tq, H, d] / lse [H, Tq] against the float64 reference."""
    rows = int(case.cu_seqlens_q[-1])
    out, lse, ref_out, ref_lse = out[:rows], lse[:, :rows], ref_out[:rows], ref_lse[:, :rows]
    assert out.dtype == case.dtype and out.shape == ref_out.shape, what
    assert not torch.isnan(out).any(), f"{what}: NaN in out (an unwritten row or a NaN-producing path)"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    err = rel_err(out, ref_out)
    assert err <= TOL[case.dtype], f"{what}: relative error {err:.3e} > {TOL[case.dtype]:g}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{what}: lse -inf pattern differs from the reference"
    if seen.any():
        diff = (lse.double() - ref_lse)[seen].abs()
        assert bool((diff <= 2e-4 * (1 + ref_lse[seen].abs())).all()), f"{what}: lse error {diff.max().item():.3e}"
    unseen = ~seen.t()  # [Tq, H]
    if unseen.any():
        assert bool((out[unseen] == 0).all()), f"{what}: rows that see no key must be exactly 0"
    return err


def check_replay(out, lse, ref_out, ref_lse, what):
    """A CUDA graph replay's static out [Tq, H, d] / lse [H, Tq] (bf16, every row covered) against
    the float64 reference: no NaN, relative error, lse within 2e-3."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{what}: NaN in out / lse"
    err = rel_err(out, ref_out)
    assert err <= TOL[BF16], f"{what}: relative error {err:.3e}"
    diff = (lse.double() - ref_lse).abs().max().item()
    assert diff <= 2e-3, f"{what}: lse differs by {diff:.3e}"


def check_padding(case, out, lse, what):
    """Rows past cu_seqlens_q[B] are exactly 0 (out) and -inf (lse): they belong to no sequence."""
    rows = int(case.cu_seqlens_q[-1])
    pad_out = out[rows:]
    assert pad_out.shape[0] == case.q.shape[0] - rows, what
    if pad_out.numel():
        bad = (pad_out != 0).flatten(1).any(dim=1)  # NaN != 0 too: an unwritten (poisoned) row
        assert not bad.any(), (
            f"{what}: padding rows past cu_seqlens_q[B]={rows} not all 0: tokens "
            f"{(bad.nonzero().flatten() + rows).tolist()[:10]} (first values {pad_out[bad][0].flatten()[:4].tolist()})")
    if lse is not None and pad_out.numel():
        pad_lse = lse[:, rows:]
        bad = pad_lse != float("-inf")
        assert not bad.any(), (
            f"{what}: lse of padding columns not -inf: {bad.sum().item()} entries, e.g. {pad_lse[bad][:4].tolist()}")


def capture(step):
    """Run ``step`` once on a side stream (kernels compiled, launch plans and workspaces built
    outside the capture), then capture it in a CUDA graph: returns (graph, step's outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def mixed_seqs(block_size):
    """Decode, speculative and chunked-prefill sequences with the edge key lengths, one batch."""
    bs = block_size
    return [
        (1, 1), (1, bs - 1), (1, bs), (1, bs + 1), (3, 2 * bs + 5), (1, 1000), (7, 7), (5, 300), (0, 9),
        (2, 2 * bs),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Correctness grid
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("head_dim", paged.HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (16, 2), (9, 3)])  # GQA 1, 4, 8, and 3 (SmolLM2)
@pytest.mark.parametrize("block_size", [16, 256])
def test_mixed_batch(dtype, head_dim, heads, kv_heads, block_size):
    seed = zlib.crc32(f"{head_dim} {heads} {kv_heads} {block_size} {dtype}".encode())
    case = Case(mixed_seqs(block_size), heads, kv_heads, head_dim, dtype, block_size, seed)
    ref_out, ref_lse = case.reference()
    out, lse, launch = case.launch()
    what = f"d={head_dim} H={heads}/{kv_heads} bs={block_size} {launch.config} splits={launch.num_splits}"
    check(case, out, lse, ref_out, ref_lse, what)


@pytest.mark.parametrize("head_dim", paged.HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (32, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_chunked_prefill_uses_every_warp_layout(head_dim, heads, kv_heads, causal):
    """max_seqlen_q * G of 129+ rows takes the 128-row prefill layout; one decode rides along."""
    seqs = [(129, 129 + 300), (1, 77), (33, 40)]
    case = Case(seqs, heads, kv_heads, head_dim, BF16, 32, seed=head_dim + heads + causal)
    ref_out, ref_lse = case.reference(causal=causal)
    out, lse, _ = case.launch(causal=causal)
    check(case, out, lse, ref_out, ref_lse, f"prefill d={head_dim} H={heads}/{kv_heads} causal={causal}")


@pytest.mark.parametrize(
    "group,nq,layout", [(1, 1, 0), (4, 4, 0), (8, 2, 0), (1, 17, 1), (4, 16, 1), (1, 65, 2), (8, 9, 2)]
)
def test_layout_boundaries(group, nq, layout):
    """Problems of max_seqlen_q * G = 1, 16, 17, 64, 65, 72 rows, each on its side of a layout boundary."""
    case = Case([(nq, nq + 50), (1, 20)], 4 * group, 4, 128, FP16, 16, seed=group * 100 + nq)
    ref_out, ref_lse = case.reference()
    out, lse, launch = case.launch()
    expected = paged.configs(128, device_arch())[layout]
    assert launch.config == expected, f"{nq * group} rows took {launch.config}, expected {expected}"
    check(case, out, lse, ref_out, ref_lse, f"G={group} nq={nq} ({launch.config})")


@pytest.mark.parametrize("head_dim", paged.HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 1)])
def test_forced_splits_equal_no_split(head_dim, heads, kv_heads):
    seqs = [(1, 2000), (1, 1), (3, 700), (1, 64), (1, 65)]
    case = Case(seqs, heads, kv_heads, head_dim, BF16, 16, seed=7 * head_dim + heads)
    ref_out, ref_lse = case.reference()
    base, base_lse, _ = case.launch(num_splits=1)
    check(case, base, base_lse, ref_out, ref_lse, "num_splits=1")
    for splits in (2, 3, 5, 16, 37, 128):
        out, lse, launch = case.launch(num_splits=splits)
        assert launch.num_splits == splits
        check(case, out, lse, ref_out, ref_lse, f"num_splits={splits}")
        diff = rel_err(out, base)
        assert diff <= TOL[BF16], f"num_splits={splits} differs from no split by {diff:.3e}"


# Decode tuning candidates (kernels.attention_paged_sm80.DECODE_TUNING, timed by `bench decode
# --sweep`; bf16 d=128 instantiations only): decode and speculative rows of one token's group
# (max_seqlen_q * G <= 16, the decode tile's rows), lengths around the 32-, 64- and 128-key tile
# edges and past the 4096-key point, junk past each table row, split counts automatic, none, odd,
# and more splits than some sequences have tiles.
DECODE_TUNING_CASES = {
    "gqa4_bs16": ([(1, 1), (1, 31), (1, 32), (1, 33), (4, 127), (1, 129), (1, 1000), (1, 4097), (0, 9), (2, 64)],
                  16, 4, 16),
    "gqa8_bs256": ([(1, 255), (2, 256), (1, 257), (1, 4097), (1, 1)], 32, 4, 256),
}


@pytest.mark.parametrize("config", paged.DECODE_TUNING[128], ids=str)
@pytest.mark.parametrize("name", list(DECODE_TUNING_CASES))
@pytest.mark.parametrize("num_splits", [None, 1, 3, 16])
def test_decode_tuning_configs(config, name, num_splits):
    from tileattn.runtime import device_smem_optin

    if config.smem_bytes(128) > device_smem_optin(torch.cuda.current_device()):
        pytest.skip(f"{config}: {config.smem_bytes(128)} bytes of shared memory, more than this GPU allows")
    seqs, heads, kv_heads, block_size = DECODE_TUNING_CASES[name]
    case = Case(seqs, heads, kv_heads, 128, BF16, block_size, seed=zlib.crc32(f"{config} {name}".encode()))
    ref_out, ref_lse = case.reference()
    out, lse, launch = case.launch(num_splits=num_splits, config=config)
    assert launch.config == config, f"asked for {config}, launched {launch.config}"
    if num_splits is not None:
        assert launch.num_splits == num_splits, f"asked for {num_splits} splits, launched {launch.num_splits}"
    check(case, out, lse, ref_out, ref_lse, f"{name} {config} splits={launch.num_splits}")


@pytest.mark.sanitize
@pytest.mark.parametrize("config", paged.DECODE_TUNING[128], ids=str)
def test_decode_tuning_configs_small_sanitize(config):
    """One small split case per candidate (also run under compute-sanitizer)."""
    from tileattn.runtime import device_smem_optin

    if config.smem_bytes(128) > device_smem_optin(torch.cuda.current_device()):
        pytest.skip(f"{config}: {config.smem_bytes(128)} bytes of shared memory, more than this GPU allows")
    case = Case([(1, 17), (2, 150), (0, 3), (1, 0)], 8, 2, 128, BF16, 16, seed=13)
    ref_out, ref_lse = case.reference()
    out, lse, launch = case.launch(num_splits=3, config=config)
    check(case, out, lse, ref_out, ref_lse, f"small {config} splits=3")


@pytest.mark.sanitize
@pytest.mark.parametrize("num_splits", [1, 3])
def test_small_sanitize(num_splits):
    """Small mixed case (also run under compute-sanitizer)."""
    case = Case([(1, 17), (2, 33), (0, 3), (1, 0)], 8, 2, 64, FP16, 16, seed=11)
    ref_out, ref_lse = case.reference()
    out, lse, _ = case.launch(num_splits=num_splits)
    check(case, out, lse, ref_out, ref_lse, f"small num_splits={num_splits}")


# ---------------------------------------------------------------------------------------------
# Effective split count: a table sized for far more keys than the lengths (an engine's decode graph)
# ---------------------------------------------------------------------------------------------
# The host picks num_splits from the table's capacity; each (M tile, KV head, sequence) group runs
# S = min(num_splits, max(1, its key tiles)) of them (splits >= S leave at once, S == 1 writes out
# directly, the combine reads S partials, the S-th arrival resets the counter). Lengths around the
# 16-key block and 64-key tile edges and long ones in one batch, a table for 32k keys (junk past
# each length), query counts: decode (1), speculative (1..5: the 16- and 64-row tiles) and a chunk
# of 40 (the 128-row tile at G = 4; rows of the chunk with no key in a short sequence).
EFFECTIVE_LENGTHS = (1, 15, 16, 17, 31, 33, 64, 65, 127, 129, 1000, 4097)
EFFECTIVE_QUERIES = {
    "decode": (1,) * 12,
    "spec": (1, 3, 1, 5, 2, 1, 4, 1, 3, 5, 1, 2),
    "chunk": (1, 3, 1, 5, 40, 1, 4, 1, 3, 5, 40, 2),
}


def counters_nonzero(stream=None) -> int:
    """Split-KV arrival counters left non-zero in the buffer of `stream` (default: the current one),
    which a split launch on that stream has created: every launch must leave them 0."""
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    raw = (stream or torch.cuda.current_stream()).cuda_stream
    c = paged._counters.get((device, raw))
    assert c is not None, "no split-KV counters for this stream: no split launch ran on it"
    return int(torch.count_nonzero(c.tensor))


@pytest.mark.parametrize("queries", list(EFFECTIVE_QUERIES))
@pytest.mark.parametrize("num_splits", [None, 1, 2, 7, 32, 128])
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (8, 8)])  # GQA 4 (Llama-3-8B), MHA
@pytest.mark.parametrize("head_dim", [64, 128])
def test_effective_splits_with_a_large_table(head_dim, heads, kv_heads, num_splits, queries):
    seqs = list(zip(EFFECTIVE_QUERIES[queries], EFFECTIVE_LENGTHS))
    bs = 16
    pages = -(-max(EFFECTIVE_LENGTHS) // bs)
    case = Case(seqs, heads, kv_heads, head_dim, BF16, bs, pad=32768 // bs - pages,
                seed=zlib.crc32(f"effective {head_dim} {heads} {kv_heads} {num_splits} {queries}".encode()))
    assert case.block_table.shape[1] * bs == 32768
    ref_out, ref_lse = case.reference()
    first = None
    for run in range(2):  # the second launch finds the counters the first one left
        out, lse, launch = case.launch(num_splits=num_splits)
        what = f"{queries} d={head_dim} H={heads}/{kv_heads} {launch.config} splits={launch.num_splits} run {run}"
        if num_splits is not None:
            assert launch.num_splits == num_splits, f"{what}: asked for {num_splits} splits"
        check(case, out, lse, ref_out, ref_lse, what)
        if launch.num_splits > 1:
            left = counters_nonzero()
            assert left == 0, f"{what}: {left} split-KV arrival counters left non-zero"
        if first is None:
            first = out, lse
        else:  # the combine sums splits 0 .. S-1 in order: a rerun is bit-identical
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), f"{what}: differs from run 0"


@pytest.mark.parametrize("name", ["window_small", "window_left_right", "softcap_extreme", "all"])
@pytest.mark.parametrize("num_splits", [2, 32, 128])
@pytest.mark.parametrize("queries", ["decode", "spec"])
def test_effective_splits_variants(name, num_splits, queries):
    """The variant kernel (same body): with a window the group's tiles start at its first tile, so
    S counts the tiles from there; softcap / ALiBi alone start at tile 0 (and read the prologue's
    block ids before the lengths, like the plain kernel). Public op, a table for 32k keys, twice."""
    seqs = list(zip(EFFECTIVE_QUERIES[queries], EFFECTIVE_LENGTHS))
    bs = 16
    pages = -(-max(EFFECTIVE_LENGTHS) // bs)
    seed = zlib.crc32(f"effective variants {name} {num_splits} {queries}".encode())
    case = Case(seqs, 32, 8, 128, BF16, bs, pad=32768 // bs - pages, seed=seed)
    options, causal = variant_options(case, name, seed)
    ref_out, ref_lse = case.reference(causal=causal, **options)
    first = None
    for run in range(2):
        out, lse = case.api(causal=causal, num_splits=num_splits, **options)
        what = f"{name} {queries} num_splits={num_splits} run {run}"
        check(case, out, lse, ref_out, ref_lse, what)
        left = counters_nonzero()
        assert left == 0, f"{what}: {left} split-KV arrival counters left non-zero"
        if first is None:
            first = out, lse
        else:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), f"{what}: differs from run 0"


@pytest.mark.sanitize
@pytest.mark.parametrize("num_splits", [1, 7, 32])
def test_effective_splits_small_sanitize(num_splits):
    """Small version (also run under compute-sanitizer): a table for 2k keys, lengths of 1 tile,
    2 tiles and a block edge; a speculative run; a sequence without keys."""
    seqs = [(1, 1), (1, 17), (3, 65), (1, 0)]
    case = Case(seqs, 8, 2, 64, FP16, 16, seed=17 + num_splits, pad=2048 // 16 - 5)
    ref_out, ref_lse = case.reference()
    for run in range(2):
        out, lse, launch = case.launch(num_splits=num_splits)
        check(case, out, lse, ref_out, ref_lse, f"small splits={launch.num_splits} run {run}")
        if launch.num_splits > 1:
            left = counters_nonzero()
            assert left == 0, f"small splits={num_splits} run {run}: {left} arrival counters left non-zero"


@pytest.mark.parametrize("shape", ["llama3_8b_b1", "mixed_b12"])
def test_effective_splits_in_a_cuda_graph_as_lengths_change(shape):
    """One decode launch captured in a CUDA graph for the table's capacity (automatic split count
    for Llama-3-8B's B=1 shape, 32 forced splits for a mixed batch), replayed with lengths that
    move the effective split count up and down: a long step first (every split writes a partial,
    and the graph's workspace keeps them), then short ones, so a combine that read more than S
    partials would pick up stale ones and differ from the reference. Counters are 0 at the end."""
    bs, d = 16, 128
    if shape == "llama3_8b_b1":
        batch, heads, kv_heads, max_blocks, num_splits = 1, 32, 8, 8192 // bs, None
        # after each long step (every split writes a partial) one with 2 <= S < num_splits
        steps = [[288], [8000], [129], [33], [1], [4097], [65], [64], [17]]
    else:
        batch, heads, kv_heads, max_blocks, num_splits = 12, 32, 8, 32768 // bs, 32
        long = list(EFFECTIVE_LENGTHS)
        steps = [long, [30000 - 7 * i for i in range(batch)], long[::-1], [1] * batch, long]
    num_blocks = batch * max_blocks // 4 + 8  # shuffled blocks, shared between steps' tables
    gen = torch.Generator(device="cuda").manual_seed(31)
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", generator=gen).to(BF16)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", generator=gen).to(BF16)
    q = torch.zeros(batch, heads, d, device="cuda", dtype=BF16)  # static inputs of the graph
    table = torch.zeros(batch, max_blocks, device="cuda", dtype=torch.int32)
    seqlens_k = torch.ones(batch, device="cuda", dtype=torch.int32)
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)

    def refill(step):
        cpu = torch.Generator().manual_seed(1000 + step)
        lengths = torch.tensor(steps[step], dtype=torch.int32)
        # junk everywhere, then real blocks (random, repeating across sequences) below each length
        junk = torch.randint(-(2**31), 2**31 - 1, (batch, max_blocks), generator=cpu, dtype=torch.int64)
        real = torch.randint(0, num_blocks, (batch, max_blocks), generator=cpu, dtype=torch.int64)
        used = torch.arange(max_blocks)[None, :] < (lengths[:, None] + bs - 1) // bs
        table.copy_(torch.where(used, real, junk).to(torch.int32))
        seqlens_k.copy_(lengths)
        q.copy_(torch.randn(q.shape, generator=cpu).to(BF16))
        return lengths.tolist()

    refill(0)
    launch = paged.PagedLaunch(q, k_cache, v_cache, table, max_seqlen_q=1, causal=True, scale=d**-0.5,
                               return_lse=True, num_splits=num_splits)
    if num_splits is None:
        assert launch.num_splits > 8, f"B=1 decode of a {max_blocks * bs}-key table: {launch.num_splits} splits"
    step = lambda: launch(q, k_cache, v_cache, table, cu_q, seqlens_k)  # noqa: E731
    side, capture_stream = torch.cuda.Stream(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the kernel loaded and the side stream's counters made outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):  # its counters are born (zeroed) inside the graph
        static_out, static_lse = step()
    for step in range(1, len(steps)):
        lengths = refill(step)
        static_out.fill_(float("nan"))
        static_lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference.attention_paged(q, k_cache, v_cache, table, cu_q, seqlens_k, 1,
                                                     max_blocks * bs, return_lse=True, compute_dtype=torch.float64)
        check_replay(static_out, static_lse, ref_out, ref_lse,
                     f"{shape} splits={launch.num_splits} replay {step} (lengths {lengths})")
    left = counters_nonzero(capture_stream)
    assert left == 0, f"{shape}: {left} split-KV arrival counters left non-zero after the replays"


# ---------------------------------------------------------------------------------------------
# Rows past cu_seqlens_q[B] (token padding): exactly 0, lse -inf, written by the kernel
# ---------------------------------------------------------------------------------------------
PADDING_CASES = {
    "decode": ([(1, 40), (1, 17), (1, 300)], 8, 2, 128, 16),
    "mixed": ([(1, 33), (3, 70), (0, 5), (2, 20)], 8, 2, 64, 16),
    "prefill": ([(129, 400), (1, 77)], 8, 8, 128, 256),  # the 128-row layout
    "d256": ([(1, 500), (4, 40)], 4, 1, 256, 16),
    "all_padding": ([(0, 9), (0, 1)], 4, 4, 64, 16),  # cu_seqlens_q[B] = 0: every row is padding
}


@pytest.mark.parametrize("name", list(PADDING_CASES))
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("pad_tokens", [1, 37, 300])
def test_padding_rows_are_zero(name, num_splits, pad_tokens):
    seqs, heads, kv_heads, d, bs = PADDING_CASES[name]
    case = Case(seqs, heads, kv_heads, d, BF16, bs, seed=zlib.crc32(name.encode()) + pad_tokens, pad_tokens=pad_tokens)
    ref_out, ref_lse = case.reference()
    max_q = max(case.max_seqlen_q, 1)  # all_padding: a launch still happens (max_seqlen_q 0 would skip it)
    for return_lse in (True, False):
        with poisoned_allocations():
            result = api_paged.attention_paged(*case.tensors(), max_q, case.max_seqlen_k, return_lse=return_lse,
                                               num_splits=num_splits)
        out, lse = result if return_lse else (result, None)
        what = f"{name} pad_tokens={pad_tokens} num_splits={num_splits} return_lse={return_lse}"
        assert out.shape == case.q.shape, what
        check_padding(case, out, lse, what)
        if return_lse:
            check(case, out, lse, ref_out, ref_lse, what)


@pytest.mark.sanitize
@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_rows_small_sanitize(num_splits):
    """Small padded batch (also run under compute-sanitizer: initcheck must see every output written)."""
    case = Case([(1, 17), (2, 33), (0, 3)], 8, 2, 64, FP16, 16, seed=13, pad_tokens=5)
    ref_out, ref_lse = case.reference()
    with poisoned_allocations():
        out, lse = api_paged.attention_paged(*case.tensors(), case.max_seqlen_q, case.max_seqlen_k, return_lse=True,
                                             num_splits=num_splits)
    what = f"small padded num_splits={num_splits}"
    check(case, out, lse, ref_out, ref_lse, what)
    check_padding(case, out, lse, what)
    out2 = out + 1.0  # an engine's residual add over every row: initcheck reads all of out here
    assert not torch.isnan(out2).any(), f"{what}: NaN after adding 1 to every row"


def test_padding_rows_follow_device_lengths_in_a_cuda_graph():
    """One graph captured for 8 token slots, replayed while cu_seqlens_q[B] moves (the padding moves
    with it): rows written by an earlier replay must come back as 0 when they become padding."""
    heads, kv_heads, d, bs, max_blocks, num_blocks, slots = 8, 2, 128, 16, 8, 64, 8
    gen = torch.Generator(device="cuda").manual_seed(17)
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", generator=gen).to(BF16)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", generator=gen).to(BF16)
    q = torch.randn(slots, heads, d, device="cuda", generator=gen).to(BF16)
    table = torch.randperm(num_blocks, device="cuda")[: slots * max_blocks].view(slots, max_blocks).int()
    seqlens_k = torch.full((slots,), 50, device="cuda", dtype=torch.int32)
    cu_q = torch.arange(slots + 1, device="cuda", dtype=torch.int32)

    def step():
        return api_paged.attention_paged(q, k_cache, v_cache, table, cu_q, seqlens_k, 1, max_blocks * bs,
                                         return_lse=True)

    graph, (static_out, static_lse) = capture(step)
    for live in (8, 3, 6, 0, 1):
        # `live` decodes, then empty sequences: cu_seqlens_q[B] = live, rows live.. are padding
        cu_q.copy_(torch.tensor([min(b, live) for b in range(slots + 1)], dtype=torch.int32))
        static_out.fill_(float("nan"))
        static_lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference.attention_paged(q, k_cache, v_cache, table, cu_q, seqlens_k, 1, max_blocks * bs,
                                                     return_lse=True, compute_dtype=torch.float64)
        what = f"graph replay with {live} live tokens of {slots}"
        assert torch.equal(static_out[live:].double(), ref_out[live:]), f"{what}: padding rows not 0"
        assert bool((static_lse[:, live:] == float("-inf")).all()), f"{what}: padding lse not -inf"
        if live:
            err = rel_err(static_out[:live], ref_out[:live])
            assert err <= TOL[BF16], f"{what}: relative error {err:.3e}"


# ---------------------------------------------------------------------------------------------
# Variants (issue #15): window, softcap, ALiBi against the float64 reference with the same options
# ---------------------------------------------------------------------------------------------
# name -> (options, causal, q multiplier). Windows smaller and larger than the lengths (mixed_seqs
# has keys up to 1000), one key each (0, 0), right > 0 without causal; softcap 5 with q x 8
# (|s| ~ 8 sigma: a saturated tanh); ALiBi [H] and [B, H]; everything at once.
VARIANTS = {
    "window_small": ({"window": (40, 0)}, True, 1.0),
    "window_left_right": ({"window": (100, 7)}, False, 1.0),
    "window_large": ({"window": (5000, 5000)}, False, 1.0),
    "window_zero": ({"window": (0, 0)}, False, 1.0),
    "softcap_extreme": ({"softcap": 5.0}, True, 8.0),
    "alibi_h": ({"alibi": "h"}, True, 1.0),
    "alibi_bh": ({"alibi": "bh"}, False, 1.0),
    "all": ({"window": (64, 0), "softcap": 20.0, "alibi": "bh"}, True, 2.0),
}


def variant_options(case, name, seed):
    """(options for attention_paged / the reference, causal); q scaled in place."""
    spec, causal, mult = VARIANTS[name]
    options = {k: v for k, v in spec.items() if k != "alibi"}
    if "alibi" in spec:
        heads = case.q.shape[1]
        shape = (heads,) if spec["alibi"] == "h" else (len(case.seqs), heads)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        options["alibi_slopes"] = 0.5 * torch.rand(shape, device="cuda", generator=gen)  # fp32
    if mult != 1.0:
        case.q = (case.q.float() * mult).to(case.dtype)
    return options, causal


def variant_seqs(block_size):
    """mixed_seqs plus a sequence with more queries than keys (its first rows see no key in a window)."""
    return [*mixed_seqs(block_size), (5, 3)]


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 256])
def test_variants_mixed_batch(name, dtype, head_dim, block_size):
    """Decode, speculative and chunked-prefill rows (GQA 8/2) with each variant, against the float64
    reference; forced split counts 1, 3 and 16 give the reference's result and split 1's."""
    seed = zlib.crc32(f"variants {name} {dtype} {head_dim} {block_size}".encode())
    case = Case(variant_seqs(block_size), 8, 2, head_dim, dtype, block_size, seed)
    options, causal = variant_options(case, name, seed)
    ref_out, ref_lse = case.reference(causal=causal, **options)
    base = None
    for splits in (None, 1, 3, 16):
        out, lse = case.api(causal=causal, num_splits=splits, **options)
        what = f"{name} {dtype} d={head_dim} bs={block_size} causal={causal} num_splits={splits}"
        check(case, out, lse, ref_out, ref_lse, what)
        if splits == 1:
            base = out
        elif base is not None:
            diff = rel_err(out[: int(case.cu_seqlens_q[-1])], base[: int(case.cu_seqlens_q[-1])])
            assert diff <= TOL[dtype], f"{what}: differs from num_splits=1 by {diff:.3e}"


@pytest.mark.parametrize("name", ["window_small", "softcap_extreme", "all"])
@pytest.mark.parametrize("head_dim", paged.HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (32, 4)])
def test_variants_chunked_prefill_layouts(name, head_dim, heads, kv_heads):
    """max_seqlen_q * G of 129+ rows: the 128-row prefill layout, every head dim, MHA and GQA 8;
    the last sequence has more queries than keys."""
    seed = zlib.crc32(f"prefill variants {name} {head_dim} {heads}".encode())
    case = Case([(129, 129 + 300), (1, 77), (33, 40), (40, 20)], heads, kv_heads, head_dim, BF16, 32, seed)
    options, causal = variant_options(case, name, seed)
    ref_out, ref_lse = case.reference(causal=causal, **options)
    for splits in (None, 1, 4):
        out, lse = case.api(causal=causal, num_splits=splits, **options)
        check(case, out, lse, ref_out, ref_lse, f"prefill {name} d={head_dim} H={heads}/{kv_heads} splits={splits}")


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("rows", ["decode", "prefill"])
def test_window_skips_key_tiles_outside_it(block_size, num_splits, rows):
    """V is NaN at every key position before the first 64-key tile that any query's window reaches:
    a kernel that loaded such a tile would multiply its zero probabilities by NaN. The reference
    runs on the clean cache."""
    nq = 1 if rows == "decode" else 100
    seqs = [(nq, 3000), (nq, 700), (1, 130)]
    case = Case(seqs, 8, 2, 128, BF16, block_size, seed=31 + nq + block_size, share=False)
    left = 70
    ref_out, ref_lse = case.reference(causal=True, window=(left, 0))
    table = case.block_table.cpu()
    for b, (nq_b, nk) in enumerate(seqs):
        first_pos = nk - nq_b  # the first query's key position; its window starts at first_pos - left
        poison_end = (max(first_pos - left, 0) // 64) * 64
        keys = torch.arange(poison_end)
        case.v_cache[table[b, keys // block_size].long().cuda(), (keys % block_size).cuda()] = float("nan")
    out, lse = case.api(causal=True, num_splits=num_splits, window=(left, 0))
    check(case, out, lse, ref_out, ref_lse, f"window skip {rows} bs={block_size} num_splits={num_splits}")


def test_variants_plan_reuse_new_slopes_and_plain_call_unchanged():
    """A cached variant launch takes the slopes' pointer per call (new slopes of the same shape give
    the new result); a plain call after variant calls is still the plain op."""
    case = Case([(1, 300), (3, 50)], 8, 2, 64, BF16, 16, seed=77)
    plain_ref = case.reference()
    for trial in range(2):
        slopes = torch.rand(8, device="cuda", generator=torch.Generator(device="cuda").manual_seed(trial))
        ref_out, ref_lse = case.reference(alibi_slopes=slopes)
        out, lse = case.api(alibi_slopes=slopes)
        check(case, out, lse, ref_out, ref_lse, f"ALiBi slopes draw {trial}")
    out, lse = case.api()
    check(case, out, lse, *plain_ref, "plain call after variant calls")


def test_variants_cuda_graph_replays_with_new_lengths():
    """A sliding-window + ALiBi decode step captured once (forced splits: the window's first tile
    and the split strides come from the device-side lengths at each replay), replayed with new
    lengths, tables and slopes' values."""
    batch, heads, kv_heads, d, bs, max_blocks, num_blocks = 4, 8, 2, 128, 16, 32, 160
    gen = torch.Generator(device="cuda").manual_seed(23)
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", generator=gen).to(BF16)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", generator=gen).to(BF16)
    q = torch.zeros(batch, heads, d, device="cuda", dtype=BF16)
    table = torch.zeros(batch, max_blocks, device="cuda", dtype=torch.int32)
    seqlens_k = torch.ones(batch, device="cuda", dtype=torch.int32)
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    slopes = torch.zeros(heads, device="cuda")
    window = (100, 0)

    def step():
        return api_paged.attention_paged(q, k_cache, v_cache, table, cu_q, seqlens_k, 1, max_blocks * bs,
                                         return_lse=True, num_splits=4, window=window, alibi_slopes=slopes)

    graph, (static_out, static_lse) = capture(step)
    for replay in range(3):
        cpu = torch.Generator().manual_seed(100 + replay)
        lengths = torch.randint(1, max_blocks * bs + 1, (batch,), generator=cpu)
        lengths[replay % batch] = (1, 99, 300)[replay]
        table.copy_(torch.randperm(num_blocks, generator=cpu)[: batch * max_blocks].view(batch, max_blocks).int())
        seqlens_k.copy_(lengths.int())
        q.copy_(torch.randn(q.shape, generator=cpu).to(BF16))
        slopes.copy_(torch.rand(heads, generator=cpu))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference.attention_paged(q, k_cache, v_cache, table, cu_q, seqlens_k, 1, max_blocks * bs,
                                                     return_lse=True, compute_dtype=torch.float64, window=window,
                                                     alibi_slopes=slopes)
        err = rel_err(static_out, ref_out)
        assert err <= TOL[BF16], f"replay {replay} (lengths {lengths.tolist()}): relative error {err:.3e}"
        assert torch.allclose(static_lse.double(), ref_lse, atol=2e-3), f"replay {replay}: lse differs"


@pytest.mark.sanitize
@pytest.mark.parametrize("num_splits", [1, 3])
def test_variants_small_sanitize(num_splits):
    """Small case with every variant, padding rows and a query without keys (also under compute-sanitizer)."""
    case = Case([(1, 17), (2, 33), (0, 3), (3, 2)], 8, 2, 64, FP16, 16, seed=19, pad_tokens=3)
    options, causal = variant_options(case, "all", 19)
    ref_out, ref_lse = case.reference(causal=causal, **options)
    out, lse = case.api(causal=causal, num_splits=num_splits, **options)
    what = f"small variants num_splits={num_splits}"
    check(case, out, lse, ref_out, ref_lse, what)
    check_padding(case, out, lse, what)


# ---------------------------------------------------------------------------------------------
# Bad device-side contents: never read outside the caches, masked like the reference
# ---------------------------------------------------------------------------------------------
def spoil_block_table(case) -> None:
    """Bad device-side contents in a 3-sequence Case (block_size 16, sequences of >= 80, >= 16 and
    >= 16 keys): block ids outside [0, num_blocks) inside sequences 0 and 1, the int32 extremes, and
    sequence 2's length past the table's capacity. The kernels must mask those keys (the
    reference's rule) and never read them."""
    table = case.block_table
    table[0, 1] = -1  # keys 16..31 of sequence 0
    table[0, 4] = case.num_blocks  # keys 64..79
    table[1, 0] = 2**31 - 1  # keys 0..15 of sequence 1
    table[2, 0] = -(2**31)
    case.seqlens_k[2] = 10_000  # past the table's capacity: only the table's keys are visited


@pytest.mark.sanitize
@pytest.mark.parametrize("num_splits", [1, 4])
def test_out_of_range_block_ids_are_masked(num_splits):
    case = Case([(1, 100), (2, 70), (1, 40)], 8, 2, 128, BF16, 16, seed=5, share=False)
    spoil_block_table(case)
    ref_out, ref_lse = case.reference()
    out, lse, _ = case.launch(num_splits=num_splits)
    check(case, out, lse, ref_out, ref_lse, f"bad block ids, num_splits={num_splits}")
    with pytest.raises(ValueError, match="block_table"):
        reference.check_paged_contents(case.k_cache, case.block_table, case.cu_seqlens_q, case.seqlens_k, 2, 10_000)


@pytest.mark.parametrize("head_dim", paged.HEAD_DIMS)
@pytest.mark.parametrize("nq", [1, 5, 100])  # the 16-row key-split tile, the 64-row tile, the 128-row tile (G = 4)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_loader_copies_no_row_past_the_length(head_dim, nq, block_size, num_splits):
    """K and V are NaN in every cache row past a sequence's length (the rest of its last block):
    the loader's threads own runs of 1-4 consecutive rows of a block, and a run that straddles the
    length must copy only the rows below it and zero-fill the rest (a copied NaN V row times its
    probability 0 is NaN). Lengths end at every offset of a 4-row run and around the 64-key tile
    edge. The reference runs on the clean cache."""
    seqs = [(nq, nq + extra) for extra in (60, 61, 62, 63, 64, 65, 66, 67, 130)]
    case = Case(seqs, 8, 2, head_dim, BF16, block_size, seed=41 + head_dim + nq + block_size, share=False)
    ref_out, ref_lse = case.reference()
    table = case.block_table.cpu()
    for b, (_, nk) in enumerate(seqs):
        keys = torch.arange(nk, -(-nk // block_size) * block_size)
        blocks, rows = table[b, keys // block_size].long().cuda(), (keys % block_size).cuda()
        case.k_cache[blocks, rows] = float("nan")
        case.v_cache[blocks, rows] = float("nan")
    out, lse, launch = case.launch(num_splits=num_splits)
    check(case, out, lse, ref_out, ref_lse,
          f"NaN past the lengths, d={head_dim} nq={nq} bs={block_size} num_splits={num_splits} ({launch.config})")


def test_validate_raises_on_bad_contents():
    case = Case([(1, 20), (1, 40)], 4, 4, 64, BF16, 16, seed=3)
    args = (*case.tensors(), case.max_seqlen_q, case.max_seqlen_k)
    api_paged.attention_paged(*args, validate=True)  # good contents pass
    case.block_table[1, 2] = case.num_blocks
    with pytest.raises(ValueError, match=r"block_table\[1, 2\]"):
        api_paged.attention_paged(*args, validate=True)
    case.block_table[1, 2] = 0
    case.seqlens_k[0] = 100
    with pytest.raises(ValueError, match=r"seqlens_k\[0\] = 100"):
        api_paged.attention_paged(*args, validate=True)


# ---------------------------------------------------------------------------------------------
# The public op: layouts, lse, dtypes, a CUDA graph
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_api_strided_q_and_cache_views(dtype):
    """q as a view of a fused qkv projection output, caches as views with padded heads."""
    seqs = [(1, 300), (4, 60), (1, 17)]
    case = Case(seqs, 8, 2, 128, dtype, 16, seed=21)
    tq = case.q.shape[0]
    qkv = torch.randn(tq, 8 + 4, 128, device="cuda").to(dtype)
    qkv[:, :8] = case.q
    padded_k = torch.randn(case.num_blocks, 16, 3, 128, device="cuda").to(dtype)
    padded_v = torch.randn(case.num_blocks, 16, 3, 128, device="cuda").to(dtype)
    padded_k[:, :, :2], padded_v[:, :, :2] = case.k_cache, case.v_cache
    case.q, case.k_cache, case.v_cache = qkv[:, :8], padded_k[:, :, :2], padded_v[:, :, :2]
    ref_out, ref_lse = case.reference(scale=0.05)
    with poisoned_allocations():
        out, lse = api_paged.attention_paged(
            *case.tensors(), case.max_seqlen_q, case.max_seqlen_k, scale=0.05, return_lse=True
        )
    assert out.is_contiguous() and lse.shape == (8, tq) and lse.dtype == torch.float32
    check(case, out, lse, ref_out, ref_lse, "strided views through the API")
    with poisoned_allocations():
        out_only = api_paged.attention_paged(*case.tensors(), case.max_seqlen_q, case.max_seqlen_k, scale=0.05)
    assert torch.equal(out_only, out), "return_lse=False changed the output"


def test_cuda_graph_decode_step_replays_with_new_lengths():
    """write_kv_cache + attention_paged captured once, replayed with new lengths, tables, queries."""
    batch, heads, kv_heads, d, bs, max_blocks, num_blocks = 4, 8, 2, 128, 16, 8, 64
    gen = torch.Generator(device="cuda").manual_seed(99)
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", generator=gen).to(BF16)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", generator=gen).to(BF16)
    q = torch.zeros(batch, heads, d, device="cuda", dtype=BF16)  # static inputs of the graph
    k_new = torch.zeros(batch, kv_heads, d, device="cuda", dtype=BF16)
    v_new = torch.zeros(batch, kv_heads, d, device="cuda", dtype=BF16)
    table = torch.zeros(batch, max_blocks, device="cuda", dtype=torch.int32)
    seqlens_k = torch.ones(batch, device="cuda", dtype=torch.int32)
    slots = torch.zeros(batch, device="cuda", dtype=torch.int64)
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)

    def step():
        api_paged.write_kv_cache(k_new, v_new, k_cache, v_cache, slots)
        return api_paged.attention_paged(q, k_cache, v_cache, table, cu_q, seqlens_k, 1, max_blocks * bs,
                                         return_lse=True)

    graph, (static_out, static_lse) = capture(step)

    for replay in range(3):
        cpu = torch.Generator().manual_seed(replay)
        lengths = torch.randint(1, max_blocks * bs + 1, (batch,), generator=cpu)
        lengths[replay % batch] = 1 if replay == 0 else bs + 1
        perm = torch.randperm(num_blocks, generator=cpu)[: batch * max_blocks].view(batch, max_blocks)
        table.copy_(perm.to(torch.int32))
        seqlens_k.copy_(lengths.to(torch.int32))
        last = lengths - 1  # the new token is the last key of each sequence
        slots.copy_((perm[torch.arange(batch), last // bs] * bs + last % bs).to(torch.int64))
        q.copy_(torch.randn(batch, heads, d, generator=cpu).to(BF16))
        k_new.copy_(torch.randn(batch, kv_heads, d, generator=cpu).to(BF16))
        v_new.copy_(torch.randn(batch, kv_heads, d, generator=cpu).to(BF16))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference.attention_paged(
            q, k_cache, v_cache, table, cu_q, seqlens_k, 1, max_blocks * bs, return_lse=True,
            compute_dtype=torch.float64,
        )  # fmt: skip
        err = rel_err(static_out, ref_out)
        assert err <= TOL[BF16], f"replay {replay} (lengths {lengths.tolist()}): relative error {err:.3e}"
        assert torch.allclose(static_lse.double(), ref_lse, atol=2e-3), f"replay {replay}: lse differs"
        written = k_cache[perm[torch.arange(batch), last // bs].cuda(), (last % bs).cuda()]
        assert torch.equal(written, k_new), f"replay {replay}: write_kv_cache did not store the new keys"


def test_split_kv_in_kernel_combine_eager_graph_and_counters():
    """Split-KV partials are combined by the last CTA of each group, counted on per-stream int32
    counters that every launch must leave at zero: eager launches, two graphs captured with forced
    splits (their stream's counters born during the first capture) replayed in either order with
    new lengths and tables, and an eager launch after the replays all match the reference, and
    every counter is 0 at the end."""
    batch, heads, kv_heads, d, bs, max_blocks, num_blocks = 3, 8, 2, 128, 16, 40, 160
    gen = torch.Generator(device="cuda").manual_seed(5)
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", generator=gen).to(BF16)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", generator=gen).to(BF16)
    q = torch.zeros(batch * 2, heads, d, device="cuda", dtype=BF16)  # 2 query tokens per sequence
    table = torch.zeros(batch, max_blocks, device="cuda", dtype=torch.int32)
    seqlens_k = torch.full((batch,), 2, device="cuda", dtype=torch.int32)
    cu_q = torch.arange(0, 2 * batch + 1, 2, device="cuda", dtype=torch.int32)

    def step():
        return api_paged.attention_paged(q, k_cache, v_cache, table, cu_q, seqlens_k, 2, max_blocks * bs,
                                         return_lse=True, num_splits=5)

    def refill(seed):
        cpu = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, max_blocks * bs + 1, (batch,), generator=cpu)
        lengths[seed % batch] = 2 + seed  # short: most of its splits are empty
        table.copy_(torch.randperm(num_blocks, generator=cpu)[: batch * max_blocks].view(batch, max_blocks).int())
        seqlens_k.copy_(lengths.int())
        q.copy_(torch.randn(q.shape, generator=cpu).to(BF16))
        return lengths.tolist()

    def verify(out, lse, what):
        ref_out, ref_lse = reference.attention_paged(q, k_cache, v_cache, table, cu_q, seqlens_k, 2, max_blocks * bs,
                                                     return_lse=True, compute_dtype=torch.float64)
        err = rel_err(out, ref_out)
        assert err <= TOL[BF16], f"{what}: relative error {err:.3e}"
        assert torch.allclose(lse.double(), ref_lse, atol=2e-3), f"{what}: lse differs"

    for eager in range(2):
        lengths = refill(eager)
        with poisoned_allocations():
            out, lse = step()
        verify(out, lse, f"eager launch {eager} (lengths {lengths})")
    # Forget the per-stream counters, so the capture stream's buffer is born inside the first
    # capture (its zeroing only recorded): each graph must record its own memset, and the second
    # graph must be right when it is replayed before the first one ever was.
    paged._counters.clear()
    graphs, statics = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()], []
    for graph in graphs:
        with torch.cuda.graph(graph):
            statics.append(step())
    for replay, g in enumerate((1, 0, 1, 0)):
        lengths = refill(10 + replay)
        statics[g][0].fill_(float("nan"))
        graphs[g].replay()
        torch.cuda.synchronize()
        verify(*statics[g], f"replay {replay} of graph {g} (lengths {lengths})")
    lengths = refill(20)
    with poisoned_allocations():
        out, lse = step()
    verify(out, lse, f"eager launch after the replays (lengths {lengths})")
    torch.cuda.synchronize()
    for c in paged._counters_kept:
        nonzero = int(torch.count_nonzero(c.tensor))
        assert nonzero == 0, f"{nonzero} split-KV arrival counters were left non-zero after the launches"


def test_counters_born_in_inference_mode_serve_a_later_capture():
    """An engine captures its decode graphs under torch.inference_mode. Counters first made by such a
    capture must be a normal tensor: the next capture on the stream outside inference mode records
    their zeroing again, and zero_() on an inference tensor there raised (H200, 2026-12-04: an
    engine test ran before test_variants_cuda_graph_replays_with_new_lengths in one worker)."""
    device = torch.cuda.current_device()
    stream = torch.cuda.Stream()
    key = (device, stream.cuda_stream)
    paged._counters.pop(key, None)
    with torch.inference_mode():
        first = torch.cuda.CUDAGraph()
        with torch.cuda.graph(first, stream=stream):
            paged.arrival_counters(device, 8)
    c = paged._counters[key]
    assert not c.zeroed and not c.tensor.is_inference(), "counters born in the capture: zeroing recorded only"
    c.tensor.fill_(3)  # what the replays must zero again
    second = torch.cuda.CUDAGraph()
    with torch.cuda.graph(second, stream=stream):
        assert paged.arrival_counters(device, 8) == c.tensor.data_ptr()
    second.replay()
    torch.cuda.synchronize()
    assert int(torch.count_nonzero(c.tensor)) == 0, "the second graph did not record the counters' zeroing"
    paged._counters.pop(key, None)


def test_empty_batch_and_no_queries():
    case = Case([(0, 5), (0, 1)], 4, 4, 64, BF16, 16, seed=1)
    out = api_paged.attention_paged(*case.tensors(), 0, 5)
    assert out.shape == (0, 4, 64)


# ---------------------------------------------------------------------------------------------
# Programmatic dependent launch: the decode chain rotary + KV write -> attention -> consumer
# ---------------------------------------------------------------------------------------------
# With PDL (sm_90+, runtime.pdl_enabled) attention_paged's grid may be scheduled while the fused
# rotary + KV-cache write before it still runs, and the consumer after it (silu_mul here, an o
# projection in the engine) while attention runs: each kernel's griddepcontrol.wait is all that
# keeps it from reading stale data. The inputs make every early read visible: the new tokens'
# cache slots hold NaN until the write lands, q is unrotated until the rotary lands (their
# positions are large), and graph outputs are NaN-filled before each replay. Each run is checked
# against the float64 reference of the chain and bit for bit against the same chain launched
# without PDL (TILEATTN_PDL=0); every split count runs the combine in the last CTA of a group,
# and every split-KV arrival counter must be 0 afterwards.
PDL_QUERIES = {"decode": (1, 1, 1, 1, 1), "chunk": (1, 3, 24, 1, 1)}  # chunk: 96 rows at G = 4, the 128-row tile
PDL_RUNS = ((1, 33, 129, 1000, 4097), (4097, 1000, 31, 127, 1))  # key lengths of two runs: S per group moves both ways


class PdlChain:
    """Llama-3-8B's attention shapes (H 32 / Hkv 8, d 128, bf16, block_size 16) for sequences with
    `queries` new tokens each, key lengths runs[i] in run i, a block table for the longest + 2
    blocks, and qkv [T, (H + 2 Hkv) d] as the projection writes it (q, k, v strided views of it)."""

    heads, kv_heads, d, bs = 32, 8, 128, 16

    def __init__(self, queries, runs, num_splits, seed):
        from ..test_layer_ops_cpu import rotary_tables, split_qkv

        self.queries, self.runs, self.num_splits = queries, runs, num_splits
        self.batch, self.tokens = len(queries), sum(queries)
        assert all(len(run) == self.batch and min(nk - nq for nq, nk in zip(queries, run)) >= 0 for run in runs)
        self.max_blocks = -(-max(max(run) for run in runs) // self.bs) + 2
        self.num_blocks = self.batch * self.max_blocks + 7
        self.capacity = self.max_blocks * self.bs
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.cpu = torch.Generator().manual_seed(seed)
        cache_shape = (self.num_blocks, self.bs, self.kv_heads, self.d)
        self.k_cache = torch.randn(cache_shape, device="cuda", generator=self.gen).to(BF16)
        self.v_cache = torch.randn(cache_shape, device="cuda", generator=self.gen).to(BF16)
        width = (self.heads + 2 * self.kv_heads) * self.d
        self.qkv = torch.zeros(self.tokens, width, device="cuda", dtype=BF16)  # [T, (H + 2 Hkv) d]
        self.q, self.k, self.v = split_qkv(self.qkv, self.heads, self.kv_heads, self.d)
        self.cos, self.sin = (t.cuda() for t in rotary_tables(self.capacity, self.d))  # float32 [P, d]
        self.positions = torch.zeros(self.tokens, device="cuda", dtype=torch.int64)  # [T]
        self.slots = torch.zeros(self.tokens, device="cuda", dtype=torch.int64)  # [T]
        self.table = torch.zeros(self.batch, self.max_blocks, device="cuda", dtype=torch.int32)
        self.seqlens_k = torch.zeros(self.batch, device="cuda", dtype=torch.int32)
        cu = [0]
        for nq in queries:
            cu.append(cu[-1] + nq)
        self.cu_seqlens_q = torch.tensor(cu, device="cuda", dtype=torch.int32)

    def refill(self, lengths):
        """New inputs for one step with key lengths `lengths` (each sequence's queries are its last
        keys): fresh qkv, a fresh shuffled table (junk past each length), NaN in the new tokens'
        cache slots. Returns the float64 reference (out [T, H, d]) of the chain on them."""
        from ..test_layer_ops_cpu import norm_rotary64

        bs = self.bs
        order = torch.randperm(self.num_blocks, generator=self.cpu)
        table = torch.randint(-(2**31), 2**31 - 1, (self.batch, self.max_blocks), generator=self.cpu,
                              dtype=torch.int64).to(torch.int32)
        for b, nk in enumerate(lengths):
            pages = -(-nk // bs)
            table[b, :pages] = order[b * self.max_blocks:b * self.max_blocks + pages].to(torch.int32)
        positions = torch.cat([torch.arange(nk - nq, nk) for nq, nk in zip(self.queries, lengths)])  # [T]
        owner = torch.repeat_interleave(torch.arange(self.batch), torch.tensor(self.queries))  # [T]
        slots = table[owner, positions // bs].long() * bs + positions % bs  # [T]
        self.table.copy_(table)
        self.seqlens_k.copy_(torch.tensor(lengths, dtype=torch.int32))
        self.positions.copy_(positions)
        self.slots.copy_(slots)
        self.qkv.copy_(torch.randn(self.qkv.shape, device="cuda", generator=self.gen).to(BF16))
        blocks, rows = (slots // bs).cuda(), (slots % bs).cuda()
        self.k_cache[blocks, rows] = float("nan")  # until the write lands
        self.v_cache[blocks, rows] = float("nan")
        # The reference: q and k rotated in float64 with the tables rounded to bf16 (as the kernel
        # and transformers use them), then rounded to bf16 as the kernel stores them.
        pos, cos, sin = self.positions, self.cos.to(BF16), self.sin.to(BF16)
        q_ref = norm_rotary64(self.q, pos, cos, sin).to(BF16)  # [T, H, d]
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        k_cache[blocks, rows] = norm_rotary64(self.k, pos, cos, sin).to(BF16)
        v_cache[blocks, rows] = self.v
        ref, _ = reference.attention_paged(q_ref, k_cache, v_cache, self.table, self.cu_seqlens_q, self.seqlens_k,
                                           max(self.queries), max(lengths), return_lse=True,
                                           compute_dtype=torch.float64)
        return ref

    def step(self):
        """The chain: fused rotary + KV write, attention_paged, silu_mul of its output.
        Returns (out [T, H, d], act [T, H d / 2])."""
        from tileattn import api_layers

        api_layers.norm_rotary_write_kv_cache_(self.q, self.k, self.v, self.k_cache, self.v_cache, self.slots,
                                               self.positions, self.cos, self.sin)
        out = api_paged.attention_paged(self.q, self.k_cache, self.v_cache, self.table, self.cu_seqlens_q,
                                        self.seqlens_k, max(self.queries), self.capacity,
                                        num_splits=self.num_splits)
        act = api_layers.silu_mul(out.view(self.tokens, self.heads * self.d))
        return out, act

    def verify(self, out, act, ref, what):
        """out against the float64 reference; act bit for bit silu_mul of out recomputed alone."""
        from tileattn import api_layers

        torch.cuda.synchronize()
        nans = int(torch.isnan(out).sum())
        assert nans == 0, f"{what}: {nans} NaN in out (a cache slot read before the KV write landed?)"
        err = rel_err(out, ref)
        assert err <= TOL[BF16], f"{what}: relative error {err:.3e} > {TOL[BF16]:g} (q read before the rotary?)"
        want = api_layers.silu_mul(out.view(self.tokens, self.heads * self.d))
        torch.cuda.synchronize()
        differ = act != want  # NaN != NaN too
        assert not differ.any(), (
            f"{what}: the consumer's silu_mul differs from silu_mul of the finished attention output in "
            f"{int(differ.sum())} of {act.numel()} elements (read before attention's writes landed?)")
        for c in paged._counters_kept:
            nonzero = int(torch.count_nonzero(c.tensor))
            assert nonzero == 0, f"{what}: {nonzero} split-KV arrival counters left non-zero"


def run_pdl_chain(chain, mode):
    """The chain eagerly (mode "eager") or from a CUDA graph captured once and replayed for each
    of chain.runs: "graph-born" captures on a stream without counters, so the split counters are born
    inside the capture (their zeroing is a memset node between the KV write and attention);
    "graph" captures on a stream whose counters an eager run zeroed (attention follows the write
    directly). Yields (out, act, reference, description) per run, in the state left by the run."""
    if mode == "eager":
        for run, lengths in enumerate(chain.runs):
            ref = chain.refill(lengths)
            out, act = chain.step()
            yield out, act, ref, f"eager run {run} (lengths {lengths})"
        return
    stream = torch.cuda.Stream()
    chain.refill(chain.runs[0])
    warm = torch.cuda.Stream() if mode == "graph-born" else stream  # kernels loaded, plans made
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        chain.step()
    torch.cuda.current_stream().wait_stream(warm)
    if mode == "graph-born":  # torch hands out pooled streams: forget any counters this one had
        paged._counters.pop((torch.cuda.current_device(), stream.cuda_stream), None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out, act = chain.step()
    for run, lengths in enumerate(chain.runs):
        ref = chain.refill(lengths)
        out.fill_(float("nan"))
        act.fill_(float("nan"))
        graph.replay()
        yield out, act, ref, f"{mode} replay {run} (lengths {lengths})"


def pdl_chain_case(monkeypatch, queries, runs, num_splits, mode):
    """Runs PdlChain(queries, runs, num_splits) in `mode` under TILEATTN_PDL=1, then the same inputs with
    TILEATTN_PDL=0, each run checked against the reference and the PDL runs bit for bit against
    the plain ones. On sm_90+ the paged launch must have used a PDL plan."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 (griddepcontrol)")
    what = f"{queries} splits={num_splits} {mode}"
    results = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("TILEATTN_PDL", pdl)
        monkeypatch.delenv("TILEATTN_PAGED_PDL", raising=False)
        assert paged.pdl_launch(torch.cuda.current_device()) == (pdl == "1")
        api_paged._paged_cache.clear()  # the launches below are made fresh and inspected
        chain = PdlChain(queries, runs, num_splits, seed=zlib.crc32(what.encode()))
        results[pdl] = []
        for out, act, ref, run in run_pdl_chain(chain, mode):
            chain.verify(out, act, ref, f"{what} PDL={pdl} {run}")
            results[pdl].append((out.clone(), act.clone()))
        launches = [x for x in api_paged._paged_cache.values() if isinstance(x, paged.PagedLaunch)]
        # (TILEATTN_TEST_HOPPER_INFERENCE=1 may route a chunk without splits to the Hopper kernel)
        assert launches or HOPPER, f"{what}: attention_paged did not run the sm80 paged kernel"
        for launch in launches:
            used = {flag for flag, plan in launch._plans.items() if plan.pdl == flag}
            assert (pdl == "1") in used, f"{what} PDL={pdl}: the paged launch has plans {launch._plans}"
    for run, ((out, act), (plain_out, plain_act)) in enumerate(zip(results["1"], results["0"])):
        assert torch.equal(out, plain_out), (
            f"{what} run {run}: attention output under PDL differs from the plain launch in "
            f"{int((out != plain_out).sum())} elements")
        assert torch.equal(act, plain_act), f"{what} run {run}: the consumer under PDL differs from the plain launch"


@pytest.mark.parametrize("mode", ["eager", "graph", "graph-born"])
@pytest.mark.parametrize("num_splits", [1, 7, 32])
@pytest.mark.parametrize("queries", list(PDL_QUERIES))
def test_pdl_chain_rotary_attention_consumer(monkeypatch, queries, num_splits, mode):
    pdl_chain_case(monkeypatch, PDL_QUERIES[queries], PDL_RUNS, num_splits, mode)


@pytest.mark.sanitize
@pytest.mark.parametrize("mode", ["eager", "graph-born"])
def test_pdl_chain_small_sanitize(monkeypatch, mode):
    """Decode of 2 sequences, 7 forced splits, a table for 300 keys (also run under compute-sanitizer)."""
    pdl_chain_case(monkeypatch, (1, 1), ((1, 300), (129, 2)), 7, mode)
