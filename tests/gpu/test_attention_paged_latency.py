"""GPU tests of the paged kernel's two latency switches (docs/attention_paged.md, "Latency at short
contexts") against the float64 reference:

- unsplit_tiles (T): a (sequence, KV head) group with at most T key tiles runs as one split (split 0
  walks every tile with the block ids it read before the lengths; no partial, arrival or combine).
  T in {0 (today's rule), the config's stages - 1 (the "auto" default), huge (never split)}.
- prior_kernel_writes_only_new_keys (prewait): the kernel reads the table and lengths and loads the
  tiles wholly below nk - nq before its PDL wait. Every case here runs as the engine does: the new
  keys' cache slots are NaN-poisoned, tileattn.write_kv_cache writes them (a PDL launch) and the
  attention launch follows at once, so a new key read before the wait would be NaN in the output.
  A race only shows when the launches overlap, so each case runs three times; on a GPU without
  PDL (sm_80) the ordering is plain stream order and these are correctness tests of the reordered
  prologue only.

Cases: Llama-3-8B's attention shape (32 query heads, 8 KV heads, d = 128, bf16) and a small GQA-4
fp16 d = 64 one; block tables sized for 8k keys (junk past each length) as an engine's decode
graph, so the automatic split count is large; contexts 1, 15, 16, 17, 63, 64, 65, 200, 1000, 4097
keys around the 16/64-key block and tile edges; B = 1 and 3; block sizes 16 and 64; nq = 1 (decode)
and 4-5 (speculative / chunked prefill rows). Outputs are NaN-poisoned before every launch and the
split-KV arrival counters must be zero after each.

Markers: `gpu` (all), `sanitize` (the small cases, also run under compute-sanitizer).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import tileattn
from tileattn import reference
from tileattn.kernels import attention_paged_sm80 as paged
from tileattn.runtime import device_arch

from .conftest import poisoned_allocations
from .test_attention_paged import Case, check, check_padding, check_replay, counters_nonzero

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
CONTEXTS = (1, 15, 16, 17, 63, 64, 65, 200, 1000, 4097)
CAPACITY = 8192  # keys of block-table capacity: the engine's decode graph is sized for long contexts
UNSPLIT = ("off", "auto", "huge")


def unsplit_tiles(kind: str, config) -> int:
    """T for a test kind: 0, the config's stages - 1 (TILEATTN_PAGED_UNSPLIT_TILES=auto), or more
    tiles than any table holds (every group one split)."""
    return {"off": 0, "auto": config.stages - 1, "huge": 1 << 30}[kind]


def batch_seqs(batch: int, nq: int, i: int) -> list[tuple[int, int]]:
    """B (query tokens, keys) pairs: context i first, then two others far from it in CONTEXTS."""
    n = len(CONTEXTS)
    lengths = [CONTEXTS[i]] if batch == 1 else [CONTEXTS[i], CONTEXTS[(i + 3) % n], CONTEXTS[(i + 7) % n]]
    return [(min(nq, nk), nk) for nk in lengths]


def new_slots(case) -> torch.Tensor:
    """int64 [sum nq] cache slots (block * block_size + row) of each sequence's newest nq keys,
    positions nk - nq .. nk - 1: the slots an engine's KV write fills right before attention."""
    table = case.block_table.cpu()
    bs = case.block_size
    slots = [int(table[b, pos // bs]) * bs + pos % bs
             for b, (nq, nk) in enumerate(case.seqs) for pos in range(nk - nq, nk)]
    return torch.tensor(slots, dtype=torch.int64, device="cuda")


def run_written(case, launch, slots, what):
    """The engine's order: poison the new keys' slots, write them back with write_kv_cache (PDL),
    attention right after (PDL); three times. Checks each run against the reference of the final
    caches and the counters."""
    kv_heads, d = case.k_cache.shape[2], case.k_cache.shape[3]
    k_rows = case.k_cache.view(-1, kv_heads, d)  # [slots, Hkv, d] (the caches are contiguous)
    v_rows = case.v_cache.view(-1, kv_heads, d)
    new_k, new_v = k_rows[slots].clone(), v_rows[slots].clone()  # [T_new, Hkv, d]
    ref_out, ref_lse = case.reference()
    for run in range(3):
        k_rows[slots] = float("nan")
        v_rows[slots] = float("nan")
        out = torch.full_like(case.q, float("nan"))
        lse = torch.full((case.q.shape[1], case.q.shape[0]), float("nan"), device="cuda")
        with poisoned_allocations():  # the split-KV workspaces start as NaN
            tileattn.write_kv_cache(new_k, new_v, case.k_cache, case.v_cache, slots)
            launch(*case.tensors(), out=out, lse=lse)
        check(case, out, lse, ref_out, ref_lse, f"{what} run {run}")
        check_padding(case, out, lse, f"{what} run {run}")
        if launch.num_splits > 1:
            left = counters_nonzero()
            assert left == 0, f"{what} run {run}: {left} split-KV arrival counters left non-zero"


def make_launch(case, *, unsplit, prewait, num_splits=None):
    config = paged.pick_config(case.q.shape[2], case.max_seqlen_q * (case.q.shape[1] // case.k_cache.shape[2]),
                               device_arch(case.q.device.index))
    return paged.PagedLaunch(
        case.q, case.k_cache, case.v_cache, case.block_table, max_seqlen_q=case.max_seqlen_q, causal=True,
        scale=1.0 / math.sqrt(case.q.shape[2]), return_lse=True, num_splits=num_splits,
        unsplit_tiles=unsplit_tiles(unsplit, config), prior_kernel_writes_only_new_keys=prewait,
    )  # fmt: skip


@pytest.mark.parametrize("unsplit", UNSPLIT)
@pytest.mark.parametrize("prewait", [False, True])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("nq", [1, 4, 5])
@pytest.mark.parametrize("batch", [1, 3])
def test_llama3_shape_every_context(unsplit, prewait, block_size, nq, batch):
    """Llama-3-8B's attention (32/8 heads, d = 128, bf16) at every context of CONTEXTS, automatic
    split count for an 8k-key table, the KV write right before attention. nq = 1 and 4 run the
    16-row decode tile (3 stages: "auto" is T = 2), nq = 5 (20 rows) the 64-row tile (2 stages)."""
    for i in range(len(CONTEXTS)):
        seqs = batch_seqs(batch, nq, i)
        seed = zlib.crc32(f"latency {unsplit} {prewait} {block_size} {nq} {batch} {i}".encode())
        pages = max(-(-nk // block_size) for _, nk in seqs)
        case = Case(seqs, 32, 8, 128, BF16, block_size, seed, share=False, pad=CAPACITY // block_size - pages)
        launch = make_launch(case, unsplit=unsplit, prewait=prewait)
        what = (f"seqs={seqs} bs={block_size} T={launch.unsplit_tiles} prewait={prewait} {launch.config} "
                f"splits={launch.num_splits}")
        run_written(case, launch, new_slots(case), what)


@pytest.mark.parametrize("unsplit", UNSPLIT)
@pytest.mark.parametrize("prewait", [False, True])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_forced_splits_small_gqa(unsplit, prewait, num_splits):
    """GQA 4 at d = 64, fp16, forced split counts (2 and 3: S < num_splits at 2-3 tiles, where split
    0's pre-read block ids for S == 1 differ from the split walk's), B = 3 with decode and 4-token rows."""
    for i in range(len(CONTEXTS)):
        seqs = [(1, CONTEXTS[i]), (min(4, CONTEXTS[(i + 5) % 10]), CONTEXTS[(i + 5) % 10]), (1, 129)]
        seed = zlib.crc32(f"forced {unsplit} {prewait} {num_splits} {i}".encode())
        pages = max(-(-nk // 16) for _, nk in seqs)
        case = Case(seqs, 8, 2, 64, FP16, 16, seed, share=False, pad=CAPACITY // 16 - pages)
        launch = make_launch(case, unsplit=unsplit, prewait=prewait, num_splits=num_splits)
        run_written(case, launch, new_slots(case), f"seqs={seqs} T={launch.unsplit_tiles} prewait={prewait} "
                                                   f"splits={launch.num_splits}")


@pytest.mark.parametrize("prewait", [False, True])
def test_api_flag_reaches_the_kernel(prewait):
    """The public op with prior_kernel_writes_only_new_keys: a separate cached plan per flag value,
    correct results for both, right after the KV write (Llama-3-8B decode shape, B = 1, 288 keys)."""
    case = Case([(1, 288)], 32, 8, 128, BF16, 16, seed=5 + prewait, share=False, pad=CAPACITY // 16 - 18)
    slots = new_slots(case)
    kv_heads, d = case.k_cache.shape[2], case.k_cache.shape[3]
    k_rows, v_rows = case.k_cache.view(-1, kv_heads, d), case.v_cache.view(-1, kv_heads, d)
    new_k, new_v = k_rows[slots].clone(), v_rows[slots].clone()
    ref_out, ref_lse = case.reference()
    tileattn.api_paged._paged_cache.clear()  # the plans cached below are this test's
    for run in range(3):
        k_rows[slots] = float("nan")
        v_rows[slots] = float("nan")
        with poisoned_allocations():
            tileattn.write_kv_cache(new_k, new_v, case.k_cache, case.v_cache, slots)
            out, lse = tileattn.attention_paged(*case.tensors(), case.max_seqlen_q, case.max_seqlen_k, return_lse=True,
                                                prior_kernel_writes_only_new_keys=prewait)
        check(case, out, lse, ref_out, ref_lse, f"api prewait={prewait} run {run}")
    plans = list(tileattn.api_paged._paged_cache.values())  # one, planned for this flag value
    assert len(plans) == 1 and plans[0].prewait == prewait, f"api prewait={prewait}: cached plans {plans}"
    tileattn.attention_paged(*case.tensors(), case.max_seqlen_q, case.max_seqlen_k,  # the other value: its own plan
                             return_lse=True, prior_kernel_writes_only_new_keys=not prewait)
    plans = list(tileattn.api_paged._paged_cache.values())
    assert [p.prewait for p in plans] == [prewait, not prewait], f"api prewait={prewait}: cached plans {plans}"


@pytest.mark.parametrize("unsplit", ["off", "auto"])
@pytest.mark.parametrize("prewait", [False, True])
def test_decode_graph_write_then_attend(unsplit, prewait):
    """An engine's decode step in a CUDA graph: write_kv_cache of the new token then attention,
    captured once for an 8k-key table (Llama-3-8B shape, B = 1), replayed while the context grows
    and shrinks across the tile edges (S moving between 1, the T rule and the split walk). The new
    token's slot is NaN before each replay; the graph keeps the PDL edges."""
    bs, d, heads, kv_heads = 16, 128, 32, 8
    max_blocks = CAPACITY // bs
    steps = [33, 64, 65, 128, 129, 192, 193, 288, 1000, 17, 4097, 1]
    num_blocks = max_blocks + 8
    gen = torch.Generator(device="cuda").manual_seed(77)
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", generator=gen).to(BF16)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", generator=gen).to(BF16)
    q = torch.zeros(1, heads, d, device="cuda", dtype=BF16)  # static inputs of the graph
    table = torch.zeros(1, max_blocks, device="cuda", dtype=torch.int32)
    seqlens_k = torch.ones(1, device="cuda", dtype=torch.int32)
    cu_q = torch.arange(2, device="cuda", dtype=torch.int32)
    slot = torch.zeros(1, device="cuda", dtype=torch.int64)
    new_k = torch.zeros(1, kv_heads, d, device="cuda", dtype=BF16)
    new_v = torch.zeros(1, kv_heads, d, device="cuda", dtype=BF16)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(78))[:max_blocks]
    table.copy_(order.to(torch.int32)[None])  # a fixed shuffled table; lengths pick its prefix

    def refill(step):
        cpu = torch.Generator().manual_seed(2000 + step)
        nk = steps[step]
        seqlens_k.fill_(nk)
        slot.fill_(int(order[(nk - 1) // bs]) * bs + (nk - 1) % bs)
        q.copy_(torch.randn(q.shape, generator=cpu).to(BF16))
        new_k.copy_(torch.randn(new_k.shape, generator=cpu).to(BF16))
        new_v.copy_(torch.randn(new_v.shape, generator=cpu).to(BF16))
        k_cache.view(-1, kv_heads, d)[slot] = float("nan")
        v_cache.view(-1, kv_heads, d)[slot] = float("nan")
        return nk

    config = paged.pick_config(d, heads // kv_heads, device_arch(torch.cuda.current_device()))
    launch = paged.PagedLaunch(q, k_cache, v_cache, table, max_seqlen_q=1, causal=True, scale=d**-0.5,
                               return_lse=True, num_splits=None, unsplit_tiles=unsplit_tiles(unsplit, config),
                               prior_kernel_writes_only_new_keys=prewait)

    def step():
        tileattn.write_kv_cache(new_k, new_v, k_cache, v_cache, slot)
        return launch(q, k_cache, v_cache, table, cu_q, seqlens_k)

    refill(0)
    side, capture_stream = torch.cuda.Stream(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        static_out, static_lse = step()
    for i in range(len(steps)):
        nk = refill(i)
        static_out.fill_(float("nan"))
        static_lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference.attention_paged(q, k_cache, v_cache, table, cu_q, seqlens_k, 1, CAPACITY,
                                                     return_lse=True, compute_dtype=torch.float64)
        what = f"graph T={launch.unsplit_tiles} prewait={prewait} splits={launch.num_splits} replay {i} (nk={nk})"
        assert not torch.isnan(ref_out).any(), f"{what}: the KV write did not fill the new slot"
        check_replay(static_out, static_lse, ref_out, ref_lse, what)
    left = counters_nonzero(capture_stream)
    assert left == 0, f"graph T={launch.unsplit_tiles} prewait={prewait}: {left} arrival counters left non-zero"


@pytest.mark.sanitize
@pytest.mark.parametrize("unsplit", ["auto", "huge"])
@pytest.mark.parametrize("prewait", [False, True])
def test_latency_switches_small_sanitize(unsplit, prewait):
    """Small (also under compute-sanitizer): GQA 4, d = 64, fp16, a 1k-key table, lengths of 1, 2,
    3 and 5 tiles with decode and 4-token rows, padding rows past cu_seqlens_q[B], forced 3 splits
    and the automatic count."""
    seqs = [(1, 17), (4, 65), (1, 130), (1, 300)]
    for num_splits in (None, 3):
        case = Case(seqs, 8, 2, 64, FP16, 16, seed=23 + prewait, share=False, pad=1024 // 16 - 19, pad_tokens=3)
        launch = make_launch(case, unsplit=unsplit, prewait=prewait, num_splits=num_splits)
        run_written(case, launch, new_slots(case), f"small T={launch.unsplit_tiles} prewait={prewait} "
                                                   f"splits={launch.num_splits}")
