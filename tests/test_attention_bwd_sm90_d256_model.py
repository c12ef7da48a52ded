"""CPU checks of the d = 256 role-split layout of csrc/attention_bwd_sm90.cu (no GPU).

At d = 256 the Hopper backward's two MMA warpgroups split the products instead of the keys (csrc
"d = 256"): one CTA per 64 keys; role 0 computes S^T, P^T, dV and dQ columns 0..127, role 1 dP^T,
dS^T, dK and dQ columns 128..255, P^T passing from role 0 to role 1 through an fp32 buffer. What
the kernel relies on, restated in Python (change them together):

* the shared-memory map (offsets, 1024-byte alignment of every swizzled tile, the total the host's
  Sm90BwdConfig.smem_bytes computes, under the 227 KB limit);
* every wgmma descriptor reads, for each (row, k), the element TMA or stmatrix stored there: S^T / dP^T
  (K, V and Q, dO K-major), dV / dK (dO, Q MN-major over four 64-column panels), dQ (the dS^T tile and
  K's panels 2 role, 2 role + 1, both MN-major); the epilogue's stmatrix of dV / dK and the TMA
  store boxes that read it back;
* the P^T exchange: role 1's thread i reads exactly the (key, query) elements role 0's thread i wrote;
* the dQ RED addresses: both roles together cover the 64 x 256 fragment-order dq_accum tile once;
* the walk (64-key blocks, m_first, the `masked` flag and thresholds, edges, GQA) as a float64
  emulation against float64 autograd;
* the barrier protocol (rings, P^T barrier, single-buffered sP, double-buffered sdS, dS barrier)
  under random interleavings: no deadlock, every read sees the tile it expects.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from tileattn.kernels import attention_bwd_sm90 as ab

from .test_attention_bwd_sm90_model import (
    assert_walk_matches_autograd,
    fragment_order_index,
    padded_operands,
    stored_elements,
)
from .test_attention_fwd_sm90_model import (
    MBarrier,
    NamedBarrier,
    acc_pos,
    kmajor_element,
    mnmajor_element,
    tma_panel_addr,
)

D, BLOCK_M, BLOCK_N = 256, 64, ab.BLOCK_N_256
CFG = ab.DEFAULTS[(256, False)]


def smem_offsets(stages: int) -> dict[str, int]:
    """Byte offsets of the d = 256 kernel's shared-memory tiles from the 1024-aligned base."""
    off = {"K": 0, "V": BLOCK_N * D * 2}
    off["Q"] = off["V"] + BLOCK_N * D * 2
    off["dO"] = off["Q"] + stages * BLOCK_M * D * 2
    off["dS"] = off["dO"] + stages * BLOCK_M * D * 2
    off["P"] = off["dS"] + 2 * BLOCK_N * BLOCK_M * 2
    off["lse"] = off["P"] + BLOCK_N * BLOCK_M * 4
    off["delta"] = off["lse"] + stages * BLOCK_M * 4
    off["end"] = off["delta"] + stages * BLOCK_M * 4
    return off


def test_registry_and_config():
    assert ab.block_n_of(256) == 64 and ab.block_n_of(128) == ab.block_n_of(64) == ab.BLOCK_N
    assert CFG == ab.DEFAULTS[(256, True)] == ab.Sm90BwdConfig(64, 2)
    for det in (False, True):
        assert CFG.fits(256, det) and CFG.dq_buffers(256, det) == 0  # dQ by REDs in both modes
    assert not ab.Sm90BwdConfig(64, 2, True).fits(256, False)  # no room for a staged dQ tile
    assert not ab.Sm90BwdConfig(64, 3).fits(256, False)        # nor for a third ring stage
    want = {ab.expression(256, CFG, c, bf16, det) for c in (False, True) for bf16 in (False, True)
            for det in (False, True)}
    assert {e for e in ab.INSTANTIATIONS if "attention_bwd_sm90<256," in e} == want
    assert not any("<256," in e for e in ab.TUNING)
    assert ab.supports(256, torch.bfloat16, True) and not ab.supports_varlen(256, torch.bfloat16)
    # the variant kernels (session 22) on the same tile, every set, both dQ modes
    assert ab.VARIANT_DEFAULTS[256] == ab.Sm90BwdConfig(64, 2) and ab.VARIANT_SETS[256] == ab.VARIANT_SETS[128]
    # (but the deterministic kRngState form, which spilled: UNREGISTERED_VARIANTS)
    assert {e for e in ab.INSTANTIATIONS if "variants<256," in e} == {
        ab.variant_expression(256, CFG, bf16, bits, det) for bf16 in (False, True) for bits in ab.VARIANT_SETS[256]
        for det in (False, True) if (256, bits, det) not in ab.UNREGISTERED_VARIANTS}


def test_smem_layout_fits_and_is_aligned():
    off = smem_offsets(CFG.stages)
    assert off["end"] + 1024 == CFG.smem_bytes(256) == CFG.smem_bytes(256, True) <= ab.SMEM_LIMIT - ab.STATIC_SMEM
    assert all(off[name] % 1024 == 0 for name in ("K", "V", "Q", "dO", "dS")), off  # 128B swizzle atoms
    assert off["P"] % 16 == 0 and off["lse"] % 16 == 0 and off["delta"] % 16 == 0  # float4 / bulk copies


def test_stmatrix_tiles_and_store_boxes():
    """dS^T (64 keys x 64 queries) and the epilogue's dV / dK (64 keys x 256) by store_fragments into
    64-row panel tiles, read back by the dQ descriptor and by the four 64 x 64 TMA store boxes."""
    for cols in (BLOCK_M, D):
        written = stored_elements(BLOCK_N, 0, cols)
        assert len(written) == 64 * cols
        for addr, (row, col) in written.items():
            assert addr == tma_panel_addr(0, BLOCK_N, row, col), (cols, row, col)
    for p in range(D // 64):
        box = p * BLOCK_N * 128
        assert box % 1024 == 0
        for r in range(0, 64, 3):
            for c in range(0, 64, 5):
                assert tma_panel_addr(box, 64, r, c) == tma_panel_addr(0, BLOCK_N, r, 64 * p + c)


def test_descriptors_read_what_was_written():
    off = smem_offsets(CFG.stages)
    panel, stage_bytes = BLOCK_N * 128, BLOCK_M * D * 2  # 64-row panels (keys and queries alike)
    ds_at = {rc: a for a, rc in stored_elements(BLOCK_N, 0, BLOCK_M).items()}  # (key, query) -> byte
    rng = random.Random(256)
    for _ in range(2000):
        role, stage, k = rng.randrange(2), rng.randrange(CFG.stages), rng.randrange(16)
        # S^T = K Q^T (role 0) / dP^T = V dO^T (role 1): A = all 64 key rows, B = the stage's queries.
        a_base = off["K"] if role == 0 else off["V"]
        b_base = (off["Q"] if role == 0 else off["dO"]) + stage * stage_bytes
        ks, r, n = rng.randrange(D // 16), rng.randrange(64), rng.randrange(BLOCK_M)
        start_a = a_base + (ks // 4) * panel + 32 * (ks % 4)
        assert kmajor_element(start_a, 1024, r, k) == tma_panel_addr(a_base, BLOCK_N, r, 16 * ks + k)
        start_b = b_base + (ks // 4) * panel + 32 * (ks % 4)
        assert kmajor_element(start_b, 1024, n, k) == tma_panel_addr(b_base, BLOCK_M, n, 16 * ks + k)
        # dV += P^T dO (role 0) / dK += dS^T Q (role 1): B MN-major, N = d over four panels, k = queries.
        rhs = (off["dO"] if role == 0 else off["Q"]) + stage * stage_bytes
        kk, col = rng.randrange(BLOCK_M // 16), rng.randrange(D)
        assert mnmajor_element(rhs + 2048 * kk, panel, 1024, col, k) == tma_panel_addr(rhs, BLOCK_M, 16 * kk + k, col)
        # dQ[:, 128 role + 64 half ..] = dS K: A = dS from the dS^T tile (one panel), B = K panel 2 role + half.
        half, buf = rng.randrange(2), rng.randrange(2)
        ds0 = off["dS"] + buf * BLOCK_N * BLOCK_M * 2
        kk, m, n = rng.randrange(BLOCK_N // 16), rng.randrange(64), rng.randrange(64)
        assert mnmajor_element(ds0 + 2048 * kk, panel, 1024, m, k) == ds0 + ds_at[(16 * kk + k, m)]
        b_panel = 2 * role + half
        got_b = mnmajor_element(off["K"] + b_panel * panel + 2048 * kk, panel, 1024, n, k)
        assert got_b == tma_panel_addr(off["K"], BLOCK_N, 16 * kk + k, 64 * b_panel + n)


def test_p_exchange_hands_each_thread_its_own_elements():
    """Role 0's thread tid stores sd[4 q4 .. 4 q4 + 3] at float (q4 * 128 + tid) * 4; role 1's thread
    tid reads float4 j from the same place for its sd[4 j ..]: the same accumulator positions (both
    are m64 n64 accumulators of one warpgroup), so every (key, query) meets its own P^T; and one
    warp's 32 lanes touch 512 contiguous bytes (no bank conflict)."""
    written = {}
    for tid in range(128):
        warp, lane = tid // 32, tid % 32
        for q4 in range(BLOCK_M // 8):
            for e in range(4):
                written[(q4 * 128 + tid) * 4 + e] = acc_pos(warp, lane, 4 * q4 + e)
    assert len(written) == BLOCK_N * BLOCK_M and len(set(written.values())) == BLOCK_N * BLOCK_M
    for tid in range(128):
        warp, lane = tid // 32, tid % 32
        for j in range(BLOCK_M // 8):
            for e in range(4):
                assert written[(j * 128 + tid) * 4 + e] == acc_pos(warp, lane, 4 * j + e)
    for warp in range(4):
        for j in range(BLOCK_M // 8):
            addrs = sorted((j * 128 + 32 * warp + lane) * 16 for lane in range(32))
            assert addrs == list(range(addrs[0], addrs[0] + 512, 16))


def test_dq_red_addresses_hit_the_fragment_order_layout():
    """Role r's thread (warp, lane) REDs dq{half}[4 j ..] to dq_accum + (row0 + m0) * 256 + 16 warp * 256 +
    lane * 4 + (16 r + 8 half + j) * 128: the fragment-order places of its elements (query m0 + row,
    column 128 r + 64 half + col); both roles together cover the tile once."""
    for m0 in (0, 64, 320):
        covered = set()
        for role in range(2):
            for half in range(2):
                for warp in range(4):
                    for lane in range(32):
                        base = 16 * warp * D + lane * 4
                        for j in range(8):
                            for slot in range(4):
                                row, col = acc_pos(warp, lane, 4 * j + slot)
                                query, column = m0 + row, 128 * role + 64 * half + col
                                got = m0 * D + base + (16 * role + 8 * half + j) * 128 + slot
                                assert got == fragment_order_index(query, column, D)
                                covered.add((query, column))
        assert covered == {(m0 + i, c) for i in range(BLOCK_M) for c in range(D)}


# ---- the walk, in float64 -----------------------------------------------------------------------
def emulate(q, k, v, dout, out, lse, causal: bool, scale: float):
    """The d = 256 kernel's arithmetic per (batch, kv head, 64-key block), query head and 64-query tile
    (from the last down to m_first), with its `masked` flag and per-row thresholds (element (j, h, e)
    of thread (warp, lane) hidden iff 8 j + e < lim[h]), in float64; plus preprocess and convert.
    Checks that an unmasked tile needs no mask and that skipped tiles hold no visible pair."""
    b_, h_, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group, diag = h_ // hkv, nk - nq
    m_blocks, n_blocks = -(-nq // BLOCK_M), -(-nk // BLOCK_N)
    pad_q, pad_k = m_blocks * BLOCK_M - nq, n_blocks * BLOCK_N - nk
    qp, dop, kp, vp, lse2, delta = padded_operands(q, k, v, dout, out, lse, pad_q, pad_k)
    scale_log2 = scale * math.log2(math.e)
    dq_acc = torch.zeros_like(qp)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for b in range(b_):
        for hk in range(hkv):
            for nb in range(n_blocks):
                n0 = nb * BLOCK_N
                m_first = max(0, n0 - diag) // BLOCK_M if causal else 0
                keys = torch.arange(n0, n0 + BLOCK_N)[:, None]
                for m in range(m_first):  # skipped tiles: nothing visible
                    qs = torch.arange(m * BLOCK_M, (m + 1) * BLOCK_M)[None, :]
                    assert not ((keys < nk) & (keys <= qs + diag) & (qs < nq)).any(), (m, n0)
                m_count = m_blocks - m_first
                grad_k = torch.zeros(BLOCK_N, d, dtype=torch.float64)
                grad_v = torch.zeros(BLOCK_N, d, dtype=torch.float64)
                for it in range(group * m_count):
                    head, m0 = hk * group + it // m_count, (m_blocks - 1 - it % m_count) * BLOCK_M
                    qt, dot = qp[b, head, m0:m0 + BLOCK_M], dop[b, head, m0:m0 + BLOCK_M]
                    st = kp[b, hk, n0:n0 + BLOCK_N] @ qt.T                    # role 0: S^T [keys, queries]
                    dpt = vp[b, hk, n0:n0 + BLOCK_N] @ dot.T                  # role 1: dP^T
                    p = torch.exp2(st * scale_log2 - lse2[b, head, m0:m0 + BLOCK_M][None, :])
                    masked = n0 + BLOCK_N > nk or (causal and m0 + diag < n0 + BLOCK_N - 1)
                    hidden = torch.zeros(BLOCK_N, BLOCK_M, dtype=torch.bool)
                    for warp in range(4):
                        for lane in range(32):
                            g, t = lane // 4, lane % 4
                            lim = [(BLOCK_M if key >= nk else key - diag - m0 - 2 * t if causal else 0)
                                   for key in (n0 + 16 * warp + g, n0 + 16 * warp + g + 8)]
                            for i in range(BLOCK_M // 2):
                                j, h, e = i // 4, (i >> 1) & 1, i & 1
                                row, col = acc_pos(warp, lane, i)
                                hidden[row, col] = 8 * j + e < lim[h]
                    key, query = keys.double(), torch.arange(m0, m0 + BLOCK_M, dtype=torch.float64)[None, :]
                    exact = (key >= nk) | ((key > query + diag) if causal else torch.zeros_like(hidden))
                    if masked:
                        assert torch.equal(hidden, exact), (n0, m0)
                        p = torch.where(hidden, torch.zeros_like(p), p)
                    else:
                        assert not exact.any(), f"tile n0={n0} m0={m0} needs a mask but `masked` is false"
                    dst = p * (dpt - delta[b, head, m0:m0 + BLOCK_M][None, :])  # role 1, P^T from sP
                    grad_v += p @ dot
                    grad_k += dst @ qt
                    dq_acc[b, head, m0:m0 + BLOCK_M] += dst.T @ kp[b, hk, n0:n0 + BLOCK_N]
                rows = min(BLOCK_N, nk - n0)
                dk[b, hk, n0:n0 + rows] = scale * grad_k[:rows]
                dv[b, hk, n0:n0 + rows] = grad_v[:rows]
    return scale * dq_acc[:, :, :nq], dk, dv


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk,heads,kv_heads", [(1, 1, 1, 1), (65, 63, 2, 1), (130, 129, 2, 2), (5, 200, 2, 1),
                                                  (200, 5, 4, 2), (129, 300, 4, 1)])
def test_emulated_walk_matches_autograd(nq, nk, heads, kv_heads, causal):
    assert_walk_matches_autograd(lambda *args: emulate(*args, causal, 1.0 / math.sqrt(D)), nq, nk, heads, kv_heads,
                                 D, causal)


# ---- the barrier protocol -------------------------------------------------------------------------
def simulate(n_iters: int, stages: int, seed: int):
    """The producer and the two roles of one CTA as coroutines with the kernel's waits, arrivals and
    buffer accesses, under a random schedule, TMA copies landing at random later times. Every buffer
    holds the tile index last written there; a read asserts it sees the tile it expects, a write
    asserts no reader of the previous content may still be pending."""
    rng = random.Random(seed)
    q_full = [MBarrier(1) for _ in range(stages)]
    do_full = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(2) for _ in range(stages)]  # the kernel: 256, every MMA thread; here one per role
    p_bar, ds_bar = NamedBarrier(), NamedBarrier()
    slot = {("Q", s): None for s in range(stages)} | {("dO", s): None for s in range(stages)}
    s_p = [None]                  # sP: single buffer
    s_ds = [None, None]           # sdS: double buffer
    ds_readers = [set(), set()]   # roles whose dQ wgmma of the buffer's tile has not retired
    in_flight = []                # (landing step, barrier, buffer key, tile)

    def producer():
        for it in range(n_iters):
            s = it % stages
            if it >= stages:
                while not empty[s].passed(((it // stages) - 1) & 1):
                    yield
            for name, bar in (("Q", q_full[s]), ("dO", do_full[s])):
                bar.arrive(tx=1)
                in_flight.append((rng.randrange(1, 6), bar, (name, s), it))
            yield

    def role(r: int):
        for it in range(n_iters):
            s, parity = it % stages, (it // stages) & 1
            first = q_full[s] if r == 0 else do_full[s]
            while not first.passed(parity):
                yield
            assert slot[("Q" if r == 0 else "dO", s)] == it
            yield  # S^T / dP^T wgmmas
            if r == 0:
                assert s_p[0] is None, "sP overwritten before role 1 read it"
                s_p[0] = it
                p_bar.arrive()
                while not do_full[s].passed(parity):
                    yield
                assert slot[("dO", s)] == it
            else:
                yield from p_bar.sync()
                assert s_p[0] == it, "role 1 read another tile's P^T"
                s_p[0] = None  # read: role 0 may overwrite it
                while not q_full[s].passed(parity):
                    yield
                assert slot[("Q", s)] == it
                b = it % 2
                assert not ds_readers[b], f"sdS[{b}] overwritten while a dQ wgmma of tile {it - 2} may read it"
                s_ds[b] = it
                yield
            yield from ds_bar.sync()
            b = it % 2
            assert s_ds[b] == it
            ds_readers[b].add(r)
            yield  # dQ wgmmas
            assert slot[("Q", s)] == it and slot[("dO", s)] == it and s_ds[b] == it
            ds_readers[b].discard(r)  # wgmma_wait<0>
            empty[s].arrive()
            yield

    agents = [producer(), role(0), role(1)]
    done = [False] * 3
    for _ in range(200000):
        landed = [x for x in in_flight if x[0] <= 0]
        for x in landed:
            in_flight.remove(x)
            _, bar, key, tile = x
            slot[key] = tile
            bar.complete_tx(1)
        in_flight[:] = [(t - 1, *rest) for t, *rest in in_flight]
        live = [i for i in range(3) if not done[i]]
        if not live and not in_flight:
            return
        if live:
            i = rng.choice(live)
            try:
                next(agents[i])
            except StopIteration:
                done[i] = True
    raise AssertionError("deadlock: the protocol did not finish")


@pytest.mark.parametrize("n_iters", [1, 2, 3, 7])
def test_pipeline_protocol(n_iters):
    for seed in range(40):
        simulate(n_iters, CFG.stages, seed)


def test_variant_p_handoff_through_sp():
    """Mirror of the variant kernels' role 0 -> role 1 hand-off in sP (csrc "d = 256"): with softcap
    role 0 stages P^T (1 - tanh^2), with dropout P^T with the sign bit set where dropped (P^T = 0
    included: -0.0); role 1's dS^T = P^T (dP^T - D) pass then gives exactly the body's dS^T
    (softcap: P^T (dP^T - D) (1 - tanh^2); dropout: P^T (keep dP^T / (1 - p) - D)), in fp32."""
    rng = np.random.default_rng(5)
    n = 4096
    p = rng.random(n, dtype=np.float32)
    p[:512] = 0.0  # hidden / underflowed elements, kept and dropped
    dp = rng.standard_normal(n).astype(np.float32)
    d = rng.standard_normal(n).astype(np.float32)
    th = np.tanh(rng.standard_normal(n).astype(np.float32) * 3).astype(np.float32)
    keep = rng.random(n) < 0.6
    drop_scale = np.float32(1 / (1 - 0.4))
    # softcap: sP = P (1 - tanh^2), role 1 as the plain kernel
    dcap = (np.float32(1) - th * th).astype(np.float32)
    staged = (p * dcap).astype(np.float32)
    assert np.array_equal((staged * (dp - d)).astype(np.float32), ((p * dcap) * (dp - d)).astype(np.float32))
    # dropout: sP = keep ? P : -P, decoded by the sign bit
    staged = np.where(keep, p, -p).astype(np.float32)
    kept = (staged.view(np.uint32) >> 31) == 0
    assert np.array_equal(kept | (p == 0), keep | (p == 0))  # the sign carries every keep bit where P > 0
    assert (np.signbit(staged[:512]) == ~keep[:512]).all()   # -0.0 where a zero P^T is dropped
    got = np.abs(staged) * (np.where(kept, dp, np.float32(0)) * drop_scale - d)
    want = p * (np.where(keep, dp, np.float32(0)) * drop_scale - d)
    assert np.array_equal(got.astype(np.float32), want.astype(np.float32))
