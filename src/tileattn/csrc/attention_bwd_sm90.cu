// Fused attention backward for Hopper (sm_90a), FlashAttention-3 style: the main kernel of the
// pipeline preprocess -> main -> dQ convert. Preprocess and convert are attention_bwd_sm80.cu's
// kernels (delta = rowsum(dO * O), lse2 = lse * log2 e, dq_accum zeroed; dq = scale * dq_accum):
// this kernel adds into the same fp32 dq_accum layout, so the three launch as one pipeline, in both
// modes (kDqMode: 0 atomic REDs from registers, 1 deterministic = staged tiles added in key-block
// order, 2 staged tiles added unordered by the same bulk reduce-add; see "dQ modes" below).
// Three entry points share one body: attention_bwd_sm90 (dense batches, below),
// attention_bwd_sm90_varlen (packed variable-length batches, kVarlen; see "Varlen layout" and the
// entry point at the end; the dense instantiations compile to the same SASS as before it existed)
// and attention_bwd_sm90_variants (dense, window / softcap / ALiBi; see "Variants").
//
// Shapes (elements; any strides with a contiguous last dim and 16-byte aligned rows):
//   q, dout            [B, H,   Nq, d]     16-bit, read by TMA (4-D maps (d, Nq, H, B))
//   k, v               [B, Hkv, Nk, d]     16-bit, read by TMA; kv head of query head h: h / group
//   dk, dv             [B, Hkv, Nk, d]     16-bit, written by TMA stores (rows >= Nk never written)
//   lse2, delta        [B, H, NqPad]       fp32 workspaces (NqPad = Nq rounded up to 128): lse in log2
//                                          units (+inf for fully masked and padding rows), D_i
//   dq_accum           [B, H, NqPad/16, d/8, 32, 4] fp32: 16 x 8 tiles in mma C-fragment order
//                      (attention_bwd_sm80.cu): element (i, c) at tile (i/16, c/8), lane
//                      4 (i % 8) + (c % 8) / 2, slot 2 ((i % 16) / 8) + c % 2.
// Causal masking is aligned bottom-right: query i sees key j iff j <= i + Nk - Nq.
//
// Math (S = scale Q K^T, P = softmax(S), O = P V; dO given; all per (b, h)):
//   P^T  = 2^(S^T log2(e) - lse2)  (S^T = K Q^T scale)      dP^T = V dO^T
//   dS^T = P^T o (dP^T - D)          dV += P^T dO            dK += scale dS^T Q
//   dQ  += dS K  (unscaled, fp32 RED into dq_accum; the convert multiplies by scale)
//
// ---- Work decomposition -------------------------------------------------------------------------
// One CTA per (key block of kBlockN = 128 keys, kv head, batch): a 1-D grid of ceil(Nk / 128) x Hkv
// x B blocks in the order below. K and V are loaded once and stay in shared memory; the CTA walks the
// query heads of its GQA group and, for each, the query tiles of kBlockM rows from the last down to
// m_first (causal: the first tile with a query that sees key n0), keeping dK and dV in fp32
// registers for the whole walk (the group's sum happens there: no reduction pass, no atomics for
// dK / dV). 384 threads = 3 warpgroups:
//   warpgroup 0 (producer)   one thread issues every copy: K and V once, then per query tile Q +
//                            lse2 and dO + delta into kStages-deep rings; setmaxnreg.dec to 24.
//                            Deterministic mode: warp 1 adds the staged dQ tiles in turn.
//   warpgroups 1, 2 (MMA)    MMA warpgroup w owns keys [64 w, 64 w + 64) of the block: S^T, dP^T,
//                            dV, dK for those rows; setmaxnreg.inc to 240.
// Both MMA warpgroups read the same Q / dO slot, so a slot is released by all 256 MMA threads.
//
// ---- Block order ---------------------------------------------------------------------------------
// blockIdx.x -> (n_block, kv head, batch): the (kv head, batch) pairs (kv head fastest) are cut into
// sections of `section` pairs (the host picks it so that a section's Q, dO and dq_accum fit in L2, as
// FA3's backward scheduler does; 1 reproduces a (n, head, batch) grid); within a section the key
// block is the slower index. So (a) for a fixed pair, key blocks are dispatched in ascending order
// (the deterministic mode's deadlock argument needs exactly that), (b) causal, where key block n
// walks m_blocks - m_first(n) tiles, the longest CTAs of the section start first (LPT: the short
// ones fill the tail), (c) the CTAs running at once belong to few pairs, whose data stays in L2.
//
// ---- Rotated walk (`rotate` != 0, unordered dQ modes 0 and 2 only) ------------------------------
// Unrotated, every CTA of a (kv head, batch) pair walks the same tiles in the same order: the up to
// 132 CTAs in flight (N >= 16384: all of one pair) add into the same 32 KB dq_accum tile at the same
// time, 128 x 2048 float4 REDs on the L2 slices that hold it (suspected to be why N >= 16384 runs
// ~5% below N = 8192; the benchmark's sm90_rot column tests it). Rotated, key block n starts its
// walk n tiles further on (mod its tile count): concurrent key blocks add into different tiles, the
// adds spread over all slices. Q / dO reads are the same bytes from L2 either way (a pair's Q, dO and
// dq_accum fit in L2 beside the others in flight). The deterministic mode keeps the unrotated walk:
// its turn order needs every key block to meet the tiles in dispatch order.
//
// ---- Variants (attention_bwd_sm90_variants; issue #15, definitions in common/variants.cuh) -------
// Window, softcap and ALiBi as compile-time bits of kVariant (kWindow 1, kSoftcap 2, kAlibi 4, as
// the Hopper forward's), on the dense layout in every dQ mode; a third entry point calls the
// shared body, whose every variant line sits under `if constexpr`, so the plain and varlen kernels
// keep their .text byte for byte (checked: SHA-256 of all 24 plain .text sections, NVRTC 13.5).
// Causal is the window's right edge 0 (variant kernels have kCausal = false).
// - Walk: key block n visits only the query tiles of window_tiles() (the queries whose window holds a
//   key of the block), so a sliding window costs (window + 128) / kBlockM tiles per key block;
//   none: dK = dV = 0. `masked` / upper_idle come from the window's edges; the masks go on in a
//   pass of their own (window_mask) over the finished P^T (and dS^T) before they are packed.
// - Logits: the forward's variant_logits in the same fp32 order (softcap by softcap_tanh, the
//   ALiBi bias fmaf(slope, |dist|, x)), P^T = 2^(logit - lse2) against the variant forward's lse.
// - Softcap: dS^T = P^T (dP^T - D) (1 - tanh^2) (d logit / d(scale q.k)). Its passes pack P^T (and,
//   one-pass at d = 64, dS^T) pair by pair into the wgmma operand registers; with the dV overlap
//   (d = 128) P^T (1 - tanh^2) stays in the fp32 registers for the plain dS^T pass.
// - Deterministic mode: a window's tile is visited by consecutive key blocks, from the block of the
//   tile's first row's lower edge on (attention_bwd_sm90.window_first_blocks): the host starts
//   that tile's turn counter there instead of at 0, and the kernel's turn code is the plain one.
// - Dropout (kDropout 32, with kWindow alone): the forward's keep mask recomputed per tile
//   (dropout_tile_bits, while the S^T / dP^T wgmmas run), dV += (P^T keep / (1 - p)) dO and
//   dS^T = P^T (dP^T keep / (1 - p) - D), D = rowsum(dO o O) of the dropped output, as the sm80
//   variant backward (docs/attention_bwd_sm90.md, "Dropout").
// - Not here: varlen; dropout with softcap or ALiBi. Registered sets and why: attention_bwd_sm90.VARIANT_SETS.
//
// ---- Per query tile, MMA warpgroup w (keys 64 w.., queries m0 .. m0 + kBlockM) ----------------
//   1. S^T  = K_w Q^T      wgmma SS  m64 n kBlockM, k = d     (K rows K-major, Q K-major)
//      dP^T = V_w dO^T     wgmma SS  m64 n kBlockM, k = d
//   2. wait; P^T = 2^(S^T scale_log2 - lse2[q]) (masked -> 0), dS^T = P^T (dP^T - D[q]) in fp32,
//      packed to 16 bit: the accumulator layout of an m64 nN wgmma packed pairwise is the
//      register-A fragment of the next product (sm90.cuh), so P^T and dS^T never go to memory.
//   3. dV += P^T dO        wgmma RS  m64 n d, k = kBlockM     (dO MN-major)
//      dK += dS^T Q        wgmma RS  m64 n d, k = kBlockM     (Q MN-major)
//   4. dS^T -> stmatrix -> sdS[it % 2] rows 64 w.. ([keys][queries], 128-byte swizzled
//      panels of 64 queries); fence.proxy.async; named barrier of both MMA warpgroups (dQ needs the
//      other warpgroup's keys too).
//      dQ_w = dS K          wgmma SS  m64 n64, k = 128 keys, A = dS (MN-major: the panel stores
//      dS^T), B = K (MN-major). The 64 x 64 output per warpgroup: kBlockM = 128 (d = 64) splits
//      the query rows (warpgroup w: queries 64 w..), kBlockM = 64 (d = 128) splits d (columns
//      64 w..). dQ is 32 fp32 registers per thread either way.
//   5. wait for everything; release the Q / dO slot; dQ -> red.global.add.v4.f32 into
//      dq_accum: the accumulator's 4 consecutive registers of an n8 block are one float4 of the
//      fragment-order layout, and a warp's 32 lanes cover 512 contiguous bytes per instruction.
//      (Deterministic mode: the same float4s into a staging tile for the dQ warp, see below.)
// sdS is double-buffered: a warpgroup writes sdS[it % 2] only after passing the barrier of
// iteration it - 1, which the other warpgroup reached after retiring its dQ wgmma of it - 2 (the
// last reader of that buffer).
// Why RED and not FA3's bulk reduce-add from shared memory: RED needs no staging buffer (16-32 KB
// per stage), no extra barrier protocol and no dQ warp; its 8 vector instructions per thread and
// query tile are few next to the 5 wgmma groups. docs/attention_bwd_sm90.md lists it as a
// measurement still to make.
//
// ---- Shared memory (dynamic, aligned up to 1024 B by hand; every tile 128-byte swizzled as TMA
// writes it: 64-column panels [rows][64], 16-byte chunk q of row r at chunk q ^ (r % 8)) --------
//   sK, sV   [d/64][128][64]                 resident; epilogue: dK / dV staging for TMA stores
//   sQ, sdO  [kStages][d/64][kBlockM][64]    rings
//   sdS      [2][kBlockM/64][128][64]        dS^T, double-buffered
//   sDq      [kDqBuffers][kBlockM * d] fp32  staged dQ modes' tiles (dq_accum tile layout)
//   sLse, sDelta [kStages][kBlockM] fp32     lse2 / delta of the tile's queries (bulk copies)
// Bytes: Sm90BwdConfig.smem_bytes on the Python side computes the same total.
//
// ---- mbarriers and their phases ------------------------------------------------------------------
//   kv_full       1 arrival + K and V bytes; waited once with parity 0.
//   q_full[s]     1 arrival + Q tile + lse2 bytes.     Query tile `it` (0, 1, ... in walk order)
//   do_full[s]    1 arrival + dO tile + delta bytes.   uses slot s = it % kStages for the
//   empty[s]      256 arrivals: every MMA thread,      u = it / kStages-th time: consumers wait full
//                 after its own last read of the slot  parity u & 1; the producer refills for u >= 1
//                 (lse2 / delta loads) and the wgmma_  after empty phase u - 1: parity (u - 1) & 1.
//                 wait that retires its warpgroup's
//                 wgmmas reading Q / dO
// A waiter is never more than one phase behind, so parities are unambiguous (as in the forward).
// Why every thread arrives (not one per warpgroup after the 256-thread dS barrier, as before): with
// one releaser, a thread's ld.shared of lse2 reached the producer's next bulk copy into that slot
// only through a chain (its bar.sync, then the releaser's arrive). That is a valid happens-before in
// the PTX model, but compute-sanitizer racecheck reported the pair (run 6: UBLKCP of lse2 at +0x7380
// against the LDS.64 lse2 reads at +0x2040..+0x2160 of <128, 64, 2, false, true, 2>; run 7 the
// deterministic causal case): with each reader's own arrive the order is a direct release/acquire
// edge. The cost, 8 warp-wide arrives per tile on one mbarrier, is off the critical path (the
// producer needs the slot kStages - 1 tiles later).
//
// ---- Registers per MMA thread (d = 128, kBlockM = 64; d = 64, kBlockM = 128) ------------------
//   dK, dV   2 x d / 2 fp32 (128 | 64)       S^T / P^T, dP^T / dS^T   2 x kBlockM / 2 (64 | 128)
//   packed P^T, dS^T 2 x kBlockM / 4 (32 | 64) (dead once the dV / dK wgmmas retire), dQ 32.
//
// ---- dQ modes: staged (kDqMode 1, 2) and deterministic (kDqMode 1) ---------------------------------
// kDqMode 2 is mode 1 without the turn: the same staging and bulk reduce-add, no counter, no wait
// for completion (a tuning candidate: FA3's way of adding dQ, against mode 0's REDs).
// Every dq_accum element of (b, h, query tile m) gets one addition per key block, and they are made
// in key-block order through one int32 counter per (b, h, m) in dq_sem (zeroed by the host). The
// MMA warpgroups do not wait for it: after step 5's wgmma_wait they store their dQ float4s into a
// fp32 staging tile sDq[it % kDqBuffers] at the offsets RED would use (the tile of dq_accum is one
// contiguous block_m x d x 4 bytes in fragment order), fence.proxy.async and bar.arrive "full"; warp
// 1 of the producer warpgroup (the dQ warp) syncs on "full", its lane 0 spins (ld.acquire.gpu) until
// the counter is n_block, adds the whole tile with one cp.reduce.async.bulk .add.f32, waits for the
// read (then the warp bar.arrives "empty": the MMA warpgroups may refill the buffer) and for the
// completion, fences (proxy, acq_rel.gpu) and stores n_block + 1 (st.release.gpu). So the wait for
// the turn and the ~1 us completion round trip overlap the next tiles' wgmmas (kDqBuffers tiles
// ahead: 2 where shared memory allows). Every key block before n also visits tile m (m_first is
// non-decreasing in n), so the counter reaches n. Fixed order of float additions -> bitwise
// identical dq run to run. Deadlock-free because a CTA waits only on CTAs of the same (kv head,
// batch) with a smaller key block, which the block order dispatches before it (the lowest unfinished
// CTA can always run). The walk goes from the last query tile down so that, causal, all key blocks
// of a pair reach a tile in the same order they are dispatched in (walking up, key block n would
// start at tile m_first(n) and wait there for every lower block to get down to it). dK and dV are
// computed in registers in the same order in both modes.
//
// ---- Epilogue ----------------------------------------------------------------------------------
// After a barrier of both MMA warpgroups (their last dQ wgmma read all of sK), warpgroup w writes
// scale dK and dV as 16 bit with stmatrix into rows 64 w.. of sK / sV, fence.proxy.async, a
// 128-thread named barrier, and one thread issues the TMA stores (64 x 64 boxes; rows >= Nk of the
// edge block are not written).
#include "common/sm80.cuh"
#include "common/sm90_bwd.cuh"
#include "common/variants.cuh"
#include "common/varlen.cuh"

namespace tileattn {
namespace bwd90 {

namespace s9 = tileattn::sm90;
using u64 = uint64_t;

constexpr int kBlockN = 128;         // keys per CTA: two MMA warpgroups x 64
constexpr int kThreads = 384;
constexpr int kProducerRegs = 24;    // 24 + 2 x 240 = 504 per thread-slot x 128 <= 64 K registers
constexpr int kMmaRegs = 240;
constexpr int kPanel = 64;           // elements per 128-byte swizzle row
constexpr int kPanelRowBytes = 128;
constexpr uint64_t kRowStep16 = (16 * kPanelRowBytes) >> 4;  // 16 panel rows: one MN-major k step (16 B units)
constexpr int kDsBarrier = 1;        // named barriers: 1 dS ready (256), 2 walk done (256),
constexpr int kDoneBarrier = 2;      // 3, 4 warpgroup 0 / 1 alone (128, epilogue), deterministic
constexpr int kWgBarrier = 3;        // mode: 5, 6 dQ staging buffer b full, 7, 8 buffer b empty
constexpr int kDqFullBarrier = 5;    // (288: both MMA warpgroups + the dQ warp)
constexpr int kDqEmptyBarrier = 7;
constexpr int kDqSyncThreads = 288;
constexpr int kSmemLimit = 232448;   // bytes per block (227 KB opt-in), static + dynamic
constexpr int kStaticSmem = 256;     // reserve for the static mbarriers

// Dynamic shared memory of an instantiation (Sm90BwdConfig.smem_bytes mirrors it): K, V; the Q and
// dO rings; the double-buffered dS^T tile; deterministic mode's fp32 dQ staging buffers (two where
// they fit, else one); lse2 / delta per stage; + 1 KB to align the base to 1024 B.
template <int kHeadDim, int kBlockM, int kStages>
__device__ constexpr int smem_without_dq() {
  return 2 * kBlockN * kHeadDim * 2 + 2 * kStages * kBlockM * kHeadDim * 2 + 2 * kBlockN * kBlockM * 2 +
         2 * kStages * kBlockM * 4 + 1024;
}
template <int kHeadDim, int kBlockM, int kStages, bool kStaged>
__device__ constexpr int dq_buffers() {
  constexpr int base = smem_without_dq<kHeadDim, kBlockM, kStages>(), tile = kBlockM * kHeadDim * 4;
  return !kStaged ? 0 : base + 2 * tile + kStaticSmem <= kSmemLimit ? 2 : 1;
}

// Keep the packed A fragments of an RS wgmma alive (in their registers, unmodified) until this
// point: called after the wgmma_wait that retires the group reading them.
template <int kSteps>
__device__ __forceinline__ void keep_fragments(u32 (&a)[kSteps][4]) {
#pragma unroll
  for (int i = 0; i < kSteps; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[i][r])::"memory");
}

// stmatrix the packed 16-bit m64 x (16 kCols16) accumulator of one warpgroup into rows
// [row0, row0 + 64) of a swizzled panel tile [panels][kRows][64] at `tile`: lane l addresses row
// 8 ((l / 8) & 1) + l % 8 of its warp's 16 rows, 16-byte chunk 2 j + l / 16 of stmatrix j; chunk c
// lives in panel c / 8 at swizzled chunk (c % 8) ^ (row % 8) (row0 is a multiple of 8).
template <int kRows, int kCols16>
__device__ __forceinline__ void store_fragments(const u16* tile, int row0, const u32 (&a)[kCols16][4], int warp,
                                                int lane) {
  const int mi = lane / 8, rr = lane % 8;
  const int row = row0 + warp * 16 + 8 * (mi & 1) + rr;
  const u32 base = s9::smem_u32(tile) + row * kPanelRowBytes;
#pragma unroll
  for (int j = 0; j < kCols16; ++j) {
    const int chunk = 2 * j + (mi >> 1);
    const u32 addr = base + (chunk / 8) * (kRows * kPanelRowBytes) + (((chunk % 8) ^ rr) << 4);
    s9::stmatrix_x4(addr, a[j][0], a[j][1], a[j][2], a[j][3]);
  }
}

// fp32 accumulator (m64 x 16 kSteps) -> packed 16-bit pairs, times `mul`: register-A fragments
// (step kk = d[8 kk .. 8 kk + 7]) and, equally, stmatrix operands (matrix i of block j = pair i).
template <int kSteps, bool kIsBF16>
__device__ __forceinline__ void pack_acc(u32 (&a)[kSteps][4], const float (&d)[kSteps * 8], float mul) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) a[kk][r] = pack2<kIsBF16>(d[8 * kk + 2 * r] * mul, d[8 * kk + 2 * r + 1] * mul);
}

// dQ_w (+)= dS K over the first kSteps x 16 keys of the block (wgmma m64n64, both operands MN-major).
template <int kSteps, bool kIsBF16>
__device__ __forceinline__ void issue_dq(float (&dq)[32], u64 desc_a, u64 desc_b) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
    sm90::wgmma_ss_n64_mn_mn<kIsBF16>(dq, desc_a + kk * kRowStep16, desc_b + kk * kRowStep16, kk > 0 ? 1 : 0);
}

// ---- Varlen layout (attention_bwd_sm90_varlen) ----------------------------------------------------
// Packed q, dout [Tq, H, d], k, v, dk, dv [Tk, Hkv, d]; sequence b at tokens cu_seqlens_q[b] /
// cu_seqlens_k[b]. The same maps over a [1, H, T, d] view: batch coordinate 0, row coordinate =
// the sequence's first token + the tile's row. What changes (everything else is the dense body):
// - a box crossing the sequence's end reads the next sequence's rows (or rows past cu_seqlens[B],
//   which may hold anything): the MMA warpgroups zero those rows in shared memory (K / V once, the
//   Q / dO slot of each walk's last query tile) before any wgmma reads them, which gives exactly
//   the dense map's zero fill, so the arithmetic below is unchanged;
// - dK / dV boxes that end past the sequence are stored row by row (store_rows_masked): a TMA store
//   would write the next sequence's rows; Hkv extra CTAs zero the rows past the last sequence;
// - lse2 / delta / dq_accum are attention_bwd_sm80.cu's varlen workspaces ([H, ws_pitch] rows,
//   sequence b from roundup(cu_seqlens_q[b], 4) + kVarlenWsGap b, padded to 128 rows);
// - the grid covers ceil(max_seqlen_k / 128) key blocks per (kv head, sequence); CTAs past their
//   sequence's keys exit at once.
// VarlenArgs: what the packed layout needs beyond the dense arguments (the dense entry passes
// zeros): cu_seqlens and the raw dk / dv pointers and strides for the row stores.
struct VarlenArgs {
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  u16* dk;
  u16* dv;
  int64_t dk_sh, dk_sr, dv_sh, dv_sr;  // head and token strides (elements)
  int total_k;                         // Tk: rows of dk / dv
};

// Zero rows [row_begin, kRows) of a swizzled [kPanels][kRows][64] 16-bit tile: whole 128-byte
// rows, so the swizzle (a permutation inside a row) does not matter; the 256 MMA threads store 16
// bytes each per step. The thread index is read here by a volatile mov (and the loop not
// unrolled) so that ptxas cannot hoist per-thread start indices out of the walk, where they would
// hold registers across the whole tile loop (d = 64 spilled three of them).
template <int kRows, int kPanels>
__device__ __forceinline__ void zero_tile_rows(u16* tile, int row_begin) {
  u32 tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  const int count = (kRows - row_begin) * kPanels * 8;  // 16-byte chunks
#pragma unroll 1
  for (int idx = static_cast<int>(tid) - 128; idx < count; idx += 256) {
    const int r = row_begin + idx / (kPanels * 8), p = (idx / 8) % kPanels, c = idx % 8;
    *reinterpret_cast<uint4*>(tile + (p * kRows + r) * kPanel + c * 8) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Rows [row0, row0 + rows) of a swizzled [kPanels][kBlockN][64] 16-bit tile (row0 a multiple of 8)
// to global rows dst + r * row_stride, 16 bytes per thread and step (a warpgroup's 128 threads):
// chunk c of a row (d / 8 of them) lives in panel c / 8 at swizzled chunk (c % 8) ^ (row % 8).
template <int kPanels>
__device__ __forceinline__ void store_rows_masked(u16* dst, int64_t row_stride, const u16* tile, int row0, int rows,
                                                  int tid) {
  for (int idx = tid; idx < rows * kPanels * 8; idx += 128) {
    const int r = idx / (kPanels * 8), c = idx % (kPanels * 8), row = row0 + r;
    const uint4 v = *reinterpret_cast<const uint4*>(tile + ((c / 8) * kBlockN + row) * kPanel + (((c % 8) ^ (row % 8)) * 8));
    *reinterpret_cast<uint4*>(dst + r * row_stride + c * 8) = v;
  }
}

// Rows [begin, Tk) of kv head `head` of dk and dv (past the last sequence: no CTA owns them) to 0,
// by the whole CTA, 16 bytes per thread and step.
template <int kHeadDim>
__device__ __forceinline__ void zero_tail_rows(const VarlenArgs& va, int head, int begin) {
  constexpr int kChunks = kHeadDim / 8;
  const int64_t count = static_cast<int64_t>(va.total_k - begin) * kChunks;
  for (int64_t idx = threadIdx.x; idx < count; idx += kThreads) {
    const int64_t r = begin + idx / kChunks, c = idx % kChunks;
    *reinterpret_cast<uint4*>(va.dk + r * va.dk_sr + head * va.dk_sh + c * 8) = make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4*>(va.dv + r * va.dv_sr + head * va.dv_sh + c * 8) = make_uint4(0u, 0u, 0u, 0u);
  }
}

}  // namespace bwd90

// tmap_q, tmap_do: q / dout [B, H, Nq, d] as (d, Nq, H, B), box (64, kBlockM, 1, 1); tmap_k, tmap_v:
// k / v [B, Hkv, Nk, d], box (64, 128, 1, 1); tmap_dk, tmap_dv: dk / dv, box (64, 64, 1, 1). All
// 128B swizzle, zero fill. lse2 / delta / dq_accum: the workspaces above; dq_sem (kDqMode 1
// only, else unused): int32 [B, H, ceil(Nq / kBlockM), 2], zero.
// Grid (ceil(Nk / 128) * Hkv * B), ordered by `section` ("Block order"), 384 threads, dynamic shared
// memory Sm90BwdConfig.smem_bytes. `batches` = B. `rotate` != 0: the rotated walk (ignored when
// kDqMode == 1).
namespace bwd90 {
// Variants (attention_bwd_sm90_variants; definitions in common/variants.cuh): bits of kVariant, as
// the Hopper forward's (attention_fwd_sm90.cu) kWindow, kSoftcap, kAlibi.
constexpr int kWindow = 1;   // sliding window; causal is its right edge 0 (variant kernels have kCausal = false)
constexpr int kSoftcap = 2;  // logit = cap * tanh(scale q.k / cap); dS gains the factor 1 - tanh^2
constexpr int kAlibi = 4;    // logit += -slope[b, h] * |i + Nk - Nq - j| (no gradient: it does not depend on q, k)
constexpr int kDropout = 32;  // P' = P keep / (1 - p) (the forward's bit value); with kWindow alone ("Dropout")
// With kSoftcap: the P^T / dS^T passes compiled twice, for masked tiles and for the others, whose
// pass then has no window test (softcap's passes test inline, per element, as they pack: with the
// tile's `masked` a run-time value, every tile's pass branches around each pair's test). Census
// (scripts/sass_loop_census.py, NVRTC 13.5, bf16, atomic dQ, static instructions per tile visit):
// d = 128 softcap 975 (~750 run in an unmasked tile, with 64 uniform branches) -> 606 unmasked /
// 724 masked (window alone 608), d = 64 1618 -> 943 / 1106 (923). Registered for softcap alone,
// atomic dQ (attention_bwd_sm90.split_masked_applies; the other sets spill); written in session 25
// without a device run: dispatch.SM90_SOFTCAP_BWD_SPLIT.
constexpr int kSplitMasked = 64;
// With kDropout: the seed and offset are read from VARIANT_PARAMS' rng_state (device memory) at the
// entry point instead of the seed / offset parameters (common/variants.cuh, with_rng_state); the bodies
// never see this bit.
constexpr int kRngState = 128;
constexpr int kVariantBits = kWindow | kSoftcap | kAlibi | kDropout | kSplitMasked | kRngState;
// A compile-time bool for the generic lambdas of the P^T / dS^T passes (Const<false>: the window test
// folds away in a softcap kernel's unmasked tiles).
template <bool B>
struct Const {
  __device__ constexpr operator bool() const { return B; }
};

// Dropout keep bits of one MMA thread's accumulator elements of a query tile: bit i % 32 of
// keep[i / 32] for element i = 4 j + 2 h + e (key key_h0 + 8 h, query m0 + 8 j + 2 t + e), exactly
// tileattn.dropout_mask's bit of (bh, query, key) (common/variants.cuh: dropout_bits). Both keys of a
// thread share the Philox call of a query: the same 32-key group and lane class ((key >> 1) & 3),
// words (key >> 3) & 3 = 2 ((key_h0 >> 4) & 1) + h, half key & 1 = g & 1. Lanes l and l ^ 4 (g and
// g ^ 1, same t) need the same calls for the same queries (8 j + 2 t + e, e = 0, 1), so each makes
// the call of query e = g & 1 and swaps its two words with the other by one shuffle each: kBlockM / 8
// Philox calls per thread and tile instead of kBlockM / 4. A thread's half of word w is
// (w & half_mask) >= thr with half_mask / thr shifted up 16 bits for odd g (no shift per element).
template <int kBlockM>
__device__ __forceinline__ void dropout_tile_bits(u32 (&keep)[kBlockM / 64], const Variants& var, int bh, int m0,
                                                  int key_h0, int lane) {
  const int t = lane % 4, odd = (lane / 4) & 1;
  const int group = key_h0 >> 5, lane_class = (key_h0 >> 1) & 3;
  const bool upper_words = ((key_h0 >> 4) & 1) != 0;
  const u32 half_mask = odd ? 0xffff0000u : 0xffffu, thr = odd ? var.drop_thr << 16 : var.drop_thr;
#pragma unroll
  for (int i = 0; i < kBlockM / 64; ++i) keep[i] = 0u;
#pragma unroll
  for (int j = 0; j < kBlockM / 8; ++j) {
    const uint4 bits = dropout_bits(var, bh, m0 + 8 * j + 2 * t + odd, group, lane_class);
    const u32 own0 = upper_words ? bits.z : bits.x, own1 = upper_words ? bits.w : bits.y;
    const u32 other0 = __shfl_xor_sync(0xffffffffu, own0, 4), other1 = __shfl_xor_sync(0xffffffffu, own1, 4);
    // Bits 2 h of the own query's and the other lane's query's keeps, then each moved to e = its query.
    const u32 k_own = u32((own0 & half_mask) >= thr) | (u32((own1 & half_mask) >= thr) << 2);
    const u32 k_other = u32((other0 & half_mask) >= thr) | (u32((other1 & half_mask) >= thr) << 2);
    keep[j / 8] |= ((k_own << odd) | (k_other << (odd ^ 1))) << (4 * (j % 8));
  }
}
// Element i where kept, else 0 (a select, not a product: x may be inf where hidden). The factor
// 1 / (1 - p) is not applied per element: dV's epilogue scales by it, and dS^T's pass folds it
// into its FFMA (one FSEL per element and use, no FMUL).
template <int kBlockM>
__device__ __forceinline__ float keep_select(const u32 (&keep)[kBlockM / 64], int i, float x) {
  return (keep[i / 32] >> (i % 32)) & 1u ? x : 0.f;
}
// pack_acc of the kept values (keep_select) of an m64 x kBlockM accumulator: dV's register-A
// operand is the forward's dropped P^T (up to 1 / (1 - p)) while the fp32 P^T stays for dS^T.
template <int kBlockM, bool kIsBF16>
__device__ __forceinline__ void pack_kept(u32 (&a)[kBlockM / 16][4], const float (&d)[kBlockM / 2],
                                          const u32 (&keep)[kBlockM / 64]) {
#pragma unroll
  for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = 8 * kk + 2 * r;
      a[kk][r] = pack2<kIsBF16>(keep_select<kBlockM>(keep, i, d[i]), keep_select<kBlockM>(keep, i + 1, d[i + 1]));
    }
}

// Query tiles [x, y) of kBlockM rows holding a query whose window reaches a key of the block
// [n0, min(n0 + kBlockN, Nk)): query i sees key j iff j - diag - right <= i <= j - diag + left, so
// (both edges move with j) exactly the queries [n0 - diag - right, last key - diag + left], clipped
// to [0, Nq). The walk visits only these: a key block costs (window + kBlockN) / kBlockM tiles,
// not Nq / kBlockM. Empty (x == y): the CTA writes dK = dV = 0.
template <int kBlockM, int kKeys = kBlockN>  // kKeys: keys per CTA (d = 256: kBlockN256)
__device__ __forceinline__ int2 window_tiles(int n0, int seqlen_q, int seqlen_k, const Variants& va) {
  const int diag = seqlen_k - seqlen_q;
  const int i_lo = max(0, n0 - diag - va.right);
  const int i_hi = min(seqlen_q - 1, min(n0 + kKeys, seqlen_k) - 1 - diag + va.left);
  const int first = i_lo / kBlockM;
  return make_int2(first, i_hi < i_lo ? first : i_hi / kBlockM + 1);
}

// ---- Pieces both layouts (the body below and "d = 256") share -----------------------------------
// Block order ("Block order" above): blockIdx.x -> (key block, kv head, batch); `section` pairs per
// section, the last section possibly short.
struct BlockPair {
  int n_block, kv_head, batch;
};
__device__ __forceinline__ BlockPair block_pair(int section, int n_blocks, int kv_heads, int batches) {
  const int pairs = kv_heads * batches;
  const int sec = blockIdx.x / (section * n_blocks);
  const int in_sec = blockIdx.x - sec * section * n_blocks;
  const int sec_pairs = min(section, pairs - sec * section);  // the last section may be short
  const int pair = sec * section + in_sec % sec_pairs;
  return {in_sec / sec_pairs, pair % kv_heads, pair / kv_heads};
}

// The pipeline's mbarriers (see the table above), by one thread, before the CTA's __syncthreads.
template <int kStages>
__device__ __forceinline__ void init_pipeline(const sm90::TmaDescriptor& tmap_q, const sm90::TmaDescriptor& tmap_k,
                                              const sm90::TmaDescriptor& tmap_v, const sm90::TmaDescriptor& tmap_do,
                                              u64& kv_full, u64 (&q_full)[kStages], u64 (&do_full)[kStages],
                                              u64 (&empty)[kStages]) {
  s9::tma_prefetch_descriptor(&tmap_q);
  s9::tma_prefetch_descriptor(&tmap_k);
  s9::tma_prefetch_descriptor(&tmap_v);
  s9::tma_prefetch_descriptor(&tmap_do);
  s9::mbar_init(&kv_full, 1);
  for (int s = 0; s < kStages; ++s) {
    s9::mbar_init(&q_full[s], 1);
    s9::mbar_init(&do_full[s], 1);
    s9::mbar_init(&empty[s], 256);  // every MMA thread (see the mbarrier table)
  }
  s9::fence_barrier_init();
}

// Shared-memory tiles the producer fills: K, V [kPanels][kBlockN][64]; Q, dO rings
// [kStages][kPanels][kBlockM][64]; lse2 / delta [kStages][kBlockM].
struct BwdTiles {
  u16 *sK, *sV, *sQ, *sdO;
  float *sLse, *sDelta;
};

// The producer thread's copies: K and V of the key block (TMA row k_row) once, then per step `it`
// of the walk the Q tile + lse2 and the dO tile + delta into ring slot it % kStages, after the slot's
// previous use was released. `step(it)` gives {query head, first query row, lse2 / delta offset};
// the query tile's TMA row is q_row0 + its first row.
struct WalkStep {
  int head, m0;
  int64_t ws;
};
template <int kPanels, int kBlockN, int kBlockM, int kStages, class Step>
__device__ __forceinline__ void produce(const BwdTiles& t, const sm90::TmaDescriptor& tmap_q,
                                        const sm90::TmaDescriptor& tmap_k, const sm90::TmaDescriptor& tmap_v,
                                        const sm90::TmaDescriptor& tmap_do, const float* lse2, const float* delta,
                                        u64& kv_full, u64 (&q_full)[kStages], u64 (&do_full)[kStages],
                                        u64 (&empty)[kStages], int k_row, int q_row0, int kv_head, int map_batch,
                                        int n_iters, Step step) {
  constexpr u32 kKVBytes = kBlockN * kPanels * kPanel * 2;
  constexpr u32 kQBytes = kBlockM * kPanels * kPanel * 2;
  constexpr u32 kRowBytes = kBlockM * 4;  // lse2 or delta of one query tile
  s9::mbar_arrive_expect_tx(&kv_full, 2 * kKVBytes);
#pragma unroll
  for (int p = 0; p < kPanels; ++p) {
    s9::tma_load_4d(t.sK + p * kBlockN * kPanel, &tmap_k, p * kPanel, k_row, kv_head, map_batch, &kv_full);
    s9::tma_load_4d(t.sV + p * kBlockN * kPanel, &tmap_v, p * kPanel, k_row, kv_head, map_batch, &kv_full);
  }
  for (int it = 0; it < n_iters; ++it) {
    const WalkStep w = step(it);
    const int s = it % kStages;
    if (it >= kStages) s9::mbar_wait(&empty[s], ((it / kStages) - 1) & 1);
    s9::mbar_arrive_expect_tx(&q_full[s], kQBytes + kRowBytes);
#pragma unroll
    for (int p = 0; p < kPanels; ++p)
      s9::tma_load_4d(t.sQ + (s * kPanels + p) * kBlockM * kPanel, &tmap_q, p * kPanel, q_row0 + w.m0, w.head,
                      map_batch, &q_full[s]);
    s9::bulk_load_1d(t.sLse + s * kBlockM, lse2 + w.ws, kRowBytes, &q_full[s]);
    s9::mbar_arrive_expect_tx(&do_full[s], kQBytes + kRowBytes);
#pragma unroll
    for (int p = 0; p < kPanels; ++p)
      s9::tma_load_4d(t.sdO + (s * kPanels + p) * kBlockM * kPanel, &tmap_do, p * kPanel, q_row0 + w.m0, w.head,
                      map_batch, &do_full[s]);
    s9::bulk_load_1d(t.sDelta + s * kBlockM, delta + w.ws, kRowBytes, &do_full[s]);
  }
}

// Variants: P^T of one raw score s = q.k, 2^(logit - l2) with the logit of variants.cuh in log2
// units (softcap: cap_out tanh, the tanh also left in th for the derivative; ALiBi: + slope |dist|,
// dist the signed query - key distance plus diag), or the plain kernel's exponent without either.
// Both variant bodies (d = 64 / 128 and the d = 256 role split) take their logits from here, so they
// recompute exactly the forward's.
template <int kVariant>
__device__ __forceinline__ float variant_p(const Variants& var, float s, float scale_log2, float slope, float dist,
                                           float l2, float& th) {
  constexpr bool kSoftcapped = (kVariant & kSoftcap) != 0, kAlibied = (kVariant & kAlibi) != 0;
  if constexpr (kSoftcapped || kAlibied) {
    float x;
    if constexpr (kSoftcapped) {
      th = softcap_tanh(var, s);
      x = var.cap_out * th;
    } else {
      x = s * var.scale_log2;
    }
    if constexpr (kAlibied) x = fmaf(slope, fabsf(dist), x);
    return fast_exp2(x - l2);
  } else {
    return fast_exp2(fmaf(s, scale_log2, -l2));
  }
}

// Whether element i of a thread's S^T accumulator (key key_h0 + 8 ((i >> 1) & 1), query m0 + 8 (i / 4)
// + 2 t + (i & 1)) is outside the window, or its key past Nk: visible iff key - diag - right <= query
// <= key - diag + left.
template <int kBlockM>
__device__ __forceinline__ bool window_hidden_at(const Variants& var, int i, int key_h0, int seqlen_k, int diag,
                                                 int m0, int t) {
  const int c = 8 * (i / 4) + (i & 1), key = key_h0 + 8 * ((i >> 1) & 1);
  const int lo = key >= seqlen_k ? kBlockM : key - diag - var.right - m0 - 2 * t;
  return c < lo || c > key - diag + var.left - m0 - 2 * t;
}

// The body of both entry points below (dense: kVarlen false, `va` all zero and unused, so the dense
// kernel's code is what it was before the varlen layout existed). Varlen: `seqlen_k` is
// max_seqlen_k (it sizes the grid's key-block range), `seqlen_q` and `nq_pad` are unused (each
// CTA reads its sequence's lengths from cu_seqlens) and `batches` is B.
template <int kHeadDim, int kBlockM, int kStages, bool kCausal, bool kIsBF16, int kDqMode, bool kVarlen,
          int kVariant>
__device__ __forceinline__ void attention_bwd_sm90_body(
    const sm90::TmaDescriptor& tmap_q, const sm90::TmaDescriptor& tmap_k, const sm90::TmaDescriptor& tmap_v,
    const sm90::TmaDescriptor& tmap_do, const sm90::TmaDescriptor& tmap_dk, const sm90::TmaDescriptor& tmap_dv,
    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_accum,
    int* __restrict__ dq_sem, int heads, int kv_group, int batches, int section, int seqlen_q, int seqlen_k,
    int nq_pad, float scale_log2, float scale, int rotate, const VarlenArgs& va, const Variants& var) {
  static_assert(kHeadDim * kBlockM == 8192 && (kHeadDim == 64 || kHeadDim == 128),
                "(d, kBlockM) in {(64, 128), (128, 64)}: dQ is 64 x 64 per MMA warpgroup");
  static_assert(kStages >= 2, "at least double buffering");
  constexpr int kPanels = kHeadDim / kPanel;
  constexpr int kKSteps = kHeadDim / 16;           // k16 steps of S^T and dP^T
  constexpr int kMSteps = kBlockM / 16;            // k16 steps of dV and dK (over queries)
  constexpr u64 kKPanelStep = (kBlockN * kPanel * 2) >> 4;   // descriptor units (16 B)
  constexpr u64 kQPanelStep = (kBlockM * kPanel * 2) >> 4;
  // Issue dV before computing dS^T (so the dV wgmma hides that work) only where the registers allow:
  // it keeps the in-flight packed P^T (kBlockM / 4) live beside fp32 P^T and dP^T (kBlockM each)
  // and dK, dV. d = 64, kBlockM = 128 would need 64 + 64 + 64 + 32 = 224 and spills.
  constexpr bool kWindowed = (kVariant & kWindow) != 0, kSoftcapped = (kVariant & kSoftcap) != 0;
  constexpr bool kSplit = (kVariant & kSplitMasked) != 0;  // masked / unmasked passes compiled apart
  static_assert(!kSplit || kSoftcapped, "kSplitMasked: softcap kernels (whose passes test the window inline)");
  constexpr bool kAlibied = (kVariant & kAlibi) != 0;
  constexpr bool kDropped = (kVariant & kDropout) != 0;
  static_assert(kVariant == 0 || (kVariant > 0 && (kVariant & ~kVariantBits) == 0 && !kCausal &&
                                   !(kVarlen && (kVariant & kSplitMasked) != 0)),
                "variants: a set of kWindow | kSoftcap | kAlibi | kDropout, causal folded into the window; "
                "varlen: without the split passes");
  static_assert(!kDropped || kVariant == (kDropout | kWindow), "dropout: with the window bit alone (\"Dropout\")");
  constexpr bool kOverlap = kBlockM == 64;
  static_assert(kDqMode >= 0 && kDqMode <= 2, "dQ mode: 0 RED, 1 ordered bulk (deterministic), 2 bulk");
  // Varlen only (block-scope, so the dense cubin holds no new constant): named barrier 9 (256) after
  // zeroing edge rows of K / V or of a Q / dO slot; attention_bwd_sm80.cu's kVarlenWsGap, the gap
  // between sequences in the workspaces its preprocess / convert lay out and this kernel reads.
  constexpr int kZeroBarrier = 9, kVarlenWsGap = 132;
  constexpr bool kDeterministic = kDqMode == 1, kStaged = kDqMode != 0;
  constexpr int kDqBuffers = dq_buffers<kHeadDim, kBlockM, kStages, kStaged>();
  constexpr u32 kDqTileBytes = kBlockM * kHeadDim * 4;  // one query tile of dq_accum: contiguous
  static_assert(smem_without_dq<kHeadDim, kBlockM, kStages>() + kDqBuffers * kDqTileBytes + kStaticSmem <= kSmemLimit,
                "shared memory over the 227 KB per block");

  extern __shared__ uint8_t smem_raw[];
  __shared__ uint64_t kv_full, q_full[kStages], do_full[kStages], empty[kStages];
  __shared__ int seq_smem[3];  // varlen: the sequence's first query token, Nq, Nk (see loop_nq)
  uint8_t* const smem = smem_raw + ((1024 - (s9::smem_u32(smem_raw) & 1023)) & 1023);
  u16* const sK = reinterpret_cast<u16*>(smem);                   // [kPanels][128][64]
  u16* const sV = sK + kBlockN * kHeadDim;
  u16* const sQ = sV + kBlockN * kHeadDim;                         // [kStages][kPanels][kBlockM][64]
  u16* const sdO = sQ + kStages * kBlockM * kHeadDim;
  u16* const sdS = sdO + kStages * kBlockM * kHeadDim;             // [2][kBlockM/64][128][64]
  float* const sDq = reinterpret_cast<float*>(sdS + 2 * kBlockN * kBlockM);  // [kDqBuffers][kBlockM * kHeadDim]
  float* const sLse = sDq + kDqBuffers * kBlockM * kHeadDim;                 // [kStages][kBlockM]
  float* const sDelta = sLse + kStages * kBlockM;

  // Block order (see "Block order" above): sections of `section` (kv head, batch) pairs, key block
  // slowest within a section, so every pair's key blocks start in ascending order, longest first.
  const int kv_heads = heads / kv_group;
  const int n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  const int pairs = kv_heads * batches;
  const BlockPair bp = block_pair(section, n_blocks, kv_heads, batches);
  const int n_block = bp.n_block, kv_head = bp.kv_head, batch = bp.batch;
  const int n0 = n_block * kBlockN;
  // The sequence: its first query / key token (the TMA row coordinates; dense: 0, the batch is a
  // map coordinate) and its lengths (dense: the arguments). Varlen CTAs past the last (kv head,
  // batch) pair zero the gradient rows past the last sequence; CTAs past their sequence's keys
  // (the grid covers the longest) exit before touching anything.
  int q_tok0 = 0, k_tok0 = 0, map_batch = batch;
  if constexpr (kVarlen) {
    if (blockIdx.x >= n_blocks * pairs) {
      zero_tail_rows<kHeadDim>(va, blockIdx.x - n_blocks * pairs, __ldg(va.cu_seqlens_k + batches));
      return;
    }
    q_tok0 = __ldg(va.cu_seqlens_q + batch), k_tok0 = __ldg(va.cu_seqlens_k + batch), map_batch = 0;
    seqlen_q = __ldg(va.cu_seqlens_q + batch + 1) - q_tok0;
    seqlen_k = __ldg(va.cu_seqlens_k + batch + 1) - k_tok0;
    if (n0 >= seqlen_k) return;
  }
  const int diag = seqlen_k - seqlen_q;  // query i sees keys j <= i + diag
  const int m_blocks = (seqlen_q + kBlockM - 1) / kBlockM;
  // First query tile with a query that sees key n0 (n0 <= Nk - 1, so it is < m_blocks when Nq > 0);
  // windowed: the tiles [m_first, m_end) holding the queries whose windows reach this key block
  // (window_tiles; possibly none: then dK = dV = 0). Plain kernels walk up to the last tile.
  const int2 range = kWindowed ? window_tiles<kBlockM>(n0, seqlen_q, seqlen_k, var) : make_int2(0, m_blocks);
  const int m_first = kWindowed ? range.x : kCausal ? max(0, n0 - diag) / kBlockM : 0;
  const int m_end = kWindowed ? range.y : m_blocks;
  const int m_count = m_end - m_first;  // 0 only for a varlen sequence without queries or a window: dK = dV = 0
  const int n_iters = kv_group * m_count;
  // Step `it` of the walk: query head kv_head * kv_group + it / m_count, query tiles from the last
  // down to m_first (every key block of a (b, h) reaches tile m in ascending key-block order),
  // rotated by `rot` tiles (see "Rotated walk"; 0 in the deterministic mode).
  const int rot = (kDqMode != 1 && rotate != 0 && (!(kVarlen || kWindowed) || m_count > 0)) ? n_block % m_count : 0;
  // Inside the MMA warpgroups' walk the varlen first query token and lengths are re-read from
  // shared memory where they are used (volatile ld.shared at a fixed address: neither kept live nor
  // hoisted) instead of holding registers (and cu_seqlens addresses) beside dK, dV, P^T and dS^T:
  // d = 64 spilled otherwise. Dense: the kernel arguments, as before.
  auto seq_field = [&](int i) -> int { return *reinterpret_cast<volatile int*>(&seq_smem[i]); };
  auto loop_tok0 = [&]() -> int {
    if constexpr (kVarlen) return seq_field(0); else return 0;
  };
  auto loop_nq = [&]() -> int {
    if constexpr (kVarlen) return seq_field(1); else return seqlen_q;
  };
  auto loop_nk = [&]() -> int {
    if constexpr (kVarlen) return seq_field(2); else return seqlen_k;
  };
  auto loop_diag = [&]() -> int {
    if constexpr (kVarlen) return loop_nk() - loop_nq(); else return diag;
  };
  // Row of query 0 of query head `head` in lse2 / delta (times d in dq_accum). Dense: [B, H, NqPad];
  // varlen: attention_bwd_sm80.cu's ws_row ([H, ws_pitch], `nq_pad` = ws_pitch, sequence b from
  // roundup(tok0, 4) + kVarlenWsGap b, tok0 its first query token; its queries padded to 128 rows).
  auto ws_head_row = [&](int head, int tok0) -> int64_t {
    if constexpr (kVarlen) {
      return static_cast<int64_t>(head) * nq_pad + ((tok0 + 3) & ~3) + kVarlenWsGap * batch;
    } else {
      return (static_cast<int64_t>(batch) * heads + head) * nq_pad;
    }
  };
  auto walk_head = [&](int it) { return kv_head * kv_group + it / m_count; };
  auto walk_m0 = [&](int it) {
    int step = it % m_count + rot;  // rot < m_count
    step -= step >= m_count ? m_count : 0;
    return (m_end - 1 - step) * kBlockM;
  };
  // Warp-uniform by construction (CUTLASS's canonical_warp_group_idx): ptxas keeps wg-derived
  // values (the K / V / dQ descriptors) in uniform registers instead of vector registers + R2UR.
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  if (threadIdx.x == 0) {
    init_pipeline<kStages>(tmap_q, tmap_k, tmap_v, tmap_do, kv_full, q_full, do_full, empty);
    if constexpr (kVarlen) seq_smem[0] = q_tok0, seq_smem[1] = seqlen_q, seq_smem[2] = seqlen_k;
  }
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------ producer warpgroup
    s9::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      produce<kPanels, kBlockN, kBlockM, kStages>(
          BwdTiles{sK, sV, sQ, sdO, sLse, sDelta}, tmap_q, tmap_k, tmap_v, tmap_do, lse2, delta, kv_full, q_full,
          do_full, empty, k_tok0 + n0, q_tok0, kv_head, map_batch, n_iters, [&](int it) {
            const int head = walk_head(it), m0 = walk_m0(it);
            return WalkStep{head, m0, ws_head_row(head, q_tok0) + m0};  // padded: in bounds
          });
    } else if (threadIdx.x / 32 == 1) {  // the dQ warp: staged modes only
      if constexpr (!kStaged) return;
      const int lane = threadIdx.x % 32;
      for (int it = 0; it < n_iters; ++it) {
        const int head = walk_head(it), m0 = walk_m0(it), b = it % kDqBuffers;
        s9::named_barrier_sync<kDqSyncThreads>(kDqFullBarrier + b);  // the MMA warpgroups staged tile it
        const int64_t bh = static_cast<int64_t>(batch) * heads + head;
        int* const sem = dq_sem + bh * m_blocks + m0 / kBlockM;
        if (lane == 0) {
          if constexpr (kDeterministic) {
            while (s9::ld_acquire_gpu(sem) != n_block) {  // key blocks 0 .. n_block - 1 have added tile m
            }
            s9::fence_proxy_async_global();  // the acquire before the async-proxy reduction below
          }
          s9::bulk_reduce_add_f32(dq_accum + (ws_head_row(head, q_tok0) + m0) * kHeadDim, sDq + b * kBlockM * kHeadDim,
                                  kDqTileBytes);
          s9::tma_store_commit();
          s9::tma_store_wait_read();  // staging buffer b read: the MMA warpgroups may refill it
        }
        __syncwarp();
        if (it + kDqBuffers < n_iters) s9::named_barrier_arrive<kDqSyncThreads>(kDqEmptyBarrier + b);
        if (kDeterministic && lane == 0) {  // pass the turn once the additions are done in global memory
          s9::bulk_wait_all();
          s9::fence_proxy_async_global();
          s9::fence_acq_rel_gpu();
          s9::st_release_gpu(sem, n_block + 1);
        }
        __syncwarp();  // reconverge before the next aligned bar.sync
      }
      if (lane == 0) s9::bulk_wait_all();  // mode 2: the last additions done before the CTA retires
    }
  } else {  // ------------------------------------------------------ MMA warpgroups
    s9::setmaxnreg_inc<kMmaRegs>();
    const int w = wg - 1;                              // keys [64 w, 64 w + 64) of the block
    const int tid = threadIdx.x % 128;
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int key_h0 = n0 + 64 * w + 16 * warp + g;    // key of accumulator rows h = 0 (h = 1: + 8)
    const bool key_edge = n0 + kBlockN > seqlen_k;     // the block has rows past Nk: mask them

    // K-major A operands (this warpgroup's 64 key rows of K / V) for S^T and dP^T.
    const u64 desc_k = s9::make_desc_k128_sw128(sK + 64 * w * kPanel);
    const u64 desc_v = s9::make_desc_k128_sw128(sV + 64 * w * kPanel);
    // dQ = dS K: A = panel a_panel of sdS (queries 64 a_panel..), B = panel b_panel of sK (d columns).
    const int a_panel = kBlockM == 128 ? w : 0;
    const int b_panel = kHeadDim == 128 ? w : 0;
    const u64 desc_dq_b = s9::make_desc_mn_sw128(sK + b_panel * kBlockN * kPanel, kBlockN * kPanel * 2);

    float dk[kHeadDim / 2], dv[kHeadDim / 2];
    float sp[kBlockM / 2], dp[kBlockM / 2];  // S^T then P^T; dP^T then dS^T
    u32 pf[kMSteps][4], dsf[kMSteps][4];     // packed P^T, dS^T: register-A fragments
    float dq[32];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) dk[i] = 0.f, dv[i] = 0.f;

    s9::mbar_wait(&kv_full, 0);
    if constexpr (kVarlen) {
      // The K / V box reads past the sequence's last key into the next sequence (or the buffer's
      // tail rows, which may hold anything): zero those rows, as the dense map's bound does, so
      // that S^T, dP^T, dS^T and the dQ product's K rows of keys past Nk are exact zeros.
      if (key_edge) {
        zero_tile_rows<kBlockN, kPanels>(sK, seqlen_k - n0);
        zero_tile_rows<kBlockN, kPanels>(sV, seqlen_k - n0);
        s9::fence_proxy_async();  // generic zero stores -> async-proxy wgmma reads
        s9::named_barrier_sync<256>(kZeroBarrier);
      }
    }
    // Staged dQ modes: tile it_s's st.shared of dQ go out right after its wgmma_wait<0> (the
    // accumulator registers must not be read after the next tile's wgmmas are issued: ptxas would
    // inject a wgmma.wait_group 0 there, C7517), but the proxy fence (MEMBAR.ALL.CTA, which waits
    // for those stores, + FENCE.VIEW.ASYNC.S) and the arrival on the dQ warp's "full" barrier are
    // made one tile late, after the next tile's S^T wgmmas are issued (or at the start of an idle
    // upper warpgroup's tile, or after the walk for the last tile): they leave the path from the
    // dQ wait to the next S^T issue, where the tensor cores have nothing of this warpgroup to run.
    auto publish_dq = [&](int it_s) {
      if constexpr (kStaged) {
        s9::fence_proxy_async();  // generic st.shared -> the async-proxy bulk reduction
        s9::named_barrier_arrive<kDqSyncThreads>(kDqFullBarrier + it_s % kDqBuffers);
      }
    };
    // walk_m0(it) as a running step (it % m_count + rot, mod m_count; +1 per tile mod m_count):
    // no integer division (IABS, I2F, MUFU.RCP, F2I, ~30 uniform instructions, causal) between the
    // dQ wait and the next tile's upper_idle branch / S^T issue.
    int step_c = rot;
    for (int it = 0; it < n_iters; ++it) {
      const int head = walk_head(it), m0 = (m_end - 1 - step_c) * kBlockM;
      step_c = step_c + 1 == m_count ? 0 : step_c + 1;
      const int s = it % kStages;
      const u32 parity = (it / kStages) & 1;
      if constexpr (kVarlen) {
        // The same for the Q / dO box of the sequence's last query tile: its rows past Nq are another
        // sequence's (or the tail's): zeroed, they give S^T = dP^T = 0, and with lse2 = +inf and
        // D = 0 for those rows (preprocess) P^T = dS^T = 0, so dV, dK and dQ get nothing from them.
        // Both warpgroups read the slot, so both zero it and meet before their first wgmma on it.
        const int nq = loop_nq();
        if (m0 + kBlockM > nq) {
          s9::mbar_wait(&q_full[s], parity);
          s9::mbar_wait(&do_full[s], parity);
          zero_tile_rows<kBlockM, kPanels>(sQ + s * kBlockM * kHeadDim, nq - m0);
          zero_tile_rows<kBlockM, kPanels>(sdO + s * kBlockM * kHeadDim, nq - m0);
          s9::fence_proxy_async();
          s9::named_barrier_sync<256>(kZeroBarrier);
        }
      }
      const u64 desc_q = s9::make_desc_k128_sw128(sQ + s * kBlockM * kHeadDim);
      const u64 desc_do = s9::make_desc_k128_sw128(sdO + s * kBlockM * kHeadDim);

      // Keys 64..127 of the block hidden from every query of the tile (past Nk, or causal above the
      // diagonal: d = 128's first tile m0 = n0 - diag; windowed: above every row's upper edge):
      // warpgroup 1 would compute P^T = dS^T = 0, so it only keeps the ring protocol, and dQ reads the
      // first 64 keys of sdS (its second half is stale then). Warpgroup 0's keys are never all hidden
      // by an upper edge (m_first's tile sees key n0); a window's lower edge can hide them all, and
      // warpgroup 0 then computes zeros (its keys are below warpgroup 1's, so the converse, an idle
      // warpgroup 0 beside a busy one, would need a second dQ shape for a rare edge tile).
      u16* const ds_tile = sdS + (it % 2) * kBlockN * kBlockM;
      // (The window's terms go on under if constexpr: spelled into one expression, even a false
      // `kWindowed && ...` term changed the plain kernels' instruction order.)
      bool upper_idle = n0 + 64 >= loop_nk() || (kCausal && n0 + 64 > m0 + kBlockM - 1 + loop_diag());
      if constexpr (kWindowed) upper_idle = upper_idle || n0 + 64 > m0 + kBlockM - 1 + loop_diag() + var.right;
      if (w == 1 && upper_idle) {
        if (it > 0) publish_dq(it - 1);
        s9::mbar_wait(&q_full[s], parity);
        s9::mbar_wait(&do_full[s], parity);
      } else {
        // ---- 1. S^T = K_w Q^T, dP^T = V_w dO^T
        s9::fence_accumulators(sp);
        s9::fence_accumulators(dp);
        s9::mbar_wait(&q_full[s], parity);
        s9::wgmma_fence();
        // (Spelled out rather than s9::wgmma_ss_panels: with the helper ptxas schedules these
        // kernels' SASS differently, and that SASS has not run on a GPU; the d = 256 layout's and the
        // forward's SASS are the same either way.)
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
          const u64 off_kv = (ks / 4) * kKPanelStep + 2 * (ks % 4);
          const u64 off_q = (ks / 4) * kQPanelStep + 2 * (ks % 4);
          s9::wgmma_ss<kBlockM, kIsBF16>(sp, desc_k + off_kv, desc_q + off_q, ks > 0 ? 1 : 0);
        }
        s9::wgmma_commit();
        if (it > 0) publish_dq(it - 1);  // the previous tile's dQ, under S^T
        s9::mbar_wait(&do_full[s], parity);
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
          const u64 off_kv = (ks / 4) * kKPanelStep + 2 * (ks % 4);
          const u64 off_q = (ks / 4) * kQPanelStep + 2 * (ks % 4);
          s9::wgmma_ss<kBlockM, kIsBF16>(dp, desc_v + off_kv, desc_do + off_q, ks > 0 ? 1 : 0);
        }
        s9::wgmma_commit();
        // Dropout: the tile's keep bits while the tensor cores run S^T and dP^T (the Philox rounds
        // need only integer pipes; nothing waits on them before the P^T pass).
        u32 keep[kDropped ? kBlockM / 64 : 1];
        if constexpr (kDropped) dropout_tile_bits<kBlockM>(keep, var, batch * heads + head, m0, key_h0, lane);

        // ---- 2. S^T retired (groups retire in order; with kOverlap dP^T may still run): P^T, dS^T in
        // fp32. Element 4 j + 2 h + e of the accumulators: key key_h0 + 8 h, query m0 + 8 j + 2 t + e.
        // d = 128 (kOverlap), plain and varlen kernels: the tile's lse2 fragments read before the S^T
        // wait (the slot is full since q_full), so the first FFMA / MUFU.EX2 after the wait does not
        // wait on LDS latency (+16 registers; the window + softcap variant spilled 12 bytes with it).
        constexpr bool kPreload = kOverlap && kVariant == 0;
        float2 l2_pre[kPreload ? kBlockM / 8 : 1];
        if constexpr (kPreload) {
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j)
            l2_pre[j] = *reinterpret_cast<const float2*>(sLse + s * kBlockM + 8 * j + 2 * t);
        }
        s9::wgmma_wait<kOverlap ? 1 : 0>();
        s9::fence_accumulators(sp);
        const int nk = loop_nk(), diag_t = loop_diag();  // dense: seqlen_k, diag
        // Windowed: every (query, key) of the tile is visible iff the block's first key is at or
        // above the last row's lower edge and its last key at or below the first row's upper edge.
        const bool masked = [&]() {
          if constexpr (kWindowed) {
            return key_edge ||
                   !(n0 >= m0 + kBlockM - 1 + diag_t - var.left && n0 + kBlockN - 1 <= m0 + diag_t + var.right);
          } else {
            return key_edge || (kCausal && m0 + diag_t < n0 + kBlockN - 1);
          }
        }();
        const float* lse_s = sLse + s * kBlockM;
        const float* delta_s = sDelta + s * kBlockM;
        // Element i = 4 j + 2 h + e (key key_h0 + 8 h, query m0 + 8 j + 2 t + e) is hidden iff
        // 8 j + e < lim[h]: a key past Nk hides every query (lim = kBlockM), none non-causal (0);
        // causal, key > query + diag <=> 8 j + e < key - diag - m0 - 2 t. One compare of a compile-time
        // 8 j + e per element.
        int lim[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int key = key_h0 + 8 * h;
          lim[h] = key >= nk ? kBlockM : kCausal ? key - diag_t - m0 - 2 * t : 0;
        }
        // P^T of element i; lse2 = +inf (fully masked or padding query) gives 2^-inf = 0.
        auto prob = [&](int i, float l2) {
          const float p = fast_exp2(fmaf(sp[i], scale_log2, -l2));
          return masked && 8 * (i / 4) + (i & 1) < lim[(i >> 1) & 1] ? 0.f : p;
        };
        // Variants: the logit of element i in log2 units with the fp32 operations of the Hopper
        // forward's variant_logits, in its order (softcap by softcap_tanh, else the scale; then
        // the ALiBi bias slope * |query + diag - key|, the distance as dist0 + 8 j + e - 8 h: exact
        // integers in fp32, one I2F per tile; one register for both rows h: with one per row, softcap
        // + ALiBi spilled 8 bytes under NVRTC 13.0), so that P^T = 2^(logit - lse2) recomputes the
        // forward's probabilities against its lse. `th` receives softcap's tanh (for 1 - tanh^2).
        float slope = 0.f, dist0 = 0.f;
        if constexpr (kAlibied) {
          slope = alibi_slope_log2(var, batch, head);  // one L1-resident load per tile
          dist0 = static_cast<float>(m0 + 2 * t + diag_t - key_h0);
        }
        auto vprob = [&](int i, float l2, float& th) {
          const float dist = dist0 + static_cast<float>(8 * (i / 4) + (i & 1) - 8 * ((i >> 1) & 1));
          const float p = variant_p<kVariant>(var, sp[i], scale_log2, slope, dist, l2, th);
          return !kWindowed && masked && 8 * (i / 4) + (i & 1) < lim[(i >> 1) & 1] ? 0.f : p;
        };
        // Windowed: the masks of a masked tile go on in a pass of their own over the finished P^T
        // (and dS^T) values, before they are packed: element i is visible iff key - diag - right <=
        // query <= key - diag + left (and key < Nk), i.e. hidden iff 8 j + e < lo[h] or > hi[h].
        // Inside the P^T pass the four thresholds and second compare per element made ptxas spill at
        // d = 64 (60 bytes); here they are live only beside values that are live anyway (softcap's
        // passes, which pack as they go, test inline with window_hidden). Selects, not products: a
        // hidden score may have overflowed to P^T = inf.
        auto window_hidden = [&](int i) { return window_hidden_at<kBlockM>(var, i, key_h0, nk, diag_t, m0, t); };
        auto window_mask = [&](float (&x)[kBlockM / 2], float (&y)[kBlockM / 2], bool both) {
#pragma unroll
          for (int i = 0; i < kBlockM / 2; ++i) {
            if (window_hidden(i)) {
              x[i] = 0.f;
              if (both) y[i] = 0.f;
            }
          }
        };
        // ---- 3. dV += P^T dO (register A, MN-major B); with kOverlap it runs while dS^T is computed
        const u64 desc_do_mn = s9::make_desc_mn_sw128(sdO + s * kBlockM * kHeadDim, kBlockM * kPanel * 2);
        const u64 desc_q_mn = s9::make_desc_mn_sw128(sQ + s * kBlockM * kHeadDim, kBlockM * kPanel * 2);
        auto issue_dv = [&]() {
          s9::wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kMSteps; ++kk)
            s9::wgmma_rs<kHeadDim, kIsBF16, 1>(dv, pf[kk], desc_do_mn + kk * kRowStep16, 1);
          s9::wgmma_commit();
        };
        if constexpr (kOverlap) {
          // P^T (and softcap's P^T (1 - tanh^2)) of the tile; `hide`: whether the window test runs,
          // `masked` or, for softcap, a compile-time Const (below: the unmasked tiles' pass has none).
          auto p_pass = [&](auto hide) {
#pragma unroll
            for (int j = 0; j < kBlockM / 8; ++j) {
              float2 l2;
              if constexpr (kPreload) l2 = l2_pre[j];
              else l2 = *reinterpret_cast<const float2*>(lse_s + 8 * j + 2 * t);
              if constexpr (kSoftcapped) {
                // Softcap: dS^T = P^T (dP^T - D) (1 - tanh^2) needs tanh after S^T has become P^T. So
                // this pass packs each pair of P^T for dV itself and leaves P^T (1 - tanh^2) in sp,
                // from which the dS^T pass below is the plain one; a masked tile's window test goes
                // on here, before the packing (window_hidden: window_mask's thresholds).
#pragma unroll
                for (int r2 = 0; r2 < 2; ++r2) {
                  float p[2], dcap[2];
#pragma unroll
                  for (int e = 0; e < 2; ++e) {
                    float th;
                    p[e] = vprob(4 * j + 2 * r2 + e, e ? l2.y : l2.x, th);
                    if constexpr (kWindowed) p[e] = hide && window_hidden(4 * j + 2 * r2 + e) ? 0.f : p[e];
                    dcap[e] = fmaf(-th, th, 1.f);
                  }
                  pf[j / 2][2 * (j % 2) + r2] = pack2<kIsBF16>(p[0], p[1]);  // pack_acc's pair order
                  sp[4 * j + 2 * r2] = p[0] * dcap[0];
                  sp[4 * j + 2 * r2 + 1] = p[1] * dcap[1];
                }
              } else {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                  if constexpr (kVariant != 0) {
                    float th;  // unused without softcap
                    sp[4 * j + r] = vprob(4 * j + r, (r & 1) ? l2.y : l2.x, th);
                  } else {
                    sp[4 * j + r] = prob(4 * j + r, (r & 1) ? l2.y : l2.x);
                  }
                }
              }
            }
          };
          if constexpr (kSplit) {
            if (masked) p_pass(Const<true>{});
            else p_pass(Const<false>{});
          } else {
            p_pass(masked);
          }
          if constexpr (kWindowed && !kSoftcapped) {
            if (masked) window_mask(sp, dp, false);  // dS^T = P^T (...) follows from the masked P^T
          }
          if constexpr (kDropped) {
            pack_kept<kBlockM, kIsBF16>(pf, sp, keep);  // sp keeps P^T for dS^T
          } else if constexpr (!kSoftcapped) {
            pack_acc<kMSteps, kIsBF16>(pf, sp, 1.f);
          }
          issue_dv();
          float2 dd_pre[kPreload ? kBlockM / 8 : 1];  // delta fragments read before the dP^T wait (as lse2)
          if constexpr (kPreload) {
#pragma unroll
            for (int j = 0; j < kBlockM / 8; ++j) dd_pre[j] = *reinterpret_cast<const float2*>(delta_s + 8 * j + 2 * t);
          }
          s9::wgmma_wait<1>();  // dP^T retired; dV still running
          s9::fence_accumulators(dp);
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
            float2 dd;
            if constexpr (kPreload) dd = dd_pre[j];
            else dd = *reinterpret_cast<const float2*>(delta_s + 8 * j + 2 * t);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              if constexpr (kDropped) {  // dS^T = P^T (dropped dP^T - D), as the sm80 variant backward
                const int i = 4 * j + r;
                dp[i] = sp[i] * fmaf(keep_select<kBlockM>(keep, i, dp[i]), var.drop_scale, -((r & 1) ? dd.y : dd.x));
              } else {
                dp[4 * j + r] = sp[4 * j + r] * (dp[4 * j + r] - ((r & 1) ? dd.y : dd.x));
              }
            }
          }
        } else {  // S^T and dP^T both retired: P^T and dS^T in one pass, then dV
          s9::fence_accumulators(dp);
          auto ds_pass = [&](auto hide) {  // as p_pass
#pragma unroll
            for (int j = 0; j < kBlockM / 8; ++j) {
              const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * j + 2 * t);
              const float2 dd = *reinterpret_cast<const float2*>(delta_s + 8 * j + 2 * t);
              if constexpr (kSoftcapped) {
                // Softcap: P^T and dS^T = P^T (dP^T - D) (1 - tanh^2) packed pair by pair into the
                // dV / dK operand registers (window test inline, before the packing), so each pair's
                // fp32 S^T / dP^T registers die as the pass goes: computed for the whole tile first
                // and packed after, the tanh's temporaries made d = 64 spill 168-656 bytes.
#pragma unroll
                for (int r2 = 0; r2 < 2; ++r2) {
                  float p[2], ds[2];
#pragma unroll
                  for (int e = 0; e < 2; ++e) {
                    const int i = 4 * j + 2 * r2 + e;
                    float th;
                    p[e] = vprob(i, e ? l2.y : l2.x, th);
                    if constexpr (kWindowed) p[e] = hide && window_hidden(i) ? 0.f : p[e];
                    ds[e] = p[e] * (dp[i] - (e ? dd.y : dd.x)) * fmaf(-th, th, 1.f);
                  }
                  pf[j / 2][2 * (j % 2) + r2] = pack2<kIsBF16>(p[0], p[1]);  // pack_acc's pair order
                  dsf[j / 2][2 * (j % 2) + r2] = pack2<kIsBF16>(ds[0], ds[1]);
                }
              } else {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                  if constexpr (kDropped) {  // dS^T = P^T (dropped dP^T - D), as the sm80 variant backward
                    float th;  // unused without softcap
                    const int i = 4 * j + r;
                    sp[i] = vprob(i, (r & 1) ? l2.y : l2.x, th);
                    dp[i] = sp[i] * fmaf(keep_select<kBlockM>(keep, i, dp[i]), var.drop_scale, -((r & 1) ? dd.y : dd.x));
                  } else if constexpr (kVariant != 0) {
                    float th;  // unused without softcap
                    sp[4 * j + r] = vprob(4 * j + r, (r & 1) ? l2.y : l2.x, th);
                    dp[4 * j + r] = sp[4 * j + r] * (dp[4 * j + r] - ((r & 1) ? dd.y : dd.x));
                  } else {
                    sp[4 * j + r] = prob(4 * j + r, (r & 1) ? l2.y : l2.x);
                    dp[4 * j + r] = sp[4 * j + r] * (dp[4 * j + r] - ((r & 1) ? dd.y : dd.x));
                  }
                }
              }
            }
          };
          if constexpr (kSplit) {
            if (masked) ds_pass(Const<true>{});
            else ds_pass(Const<false>{});
          } else {
            ds_pass(masked);
          }
          if constexpr (!kSoftcapped) {
            if constexpr (kWindowed) {
              if (masked) window_mask(sp, dp, true);
            }
            if constexpr (kDropped) {
              pack_kept<kBlockM, kIsBF16>(pf, sp, keep);
            } else {
              pack_acc<kMSteps, kIsBF16>(pf, sp, 1.f);
            }
            pack_acc<kMSteps, kIsBF16>(dsf, dp, 1.f);
          }
          issue_dv();
        }
        if constexpr (kOverlap) pack_acc<kMSteps, kIsBF16>(dsf, dp, 1.f);
        // dK += dS^T Q
        s9::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kMSteps; ++kk)
          s9::wgmma_rs<kHeadDim, kIsBF16, 1>(dk, dsf[kk], desc_q_mn + kk * kRowStep16, 1);
        s9::wgmma_commit();

        // ---- 4. dS^T -> sdS[it % 2]; both warpgroups' halves, then dQ_w = dS K
        store_fragments<kBlockN, kMSteps>(ds_tile, 64 * w, dsf, warp, lane);
        s9::fence_proxy_async();  // generic stmatrix writes -> async-proxy wgmma reads
      }  // warpgroup busy
      s9::named_barrier_sync<256>(kDsBarrier);
      const u64 desc_dq_a = s9::make_desc_mn_sw128(ds_tile + a_panel * kBlockN * kPanel, kBlockN * kPanel * 2);
      s9::fence_accumulators(dq);
      s9::wgmma_fence();
      // The commit goes inside each branch so that the branch's last wgmma carries it: after the
      // merge ptxas has no wgmma to attach it to and issues a dummy HGMMA.64x8x16 for it (one per
      // tile, in the SASS of 673b57e..; the seed table's backward ran without it).
      if (upper_idle) {
        issue_dq<kBlockN / 32, kIsBF16>(dq, desc_dq_a, desc_dq_b);
        s9::wgmma_commit();
      } else {
        issue_dq<kBlockN / 16, kIsBF16>(dq, desc_dq_a, desc_dq_b);
        s9::wgmma_commit();
      }

      // ---- 5. retire everything; release the slot; dQ into dq_accum
      s9::wgmma_wait<0>();
      keep_fragments<kMSteps>(pf);
      keep_fragments<kMSteps>(dsf);
      s9::fence_accumulators(dk);
      s9::fence_accumulators(dv);
      s9::fence_accumulators(dq);
      s9::mbar_arrive(&empty[s]);  // this thread's lse2 / delta reads and its warpgroup's wgmmas are done
      // Rows m0 + 64 a_panel + 16 warp + (g, g + 8), columns 64 b_panel + 8 j + 2 t + (0, 1): one
      // 16 x 8 fragment tile per j, this lane's float4 at lane * 4 (from the tile's first element).
      const int tile_off = (64 * a_panel + 16 * warp) * kHeadDim + (64 * b_panel / 8) * 128 + lane * 4;
      if constexpr (kStaged) {  // stage the tile for the dQ warp (which adds it in key-block order if ordered)
        const int b = it % kDqBuffers;
        if (it >= kDqBuffers) s9::named_barrier_sync<kDqSyncThreads>(kDqEmptyBarrier + b);
        float* const dst = sDq + b * kBlockM * kHeadDim + tile_off;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          *reinterpret_cast<float4*>(dst + j * 128) =
              make_float4(dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
        // fence + "full" arrival: publish_dq(it), one tile later
      } else {
        const int64_t row0 = ws_head_row(head, loop_tok0()) + m0;
        float* const dst = dq_accum + row0 * kHeadDim + tile_off;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          red_add_f32x4(dst + j * 128, dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
      }
    }

    if (n_iters > 0) publish_dq(n_iters - 1);  // the last tile's dQ
    // ---- epilogue: scale dK, dK / dV -> 16 bit -> rows 64 w.. of sK / sV -> TMA stores
    s9::named_barrier_sync<256>(kDoneBarrier);  // the other warpgroup's last dQ wgmma read all of sK
    {
      u32 frag[kHeadDim / 16][4];
      pack_acc<kHeadDim / 16, kIsBF16>(frag, dk, scale);
      store_fragments<kBlockN, kHeadDim / 16>(sK, 64 * w, frag, warp, lane);
      // Dropout: dV's operand held the kept P^T without 1 / (1 - p) (keep_select); the factor goes on here.
      pack_acc<kHeadDim / 16, kIsBF16>(frag, dv, [&]() {
        if constexpr (kDropped) return var.drop_scale; else return 1.f;
      }());
      store_fragments<kBlockN, kHeadDim / 16>(sV, 64 * w, frag, warp, lane);
    }
    s9::fence_proxy_async();  // generic stmatrix writes -> async-proxy TMA store
    s9::named_barrier_sync<128>(kWgBarrier + w);
    const int rows = seqlen_k - n0 - 64 * w;  // keys of this warpgroup's 64 inside the sequence
    if (kVarlen && rows > 0 && rows < 64) {
      // Varlen edge box: a TMA store would write the next sequence's rows (the map's bound is the
      // packed tensor's end): the valid rows go out by 16-byte stores instead.
      const int64_t row = k_tok0 + n0 + 64 * w;
      store_rows_masked<kPanels>(va.dk + row * va.dk_sr + kv_head * va.dk_sh, va.dk_sr, sK, 64 * w, rows, tid);
      store_rows_masked<kPanels>(va.dv + row * va.dv_sr + kv_head * va.dv_sh, va.dv_sr, sV, 64 * w, rows, tid);
    } else if (tid == 0 && n0 + 64 * w < seqlen_k) {
#pragma unroll
      for (int p = 0; p < kPanels; ++p) {
        const int off = p * kBlockN * kPanel + 64 * w * kPanel;
        s9::tma_store_4d(&tmap_dk, sK + off, p * kPanel, k_tok0 + n0 + 64 * w, kv_head, map_batch);
        s9::tma_store_4d(&tmap_dv, sV + off, p * kPanel, k_tok0 + n0 + 64 * w, kv_head, map_batch);
      }
      s9::tma_store_commit();
      s9::tma_store_wait_read();  // shared memory must stay valid until the copies have read it
    }
  }
}

// ---- d = 256: the role-split layout (attention_bwd_sm90<256, 64, kStages, ...>) -----------------
// The body above keeps dK and dV of 64 keys in each MMA warpgroup: 2 x 64 x d / 128 fp32 registers
// per thread, 256 at d = 256, more than a warpgroup has (240). Here the two MMA warpgroups split the
// work by product instead of by keys. One CTA per (64 keys, kv head, batch), 384 threads:
//   warpgroup 0 (producer)  as above: K and V once, then Q + lse2 and dO + delta per query tile.
//   role 0 (warpgroup 1)    S^T = K Q^T, P^T = 2^(S^T scale log2 e - lse2) (masked), P^T in fp32 to
//                           sP for role 1, dV += P^T dO (P^T from registers), dQ columns 0..127.
//   role 1 (warpgroup 2)    dP^T = V dO^T, dS^T = P^T (dP^T - D) (P^T read from sP), dK += dS^T Q
//                           (dS^T from registers), dS^T to sdS (stmatrix), dQ columns 128..255.
// Each role holds one 64 x 256 fp32 gradient (128 registers), its 64 x 64 S^T or dP^T (32), the
// packed P^T or dS^T (16) and dQ 64 x 128 (64): ~210 of 240 at the dQ wgmma. Tensor work per query
// tile (64 x 64 x 256 per product): role 0 S^T + dV + half of dQ, role 1 dP^T + dK + the other half:
// 2.5 products each. Role 1 waits for role 0's P^T (the exp pass runs while no wgmma of either
// role is in flight: the price of this split, measured in docs/attention_bwd_sm90.md, "d = 256").
//
// Shared memory (bytes; every 16-bit tile 128-byte swizzled [d/64 panels][rows][64], as TMA writes it):
//   sK, sV    [4][64][64]              2 x 32 KB  resident; epilogue: dK / dV staging for TMA stores
//   sQ, sdO   [kStages][4][64][64]     2 x 64 KB  rings (kStages = 2)
//   sdS       [2][64 keys][64 queries]     16 KB  dS^T, double-buffered as above
//   sP        [8][128 threads][4] fp32     16 KB  role 0's P^T in its accumulator order: role 1's
//                                                 thread i has the same (key, query) elements as
//                                                 role 0's thread i, so it reads what that thread
//                                                 wrote, 16 contiguous bytes per lane (no conflicts)
//   sLse, sDelta [kStages][64] fp32          1 KB
// 226 KB + 1 KB of alignment: no room for a staged dQ tile (64 KB), so the deterministic mode adds
// dQ by REDs in turn: per (b, h, query tile) and role one int32 counter in dq_sem ([.., 2]); the
// role's thread 0 waits until it reads n_block, the warpgroup REDs its half, syncs, and thread 0
// releases n_block + 1 (fence.acq_rel.gpu + st.release.gpu after the warpgroup's barrier, the
// pattern of CUTLASS's generic barrier). Deadlock-free for the reason the staged mode is (a key block
// waits only for lower key blocks of its pair, dispatched before it); the waits stall the MMA
// warpgroup, which is the deterministic mode's documented cost here.
// Barriers: mbarriers as above (empty[s]: 256 arrivals, every MMA thread after its last read of the
// slot); named barriers kDsBarrier (dS^T staged, 256), kDoneBarrier (walk done, 256), kWgBarrier +
// role (128), kPBarrier (P^T staged: role 0 arrives, role 1 syncs; 256). sP is single-buffered: role
// 0 writes it for tile it + 1 only after the dS barrier of tile it, which role 1 reaches after its
// reads of tile it; sdS as in the body above.
constexpr int kBlockN256 = 64;  // keys per CTA at d = 256
constexpr int kPBarrier = 10;   // named barrier: P^T of the tile staged in sP (after 9, varlen's)

template <int kStages>
__device__ constexpr int smem_d256() {
  return 2 * kBlockN256 * 256 * 2 + 2 * kStages * 64 * 256 * 2 + 2 * kBlockN256 * 64 * 2 + kBlockN256 * 64 * 4 +
         2 * kStages * 64 * 4 + 1024;
}

template <int kStages, bool kCausal, bool kIsBF16, int kDqMode, int kVariant>
__device__ __forceinline__ void attention_bwd_sm90_d256_body(
    const sm90::TmaDescriptor& tmap_q, const sm90::TmaDescriptor& tmap_k, const sm90::TmaDescriptor& tmap_v,
    const sm90::TmaDescriptor& tmap_do, const sm90::TmaDescriptor& tmap_dk, const sm90::TmaDescriptor& tmap_dv,
    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_accum,
    int* __restrict__ dq_sem, int heads, int kv_group, int batches, int section, int seqlen_q, int seqlen_k,
    int nq_pad, float scale_log2, float scale, const Variants& var) {
  constexpr int kHeadDim = 256, kBlockM = 64, kBlockN = kBlockN256;
  constexpr int kPanels = kHeadDim / kPanel;      // 4
  constexpr int kKSteps = kHeadDim / 16;          // k16 steps of S^T and dP^T
  constexpr int kMSteps = kBlockM / 16;           // k16 steps of dV and dK (queries)
  constexpr int kNSteps = kBlockN / 16;           // k16 steps of dQ (keys)
  constexpr u64 kKPanelStep = (kBlockN * kPanel * 2) >> 4;  // descriptor units (16 B)
  constexpr u64 kQPanelStep = (kBlockM * kPanel * 2) >> 4;
  constexpr bool kDeterministic = kDqMode == 1;
  static_assert(kDqMode == 0 || kDqMode == 1, "d = 256: dQ by REDs, unordered (0) or in turn (1)");
  static_assert(kStages >= 2, "at least double buffering");
  static_assert(smem_d256<kStages>() + kStaticSmem <= kSmemLimit, "shared memory over the 227 KB per block");
  // Variants ("Variants" above; the same logits, masks and dropout bits as the body above): role 0
  // computes the variant P^T; what role 1 needs of it travels in sP: P^T (1 - tanh^2) with softcap
  // (so its dS^T = sP (dP^T - D) pass is the plain one), and with dropout P^T with its sign bit set
  // where dropped (P^T >= 0; a dropped P^T = 0 gives dS^T = 0 either way).
  constexpr bool kWindowed = (kVariant & kWindow) != 0, kSoftcapped = (kVariant & kSoftcap) != 0;
  static_assert((kVariant & kSplitMasked) == 0, "kSplitMasked: the d = 64 / 128 layout only");
  constexpr bool kAlibied = (kVariant & kAlibi) != 0;
  constexpr bool kDropped = (kVariant & kDropout) != 0;
  static_assert(kVariant == 0 || (kVariant > 0 && (kVariant & ~kVariantBits) == 0 && !kCausal),
                "variants: a set of kWindow | kSoftcap | kAlibi | kDropout, causal folded into the window");
  static_assert(!kDropped || kVariant == (kDropout | kWindow), "dropout: with the window bit alone (\"Dropout\")");

  extern __shared__ uint8_t smem_raw[];
  __shared__ uint64_t kv_full, q_full[kStages], do_full[kStages], empty[kStages];
  uint8_t* const smem = smem_raw + ((1024 - (s9::smem_u32(smem_raw) & 1023)) & 1023);
  u16* const sK = reinterpret_cast<u16*>(smem);                    // [4][64][64]
  u16* const sV = sK + kBlockN * kHeadDim;
  u16* const sQ = sV + kBlockN * kHeadDim;                          // [kStages][4][64][64]
  u16* const sdO = sQ + kStages * kBlockM * kHeadDim;
  u16* const sdS = sdO + kStages * kBlockM * kHeadDim;              // [2][64][64]
  float* const sP = reinterpret_cast<float*>(sdS + 2 * kBlockN * kBlockM);  // [8][128][4]
  float* const sLse = sP + kBlockN * kBlockM;                       // [kStages][64]
  float* const sDelta = sLse + kStages * kBlockM;

  // Block order: as the body above (sections of `section` (kv head, batch) pairs, key block slowest).
  const int n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  const BlockPair bp = block_pair(section, n_blocks, heads / kv_group, batches);
  const int n_block = bp.n_block, kv_head = bp.kv_head, batch = bp.batch;
  const int n0 = n_block * kBlockN;
  const int diag = seqlen_k - seqlen_q;  // query i sees keys j <= i + diag
  const int m_blocks = (seqlen_q + kBlockM - 1) / kBlockM;
  // Query tiles [m_first, m_end) walked; windowed: those holding a query whose window reaches this
  // key block (window_tiles; possibly none: then dK = dV = 0).
  const int2 range = kWindowed ? window_tiles<kBlockM, kBlockN>(n0, seqlen_q, seqlen_k, var)
                               : make_int2(kCausal ? max(0, n0 - diag) / kBlockM : 0, m_blocks);
  const int m_first = range.x, m_end = range.y;
  const int m_count = m_end - m_first;
  const int n_iters = kv_group * m_count;
  // Step `it`: query head kv_head * kv_group + it / m_count, query tiles from the last down.
  auto walk_head = [&](int it) { return kv_head * kv_group + it / m_count; };
  auto walk_m0 = [&](int it) { return (m_end - 1 - it % m_count) * kBlockM; };
  auto ws_row = [&](int head) { return (static_cast<int64_t>(batch) * heads + head) * nq_pad; };
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  if (threadIdx.x == 0) init_pipeline<kStages>(tmap_q, tmap_k, tmap_v, tmap_do, kv_full, q_full, do_full, empty);
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------ producer warpgroup
    s9::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      produce<kPanels, kBlockN, kBlockM, kStages>(
          BwdTiles{sK, sV, sQ, sdO, sLse, sDelta}, tmap_q, tmap_k, tmap_v, tmap_do, lse2, delta, kv_full, q_full,
          do_full, empty, n0, 0, kv_head, batch, n_iters, [&](int it) {
            const int head = walk_head(it), m0 = walk_m0(it);
            return WalkStep{head, m0, ws_row(head) + m0};
          });
    }
    return;
  }
  // ------------------------------------------------------------------ MMA warpgroups (roles 0, 1)
  s9::setmaxnreg_inc<kMmaRegs>();
  const int role = wg - 1;
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int key_h0 = n0 + 16 * warp + g;  // key of accumulator rows h = 0 (h = 1: + 8)
  const bool key_edge = n0 + kBlockN > seqlen_k;
  // A of S^T (role 0: K) or dP^T (role 1: V), K-major; B of dQ: K's d panels 2 role, 2 role + 1.
  const u64 desc_kv = s9::make_desc_k128_sw128(role == 0 ? sK : sV);
  const u64 desc_dq_b0 = s9::make_desc_mn_sw128(sK + (2 * role) * kBlockN * kPanel, kBlockN * kPanel * 2);
  const u64 desc_dq_b1 = s9::make_desc_mn_sw128(sK + (2 * role + 1) * kBlockN * kPanel, kBlockN * kPanel * 2);

  float grad[kHeadDim / 2];  // role 0: dV, role 1: dK (64 keys x 256, unscaled)
  float sd[kBlockM / 2];     // role 0: S^T then P^T; role 1: dP^T then dS^T
  u32 frag[kMSteps][4];      // the packed P^T or dS^T: register-A fragments
  float dq0[32], dq1[32];    // dQ columns 128 role + (0..63, 64..127)
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) grad[i] = 0.f;

  s9::mbar_wait(&kv_full, 0);
  for (int it = 0; it < n_iters; ++it) {
    const int head = walk_head(it), m0 = walk_m0(it), s = it % kStages;
    const u32 parity = (it / kStages) & 1;
    u16* const ds_tile = sdS + (it % 2) * kBlockN * kBlockM;
    // ---- 1. S^T = K Q^T (role 0) or dP^T = V dO^T (role 1)
    s9::fence_accumulators(sd);
    s9::mbar_wait(role == 0 ? &q_full[s] : &do_full[s], parity);
    const u64 desc_in = s9::make_desc_k128_sw128((role == 0 ? sQ : sdO) + s * kBlockM * kHeadDim);
    s9::wgmma_fence();
    s9::wgmma_ss_panels<kBlockM, kIsBF16, kKSteps>(sd, desc_kv, kKPanelStep, desc_in, kQPanelStep);
    s9::wgmma_commit();
    // Dropout (role 0): the tile's keep bits while the tensor cores run S^T (one word: kBlockM = 64).
    u32 keep[1] = {0u};
    if constexpr (kDropped) {
      if (role == 0) dropout_tile_bits<kBlockM>(keep, var, batch * heads + head, m0, key_h0, lane);
    }
    s9::wgmma_wait<0>();
    s9::fence_accumulators(sd);
    // Element i = 4 j + 2 h + e of sd: key key_h0 + 8 h, query m0 + 8 j + 2 t + e.
    u64 desc_b;  // B of the register-A product: dO (dV, role 0) or Q (dK, role 1), MN-major
    if (role == 0) {
      // ---- 2a. P^T = 2^(S^T scale_log2 - lse2), hidden elements 0 (the masks of the body above:
      // element i hidden iff 8 j + e < lim[h]; windowed, window_hidden); lse2 = +inf (fully masked or
      // padding query) gives 0. Variants: the logit of the body above's vprob, in its order.
      const bool masked = [&]() {
        if constexpr (kWindowed) {
          return key_edge ||
                 !(n0 >= m0 + kBlockM - 1 + diag - var.left && n0 + kBlockN - 1 <= m0 + diag + var.right);
        } else {
          return key_edge || (kCausal && m0 + diag < n0 + kBlockN - 1);
        }
      }();
      int lim[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key = key_h0 + 8 * h;
        lim[h] = key >= seqlen_k ? kBlockM : kCausal ? key - diag - m0 - 2 * t : 0;
      }
      auto window_hidden = [&](int i) { return window_hidden_at<kBlockM>(var, i, key_h0, seqlen_k, diag, m0, t); };
      float slope = 0.f, dist0 = 0.f;
      if constexpr (kAlibied) {
        slope = alibi_slope_log2(var, batch, head);
        dist0 = static_cast<float>(m0 + 2 * t + diag - key_h0);
      }
      const float* lse_s = sLse + s * kBlockM;
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
        const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * j + 2 * t);
        float to_role1[4];  // variants: what role 1 reads from sP for elements 4 j .. 4 j + 3 (see above)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 4 * j + r;
          if constexpr (kVariant == 0) {
            const float p = fast_exp2(fmaf(sd[i], scale_log2, -((r & 1) ? l2.y : l2.x)));
            sd[i] = masked && 8 * j + (r & 1) < lim[r >> 1] ? 0.f : p;
          } else {
            float th = 0.f;
            const float dist = dist0 + static_cast<float>(8 * j + (r & 1) - 8 * (r >> 1));
            float p = variant_p<kVariant>(var, sd[i], scale_log2, slope, dist, (r & 1) ? l2.y : l2.x, th);
            const float dcap = kSoftcapped ? fmaf(-th, th, 1.f) : 1.f;
            const bool hidden = kWindowed ? masked && window_hidden(i) : masked && 8 * j + (r & 1) < lim[r >> 1];
            p = hidden ? 0.f : p;  // a select: a hidden score may have overflowed to inf
            if constexpr (kDropped) {
              const bool kept = (keep[0] >> i) & 1u;
              to_role1[r] = kept ? p : -p;
              sd[i] = kept ? p : 0.f;  // dV takes the dropped P^T (1 / (1 - p) in its epilogue)
            } else {
              to_role1[r] = p * dcap;
              sd[i] = p;
            }
          }
        }
        if constexpr (kVariant != 0)
          *reinterpret_cast<float4*>(sP + (j * 128 + tid) * 4) = make_float4(to_role1[0], to_role1[1], to_role1[2], to_role1[3]);
      }
      if constexpr (kVariant == 0) {
#pragma unroll
        for (int q4 = 0; q4 < kBlockM / 8; ++q4)
          *reinterpret_cast<float4*>(sP + (q4 * 128 + tid) * 4) =
              make_float4(sd[4 * q4], sd[4 * q4 + 1], sd[4 * q4 + 2], sd[4 * q4 + 3]);
      }
      s9::named_barrier_arrive<256>(kPBarrier);
      pack_acc<kMSteps, kIsBF16>(frag, sd, 1.f);
      s9::mbar_wait(&do_full[s], parity);
      desc_b = s9::make_desc_mn_sw128(sdO + s * kBlockM * kHeadDim, kBlockM * kPanel * 2);
    } else {
      // ---- 2b. dS^T = P^T (dP^T - D), P^T from role 0 (same thread index, same elements)
      const float* delta_s = sDelta + s * kBlockM;
      s9::named_barrier_sync<256>(kPBarrier);
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
        const float4 p = *reinterpret_cast<const float4*>(sP + (j * 128 + tid) * 4);
        const float2 dd = *reinterpret_cast<const float2*>(delta_s + 8 * j + 2 * t);
        if constexpr (kDropped) {  // dS^T = P^T (dropped dP^T / (1 - p) - D), as the body above
          const float x[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const bool kept = (__float_as_uint(x[r]) >> 31) == 0u;
            sd[4 * j + r] = fabsf(x[r]) * fmaf(kept ? sd[4 * j + r] : 0.f, var.drop_scale, -((r & 1) ? dd.y : dd.x));
          }
        } else {
          sd[4 * j] = p.x * (sd[4 * j] - dd.x);
          sd[4 * j + 1] = p.y * (sd[4 * j + 1] - dd.y);
          sd[4 * j + 2] = p.z * (sd[4 * j + 2] - dd.x);
          sd[4 * j + 3] = p.w * (sd[4 * j + 3] - dd.y);
        }
      }
      pack_acc<kMSteps, kIsBF16>(frag, sd, 1.f);
      s9::mbar_wait(&q_full[s], parity);
      desc_b = s9::make_desc_mn_sw128(sQ + s * kBlockM * kHeadDim, kBlockM * kPanel * 2);
    }
    // ---- 3. dV += P^T dO (role 0) or dK += dS^T Q (role 1): register A, N = 256 over 4 panels
    s9::fence_accumulators(grad);
    s9::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kMSteps; ++kk) s9::wgmma_rs<kHeadDim, kIsBF16, 1>(grad, frag[kk], desc_b + kk * kRowStep16, 1);
    s9::wgmma_commit();
    // ---- 4. dS^T -> sdS[it % 2] (role 1), then dQ[:, 128 role ..] = dS K[:, 128 role ..]
    if (role == 1) {
      store_fragments<kBlockN, kMSteps>(ds_tile, 0, frag, warp, lane);
      s9::fence_proxy_async();  // generic stmatrix writes -> async-proxy wgmma reads
    }
    s9::named_barrier_sync<256>(kDsBarrier);
    const u64 desc_dq_a = s9::make_desc_mn_sw128(ds_tile, kBlockN * kPanel * 2);
    s9::fence_accumulators(dq0);
    s9::fence_accumulators(dq1);
    s9::wgmma_fence();
    issue_dq<kNSteps, kIsBF16>(dq0, desc_dq_a, desc_dq_b0);
    issue_dq<kNSteps, kIsBF16>(dq1, desc_dq_a, desc_dq_b1);
    s9::wgmma_commit();
    // ---- 5. retire everything; release the slot; dQ into dq_accum (in turn when deterministic)
    s9::wgmma_wait<0>();
    keep_fragments<kMSteps>(frag);
    s9::fence_accumulators(grad);
    s9::fence_accumulators(dq0);
    s9::fence_accumulators(dq1);
    s9::mbar_arrive(&empty[s]);
    int* sem = nullptr;
    if constexpr (kDeterministic) {
      sem = dq_sem + ((static_cast<int64_t>(batch) * heads + head) * m_blocks + m0 / kBlockM) * 2 + role;
      if (tid == 0) {
        while (s9::ld_acquire_gpu(sem) != n_block) {  // key blocks 0 .. n_block - 1 have added this half
        }
      }
      s9::named_barrier_sync<128>(kWgBarrier + role);
    }
    // Rows m0 + 16 warp + (g, g + 8), columns 128 role + 64 half + 8 j + 2 t + (0, 1): fragment order.
    float* const dst = dq_accum + (ws_row(head) + m0) * kHeadDim + 16 * warp * kHeadDim + lane * 4;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      red_add_f32x4(dst + (16 * role + j) * 128, dq0[4 * j], dq0[4 * j + 1], dq0[4 * j + 2], dq0[4 * j + 3]);
      red_add_f32x4(dst + (16 * role + 8 + j) * 128, dq1[4 * j], dq1[4 * j + 1], dq1[4 * j + 2], dq1[4 * j + 3]);
    }
    if constexpr (kDeterministic) {
      s9::named_barrier_sync<128>(kWgBarrier + role);
      if (tid == 0) {
        s9::fence_acq_rel_gpu();
        s9::st_release_gpu(sem, n_block + 1);
      }
    }
  }

  // ---- epilogue: dV (role 0) or scale dK (role 1) -> 16 bit -> sV / sK -> TMA stores
  s9::named_barrier_sync<256>(kDoneBarrier);  // both roles' last dQ wgmmas read all of sK
  u16* const stage = role == 0 ? sV : sK;
  {
    u32 out[kHeadDim / 16][4];
    pack_acc<kHeadDim / 16, kIsBF16>(out, grad, role == 0 ? (kDropped ? var.drop_scale : 1.f) : scale);
    store_fragments<kBlockN, kHeadDim / 16>(stage, 0, out, warp, lane);
  }
  s9::fence_proxy_async();  // generic stmatrix writes -> async-proxy TMA store
  s9::named_barrier_sync<128>(kWgBarrier + role);
  if (tid == 0) {
    const sm90::TmaDescriptor* map = role == 0 ? &tmap_dv : &tmap_dk;
#pragma unroll
    for (int p = 0; p < kPanels; ++p) s9::tma_store_4d(map, stage + p * kBlockN * kPanel, p * kPanel, n0, kv_head, batch);
    s9::tma_store_commit();
    s9::tma_store_wait_read();
  }
}
}  // namespace bwd90

// Dense [B, H, N, d] batches (see above for the arguments).
template <int kHeadDim, int kBlockM, int kStages, bool kCausal, bool kIsBF16, int kDqMode>
__global__ void __launch_bounds__(bwd90::kThreads, 1)
    attention_bwd_sm90(const __grid_constant__ sm90::TmaDescriptor tmap_q,
                       const __grid_constant__ sm90::TmaDescriptor tmap_k,
                       const __grid_constant__ sm90::TmaDescriptor tmap_v,
                       const __grid_constant__ sm90::TmaDescriptor tmap_do,
                       const __grid_constant__ sm90::TmaDescriptor tmap_dk,
                       const __grid_constant__ sm90::TmaDescriptor tmap_dv, const float* __restrict__ lse2,
                       const float* __restrict__ delta, float* __restrict__ dq_accum, int* __restrict__ dq_sem,
                       int heads, int kv_group, int batches, int section,
                       int seqlen_q, int seqlen_k, int nq_pad, float scale_log2, float scale, int rotate) {
  if constexpr (kHeadDim == 256) {  // the role-split layout ("d = 256"); no rotated walk
    static_assert(kBlockM == 64, "d = 256: 64-query tiles");
    bwd90::attention_bwd_sm90_d256_body<kStages, kCausal, kIsBF16, kDqMode, 0>(
        tmap_q, tmap_k, tmap_v, tmap_do, tmap_dk, tmap_dv, lse2, delta, dq_accum, dq_sem, heads, kv_group, batches,
        section, seqlen_q, seqlen_k, nq_pad, scale_log2, scale, Variants{});
  } else {
    bwd90::attention_bwd_sm90_body<kHeadDim, kBlockM, kStages, kCausal, kIsBF16, kDqMode, false, 0>(
        tmap_q, tmap_k, tmap_v, tmap_do, tmap_dk, tmap_dv, lse2, delta, dq_accum, dq_sem, heads, kv_group, batches,
        section, seqlen_q, seqlen_k, nq_pad, scale_log2, scale, rotate, bwd90::VarlenArgs{}, Variants{});
  }
}

// Dense batches with variants (kVariant: a non-empty set of bits bwd90::kWindow, kSoftcap, kAlibi,
// or kWindow | kDropout, the latter with or without kRngState; see "Variants" above): the dense kernel's
// parameters, then VARIANT_PARAMS
// (common/variants.cuh; causal folded into win_right; seed, offset, drop_thr, drop_scale read only
// by kDropout instantiations, which must get the forward's). lse2 must come from the
// variant logits' lse (natural log, as the Hopper forward and the sm80 variant forward write it),
// converted by the preprocess as for the plain kernel.
template <int kHeadDim, int kBlockM, int kStages, bool kIsBF16, int kDqMode, int kVariant>
__global__ void __launch_bounds__(bwd90::kThreads, 1)
    attention_bwd_sm90_variants(const __grid_constant__ sm90::TmaDescriptor tmap_q,
                                const __grid_constant__ sm90::TmaDescriptor tmap_k,
                                const __grid_constant__ sm90::TmaDescriptor tmap_v,
                                const __grid_constant__ sm90::TmaDescriptor tmap_do,
                                const __grid_constant__ sm90::TmaDescriptor tmap_dk,
                                const __grid_constant__ sm90::TmaDescriptor tmap_dv, const float* __restrict__ lse2,
                                const float* __restrict__ delta, float* __restrict__ dq_accum,
                                int* __restrict__ dq_sem, int heads, int kv_group, int batches, int section,
                                int seqlen_q, int seqlen_k, int nq_pad, float scale_log2, float scale, int rotate,
                                VARIANT_PARAMS) {
  static_assert(kVariant > 0 && (kVariant & ~bwd90::kVariantBits) == 0,
                "kVariant: a non-empty set of kWindow | kSoftcap | kAlibi | kDropout");
  constexpr bool kRngState = (kVariant & bwd90::kRngState) != 0;
  static_assert(!kRngState || (kVariant & bwd90::kDropout) != 0, "kRngState: a dropout kernel's");
  constexpr int kBodyVariant = kVariant & ~bwd90::kRngState;
  if constexpr (kHeadDim == 256) {  // the role-split layout ("d = 256"); no rotated walk
    static_assert(kBlockM == 64, "d = 256: 64-query tiles");
    bwd90::attention_bwd_sm90_d256_body<kStages, false, kIsBF16, kDqMode, kBodyVariant>(
        tmap_q, tmap_k, tmap_v, tmap_do, tmap_dk, tmap_dv, lse2, delta, dq_accum, dq_sem, heads, kv_group, batches,
        section, seqlen_q, seqlen_k, nq_pad, scale_log2, scale, resolved_variants<kRngState>(VARIANTS_FROM_PARAMS));
  } else {
    bwd90::attention_bwd_sm90_body<kHeadDim, kBlockM, kStages, false, kIsBF16, kDqMode, false, kBodyVariant>(
        tmap_q, tmap_k, tmap_v, tmap_do, tmap_dk, tmap_dv, lse2, delta, dq_accum, dq_sem, heads, kv_group, batches,
        section, seqlen_q, seqlen_k, nq_pad, scale_log2, scale, rotate, bwd90::VarlenArgs{},
        resolved_variants<kRngState>(VARIANTS_FROM_PARAMS));
  }
}

// Packed variable-length batches: q, dout [Tq, H, d], k, v, dk, dv [Tk, Hkv, d], sequence b at
// tokens cu_seqlens_q[b] / cu_seqlens_k[b] (int32 [B + 1]), causal aligned bottom-right per
// sequence. Maps as the dense ones over a [1, H, T, d] view (batch coordinate 0, the row
// coordinate starts at the sequence's first token); dk, dv also as raw pointers with their head /
// token strides (edge boxes and the tail rows are stored without TMA). lse2 / delta / dq_accum:
// attention_bwd_sm80.cu's varlen workspaces, ws_pitch rows per head. Grid: ceil(max_seqlen_k /
// 128) x Hkv x B CTAs in the dense block order, then Hkv CTAs that zero the rows of dk / dv past
// the last sequence (Tk = total_k). dQ modes 0 and 2 (the deterministic varlen backward is the
// sm80 kernels').
template <int kHeadDim, int kBlockM, int kStages, bool kCausal, bool kIsBF16, int kDqMode>
__global__ void __launch_bounds__(bwd90::kThreads, 1)
    attention_bwd_sm90_varlen(const __grid_constant__ sm90::TmaDescriptor tmap_q,
                              const __grid_constant__ sm90::TmaDescriptor tmap_k,
                              const __grid_constant__ sm90::TmaDescriptor tmap_v,
                              const __grid_constant__ sm90::TmaDescriptor tmap_do,
                              const __grid_constant__ sm90::TmaDescriptor tmap_dk,
                              const __grid_constant__ sm90::TmaDescriptor tmap_dv, const float* __restrict__ lse2,
                              const float* __restrict__ delta, float* __restrict__ dq_accum,
                              const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
                              u16* __restrict__ dk, u16* __restrict__ dv, int64_t dk_sh, int64_t dk_sr,
                              int64_t dv_sh, int64_t dv_sr, int heads, int kv_group, int batches, int section,
                              int max_seqlen_k, int total_k, int ws_pitch, float scale_log2, float scale,
                              int rotate) {
  static_assert(kDqMode != 1, "the deterministic varlen backward runs on the sm80 kernels");
  const bwd90::VarlenArgs va{cu_seqlens_q, cu_seqlens_k, dk, dv, dk_sh, dk_sr, dv_sh, dv_sr, total_k};
  bwd90::attention_bwd_sm90_body<kHeadDim, kBlockM, kStages, kCausal, kIsBF16, kDqMode, true, 0>(
      tmap_q, tmap_k, tmap_v, tmap_do, tmap_dk, tmap_dv, lse2, delta, dq_accum, nullptr, heads, kv_group, batches,
      section, 0, max_seqlen_k, ws_pitch, scale_log2, scale, rotate, va, Variants{});
}

// Packed variable-length batches with variants (kVariant: kWindow with any of kSoftcap, kAlibi, or
// kWindow | kDropout with or without kRngState; no split passes): the varlen kernel's parameters,
// then VARIANT_PARAMS (causal folded into win_right; ALiBi slopes [B, H] by sequence). The walk reads
// each sequence's lengths as the plain varlen kernel does, so the window's tile range (window_tiles)
// and every per-score test take the sequence's own Nq, Nk and diag, and the dropout keep bits the
// sequence index as the batch and positions inside the sequence (the varlen mask's rule). lse2 from
// the variant forward's lse, as the dense variant kernel's.
template <int kHeadDim, int kBlockM, int kStages, bool kIsBF16, int kDqMode, int kVariant>
__global__ void __launch_bounds__(bwd90::kThreads, 1)
    attention_bwd_sm90_varlen_variants(const __grid_constant__ sm90::TmaDescriptor tmap_q,
                                       const __grid_constant__ sm90::TmaDescriptor tmap_k,
                                       const __grid_constant__ sm90::TmaDescriptor tmap_v,
                                       const __grid_constant__ sm90::TmaDescriptor tmap_do,
                                       const __grid_constant__ sm90::TmaDescriptor tmap_dk,
                                       const __grid_constant__ sm90::TmaDescriptor tmap_dv,
                                       const float* __restrict__ lse2, const float* __restrict__ delta,
                                       float* __restrict__ dq_accum, const int* __restrict__ cu_seqlens_q,
                                       const int* __restrict__ cu_seqlens_k, u16* __restrict__ dk,
                                       u16* __restrict__ dv, int64_t dk_sh, int64_t dk_sr, int64_t dv_sh,
                                       int64_t dv_sr, int heads, int kv_group, int batches, int section,
                                       int max_seqlen_k, int total_k, int ws_pitch, float scale_log2, float scale,
                                       int rotate, VARIANT_PARAMS) {
  static_assert(kDqMode != 1, "the deterministic varlen backward runs on the sm80 kernels");
  constexpr bool kRngState = (kVariant & bwd90::kRngState) != 0;
  constexpr int kBodyVariant = kVariant & ~bwd90::kRngState;
  static_assert((kBodyVariant & bwd90::kWindow) != 0 &&
                    ((kBodyVariant & ~(bwd90::kWindow | bwd90::kSoftcap | bwd90::kAlibi)) == 0 ||
                     kBodyVariant == (bwd90::kWindow | bwd90::kDropout)) &&
                    (!kRngState || (kVariant & bwd90::kDropout) != 0),
                "kVariant: kWindow with any of kSoftcap, kAlibi, or kWindow | kDropout (kRngState: with dropout)");
  const bwd90::VarlenArgs va{cu_seqlens_q, cu_seqlens_k, dk, dv, dk_sh, dk_sr, dv_sh, dv_sr, total_k};
  bwd90::attention_bwd_sm90_body<kHeadDim, kBlockM, kStages, false, kIsBF16, kDqMode, true, kBodyVariant>(
      tmap_q, tmap_k, tmap_v, tmap_do, tmap_dk, tmap_dv, lse2, delta, dq_accum, nullptr, heads, kv_group, batches,
      section, 0, max_seqlen_k, ws_pitch, scale_log2, scale, rotate, va, resolved_variants<kRngState>(VARIANTS_FROM_PARAMS));
}

}  // namespace tileattn
