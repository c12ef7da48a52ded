"""CPU checks of csrc/attention_bwd_sm90.cu's index maps, pipeline protocol and tile walk (no GPU).

What the Hopper backward relies on, restated in Python and checked for every registered config:

* operand layouts: each wgmma descriptor the kernel builds (S^T = K Q^T and dP^T = V dO^T K-major,
  dV += P^T dO and dK += dS^T Q with MN-major B, dQ = dS K with both operands MN-major) reads, for
  every (row, k), the element that TMA or the kernel's stmatrix stored there;
* the stmatrix addresses (store_fragments) put every accumulator element of a warpgroup's 64 rows
  where the 128-byte-swizzled panel layout (TMA's) has it, for dS^T and for the dK / dV epilogue,
  whose TMA store boxes then read the right rows;
* the dQ RED addresses: each thread's float4 of the 64 x 64 dQ accumulator lands on the elements of
  the sm80 fragment-order dq_accum layout that the convert kernel reads back as those (query, col),
  and the two MMA warpgroups together cover the query tile x d exactly once;
* the tile walk (m_first, the GQA head loop, the `masked` flag, key and query edges) as a float64
  emulation of the kernel's arithmetic, against float64 autograd through tileattn.reference;
* the mbarrier / named-barrier protocol (K/V once, the Q + lse2 and dO + delta rings, two MMA
  warpgroups, the double-buffered dS^T tile, the epilogue's reuse of sK / sV) under random
  interleavings: no deadlock, every read sees the expected iteration's data, nothing is overwritten
  while a reader may still use it;
* SASS: the register-A operands (P^T, dS^T) are not rewritten before the wgmma_wait that retires
  them, and there is no local memory.

The Python mirrors the C++ by hand: change them together.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tileattn import reference
from tileattn.dropout import UNBOUNDED, drop_threshold, dropout_mask, philox4x32_7
from tileattn.kernels import attention_bwd_sm80 as sm80
from tileattn.kernels import attention_bwd_sm90 as ab

from .test_attention_fwd_sm90_model import (
    MBarrier,
    NamedBarrier,
    acc_pos,
    dummy_wgmmas,
    kmajor_element,
    mnmajor_element,
    register_a_hazards,
    swizzle128,
    tma_panel_addr,
)

BLOCK_N = ab.BLOCK_N
LOG2E = math.log2(math.e)
C = ab.Sm90BwdConfig
# The key-split layout (two MMA warpgroups x 64 keys): d = 64 and 128. d = 256's role-split layout has
# its own model in tests/test_attention_bwd_sm90_d256_model.py.
CONFIGS = sorted({(d, cfg) for d in ab.HEAD_DIMS if ab.block_n_of(d) == BLOCK_N for causal in (False, True)
                  for cfg in ab.tuning_candidates(d, causal)})


def smem_offsets(d: int, cfg, deterministic: bool = False) -> dict[str, int]:
    """Byte offsets of the kernel's shared-memory tiles from the 1024-aligned base."""
    bm, st = cfg.block_m, cfg.stages
    off = {"K": 0, "V": BLOCK_N * d * 2}
    off["Q"] = off["V"] + BLOCK_N * d * 2
    off["dO"] = off["Q"] + st * bm * d * 2
    off["dS"] = off["dO"] + st * bm * d * 2
    off["dQ"] = off["dS"] + 2 * BLOCK_N * bm * 2
    off["lse"] = off["dQ"] + cfg.dq_buffers(d, deterministic) * bm * d * 4
    off["delta"] = off["lse"] + st * bm * 4
    off["end"] = off["delta"] + st * bm * 4
    return off


@pytest.mark.parametrize("d,cfg", CONFIGS, ids=str)
def test_smem_layout_fits_and_is_aligned(d, cfg):
    for det in (False, True):
        if not cfg.fits(d, det):
            assert det and (d, cfg) == (64, C(128, 3)), (d, cfg, det)  # the one config without room
            continue
        off = smem_offsets(d, cfg, det)
        assert off["end"] + 1024 == cfg.smem_bytes(d, det) <= ab.SMEM_LIMIT - ab.STATIC_SMEM
        assert all(off[name] % 1024 == 0 for name in ("K", "V", "Q", "dO", "dS", "dQ")), off  # 128B swizzle atoms
        assert off["lse"] % 16 == 0 and off["delta"] % 16 == 0  # bulk copy destinations (and source, dQ)
    assert cfg.block_m * d == 8192  # dQ is 64 x 64 per MMA warpgroup


def store_fragments_address(rows: int, row0: int, warp: int, lane: int, j: int) -> int:
    """Mirror of bwd90::store_fragments: the byte address lane `lane` gives stmatrix number j."""
    mi, rr = lane // 8, lane % 8
    row = row0 + warp * 16 + 8 * (mi & 1) + rr
    chunk = 2 * j + (mi >> 1)
    return row * 128 + (chunk // 8) * (rows * 128) + (((chunk % 8) ^ rr) << 4)


def stored_elements(rows: int, row0: int, cols: int) -> dict[int, tuple[int, int]]:
    """byte address -> (row, col) of the tile for every element one warpgroup's store_fragments
    writes (an m64 x cols accumulator, rows row0..row0 + 63)."""
    written = {}
    for warp in range(4):
        for j in range(cols // 16):
            for m in range(4):          # stmatrix.x4 matrix m, row r: address of lane 8m + r
                for r in range(8):
                    base = store_fragments_address(rows, row0, warp, 8 * m + r, j)
                    for t in range(4):  # its 8 elements: register m of lanes 4r + t
                        for half in range(2):
                            row, col = acc_pos(warp, 4 * r + t, 8 * j + 2 * m + half)
                            addr = base + 4 * t + 2 * half
                            assert addr not in written, f"two elements written to byte {addr}"
                            written[addr] = (row0 + row, col)
    return written


@pytest.mark.parametrize("d,cfg", CONFIGS, ids=str)
def test_stmatrix_tiles_match_the_panel_layout(d, cfg):
    for w in range(2):
        # dS^T: rows = keys 64 w.., columns = queries; dK / dV: rows = keys, columns = d.
        for cols in (cfg.block_m, d):
            written = stored_elements(BLOCK_N, 64 * w, cols)
            assert len(written) == 64 * cols
            for addr, (row, col) in written.items():
                assert addr == tma_panel_addr(0, BLOCK_N, row, col), (w, cols, row, col)
        # The epilogue's TMA store box p of warpgroup w: 64 rows x 64 columns starting at
        # sK + p * 128 * 128 + 64 w * 128 bytes (1024-aligned), read with the same swizzle.
        for p in range(d // 64):
            box = p * BLOCK_N * 128 + 64 * w * 128
            assert box % 1024 == 0
            for r in range(0, 64, 7):
                for c in range(0, 64, 5):
                    assert tma_panel_addr(box, 64, r, c) == tma_panel_addr(0, BLOCK_N, 64 * w + r, 64 * p + c)


@pytest.mark.parametrize("d,cfg", CONFIGS, ids=str)
def test_descriptors_read_what_was_written(d, cfg):
    bm, stages = cfg.block_m, cfg.stages
    off = smem_offsets(d, cfg)
    kv_panel, q_panel, q_stage = BLOCK_N * 128, bm * 128, bm * d * 2  # bytes
    ds_written = {}
    for w in range(2):
        ds_written.update({a: rc for a, rc in stored_elements(BLOCK_N, 64 * w, bm).items()})
    ds_at = {rc: a for a, rc in ds_written.items()}  # (key, query) -> byte in the dS^T tile
    rng = random.Random(d + bm + stages)
    for _ in range(600):
        w, stage, k = rng.randrange(2), rng.randrange(stages), rng.randrange(16)
        # S^T = K_w Q^T (dP^T = V_w dO^T alike): A = key rows 64 w.. of sK, B = query rows of the stage.
        ks, r, n = rng.randrange(d // 16), rng.randrange(64), rng.randrange(bm)
        start_a = off["K"] + 64 * w * 128 + (ks // 4) * kv_panel + 32 * (ks % 4)
        assert kmajor_element(start_a, 1024, r, k) == tma_panel_addr(off["K"], BLOCK_N, 64 * w + r, 16 * ks + k)
        q0 = off["Q"] + stage * q_stage
        start_b = q0 + (ks // 4) * q_panel + 32 * (ks % 4)
        assert kmajor_element(start_b, 1024, n, k) == tma_panel_addr(q0, bm, n, 16 * ks + k)
        # dV += P^T dO (dK += dS^T Q alike): B = dO of the stage, MN-major, N = d, k = queries.
        kk, col = rng.randrange(bm // 16), rng.randrange(d)
        do0 = off["dO"] + stage * q_stage
        assert mnmajor_element(do0 + 2048 * kk, bm * 128, 1024, col, k) == tma_panel_addr(do0, bm, 16 * kk + k, col)
        # dQ_w = dS K: A = dS (M = queries of panel a_panel, K = keys) from the dS^T tile,
        # B = K (N = d columns of panel b_panel), both MN-major, k = keys 16 kk...
        a_panel = w if bm == 128 else 0
        b_panel = w if d == 128 else 0
        buf = rng.randrange(2)
        ds0 = off["dS"] + buf * BLOCK_N * bm * 2
        kk, m, n = rng.randrange(BLOCK_N // 16), rng.randrange(64), rng.randrange(64)
        got_a = mnmajor_element(ds0 + a_panel * BLOCK_N * 128 + 2048 * kk, BLOCK_N * 128, 1024, m, k)
        assert got_a == ds0 + ds_at[(16 * kk + k, 64 * a_panel + m)]
        got_b = mnmajor_element(off["K"] + b_panel * BLOCK_N * 128 + 2048 * kk, BLOCK_N * 128, 1024, n, k)
        assert got_b == tma_panel_addr(off["K"], BLOCK_N, 16 * kk + k, 64 * b_panel + n)
    assert swizzle128(0) == 0


def fragment_order_index(i: int, c: int, d: int) -> int:
    """Float offset of element (query row i, column c) of one (b, h) in the sm80 dq_accum layout
    [NqPad/16, d/8, 32, 4]: tile (i/16, c/8), lane 4 (i % 8) + (c % 8) / 2, slot 2 ((i % 16) / 8) + c % 2."""
    return ((i // 16) * (d // 8) + c // 8) * 128 + (4 * (i % 8) + (c % 8) // 2) * 4 + 2 * ((i % 16) // 8) + c % 2


@pytest.mark.parametrize("d,cfg", CONFIGS, ids=str)
def test_dq_red_addresses_hit_the_fragment_order_layout(d, cfg):
    """Atomic mode REDs each float4 to dq_accum + (row0 of the tile) * d + tile_off; deterministic
    mode stores it at staging + tile_off and bulk-adds the staging tile to dq_accum + row0 * d: so
    the tile's elements must fill exactly the contiguous floats [m0 d, (m0 + block_m) d)."""
    bm = cfg.block_m
    for m0 in (0, bm, 5 * bm):
        covered, offsets = set(), set()
        for w in range(2):
            a_panel = w if bm == 128 else 0
            b_panel = w if d == 128 else 0
            for warp in range(4):
                for lane in range(32):
                    tile_off = (64 * a_panel + 16 * warp) * d + (64 * b_panel // 8) * 128 + lane * 4  # the kernel's
                    for j in range(8):
                        for slot in range(4):
                            row, col = acc_pos(warp, lane, 4 * j + slot)  # dQ accumulator element
                            query, column = m0 + 64 * a_panel + row, 64 * b_panel + col
                            assert m0 * d + tile_off + j * 128 + slot == fragment_order_index(query, column, d)
                            covered.add((query, column))
                            offsets.add(tile_off + j * 128 + slot)
        assert covered == {(m0 + i, c) for i in range(bm) for c in range(d)}
        assert offsets == set(range(bm * d)), "the staging tile is the contiguous dq_accum tile"


# ---- block order and tile walk ----------------------------------------------------------------------
def block_coords(idx: int, n_blocks: int, pairs: int, section: int) -> tuple[int, int]:
    """Mirror of the kernel's blockIdx.x -> (n_block, pair), pair = kv_head + Hkv * batch."""
    sec = idx // (section * n_blocks)
    in_sec = idx - sec * section * n_blocks
    sec_pairs = min(section, pairs - sec * section)
    return in_sec // sec_pairs, sec * section + in_sec % sec_pairs


def walk(it: int, kv_head: int, group: int, m_blocks: int, m_count: int, block_m: int,
         rot: int = 0) -> tuple[int, int]:
    """Mirror of walk_head / walk_m0: step `it` of a CTA's walk -> (query head, first query row);
    `rot` = the rotated walk's n_block % m_count (0 unrotated)."""
    step = it % m_count + rot
    step -= m_count if step >= m_count else 0
    return kv_head * group + it // m_count, (m_blocks - 1 - step) * block_m


@pytest.mark.parametrize("m_blocks,m_first", [(1, 0), (5, 0), (5, 3), (64, 10), (7, 6)])
def test_rotated_walk_visits_every_tile_once(m_blocks, m_first):
    """Every rotation of the walk visits each (query head, tile m_first..m_blocks-1) exactly once, and
    key blocks n = 0, 1, ... in flight together start on pairwise different tiles (the point of it)."""
    m_count, group = m_blocks - m_first, 3
    starts = []
    for n_block in range(2 * m_count + 1):
        rot = n_block % m_count
        steps = [walk(it, 0, group, m_blocks, m_count, 1, rot) for it in range(group * m_count)]
        assert sorted(steps) == [(h, m) for h in range(group) for m in range(m_first, m_blocks)], (n_block, steps)
        starts.append(steps[0][1])
    assert len(set(starts[:m_count])) == m_count, starts


@pytest.mark.parametrize("n_blocks,pairs", [(1, 1), (5, 1), (1, 7), (16, 128), (64, 12), (3, 10)])
def test_block_order(n_blocks, pairs):
    """Every (n_block, pair) once; per pair, key blocks in ascending blockIdx order (the deterministic
    mode's deadlock argument); within a section all pairs' key block n before any key block n + 1
    (causal: longest CTAs first)."""
    for section in sorted({1, 2, 4, 8, pairs, max(1, pairs - 1)}):
        section = min(section, pairs)
        coords = [block_coords(i, n_blocks, pairs, section) for i in range(n_blocks * pairs)]
        assert sorted(coords) == [(n, p) for n in range(n_blocks) for p in range(pairs)], section
        for p in range(pairs):
            ns = [n for n, q in coords if q == p]
            assert ns == list(range(n_blocks)), (section, p, ns)
        for i in range(1, len(coords)):
            (n_a, p_a), (n_b, p_b) = coords[i - 1], coords[i]
            if p_a // section == p_b // section:
                assert n_b >= n_a, (section, i, coords[i - 1], coords[i])


def test_section_pairs():
    # d=128 16-bit MHA: 2 + 2 bytes of Q and dO, 4 of dq_accum per element: 1 KiB per query row
    assert ab.section_pairs(2048, 128, 1, 2, True, False) == 16       # 40 MiB / 2 MiB = 20 -> 16
    assert ab.section_pairs(8192, 128, 1, 2, True, True) == 4         # 40 / 8 = 5 -> 4
    assert ab.section_pairs(32768, 128, 1, 2, True, False) == 1       # one pair is 32 MiB
    assert ab.section_pairs(65536, 128, 1, 2, True, False) == 1       # more than L2: still 1
    assert ab.section_pairs(2048, 128, 8, 2, False, True) == 2        # GQA 8: 16 MiB per pair
    assert ab.section_pairs(2048, 128, 1, 2, False, False) == 1       # non-causal atomic keeps 1


# ---- the tile walk, emulated in float64 -----------------------------------------------------------
@dataclass(frozen=True)
class Var:
    """The variants of attention_bwd_sm90_variants as the kernel holds them: window edges (UNBOUNDED:
    none; causal is right = 0), softcap (0: off), ALiBi slopes [B, H] float64 (None: off), dropout
    (seed, offset, p) (None: off; the keep bits from dropout_tile_keep, the kernel's mapping)."""

    left: int = UNBOUNDED
    right: int = UNBOUNDED
    cap: float = 0.0
    slopes: torch.Tensor | None = None
    dropout: tuple[int, int, float] | None = None


def window_tiles(n0: int, nq: int, nk: int, left: int, right: int, block_m: int,
                 block_n: int = BLOCK_N) -> tuple[int, int]:
    """Mirror of window_tiles (csrc): query tiles [first, end) whose queries' windows reach a key
    of the block [n0, min(n0 + block_n, nk)) (block_n: keys per CTA, 64 at d = 256)."""
    diag = nk - nq
    i_lo = max(0, n0 - diag - right)
    i_hi = min(nq - 1, min(n0 + block_n, nk) - 1 - diag + left)
    first = i_lo // block_m
    return first, first if i_hi < i_lo else i_hi // block_m + 1


def window_flags(n0: int, m0: int, nk: int, diag: int, left: int, right: int, block_m: int) -> tuple[bool, bool]:
    """Mirror of a windowed kernel's (masked, upper_idle) for the tile (n0, m0)."""
    key_edge = n0 + BLOCK_N > nk
    masked = key_edge or not (n0 >= m0 + block_m - 1 + diag - left and n0 + BLOCK_N - 1 <= m0 + diag + right)
    upper_idle = n0 + 64 >= nk or n0 + 64 > m0 + block_m - 1 + diag + right
    return masked, upper_idle


def window_thresholds(key: int, nk: int, diag: int, left: int, right: int, m0: int, t: int,
                      block_m: int) -> tuple[int, int]:
    """Mirror of window_mask's (lo[h], hi[h]) for the key of accumulator row h: element 8 j + e
    (query m0 + 8 j + 2 t + e) is hidden iff 8 j + e < lo or 8 j + e > hi."""
    lo = block_m if key >= nk else key - diag - right - m0 - 2 * t
    return lo, key - diag + left - m0 - 2 * t


def tile_step(qt, dot, kt, vt, lse2_t, delta_t, n0: int, m0: int, nk: int, diag: int, causal: bool,
              scale_log2: float, block_m: int, var: Var | None = None, slope: float = 0.0, keep=None):
    """One step of a CTA's walk as the MMA warpgroups compute it (float64): the query tile qt / dot
    [block_m, d] (rows past Nq zero) against the key block kt / vt [BLOCK_N, d] (rows past Nk zero),
    with the kernel's `masked` flag, masks and idle upper warpgroup. Returns the tile's additions
    (dV, dK before the scale, dQ before the scale): [keys, d], [keys, d], [block_m, d] with keys 64
    when warpgroup 1 idles, else BLOCK_N. Checks that an unmasked tile needs no mask and that
    the idle upper warpgroup's keys are all hidden. `var` (causal False): the variant kernel's
    logits (softcap, the ALiBi bias with this head's `slope`), window masks and dS factor; `keep`
    (dropout): bool [BLOCK_N, block_m], dV from P^T keep (the caller scales the finished dV by 1 / (1 - p),
    as the kernel's epilogue), dS^T = P^T (dP^T keep / (1 - p) - D)."""
    st = kt @ qt.T                                   # S^T [keys, queries]
    dpt = vt @ dot.T                                 # dP^T
    key = torch.arange(n0, n0 + BLOCK_N, dtype=torch.float64)[:, None]
    query = torch.arange(m0, m0 + block_m, dtype=torch.float64)[None, :]
    dcap = 1.0
    if var is None:
        masked = n0 + BLOCK_N > nk or (causal and m0 + diag < n0 + BLOCK_N - 1)
        upper_idle = n0 + 64 >= nk or (causal and n0 + 64 > m0 + block_m - 1 + diag)
        hidden = (key >= nk) | ((key > query + diag) if causal else torch.zeros_like(key, dtype=bool))
        x = st * scale_log2
    else:
        masked, upper_idle = window_flags(n0, m0, nk, diag, var.left, var.right, block_m)
        hidden = (key >= nk) | (key < query + diag - var.left) | (key > query + diag + var.right)
        if var.cap > 0:  # the kernel: tanh(s scale / cap) (hardware tanh) from scale / cap, times cap log2(e)
            th = torch.tanh(st * (scale_log2 / LOG2E) / var.cap)
            x, dcap = var.cap * LOG2E * th, 1.0 - th * th
        else:
            x = st * scale_log2
        x = x - LOG2E * slope * (query + diag - key).abs()
    p = torch.exp2(x - lse2_t[None, :])
    if masked:
        p = torch.where(hidden, torch.zeros_like(p), p)
    else:
        assert not hidden.any(), f"tile n0={n0} m0={m0} needs a mask but `masked` is false"
    pz = p
    if keep is not None:
        pz, dpt = p * keep, dpt * keep / (1.0 - var.dropout[2])
    dst = p * (dpt - delta_t[None, :]) * dcap
    # Keys 64.. all hidden: warpgroup 1 idles, dQ reads only the first 64 keys.
    assert not upper_idle or bool(hidden[64:].all()), f"n0={n0} m0={m0}: keys 64.. are visible"
    keys = 64 if upper_idle else BLOCK_N
    assert var is not None or not hidden[:64].all(), f"n0={n0} m0={m0}: warpgroup 0 visits a tile it cannot see"
    assert not hidden.all(), f"n0={n0} m0={m0}: the walk visits a tile without a visible (query, key) pair"
    return pz[:keys] @ dot, dst[:keys] @ qt, dst[:keys].T @ kt[:keys]


def padded_operands(q, k, v, dout, out, lse, pad_q: int, pad_k: int):
    """What the kernels read, padded to whole tiles: q, dO (pad_q rows), k, v (pad_k rows), lse2 =
    lse in log2 units with +inf for rows that saw no key and for the padding (so their P is 0), and
    the preprocess's delta = rowsum(dO * O) (0 in the padding)."""
    pad = torch.nn.functional.pad
    lse2 = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse * math.log2(math.e))
    return (pad(q, (0, 0, 0, pad_q)), pad(dout, (0, 0, 0, pad_q)), pad(k, (0, 0, 0, pad_k)),
            pad(v, (0, 0, 0, pad_k)), pad(lse2, (0, pad_q), value=math.inf), pad((dout * out).sum(-1), (0, pad_q)))


def emulate(q, k, v, dout, out, lse, causal: bool, scale: float, block_m: int, rotate: bool = False,
            var: Var | None = None):
    """The kernel's arithmetic per (batch, kv head, key block), query head of the group and query
    tile, with its m_first, `masked` flag and masks, in float64 (no 16-bit rounding), plus the
    preprocess / convert steps (`rotate`: the rotated walk's order; `var`: the variant kernel, its
    walk over window_tiles). Also checks that an unmasked tile really needs no mask and that the
    query tiles skipped (before m_first, windowed also from m_end) hold no visible (query, key)
    pair."""
    b_, h_, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group, diag = h_ // hkv, nk - nq
    m_blocks, n_blocks = -(-nq // block_m), -(-nk // BLOCK_N)
    pad_q, pad_k = m_blocks * block_m - nq, n_blocks * BLOCK_N - nk
    qp, dop, kp, vp, lse2, delta = padded_operands(q, k, v, dout, out, lse, pad_q, pad_k)
    scale_log2 = scale * math.log2(math.e)
    dq_acc = torch.zeros_like(qp)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for b in range(b_):
        for hk in range(hkv):
            for nb in range(n_blocks):
                n0 = nb * BLOCK_N
                if var is None:
                    m_first, m_end = (max(0, n0 - diag) // block_m if causal else 0), m_blocks
                    assert_skipped_tiles_hidden(m_first, block_m, n0, nq, nk, diag, causal)
                else:
                    m_first, m_end = window_tiles(n0, nq, nk, var.left, var.right, block_m)
                    assert_window_skips_hidden(m_first, m_end, block_m, n0, nq, nk, var)
                m_count = m_end - m_first
                dk_blk = torch.zeros(BLOCK_N, d, dtype=torch.float64)
                dv_blk = torch.zeros(BLOCK_N, d, dtype=torch.float64)
                for it in range(group * m_count):
                    head, m0 = walk(it, hk, group, m_end, m_count, block_m, nb % m_count if rotate else 0)
                    slope = 0.0 if var is None or var.slopes is None else float(var.slopes[b, head])
                    keep = None
                    if var is not None and var.dropout is not None:
                        seed, offset, pdrop = var.dropout
                        keep = dropout_tile_keep(seed, offset, b * h_ + head, n0, m0, block_m,
                                                 drop_threshold(pdrop))
                    add_v, add_k, add_q = tile_step(
                        qp[b, head, m0:m0 + block_m], dop[b, head, m0:m0 + block_m], kp[b, hk, n0:n0 + BLOCK_N],
                        vp[b, hk, n0:n0 + BLOCK_N], lse2[b, head, m0:m0 + block_m], delta[b, head, m0:m0 + block_m],
                        n0, m0, nk, diag, causal, scale_log2, block_m, var, slope, keep)
                    dv_blk[:add_v.shape[0]] += add_v
                    dk_blk[:add_k.shape[0]] += add_k
                    dq_acc[b, head, m0:m0 + block_m] += add_q
                rows = min(BLOCK_N, nk - n0)
                dk[b, hk, n0:n0 + rows] = scale * dk_blk[:rows]
                dv_scale = 1.0 if var is None or var.dropout is None else 1.0 / (1.0 - var.dropout[2])
                dv[b, hk, n0:n0 + rows] = dv_scale * dv_blk[:rows]
    return scale * dq_acc[:, :, :nq], dk, dv


def assert_window_skips_hidden(m_first: int, m_end: int, block_m: int, n0: int, nq: int, nk: int, var: Var):
    """The query tiles outside [m_first, m_end) hold no visible (query, key) pair of the key block."""
    ks = torch.arange(n0, n0 + BLOCK_N)[:, None]
    diag = nk - nq
    for m in [*range(m_first), *range(m_end, -(-nq // block_m))]:
        qs = torch.arange(m * block_m, (m + 1) * block_m)[None, :]
        seen = (ks < nk) & (qs < nq) & (ks >= qs + diag - var.left) & (ks <= qs + diag + var.right)
        assert not seen.any(), (m, n0, m_first, m_end)


def assert_skipped_tiles_hidden(m_first: int, block_m: int, n0: int, nq: int, nk: int, diag: int, causal: bool):
    """The query tiles a key block skips (before m_first) hold no visible (query, key) pair."""
    ks = torch.arange(n0, n0 + BLOCK_N)[:, None]
    for m in range(m_first):
        qs = torch.arange(m * block_m, (m + 1) * block_m)[None, :]
        assert not ((ks < nk) & (ks <= qs + diag) & (qs < nq)).any(), (m, n0)


WALK_SHAPES_QK = [(1, 1), (65, 65), (130, 129), (129, 300), (300, 129), (5, 200), (200, 5), (100, 192)]
WALK_SHAPES = [(1, 1, 1, 1), (65, 65, 2, 1), (130, 129, 2, 2), (129, 300, 4, 1), (300, 129, 2, 1),
               (5, 200, 2, 2), (200, 5, 4, 2), (257, 256, 8, 1), (100, 192, 2, 1), (192, 200, 2, 1)]


@pytest.mark.parametrize("rotate", [False, True], ids=["", "rot"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,block_m", [(128, 64), (64, 128)])
@pytest.mark.parametrize("nq,nk,heads,kv_heads", WALK_SHAPES)
def test_emulated_walk_matches_autograd(nq, nk, heads, kv_heads, d, block_m, causal, rotate):
    assert_walk_matches_autograd(lambda *args: emulate(*args, causal, 1.0 / math.sqrt(d), block_m, rotate), nq, nk,
                                 heads, kv_heads, d, causal)


def assert_walk_matches_autograd(run, nq, nk, heads, kv_heads, d, causal):
    """A kernel emulation `run(q, k, v, dout, out, lse)` -> (dq, dk, dv) against float64 autograd
    through tileattn.reference on random float64 inputs (B = 1, scale 1 / sqrt(d))."""
    g = torch.Generator().manual_seed(nq * 1000 + nk + heads)
    q = torch.randn(1, heads, nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, kv_heads, nk, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, kv_heads, nk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(1, heads, nq, d, generator=g, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = reference.attention(qr, kr, vr, causal, 1.0 / math.sqrt(d), compute_dtype=torch.float64)
    out.backward(dout)
    got = run(q, k, v, dout, out.detach(), lse.detach())
    for name, a, ref in zip(("dq", "dk", "dv"), got, (qr.grad, kr.grad, vr.grad)):
        err = float((a - ref).norm() / max(float(ref.norm()), 1e-300))
        assert err < 1e-9 or float((a - ref).abs().max()) < 1e-12, f"{name}: relative error {err:.3e}"


# ---- variants (attention_bwd_sm90_variants): the window's walk, flags and masks, and the logits ------
def _edge(x: int) -> int:
    """A window edge as the kernel takes it (-1: UNBOUNDED)."""
    return UNBOUNDED if x < 0 else x


# (Nq, Nk, left, right): windows smaller than, equal to and larger than N, one-sided, causal (right
# 0), empty ones (rows that see nothing), Nq != Nk both ways, edges on tile and block boundaries.
WINDOWS = [(300, 300, 5, 0), (300, 300, 64, 64), (300, 300, 128, 0), (300, 300, 299, 299), (300, 300, 1000, 0),
           (129, 300, 0, 0), (300, 129, 40, 3), (300, 129, 0, 0), (200, 5, 2, 0), (5, 200, 1, 1),
           (1, 1, 0, 0), (257, 600, 127, 129), (600, 257, -1, 0), (400, 400, 0, -1), (256, 512, 64, -1),
           (500, 500, 31, 33), (130, 130, 1, -1),
           # diag + right = 1 (mod 64): a tile's last row sees key n0 + 64 exactly (upper_idle's edge)
           (300, 300, 10, 1), (257, 322, 20, 0),
           # diag - left = 2 (mod 64), right wide: the last row's lower edge one key past n0 (`masked`)
           (300, 300, 62, 200)]


@pytest.mark.parametrize("block_m", [64, 128])
def test_window_tiles_cover_exactly_the_queries_that_see_the_block(block_m):
    """window_tiles' [first, end) holds every query tile with a visible (query, key) pair of the key
    block and no tile without one (so a walk never visits a tile it cannot see), and its length is
    bounded by the window, not by Nq: at most ceil((BLOCK_N + left + right) / block_m) + 1 tiles."""
    rng = random.Random(5)
    cases = WINDOWS + [(rng.randint(1, 700), rng.randint(1, 700), rng.choice([-1, rng.randint(0, 300)]),
                        rng.choice([-1, 0, rng.randint(0, 300)])) for _ in range(150)]
    for nq, nk, left, right in cases:
        lo_e, hi_e, diag = _edge(left), _edge(right), nk - nq
        m_blocks = -(-nq // block_m)
        qs = torch.arange(nq)[None, :]
        for n0 in range(0, nk, BLOCK_N):
            ks = torch.arange(n0, min(n0 + BLOCK_N, nk))[:, None]
            seen = ((ks >= qs + diag - lo_e) & (ks <= qs + diag + hi_e)).any(0)  # [nq]
            want = sorted({int(i) // block_m for i in torch.nonzero(seen).flatten()})
            first, end = window_tiles(n0, nq, nk, lo_e, hi_e, block_m)
            assert 0 <= first <= end <= m_blocks, (nq, nk, left, right, n0, first, end)
            assert list(range(first, end)) == want, (nq, nk, left, right, n0, first, end, want)
            if left >= 0 and right >= 0:
                assert end - first <= -(-(BLOCK_N + left + right) // block_m) + 1, (nq, nk, left, right, n0)


@pytest.mark.parametrize("block_m", [64, 128])
def test_window_flags_and_thresholds(block_m):
    """For every tile of a windowed walk: `masked` false only when every (query, key) pair of the
    tile is visible; `upper_idle` only when keys 64.. are hidden from every row (padding rows
    included); window_mask's thresholds, per thread of the accumulator layout, hide exactly the
    pairs outside the window or past Nk; and the ALiBi distance from one per-tile register is each
    element's query + diag - key."""
    for nq, nk, left, right in WINDOWS:
        lo_e, hi_e, diag = _edge(left), _edge(right), nk - nq
        for n0 in range(0, nk, BLOCK_N):
            first, end = window_tiles(n0, nq, nk, lo_e, hi_e, block_m)
            key = torch.arange(n0, n0 + BLOCK_N)[:, None]
            for m in range(first, end):
                m0 = m * block_m
                query = torch.arange(m0, m0 + block_m)[None, :]
                hidden = (key >= nk) | (key < query + diag - lo_e) | (key > query + diag + hi_e)
                masked, upper_idle = window_flags(n0, m0, nk, diag, lo_e, hi_e, block_m)
                assert masked or not hidden.any(), (nq, nk, left, right, n0, m0)
                assert not upper_idle or bool(hidden[64:].all()), (nq, nk, left, right, n0, m0)
                for w, warp, g, t in itertools.product(range(2), range(4), range(8), range(4)):
                    for h in range(2):
                        k_ = n0 + 64 * w + 16 * warp + g + 8 * h
                        lo, hi = window_thresholds(k_, nk, diag, lo_e, hi_e, m0, t, block_m)
                        dist0 = m0 + 2 * t + diag - (n0 + 64 * w + 16 * warp + g)  # the kernel's, per tile
                        for j, e in itertools.product(range(block_m // 8), range(2)):
                            c = 8 * j + e
                            assert bool(hidden[k_ - n0, c + 2 * t]) == (c < lo or c > hi), (n0, m0, k_, c)
                            # ALiBi's |query + diag - key| as the kernel forms it: dist0 + 8 j + e - 8 h
                            assert dist0 + c - 8 * h == m0 + c + 2 * t + diag - k_, (n0, m0, k_, c)


def test_window_cost_scales_with_the_window():
    """The benchmark's case, issue #15: a causal 4096-key window at N = 32768 (d = 128, block_m 64)
    walks (4096 + 128) / 64 + 1 tiles per key block at most, against N / 64 = 512 dense: the work is
    that of N = 4096 x 8 dense, not of N = 32768."""
    n, block_m = 32768, 64
    tiles = [window_tiles(n0, n, n, 4095, 0, block_m) for n0 in range(0, n, BLOCK_N)]
    counts = [end - first for first, end in tiles]
    assert max(counts) <= (4096 + BLOCK_N) // block_m + 1
    assert sum(counts) <= 1.07 * (n // BLOCK_N) * (4096 + BLOCK_N) // block_m, sum(counts)


# (Nq, Nk, heads, kv_heads, window (left, right) or None, softcap, alibi) for the float64 emulation
VARIANT_WALKS = [
    (300, 300, 2, 1, (40, 0), 0.0, False),
    (300, 300, 2, 2, (64, 64), 0.0, True),
    (129, 300, 4, 1, (0, 0), 0.0, False),          # window (0, 0), Nq < Nk: one key per row
    (300, 129, 2, 1, (0, 0), 0.0, False),          # Nq > Nk: rows 0 .. 170 see no key (zero dQ)
    (300, 129, 2, 1, (30, 0), 5.0, True),          # fully masked rows with softcap and ALiBi
    (200, 200, 2, 1, None, 5.0, False),            # softcap alone: extreme logits (inputs x 8)
    (257, 256, 2, 2, None, 30.0, True),
    (100, 192, 2, 1, None, 0.0, True),             # ALiBi alone, [B, H] slopes
    (256, 512, 4, 2, (64, -1), 0.0, False),        # left-only
    (190, 190, 2, 1, (1000, 1000), 30.0, True),    # window larger than N
    (65, 65, 2, 1, (64, 0), 0.0, False),           # window equal to N (causal)
]


@pytest.mark.parametrize("d,block_m", [(128, 64), (64, 128)])
@pytest.mark.parametrize("nq,nk,heads,kv_heads,window,cap,alibi", VARIANT_WALKS)
def test_emulated_variant_walk_matches_autograd(nq, nk, heads, kv_heads, window, cap, alibi, d, block_m):
    """The variant kernel's walk (window_tiles, flags, masks, logits with softcap and ALiBi, dS times
    1 - tanh^2) in float64 against float64 autograd of reference.attention with the same window /
    softcap / alibi_slopes; fully masked rows get exactly zero dQ."""
    g = torch.Generator().manual_seed(nq * 1000 + nk + heads + int(cap))
    batch = 2
    q = torch.randn(batch, heads, nq, d, generator=g, dtype=torch.float64) * (8.0 if cap == 5.0 else 1.0)
    k = torch.randn(batch, kv_heads, nk, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, nk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, heads, nq, d, generator=g, dtype=torch.float64)
    slopes = torch.rand(batch, heads, generator=g, dtype=torch.float64) * 0.5 if alibi else None
    scale = 1.0 / math.sqrt(d)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = reference.attention(qr, kr, vr, False, scale, compute_dtype=torch.float64, window=window,
                                   softcap=cap or None, alibi_slopes=slopes)
    out.backward(dout)
    var = Var(*((_edge(window[0]), _edge(window[1])) if window else (UNBOUNDED, UNBOUNDED)), cap, slopes)
    got = emulate(q, k, v, dout, out.detach(), lse.detach(), False, scale, block_m, var=var)
    for name, a, ref in zip(("dq", "dk", "dv"), got, (qr.grad, kr.grad, vr.grad)):
        err = float((a - ref).norm() / max(float(ref.norm()), 1e-300))
        assert err < 1e-9 or float((a - ref).abs().max()) < 1e-12, f"{name}: relative error {err:.3e}"
    empty = torch.isneginf(lse.detach())
    assert bool((got[0][empty] == 0).all()), "dQ of rows that see no key must be exactly 0"


# ---- dropout (kDropout): the keep bits of the transposed tile --------------------------------------
_M32 = 0xFFFFFFFF


def dropout_tile_keep(seed: int, offset: int, bh: int, n0: int, m0: int, block_m: int, thr: int) -> torch.Tensor:
    """Mirror of dropout_tile_bits (csrc) for every MMA thread of the tile (key block n0, query tile
    m0 of head bh = b H + h): each lane's Philox call for query m0 + 8 j + 2 t + (g & 1), its two
    words, the shfl.xor 4 exchange, the keep words' bit assembly, then element i = 4 j + 2 h + e of
    thread (w, warp, lane) decoded to (key key_h0 + 8 h, query m0 + 8 j + 2 t + e). Returns bool
    [BLOCK_N keys, block_m queries] (True: kept); raises AssertionError if an element is written twice."""
    lane = np.arange(32, dtype=np.int64)
    t, g = lane % 4, lane // 4
    odd = g & 1
    key = (np.uint64(seed & _M32), np.uint64(((seed >> 32) + (offset >> 32)) & _M32))
    half_mask = np.where(odd == 1, 0xFFFF0000, 0xFFFF).astype(np.uint64)
    thr_l = np.where(odd == 1, thr << 16, thr).astype(np.uint64)
    out = torch.zeros(BLOCK_N, block_m, dtype=torch.bool)
    seen = torch.zeros(BLOCK_N, block_m, dtype=torch.int64)
    for w in range(2):
        for warp in range(4):
            key_h0 = n0 + 64 * w + 16 * warp + g
            group, lane_class, upper = key_h0 >> 5, (key_h0 >> 1) & 3, (key_h0 >> 4) & 1
            keep = [np.zeros(32, dtype=np.int64) for _ in range(block_m // 64)]
            for j in range(block_m // 8):
                ctr = ((4 * group + lane_class).astype(np.uint64), (m0 + 8 * j + 2 * t + odd).astype(np.uint64),
                       np.uint64(bh & _M32), np.uint64(offset & _M32))
                words = philox4x32_7(ctr, key)
                own0 = np.where(upper == 1, words[2], words[0])
                own1 = np.where(upper == 1, words[3], words[1])
                other0, other1 = own0[lane ^ 4], own1[lane ^ 4]  # __shfl_xor_sync(.., 4)
                k_own = ((own0 & half_mask) >= thr_l).astype(np.int64) | (((own1 & half_mask) >= thr_l).astype(np.int64) << 2)
                k_other = (((other0 & half_mask) >= thr_l).astype(np.int64)
                           | (((other1 & half_mask) >= thr_l).astype(np.int64) << 2))
                keep[j // 8] |= ((k_own << odd) | (k_other << (odd ^ 1))) << (4 * (j % 8))
            for i in range(block_m // 2):
                jj, h, e = i // 4, (i >> 1) & 1, i & 1
                rows = torch.from_numpy(key_h0 + 8 * h - n0)
                cols = torch.from_numpy(8 * jj + 2 * t + e)
                out[rows, cols] = torch.from_numpy(((keep[i // 32] >> (i % 32)) & 1) == 1)
                seen[rows, cols] += 1
    assert bool((seen == 1).all()), "the threads' elements do not cover the tile exactly once"
    return out


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("seed,offset,p", [(0, 0, 0.1), (2**63 + 12345, 2**40 + 7, 0.5), (2**64 - 1, 2**64 - 1, 0.9),
                                           (1234, 3 * 2**32, 1e-5)])
def test_dropout_tile_bits_match_dropout_mask(block_m, seed, offset, p):
    """Every keep bit the backward's transposed tile derives (dropout_tile_bits: one Philox call per
    lane pair and query, words swapped by shuffle) equals tileattn.dropout_mask's bit of that (b, h,
    query, key), for both registered tile shapes, several key blocks and query tiles (also past Nq /
    Nk: the kernel masks those elements), GQA heads, 64-bit seeds / offsets and extreme p."""
    batch, heads, nq, nk = 2, 4, 300, 520  # GQA groups of 2 or 4 share K / V; the mask is per query head
    mask = dropout_mask(seed, offset, batch, heads, nq, nk, p)
    thr = drop_threshold(p)
    tiles = [(n0, m0) for n0 in (0, 128, 512) for m0 in (0, block_m, 256)]
    for b, h in ((0, 0), (1, 3), (0, 2)):
        for n0, m0 in tiles:
            got = dropout_tile_keep(seed, offset, b * heads + h, n0, m0, block_m, thr)
            want = mask[b, h, m0:m0 + block_m, n0:n0 + BLOCK_N].T  # [keys, queries]
            kk, qq = want.shape
            bad = (got[:kk, :qq] != want).nonzero()
            assert bad.numel() == 0, (f"b={b} h={h} n0={n0} m0={m0} block_m={block_m}: {bad.shape[0]} keep bits differ, "
                                      f"first (key, query) {[(n0 + int(r), m0 + int(c)) for r, c in bad[:4]]}")
    kept = float(mask.float().mean())  # the mask itself is not degenerate at this p
    assert abs(kept - (1 - thr / 65536)) < 6 * math.sqrt(max(thr / 65536 * (1 - thr / 65536), 1e-9) / mask.numel()) + 1e-6


DROPOUT_WALKS = [  # nq, nk, heads, kv_heads, window (None: no window; causal is (-1, 0)), p
    (300, 300, 2, 2, None, 0.1),
    (129, 300, 4, 1, (-1, 0), 0.5),                # causal, Nq < Nk, GQA 4
    (300, 129, 2, 1, (-1, 0), 0.5),                # Nq > Nk: rows without keys keep zero dQ
    (200, 257, 4, 2, (64, 0), 0.1),                # sliding window
]


@pytest.mark.parametrize("d,block_m", [(128, 64), (64, 128)])
@pytest.mark.parametrize("nq,nk,heads,kv_heads,window,p", DROPOUT_WALKS)
def test_emulated_dropout_walk_matches_autograd(nq, nk, heads, kv_heads, window, p, d, block_m):
    """The dropout kernel's walk (keep bits from dropout_tile_keep, dV from the dropped P^T, dS^T =
    P^T (dropped dP^T - D)) in float64 against float64 autograd of reference.attention with the same
    dropout_p / seed / offset (its mask is dropout_mask's)."""
    g = torch.Generator().manual_seed(nq * 1000 + nk + heads)
    batch, seed, offset = 2, 2**63 + 99, 5 * 2**32 + 3
    q = torch.randn(batch, heads, nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, nk, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, nk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, heads, nq, d, generator=g, dtype=torch.float64)
    scale = 1.0 / math.sqrt(d)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = reference.attention(qr, kr, vr, False, scale, compute_dtype=torch.float64, window=window,
                                   dropout_p=p, seed=seed, offset=offset)
    out.backward(dout)
    edges = (_edge(window[0]), _edge(window[1])) if window else (UNBOUNDED, UNBOUNDED)
    var = Var(*edges, dropout=(seed, offset, p))
    got = emulate(q, k, v, dout, out.detach(), lse.detach(), False, scale, block_m, var=var)
    for name, a, ref in zip(("dq", "dk", "dv"), got, (qr.grad, kr.grad, vr.grad)):
        err = float((a - ref).norm() / max(float(ref.norm()), 1e-300))
        assert err < 1e-9, f"{name}: relative error {err:.3e} (p={p}, window={window})"


def test_variant_registry_and_supports():
    """The registered variant kernels are VARIANT_SETS x dtypes x atomic / deterministic at the
    variant defaults; supports_variants / variant_bits route exactly those (dropout with a window or
    none, not with softcap / ALiBi; d = 64, 128 and 256), and a call with nothing on runs the plain kernel."""
    from tileattn.kernels.attention_fwd_sm80 import VariantArgs

    want = {ab.variant_expression(d, ab.VARIANT_DEFAULTS[d], bf16, bits, det) for d in ab.VARIANT_SETS
            for bf16 in (False, True) for bits in ab.VARIANT_SETS[d] for det in (False, True)
            if (d, bits, det) not in ab.UNREGISTERED_VARIANTS}
    assert set(ab.VARIANT_INSTANTIATIONS) == want and want <= set(ab.INSTANTIATIONS)
    unregistered = 2 * len(ab.UNREGISTERED_VARIANTS)  # both dtypes, deterministic mode
    assert ab.UNREGISTERED_VARIANTS == {(256, ab.WINDOW | ab.DROPOUT | ab.RNG_STATE, True)}
    assert sorted(dq_mode_of(e) for e in want) == ([0] * ((len(want) + unregistered) // 2)
                                                   + [1] * ((len(want) - unregistered) // 2))
    assert all(bits & ab.WINDOW for sets in ab.VARIANT_SETS.values() for bits in sets)
    from tileattn.kernels import attention_fwd_sm90, family

    src = family(ab.FAMILY_NAME).path.read_text()
    for name, value in (("kWindow", ab.WINDOW), ("kSoftcap", ab.SOFTCAP), ("kAlibi", ab.ALIBI),
                        ("kDropout", ab.DROPOUT)):
        assert f"constexpr int {name} = {value};" in src, name  # the kernel's bits are the Python ones
    assert (ab.WINDOW, ab.SOFTCAP, ab.ALIBI, ab.DROPOUT) == (
        attention_fwd_sm90.WINDOW, attention_fwd_sm90.SOFTCAP, attention_fwd_sm90.ALIBI, attention_fwd_sm90.DROPOUT)
    bf = torch.bfloat16
    assert ab.variant_bits(VariantArgs()) == 0
    assert ab.variant_bits(VariantArgs(softcap=30.0)) == ab.WINDOW | ab.SOFTCAP
    assert ab.variant_bits(VariantArgs(window_left=5, window_right=0, alibi_batch_stride=0)) == ab.WINDOW | ab.ALIBI
    assert ab.supports_variants(128, bf, VariantArgs(4096, 0, 30.0))
    assert ab.supports_variants(128, bf, VariantArgs(4096, 0, 0.0, 8))
    assert ab.supports_variants(128, bf, VariantArgs(4096, 0, 30.0, 8))
    assert ab.supports_variants(64, torch.float16, VariantArgs(4096, 0, 30.0, 0))
    assert ab.supports_variants(64, bf, VariantArgs(softcap=30.0))
    assert ab.variant_bits(VariantArgs(dropout_p=0.1)) == ab.WINDOW | ab.DROPOUT
    for d in (64, 128, 256):
        for det in (False, True):
            assert ab.supports_variants(d, bf, VariantArgs(dropout_p=0.1), deterministic=det)
            assert ab.supports_variants(d, torch.float16, VariantArgs(UNBOUNDED, 0, dropout_p=0.5), deterministic=det)
            assert ab.supports_variants(d, bf, VariantArgs(64, 0, dropout_p=0.5), deterministic=det)
        assert not ab.supports_variants(d, bf, VariantArgs(softcap=30.0, dropout_p=0.1))
        assert not ab.supports_variants(d, bf, VariantArgs(alibi_batch_stride=0, dropout_p=0.1))
    assert not ab.supports_variants(96, bf, VariantArgs(dropout_p=0.1))
    for causal, window, cap, alibi in ab.VARIANT_BENCH_CASES.values():  # benchmark_variants' cases run here
        va = VariantArgs(UNBOUNDED, 0 if causal else UNBOUNDED, cap, 0 if alibi else None)
        assert all(ab.supports_variants(d, bf, va) for d in ab.VARIANT_SETS), (causal, window, cap, alibi)
    assert ab.supports_variants(128, bf, VariantArgs(64, 0, 30.0, 0), deterministic=True)
    assert ab.supports_variants(256, bf, VariantArgs(softcap=30.0))
    assert not ab.supports_variants(32, bf, VariantArgs(softcap=30.0))
    assert not ab.supports_variants(128, torch.float32, VariantArgs(softcap=30.0))


# ---- varlen layout (attention_bwd_sm90_varlen) -----------------------------------------------------
VARLEN_WS_GAP = sm80.VARLEN_WS_GAP


def varlen_ws_row(head: int, b: int, q_tok0: int, ws_pitch: int) -> int:
    """Mirror of ws_head_row (varlen): row of query 0 of (sequence b, head) in lse2 / delta / dq_accum,
    attention_bwd_sm80.cu's ws_row."""
    return head * ws_pitch + ((q_tok0 + 3) & ~3) + VARLEN_WS_GAP * b


def tma_box_rows(t, row0: int, rows: int, head: int):
    """What a TMA load of `rows` rows from token row0 of a packed [T, H, d] tensor's head puts in
    shared memory: the packed rows (another sequence's or the tail's past this sequence), zero past T."""
    box = torch.zeros(rows, t.shape[2], dtype=t.dtype)
    end = min(row0 + rows, t.shape[0])
    if end > row0:
        box[:end - row0] = t[row0:end, head]
    return box


def zero_tile_rows_chunks(rows: int, panels: int, row_begin: int) -> list[int]:
    """Mirror of bwd90::zero_tile_rows: the element offsets of the 16-byte chunks the 256 MMA threads
    zero (thread tid from %tid.x - 128 = 0..255, stride 256)."""
    count = (rows - row_begin) * panels * 8
    out = []
    for tid in range(256):
        for idx in range(tid, count, 256):
            r, p, c = row_begin + idx // (panels * 8), (idx // 8) % panels, idx % 8
            out.append((p * rows + r) * 64 + c * 8)
    return out


def store_rows_masked_offsets(panels: int, row0: int, rows: int):
    """Mirror of bwd90::store_rows_masked: (row r of the box, chunk c) -> element offset in sK / sV it
    copies, for the 128 threads of a warpgroup."""
    out = {}
    for tid in range(128):
        for idx in range(tid, rows * panels * 8, 128):
            r, c = idx // (panels * 8), idx % (panels * 8)
            row = row0 + r
            assert (r, c) not in out
            out[(r, c)] = ((c // 8) * BLOCK_N + row) * 64 + ((c % 8) ^ (row % 8)) * 8
    return out


@pytest.mark.parametrize("d", ab.VARLEN_HEAD_DIMS)
def test_varlen_edge_zeroing_covers_exactly_the_rows_past_the_end(d):
    panels = d // 64
    for rows in (BLOCK_N, 64, 128):
        for row_begin in (1, 7, 8, 31, 33, 63, rows - 1):
            if row_begin >= rows:
                continue
            chunks = zero_tile_rows_chunks(rows, panels, row_begin)
            assert len(chunks) == len(set(chunks)), "a chunk zeroed twice (the loop's index map is not 1:1)"
            # whole 128-byte rows >= row_begin of every panel, nothing below: the swizzle permutes
            # chunks within a row only, so these are exactly the tile's rows >= row_begin
            want = {(p * rows + r) * 64 + c * 8 for p in range(panels) for r in range(row_begin, rows) for c in range(8)}
            assert set(chunks) == want, (rows, row_begin)
            for r in range(rows):
                for col in range(0, d, 13):
                    byte = tma_panel_addr(0, rows, r, col)
                    assert ((byte // 16) * 8 in set(chunks)) == (r >= row_begin), (r, col)


@pytest.mark.parametrize("d", ab.VARLEN_HEAD_DIMS)
def test_varlen_masked_store_reads_the_staged_rows(d):
    """The edge box's 16-byte stores read row r, columns 8c..8c+7 of warpgroup w's staged dK / dV
    (where stmatrix put them: TMA's swizzled panel layout) and write them to global row r, chunk c."""
    for w in range(2):
        for rows in (1, 9, 63):
            offsets = store_rows_masked_offsets(d // 64, 64 * w, rows)
            assert set(offsets) == {(r, c) for r in range(rows) for c in range(d // 8)}
            for (r, c), off in offsets.items():
                for e in range(8):
                    assert 2 * (off + e) == tma_panel_addr(0, BLOCK_N, 64 * w + r, 8 * c + e), (w, r, c, e)


def emulate_varlen(q, k, v, dout, out, lse, cu_q, cu_k, max_seqlen_k: int, causal: bool, scale: float,
                   block_m: int, section: int = 1, rotate: bool = False):
    """The varlen pipeline in float64 as the kernels index it: the sm80 varlen preprocess into the
    [H, ws_pitch] workspaces (NaN everywhere it does not write), the main kernel's 1-D grid (block
    order, CTAs past a sequence's keys exiting, the Hkv tail CTAs), TMA boxes read from the packed
    tensors (rows past a sequence's end are the neighbour's or the tail's) with the kernel's edge-row
    zeroing, lse2 / delta / dq_accum rows at ws_head_row, dK / dV stored by full TMA boxes or row by
    row, and the sm80 varlen convert. dq / dk / dv start as NaN: every row must be written. Asserts
    that every workspace row read or added into is one the preprocess wrote for that sequence, and
    that no store reaches a row of another sequence."""
    total_q, heads, d = q.shape
    total_k, hkv = k.shape[:2]
    batch = len(cu_q) - 1
    group = heads // hkv
    scale_log2 = scale * math.log2(math.e)
    ws_pitch = -(-total_q // 4) * 4 + VARLEN_WS_GAP * batch
    lse2 = torch.full((heads * ws_pitch,), math.nan, dtype=torch.float64)
    delta = torch.full((heads * ws_pitch,), math.nan, dtype=torch.float64)
    acc = torch.full((heads * ws_pitch, d), math.nan, dtype=torch.float64)
    for b in range(batch):  # preprocess: rows < roundup(Nq, 128) of each (sequence, head)
        q0, nq = cu_q[b], cu_q[b + 1] - cu_q[b]
        for h in range(heads):
            base = varlen_ws_row(h, b, q0, ws_pitch)
            pad = -(-nq // 128) * 128
            assert base % 4 == 0, "16-byte aligned rows (bulk copies of lse2 / delta, the dQ float4s)"
            assert torch.isnan(lse2[base:base + pad]).all(), "two sequences' workspace rows overlap"
            for r in range(pad):
                valid = r < nq
                lv = float(lse[h, q0 + r]) if valid else -math.inf
                lse2[base + r] = math.inf if lv == -math.inf else lv * math.log2(math.e)
                delta[base + r] = float((dout[q0 + r, h] * out[q0 + r, h]).sum()) if valid else 0.0
                acc[base + r] = 0.0
    assert base + pad <= heads * ws_pitch
    dq = torch.full_like(q, math.nan)
    dk, dv = torch.full_like(k, math.nan), torch.full_like(v, math.nan)
    n_blocks = max(1, -(-max_seqlen_k // BLOCK_N))
    pairs = hkv * batch
    section = min(section, pairs)
    for idx in range(n_blocks * pairs + hkv):
        if idx >= n_blocks * pairs:  # tail CTA: rows past the last sequence of kv head idx - ...
            head = idx - n_blocks * pairs
            dk[cu_k[batch]:, head] = 0
            dv[cu_k[batch]:, head] = 0
            continue
        nb, pair = block_coords(idx, n_blocks, pairs, section)
        hk, b = pair % hkv, pair // hkv
        q0, k0 = cu_q[b], cu_k[b]
        nq, nk = cu_q[b + 1] - q0, cu_k[b + 1] - k0
        n0 = nb * BLOCK_N
        if n0 >= nk:
            continue
        diag = nk - nq
        m_blocks = -(-nq // block_m)
        m_first = max(0, n0 - diag) // block_m if causal else 0
        m_count = m_blocks - m_first
        assert_skipped_tiles_hidden(m_first, block_m, n0, nq, nk, diag, causal)
        kt, vt = tma_box_rows(k, k0 + n0, BLOCK_N, hk), tma_box_rows(v, k0 + n0, BLOCK_N, hk)
        if n0 + BLOCK_N > nk:  # key_edge: zero_tile_rows(sK / sV, Nk - n0)
            kt[nk - n0:] = 0
            vt[nk - n0:] = 0
        dk_blk = torch.zeros(BLOCK_N, d, dtype=torch.float64)
        dv_blk = torch.zeros(BLOCK_N, d, dtype=torch.float64)
        rot = nb % m_count if (rotate and m_count > 0) else 0
        for it in range(group * m_count):
            head, m0 = walk(it, hk, group, m_blocks, m_count, block_m, rot)
            qt, dot = tma_box_rows(q, q0 + m0, block_m, head), tma_box_rows(dout, q0 + m0, block_m, head)
            if m0 + block_m > nq:  # the last query tile: zero_tile_rows(sQ / sdO slot, Nq - m0)
                qt[nq - m0:] = 0
                dot[nq - m0:] = 0
            ws = varlen_ws_row(head, b, q0, ws_pitch) + m0
            assert m0 + block_m <= -(-nq // 128) * 128, "a tile reaches past the sequence's padded rows"
            add_v, add_k, add_q = tile_step(qt, dot, kt, vt, lse2[ws:ws + block_m], delta[ws:ws + block_m], n0, m0,
                                            nk, diag, causal, scale_log2, block_m)
            dv_blk[:add_v.shape[0]] += add_v
            dk_blk[:add_k.shape[0]] += add_k
            acc[ws:ws + block_m] += add_q
        for w in range(2):  # epilogue: warpgroup w's 64 keys
            rows = nk - n0 - 64 * w
            row = k0 + n0 + 64 * w
            if rows >= 64:  # TMA box: 64 rows, clipped only at Tk
                assert row + 64 <= k0 + nk, "a TMA store box reaches into the next sequence"
            if rows > 0:
                n = min(rows, 64)
                dk[row:row + n, hk] = scale * dk_blk[64 * w:64 * w + n]
                dv[row:row + n, hk] = dv_blk[64 * w:64 * w + n]
    for b in range(batch):  # convert: rows < Nq of each sequence; tail slice zeroes the rest
        q0, nq = cu_q[b], cu_q[b + 1] - cu_q[b]
        for h in range(heads):
            base = varlen_ws_row(h, b, q0, ws_pitch)
            dq[q0:q0 + nq, h] = scale * acc[base:base + nq]
    dq[cu_q[batch]:] = 0
    return dq, dk, dv


def _packed(lengths, total, heads, d, g, tail_nan: bool = True):
    """[total, heads, d] float64: random rows for the sequences, NaN in the rows past the last one (a
    token buffer padded to a captured size holds anything)."""
    t = torch.randn(total, heads, d, generator=g, dtype=torch.float64)
    if tail_nan:
        t[sum(lengths):] = math.nan
    return t


VARLEN_CASES = [  # (query lengths, key lengths, heads, kv heads, extra tail rows q / k)
    ([1, 31, 33], [1, 31, 33], 2, 1, (0, 0)),
    ([0, 129, 1, 0, 65], [5, 129, 1, 0, 200], 2, 2, (3, 7)),
    ([127, 0, 200, 64], [127, 300, 64, 129], 4, 1, (5, 0)),
    ([257, 128], [256, 128], 8, 1, (0, 130)),
    ([100, 1000], [1000, 100], 2, 1, (1, 1)),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,block_m", [(128, 64), (64, 128)])
@pytest.mark.parametrize("lens_q,lens_k,heads,kv_heads,tail", VARLEN_CASES)
def test_emulated_varlen_matches_autograd(lens_q, lens_k, heads, kv_heads, tail, d, block_m, causal):
    """Per sequence, the varlen emulation equals float64 autograd of the reference on that sequence
    alone (keys but no queries: dK = dV = 0; rows past the last sequence: 0), whatever the rows past
    a sequence hold (the tail is NaN), in the block order with section 1 and several pairs per
    section, and with the rotated walk."""
    g = torch.Generator().manual_seed(sum(lens_q) * 7 + sum(lens_k) + heads + d)
    tq, tk = sum(lens_q) + tail[0], sum(lens_k) + tail[1]
    q, dout = _packed(lens_q, tq, heads, d, g), _packed(lens_q, tq, heads, d, g)
    k, v = _packed(lens_k, tk, kv_heads, d, g), _packed(lens_k, tk, kv_heads, d, g)
    cu_q = [0, *itertools.accumulate(lens_q)]
    cu_k = [0, *itertools.accumulate(lens_k)]
    scale = 1.0 / math.sqrt(d)
    out = torch.zeros_like(q)
    lse = torch.full((heads, tq), -math.inf, dtype=torch.float64)
    want = []
    for b in range(len(lens_q)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qs, ks, vs = (t[s].transpose(0, 1).unsqueeze(0).clone().requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk)))
        if lens_q[b] and lens_k[b]:
            o, l_ = reference.attention(qs, ks, vs, causal, scale, compute_dtype=torch.float64)
            o.backward(dout[sq].transpose(0, 1).unsqueeze(0))
            out[sq] = o.detach()[0].transpose(0, 1)
            lse[:, sq] = l_.detach()[0]
            grads = [t.grad[0].transpose(0, 1) for t in (qs, ks, vs)]
        else:  # no queries: dK = dV = 0; no keys: every query row fully masked, dQ = 0
            grads = [torch.zeros_like(t[s]) for t, s in ((q, sq), (k, sk), (v, sk))]
        want.append(grads)
    max_k = max(lens_k)
    for section, rotate in ((1, False), (3, False), (1, True)):
        dq, dk, dv = emulate_varlen(q, k, v, dout, out, lse, cu_q, cu_k, max_k, causal, scale, block_m, section,
                                    rotate)
        for name, got, tail_from, cu in (("dq", dq, cu_q[-1], cu_q), ("dk", dk, cu_k[-1], cu_k),
                                         ("dv", dv, cu_k[-1], cu_k)):
            assert not torch.isnan(got).any(), f"{name}: NaN (a row never written, or garbage read)"
            assert (got[tail_from:] == 0).all(), f"{name}: rows past the last sequence not zero"
        for b, (gq, gk, gv) in enumerate(want):
            for name, got, ref, cu in (("dq", dq, gq, cu_q), ("dk", dk, gk, cu_k), ("dv", dv, gv, cu_k)):
                a = got[cu[b]:cu[b + 1]]
                err = float((a - ref).norm() / max(float(ref.norm()), 1e-300))
                assert err < 1e-9 or float((a - ref).abs().max()) < 1e-12, \
                    f"{name} of sequence {b} (Nq={lens_q[b]}, Nk={lens_k[b]}), section {section}, rotate {rotate}: " \
                    f"relative error {err:.3e}"


def test_varlen_host_layout_matches_the_kernels():
    """The constants the varlen kernel shares with attention_bwd_sm80.cu (workspace gap) are equal in
    both sources and in Python, and the varlen instantiations registered for dispatch are exactly the
    VARLEN_DEFAULTS configs' atomic mode (dQ by REDs)."""
    from tileattn.kernels import family

    src90 = family(ab.FAMILY_NAME).path.read_text()
    src80 = family(sm80.FAMILY_NAME).path.read_text()
    assert f"kVarlenWsGap = {VARLEN_WS_GAP};" in src80
    assert f"kVarlenWsGap = {VARLEN_WS_GAP};" in src90
    want = {ab.varlen_expression(d, ab.VARLEN_DEFAULTS[(d, c)], c, bf16) for d in ab.VARLEN_HEAD_DIMS for c in (False, True)
            for bf16 in (False, True)}
    assert all(dq_mode_of(e) == 0 for e in want)
    assert {e for e in ab.INSTANTIATIONS if "_varlen<" in e} == want
    assert all(dq_mode_of(e) != 1 for e in ab.INSTANTIATIONS + ab.TUNING if "varlen" in e)
    for d in ab.VARLEN_HEAD_DIMS:  # the varlen preprocess / convert the plan launches are registered
        for bf16 in (False, True):
            assert sm80.preprocess_expr(d, bf16, True) in sm80.INSTANTIATIONS
            assert sm80.convert_expr(d, bf16, True) in sm80.INSTANTIATIONS
    assert ab.supports_varlen(128, torch.bfloat16, True, False)
    assert not ab.supports_varlen(128, torch.bfloat16, True, True), "deterministic stays on sm80"
    assert not ab.supports_varlen(96, torch.float16) and not ab.supports_varlen(64, torch.float32)


@pytest.mark.parametrize("block_m", [64, 128])
def test_mask_thresholds_match_the_direct_mask(block_m):
    """The kernel's masked tiles hide element (j, h, e) of thread (warp, lane) iff 8 j + e < lim[h],
    lim[h] = block_m past Nk, 0 non-causal, key - diag - m0 - 2 t causal: the same set as
    key >= Nk or (causal and key > query + diag)."""
    for nq, nk in WALK_SHAPES_QK:
        diag = nk - nq
        for causal in (False, True):
            for n0 in range(0, nk, BLOCK_N):
                for m0 in range(0, -(-nq // block_m) * block_m, block_m):
                    for w, warp, g, t in itertools.product(range(2), range(4), range(8), range(4)):
                        key_h0 = n0 + 64 * w + 16 * warp + g
                        for h in range(2):
                            key = key_h0 + 8 * h
                            lim = block_m if key >= nk else key - diag - m0 - 2 * t if causal else 0
                            for j, e in itertools.product(range(block_m // 8), range(2)):
                                query = m0 + 8 * j + 2 * t + e
                                direct = key >= nk or (causal and key > query + diag)
                                assert direct == (8 * j + e < lim), (nq, nk, causal, n0, m0, key, query)


# ---- the mbarrier / named-barrier protocol, simulated ----------------------------------------------
class PartyBarrier:
    """A named barrier (bar.sync / bar.arrive) whose phase completes when each of `parties` (whole
    warps counted as one party) has arrived; an arrival of a party already in the current phase
    would make the hardware count complete a phase early, so it fails here."""

    def __init__(self, parties):
        self.parties, self.arrived, self.generation = frozenset(parties), set(), 0

    def arrive(self, party):
        assert party not in self.arrived, f"{party} arrives twice in one phase"
        self.arrived.add(party)
        if self.arrived == self.parties:
            self.arrived, self.generation = set(), self.generation + 1

    def sync(self, party):
        generation = self.generation
        self.arrive(party)
        while self.generation == generation:
            yield


MODEL_THREADS = 4  # threads per MMA warpgroup in simulate() (the kernel's 128, fewer for speed)


def simulate(n_iters: int, stages: int, seed: int, dq_buffers: int = 0, edge_iters=frozenset(),
             key_edge: bool = False):
    """One CTA: the producer thread, the two MMA warpgroups and (dq_buffers > 0: deterministic
    mode) the dQ warp as coroutines following the kernel's waits, arrivals and barriers, under a
    random schedule; TMA copies land at random later times, the dQ warp's bulk reduction reads its
    staging buffer until a random later step. Each warpgroup's threads read the slot's lse2 / delta
    rows and arrive on `empty` one by one (the kernel's per-thread release), so a refill while any
    thread may still read its rows fails. Varlen: with `key_edge` both warpgroups zero their share
    of sK / sV rows after kv_full and meet at barrier 9 before the first wgmma; in the iterations of
    `edge_iters` (a sequence's last query tile) they wait both full barriers, zero their share of the
    slot's Q / dO rows and meet at barrier 9 before reading it: no refill or other reader may overlap
    the zeroing, and no wgmma may read a slot / K before both halves are zeroed."""
    rng = random.Random(seed)
    kv_full = MBarrier(1)
    q_full = [MBarrier(1) for _ in range(stages)]
    do_full = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(2 * MODEL_THREADS) for _ in range(stages)]  # the kernel: 256, every MMA thread
    ds_bar, done_bar, zero_bar = NamedBarrier(), NamedBarrier(), NamedBarrier()
    zeroed = [set() for _ in range(stages)]  # warpgroups that zeroed the slot's edge rows this fill
    kv_zeroed = set()
    kv = [None]
    q_slot, do_slot = [None] * stages, [None] * stages
    ring_readers = [set() for _ in range(stages)]
    ds_tile = [[None, None], [None, None]]   # buffer -> what each warpgroup's half holds
    ds_readers = [set(), set()]              # warpgroups whose dQ wgmma may still read the buffer
    sk_readers = set()                       # warpgroups whose dQ wgmma may still read all of sK
    in_flight = []
    parties = ("mma0", "mma1", "dq")
    dq_full = [PartyBarrier(parties) for _ in range(dq_buffers)]
    dq_empty = [PartyBarrier(parties) for _ in range(dq_buffers)]
    staged = [[None, None] for _ in range(dq_buffers)]  # buffer -> iteration each warpgroup's part holds
    reducing = [False] * dq_buffers                    # the bulk reduction may still read the buffer
    added = []

    def producer():
        kv_full.arrive(tx=1)
        in_flight.append((kv, 0, "kv", kv_full))
        yield
        for it in range(n_iters):
            s = it % stages
            if it >= stages:
                while not empty[s].passed(((it // stages) - 1) & 1):
                    yield
            assert not ring_readers[s], f"producer refills slot {s} while {ring_readers[s]} read it"
            q_full[s].arrive(tx=1)
            in_flight.append((q_slot, s, it, q_full[s]))
            yield
            do_full[s].arrive(tx=1)
            in_flight.append((do_slot, s, it, do_full[s]))
            yield

    def mma(w):
        while not kv_full.passed(0):
            yield
        assert kv[0] == "kv"
        if key_edge:  # zero_tile_rows(sK / sV) by both warpgroups, fence, barrier 9
            kv_zeroed.add(w)
            yield
            yield from zero_bar.sync()
        assert not key_edge or kv_zeroed == {0, 1}, f"warpgroup {w} reads K / V before both zeroed their rows"
        for it in range(n_iters):
            s, parity = it % stages, (it // stages) & 1
            if it in edge_iters:  # wait both fills, zero this warpgroup's share of the rows, barrier 9
                while not (q_full[s].passed(parity) and do_full[s].passed(parity)):
                    yield
                assert q_slot[s] == it and do_slot[s] == it, f"warpgroup {w} zeroes slot {s} of another fill"
                readers = {r for r in ring_readers[s] if not (isinstance(r, tuple) and r[0] == "zero")}
                assert not readers, f"warpgroup {w} zeroes slot {s} while {readers} read it"  # the other's zeroing
                # writes other rows (each thread its own chunks): concurrent with it is fine
                ring_readers[s].add(("zero", w))
                zeroed[s].add(w)
                yield
                ring_readers[s].discard(("zero", w))
                yield from zero_bar.sync()
            while not q_full[s].passed(parity):
                yield
            assert q_slot[s] == it, f"warpgroup {w} reads Q of {q_slot[s]} in iteration {it}"
            assert it not in edge_iters or zeroed[s] == {0, 1}, f"warpgroup {w} reads slot {s} before both zeroed it"
            ring_readers[s].add(w)  # its wgmmas read Q / dO until its wgmma_wait<0>
            for i in range(MODEL_THREADS):  # each thread reads its lse2 / delta rows (ld.shared)
                ring_readers[s].add((w, i))
                yield
            while not do_full[s].passed(parity):
                yield
            assert do_slot[s] == it, f"warpgroup {w} reads dO of {do_slot[s]} in iteration {it}"
            yield  # S^T, dP^T, P^T, dS^T, dV / dK issued
            buf = it % 2
            assert (1 - w) not in ds_readers[buf], f"warpgroup {w} overwrites dS buffer {buf} being read"
            ds_tile[buf][w] = it
            yield from ds_bar.sync()
            assert ds_tile[buf] == [it, it], f"dQ of iteration {it} reads dS halves {ds_tile[buf]}"
            ds_readers[buf].add(w)
            sk_readers.add(w)
            yield
            # wgmma_wait<0>: everything retired
            ds_readers[it % 2].discard(w)
            sk_readers.discard(w)
            ring_readers[s].discard(w)
            zeroed[s].discard(w)  # the slot's next fill is a new tile
            for i in range(MODEL_THREADS):  # every thread's own arrive, after its own reads
                ring_readers[s].discard((w, i))
                empty[s].arrive()
                yield
            if dq_buffers:  # stage dQ for the dQ warp
                b = it % dq_buffers
                if it >= dq_buffers:
                    yield from dq_empty[b].sync(f"mma{w}")
                assert not reducing[b], f"warpgroup {w} overwrites dQ staging buffer {b} being reduced"
                staged[b][w] = it
                dq_full[b].arrive(f"mma{w}")
                yield
        yield from done_bar.sync()
        assert not sk_readers, f"warpgroup {w} writes dK into sK while {sk_readers} may read it"

    def dq_warp():
        for it in range(n_iters):
            b = it % dq_buffers
            yield from dq_full[b].sync("dq")
            assert staged[b] == [it, it], f"the dQ warp reduces iteration {it} from halves {staged[b]}"
            reducing[b] = True
            while rng.random() < 0.5:  # cp.async.bulk.wait_group.read
                yield
            reducing[b] = False
            added.append(it)
            if it + dq_buffers < n_iters:
                dq_empty[b].arrive("dq")
            yield

    actors = [producer(), mma(0), mma(1)] + ([dq_warp()] if dq_buffers else [])
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
    assert ds_bar.arrived == 0 and done_bar.arrived == 0 and zero_bar.arrived == 0, \
        "a named barrier was left half-arrived"
    assert all(not bar.arrived for bar in dq_full + dq_empty), "a dQ barrier was left half-arrived"
    assert added == (list(range(n_iters)) if dq_buffers else []), added


@pytest.mark.parametrize("stages", sorted({cfg.stages for _, cfg in CONFIGS}))
@pytest.mark.parametrize("dq_buffers", [0, 1, 2], ids=["atomic", "det1", "det2"])
def test_pipeline_protocol(stages, dq_buffers):
    for n_iters in (1, 2, 3, stages, stages + 1, 2 * stages + 1, 9):
        for seed in range(20):
            simulate(n_iters, stages, seed, dq_buffers)


@pytest.mark.parametrize("stages", sorted({cfg.stages for _, cfg in CONFIGS}))
@pytest.mark.parametrize("dq_buffers", [0, 1], ids=["atomic", "bulk"])
def test_pipeline_protocol_varlen_edges(stages, dq_buffers):
    """The varlen kernel's edge zeroing inside the protocol: K / V once, and the first tile of each
    query head's walk (walking down, a sequence's last query tile comes first: iterations 0,
    m_count, 2 m_count, ...), GQA groups of 1-3 heads."""
    for m_count, group in ((1, 1), (1, 3), (2, 2), (stages + 1, 2), (5, 1)):
        n_iters = m_count * group
        edges = frozenset(range(0, n_iters, m_count))
        for seed in range(15):
            simulate(n_iters, stages, seed, dq_buffers, edge_iters=edges, key_edge=seed % 2 == 0)


def test_dq_buffers_mirror_the_kernel():
    """Two staging tiles where they fit (d=128, 2 stages), one otherwise; the dynamic + static shared
    memory of every instantiation within the block limit."""
    assert C(64, 2).dq_buffers(128, True) == 2 and C(128, 2).dq_buffers(64, True) == 1
    assert C(64, 3).dq_buffers(128, True) == 1 and not C(128, 3).fits(64, True)
    assert C(64, 2).dq_buffers(128, False) == 0 and C(64, 2, True).dq_buffers(128, False) == 2
    assert C(128, 2, True).dq_buffers(64, False) == 1
    for expr in ab.INSTANTIATIONS + ab.TUNING:
        d, bm, st = (int(x) for x in expr.split("<")[1].split(",")[:3])
        mode = dq_mode_of(expr)
        cfg = C(bm, st, mode == 2)
        assert cfg.dq_mode(mode == 1) == mode, expr
        assert cfg.smem_bytes(d, mode == 1) + ab.STATIC_SMEM <= ab.SMEM_LIMIT, expr


def dq_mode_of(expression: str) -> int:
    """kDqMode of an instantiation: 0 REDs, 1 deterministic (ordered bulk), 2 unordered bulk (the
    last template argument, the variant entry point's fifth: its kVariant comes last)."""
    args = expression.rstrip(">").split("<", 1)[1].split(",")
    return int(args[4] if "_variants<" in expression else args[-1])


# ---- deterministic mode: the turn counters across CTAs -----------------------------------------------
def simulate_turns(nq: int, nk: int, group: int, pairs: int, section: int, block_m: int, causal: bool,
                   resident: int, dq_buffers: int, seed: int, window: tuple[int, int] | None = None,
                   block_n: int = BLOCK_N):
    """The CTAs of `pairs` (kv head, batch) pairs, dispatched in blockIdx order (block_coords) with at
    most `resident` running at once. Each CTA is its MMA warpgroups, which walk the kernel's (head,
    query tile) sequence and stage each tile's dQ in one of `dq_buffers` buffers (waiting while all
    are full), and its dQ warp, which takes the staged tiles in order and adds one when the tile's
    counter reads n. Checks: no deadlock, and each (pair, head, tile) receives the additions of key
    blocks 0, 1, ..., last in order. `window` (left, right; causal False): the variant kernel's walk
    (window_tiles), the counters starting at window_first_blocks as the host sets them, and each
    tile must receive exactly the key blocks with a visible pair in it, in order. block_n: keys per
    CTA (64: d = 256's role-split layout, whose two roles each keep one such counter per tile)."""
    rng = random.Random(seed)
    m_blocks, n_blocks, diag = -(-nq // block_m), -(-nk // block_n), nk - nq
    counters: dict[tuple[int, int, int], int] = {}
    order: dict[tuple[int, int, int], list[int]] = {}
    first = ab.window_first_blocks(nq, nk, window[0], block_m, block_n) if window else [0] * m_blocks
    for pair, head, m in itertools.product(range(pairs), range(group), range(m_blocks)):
        counters[(pair, head, m)] = first[m]

    def cta(n, pair):
        if window:
            m_first, m_end = window_tiles(n * block_n, nq, nk, window[0], window[1], block_m, block_n)
        else:
            m_first, m_end = (max(0, n * block_n - diag) // block_m if causal else 0), m_blocks
        m_count = m_end - m_first
        steps = [walk(it, 0, group, m_end, m_count, block_m) for it in range(group * m_count)]
        staged, added = 0, 0  # tiles the MMA warpgroups staged / the dQ warp added
        while added < len(steps):
            if staged < len(steps) and staged - added < dq_buffers and rng.random() < 0.5:
                staged += 1  # computed and staged (dq_empty passed)
            elif added < staged:
                head, m0 = steps[added]
                key = (pair, head, m0 // block_m)
                if counters.get(key, 0) == n:
                    order.setdefault(key, []).append(n)
                    counters[key] = n + 1
                    added += 1
            yield

    waiting = list(range(n_blocks * pairs))
    running = []
    steps = 0
    while waiting or running:
        steps += 1
        assert steps < 400000, f"deadlock: running {[c for c, _ in running]}, waiting {waiting[:5]}"
        while waiting and len(running) < resident:
            coords = block_coords(waiting.pop(0), n_blocks, pairs, section)  # in-order dispatch
            running.append((coords, cta(*coords)))
        i = rng.randrange(len(running))
        try:
            next(running[i][1])
        except StopIteration:
            running.pop(i)
    for (pair, head, m), seen in order.items():
        if window:  # exactly the key blocks with a visible pair in tile m, in order
            qs = torch.arange(m * block_m, min(nq, (m + 1) * block_m))[None, :]
            ks = torch.arange(nk)[:, None]
            vis = (ks >= qs + diag - window[0]) & (ks <= qs + diag + window[1])
            want = sorted({int(j) // block_n for j in torch.nonzero(vis.any(1)).flatten()})
            assert seen == want, f"tile {m} of head {head}, pair {pair} added by {seen}, want {want}"
            continue
        assert seen == list(range(len(seen))), f"tile {m} of head {head}, pair {pair} added in order {seen}"
        last_key = min(nq, (m + 1) * block_m) - 1 + diag if causal else nk - 1
        assert len(seen) == min(n_blocks, last_key // block_n + 1), (m, seen)
    assert causal or window or len(order) == pairs * group * m_blocks


@pytest.mark.parametrize("dq_buffers", [1, 2])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_m", [64, 128])
def test_deterministic_turns(block_m, causal, dq_buffers):
    for nq, nk, group, pairs, section in ((1, 1, 1, 1, 1), (300, 700, 2, 3, 2), (700, 300, 1, 2, 1),
                                          (1000, 1000, 4, 1, 1), (129, 4097, 1, 1, 1), (600, 900, 1, 5, 4)):
        for resident in (1, 2, 5):
            simulate_turns(nq, nk, group, pairs, section, block_m, causal, resident, dq_buffers,
                           seed=nq + nk + resident)


@pytest.mark.parametrize("dq_buffers", [1, 2])
@pytest.mark.parametrize("block_m, block_n", [(64, BLOCK_N), (128, BLOCK_N), (64, 64)], ids=["m64", "m128", "d256"])
def test_deterministic_turns_windowed(block_m, block_n, dq_buffers):
    """The deterministic variant kernel: a window's tiles are visited by consecutive key blocks from
    window_first_blocks on; with the counters started there, no deadlock and every tile gets exactly
    its visiting key blocks, in order (windows smaller than a block, sliding, one-sided, Nq != Nk)."""
    for nq, nk, left, right in ((700, 700, 100, 0), (700, 700, 0, 0), (300, 900, 200, 50), (900, 300, 30, 0),
                                (1000, 1000, 300, UNBOUNDED), (640, 640, UNBOUNDED, 0), (129, 4097, 64, 64)):
        for resident in (1, 3):
            simulate_turns(nq, nk, 2, 2, 1, block_m, False, resident, dq_buffers, seed=nq + left + resident,
                           window=(left, right), block_n=block_n)


# ---- SASS --------------------------------------------------------------------------------------------
def _compiled_sass(expression: str) -> str:
    from labs.sass import dump_sass, tools

    if tools()[0] is None or tools()[1] is None:
        pytest.skip("cuobjdump / nvdisasm not found (nvidia-cuda-cuobjdump and triton wheels)")
    from tileattn.kernels import family
    from tileattn.runtime import compile_cuda

    module = compile_cuda(family(ab.FAMILY_NAME).path, [expression], "sm_90a")
    return dump_sass(module.cubin)


def _two_stages(expression: str) -> bool:
    return expression.split("<")[1].split(",")[2].strip() == "2"


# The registered kernels and the two-stage tuning candidates (the other dQ mode of each default).
@pytest.mark.parametrize("expression", ab.INSTANTIATIONS + tuple(e for e in ab.TUNING if _two_stages(e)))
def test_sass_register_a_operands_untouched_until_retired(expression):
    sass = _compiled_sass(expression)
    found, problems = register_a_hazards(sass)
    d, block_m = (int(x) for x in expression.split("<")[1].split(",")[:2])
    mode = dq_mode_of(expression)
    # d = 256 (the role-split layout): one register-A product per role (dV or dK), and the two roles
    # run the same instructions; dQ by REDs in both of its modes (in turn when deterministic).
    products = 1 if d == 256 else 2
    assert found == products * block_m // 16, f"expected the dV and dK register-A wgmmas, found {found}"
    assert not problems, "\n".join(problems[:10])
    for insn in ("UTMALDG", "UTMASTG", "STSM", "UBLKCP", "USETMAXREG"):
        assert insn in sass, f"{insn} expected in the SASS"
    assert ("REDG" in sass) == (mode == 0 or d == 256), "dQ REDs from registers exactly in mode 0 (d = 256: always)"
    assert ("UBLKRED" in sass) == (mode != 0 and d != 256), "the dQ warp's bulk reduce-add exactly in the staged modes"
    assert ("LDG.E.STRONG.GPU" in sass) == (mode == 1), "acquire loads of the turn counters exactly when ordered"
    assert "LDL" not in sass and "STL" not in sass, "local memory traffic (spills) in the SASS"
    assert not dummy_wgmmas(sass), f"ptxas added wgmmas to carry a commit: {dummy_wgmmas(sass)[:2]}"


@pytest.mark.parametrize("expression", ab.INSTANTIATIONS + ab.TUNING)
def test_ptxas_reports_no_wgmma_serialization(expression):
    """ptxas C7510-C7520 ("wgmma serialized", "warpgroup.wait injected") mean the tensor cores wait
    on every wgmma; `tileattn check` counts spills, so the warnings are checked here."""
    from tileattn.kernels import family
    from tileattn.runtime import compile_cuda

    module = compile_cuda(family(ab.FAMILY_NAME).path, [expression], "sm_90a")
    warnings = [line for line in module.log.splitlines() if "C75" in line]
    assert not warnings, "\n".join(warnings)
    assert "0 bytes spill stores" in module.log and "0 bytes stack frame" in module.log, module.log


def test_benchmark_rejects_unknown_columns():
    """benchmark() names the bad column before touching the GPU (a typo in --col would otherwise
    measure nothing for it)."""
    with pytest.raises(ValueError, match="sm90_nope"):
        ab.benchmark(columns=("sm90", "sm90_nope"))
    assert {"sm90", "sm90_rot", "autograd", "cudnn"} <= set(ab.COLUMNS)
    # BackwardPlan looks ROTATE up for every supported (head dim, causal): a missing key is a KeyError
    assert set(ab.ROTATE) == {(d, c) for d in ab.HEAD_DIMS for c in (False, True)}


def test_backward_plans_refuse_a_grid_of_2_31_blocks():
    """One CTA per (k/v block, k/v head, batch) along x: a call needing 2^31 or more blocks gets a
    ValueError from BackwardPlan before anything is compiled or allocated (tileattn.launch_limits);
    a grid under 2^31 - 1 passes that check and stops at the next one."""
    block_n = ab.block_n_of(128)
    batch = 65536

    def plan(nk, section):
        q = torch.empty(batch, 1, 1, 128, dtype=torch.bfloat16, device="meta")
        k = torch.empty(batch, 1, nk, 128, dtype=torch.bfloat16, device="meta")
        lse = torch.empty(batch, 1, 1, device="meta")
        ab.BackwardPlan(q, k, k, q, lse, q, q, k, k, causal=False, scale=1.0, deterministic=False, section=section)

    with pytest.raises(ValueError, match=r"ceil\(Nk / \d+\) must be <= 2147483647 blocks"):
        plan(block_n * 32768 + 1, None)  # 65536 x 32769 blocks
    with pytest.raises(ValueError, match=r"ceil\(Nk / \d+\) must be <= 2147483647 blocks"):
        plan(block_n * 32768, None)  # exactly 2^31 blocks
    with pytest.raises(ValueError, match="section must be >= 1"):  # the check after the grid's
        plan(block_n * 32767, 0)  # 65536 x 32767 blocks < 2^31 - 1
