"""The index maps of csrc/attention_bwd_sm80.cu, checked over every registered config (no GPU).

The kernel addresses shared memory as "lane base XOR constant + immediate" (LdsmLane) and stores
dQ partials in mma-fragment order. Both rest on identities that hold only under conditions on the
warp tiles (power-of-two pitch, tile offsets that share no bits with the XORed constants). These
tests restate the kernel's formulas in Python and check, for every lane of every warp of every
config in the registry, that

* LdsmLane::at(i, j) equals the plain swizzle formula for the 16 x 16 block it names, and every
  block stays inside the tile's data columns;
* the phase-1 P^T / dS^T store offsets equal the plain formula;
* the main kernel's RED.v4 targets cover each dq_accum tile exactly once, and the convert kernel
  reads back each element from where the main kernel added it.

If a config is added whose warp tiles break a condition, or one of these formulas is changed on
one side only, this fails on the CPU. The Python must mirror the C++ by hand: keep them together.
"""

from __future__ import annotations

import pytest

from tileattn.kernels import attention_bwd_sm80 as ab


def pitch_chunks(cols: int) -> int:
    """SwizzledTile::kPitchChunks: chunks per row, rounded up to a power of two (at least 4)."""
    chunks = cols // 8
    return max(4, 1 << (chunks - 1).bit_length())


def chunk_offset(cols: int, r: int, c: int) -> int:
    """SwizzledTile::chunk: byte offset of 16-byte chunk c of row r."""
    pc = pitch_chunks(cols)
    swz = (r & 7) if pc >= 8 else ((r >> 1) & 3)
    return r * pc * 16 + ((c ^ swz) << 4)


def lane_row_chunk(rows_first: bool, lane: int) -> tuple[int, int]:
    """The (row, chunk) a lane addresses within one 16 x 16 ldmatrix.x4 block."""
    if rows_first:
        return lane & 15, lane >> 4
    return (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def check_ldsm(cols: int, rows_first: bool, xor: bool, row0: int, col0: int, n_i: int, n_j: int) -> None:
    """LdsmLane<cols, rows_first, xor>(tile, row0, col0).at(i, j) for i < n_i, j < n_j, all lanes."""
    tile = 64 * 1024  # any multiple of 1 KB
    row_bytes = pitch_chunks(cols) * 16
    for lane in range(32):
        lr, lc = lane_row_chunk(rows_first, lane)
        r, c = row0 + lr, (col0 >> 3) + lc
        for i in range(n_i):
            for j in range(n_j):
                want = tile + chunk_offset(cols, r + 16 * i, c + 2 * j)
                if xor:
                    got = ((tile + chunk_offset(cols, r, c)) ^ (32 * j)) + i * 16 * row_bytes
                else:
                    swz = (r & 7) if pitch_chunks(cols) >= 8 else ((r >> 1) & 3)
                    got = tile + r * row_bytes + i * 16 * row_bytes + (((c + 2 * j) ^ swz) << 4)
                assert got == want, (cols, rows_first, xor, row0, col0, i, j, lane)
                assert c + 2 * j < cols // 8, "block past the tile's data columns"


def check_warp_mma(mt: int, nt: int, ks: int, a_trans: bool, b_trans: bool, a_cols: int, b_cols: int,
                   a_m0: int, b_n0: int) -> None:
    """The two LdsmLane objects of warp_mma<..., MT, NT, KS, kATrans, kBTrans, kACols, kBCols>."""
    a_xor = (not a_trans) or is_pow2(mt)
    b_xor = (not b_trans) or is_pow2(nt // 2)
    if a_trans:
        check_ldsm(a_cols, False, a_xor, 0, a_m0, ks, mt)
    else:
        check_ldsm(a_cols, True, a_xor, a_m0, 0, mt, ks)
    if b_trans:
        check_ldsm(b_cols, True, b_xor, 0, b_n0, ks, nt // 2)
    else:
        check_ldsm(b_cols, False, b_xor, b_n0, 0, nt // 2, ks)


def layouts(cfg: ab.BwdConfig) -> dict:
    """MainCfg's warp tiles."""
    d, bn, bm, w = cfg.head_dim, cfg.block_n, cfg.block_m, cfg.warps
    wm1, wd2, wd3 = w // cfg.warps_n1, w // cfg.warps_n2, w // cfg.warps_m3
    t = dict(tn1=bn // cfg.warps_n1, tm1=bm // wm1, tn2=bn // cfg.warps_n2, td2=d // wd2, tm3=bm // cfg.warps_m3,
             td3=d // wd3, wm1=wm1, wd2=wd2, wd3=wd3)
    t.update(mt1=t["tn1"] // 16, nt1=t["tm1"] // 8, mt2=t["tn2"] // 16, nt2=t["td2"] // 8, mt3=t["tm3"] // 16,
             nt3=t["td3"] // 8)
    return t


CONFIGS = ab.all_configs()


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_main_kernel_ldmatrix_and_store_addresses(cfg):
    d, bn, bm = cfg.head_dim, cfg.block_n, cfg.block_m
    t = layouts(cfg)
    for warp in range(cfg.warps):
        key1, qry1 = (warp // t["wm1"]) * t["tn1"], (warp % t["wm1"]) * t["tm1"]
        key2, dim2 = (warp // t["wd2"]) * t["tn2"], (warp % t["wd2"]) * t["td2"]
        qry3, dim3 = (warp // t["wd3"]) * t["tm3"], (warp % t["wd3"]) * t["td3"]
        check_warp_mma(t["mt1"], t["nt1"], d // 16, False, False, d, d, key1, qry1)  # dP^T, S^T
        check_warp_mma(t["mt2"], t["nt2"], bm // 16, False, True, bm, d, key2, dim2)  # dV, dK
        check_warp_mma(t["mt3"], t["nt3"], bn // 16, True, True, bm, d, qry3, dim3)  # dQ
        # Phase-1 stores: (st_lane ^ 16 nt) + (16 mt + 8 half) * row bytes.
        assert is_pow2(t["nt1"])
        row_bytes = pitch_chunks(bm) * 16
        for lane in range(32):
            g, tt = lane >> 2, lane & 3
            col = qry1 + 2 * tt
            st_lane = chunk_offset(bm, key1 + g, col >> 3) + (col & 7) * 2
            for mt in range(t["mt1"]):
                for nt in range(t["nt1"]):
                    for half in range(2):
                        r, c = key1 + 16 * mt + g + 8 * half, qry1 + 8 * nt + 2 * tt
                        want = chunk_offset(bm, r, c >> 3) + (c & 7) * 2
                        assert (st_lane ^ (16 * nt)) + (16 * mt + 8 * half) * row_bytes == want


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_dq_kernel_k_addresses(cfg):
    d = cfg.head_dim
    check_ldsm(d, True, is_pow2(d // 16), 0, 0, cfg.dq_block_n // 16, d // 16)


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_dq_accum_fragment_order_round_trip(cfg):
    """Main kernel RED.v4 targets vs the convert kernel's reads, over one query block of BM rows."""
    d, bm = cfg.head_dim, cfg.block_m
    t = layouts(cfg)
    added: dict[int, tuple[int, int]] = {}
    for warp in range(cfg.warps):
        qry3, dim3 = (warp // t["wd3"]) * t["tm3"], (warp % t["wd3"]) * t["td3"]
        for lane in range(32):
            g, tt = lane >> 2, lane & 3
            base = ((qry3 // 16) * (d // 8) + dim3 // 8) * 128 + lane * 4
            for mt in range(t["mt3"]):
                for nt in range(t["nt3"]):
                    for e in range(4):  # c0..c3: rows g, g, g+8, g+8; cols 2t, 2t+1
                        idx = base + (mt * (d // 8) + nt) * 128 + e
                        assert idx not in added
                        added[idx] = (qry3 + 16 * mt + g + 8 * (e >> 1), dim3 + 8 * nt + 2 * tt + (e & 1))
    assert sorted(added) == list(range(bm * d))
    # Convert kernel: 64-row blocks, warp w reads tile row w, lane one float4 per tile.
    for m0 in range(0, bm, 64):
        for warp in range(4):
            for lane in range(32):
                g, tt = lane >> 2, lane & 3
                for tile in range(d // 8):
                    for e in range(4):
                        idx = m0 * d + warp * 16 * d + tile * 128 + lane * 4 + e
                        row, col = m0 + warp * 16 + g + 8 * (e >> 1), tile * 8 + 2 * tt + (e & 1)
                        if row < bm:
                            assert added[idx] == (row, col)
