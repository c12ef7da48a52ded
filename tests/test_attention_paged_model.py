"""CPU model of csrc/attention_paged_sm80.cu, lane by lane, against the float64 reference (no GPU).

The kernel is restated in NumPy at the level where its bugs would live: the CTA's key range and
split (KeyRange), the tile loader (thread -> key row and chunks, one block-table read per row, XOR-stepped
swizzled destinations, zero fill for invalid block ids, the per-tile "bad" flag), the XOR swizzle, the ldmatrix lane
addresses of Q, K and V (patterns A and B), the PTX fragment layouts of ldmatrix(.trans) and
mma.m16n8k16, the masks (length edge, causal diagonal, invalid blocks), the online softmax with its
-2^100 start and vote-gated rescale, P rounded to 16 bits, the key-split merge through shared
memory, the epilogue's (token, head) row map, and the split-KV combine. ldmatrix and mma are
modelled from the PTX ISA's fragment tables, independently of the kernel's own comments, so a
wrong lane address or register order shows up as a wrong result.

The Python mirrors the C++ by hand: change them together.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tileattn import reference
from tileattn.dropout import UNBOUNDED, check_window
from tileattn.kernels import attention_paged_sm80 as paged

LANES = np.arange(32)
G_OF, T_OF = LANES // 4, LANES % 4  # mma fragment coordinates of each lane
NO_KEY = -(2.0**100)
LOG2E = 1.4426950408889634


def pitch(d):
    """Row pitch in elements of common/sm80_tile.cuh's SwizzledTile: a power of two >= d."""
    return 1 << (d - 1).bit_length()


def swizzle(d, row, chunk):
    """Element offset of chunk `chunk` of row `row` (SwizzledTile::chunk / 2): the physical chunk is
    chunk ^ (row & 7) for pitches of 8+ chunks, chunk ^ ((row >> 1) & 3) for 4-chunk rows."""
    row_term = (row & 7) if pitch(d) >= 64 else ((row >> 1) & 3)
    return row * pitch(d) + ((chunk ^ row_term) << 3)


def ldmatrix_x4(smem, addrs, trans=False):
    """PTX ldmatrix.x4: lane 8m + r gives the address of row r of matrix m; lane l receives, in
    register m, elements (l // 4, 2 (l % 4) + {0, 1}) of matrix m (of its transpose with .trans).
    Returns [32 lanes, 4 registers, 2 halves]."""
    rows = smem[np.asarray(addrs)[:, None] + np.arange(8)]  # [32, 8]
    mats = rows.reshape(4, 8, 8)
    if trans:
        mats = mats.transpose(0, 2, 1)
    return np.stack([mats[m][G_OF[:, None], 2 * T_OF[:, None] + np.arange(2)] for m in range(4)], axis=1)


def mma(c, a, b):
    """PTX mma.m16n8k16.row.col: A register r half h of lane (g, t) is (row g + 8 (r & 1), k 8 (r >> 1)
    + 2t + h); B register r half h is (k 8r + 2t + h, column g); C element e is (row g + 8 (e >> 1),
    column 2t + (e & 1)). c [32, 4], a [32, 4, 2], b [32, 2, 2] -> new c."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for r in range(4):
        for h in range(2):
            A[G_OF + 8 * (r & 1), 8 * (r >> 1) + 2 * T_OF + h] = a[:, r, h]
    for r in range(2):
        for h in range(2):
            B[8 * r + 2 * T_OF + h, G_OF] = b[:, r, h]
    C = np.zeros((16, 8))
    for e in range(4):
        C[G_OF + 8 * (e >> 1), 2 * T_OF + (e & 1)] = c[:, e]
    C = C + A @ B
    return np.stack([C[G_OF + 8 * (e >> 1), 2 * T_OF + (e & 1)] for e in range(4)], axis=1)


def quad(x, op):
    return op(x.reshape(8, 4), axis=1).repeat(4)


def round16(x, dtype):
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).to(dtype).double().numpy()


def loader_geometry(cfg, d):
    """(threads per key row, consecutive rows per thread) of the kernel's tile loader
    (kLoadTPR, kLoadRows): one row per thread on the two-m-tile prefill tiles, else 8 threads per
    row where rows are whole 128-byte lines (d % 64 == 0), 4 at d = 32 and 96."""
    threads = 32 * cfg.warps_m * cfg.warps_n
    m_tiles = cfg.block_m // (16 * cfg.warps_m)
    tpr = threads // cfg.block_n if m_tiles == 2 else 8 if (d // 8) % 8 == 0 else 4
    return tpr, cfg.block_n * tpr // threads


def loader_copies(cfg, d, tid):
    """The 16-byte copies thread `tid` issues per tile, in the kernel's order: (i, r, c, at): row i of
    its rows, tile row r = r0 + i, logical chunk c = q + tpr j, and the destination element offset
    formed as the kernel forms it, swizzle(r0, q) XOR swizzle(i, tpr j)."""
    tpr, rows = loader_geometry(cfg, d)
    r0, q = tid // tpr * rows, tid % tpr
    return [(i, r0 + i, q + tpr * j, swizzle(d, r0, q) ^ swizzle(d, i, tpr * j))
            for i in range(rows) for j in range(d // 8 // tpr)]


def run_cta(cfg, d, p, b, kv_head, split, m_tile, out, lse, o_part, lse_part):
    """One CTA of attention_paged_sm80<d, cfg...>; p holds the launch parameters and tensors.
    Returns (S, the key tiles this CTA visited, the group's key tiles): S is the group's effective
    split count min(num_splits, max(1, tiles)), or 1 at most p["unsplit"] tiles (the kernel's
    unsplit_tiles, on the one-m-tile layouts), the kernel's s_eff. With p["stale"] (the prewait
    contract) the prologue tiles wholly below nk - nq are loaded from the stale caches (what the
    kernel may see before its PDL wait: the new keys' slots NaN), the rest from the final ones."""
    warps_m, warps_n, bm, bn = cfg.warps_m, cfg.warps_n, cfg.block_m, cfg.block_n  # stages: timing only
    threads = 32 * warps_m * warps_n
    chunks = d // 8
    row_elems = pitch(d)
    warp_keys = bn // warps_n
    m_tiles = bm // (16 * warps_m)
    rows_per_warp = 16 * m_tiles
    group, bs, cap = p["group"], p["block_size"], p["max_blocks"] * p["block_size"]
    q_start = p["cu"][b]
    nq = max(p["cu"][b + 1] - q_start, 0)
    nk = max(p["seqlens"][b], 0)
    rows = nq * group
    row0 = m_tile * bm
    if row0 >= rows:
        return 1, [], []  # no key tile: S = 1, and the CTA leaves after the prologue
    nk_read = min(nk, cap)
    diag = nk - nq
    first_tok, last_tok = row0 // group, (min(row0 + bm, rows) - 1) // group
    va = p["variants"]  # None: the plain kernel
    first_tile = n_unmasked_first = 0
    if va is None:
        kv_end = max(0, min(nk_read, last_tok + diag + 1)) if p["causal"] else nk_read
        unmasked_end = max(0, min(nk_read, first_tok + diag + 1)) if p["causal"] else nk_read
    else:  # window_lo / window_hi of common/variants.cuh; union and intersection of the rows' windows
        kv_end = max(0, min(nk_read, min(nk - 1, last_tok + diag + va["right"]) + 1))
        unmasked_end = max(0, min(nk_read, min(nk - 1, first_tok + diag + va["right"]) + 1))
        first_tile = max(0, first_tok + diag - va["left"]) // bn
        n_unmasked_first = -(-max(0, last_tok + diag - va["left"]) // bn)
    tiles = -(-kv_end // bn)
    unsplit = p["unsplit"] if m_tiles == 1 else 0
    s_eff = 1 if tiles - first_tile <= unsplit else min(p["splits"], max(1, tiles - first_tile))
    if split >= s_eff:
        return s_eff, [], list(range(first_tile, tiles))  # an idle split: no load, partial or arrival
    visits = range(first_tile + split, tiles, s_eff)  # strided splits, increasing tiles
    if va is None or va["left"] >= UNBOUNDED:
        # The prologue's block ids are read before the lengths: pre_id for tiles split + s num_splits,
        # pre_one for split 0's walk when S == 1 (tile s; the same entry where s == 0 or
        # num_splits == 1; unread, i.e. read later by the loader, elsewhere). The kernel loads tile
        # split + s S with pre_one when S == 1, pre_id otherwise: wherever that tile is visible and
        # the entry was read, they must name the same tile.
        for s in range(cfg.stages - 1):
            pre_id = split + s * p["splits"]
            if s == 0 or p["splits"] == 1:
                pre_one = pre_id
            else:
                pre_one = s if split == 0 and unsplit > 1 else None
            used = pre_one if s_eff == 1 else pre_id
            tile = first_tile + split + s * s_eff
            if tile < tiles and used is not None:
                assert used == tile, (f"prologue tile {s} of split {split}: S={s_eff}, num_splits={p['splits']}, "
                                      f"T={unsplit}: entry read for tile {used}, tile {tile} loaded")
    sl2 = p["scale_log2"] if va is None else 1.0  # variant logits are in log2 units already
    n_unmasked = unmasked_end // bn
    table = p["table"][b]

    sq = np.zeros(bm * row_elems)
    for tid in range(threads):  # the Q prologue loop
        for idx in range(tid, bm * chunks, threads):
            r, c = idx // chunks, idx % chunks
            grow = row0 + r
            tok, head = q_start + grow // group, kv_head * group + grow % group
            if grow < rows and 0 <= tok < p["q"].shape[0]:
                sq[swizzle(d, r, c) : swizzle(d, r, c) + 8] = p["q"][tok, head, 8 * c : 8 * c + 8]

    def load_tile(n, early=False):
        """Line-owner loader: thread (g, q) owns rows r0 + i (r0 = g * rows) of one cache block: one
        table read at its first row, the block row offset key0 % bs + i, zero fill for keys past
        kv_end or an invalid block id; destinations from loader_copies. `early`: issued before the
        PDL wait (from the stale caches)."""
        k_src, v_src = p["stale"] if early else (p["k_cache"], p["v_cache"])
        sk, sv = np.zeros(bn * row_elems), np.zeros(bn * row_elems)
        bad = False
        for tid in range(threads):
            copies = loader_copies(cfg, d, tid)
            key0 = n * bn + copies[0][1]
            in_range = key0 < kv_end
            page = table[key0 // bs] if in_range else -1
            ok = 0 <= page < p["num_blocks"]
            for i, r, c, at in copies:
                assert key0 % bs + i < bs, "a thread's rows left its cache block"
                if in_range and ok and (i == 0 or key0 + i < kv_end):
                    sk[at : at + 8] = k_src[page, key0 % bs + i, kv_head, 8 * c : 8 * c + 8]
                    sv[at : at + 8] = v_src[page, key0 % bs + i, kv_head, 8 * c : 8 * c + 8]
            bad |= in_range and not ok
        return sk, sv, bad

    a_row, a_chunk = (LANES & 7) + 8 * ((LANES >> 3) & 1), LANES >> 4
    b_row, b_chunk = (LANES & 7) + 8 * (LANES >> 4), (LANES >> 3) & 1
    state = []
    for w in range(warps_m * warps_n):
        state.append({"o": np.zeros((m_tiles, d // 8, 32, 4)), "shift": np.full((m_tiles, 2, 32), NO_KEY),
                      "sum": np.zeros((m_tiles, 2, 32))})
    for i, n in enumerate(visits):
        # the prewait contract: the prologue's tiles wholly below nk - nq go before the wait
        early = p["stale"] is not None and i < cfg.stages - 1 and (n + 1) * bn <= diag
        sk, sv, tile_bad = load_tile(n, early)
        for w in range(warps_m * warps_n):
            wm, wn = w % warps_m, w // warps_m
            warp_row0 = row0 + wm * rows_per_warp
            if warp_row0 >= rows:
                continue
            st = state[w]
            key_base = wn * warp_keys * row_elems  # element offset of this warp's keys in the tile
            s = np.zeros((m_tiles, warp_keys // 8, 32, 4))
            for ks in range(d // 16):
                a = [ldmatrix_x4(sq, wm * rows_per_warp * row_elems + swizzle(d, 16 * mt + a_row, 2 * ks + a_chunk))
                     for mt in range(m_tiles)]
                for npair in range(warp_keys // 16):
                    bk = ldmatrix_x4(sk, key_base + swizzle(d, 16 * npair + b_row, 2 * ks + b_chunk))
                    for mt in range(m_tiles):
                        s[mt, 2 * npair] = mma(s[mt, 2 * npair], a[mt], bk[:, 0:2])
                        s[mt, 2 * npair + 1] = mma(s[mt, 2 * npair + 1], a[mt], bk[:, 2:4])
            if va is not None:  # softcap or scale, ALiBi, window (+ length / capacity, invalid blocks)
                masked = n < n_unmasked_first or n >= n_unmasked or tile_bad
                key0 = n * bn + wn * warp_keys + 2 * T_OF  # [32]
                for nb in range(warp_keys // 8):
                    key = key0 + nb * 8
                    page_ok = np.ones(32, bool)
                    if tile_bad:
                        page_ok = np.array([kk < kv_end and 0 <= table[kk // bs] < p["num_blocks"] for kk in key])
                    for mt in range(m_tiles):
                        for h in range(2):
                            row = warp_row0 + 16 * mt + G_OF + 8 * h  # [32]
                            pos = row // group + diag
                            lo, hi = pos - va["left"], np.minimum(kv_end - 1, pos + va["right"])
                            slope = 0.0
                            if va["slopes"] is not None:
                                slope = -LOG2E * va["slopes"][b, kv_head * group + row % group]
                            for e in range(2):
                                raw = s[mt, nb, :, 2 * h + e]
                                if va["cap"] > 0:
                                    x = va["cap"] * LOG2E * np.tanh(raw * p["scale_log2"] / LOG2E / va["cap"])
                                else:
                                    x = raw * p["scale_log2"]
                                x = x + slope * np.abs(pos - (key + e))
                                if masked:
                                    x = np.where(~page_ok | (key + e < lo) | (key + e > hi), -np.inf, x)
                                s[mt, nb, :, 2 * h + e] = x
            elif n >= n_unmasked or tile_bad:
                key0 = n * bn + wn * warp_keys + 2 * T_OF  # [32]
                for nb in range(warp_keys // 8):
                    key = key0 + nb * 8
                    if tile_bad:
                        page_ok = np.array([kk < kv_end and 0 <= table[kk // bs] < p["num_blocks"] for kk in key])
                    else:
                        page_ok = np.ones(32, bool)
                    for mt in range(m_tiles):
                        for h in range(2):
                            tok = (warp_row0 + 16 * mt + G_OF + 8 * h) // group
                            limit = np.minimum(kv_end, tok + diag + 1) if p["causal"] else np.full(32, kv_end)
                            for e in range(2):
                                dead = ~page_ok | (key + e >= limit)
                                s[mt, nb, dead, 2 * h + e] = -np.inf
            blk = np.zeros((m_tiles, 2, 32))
            for mt in range(m_tiles):
                for h in range(2):
                    mx = np.max(s[mt, :, :, 2 * h : 2 * h + 2], axis=(0, 2))  # [32]
                    blk[mt, h] = quad(mx, np.max) * sl2
            if np.any(blk - st["shift"] > 8.0):
                new = np.maximum(st["shift"], blk)
                alpha = np.exp2(st["shift"] - new)
                st["shift"], st["sum"] = new, st["sum"] * alpha
                st["o"][:, :, :, 0:2] *= alpha[:, 0][:, None, :, None]
                st["o"][:, :, :, 2:4] *= alpha[:, 1][:, None, :, None]
            pfrag = np.zeros((m_tiles, warp_keys // 16, 32, 4, 2))
            for mt in range(m_tiles):
                for nb in range(warp_keys // 8):
                    pe = np.stack([np.exp2(s[mt, nb, :, e] * sl2 - st["shift"][mt, e >> 1])
                                   for e in range(4)], axis=1)
                    st["sum"][mt, 0] += pe[:, 0] + pe[:, 1]
                    st["sum"][mt, 1] += pe[:, 2] + pe[:, 3]
                    pe = round16(pe, p["dtype"])
                    pfrag[mt, nb >> 1, :, 2 * (nb & 1)] = pe[:, 0:2]
                    pfrag[mt, nb >> 1, :, 2 * (nb & 1) + 1] = pe[:, 2:4]
            for kk in range(warp_keys // 16):
                for dp in range(d // 16):
                    bv = ldmatrix_x4(sv, key_base + swizzle(d, 16 * kk + a_row, 2 * dp + a_chunk), trans=True)
                    for mt in range(m_tiles):
                        st["o"][mt, 2 * dp] = mma(st["o"][mt, 2 * dp], pfrag[mt, kk], bv[:, 0:2])
                        st["o"][mt, 2 * dp + 1] = mma(st["o"][mt, 2 * dp + 1], pfrag[mt, kk], bv[:, 2:4])
    for st in state:
        st["sum"] = np.stack([[quad(st["sum"][mt, h], np.sum) for h in range(2)] for mt in range(m_tiles)])
    if warps_n > 1:  # key-split merge into warp 0
        w0 = state[0]
        for h in range(2):
            shift = np.max([st["shift"][0, h] for st in state], axis=0)
            total, o = np.zeros(32), np.zeros((d // 8, 32, 2))
            for st in state:
                alpha = np.exp2(st["shift"][0, h] - shift)
                total += alpha * st["sum"][0, h]
                o += alpha[None, :, None] * st["o"][0, :, :, 2 * h : 2 * h + 2]
            w0["shift"][0, h], w0["sum"][0, h], w0["o"][0, :, :, 2 * h : 2 * h + 2] = shift, total, o
        state = state[:1]
    for w, st in enumerate(state):
        wm = w % warps_m
        for mt in range(m_tiles):
            for h in range(2):
                for lane in range(32):
                    grow = row0 + wm * rows_per_warp + 16 * mt + G_OF[lane] + 8 * h
                    tok = q_start + grow // group
                    if grow >= rows or not 0 <= tok < p["q"].shape[0]:
                        continue
                    head = kv_head * group + grow % group
                    total = st["sum"][mt, h, lane]
                    inv = 1 / total if total > 0 else 0.0
                    row_lse = (st["shift"][mt, h, lane] + math.log2(total)) / LOG2E if total > 0 else -math.inf
                    cols = np.arange(d // 8) * 8 + 2 * T_OF[lane]
                    vals = st["o"][mt, :, lane, 2 * h : 2 * h + 2] * inv  # [d/8, 2]
                    dst = out if s_eff == 1 else o_part[split]
                    dst[tok, head, cols], dst[tok, head, cols + 1] = vals[:, 0], vals[:, 1]
                    (lse if s_eff == 1 else lse_part[split])[head, tok] = row_lse
    return s_eff, list(visits), list(range(first_tile, tiles))


def model(case, cfg, splits, causal=True, variants=None, unsplit=0, prewait=False):
    """`variants`: None or reference-style options (window, softcap, alibi_slopes): the variant kernel.
    `unsplit`: the kernel's unsplit_tiles; `prewait`: the engine contract (loads before the wait
    see the new keys' slots as NaN, stale_caches)."""
    q, k_cache, v_cache, table, cu, seqlens, max_q = case
    tq, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    p = {"q": q.double().numpy(), "k_cache": k_cache.double().numpy(), "v_cache": v_cache.double().numpy(),
         "table": table.tolist(), "cu": cu.tolist(), "seqlens": seqlens.tolist(), "group": group,
         "block_size": k_cache.shape[1], "max_blocks": table.shape[1], "num_blocks": k_cache.shape[0],
         "causal": causal, "splits": splits, "scale_log2": LOG2E / math.sqrt(d), "dtype": q.dtype, "variants": None,
         "unsplit": unsplit, "stale": stale_caches(case) if prewait else None}
    if variants is not None:  # as api_paged: causal folded into the window, slopes as [B, H]
        left, right = check_window(variants.get("window"), causal)
        slopes = variants.get("alibi_slopes")
        if slopes is not None:
            slopes = slopes.double().expand(table.shape[0], heads).numpy()
        p["variants"] = {"left": left, "right": right, "cap": float(variants.get("softcap") or 0.0), "slopes": slopes}
    out = np.full((tq, heads, d), np.nan)
    lse = np.full((heads, tq), np.nan)
    o_part = np.full((splits, tq, heads, d), np.nan)
    lse_part = np.full((splits, heads, tq), np.nan)
    m_tiles = -(-max_q * group // cfg.block_m)
    for b in range(table.shape[0]):
        nq = max(p["cu"][b + 1] - p["cu"][b], 0)
        for kv_head in range(kv_heads):
            for m_tile in range(m_tiles):
                runs = [run_cta(cfg, d, p, b, kv_head, split, m_tile, out, lse, o_part, lse_part)
                        for split in range(splits)]
                s_eff = runs[0][0]
                assert all(r[0] == s_eff for r in runs), f"the CTAs of group {(b, kv_head, m_tile)} disagree on S"
                seen = sorted(n for _, visits, _ in runs for n in visits)
                assert seen == runs[0][2], f"group {(b, kv_head, m_tile)}, S={s_eff}: tiles visited {seen}"
                if s_eff == 1:
                    continue
                # the S-th arrival's combine (paged::combine_row) over the group's rows, S partials
                for r in range(m_tile * cfg.block_m, min((m_tile + 1) * cfg.block_m, nq * group)):
                    tok, head = p["cu"][b] + r // group, kv_head * group + r % group
                    ls = lse_part[:s_eff, head, tok]
                    mx = ls.max()
                    total = np.exp(ls - mx).sum() if mx > -np.inf else 0.0
                    row_lse = mx + math.log(total) if total > 0 else -math.inf
                    acc = np.zeros(d)
                    for s in range(s_eff):
                        if ls[s] > -np.inf:
                            acc += np.exp(ls[s] - row_lse) * o_part[s, tok, head]
                    out[tok, head], lse[head, tok] = acc, row_lse
    return out, lse


def stale_caches(case):
    """(k, v) float64 copies of the caches as the kernel may find them before its PDL wait under the
    prewait contract: the previous kernel has not yet written each sequence's newest nq keys
    (positions nk - nq .. nk - 1, through the block table), here NaN."""
    _, k_cache, v_cache, table, cu, seqlens, _ = case
    k, v = k_cache.double().numpy().copy(), v_cache.double().numpy().copy()
    bs = k_cache.shape[1]
    for b in range(table.shape[0]):
        nq, nk = int(cu[b + 1] - cu[b]), int(seqlens[b])
        for pos in range(max(nk - nq, 0), min(nk, table.shape[1] * bs)):
            page = int(table[b, pos // bs])
            if 0 <= page < k.shape[0]:
                k[page, pos % bs], v[page, pos % bs] = np.nan, np.nan
    return k, v


def make_case(seqs, heads, kv_heads, d, block_size, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-nk // block_size) for _, nk in seqs]
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.randint(-(2**31), 2**31 - 1, (len(seqs), max(pages) + 1), generator=gen, dtype=torch.int64)
    table = table.to(torch.int32)
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, d)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(nq for nq, _ in seqs), heads, d, generator=gen).to(dtype)
    cu = torch.tensor([0, *np.cumsum([nq for nq, _ in seqs]).tolist()], dtype=torch.int32)
    seqlens = torch.tensor([nk for _, nk in seqs], dtype=torch.int32)
    return q, k_cache, v_cache, table, cu, seqlens, max(nq for nq, _ in seqs)


def check(case, cfg, splits, causal=True, variants=None, model_case=None, unsplit=0, prewait=False):
    """The model on `model_case` (default: `case`) against the reference on `case`."""
    q, k_cache, v_cache, table, cu, seqlens, max_q = case
    out, lse = model(case if model_case is None else model_case, cfg, splits, causal, variants, unsplit, prewait)
    ref_out, ref_lse = reference.attention_paged(q, k_cache, v_cache, table, cu, seqlens, max_q, 10**6,
                                                 causal=causal, return_lse=True, compute_dtype=torch.float64,
                                                 **(variants or {}))
    ref_out, ref_lse = ref_out.numpy(), ref_lse.numpy()
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "a row was not written"
    err = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    assert err < 1e-2, f"{cfg} splits={splits}: relative error {err:.3e}"
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse)), f"{cfg} splits={splits}: -inf pattern of lse"
    fin = np.isfinite(ref_lse)
    assert np.allclose(lse[fin], ref_lse[fin], atol=1e-6 * (1 + np.abs(ref_lse[fin]).max())), "lse"


@pytest.mark.parametrize("layout", [0, 1, 2])
@pytest.mark.parametrize("splits", [1, 3])
def test_model_matches_reference(layout, splits):
    cfg = paged.CONFIGS[64][layout]
    heads, kv_heads = (8, 2) if layout < 2 else (4, 4)
    seqs = [(1, 40), (3, 70), (0, 5), (2, 17)] if layout < 2 else [(33, 90), (1, 20)]
    check(make_case(seqs, heads, kv_heads, 64, 16, seed=layout * 10 + splits), cfg, splits)


@pytest.mark.parametrize("layout", [0, 1, 2])
def test_model_group_of_three(layout):
    """G = 3 (H = 9, Hkv = 3, SmolLM2's shape): token = row / 3, head = kv_head * 3 + row % 3."""
    seqs = [(5, 60), (1, 31)] if layout < 2 else [(30, 80)]
    check(make_case(seqs, 9, 3, 64, 16, seed=30 + layout), paged.CONFIGS[64][layout], 2)


def test_model_masks_invalid_blocks_and_capacity():
    case = make_case([(1, 70), (2, 40)], 8, 2, 64, 16, seed=3)
    table, seqlens = case[3], case[5]
    table[0, 1] = -1
    table[1, 0] = 10**6
    seqlens[1] = 1000  # past the table's capacity
    for layout in range(3):
        check(case, paged.CONFIGS[64][layout], 2)


@pytest.mark.parametrize("layout", [0, 1, 2])
def test_model_copies_no_row_past_the_length(layout):
    """K and V NaN in the rest of each sequence's last block (the model runs on that, the reference
    on the clean cache): a loader run of rows straddling the length copies only the rows below it.
    Lengths end at every offset of a 4-row run and around the 64-key tile edge."""
    nq = (1, 5, 40)[layout]
    seqs = [(nq, nq + extra) for extra in (60, 61, 62, 63, 66, 67)]
    case = make_case(seqs, 8, 2, 64, 16, seed=50 + layout)
    k_bad, v_bad = case[1].clone(), case[2].clone()
    for b, (_, nk) in enumerate(seqs):
        keys = torch.arange(nk, -(-nk // 16) * 16)
        k_bad[case[3][b, keys // 16].long(), keys % 16] = float("nan")
        v_bad[case[3][b, keys // 16].long(), keys % 16] = float("nan")
    check(case, paged.CONFIGS[64][layout], 2, model_case=(case[0], k_bad, v_bad, *case[3:]))


def test_model_non_causal_prefill_tile():
    case = make_case([(40, 100), (5, 5)], 4, 2, 64, 32, seed=4)
    check(case, paged.CONFIGS[64][2], 1, causal=False)


@pytest.mark.parametrize("head_dim", [32, 96, 128, 256])
def test_model_other_head_dims(head_dim):
    """d = 32: 4-chunk rows ((row >> 1) & 3 swizzle); d = 96: 128-element pitch and the round-robin
    loader; d = 128 / 256: loader passes of 8 / 4 rows."""
    case = make_case([(1, 50), (2, 33)], 8, 2, head_dim, 16, seed=head_dim)
    check(case, paged.CONFIGS[head_dim][0], 2)
    case = make_case([(9, 40)], 16, 1, head_dim, 16, seed=head_dim + 1)  # 144 rows: the prefill layout
    for cfg in dict.fromkeys(paged.configs(head_dim, arch)[2] for arch in ("sm_80", "sm_90a")):
        check(case, cfg, 1)


@pytest.mark.parametrize("cfg", paged.DECODE_TUNING[128], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
def test_model_decode_tuning_configs(cfg, splits):
    """The decode tuning candidates (2 and 8 key-split warps, 32- and 128-key tiles) at d = 128:
    decode rows of GQA 4 with lengths around their tile edges, one speculative run of 3 tokens
    (12 rows), a sequence without keys, and an invalid block id."""
    seqs = [(1, 150), (1, 31), (1, 129), (3, 40), (1, 0)]
    case = make_case(seqs, 8, 2, 128, 16, seed=200 + cfg.block_n + splits)
    case[3][0, 2] = -3  # keys 32..47 of sequence 0: masked, never read
    check(case, cfg, splits)


def all_configs():
    """Every (head dim, config) the kernel is instantiated with: the base table, the per-arch
    tables and the tuning candidates."""
    tables = [paged.CONFIGS, *paged.ARCH_CONFIGS.values()]
    pairs = {(d, c) for t in tables for d, cs in t.items() for c in cs}
    pairs |= {(d, c) for table in (paged.PREFILL_TUNING, paged.DECODE_TUNING) for d, cs in table.items() for c in cs}
    return sorted(pairs, key=str)


@pytest.mark.parametrize(("head_dim", "cfg"), all_configs(), ids=str)
def test_loader_copies_every_chunk_once_to_its_swizzled_place(head_dim, cfg):
    """The loader's (thread, row, chunk) -> destination map over a whole tile: every chunk of every
    key row is copied exactly once, to swizzle(row, chunk) (the XOR-formed destinations against
    the swizzle itself); a thread's rows are consecutive and aligned, so they share a cache block
    at every block size (16..256); and each warp instruction's quarter-warps copy whole 128-byte
    lines (d % 64 == 0) or 64-byte pieces at 64-byte offsets of a row, not sectors of many rows."""
    threads = 32 * cfg.warps_m * cfg.warps_n
    tpr, rows = loader_geometry(cfg, head_dim)
    seen = {}
    for tid in range(threads):
        copies = loader_copies(cfg, head_dim, tid)
        r0 = copies[0][1]
        assert r0 % rows == 0 and 16 % rows == 0, f"thread {tid}: rows from {r0}, {rows} per thread"
        for i, r, c, at in copies:
            assert (r, c) not in seen, f"row {r} chunk {c} copied by threads {seen[(r, c)]} and {tid}"
            seen[(r, c)] = tid
            want = swizzle(head_dim, r, c)
            assert at == want, f"thread {tid} row {r} chunk {c}: copied to element {at}, swizzle says {want}"
    missing = {(r, c) for r in range(cfg.block_n) for c in range(head_dim // 8)} - set(seen)
    assert not missing, f"chunks never copied: {sorted(missing)[:8]}"
    if cfg.block_m // (16 * cfg.warps_m) == 2:
        return  # the prefill tiles keep one row per thread (registers), see loader_geometry
    piece = 128 if head_dim % 64 == 0 else 64  # bytes per quarter-warp and row
    for warp in range(threads // 32):
        per_lane = [loader_copies(cfg, head_dim, 32 * warp + lane) for lane in range(32)]
        for k in range(len(per_lane[0])):  # one cp.async instruction of the warp
            for quarter in range(4):
                lanes = range(8 * quarter, 8 * quarter + 8)
                cells = sorted((per_lane[ln][k][1], 16 * per_lane[ln][k][2]) for ln in lanes)  # (row, byte)
                by_row = {}
                for r, byte in cells:
                    by_row.setdefault(r, []).append(byte)
                for r, starts in by_row.items():
                    whole = starts == list(range(starts[0] - starts[0] % piece, starts[0] + piece, 16))
                    assert whole, f"warp {warp} copy {k} quarter {quarter}: row {r} bytes {starts}, want {piece} aligned"


MODEL_VARIANTS = {
    "window": {"window": (20, 0)},  # smaller than the lengths: tiles before it skipped
    "window_right": {"window": (9, 3)},
    "window_zero": {"window": (0, 0)},
    "softcap": {"softcap": 0.7},
    "alibi_bh": {"alibi_slopes": "bh"},
    "all": {"window": (30, 5), "softcap": 2.0, "alibi_slopes": "h"},
}


@pytest.mark.parametrize("name", list(MODEL_VARIANTS))
@pytest.mark.parametrize("layout", [0, 1, 2])
@pytest.mark.parametrize("splits", [1, 3])
def test_model_variants(name, layout, splits):
    """The variant kernel's key range (first tile from the window, strided splits from there), its
    per-tile mask decision and logits against the reference with the same options; causal and not;
    a sequence with more queries than keys (rows without keys) and an invalid block id."""
    heads, kv_heads = (8, 2) if layout < 2 else (4, 4)
    seqs = [(1, 150), (3, 70), (0, 5), (4, 2)] if layout < 2 else [(33, 200), (1, 20), (40, 25)]
    case = make_case(seqs, heads, kv_heads, 64, 16, seed=100 + layout * 10 + splits)
    case[3][1, 1] = -5  # keys 16..31 of sequence 1: an invalid block inside the windows
    options = dict(MODEL_VARIANTS[name])
    if "alibi_slopes" in options:
        shape = (heads,) if options["alibi_slopes"] == "h" else (len(seqs), heads)
        options["alibi_slopes"] = torch.rand(shape, generator=torch.Generator().manual_seed(layout)) * 0.5
    for causal in (True, False):
        check(case, paged.CONFIGS[64][layout], splits, causal, options)


@pytest.mark.parametrize("splits", [2, 5, 128])
@pytest.mark.parametrize("variant", [None, "window"])
def test_model_effective_splits(splits, variant):
    """A block table sized for far more keys than the lengths (an engine's decode graph): each
    (M tile, KV head, sequence) group runs S = min(num_splits, max(1, tiles)) splits, the others
    stay idle; S == 1 writes out directly, otherwise the combine reads S partials (the rest of
    o_part / lse_part stays NaN here, so reading one more would show). Lengths around the 64-key
    tile edges, one sequence without keys, a speculative run of 3 tokens; with a window the
    group's tiles start past 0."""
    seqs = [(1, 1), (1, 63), (1, 64), (1, 65), (1, 129), (3, 300), (1, 0)]
    q, k_cache, v_cache, table, cu, seqlens, max_q = make_case(seqs, 8, 2, 64, 16, seed=300 + splits)
    gen = torch.Generator().manual_seed(splits)
    spare = torch.randint(-(2**31), 2**31 - 1, (len(seqs), 2048 // 16), generator=gen, dtype=torch.int64)
    table = torch.cat([table, spare.to(torch.int32)], dim=1)  # capacity > 2k keys; entries past a length unused
    options = None if variant is None else {"window": (70, 0)}
    causal = variant is None
    check((q, k_cache, v_cache, table, cu, seqlens, max_q), paged.CONFIGS[64][0], splits, causal, options)


@pytest.mark.parametrize("unsplit", [0, 2, 4, 1 << 30])
@pytest.mark.parametrize("prewait", [False, True])
@pytest.mark.parametrize("layout", [0, 1, 2])
def test_model_unsplit_and_prewait(unsplit, prewait, layout):
    """The no-split rule (groups of at most `unsplit` key tiles run split 0 alone over all of them,
    with the block ids it pre-reads for that walk) and the prewait contract (prologue tiles wholly
    below nk - nq loaded before the wait, from caches whose new keys are still NaN: a new key read
    early shows as NaN) on a table sized for long contexts and 3-stage / 2-stage rings; lengths
    around the 64-key tile edges, decode and multi-token (chunked prefill, speculative) rows, one
    sequence without keys. The 128-row layout (two m16 tiles per warp) ignores `unsplit`."""
    cfg = paged.CONFIGS[64][layout]
    seqs = [(1, 1), (1, 64), (1, 65), (1, 128), (1, 129), (1, 200), (3, 200), (1, 0)]
    if layout == 2:
        seqs = [(33, 200), (1, 130), (40, 40)]
    case = make_case(seqs, 8, 2, 64, 16, seed=400 + layout * 10 + (unsplit & 7) + 3 * prewait)
    q, k_cache, v_cache, table, cu, seqlens, max_q = case
    gen = torch.Generator().manual_seed(401)
    spare = torch.randint(-(2**31), 2**31 - 1, (len(seqs), 1024 // 16), generator=gen, dtype=torch.int64)
    table = torch.cat([table, spare.to(torch.int32)], dim=1)  # capacity > 1k keys; entries past a length unused
    for splits in (1, 3, 16):
        check((q, k_cache, v_cache, table, cu, seqlens, max_q), cfg, splits, unsplit=unsplit, prewait=prewait)


@pytest.mark.parametrize("unsplit", [0, 2, 1 << 30])
def test_model_unsplit_and_prewait_with_a_window(unsplit):
    """The variant kernel's key range under both switches: a sliding window (70 keys) moves the
    group's first tile past 0, so split 0's S == 1 walk starts there and reads its block ids in the
    loader (the window's left edge needs the lengths); prologue tiles wholly below nk - nq still go
    before the wait."""
    seqs = [(1, 1), (1, 65), (1, 129), (1, 200), (3, 300), (1, 0)]
    q, k_cache, v_cache, table, cu, seqlens, max_q = make_case(seqs, 8, 2, 64, 16, seed=450 + (unsplit & 7))
    gen = torch.Generator().manual_seed(451)
    spare = torch.randint(-(2**31), 2**31 - 1, (len(seqs), 1024 // 16), generator=gen, dtype=torch.int64)
    table = torch.cat([table, spare.to(torch.int32)], dim=1)
    for splits in (1, 3, 16):
        check((q, k_cache, v_cache, table, cu, seqlens, max_q), paged.CONFIGS[64][0], splits, False,
              {"window": (70, 0)}, unsplit=unsplit, prewait=True)
