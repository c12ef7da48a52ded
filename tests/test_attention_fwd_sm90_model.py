"""CPU checks of csrc/attention_fwd_sm90.cu's index maps, pipeline protocol and numerics (no GPU).

The Hopper forward rests on identities that no CPU can execute but that can be restated and checked
here, for every registered config:

* fragment layouts: packing the fp32 S accumulator pairwise (pack_p) yields exactly wgmma's
  register-A fragment of P for each k16 step of O += P V;
* the epilogue: the addresses stmatrix gets (lane -> row, swizzled 16-byte chunk) put every O
  element where a TMA store with the 128-byte swizzle reads it for its (row, column);
* block_range: the K/V blocks a query tile visits cover every key its rows see, the blocks after
  the first n_masked need no mask, and skipped blocks hold no visible key;
* the mbarrier protocol (Q and full/empty rings, phase parities counted across a persistent CTA's
  tiles, two consumers, the ping-pong turns on named barriers): simulated under random
  interleavings, it never deadlocks, a consumer always reads the tile and block it expects, the
  producer never overwrites sQ or a slot still in use, and no named barrier is left half-arrived;
* the tile order: every query row exactly once, causal longest first inside L2 groups of heads;
* the online softmax as the kernel runs it (blocks last to first, -2^100 start, a row max that lags
  by up to 2^8, exp2 with the folded scale, P rounded to 16 bit, l = 0 -> O = 0, lse = -inf)
  matches the float64 reference.

The Python mirrors the C++ by hand (block_range, apply_mask, the stmatrix address, the parities):
change them together.
"""

from __future__ import annotations

import functools
import math
import random
import re
from dataclasses import replace

import pytest
import torch

from tileattn import reference
from tileattn.kernels import attention_fwd_sm90 as af

BLOCK_M = af.BLOCK_M
CONFIGS = sorted({(d, cfg) for d in af.HEAD_DIMS for causal in (False, True) for bf16 in (False, True)
                  for cfg in af.configs_for(d, causal, bf16)})


# ---- fragment layouts (PTX ISA: wgmma m64nNk16 accumulator and register-A fragments) ----------
def acc_pos(warp: int, lane: int, i: int) -> tuple[int, int]:
    """(row, column) of accumulator element i of a thread: i = 4j + 2h + e -> row 16 warp + g + 8h,
    column 8j + 2t + e."""
    g, t = lane // 4, lane % 4
    j, h, e = i // 4, (i >> 1) & 1, i & 1
    return 16 * warp + g + 8 * h, 8 * j + 2 * t + e


def a_frag_pos(warp: int, lane: int, reg: int, half: int) -> tuple[int, int]:
    """(row, column) within the 64 x 16 A tile of half `half` of A register `reg`."""
    g, t = lane // 4, lane % 4
    return 16 * warp + g + 8 * (reg & 1), 8 * (reg >> 1) + 2 * t + half


@pytest.mark.parametrize("block_n", sorted({cfg.block_n for _, cfg in CONFIGS}))
def test_packed_s_accumulator_is_the_register_a_fragment_of_p(block_n):
    for warp in range(4):
        for lane in range(32):
            for kk in range(block_n // 16):
                for reg in range(4):
                    for half in range(2):
                        i = 8 * kk + 2 * reg + half  # pack_p: p[kk][reg] = pack(s[8kk + 2reg], s[8kk + 2reg + 1])
                        row, col = acc_pos(warp, lane, i)
                        a_row, a_col = a_frag_pos(warp, lane, reg, half)
                        assert (row, col) == (a_row, 16 * kk + a_col)


# ---- epilogue: stmatrix into the swizzled O staging tile, read back as the TMA store does --------
def tma_sw128_offset(row: int, col: int) -> int:
    """Byte offset TMA (128-byte swizzle) uses for element (row, col) of a [rows][64] 16-bit panel
    starting 1024-byte aligned: 16-byte chunk q of row r sits at chunk q ^ (r % 8)."""
    chunk, within = col // 8, col % 8
    return row * 128 + ((chunk ^ (row % 8)) << 4) + 2 * within


def stmatrix_lane_address(warp: int, lane: int, j: int, head_dim: int) -> int:
    """The kernel's address for stmatrix.x4 number j (bytes from this consumer's first row of sQ)."""
    mi, rr = lane // 8, lane % 8
    row = warp * 16 + 8 * (mi & 1) + rr
    chunk = 2 * j + (mi >> 1)
    return row * 128 + (chunk // 8) * (BLOCK_M * 64 * 2) + (((chunk % 8) ^ rr) << 4)


@pytest.mark.parametrize("head_dim", af.HEAD_DIMS)
def test_stmatrix_addresses_match_the_tma_store_layout(head_dim):
    panel_bytes = BLOCK_M * 64 * 2
    written: dict[int, tuple[int, int]] = {}
    for warp in range(4):
        for j in range(head_dim // 16):
            # stmatrix.x4: matrix m row r comes from the address of lane 8m + r; its 8 elements
            # are register m of the 4 lanes with g == r (t = 0..3 -> columns 2t, 2t + 1).
            for m in range(4):
                for r in range(8):
                    base = stmatrix_lane_address(warp, 8 * m + r, j, head_dim)
                    for t in range(4):
                        lane = 4 * r + t
                        for half in range(2):
                            i = 8 * j + 2 * m + half  # register m of stmatrix j packs o[8j + 2m], o[8j + 2m + 1]
                            row, col = acc_pos(warp, lane, i)
                            addr = base + 4 * t + 2 * half
                            assert addr not in written, f"two elements written to byte {addr}"
                            written[addr] = (row, col)
    assert len(written) == 64 * head_dim
    for addr, (row, col) in written.items():
        panel = col // 64
        assert addr == panel * panel_bytes + tma_sw128_offset(row, col % 64), (row, col)


# ---- wgmma operand descriptors against the TMA layout ------------------------------------------------
# The canonical layouts a wgmma descriptor describes (PTX "Shared Memory Matrix Layout"; CUTLASS
# make_gmma_desc, in 16-byte units), with the 128-byte swizzle applied to the final byte address
# (bits 4-6 ^= bits 7-9):
#   K-major:  ((8, m), (8 chunks, k)) : ((8, SBO), (1, -))   row r, 16-byte chunk kc of the k16 slice
#   MN-major: ((8, n), (8, k))        : ((1, LBO), (8, SBO)) 16-byte chunk nc along N, K row kr
# These check that the kernel's start addresses and offsets (per k-step, panel and ring stage) make
# wgmma read, for every (row, k), the element TMA stored there.
def swizzle128(addr: int) -> int:
    return addr ^ (((addr >> 7) & 7) << 4)


def tma_panel_addr(base: int, rows: int, r: int, c: int) -> int:
    """Where TMA (128-byte swizzle) puts element (r, c) of a [rows][d] tile stored as 64-column panels."""
    return base + (c // 64) * rows * 128 + swizzle128(r * 128 + (c % 64) * 2)


def kmajor_element(start: int, sbo: int, r: int, k: int) -> int:
    """Byte address wgmma reads for element (r, k) of a K-major k16 slice starting at `start`."""
    return swizzle128(start + (r % 8) * 128 + (r // 8) * sbo + (k // 8) * 16 + (k % 8) * 2)


def mnmajor_element(start: int, lbo: int, sbo: int, n: int, k: int) -> int:
    """Byte address wgmma reads for element (k, n) of an MN-major k16 slice starting at `start`."""
    return swizzle128(start + ((n // 8) % 8) * 16 + (n // 64) * lbo + (k % 8) * 128 + (k // 8) * sbo + (n % 8) * 2)


@pytest.mark.parametrize("d,cfg", CONFIGS, ids=lambda x: str(x))
def test_descriptors_read_what_tma_wrote(d, cfg):
    bn, stages, bm = cfg.block_n, cfg.stages, cfg.block_m
    s_q = 0                                   # 1024-aligned dynamic smem base (the kernel rounds up)
    s_k = s_q + bm * d * 2
    s_v = s_k + stages * bn * d * 2
    q_panel_step, kv_panel_step, stage_step = bm * 64 * 2, bn * 64 * 2, bn * d * 2  # bytes
    rng = random.Random(d * 1000 + bn)
    for _ in range(400):
        c, stage = rng.randrange(cfg.consumers), rng.randrange(stages)
        ks, k = rng.randrange(d // 16), rng.randrange(16)
        # S = Q K^T: A = rows 64 c.. of sQ, B = K rows of the stage; k-step ks -> panel ks / 4, +32 B each.
        r = rng.randrange(64)
        start_q = s_q + c * 64 * 128 + (ks // 4) * q_panel_step + 32 * (ks % 4)
        assert kmajor_element(start_q, 1024, r, k) == tma_panel_addr(s_q, bm, 64 * c + r, 16 * ks + k)
        n = rng.randrange(bn)
        start_k = s_k + stage * stage_step + (ks // 4) * kv_panel_step + 32 * (ks % 4)
        assert kmajor_element(start_k, 1024, n, k) == tma_panel_addr(s_k + stage * stage_step, bn, n, 16 * ks + k)
        # O += P V: B = V of the stage, MN-major (N = d); k-step kk = keys 16 kk.., +2048 B each.
        kk, col = rng.randrange(bn // 16), rng.randrange(d)
        start_v = s_v + stage * stage_step + 2048 * kk
        got = mnmajor_element(start_v, bn * 128, 1024, col, k)
        assert got == tma_panel_addr(s_v + stage * stage_step, bn, 16 * kk + k, col)


# ---- block_range: which K/V blocks a query tile visits, and which need masking ---------------------
def block_range(causal: bool, block_n: int, m_block: int, nq: int, nk: int, rows: int = BLOCK_M) -> tuple[int, int]:
    """Mirror of fwd90::block_range (rows: positions per tile, 128 / pack)."""
    n_total = -(-nk // block_n)
    edge = 1 if nk % block_n else 0
    if not causal:
        return n_total, edge
    row0 = m_block * rows
    diag = nk - nq
    last_key = min(row0 + rows, nq) - 1 + diag
    if last_key < 0:
        return 0, 0
    n_end = min(n_total, last_key // block_n + 1)
    first_limit = row0 + diag
    n_unmasked = 0 if first_limit + 1 <= 0 else min(n_end, (first_limit + 1) // block_n)
    return n_end, max(n_end - n_unmasked, edge if n_end == n_total else 0)


def diagonal_first_block(it: int, n_end: int, diag_lo: int, block_n: int) -> int:
    """Mirror of fwd90::diagonal_first_block (the non-causal ALiBi-alone kernels' visit order)."""
    if it == 0:
        return n_end - 1
    d0 = min(max(diag_lo, 0) // block_n, n_end - 2)
    r, right = it - 1, n_end - 1 - d0
    return d0 + r if r < right else d0 - 1 - (r - right)


@pytest.mark.parametrize("block_n", [64, 80, 96, 128])
def test_diagonal_first_order_walks_outward_from_the_diagonal(block_n):
    """Every block once, the last (the masked edge, if any) first as in the plain order; after it
    the walk starts at the block nearest to the tile's lowest diagonal key and each side is visited
    nearest first, so ALiBi's bias (falling with the distance) never rises along a side."""
    for n_end in range(1, 14):
        for diag_lo in range(-3 * block_n, (n_end + 3) * block_n, 11):
            order = [diagonal_first_block(it, n_end, diag_lo, block_n) for it in range(n_end)]
            assert sorted(order) == list(range(n_end)) and order[0] == n_end - 1, (n_end, diag_lo, order)

            def gap(n):  # keys between block n and the key diag_lo (0: the block holds it)
                return max(0, n * block_n - diag_lo, diag_lo - ((n + 1) * block_n - 1))

            walk = order[1:]
            if walk:
                assert gap(walk[0]) == min(gap(n) for n in walk), (n_end, diag_lo, order)
            for side in (lambda n: n >= walk[0], lambda n: n < walk[0]) if walk else ():
                gaps = [gap(n) for n in walk if side(n)]
                assert gaps == sorted(gaps), (n_end, diag_lo, order)


def visible(causal: bool, row: int, key: int, nq: int, nk: int) -> bool:
    return key < nk and (not causal or key <= row + nk - nq)


SIZES = (1, 2, 17, 63, 64, 65, 127, 128, 129, 255, 256, 300, 513)


@pytest.mark.parametrize("tile_rows", [192, 128, 64, 32, 8], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("block_n", sorted({cfg.block_n for _, cfg in CONFIGS}))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_range_covers_exactly_the_visible_keys(block_n, causal, tile_rows):
    for nq in SIZES:
        for nk in SIZES:
            for m_block in range(-(-nq // tile_rows)):
                n_end, n_masked = block_range(causal, block_n, m_block, nq, nk, tile_rows)
                assert 0 <= n_masked <= n_end
                rows = range(m_block * tile_rows, min((m_block + 1) * tile_rows, nq))
                for n in range(-(-nk // block_n)):
                    keys = range(n * block_n, (n + 1) * block_n)
                    seen = [visible(causal, r, k, nq, nk) for r in rows for k in keys]
                    visit_index = n_end - 1 - n  # blocks are visited last to first
                    what = f"nq={nq} nk={nk} m_block={m_block} block {n} (n_end={n_end}, n_masked={n_masked})"
                    if n >= n_end:
                        assert not any(seen), f"{what}: skipped block holds a visible key"
                    elif visit_index >= n_masked:
                        assert all(seen), f"{what}: visited without a mask but some key is masked"


def unseen_visits(causal: bool, block_n: int, n_end: int, m_block: int, rows: int, c: int, nq: int, nk: int) -> int:
    """Mirror of fwd90::unseen_visits: how many of the tile's first visits consumer c releases unread."""
    first = m_block * rows + (c * 64) % rows
    if first >= nq:
        return n_end
    if not causal:
        return 0
    last_key = min(first + min(64, rows), nq) - 1 + nk - nq
    return n_end if last_key < 0 else n_end - min(n_end, last_key // block_n + 1)


@pytest.mark.parametrize("block_m,pack", [(192, 1), (192, 3), (192, 6), (128, 1), (128, 2), (128, 4), (128, 8)])
@pytest.mark.parametrize("block_n", sorted({cfg.block_n for _, cfg in CONFIGS}))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_unseen_visits_hold_no_visible_key_of_the_consumer(block_n, causal, block_m, pack):
    """Every visit a consumer skips holds no key any of its rows sees (its 64 tile rows: one head's
    positions, or every packed head's when a head has fewer than 64 rows), and the first visit it
    makes holds one (nothing more could be skipped)."""
    rows = block_m // pack
    for nq in SIZES:
        for nk in SIZES:
            for m_block in range(-(-nq // rows)):
                n_end, _ = block_range(causal, block_n, m_block, nq, nk, rows)
                for c in range(block_m // 64):
                    skip = unseen_visits(causal, block_n, n_end, m_block, rows, c, nq, nk)
                    first = m_block * rows + (c * 64) % rows
                    mine = range(first, min(first + min(64, rows), nq))  # positions, any of its heads
                    what = f"nq={nq} nk={nk} m_block={m_block} consumer {c} (n_end={n_end}, skip={skip})"
                    assert 0 <= skip <= n_end, what
                    for it in range(n_end):
                        n = n_end - 1 - it
                        seen = any(visible(causal, r, k, nq, nk) for r in mine for k in range(n * block_n, (n + 1) * block_n))
                        if it < skip:
                            assert not seen, f"{what}: visit {it} skipped but holds a visible key"
                        elif it == skip:
                            assert seen, f"{what}: the first visit made holds no visible key"


# ---- the mbarrier protocol, simulated ----------------------------------------------------------------
class MBarrier:
    """Phase-counting model of an mbarrier: a phase completes when `count` arrivals and every
    expected byte arrived; wait(parity) passes once the phase with that parity has completed,
    i.e. while the current (incomplete) phase's parity differs from it."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, tx: int = 0):
        self.pending -= 1
        self.tx += tx
        self._maybe_complete()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        self._maybe_complete()

    def _maybe_complete(self):
        assert self.pending >= 0, "more arrivals than the phase expects"
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def passed(self, parity: int) -> bool:
        return (self.phase & 1) != parity


class NamedBarrier:
    """bar.sync / bar.arrive between `parties` warpgroups (each counts as one party; the forward's two
    consumer warpgroups by default)."""

    def __init__(self, parties: int = 2):
        self.parties, self.arrived, self.generation = parties, 0, 0

    def arrive(self):
        self.arrived += 1
        if self.arrived == self.parties:
            self.arrived, self.generation = 0, self.generation + 1

    def sync(self):
        generation = self.generation
        self.arrive()
        while self.generation == generation:
            yield


THREADS = 2  # threads of a consumer warpgroup in the model: thread 0 (the releaser) and another


def simulate(n_ends: list[int], stages: int, pingpong: bool, seed: int, packed: bool = False,
             thread_release: bool = True, own_o: bool = False, q_release_shift: int = 0, consumers: int = 2,
             k_release_count: int | None = None, skips: bool = False, skip_waits_full: bool = True):
    """Run the producer and `consumers` consumers of one CTA over its tiles (n_ends: the number of K/V
    blocks each tile visits) as coroutines, with the kernel's sequence of waits, arrivals, turns
    and copies, under a random schedule; TMA copies land at random later times.

    packed: the varlen / paged layouts, whose consumer threads also access two TMA-filled buffers
    with ordinary instructions: every thread clears rows of the first visited block's V slot
    (clear_rows; modelled in every tile) and copies its staged O rows out of sQ. The producer then
    checks racecheck's view of each refill: every thread that accessed the buffer must have
    arrived on its empty barrier itself since (an order through another thread's arrive, valid in
    the PTX model, is what racecheck reported in the Hopper backward). thread_release: the
    kernel's packed-layout release (every thread arrives; q_empty / v_empty count 2 x THREADS);
    False models one releasing thread per consumer after a named barrier. own_o: the kernel's kOwnO
    (O staged in sO): Q is released once the tile's last S = Q K^T has retired, and each
    consumer's TMA store (dense) of sO must have read it before that consumer's next epilogue
    writes there. q_release_shift (a mutation, own_o only): release Q that many blocks early.
    consumers: 2, or 3 (the plain dense kernel's 192-row tiles; no ping-pong). k_release_count (a
    mutation): the arrivals k_empty waits for, instead of one per consumer. skips: each consumer
    releases unread a random number of each tile's first visits (the kernel's unseen_visits, plain
    dense without ping-pong), waiting for each block's full barrier first; skip_waits_full=False (a
    mutation) releases them without that wait."""
    assert consumers == 2 or not pingpong, "ping-pong takes turns between two consumers"
    assert not skips or not (pingpong or packed), "unseen visits are skipped by the plain dense kernel only"
    rng = random.Random(seed)
    turn = [NamedBarrier(), NamedBarrier()]  # kTurnBarrier + c: "consumer c may issue"
    clear_barrier = NamedBarrier(consumers)
    per_thread = packed and thread_release
    empty_count = consumers * THREADS if per_thread else consumers
    q_full, q_empty = MBarrier(1), MBarrier(empty_count)
    k_full = [MBarrier(1) for _ in range(stages)]
    v_full = [MBarrier(1) for _ in range(stages)]
    k_empty = [MBarrier(k_release_count or consumers) for _ in range(stages)]
    v_empty = [MBarrier(empty_count) for _ in range(stages)]
    q_touched, v_touched = [set()], [set() for _ in range(stages)]  # (consumer, thread): ordinary accesses
    q_slot, k_slot, v_slot = [None], [None] * stages, [None] * stages  # what each buffer holds once landed
    q_readers = [set()]
    k_readers = [set() for _ in range(stages)]  # consumers that may still read the slot
    v_readers = [set() for _ in range(stages)]
    in_flight = []  # (buffer list, index, content, barrier)
    o_store = [None] * consumers  # per consumer: the tile whose O its TMA store is still reading from sO
    # The tile hand-off: the producer writes tile i (or -1 after the last) into slot i % 2 and arrives
    # on sched_full; every consumer thread reads it and arrives on sched_empty.
    sched_full, sched_empty = [MBarrier(1), MBarrier(1)], [MBarrier(consumers * THREADS) for _ in range(2)]
    sched_tile = [None, None]
    sched_readers = [set(), set()]  # (consumer, thread) that read the slot's current value

    def publish(i, value):
        if i >= 2:
            while not sched_empty[i & 1].passed(((i >> 1) - 1) & 1):
                yield
        assert not sched_readers[i & 1], f"producer overwrites tile slot {i & 1} before {sched_readers[i & 1]} read it"
        sched_tile[i & 1] = value
        sched_readers[i & 1].update((c, thread) for c in range(consumers) for thread in range(THREADS))
        sched_full[i & 1].arrive()

    def producer():
        g = 0
        for i, n_end in enumerate(n_ends):
            yield from publish(i, i)
            if i > 0:
                while not q_empty.passed((i - 1) & 1):
                    yield
            assert not q_readers[0], f"producer loads Q of tile {i} while consumers {q_readers[0]} use sQ"
            assert not q_touched[0], f"racecheck: Q of tile {i} lands after {q_touched[0]}'s reads of sQ " \
                "without their own release"
            q_full.arrive(tx=1)
            in_flight.append((q_slot, 0, i, q_full))
            yield
            for it in range(n_end):
                s = g % stages
                for full, empty, slots, readers in ((k_full, k_empty, k_slot, k_readers),
                                                    (v_full, v_empty, v_slot, v_readers)):
                    if g >= stages:
                        while not empty[s].passed(((g // stages) - 1) & 1):
                            yield
                    assert not readers[s], f"producer refills slot {s} while consumers {readers[s]} use it"
                    if slots is v_slot:
                        assert not v_touched[s], f"racecheck: V slot {s} refilled after {v_touched[s]}'s " \
                            "clear without their own release"
                    full[s].arrive(tx=1)
                    in_flight.append((slots, s, (i, n_end - 1 - it), full[s]))
                    yield
                g += 1
        yield from publish(len(n_ends), -1)

    def consumer(c):
        def use(full, slots, readers, gi, want):
            s = gi % stages
            while not full[s].passed((gi // stages) & 1):
                yield
            assert slots[s] == want, f"consumer {c} reads {slots[s]}, expected {want}"
            readers[s].add(c)

        def release(empty, readers, gi, touched=None):
            readers[gi % stages].discard(c)
            for thread in range(THREADS if per_thread and empty is not k_empty else 1):
                if touched is not None:
                    touched[gi % stages].discard((c, thread))
                empty[gi % stages].arrive()

        def take_turn():
            if pingpong:
                yield from turn[c].sync()

        def pass_turn(last_event):
            if pingpong and not (c == 1 and last_event):
                turn[1 - c].arrive()

        def release_q():
            q_readers[0].discard(c)
            for thread in range(THREADS if per_thread else 1):
                q_touched[0].discard((c, thread))
                q_empty.arrive()

        def read_q(i):  # an S = Q K^T of tile i reads sQ
            assert q_slot[0] == i, f"consumer {c} reads Q of tile {q_slot[0]} in tile {i}"

        def take_tile(i):  # wait for slot i % 2, read it (every thread), release it
            while not sched_full[i & 1].passed((i >> 1) & 1):
                yield
            value = sched_tile[i & 1]
            for thread in range(THREADS):
                sched_readers[i & 1].discard((c, thread))
                sched_empty[i & 1].arrive()
            return value

        g0 = 0
        for i, n_end in enumerate(n_ends):
            tile = yield from take_tile(i)
            assert tile == i, f"consumer {c} was handed tile {tile} as its tile {i}"
            while not q_full.passed(i & 1):
                yield
            assert q_slot[0] == i, f"consumer {c} sees Q of tile {q_slot[0]} in tile {i}"
            q_readers[0].add(c)
            early = own_o and q_release_shift and n_end > q_release_shift  # the mutation's release point
            skip = random.Random(f"{seed}/{i}/{c}").randint(0, n_end) if skips else 0
            for it in range(skip):  # unseen visits: released unread
                for full, empty, readers in ((k_full, k_empty, k_readers), (v_full, v_empty, v_readers)):
                    while skip_waits_full and not full[(g0 + it) % stages].passed(((g0 + it) // stages) & 1):
                        yield
                    release(empty, readers, g0 + it)  # never read: the consumer is not among its readers
                    yield
            if n_end > skip:
                def block(it):
                    return (i, n_end - 1 - it)

                if c == 1:
                    pass_turn(False)
                yield from use(k_full, k_slot, k_readers, g0 + skip, block(skip))
                yield from take_turn()
                read_q(i)
                pass_turn(False)
                yield
                release(k_empty, k_readers, g0 + skip)
                if packed:  # clear_rows: every consumer's threads write the V slot, then meet
                    while not v_full[g0 % stages].passed((g0 // stages) & 1):
                        yield
                    v_touched[g0 % stages].update((c, thread) for thread in range(THREADS))
                    yield from clear_barrier.sync()  # kClearBarrier: all cleared before any P V
                for it in range(skip + 1, n_end):
                    if early and it == n_end - q_release_shift:
                        release_q()
                    yield from use(k_full, k_slot, k_readers, g0 + it, block(it))
                    yield from take_turn()
                    read_q(i)
                    yield from use(v_full, v_slot, v_readers, g0 + it - 1, block(it - 1))
                    pass_turn(False)
                    yield
                    release(k_empty, k_readers, g0 + it)
                    yield
                    release(v_empty, v_readers, g0 + it - 1, v_touched)
                if own_o and not early:  # the tile's last S = Q K^T has retired
                    release_q()
                yield from use(v_full, v_slot, v_readers, g0 + n_end - 1, block(n_end - 1))
                yield from take_turn()
                pass_turn(True)
                yield
                release(v_empty, v_readers, g0 + n_end - 1, v_touched)
            elif own_o:
                release_q()  # no S issued
            g0 += n_end
            if own_o:
                # epilogue: the storing thread waits for its previous store's read of sO (dense), then
                # stmatrix into sO, and the TMA store (packed: the threads' row copies) reads it
                while o_store[c] is not None:
                    yield
                yield
                if not packed:
                    o_store[c] = i
                    actors.append(store_read(c))
                continue
            yield  # epilogue: stmatrix into sQ, TMA store (packed: the threads' row copies) reads it
            if packed:
                q_touched[0].update((c, thread) for thread in range(THREADS))
                yield
            release_q()
        last = yield from take_tile(len(n_ends))
        assert last == -1, f"consumer {c} was handed {last} after the CTA's last tile"

    def store_read(c):  # the TMA store's read of sO finishes at a random later time
        for _ in range(rng.randrange(4)):
            yield
        o_store[c] = None

    actors = [producer(), *(consumer(c) for c in range(consumers))]
    steps = 0
    while actors or in_flight:
        steps += 1
        assert steps < 200000, "deadlock"
        if in_flight and (not actors or rng.random() < 0.3):
            slots, s, content, bar = in_flight.pop(rng.randrange(len(in_flight)))
            slots[s] = content
            bar.complete_tx(1)
            continue
        actor = rng.choice(actors)
        try:
            next(actor)
        except StopIteration:
            actors.remove(actor)
    assert all(b.arrived == 0 for b in (*turn, clear_barrier)), "a named barrier was left half-arrived"


@pytest.mark.parametrize("own_o", [False, True], ids=["o-in-sq", "own-o"])
@pytest.mark.parametrize("pingpong", [False, True], ids=["free", "pingpong"])
@pytest.mark.parametrize("stages", sorted({cfg.stages for _, cfg in CONFIGS}))
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_pipeline_protocol(stages, pingpong, packed, own_o):
    """One tile per CTA with every block count, then persistent CTAs walking several tiles
    (including fully masked tiles that visit no block); packed: with the varlen / paged layouts'
    V clears and row copies, each released by every thread that made them; own_o: O staged in sO,
    Q released after the tile's last S."""
    for n_ends in _protocol_cases(stages):
        for seed in range(20):
            simulate(n_ends, stages, pingpong, seed, packed=packed, own_o=own_o)


@pytest.mark.parametrize("own_o", [False, True], ids=["o-in-sq", "own-o"])
@pytest.mark.parametrize("stages", sorted({cfg.stages for _, cfg in CONFIGS if cfg.consumers == 3}))
def test_pipeline_protocol_three_consumers(stages, own_o):
    """The plain dense kernel with three consumer warpgroups: every barrier that counts consumers
    (k_empty, v_empty, q_empty, sched_empty) waits for the third too, under random schedules."""
    for n_ends in _protocol_cases(stages):
        for seed in range(20):
            simulate(n_ends, stages, False, seed, own_o=own_o, consumers=3)


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("own_o", [False, True], ids=["o-in-sq", "own-o"])
@pytest.mark.parametrize("stages", sorted({cfg.stages for _, cfg in CONFIGS}))
def test_pipeline_protocol_with_unseen_visits_released(stages, own_o, consumers):
    """Consumers releasing, unread, random numbers of each tile's first visits (unseen_visits), after
    waiting for each block's full barrier: no slot is refilled while another consumer reads it."""
    for n_ends in _protocol_cases(stages):
        for seed in range(20):
            simulate(n_ends, stages, False, seed, own_o=own_o, consumers=consumers, skips=True)


def test_unseen_visits_released_without_waiting_for_full_is_caught():
    """Releasing an unseen visit before its block's full barrier: the arrival can count toward the
    slot's previous use, whose other consumers are still reading it: the model sees the early refill
    (or a consumer reading a block that has not landed)."""
    with pytest.raises(AssertionError, match="refills slot|more arrivals|reads"):
        for n_ends in _protocol_cases(2):
            for seed in range(40):
                simulate(n_ends, 2, False, seed, own_o=True, consumers=3, skips=True, skip_waits_full=False)


def test_three_consumers_with_two_k_releases_is_caught():
    """k_empty counting two arrivals with three consumers (the two-consumer count left in place):
    the model sees a K slot refilled while the third consumer still reads it."""
    with pytest.raises(AssertionError, match="refills slot"):
        for n_ends in _protocol_cases(2):
            for seed in range(40):
                simulate(n_ends, 2, False, seed, own_o=True, consumers=3, k_release_count=2)


@pytest.mark.parametrize("stages", sorted({cfg.stages for _, cfg in CONFIGS}))
def test_q_released_one_block_early_is_caught(stages):
    """The model catches the next tile's Q landing while an S = Q K^T of this tile still reads sQ,
    the hazard of releasing Q before the last S has retired."""
    with pytest.raises(AssertionError, match="Q of tile"):
        for n_ends in _protocol_cases(stages):
            for seed in range(40):
                simulate(n_ends, stages, False, seed, own_o=True, q_release_shift=1)


@pytest.mark.parametrize("head_dim", af.HEAD_DIMS)
def test_o_staging_buffer_where_it_fits(head_dim):
    """smem_bytes has the kernel's kOwnO rule: an O staging tile after the rings exactly when the
    total with it stays within the block limit (static mbarriers reserved), never over it."""
    for cfg in {cfg for d, cfg in CONFIGS if d == head_dim}:
        base = 2 * head_dim * (cfg.block_m + 2 * cfg.stages * cfg.block_n) + 1024
        own = base + 2 * head_dim * cfg.block_m + 256 <= af.SMEM_LIMIT
        assert cfg.smem_bytes(head_dim) == base + (2 * head_dim * cfg.block_m if own else 0) <= af.SMEM_LIMIT
    default = af.DEFAULTS[(head_dim, False)]
    assert (default.smem_bytes(head_dim) > 2 * head_dim * (af.BLOCK_M + 2 * default.stages * default.block_n) + 1024) \
        == (head_dim in (64, 128)), "the default tiles of d = 64 / 128 stage O in sO, d = 256 in sQ"


def _protocol_cases(stages: int) -> list[list[int]]:
    cases = [[n] for n in (0, 1, 2, 3, stages, stages + 1, 2 * stages + 1, 9)]
    return cases + [[3, 0, 2, 5], [1, 1, 1, 1, 1], [0, 0, 4], [stages + 1, stages, 2 * stages + 1]]


@pytest.mark.parametrize("stages", sorted({cfg.stages for _, cfg in CONFIGS}))
def test_packed_release_by_one_thread_is_what_racecheck_reports(stages):
    """The packed layouts' release as it was (one thread per consumer after a named barrier): the
    model sees a V slot refilled, or Q reloaded, after another thread's ordinary accesses with no
    release of that thread in between, the order racecheck does not follow."""
    with pytest.raises(AssertionError, match="racecheck"):
        for n_ends in _protocol_cases(stages):
            for seed in range(20):
                simulate(n_ends, stages, False, seed, packed=True, thread_release=False)


# ---- tile order --------------------------------------------------------------------------------------
def tile_coords(causal: bool, t: int, m_blocks: int, groups: int, pack: int, batches: int,
                l2_group: int) -> tuple[int, int, int]:
    """Mirror of fwd90::tile_coords: (m_block, first head, batch)."""
    if causal:
        per_group = l2_group * m_blocks
        first = (t // per_group) * l2_group
        size = min(l2_group, groups * batches - first)
        i = t % per_group
        m_block, unit = m_blocks - 1 - i // size, first + i % size
    else:
        m_block, unit = t % m_blocks, t // m_blocks
    return m_block, (unit % groups) * pack, unit // groups


def tile_rows(m_block: int, head0: int, rows: int, c: int, warp: int, lane: int) -> list[tuple[int, int]]:
    """Mirror of the consumer's (head, position) of its accumulator rows g and g + 8."""
    r0 = c * 64 + warp * 16 + lane // 4
    return [(head0 + r // rows, m_block * rows + r % rows) for r in (r0, r0 + 8)]


def store_box(m_block: int, head0: int, rows: int, c: int) -> list[tuple[int, int]]:
    """(head, position) of each of the 64 rows of consumer c's TMA store box, in box row order:
    the kernel's first (position, head) and geometry's box (o_rows positions x 64/o_rows heads)."""
    pos0, head = m_block * rows + (c * 64) % rows, head0 + (c * 64) // rows
    o_rows = min(rows, 64)
    return [(head + i // o_rows, pos0 + i % o_rows) for i in range(64)]


@pytest.mark.parametrize("wide", [False, True], ids=["128rows", "192rows"])
@pytest.mark.parametrize("l2_bytes", [60 << 20, 1 << 20], ids=["L2_60MB", "L2_1MB"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tiles_cover_every_query_row_once_longest_first(causal, l2_bytes, wide):
    d, cfg = (64, af.WIDE_DEFAULTS[(64, causal)]) if wide else (128, af.DEFAULTS[(128, causal)])
    for nq, heads, kv_heads, batches in ((1, 1, 1, 1), (300, 3, 3, 2), (1000, 5, 5, 1), (129, 1, 1, 7), (1, 8, 1, 2),
                                         (17, 8, 2, 1), (129, 16, 4, 1), (300, 64, 1, 1), (5, 32, 16, 3), (200, 7, 7, 1),
                                         (70, 6, 2, 2), (40, 12, 2, 1)):
        for pack_gqa in (False, True):
            if pack_gqa and heads > kv_heads and not af.packable(heads // kv_heads, cfg.block_m):
                with pytest.raises(ValueError, match="pack_gqa"):
                    af._geometry(batches, heads, kv_heads, nq, nq, d, cfg, pack_gqa, l2_bytes)
                continue
            geo = af._geometry(batches, heads, kv_heads, nq, nq, d, cfg, pack_gqa, l2_bytes)
            pack = geo.pack
            rows = cfg.block_m // pack
            m_blocks = -(-nq // rows)
            units = heads // pack * batches
            assert 1 <= geo.l2_group <= units
            assert geo.l2_group == 1 or geo.l2_group * nq * d * 4 <= l2_bytes // 2, "the group's K/V fit half the L2"
            order = [tile_coords(causal, t, m_blocks, heads // pack, pack, batches, geo.l2_group)
                     for t in range(geo.tiles)]
            assert geo.boxes[0] == (1, pack, rows, 64) and (kv_heads == heads or not pack_gqa or pack > 1)
            seen = []
            for m_block, head0, b in order:
                assert (head0 // (heads // kv_heads)) == ((head0 + pack - 1) // (heads // kv_heads)), "one K/V head"
                for c in range(cfg.consumers):
                    stored = store_box(m_block, head0, rows, c)
                    mine = [hp for w in range(4) for lane in range(32) for hp in tile_rows(m_block, head0, rows, c, w, lane)]
                    assert sorted(set(mine)) == sorted(stored), "a consumer stores exactly the rows it computed"
                    seen += [(b, h, pos) for h, pos in stored if pos < nq]
            assert sorted(seen) == sorted((b, h, i) for b in range(batches) for h in range(heads) for i in range(nq))
            if causal:  # inside each L2 group: every unit's tiles, work (K/V blocks) never increasing
                per_group = geo.l2_group * m_blocks
                for g0 in range(0, len(order), per_group):
                    chunk = order[g0:g0 + per_group]
                    work = [block_range(True, 128, m, nq, nq, rows)[0] for m, _, _ in chunk]
                    assert work == sorted(work, reverse=True)
                    assert len({(h, b) for _, h, b in chunk}) * m_blocks == len(chunk)
            else:  # one head group's query tiles back to back
                assert all(order[t][1:] == order[t - 1][1:] for t in range(1, len(order)) if t % m_blocks)


@pytest.mark.parametrize("head_dim", af.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_default_config_is_persistent_where_o_has_its_own_buffer(head_dim, causal):
    base = af.WIDE_DEFAULTS.get((head_dim, causal), af.DEFAULTS[(head_dim, causal)])
    got = af.default_config(head_dim, causal)
    persistent = head_dim in af.PERSISTENT_HEAD_DIMS
    assert got == (replace(base, persistent=True) if persistent else base), got
    # persistent pays where the next tile's Q can load during this tile's epilogue: O staged in sO
    own_o = base.smem_bytes(head_dim) > 2 * head_dim * (base.block_m + 2 * base.stages * base.block_n) + 1024
    assert persistent == own_o, f"d={head_dim}: persistent {persistent}, own O buffer {own_o}"
    # the same compiled kernel either way: persistence is a grid choice
    assert af.expression(head_dim, got, causal, True) == af.expression(head_dim, base, causal, True)


@pytest.mark.parametrize("head_dim", af.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_every_tuning_candidate_has_its_dense_and_varlen_kernels_registered(head_dim, causal):
    # The GPU tests run every candidate, dense in both dtypes and varlen in bf16; a persistent-only
    # candidate once had no varlen instantiation (UnknownKernelError on the H200, 2026-12-03).
    registered = set(af.INSTANTIATIONS) | set(af.TUNING)
    for bf16, dtype in ((False, torch.float16), (True, torch.bfloat16)):
        for cfg in af.tuning_candidates(head_dim, causal, dtype):
            assert af.expression(head_dim, cfg, causal, bf16) in registered, cfg
            assert not bf16 or af.varlen_expression(head_dim, cfg, causal, bf16) in registered, cfg
            if cfg.consumers == 3:  # three consumer warpgroups: the dense and varlen kernels, ALiBi or softcap alone only
                with pytest.raises(ValueError, match="three-consumer"):
                    af.paged_expression(head_dim, cfg, causal, bf16)
                with pytest.raises(ValueError, match="three-consumer"):
                    af.variant_expression(head_dim, cfg, bf16, af.WINDOW)


def test_three_consumer_configs():
    cfg = af.Sm90Config(128, 3, persistent=True, consumers=3)
    assert (cfg.block_m, cfg.threads, str(cfg)) == (192, 512, "192x128/s3/persistent")
    assert af.expression(64, cfg, True, True) == "tileattn::attention_fwd_sm90<64, 128, 3, false, true, true, 3>"
    # Q 24 KB + 3 stages of K and V (96 KB) + 1 KB, and sO 24 KB: within 227 KB
    assert cfg.smem_bytes(64) == 2 * 64 * (192 + 2 * 3 * 128) + 1024 + 2 * 64 * 192
    for bad in (dict(consumers=4), dict(consumers=3, pingpong=True)):
        with pytest.raises(ValueError, match="consumers"):
            af.Sm90Config(128, 2, **bad)
    # A consumer's 64 rows (its O box) must be whole heads' runs or one head's: groups 3 and 6
    # pack into 192 rows, 2, 4 and 8 do not (96, 48, 24 positions per head).
    assert [g for g in (1, 2, 3, 4, 6, 8) if af.packable(g, 192)] == [1, 3, 6]
    assert [g for g in (1, 2, 3, 4, 8, 16) if af.packable(g, 128)] == [1, 2, 4, 8, 16]
    assert af.gqa_pack(32, 16, 1, 192) == 1 and af.gqa_pack(6, 2, 1, 192) == 3


def test_long_keys_switch_the_config_exactly_at_long_keys():
    assert set(af.LONG_KEYS) == set(af.LONG_DEFAULTS)
    for (d, causal), long in af.LONG_DEFAULTS.items():
        switch = af.LONG_KEYS[(d, causal)]
        assert af.default_config(d, causal, switch - 1) == af.default_config(d, causal)
        got = af.default_config(d, causal, switch)
        assert (got.block_n, got.stages, got.pingpong) == (long.block_n, long.stages, long.pingpong)
        assert got.smem_bytes(d) <= af.SMEM_LIMIT
        for bf16 in (False, True):  # what `tileattn check` compiles: fp16 too, not a tuning candidate
            assert af.expression(d, long, causal, bf16) in af.INSTANTIATIONS
    for (d, causal) in af.DEFAULTS:  # pairs without a long entry keep their default at any length
        if (d, causal) not in af.LONG_DEFAULTS:
            assert af.default_config(d, causal, 1 << 20) == af.default_config(d, causal)


def test_wide_tiles_from_wide_min_queries_where_packing_allows():
    for (d, causal), wide in af.WIDE_DEFAULTS.items():
        narrow = replace(af.DEFAULTS[(d, causal)], persistent=True)
        wide = replace(wide, persistent=True)
        pick = functools.partial(af.default_config, d, causal, 4096)
        assert pick() == wide  # Nq unknown: a long call
        n = af.WIDE_MIN_QUERIES[d]
        assert pick(seqlen_q=n - 1) == narrow and pick(seqlen_q=n) == wide
        # GQA 4 at n queries does not pack (nothing to save): wide; forced packing needs 128 rows
        assert pick(seqlen_q=n, heads=32, kv_heads=8) == wide
        assert pick(seqlen_q=n, heads=32, kv_heads=8, pack_gqa=True) == narrow
        assert pick(seqlen_q=n, heads=6, kv_heads=2, pack_gqa=True) == wide  # groups of 3: 64 rows each
        assert pick(seqlen_q=n, heads=32, kv_heads=8, pack_gqa=False) == wide
        for bf16 in (False, True):  # both dtypes registered (not tuning candidates)
            assert af.expression(d, wide, causal, bf16) in af.INSTANTIATIONS
        assert wide.smem_bytes(d) <= af.SMEM_LIMIT


def test_gqa_pack_choice():
    assert af.gqa_pack(8, 1, 1) == 8 and af.gqa_pack(8, 2, 17) == 4  # decode / short chunks: pack
    assert af.gqa_pack(8, 8, 1) == 1 and af.gqa_pack(6, 2, 1) == 1  # no group; group of 3 does not divide 128
    assert af.gqa_pack(4, 1, 128) == 1 and af.gqa_pack(4, 1, 4096) == 1  # no padding to save


# ---- numerics of the online softmax as the kernel orders it -----------------------------------------
def tile_forward(qf, blocks, sl2: float, dtype):
    """One query tile's online softmax as the kernel runs it: qf [rows, d] fp32; blocks: the K/V
    blocks in visit order as (kb, vb, limit) with kb/vb [block_n, d] exactly as they sit in shared
    memory and limit None (unmasked visit) or, per row, the last visible key offset inside the block
    (keys past it get -inf whatever their score, NaN included; [rows, block_n]: per key, -1 masks). Returns (o, l, m) before the
    epilogue: out = o / l (0 where l = 0), lse = (m + log2 l) ln 2 (-inf where l = 0)."""
    m = torch.full((qf.shape[0],), -2.0 ** 100)
    l = torch.zeros(qf.shape[0])
    o = torch.zeros(qf.shape[0], qf.shape[1])
    for kb, vb, limit in blocks:
        s = qf @ kb.T
        if limit is not None:
            limit = limit[:, None] if limit.dim() == 1 else limit
            s[torch.arange(kb.shape[0])[None, :] > limit] = -math.inf
        # The kernel moves a row's max only when some row of its warp would see p > 2^8; deciding
        # per row here is the stalest case the kernel can produce.
        blk = s.max(dim=1).values * sl2
        grow = blk - m > 8.0
        m_new = torch.where(grow, torch.maximum(m, blk), m)
        alpha = torch.exp2(m - m_new)
        p = torch.exp2(s * sl2 - m_new[:, None])
        assert not bool((p > 256.0).any())
        l = l * alpha + p.sum(dim=1)
        o = o * alpha[:, None] + p.to(dtype).float() @ vb.to(dtype).float()
        m = m_new
    return o, l, m


def epilogue(o, l, m, dtype):
    """(out rows rounded to the 16-bit dtype, lse) of tile_forward's state."""
    inv = torch.where(l > 0, 1.0 / l, torch.zeros_like(l))
    lse = torch.where(l > 0, (m + torch.log2(l)) * math.log(2.0), torch.full_like(l, -math.inf))
    return (o * inv[:, None]).to(dtype).float(), lse


def key_limit(rows, nq: int, nk: int, first_key: int, causal: bool):
    """The last visible key of each query row (rows: positions in [0, nq)), relative to a key block
    starting at `first_key`: nk - 1, and with causal the bottom-right-aligned diagonal."""
    limit = torch.full_like(rows, nk - 1)
    if causal:
        limit = torch.minimum(limit, rows + nk - nq)
    return limit - first_key


def emulate(q, k, v, causal: bool, scale: float, block_n: int, pack: int = 1):
    """The kernel's arithmetic per query row (fp32, exp2, P rounded to the input dtype); with GQA
    packing a tile holds 128 / pack positions of each packed head (same block range for all)."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    out = torch.zeros(b, h, nq, d)
    lse = torch.zeros(b, h, nq)
    sl2 = scale * 1.4426950408889634
    tile = BLOCK_M // pack
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hkv)
            for m_block in range(-(-nq // tile)):
                rows = torch.arange(m_block * tile, min((m_block + 1) * tile, nq))
                n_end, n_masked = block_range(causal, block_n, m_block, nq, nk, tile)
                blocks = []
                for it in range(n_end):
                    n = n_end - 1 - it
                    keys = torch.arange(n * block_n, (n + 1) * block_n)
                    kb = torch.zeros(block_n, d)
                    vb = torch.zeros(block_n, d)
                    valid = keys < nk
                    kb[valid] = k[bi, kh, keys[valid]].float()  # TMA zero-fills rows past Nk
                    vb[valid] = v[bi, kh, keys[valid]].float()
                    limit = key_limit(rows, nq, nk, n * block_n, causal) if it < n_masked else None
                    blocks.append((kb, vb, limit))
                o, l, m = tile_forward(q[bi, hi, rows].float(), blocks, sl2, q.dtype)
                out[bi, hi, rows], lse[bi, hi, rows] = epilogue(o, l, m, q.dtype)
    return out, lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 2, 1, 130, 200), (1, 1, 1, 300, 45), (2, 2, 2, 1, 129), (1, 4, 2, 129, 128),
                                   (1, 8, 1, 17, 150)],
                         ids=lambda s: "B{}H{}Hkv{}_Nq{}_Nk{}".format(*s))
@pytest.mark.parametrize("block_n", [64, 128])
def test_emulated_online_softmax_matches_reference(block_n, shape, causal):
    b, h, hkv, nq, nk = shape
    g = torch.Generator().manual_seed(nq * 7 + nk)
    q = torch.randn(b, h, nq, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(b, hkv, nk, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(b, hkv, nk, 64, generator=g).to(torch.bfloat16)
    out, lse = emulate(q, k, v, causal, 0.125, block_n, af.gqa_pack(h, hkv, nq))
    ref, ref_lse = reference.attention(q, k, v, causal=causal, scale=0.125, compute_dtype=torch.float64)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.3e}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert bool((out[~seen] == 0).all())
    assert (lse.double() - ref_lse)[seen].abs().max() < 1e-3


# ---- variable-length batches: the varlen kernel's tiles, boxes, clears and stores, emulated ---------
def gather_rows(t, tokens, heads):
    """What a TMA box reads from a packed [T, heads, d] tensor: rows `tokens` of `heads` (one head
    per row or one for all), zeros at tokens >= T (the map's row bound)."""
    out = torch.zeros(len(tokens), t.shape[-1])
    heads = torch.as_tensor(heads).expand(len(tokens))
    inside = tokens < t.shape[0]
    out[inside] = t[tokens[inside], heads[inside]].float()
    return out


def packed_emulate(q, batches: int, span, load_block, max_seqlen_q: int, causal: bool, scale: float, block_n: int,
                   pack: int, group: int, bad_key=None, l2_group: int = 2, clear: bool = True):
    """Mirror of the packed-query kernels (kVariant = kVarlen or kPaged): the tiles of a dense batch
    of B sequences of max_seqlen_q queries in tile_coords order, skipped past their sequence's end;
    the Q box at the sequence's first token + the dense row offset (reading the next sequence, the
    padding, or TMA zeros past the tensor); K/V blocks as load_block(b, kv_head, n) puts them in
    shared memory; the edge block's V rows past the sequence's keys cleared (clear=False: the kernel
    without clear_rows); paged (bad_key(b, key) -> bool): a sequence with a bad key masks every
    visit and those keys in it; O and lse stored only for positions inside the sequence; the rows
    past the last sequence zeroed (zero_rows_past_last). span(b) -> (q0, nq, nk). Returns (out [Tq, H, d]
    NaN where never written, lse [H, Tq], writes [Tq, H]: how often each out row was written)."""
    tq, h, d = q.shape
    rows = BLOCK_M // pack
    m_blocks, groups = -(-max_seqlen_q // rows), h // pack
    sl2 = scale * 1.4426950408889634
    out = torch.full((tq, h, d), math.nan)
    lse = torch.full((h, tq), math.nan)
    writes = torch.zeros(tq, h, dtype=torch.int64)
    r = torch.arange(BLOCK_M)
    for tl in range(m_blocks * groups * batches):
        m_block, head0, b = tile_coords(causal, tl, m_blocks, groups, pack, batches, min(l2_group, groups * batches))
        q0, nq, nk = span(b)
        if m_block * rows >= nq:
            continue  # past its sequence's end: skipped
        n_end, n_masked = block_range(causal, block_n, m_block, nq, nk, rows)
        any_bad = bad_key is not None and any(bad_key(b, key) for key in range(nk))
        if any_bad:
            n_masked = n_end
        heads_r, pos_r = head0 + r // rows, m_block * rows + r % rows  # tile row -> (head, position)
        assert (heads_r // group == head0 // group).all(), "a packed tile shares one K/V head"
        qf = gather_rows(q, q0 + pos_r, heads_r)
        blocks = []
        for it in range(n_end):
            n = n_end - 1 - it
            kb, vb = load_block(b, head0 // group, n)
            valid = nk - (n_end - 1) * block_n  # the kernel's test, first visit only
            if it == 0 and valid < block_n and clear:
                vb[valid:] = 0.0
            limit = None
            if it < n_masked:
                limit = key_limit(pos_r, nq, nk, n * block_n, causal)
                if any_bad:  # page_mask: a bad key is past every row's limit
                    bad = torch.tensor([bad_key(b, n * block_n + j) for j in range(block_n)])
                    kb[bad] = math.nan  # whatever was read there: the mask must overwrite it
                    limit = limit[:, None].expand(-1, block_n).clone()
                    limit[:, bad] = -1
            else:
                assert n * block_n + block_n <= nk, "an unmasked visit reads only the sequence's own keys"
            blocks.append((kb, vb, limit))
        o, l, m = tile_forward(qf, blocks, sl2, q.dtype)
        o, tile_lse = epilogue(o, l, m, q.dtype)
        for i in range(BLOCK_M):  # store_rows_masked and the lse stores: only rows inside the sequence
            if pos_r[i] < nq:
                tok, hd = q0 + int(pos_r[i]), int(heads_r[i])
                out[tok, hd], lse[hd, tok] = o[i], tile_lse[i]
                writes[tok, hd] += 1
    last = span(batches)[0] if batches else 0
    out[last:], lse[:, last:] = 0.0, -math.inf  # zero_rows_past_last (every CTA's consumers, a share each)
    writes[last:] += 1
    return out, lse, writes


def varlen_emulate(q, k, v, cu_q, cu_k, max_seqlen_q: int, causal: bool, scale: float, block_n: int, pack: int,
                   clear: bool = True):
    """packed_emulate for varlen: K/V boxes of block_n rows at the sequence's first key + n block_n."""
    def span(b):
        return (cu_q[b], cu_q[b + 1] - cu_q[b] if b + 1 < len(cu_q) else 0, cu_k[b + 1] - cu_k[b]
                if b + 1 < len(cu_k) else 0)

    def load_block(b, kv_head, n):
        tokens = cu_k[b] + n * block_n + torch.arange(block_n)
        return gather_rows(k, tokens, kv_head), gather_rows(v, tokens, kv_head)

    return packed_emulate(q, len(cu_q) - 1, span, load_block, max_seqlen_q, causal, scale, block_n, pack,
                          q.shape[1] // k.shape[1], clear=clear)


def packed_batch(lens_q, lens_k, h: int, hkv: int, d: int, pad_q: int, pad_k: int, seed: int):
    """Random packed q/k/v for these per-sequence lengths with pad_q / pad_k NaN tokens after the
    last sequence (a token buffer padded to a captured size), and the cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    cu_q = [0]
    cu_k = [0]
    for a, c in zip(lens_q, lens_k):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + c)
    q = torch.randn(cu_q[-1] + pad_q, h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(cu_k[-1] + pad_k, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(cu_k[-1] + pad_k, hkv, d, generator=g).to(torch.bfloat16)
    q[cu_q[-1]:], k[cu_k[-1]:], v[cu_k[-1]:] = math.nan, math.nan, math.inf
    return q, k, v, cu_q, cu_k


VARLEN_CASES = [  # (query lengths, key lengths, H, Hkv)
    ((0, 1, 31, 33), (0, 1, 31, 33), 2, 2),
    ((129, 0, 7), (129, 5, 200), 2, 1),
    ((5, 127, 3), (70, 127, 0), 4, 1),        # a sequence with queries but no key
    ((1, 1, 1, 2), (65, 1, 130, 63), 8, 2),   # decode-like: GQA packing
    ((200,), (64,), 2, 2),                    # Nq > Nk: causal rows that see nothing
]


@pytest.mark.parametrize("pack_gqa", [None, False], ids=["pack_auto", "pack_off"])
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_varlen_emulation_matches_reference(case, causal, block_n, pack_gqa):
    lens_q, lens_k, h, hkv = VARLEN_CASES[case]
    q, k, v, cu_q, cu_k = packed_batch(lens_q, lens_k, h, hkv, 64, pad_q=3, pad_k=block_n - 1, seed=case)
    max_q = max(lens_q)
    pack = af.gqa_pack(h, hkv, max_q) if pack_gqa is None else 1
    out, lse, writes = varlen_emulate(q, k, v, cu_q, cu_k, max_q, causal, 0.125, block_n, pack)
    what = f"lens_q={lens_q} lens_k={lens_k} H={h} Hkv={hkv} pack={pack} block_n={block_n} causal={causal}"
    assert bool((writes == 1).all()), f"{what}: out rows written {writes.min()}..{writes.max()} times (want 1)"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{what}: NaN reached the outputs"
    ref, ref_lse = reference.attention_varlen(q[:cu_q[-1]], k[:cu_k[-1]], v[:cu_k[-1]], torch.tensor(cu_q),
                                              torch.tensor(cu_k), max_q, max(lens_k), causal=causal, scale=0.125,
                                              return_lse=True, compute_dtype=torch.float64)
    n = cu_q[-1]
    err = (out[:n].double() - ref).norm() / max(ref.norm(), 1e-30)
    assert err < 1e-2, f"{what}: relative error {err:.3e}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse[:, :n]), seen), f"{what}: rows that see no key differ"
    assert bool((out[:n].transpose(0, 1)[~seen] == 0).all()), f"{what}: a row that sees no key is not 0"
    if seen.any():
        assert (lse[:, :n].double() - ref_lse)[seen].abs().max() < 1e-3, f"{what}: lse differs"
    assert bool((out[n:] == 0).all()) and bool((lse[:, n:] == -math.inf).all()), f"{what}: padding rows"


def test_varlen_emulation_needs_the_v_clear():
    """Without clear_rows the NaN/Inf padding after the last sequence meets P = 0 in P V: NaN (the
    test above would catch a kernel that lost the clear)."""
    q, k, v, cu_q, cu_k = packed_batch((40,), (40,), 1, 1, 64, pad_q=0, pad_k=30, seed=1)
    out, _, _ = varlen_emulate(q, k, v, cu_q, cu_k, 40, False, 0.125, 64, 1, clear=False)
    assert torch.isnan(out[:40]).all()
    out, _, _ = varlen_emulate(q, k, v, cu_q, cu_k, 40, False, 0.125, 64, 1)
    assert not torch.isnan(out).any()


def paged_emulate(q, k_cache, v_cache, block_table, cu_q, seqlens_k, max_seqlen_q: int, causal: bool, scale: float,
                  block_n: int, pack: int, page_mask: bool = True):
    """packed_emulate for the paged kernel: a K/V block is min(block_size, block_n)-row boxes, each
    from the cache block page_block names (TMA zeros where it names none). page_mask=False: the
    kernel without it (bad blocks' keys would score 0 from the zero fill)."""
    num_blocks, bs = k_cache.shape[:2]
    max_blocks = len(block_table[0]) if block_table else 0
    box = min(bs, block_n)

    def page_block(b, key):  # mirror of fwd90::page_block
        page = key // bs
        bid = block_table[b][page] if key < max(seqlens_k[b], 0) and page < max_blocks else num_blocks
        return bid if 0 <= bid < num_blocks else num_blocks

    def span(b):
        return (cu_q[b], cu_q[b + 1] - cu_q[b], max(seqlens_k[b], 0)) if b < len(seqlens_k) else (cu_q[b], 0, 0)

    def load_block(b, kv_head, n):
        kb, vb = torch.zeros(block_n, q.shape[-1]), torch.zeros(block_n, q.shape[-1])
        for r0 in range(0, block_n, box):
            key = n * block_n + r0
            blk, off = page_block(b, key), key % bs
            assert off + box <= bs, "a box lies inside one cache block"
            if blk < num_blocks:
                kb[r0:r0 + box] = k_cache[blk, off:off + box, kv_head].float()
                vb[r0:r0 + box] = v_cache[blk, off:off + box, kv_head].float()
        return kb, vb

    return packed_emulate(q, len(seqlens_k), span, load_block, max_seqlen_q, causal, scale, block_n, pack,
                          q.shape[1] // k_cache.shape[2],
                          bad_key=(lambda b, key: page_block(b, key) == num_blocks) if page_mask else None)


def paged_batch(lens_q, lens_k, bs: int, h: int, hkv: int, seed: int, *, bad=()):
    """Packed queries and a shuffled paged cache: sequence b's blocks drawn from a permutation, the
    second sequence sharing the first one's first block (a prefix cache); every cache row no
    sequence owns is NaN (K) / Inf (V); `bad`: (b, page, id) entries overwritten with bad ids."""
    g = torch.Generator().manual_seed(seed)
    d = 64
    max_blocks = max(1, max(-(-max(n, 0) // bs) for n in lens_k))
    num_blocks = len(lens_k) * max_blocks + 5  # a few blocks nobody uses
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table, used = [], torch.zeros(num_blocks, bs, dtype=torch.bool)
    for b, n in enumerate(lens_k):
        row = [perm.pop() for _ in range(max_blocks)]
        if b == 1 and len(table) and n > bs:
            row[0] = table[0][0]  # shared with sequence 0
        table.append(row)
    for b, page, bid in bad:
        table[b][page % max_blocks] = bid  # large blocks: fewer pages
    for b, n in enumerate(lens_k):
        for key in range(max(n, 0)):
            bid = table[b][key // bs] if key // bs < max_blocks else -1
            if 0 <= bid < num_blocks:
                used[bid, key % bs] = True
    used[0, 0] = True  # the reference multiplies P = 0 by row 0 of block 0 for unreadable keys: keep it finite
    k_cache[~used], v_cache[~used] = math.nan, math.inf
    cu_q = [0]
    for n in lens_q:
        cu_q.append(cu_q[-1] + n)
    q = torch.randn(cu_q[-1] + 3, h, d, generator=g).to(torch.bfloat16)
    q[cu_q[-1]:] = math.nan
    return q, k_cache, v_cache, table, cu_q


PAGED_CASES = [  # (query lengths, key lengths incl. the queries, bad entries)
    ((5, 0, 70, 1), (40, 3, 200, 1), ()),           # chunks after a prefix, an empty chunk, a one-token one
    ((33, 129), (33, 300), ()),                       # a whole prompt, a chunk after a long prefix
    ((20, 9), (100, 9), ((0, 1, -1), (1, 0, 10**6))),  # bad block ids inside the lengths: masked keys
    ((4, 6), (0, -5), ()),                            # no keys (and a negative length)
]


@pytest.mark.parametrize("bs", [16, 64, 256])
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", range(len(PAGED_CASES)))
def test_paged_emulation_matches_reference(case, causal, block_n, bs):
    lens_q, lens_k, bad = PAGED_CASES[case]
    h, hkv = 4, 2
    q, k_cache, v_cache, table, cu_q = paged_batch(lens_q, lens_k, bs, h, hkv, seed=case, bad=bad)
    max_q = max(lens_q)
    pack = af.gqa_pack(h, hkv, max_q)
    out, lse, writes = paged_emulate(q, k_cache, v_cache, table, cu_q, list(lens_k), max_q, causal, 0.125, block_n,
                                     pack)
    what = f"lens_q={lens_q} lens_k={lens_k} bad={bad} bs={bs} block_n={block_n} causal={causal} pack={pack}"
    assert bool((writes == 1).all()), f"{what}: out rows written {writes.min()}..{writes.max()} times (want 1)"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{what}: NaN reached the outputs"
    ref, ref_lse = reference.attention_paged(q[:cu_q[-1]], k_cache, v_cache, torch.tensor(table, dtype=torch.int32),
                                             torch.tensor(cu_q, dtype=torch.int32),
                                             torch.tensor(lens_k, dtype=torch.int32), max_q, max(max(lens_k), 0),
                                             causal=causal, scale=0.125, return_lse=True,
                                             compute_dtype=torch.float64)
    n = cu_q[-1]
    err = (out[:n].double() - ref).norm() / max(ref.norm(), 1e-30)
    assert err < 1e-2, f"{what}: relative error {err:.3e}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse[:, :n]), seen), f"{what}: rows that see no key differ"
    if seen.any():
        assert (lse[:, :n].double() - ref_lse)[seen].abs().max() < 1e-3, f"{what}: lse differs"
    assert bool((out[n:] == 0).all()) and bool((lse[:, n:] == -math.inf).all()), f"{what}: padding rows"


def test_paged_producer_lanes_issue_each_box_once():
    """The paged producer warp: lane l issues box (row (l / panels) * box_rows, panel l % panels) of a
    visit when the row is inside the block (csrc's paged branch), box_rows = min(block_size, kBlockN):
    every registered paged instantiation's boxes, at every block size, exactly once, and never more
    boxes than lanes (the kernel's static_assert)."""
    for expression in af.PAGED_INSTANTIATIONS:
        d, block_n = (int(x) for x in re.match(r"tileattn::attention_fwd_sm90<(\d+), (\d+),", expression).groups())
        panels = d // 64
        assert (block_n // 16) * panels <= 32, expression
        for bs in (16, 32, 64, 128, 256):
            box_rows = min(bs, block_n)
            issued = [((lane // panels) * box_rows, lane % panels) for lane in range(32)
                      if (lane // panels) * box_rows < block_n]
            want = [(r, p) for r in range(0, block_n, box_rows) for p in range(panels)]
            assert sorted(issued) == sorted(want) and len(set(issued)) == len(issued), (expression, bs)


def test_paged_bad_ids_need_the_page_mask():
    """A bad block id inside the length must mask its keys (the reference's rule), not let them score
    0 from TMA's zero fill: without page_mask the emulation leaves the reference (the test above
    would catch a kernel that lost it)."""
    q, k_cache, v_cache, table, cu_q = paged_batch((8,), (64,), 16, 2, 2, seed=3, bad=((0, 1, -1),))
    ref = reference.attention_paged(q[:8], k_cache, v_cache, torch.tensor(table, dtype=torch.int32),
                                    torch.tensor(cu_q, dtype=torch.int32), torch.tensor([64], dtype=torch.int32), 8, 64,
                                    causal=False, scale=0.125, compute_dtype=torch.float64)
    for page_mask, close in ((True, True), (False, False)):
        out, _, _ = paged_emulate(q, k_cache, v_cache, table, cu_q, [64], 8, False, 0.125, 64, 1, page_mask=page_mask)
        assert ((out[:8].double() - ref).norm() / ref.norm() < 1e-2) == close, f"page_mask={page_mask}"


def test_varlen_plan_geometry_and_names():
    """The host side of the varlen plan: the grid (tiles of B x max_seqlen_q, plus one tail CTA per
    head), the name expressions (the plain kernel with kVariant = kVarlen and VARLEN_PARAMS' types),
    and what supports_varlen accepts."""
    geo = af._geometry(3, 8, 2, 256, 300, 128, af.VARLEN_DEFAULTS[(128, True)], None, 60 << 20)
    assert geo.pack == 1 and geo.tiles == 2 * 8 * 3
    geo = af._geometry(5, 8, 2, 1, 100, 128, af.VARLEN_DEFAULTS[(128, False)], None, 60 << 20)
    assert geo.pack == 4 and geo.tiles == 5 * 2
    assert len(af.VARLEN_INSTANTIATIONS) == 12 and set(af.VARLEN_INSTANTIATIONS) <= set(af.INSTANTIATIONS)
    assert af.varlen_expression(64, af.C(128, 3), True, True) == (
        "tileattn::attention_fwd_sm90<64, 128, 3, false, true, true, 2, 8, const int*, const int*, unsigned short*, "
        "long long, long long, int>")
    assert not any(", 8, " in e for e in af.INSTANTIATIONS if e not in af.VARLEN_INSTANTIATIONS)
    assert af.supports_varlen(128, torch.bfloat16) and not af.supports_varlen(96, torch.bfloat16)
    assert not af.supports_varlen(128, torch.float32)
    assert not af.supports_varlen(128, torch.float16, device="cpu")
    assert not af.supports_varlen(64, torch.float16, batch=2**20, heads=2**10, max_seqlen_q=129)


# ---- SASS audit: P's registers are not rewritten while the register-A wgmma reads them ---------------
# ptxas before 13.3 could hand the registers of a register-A wgmma operand to other values while the
# asynchronous wgmma was still reading them (docs/attention_fwd_sm90.md). This walks the kernel's control flow
# from every register-A HGMMA to the WARPGROUP.DEPBAR.LE gsb0, 0x0 (wgmma.wait_group 0) that retires
# it, and fails if any instruction on the way writes one of the four A registers. Run with the
# installed NVRTC here; docs/attention_fwd_sm90.md records the run with the GPU machine's NVRTC 13.0.
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)\s*([^;]*);")
_NO_REG_DEST = ("ST", "STS", "STG", "STL", "STSM", "RED", "BAR", "SYNCS", "UTMALDG", "UTMASTG", "UTMACCTL",
                "WARPGROUP", "BRA", "EXIT", "RET", "CALL", "NOP", "MEMBAR", "FENCE", "ERRBAR", "CCTL", "DEPBAR")


def _reg_writes(opcode: str, operands: str) -> set[int]:
    """Registers an instruction writes (conservatively: vector widths from the opcode's modifiers)."""
    base = opcode.split(".")[0]
    first = operands.split(",")[0].strip()
    if base in _NO_REG_DEST or not re.fullmatch(r"R\d+", first):
        return set()
    rd = int(first[1:])
    width = 1
    if base == "HGMMA":
        width = int(re.match(r"HGMMA\.64x(\d+)x", opcode).group(1)) // 2
    elif ".128" in opcode or opcode.endswith(".4"):
        width = 4
    elif ".64" in opcode or ".WIDE" in opcode or opcode.endswith(".2"):
        width = 2
    return set(range(rd, rd + width))


def register_a_hazards(sass: str) -> tuple[int, list[str]]:
    """(number of register-A HGMMAs found, descriptions of writes to their A registers before the
    wgmma.wait_group 0 that retires them)."""
    insns = []
    for line in sass.splitlines():
        m = _SASS_LINE.search(line)
        if m:
            insns.append((int(m.group(1), 16), bool(m.group(2)), m.group(3), m.group(4).strip()))
    index = {addr: i for i, (addr, *_rest) in enumerate(insns)}
    found, problems = 0, []
    for i, (addr, _pred, opcode, operands) in enumerate(insns):
        ops = [o.strip() for o in operands.split(",")]
        if not (opcode.startswith("HGMMA") and len(ops) > 2 and re.fullmatch(r"R\d+", ops[1])):
            continue
        found += 1
        a_regs = set(range(int(ops[1][1:]), int(ops[1][1:]) + 4))
        stack, seen = [i + 1], set()
        while stack:
            j = stack.pop()
            if j in seen or j >= len(insns):
                continue
            seen.add(j)
            jaddr, jpred, jop, jops = insns[j]
            if jop.startswith("WARPGROUP.DEPBAR") and jops.replace(" ", "").endswith("0x0"):
                continue  # retired: the path ends here
            if jop.startswith("HGMMA") and j != i:
                hit = set()  # a later wgmma reading P is fine; its own accumulators are not P
            else:
                hit = _reg_writes(jop, jops) & a_regs
            if hit:
                problems.append(f"{jop} {jops} at {jaddr:#x} writes R{min(hit)} of the HGMMA at {addr:#x}")
            if jop.split(".")[0] in ("EXIT", "RET"):
                continue
            if jop.split(".")[0] == "BRA":
                stack.append(index[int(jops.split()[-1], 16)])
                if not jpred:
                    continue
            stack.append(j + 1)
    return found, problems


def dummy_wgmmas(sass: str) -> list[str]:
    """HGMMAs that read no shared-memory descriptor (gdesc[URZ]) and write no register: ptxas issues
    one to carry a wgmma.commit_group that follows no wgmma of its own path (e.g. a commit after
    two branches that each issue wgmmas). One per tile cost the sm90 backward 9-13 % (2026-12-02)."""
    return [line.strip() for line in sass.splitlines() if "HGMMA" in line and "gdesc[URZ]" in line]


def _compiled_sass(expression: str) -> str:
    from labs.sass import dump_sass, tools

    if tools()[0] is None or tools()[1] is None:
        pytest.skip("cuobjdump / nvdisasm not found (nvidia-cuda-cuobjdump and triton wheels)")
    from tileattn.kernels import family
    from tileattn.runtime import compile_cuda

    module = compile_cuda(family(af.FAMILY_NAME).path, [expression], "sm_90a")
    return dump_sass(module.cubin)


@pytest.mark.parametrize("expression", af.INSTANTIATIONS)
def test_sass_register_a_operands_untouched_until_retired(expression):
    sass = _compiled_sass(expression)
    found, problems = register_a_hazards(sass)
    d = int(expression.split("<")[1].split(",")[0])
    block_n = int(expression.split(",")[1])
    assert found >= 2 * block_n // 16, f"expected the P V wgmmas in the SASS, found {found} register-A HGMMAs"
    assert not problems, "\n".join(problems[:10])
    assert "UTMALDG" in sass and "STSM" in sass, "TMA loads and stmatrix expected"
    packed = (af.VARLEN_INSTANTIATIONS + af.PAGED_INSTANTIATIONS + af.PACKED_VARIANT_INSTANTIATIONS
              + af.VARLEN_DROPOUT_INSTANTIATIONS)
    if expression in packed:  # O: predicated 16-byte stores, no TMA store
        assert "UTMASTG" not in sass and "STG.E.128" in sass, "packed: no TMA store, predicated STG.E.128 expected"
    else:
        assert "UTMASTG" in sass, "TMA store expected"
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory traffic (spills) in the SASS"
    assert not dummy_wgmmas(sass), f"ptxas added wgmmas to carry a commit: {dummy_wgmmas(sass)[:2]}"
    assert d in af.HEAD_DIMS


def test_sass_audit_catches_a_rewritten_a_register():
    sass = """
        /*0100*/                   HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR12].tnspB, R88, gsb0 ;
        /*0110*/                   F2FP.BF16.F32.PACK_AB R153, R3, R2 ;
        /*0120*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0130*/                   F2FP.BF16.F32.PACK_AB R152, R3, R2 ;
    """
    assert register_a_hazards(sass) == (1, [("F2FP.BF16.F32.PACK_AB R153, R3, R2 at 0x110 writes R153 of the HGMMA "
                                            "at 0x100")])


def test_packed_plans_refuse_bad_arguments_before_any_launch():
    """VarlenPlan / PagedPlan raise ValueError naming what is wrong before touching a device (CPU
    tensors stand in: every check runs before the first CUDA call)."""
    q = torch.zeros(10, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(12, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(4, 10)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    plan = af.forward_varlen_plan
    with pytest.raises(ValueError, match="head_dim"):
        plan(q[..., :32], kv[..., :32], kv[..., :32], q[..., :32], lse, cu, cu, 10, causal=False, scale=0.1)
    with pytest.raises(ValueError, match="dtype"):
        plan(q.float(), kv, kv, q, lse, cu, cu, 10, causal=False, scale=0.1)
    with pytest.raises(ValueError, match="k.dtype"):
        plan(q, kv.half(), kv, q, lse, cu, cu, 10, causal=False, scale=0.1)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        plan(q[:, :3], kv, kv, q[:, :3], lse, cu, cu, 10, causal=False, scale=0.1)
    odd = torch.zeros(10, 4, 68, dtype=torch.bfloat16)[:, :, :64]  # head stride 136 bytes
    with pytest.raises(ValueError, match="TMA"):
        plan(odd, kv, kv, q, lse, cu, cu, 10, causal=False, scale=0.1)
    cache = torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.zeros(1, 6, dtype=torch.int32)
    kw = dict(max_seqlen_q=10, causal=True, scale=0.1, return_lse=True)
    with pytest.raises(ValueError, match="split"):
        af.PagedPlan(q, cache, cache, table, **kw, num_splits=2)
    with pytest.raises(ValueError, match="variants"):
        af.PagedPlan(q, cache, cache, table, **kw, variants=object())
    with pytest.raises(ValueError, match="block_size"):
        af.PagedPlan(q, cache[:, :8], cache[:, :8], table, **kw)
    with pytest.raises(ValueError, match="no block"):
        af.PagedPlan(q, cache[:0], cache[:0], table, **kw)
    with pytest.raises(ValueError, match="v_cache"):
        af.PagedPlan(q, cache, cache.half(), table, **kw)
    assert not af.supports_paged(128, torch.bfloat16, block_size=16, max_seqlen_q=1, batch=64, heads=32, kv_heads=8)
    assert af.supports_paged(128, torch.bfloat16, block_size=16, max_seqlen_q=512, batch=4, heads=32, kv_heads=8)
    assert not af.supports_paged(128, torch.bfloat16, block_size=8, max_seqlen_q=512, batch=4, heads=32, kv_heads=8)
    # one 512-query chunk among 63 decodes: 63 tiles of one query each would scan their whole K/V
    assert not af.supports_paged(128, torch.bfloat16, block_size=16, max_seqlen_q=512, batch=64, heads=32,
                                 kv_heads=8, total_q=512 + 63)
    assert af.supports_paged(128, torch.bfloat16, block_size=16, max_seqlen_q=512, batch=4, heads=32, kv_heads=8,
                             total_q=4 * 512)



# ---- dropout (kDropout): the keep bits the kernel draws are dropout_mask's ----------------------------
# Mirror of fwd90::dropout_keep_bits / apply_dropout: per consumer thread and K/V block n, one Philox
# call per row h and 32-key group (counter (4 G + t, position, b * H + head, offset), variants.cuh's
# dropout_bits), keep bit i = 4 (4 grp + w) + 2 h + e of word i // 32 from half e of Philox word w
# (compared in the word's upper half), then element i of the accumulator is that bit.
_M32 = 0xFFFFFFFF


def dropout_keep_words(n: int, block_n: int, pos, bh, t, seed: int, offset: int, thr: int, *, bug: str = ""):
    """keep words [T, block_n // 64] (32-bit values in uint64) of T threads: pos, bh [T, 2] (their
    rows g, g + 8), t [T] (lane % 4)."""
    import numpy as np

    from tileattn.dropout import philox4x32_7

    u = np.uint64
    groups = block_n // 32
    grp = np.arange(groups, dtype=np.uint64)
    ctr0 = (u(4) * (u(n * groups) + grp))[None, None, :] + t.astype(np.uint64)[:, None, None]  # [T, 1, G]
    if bug == "t_for_word":  # the word index where the lane class goes: a wrong counter
        ctr0 = (u(4) * (u(n * groups) + grp))[None, None, :] + u(0) * t.astype(np.uint64)[:, None, None]
    key = (u(seed & _M32), u(((seed >> 32) + (offset >> 32)) & _M32))
    words = philox4x32_7((ctr0, pos.astype(np.uint64)[:, :, None], bh.astype(np.uint64)[:, :, None],
                           u(offset & _M32)), key)  # 4 x [T, 2, G]
    thr16 = u(thr << 16)
    keep = np.zeros((len(t), block_n // 64), dtype=np.uint64)
    for h in range(2):
        for g in range(groups):
            for w in range(4):
                i = 4 * (4 * g + w) + 2 * h
                word = words[w][:, h, g]
                lo = (((word << u(16)) & u(_M32)) >= thr16).astype(np.uint64)
                hi = (word >= thr16).astype(np.uint64)
                keep[:, i // 32] |= lo << u(i % 32)
                keep[:, i // 32] |= hi << u(i % 32 + 1)
    return keep


def kernel_dropout_mask(batch: int, heads: int, kv_heads: int, nq: int, nk: int, p: float, seed: int, offset: int,
                        block_n: int, pack_gqa: bool, *, bug: str = ""):
    """bool [B, H, Nq, Nk]: what the kernel's threads keep, tile by tile (non-causal tile order,
    GQA packing as _geometry decides), each element from its thread's keep bit."""
    import numpy as np

    from tileattn.dropout import drop_threshold

    geo = af._geometry(batch, heads, kv_heads, nq, nk, 128, af.Sm90Config(block_n, 2), pack_gqa, 60 << 20)
    rows = BLOCK_M // geo.pack
    m_blocks = -(-nq // rows)
    thr = drop_threshold(p)
    # The 256 consumer threads (c, warp, lane) and their accumulator rows g, g + 8 (tile rows r0, r0 + 8).
    c, warp, lane = (a.ravel() for a in np.meshgrid(np.arange(2), np.arange(4), np.arange(32), indexing="ij"))
    g, t = lane // 4, lane % 4
    r = (c * 64 + warp * 16 + g)[:, None] + 8 * np.arange(2)[None, :]  # [T, 2]
    n_blocks = -(-nk // block_n)
    out = np.zeros((batch, heads, m_blocks * rows, n_blocks * block_n), dtype=bool)
    for tl in range(geo.tiles):
        m_block, head0, b = tile_coords(False, tl, m_blocks, heads // geo.pack, geo.pack, batch, geo.l2_group)
        pos = m_block * rows + r % rows
        head = head0 + r // rows  # [T, 2]
        bh = b * heads + (np.full_like(head, head0) if bug == "no_row_head" else head)  # bug: all in the first head
        for n in range(n_blocks):
            keep = dropout_keep_words(n, block_n, pos, bh, t, seed, offset, thr, bug=bug)
            for i in range(block_n // 2):  # accumulator element i: row g + 8h, column 8j + 2t + e
                j, h, e = i // 4, (i >> 1) & 1, i & 1
                bit = ((keep[:, i // 32] >> np.uint64(i % 32)) & np.uint64(1)).astype(bool)
                out[b, head[:, h], pos[:, h], n * block_n + 8 * j + 2 * t + e] = bit
    return torch.from_numpy(out[:, :, :nq, :nk].copy())


@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize(
    "batch, heads, kv_heads, nq, nk, pack_gqa",
    [(2, 3, 3, 129, 200, False), (1, 2, 1, 1, 77, False), (2, 8, 2, 33, 130, True), (1, 16, 1, 5, 64, True),
     (1, 4, 1, 300, 31, False)],
    ids=["mha", "nq1", "gqa4_packed", "gqa16_packed_rows8", "nk31"])
@pytest.mark.parametrize("p, seed, offset", [(0.5, 1234, 8), (0.9, (1 << 63) + 12345, (1 << 35) + 20), (0.17, 0, 0)])
def test_dropout_keep_bits_are_dropout_mask(block_n, batch, heads, kv_heads, nq, nk, pack_gqa, p, seed, offset):
    """Every (b, h, i, j) the kernel's threads drop or keep, over every tile shape and GQA packing
    (rows = 128 / pack: 16 and 8 put a thread's two rows in different heads), equals
    tileattn.dropout.dropout_mask element for element."""
    from tileattn.dropout import dropout_mask

    got = kernel_dropout_mask(batch, heads, kv_heads, nq, nk, p, seed, offset, block_n, pack_gqa)
    want = dropout_mask(seed, offset, batch, heads, nq, nk, p)
    bad = int((got != want).sum())
    assert bad == 0, f"{bad} of {want.numel()} keep bits differ from dropout_mask (first at {(got != want).nonzero()[0]})"


@pytest.mark.parametrize("bug", ["no_row_head", "t_for_word"])
def test_dropout_keep_bits_model_catches_a_wrong_counter(bug):
    from tileattn.dropout import dropout_mask

    got = kernel_dropout_mask(1, 16, 1, 5, 64, 0.5, 7, 0, 64, True, bug=bug)
    assert not torch.equal(got, dropout_mask(7, 0, 1, 16, 5, 64, 0.5)), f"the model with bug {bug!r} went unnoticed"


def test_dropout_half_word_compare_is_the_16_bit_compare():
    """(word << 16) >= thr << 16 and word >= thr << 16 are (word & 0xffff) >= thr and (word >> 16)
    >= thr, for thresholds and halves at their edges (uint32 arithmetic)."""
    for thr in (1, 2, 0x7FFF, 0x8000, 0xFFFE, 0xFFFF):
        for hi in (0, thr - 1, thr, thr + 1, 0xFFFF):
            for lo in (0, thr - 1, thr, thr + 1, 0xFFFF):
                hi, lo = hi & 0xFFFF, lo & 0xFFFF
                word = (hi << 16) | lo
                assert ((word << 16) & _M32 >= thr << 16) == (lo >= thr), (thr, hi, lo)
                assert (word >= thr << 16) == (hi >= thr), (thr, hi, lo)


def test_dropout_instantiations_and_plan_checks():
    from tileattn.kernels.attention_fwd_sm80 import VariantArgs

    from tileattn.kernels import family

    assert af.DROPOUT & (af.WINDOW | af.SOFTCAP | af.ALIBI | af.VARLEN | af.PAGED) == 0
    src = family(af.FAMILY_NAME).path.read_text()
    assert f"constexpr int kDropout = {af.DROPOUT};" in src, "the kernel's dropout bit is the Python one"
    assert set(af.DROPOUT_INSTANTIATIONS) <= set(af.INSTANTIATIONS)
    assert not set(af.DROPOUT_INSTANTIATIONS) & set(af.VARIANT_INSTANTIATIONS)
    for d, sets in af.DROPOUT_FLAG_SETS.items():
        assert af.VARIANT_DEFAULTS[d].block_n % 64 == 0, "whole keep words per block (the kernel's static_assert)"
        for flags in sets:
            assert flags & af.DROPOUT
            for bf16 in (False, True):
                assert af.variant_expression(d, af.VARIANT_DEFAULTS[d], bf16, flags) in af.DROPOUT_INSTANTIATIONS
    bf = torch.bfloat16
    assert af.variant_flags(VariantArgs(dropout_p=0.1)) == af.DROPOUT
    assert af.variant_flags(VariantArgs(4096, 0, 30.0, 8, 0.1)) == af.DROPOUT | 7
    for d in af.HEAD_DIMS:  # a combination runs its own set, or the windowed one with an unbounded window
        for flags in range(8):
            k = af.dropout_kernel_flags(d, af.DROPOUT | flags)
            if d == 128 and flags & af.ALIBI:  # spills under NVRTC 13.0: not registered, sm80 runs it
                assert k is None
                continue
            assert k in af.DROPOUT_FLAG_SETS[d] and k in (af.DROPOUT | flags, af.DROPOUT | flags | af.WINDOW)
    assert af.dropout_kernel_flags(256, af.DROPOUT | af.SOFTCAP | af.ALIBI) == af.DROPOUT | 7
    assert af.supports_dropout(64, bf, VariantArgs(softcap=30.0, alibi_batch_stride=0, dropout_p=0.1))
    assert af.supports_dropout(128, bf, VariantArgs(softcap=30.0, dropout_p=0.1))
    assert not af.supports_dropout(128, bf, VariantArgs(alibi_batch_stride=0, dropout_p=0.1))
    assert af.supports_dropout(128, bf, VariantArgs(dropout_p=0.1))
    assert af.supports_dropout(64, torch.float16, VariantArgs(100, 0, dropout_p=0.5))
    assert not af.supports_dropout(128, bf, VariantArgs())  # p = 0: not a dropout call
    assert not af.supports_dropout(96, bf, VariantArgs(dropout_p=0.1))
    assert not af.supports_dropout(128, torch.float32, VariantArgs(dropout_p=0.1))
    q = torch.zeros(1, 2, 8, 96, dtype=bf)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="no dropout instantiation for head_dim 96"):
        af.ForwardPlan(q, q, q, q, lse, causal=False, scale=0.1, variants=VariantArgs(dropout_p=0.1))
    with pytest.raises(ValueError, match="causal"):
        af.ForwardPlan(q, q, q, q, lse, causal=True, scale=0.1, variants=VariantArgs(dropout_p=0.1))
