// Fused attention forward, FlashAttention-2 style, on the sm_80 tensor-core path (mma.sync
// m16n8k16 + ldmatrix + cp.async). Also the baseline kernel on Hopper (sm_90a) until the
// wgmma/TMA kernel lands.
//
//   O[b, h, i, :] = sum_j softmax_j(scale * Q[b, h, i, :] . K[b, h / kv_group, j, :]) V[b, h / kv_group, j, :]
//   lse[b, h, i]  = log sum_j exp(scale * Q[b, h, i, :] . K[b, h / kv_group, j, :])   (natural log)
//
// Causal masking is aligned bottom-right: query i sees key j iff j <= i + Nk - Nq. A query that
// sees no key at all (causal with Nq > Nk) gets O = 0 and lse = -inf, never NaN.
//
// ---- Work decomposition -------------------------------------------------------------------------
// grid = (ceil(Nq / kBlockM), heads, batch); one CTA owns a kBlockM x kHeadDim tile of Q and O.
// kWarps warps split the tile by rows: warp w owns rows [w * kRowsPerWarp, (w + 1) * kRowsPerWarp),
// kRowsPerWarp = 16 * kMTiles (one or two m16 mma tiles). Every warp walks all K/V blocks of
// kBlockN keys; nothing about the softmax is shared between warps (a row lives in one warp), so
// the only CTA-wide synchronisation is the one barrier per K/V block that guards the smem ring.
//
// ---- Per-thread register budget (fp32 = one 32-bit register per element) ----------------------
// For a warp that owns R = 16 * kMTiles rows, with d = kHeadDim and N = kBlockN:
//   O accumulator  R * d / 32 regs   (d=128: 64 per m-tile)             lives for the whole CTA
//   S = Q K^T      R * N / 32 regs   (N=32: 16 per m-tile)              lives for one K/V block
//   P (16-bit)     S / 2 regs, packed from S two columns at a time while S dies
//   Q fragments    R * d / 64 regs when held in registers (kQInRegs: one m-tile and d <= 128),
//                  otherwise re-read from smem with ldmatrix for every K block (2 m-tiles or d=256)
//   K/V fragments  4 regs per ldmatrix.x4 in flight (ptxas keeps ~1 k-step of them ahead)
//   softmax state  shift + partial sum per row half per m-tile: 4 * kMTiles
//   ldmatrix address: one XOR-able address per operand (LdsmLane), a few loop counters
// d=128 default (kBlockM=128, 4 warps -> R=32, N=32): O 128 + S 32 + Q/K fragments ~16-24 + the
// rest -> 229-240 of the 255 that __launch_bounds__(128, 1) allows; 2 CTAs (8 warps) fit in the
// 64K-register file. N=64 at R=32 (FA2's tile) needs O 128 + S 64: it compiles to 255 registers
// with 0 spills only because nothing CTA-specific lives in per-thread registers across the loop
// (kv_head by multiply-shift in uniform registers, blockIdx re-read on sm_80, see cta_id), the
// ldmatrix offsets are one register per pattern, and the softmax needs no per-row select.
// Thread-specific address arithmetic is re-derived inside the main loop from an opaque thread
// index (see opaque()): a few integer ops per block instead of registers held across the loop.
// ptxas must report 0 spills and 0 stack for every registered instantiation (`tileattn check`,
// sm_90a and sm_80).
//
// ---- Shared memory ----------------------------------------------------------------------------
//   sQ  [kBlockM][d]            Q tile, loaded once; reused to stage O for coalesced 16-B stores
//   sK  [kStages][kBlockN][d]   ring of K blocks (cp.async, kStages - 1 blocks in flight)
//   sV  [kStages][kBlockN][d]   ring of V blocks (same commit group as the K block)
// bytes = 2 * d * (kBlockM + 2 * kStages * kBlockN). d=128 default: 32 KB + 32 KB = 64 KB -> three
// CTAs' worth of smem per SM on an H100/H200 (228 KB); registers cap it at two. The Python side
// computes the same number (FwdConfig.smem_bytes).
//
// ---- Bank conflicts: XOR swizzle of 16-byte chunks ---------------------------------------------
// A row of d 16-bit elements is C = d / 8 chunks of 16 bytes. ldmatrix and cp.async both move
// 16-byte chunks, and a warp's shared-memory access is served 8 chunks (128 B = 32 banks) per
// phase. ldmatrix reads the same logical chunk c of 8 consecutive rows; with a plain row-major
// layout and a row pitch that is a multiple of 128 B, those 8 chunks sit in the same 4 banks
// (8-way conflict). We store chunk c of row r at position c ^ f(r) inside its row:
//   C % 8 == 0 (d = 64, 128, 256): f(r) = r & 7 -> the 8 rows hit 8 different chunk slots of the
//                                   128-byte bank window.
//   C == 4     (d = 32, 64-B rows): two rows share a 128-B window, so f(r) = (r >> 1) & 3 and the
//                                   row parity supplies the fourth bit.
//   C == 12    (d = 96, 192-B rows): chunks 0..7 use r & 7, chunks 8..11 use (r >> 1) & 3 (rows
//                                   start at 0 or 64 B mod 128). ldmatrix is conflict-free; some
//                                   cp.async phases that straddle two rows are 2-way (writes only).
// The swizzle permutes chunks inside a row, so a warp's cp.async writes of 8 consecutive chunks of
// one row and the epilogue's 16-B reads stay conflict-free too. No padding, so no smem is wasted.
// The tile type (SwizzledTile<d, false>), the loaders and the ldmatrix lane addresses (LdsmLane)
// are the shared sm_80 building blocks of common/sm80_tile.cuh. The kernel traps when it is
// launched with less dynamic shared memory than the tiles need, or with a base that is not 1 KB
// aligned (LdsmLane XORs chunk bits into absolute shared addresses).
//
// ---- Pipeline -------------------------------------------------------------------------------
// K/V blocks are visited from the last one down to the first (as FA2 does): the blocks that need
// masking (the Nk edge block and, when causal, the blocks crossing the diagonal) come first, and
// the loop runs `n_masked` masked iterations followed by unmasked ones. Iteration `it`:
//   cp.async.wait_group(kStages - 2); __syncthreads()   K/V block `it` has landed for every thread,
//                                                       and every warp is done with block it - 1
//   issue cp.async for block it + kStages - 1 into the slot block it - 1 used; commit
//   S = Q K^T (mma), mask (first n_masked iterations only), online softmax, O += P V (mma)
// so kStages - 1 blocks are in flight while one is consumed, with one barrier per block. Commit
// groups: Q, then one per K/V block (K and V together), empty groups past the end, so "block `it`
// has landed" is always wait_group(kStages - 2). Only the first block visited can be partial: the
// prologue loads with row bounds checks and zero fill (load_tile_async), the main loop without
// (load_tile_full_async, 32-bit per-thread offsets: the host guarantees row_stride(K, V) < 2^24).
//
// ---- Online softmax (fp32, base 2) ------------------------------------------------------------
// scale_log2 = scale * log2(e) is folded into one FFMA per score: p = 2^(s * scale_log2 - shift),
// shift = (running row max of s) * scale_log2. The shift only moves (and O, l are rescaled) when
// some row of the warp would otherwise see p > 2^8 (warp vote): a stale max is exact because the
// same shift is used for O, l and lse, and p <= 256 is far from fp16/bf16 overflow. After the
// first block this skips almost every O rescale (64-128 FMULs per thread per block).
// A row that has seen no key keeps shift = -inf; its exponent uses 0 instead, so its all -inf
// scores give p = 0 (never -inf - -inf = NaN), and its rescale factor is 0 (O and l are still 0).
// Extreme logits stay exact: scores are fp32 (|s| ~ 1e4 is fine) and every p is <= 2^8.
// The final row sum l = 0 marks a fully masked row: O = 0, lse = -inf; otherwise
// lse = (shift + log2 l) * ln 2 (natural log, what the backward expects).
#include "common/sm80_tile.cuh"
#include "common/variants.cuh"
#include "common/varlen.cuh"

namespace tileattn {
namespace fwd {

// Largest growth of the row max (in log2 units) that is absorbed without rescaling O.
constexpr float kRescaleThreshold = 8.0f;
// Row shift of a row that has seen no key yet: a finite -2^100 instead of -inf, so that
// s * scale_log2 - shift never computes -inf - -inf (no select per row per block) and the rescale
// factor 2^(shift_old - shift_new) is exactly 0 on a row's first visible key (ex2 underflows;
// O and l are still 0 there) and exactly 1 while the row still sees nothing. Any real scaled score
// is > -2^100 (|s| <= ~1e30 would already have overflowed the fp32 dot product by then), so the
// first visible key always beats the sentinel by more than kRescaleThreshold and triggers the
// rescale that replaces it.
constexpr float kNoKeyShift = -1.2676506002282294e30f;  // -2^100

// blockIdx. On sm_80 it is re-read from the special registers at each call (asm volatile: never
// CSE'd): there ptxas reads %ctaid into per-thread registers (S2R), so (batch, head, query tile)
// and the 64-bit pointers derived from them would otherwise stay live across the main loop;
// re-reading them where they are needed (the prefetch, the mask, the epilogue) costs an S2R and a
// few IMADs instead.
struct CtaId {
  int m_block, head, batch;
};
template <bool kCausal>
__device__ __forceinline__ CtaId cta_id() {
  unsigned x, y, z, nx;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // sm_90: ptxas keeps blockIdx and everything derived from it in uniform registers (S2UR), free
  // for the per-thread register file; a volatile re-read would force per-thread copies instead.
  x = blockIdx.x, y = blockIdx.y, z = blockIdx.z, nx = gridDim.x;
#else
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
  asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(y));
  asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(nx));
#endif
  // Causal: the last query tiles see the most keys. Blocks are dispatched roughly in blockIdx
  // order, so hand out the query tiles last-to-first: the long CTAs start in the first wave and
  // the short ones fill the tail (without this, the heaviest CTAs of the last heads run alone).
  return {kCausal ? static_cast<int>(nx - 1 - x) : static_cast<int>(x), static_cast<int>(y), static_cast<int>(z)};
}

// Variant kernels: S = Q K^T of K/V block n (mma accumulator layout: rows g, g + 8 of each m-tile,
// keys 2t, 2t + 1 of each n8 block) -> logits in log2 units: softcap or scale, ALiBi bias, and -inf
// outside each row's window (and past Nk). A block inside every row's window needs no per-score
// test. The thread index is opaque (re-derived here, as in the main loop) and the CTA's indices are
// re-read: nothing of this lives across the loop.
template <int kMTiles, int kNBlocks, int kBlockM, int kBlockN, int kRowsPerWarp>
__device__ __forceinline__ void apply_variants(float (&s_acc)[kMTiles][kNBlocks][4], const Variants& va, int n,
                                               int seqlen_q, int seqlen_k, int tid_l) {
  const int lane = tid_l & 31, g = lane >> 2, t = lane & 3;
  const CtaId c = cta_id<true>();  // the variant kernels hand out query tiles last-to-first
  const int row_t = c.m_block * kBlockM;  // first row of the tile
  const int diag = seqlen_k - seqlen_q;
  const int key_b = n * kBlockN;
  const bool inside = key_b >= window_lo(va, min(row_t + kBlockM, seqlen_q) - 1, diag) &&
                      key_b + kBlockN - 1 <= window_hi(va, row_t, diag, seqlen_k);
  const float slope = alibi_slope_log2(va, c.batch, c.head);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_t + (tid_l >> 5) * kRowsPerWarp + mt * 16 + g + 8 * h;
      const int lo = row + diag - va.left, hi = min(seqlen_k - 1, row + diag + va.right);
#pragma unroll
      for (int nb = 0; nb < kNBlocks; ++nb)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = key_b + nb * 8 + 2 * t + e;
          float x = variant_logit(va, s_acc[mt][nb][2 * h + e]);
          if (va.alibi != nullptr) x = fmaf(slope, static_cast<float>(abs(row + diag - j)), x);
          if (!inside && (j < lo || j > hi)) x = neg_inf();
          s_acc[mt][nb][2 * h + e] = x;
        }
    }
}

}  // namespace fwd

// q: [B, H, Nq, d], k/v: [B, H / kv_group, Nk, d], o: [B, H, Nq, d] (16-bit, strides in elements,
// last dim contiguous, 16-byte aligned rows); lse: [B, H, Nq] fp32 contiguous, natural log.
// kv_group_magic = ceil(2^32 / kv_group): h / kv_group = (h * magic) >> 32 exactly for h, kv_group
// < 2^16 (the error term h * (magic * kv_group - 2^32) / 2^32 < 1 / kv_group). A division by a
// runtime value goes through MUFU.RCP, which has no uniform-datapath form, so `head / kv_group`
// put kv_head and the 64-bit K/V head offsets into per-thread registers for the whole main loop
// (4 registers: the difference between spilling and not at 32 rows x BN = 64). The multiply-shift
// stays in uniform registers.
//
// The body serves both entry points below: dense batches (kVarlen = false) and packed variable-
// length batches (kVarlen = true, see common/varlen.cuh: sequence b's tokens start at
// cu_seqlens_q[b] / cu_seqlens_k[b]; the batch strides are 0; lse is [H, total_q]).
//
// kVariants: the variant kernels (common/variants.cuh): window (causal is its right edge 0, so they
// are built with kCausal = false), softcap, ALiBi and dropout from `va`, all chosen at run time.
// Scores become log2-unit logits right after S = Q K^T, so the softmax below runs with scale 1.
template <int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kCausal, bool kIsBF16, bool kVarlen,
          bool kVariants = false>
__device__ __forceinline__ void attention_fwd_body(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o,
    float* __restrict__ lse, int64_t q_sb, int64_t q_sh, int64_t q_sr, int64_t k_sb, int64_t k_sh, int64_t k_sr,
    int64_t v_sb, int64_t v_sh, int64_t v_sr, int64_t o_sb, int64_t o_sh, int64_t o_sr, int heads,
    uint64_t kv_group_magic, int seqlen_q_arg, int seqlen_k_arg, float scale_log2, const int* __restrict__ cu_seqlens_q,
    const int* __restrict__ cu_seqlens_k, int total_q, const Variants& va) {
  using namespace fwd;
  constexpr int kThreads = kWarps * 32;
  constexpr int kRowsPerWarp = kBlockM / kWarps;
  constexpr int kMTiles = kRowsPerWarp / 16;  // m16 tiles per warp
  constexpr int kChunks = kHeadDim / 8;       // 16-byte chunks per row
  constexpr int kKSteps = kHeadDim / 16;      // k16 steps of S = Q K^T
  constexpr int kNBlocks = kBlockN / 8;       // n8 blocks of S
  constexpr int kPSteps = kBlockN / 16;       // k16 steps of O += P V
  constexpr int kDBlocks = kHeadDim / 8;      // n8 blocks of O
  constexpr bool kQInRegs = kMTiles == 1 && kHeadDim <= 128;
  static_assert(kHeadDim == 32 || kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 256,
                "unsupported head dim");
  static_assert(kBlockM % (16 * kWarps) == 0 && (kMTiles == 1 || kMTiles == 2), "16 or 32 rows per warp");
  static_assert(kBlockN % 16 == 0 && kStages >= 2, "kBlockN multiple of 16, at least double buffering");
  static_assert((kRowsPerWarp * kChunks) % 32 == 0, "epilogue: whole chunks per lane");
  static_assert(!kVariants || (!kCausal && kBlockN % 32 == 0), "variants: causal is a window; dropout bits per 32 keys");
  // Logits of the variant kernels are already scaled (log2 units) when the softmax sees them.
  const float sl2 = kVariants ? 1.f : scale_log2;
  // Query tiles last-to-first (see cta_id): causal, and the variant kernels (a causal window makes
  // the first tiles lighter; for equal tiles the order is irrelevant).
  constexpr bool kReverse = kCausal || kVariants;
  // Unpadded rows (d = 96: 12 chunks, the split swizzle) keep d = 96 at 72 KB per CTA.
  using Tile = SwizzledTile<kHeadDim, false>;
  // Power-of-two pitches (every d but 96) step ldmatrix chunk pairs by XOR; d = 96 keeps a table.
  constexpr bool kXor = Tile::kXorPitch;
  constexpr int kTileQ = Tile::bytes(kBlockM), kTileKV = Tile::bytes(kBlockN);
  static_assert(kTileQ % 1024 == 0 && kTileKV % 1024 == 0, "tiles start on 1 KB boundaries");

  extern __shared__ __align__(1024) char smem[];
  check_dynamic_smem(smem, kTileQ + 2 * kStages * kTileKV);
  const u32 sQ = smem_addr(smem);              // [kBlockM][kHeadDim], swizzled
  const u32 sK = sQ + kTileQ;                  // [kStages][kBlockN][kHeadDim], swizzled
  const u32 sV = sK + kStages * kTileKV;       // [kStages][kBlockN][kHeadDim], swizzled

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const CtaId cta = cta_id<kReverse>();
  const int head = cta.head;
  const int batch = cta.batch;
  const int kv_head = static_cast<int>((static_cast<uint64_t>(head) * kv_group_magic) >> 32);
  const int row0 = cta.m_block * kBlockM;
  const int warp_row0 = warp * kRowsPerWarp;  // first row of this warp inside the tile
  // This sequence's lengths (and, varlen, its first tokens). The varlen grid covers the longest
  // sequence: tiles past this one's end (all of them for an empty sequence) have nothing to do.
  const SeqSpan span = seq_span<kVarlen>(cu_seqlens_q, cu_seqlens_k, batch, seqlen_q_arg, seqlen_k_arg);
  const int seqlen_q = span.nq, seqlen_k = span.nk;
  if (kVarlen && row0 >= seqlen_q) return;

  const u16* const q_g = q + batch * q_sb + span.q0 * q_sr + head * q_sh;       // [Nq, d] of this (b, h)
  const u16* const k_g = k + batch * k_sb + span.k0 * k_sr + kv_head * k_sh;    // [Nk, d]
  const u16* const v_g = v + batch * v_sb + span.k0 * v_sr + kv_head * v_sh;    // [Nk, d]
  u16* const o_g = o + batch * o_sb + span.q0 * o_sr + head * o_sh;             // [Nq, d]
  float* const lse_g = kVarlen ? lse + static_cast<int64_t>(head) * total_q + span.q0  // [Nq]
                               : lse + (static_cast<int64_t>(batch) * heads + head) * seqlen_q;

  // ---- Which K/V blocks this query tile visits, and how many of them need masking -------------
  const int n_total = (seqlen_k + kBlockN - 1) / kBlockN;
  int n_end = n_total;                                  // visit blocks [n_begin, n_end)
  int n_begin = 0;
  int n_masked = (seqlen_k % kBlockN) != 0 ? 1 : 0;     // the Nk edge block is visited first
  const int diag = seqlen_k - seqlen_q;                 // query i sees keys j <= i + diag
  if constexpr (kCausal || kVariants) {
    const int last_row = min(row0 + kBlockM, seqlen_q) - 1;
    // Keys any row of the tile sees: [key_lo, key_hi] (windows move monotonically with the row).
    const int key_hi = kVariants ? window_hi(va, last_row, diag, seqlen_k) : last_row + diag;
    const int key_lo = kVariants ? window_lo(va, row0, diag) : 0;
    if (key_hi < key_lo) {
      // Every row of the tile is fully masked: O = 0, lse = -inf. No smem, no mma.
      const int rows = last_row - row0 + 1;
      for (int id = tid; id < rows * kChunks; id += kThreads) {
        const int r = id / kChunks, c = id % kChunks;
        *reinterpret_cast<uint4*>(o_g + (row0 + r) * o_sr + c * 8) = make_uint4(0u, 0u, 0u, 0u);
      }
      for (int r = tid; r < rows; r += kThreads) lse_g[row0 + r] = neg_inf();
      return;
    }
    n_end = min(n_total, key_hi / kBlockN + 1);
    if constexpr (kVariants) {
      n_begin = key_lo / kBlockN;  // blocks below the window are skipped: cost scales with the window
    } else {
      // Block n is unmasked for the whole tile iff its last key n * kBlockN + kBlockN - 1 is visible
      // to the tile's first row, i.e. <= row0 + diag.
      const int first_limit = row0 + diag;
      const int n_unmasked = first_limit + 1 <= 0 ? 0 : (first_limit + 1) / kBlockN;
      const int edge = (n_end == n_total) ? n_masked : 0;
      n_masked = max(n_end - n_unmasked, edge);
    }
  }
  const int n_iters = n_end - n_begin;  // blocks visited, from n_end - 1 down to n_begin

  // ---- Prologue: Q (own commit group), then kStages - 1 K/V blocks ----------------------------
  load_tile_async<kBlockM, Tile, kThreads>(sQ, q_g + row0 * q_sr, q_sr, seqlen_q - row0, tid);
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_iters) {
      const int n = n_end - 1 - s;
      // Only block n_total - 1 can be partial, and it is visited first: edge-checked loads here.
      load_tile_async<kBlockN, Tile, kThreads>(sK + s * kTileKV, k_g + n * kBlockN * k_sr, k_sr, seqlen_k - n * kBlockN,
                                               tid);
      load_tile_async<kBlockN, Tile, kThreads>(sV + s * kTileKV, v_g + n * kBlockN * v_sr, v_sr, seqlen_k - n * kBlockN,
                                               tid);
    }
    cp_async_commit();  // empty groups keep the wait_group arithmetic uniform
  }

  // Per-lane constant parts of the ldmatrix addresses. Lane l supplies the row address of row
  // (l & 7) of 8x8 matrix (l >> 3), and matrix m lands in register m.
  //  Pattern A (Q without .trans, V with .trans): matrices (rows 0-7, chunk c), (rows 8-15, c),
  //  (rows 0-7, c+1), (rows 8-15, c+1): lane row (l & 7) + 8 ((l >> 3) & 1), chunk c + (l >> 4).
  //    Q: regs = a0..a3 of the mma A operand (rows g / g+8 x k 0-7, then k 8-15)
  //    V: a lane gets keys 2t, 2t+1 of dim g of each matrix -> regs {0, 1} = B fragment of
  //       d-block 2c', regs {2, 3} = d-block 2c' + 1
  //  Pattern B (K without .trans): matrices (keys 0-7, chunk c), (keys 0-7, c+1), (keys 8-15, c),
  //  (keys 8-15, c+1): lane row (l & 7) + 8 (l >> 4), chunk c + ((l >> 3) & 1). A lane gets key g,
  //  dims 2t, 2t+1 of each matrix -> regs {0, 1} = B fragment of keys 0-7, {2, 3} = keys 8-15.
  //  (B fragments must be register pairs, so K cannot reuse pattern A without register moves.)
  // The lane addresses of both patterns (LdsmLane) are rebuilt inside the main loop, see there.

  // Q fragments: [kKSteps][4] A-operand registers for this warp's 16 rows (kQInRegs only).
  u32 q_frag[kQInRegs ? kKSteps : 1][4];
  if constexpr (kQInRegs) {
    cp_async_wait<kStages - 1>();  // the Q group (committed first) has landed for this thread
    __syncthreads();               // ... and for every thread
    const LdsmLane<Tile, true, kXor, kKSteps> lq(sQ, warp_row0, 0, lane);  // this warp's rows of sQ
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) ldmatrix_x4(q_frag[ks], lq.at(0, ks));
  }

  float o_acc[kMTiles][kDBlocks][4];  // O accumulator, fp32: [m-tile][d-block][c0..c3]
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int db = 0; db < kDBlocks; ++db)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[mt][db][e] = 0.f;
  // Softmax state per (m-tile, row half): half 0 = row g, half 1 = row g + 8.
  float row_shift[kMTiles][2];  // running row max * scale_log2 (log2 units); kNoKeyShift: no key yet
  float row_sum[kMTiles][2];    // this thread's partial sum of p (its 2 columns per n8 block)
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_shift[mt][h] = kNoKeyShift;
      row_sum[mt][h] = 0.f;
    }

  // ---- Main loop over K/V blocks, last to first --------------------------------------------
  for (int it = 0; it < n_iters; ++it) {
    const int n = n_end - 1 - it;  // K/V block index
    const int stage = it % kStages;
    cp_async_wait<kStages - 2>();  // block `it` (and Q) landed for this thread
    __syncthreads();               // ... for all threads; all warps finished block it - 1
    {
      const int pf = it + kStages - 1;  // prefetch into the slot block it - 1 used
      if (pf < n_iters) {
        const int pn = n_end - 1 - pf;
        const int ps = pf % kStages;
        const CtaId c = cta_id<kReverse>();
        const int kvh = static_cast<int>((static_cast<uint64_t>(c.head) * kv_group_magic) >> 32);
        const u16* const k_b = k + c.batch * k_sb + span.k0 * k_sr + kvh * k_sh;  // [Nk, d] of this kv head
        const u16* const v_b = v + c.batch * v_sb + span.k0 * v_sr + kvh * v_sh;
        // pn <= n_end - 2 < n_total - 1: a full block, no bounds checks.
        load_tile_full_async<kBlockN, Tile, kThreads>(sK + ps * kTileKV, k_b + pn * kBlockN * k_sr,
                                                      static_cast<int>(k_sr), tid);
        load_tile_full_async<kBlockN, Tile, kThreads>(sV + ps * kTileKV, v_b + pn * kBlockN * v_sr,
                                                      static_cast<int>(v_sr), tid);
      }
      cp_async_commit();
    }
    // Thread-dependent addressing is re-derived from an opaque thread index in every iteration (a
    // handful of integer ops): hoisted out of the loop it would occupy registers across the whole
    // loop, and the 32-row configs need every register for O (128 at d = 128) and S.
    const int tid_l = opaque(tid);
    const int lane_l = tid_l & 31;
    // Q: this warp's rows of sQ (pattern A); K (pattern B) and V (pattern A, .trans): this stage.
    const LdsmLane<Tile, true, kXor, kKSteps> lq_l(sQ, (tid_l >> 5) * kRowsPerWarp, 0, lane_l);
    const LdsmLane<Tile, false, kXor, kKSteps> lk_l(sK + stage * kTileKV, 0, 0, lane_l);
    const LdsmLane<Tile, true, kXor, kDBlocks / 2> lv_l(sV + stage * kTileKV, 0, 0, lane_l);

    // S = Q K^T: [kMTiles][kNBlocks][4] fp32, row g / g+8, key columns 2t, 2t+1 of each n8 block.
    float s_acc[kMTiles][kNBlocks][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nb = 0; nb < kNBlocks; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) s_acc[mt][nb][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      u32 a[kMTiles][4];
      if constexpr (kQInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[0][e] = q_frag[ks][e];
      } else {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
          ldmatrix_x4(a[mt], lq_l.at(mt, ks));
      }
#pragma unroll
      for (int np = 0; np < kNBlocks / 2; ++np) {
        u32 bk[4];
        ldmatrix_x4(bk, lk_l.at(np, ks));
        const u32 b0[2] = {bk[0], bk[1]};  // keys 16 np + 0..7
        const u32 b1[2] = {bk[2], bk[3]};  // keys 16 np + 8..15
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<kIsBF16>(s_acc[mt][2 * np], a[mt], b0);
          mma_16816<kIsBF16>(s_acc[mt][2 * np + 1], a[mt], b1);
        }
      }
    }

    if constexpr (kVariants) {
      apply_variants<kMTiles, kNBlocks, kBlockM, kBlockN, kRowsPerWarp>(s_acc, va, n, seqlen_q, seqlen_k, tid_l);
    } else if (it < n_masked) {
      // Mask: only the Nk edge block and blocks crossing the diagonal (the first n_masked visited).
      // mma accumulator ownership: rows g and g + 8, columns 2t, 2t + 1 of each n8 block.
      const int g = lane_l >> 2, t = lane_l & 3, wrow0 = (tid_l >> 5) * kRowsPerWarp;
      const int key0 = n * kBlockN + 2 * t;

#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = cta_id<kReverse>().m_block * kBlockM + wrow0 + mt * 16 + g + 8 * h;
          // last visible key of this row (may be < 0: the row sees nothing)
          const int limit = kCausal ? min(seqlen_k - 1, row + diag) : seqlen_k - 1;
#pragma unroll
          for (int nb = 0; nb < kNBlocks; ++nb)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (key0 + nb * 8 + e > limit) s_acc[mt][nb][2 * h + e] = neg_inf();
        }
    }

    // Online softmax. Block max per row (the quad of 4 lanes that shares a row reduces it), in
    // log2 units. The max only moves when some row of the warp would otherwise see
    // p > 2^kRescaleThreshold: blk - shift is ~2^100 for a row's first visible key (shift =
    // kNoKeyShift), and -inf (false) while a row sees nothing (blk = -inf).
    float blk_max[kMTiles][2];
    bool grow = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = neg_inf();
#pragma unroll
        for (int nb = 0; nb < kNBlocks; ++nb) mx = fmaxf(mx, fmaxf(s_acc[mt][nb][2 * h], s_acc[mt][nb][2 * h + 1]));
        blk_max[mt][h] = quad_max(mx) * sl2;  // sl2 > 0: max commutes with the scale
        grow |= blk_max[mt][h] - row_shift[mt][h] > kRescaleThreshold;
      }
    if (__any_sync(0xffffffffu, grow)) {  // warp-uniform: rescale all rows of the warp together
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float shift_new = fmaxf(row_shift[mt][h], blk_max[mt][h]);
          // First visible key: 2^(-2^100 - shift_new) = 0 (O and l are still 0). Still nothing
          // seen: shift_new = kNoKeyShift, alpha = 1 (and O, l = 0). Never NaN.
          const float alpha = fast_exp2(row_shift[mt][h] - shift_new);
          row_shift[mt][h] = shift_new;
          row_sum[mt][h] *= alpha;
#pragma unroll
          for (int db = 0; db < kDBlocks; ++db) {
            o_acc[mt][db][2 * h] *= alpha;
            o_acc[mt][db][2 * h + 1] *= alpha;
          }
        }
    }
    // p = 2^(s * scale_log2 - shift): one FFMA + one MUFU.EX2 per score; s = -inf gives 0 (the
    // shift is always finite, see kNoKeyShift). Each n8 pair of p is packed to 16 bits as soon as
    // it exists, so the fp32 S registers die one n8 block at a time and P (half their count) is
    // what stays live into O += P V. The S accumulator of key blocks 2kk, 2kk+1 is exactly the A
    // fragment of k-step kk (a0 = row g keys 2t.., a1 = row g+8, a2/a3 = same rows, keys 8 + 2t..).
    // Dropout (variant kernels): the row sums keep every p (they normalize the softmax), P V gets
    // the kept ones; 1 / (1 - p) is applied with 1 / l in the epilogue.
    u32 p_frag[kMTiles][kPSteps][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      uint4 bits[2];  // dropout bits of rows g and g + 8 for the current 32-key group
#pragma unroll
      for (int nb = 0; nb < kNBlocks; ++nb) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          p[e] = fast_exp2(fmaf(s_acc[mt][nb][e], sl2, -row_shift[mt][e >> 1]));
          row_sum[mt][e >> 1] += p[e];
        }
        if constexpr (kVariants) {
          if (va.drop_thr != 0u) {
            const int tid_d = opaque(tid);
            const int lane_d = tid_d & 31, t = lane_d & 3;
            const CtaId c = cta_id<kReverse>();
            const int key = n * kBlockN + nb * 8 + 2 * t;
            if ((nb & 3) == 0) {
              const int row = c.m_block * kBlockM + (tid_d >> 5) * kRowsPerWarp + mt * 16 + (lane_d >> 2);
              const int bh = c.batch * static_cast<int>(gridDim.y) + c.head;
#pragma unroll
              for (int h = 0; h < 2; ++h) bits[h] = dropout_bits(va, bh, row + 8 * h, key >> 5, t);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (!dropout_keep(va, bits[e >> 1], key + (e & 1))) p[e] = 0.f;
          }
        }
        p_frag[mt][nb >> 1][2 * (nb & 1)] = pack2<kIsBF16>(p[0], p[1]);
        p_frag[mt][nb >> 1][2 * (nb & 1) + 1] = pack2<kIsBF16>(p[2], p[3]);
      }
    }

    // O += P V.
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
#pragma unroll
      for (int dp = 0; dp < kDBlocks / 2; ++dp) {
        u32 bv[4];
        ldmatrix_x4_trans(bv, lv_l.at(kk, dp));
        const u32 b0[2] = {bv[0], bv[1]};
        const u32 b1[2] = {bv[2], bv[3]};
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<kIsBF16>(o_acc[mt][2 * dp], p_frag[mt][kk], b0);
          mma_16816<kIsBF16>(o_acc[mt][2 * dp + 1], p_frag[mt][kk], b1);
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can be left; keep the invariant explicit
  // The Q tile's cp.async chunks were issued by every thread of the CTA, not by the warp that owns
  // the rows. After at least one main-loop iteration they have all landed (its wait + barrier);
  // with no K/V block to visit (a varlen sequence with no key, a window past the keys) the loop never
  // ran, and a warp's O staging below could race with another thread's Q copy still landing in the
  // same rows (compute-sanitizer racecheck, 2026-12-01). One CTA barrier per tile closes that.
  __syncthreads();

  // ---- Epilogue: normalise, lse, stage O through this warp's rows of sQ, 16-byte stores -------
  // sQ rows [warp_row0, warp_row0 + kRowsPerWarp) are read (Q fragments) and written (O) only by
  // this warp, so after the barrier above a __syncwarp orders the reuse.
  {
    const int tid_e = opaque(tid);  // see the main loop: nothing thread-specific lives across it
    const int lane_e = tid_e & 31, g_e = lane_e >> 2, t_e = lane_e & 3;
    const int wrow0 = (tid_e >> 5) * kRowsPerWarp;
    const CtaId cta_e = cta_id<kReverse>();
    const int row0 = cta_e.m_block * kBlockM;
    // Re-read (varlen), not kept from the prologue: nothing of the span but k0 lives across the loop.
    const SeqSpan span_e = seq_span<kVarlen, true>(cu_seqlens_q, cu_seqlens_k, cta_e.batch, seqlen_q_arg, seqlen_k_arg);
    u16* const o_g = o + cta_e.batch * o_sb + span_e.q0 * o_sr + cta_e.head * o_sh;  // [Nq, d]
    float* const lse_g = kVarlen ? lse + static_cast<int64_t>(cta_e.head) * total_q + span_e.q0  // [Nq]
                                 : lse + (static_cast<int64_t>(cta_e.batch) * heads + cta_e.head) * span_e.nq;
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float l = quad_sum(row_sum[mt][h]);
        // l == 0 <=> the row saw no key: O = 0. Dropout: kept p times 1 / (1 - p).
        const float inv = l > 0.f ? (kVariants ? va.drop_scale : 1.f) / l : 0.f;
        const int r = wrow0 + mt * 16 + g_e + 8 * h;
        if (t_e == 0 && row0 + r < span_e.nq)
          lse_g[row0 + r] = l > 0.f ? (row_shift[mt][h] + log2f(l)) * kLn2 : neg_inf();
#pragma unroll
        for (int db = 0; db < kDBlocks; ++db) {
          const u32 packed = pack2<kIsBF16>(o_acc[mt][db][2 * h] * inv, o_acc[mt][db][2 * h + 1] * inv);
          *reinterpret_cast<u32*>(smem + Tile::elem(r, db * 8 + 2 * t_e)) = packed;
        }
      }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kRowsPerWarp * kChunks / 32; ++i) {
      const int id = lane_e + i * 32;
      const int r = id / kChunks, c = id % kChunks;
      const int row = row0 + wrow0 + r;
      const uint4 val = *reinterpret_cast<const uint4*>(smem + Tile::chunk(wrow0 + r, c));
      if (row < span_e.nq) *reinterpret_cast<uint4*>(o_g + row * o_sr + c * 8) = val;
    }
  }
}

// Dense batches: q [B, H, Nq, d], k/v [B, Hkv, Nk, d], o [B, H, Nq, d], lse [B, H, Nq] (see above).
template <int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kCausal, bool kIsBF16>
__global__ void __launch_bounds__(kWarps * 32, 1)
    attention_fwd_sm80(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                       u16* __restrict__ o, float* __restrict__ lse, int64_t q_sb, int64_t q_sh, int64_t q_sr,
                       int64_t k_sb, int64_t k_sh, int64_t k_sr, int64_t v_sb, int64_t v_sh, int64_t v_sr,
                       int64_t o_sb, int64_t o_sh, int64_t o_sr, int heads, uint64_t kv_group_magic, int seqlen_q,
                       int seqlen_k, float scale_log2) {
  attention_fwd_body<kHeadDim, kBlockM, kBlockN, kWarps, kStages, kCausal, kIsBF16, false>(
      q, k, v, o, lse, q_sb, q_sh, q_sr, k_sb, k_sh, k_sr, v_sb, v_sh, v_sr, o_sb, o_sh, o_sr, heads, kv_group_magic,
      seqlen_q, seqlen_k, scale_log2, nullptr, nullptr, 0, Variants{});
}

// Dense batches with variants (common/variants.cuh): the plain dense kernel's parameters, then
// VARIANT_PARAMS. Causal is the window's right edge 0. kRngState: the dropout seed and offset come from
// rng_state (device memory), not the seed / offset parameters.
template <int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kIsBF16, bool kRngState = false>
__global__ void __launch_bounds__(kWarps * 32, 1)
    attention_fwd_variants_sm80(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                u16* __restrict__ o, float* __restrict__ lse, int64_t q_sb, int64_t q_sh,
                                int64_t q_sr, int64_t k_sb, int64_t k_sh, int64_t k_sr, int64_t v_sb, int64_t v_sh,
                                int64_t v_sr, int64_t o_sb, int64_t o_sh, int64_t o_sr, int heads,
                                uint64_t kv_group_magic, int seqlen_q, int seqlen_k, float scale_log2,
                                VARIANT_PARAMS) {
  attention_fwd_body<kHeadDim, kBlockM, kBlockN, kWarps, kStages, false, kIsBF16, false, true>(
      q, k, v, o, lse, q_sb, q_sh, q_sr, k_sb, k_sh, k_sr, v_sb, v_sh, v_sr, o_sb, o_sh, o_sr, heads, kv_group_magic,
      seqlen_q, seqlen_k, scale_log2, nullptr, nullptr, 0, resolved_variants<kRngState>(VARIANTS_FROM_PARAMS));
}

// Packed variable-length batches: q [Tq, H, d], k/v [Tk, Hkv, d], o [Tq, H, d] (token stride *_sr,
// head stride *_sh, in elements), lse [H, Tq] fp32 contiguous (total_q = Tq), cu_seqlens_q /
// cu_seqlens_k int32 [B + 1] on the device. Grid (ceil(max_seqlen_q / kBlockM), H, B + 1): the
// last z-slice zeroes the rows past the last sequence. Causal is bottom-right per sequence; an empty
// sequence writes nothing.
template <int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kCausal, bool kIsBF16>
__global__ void __launch_bounds__(kWarps * 32, 1)
    attention_fwd_varlen_sm80(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                              u16* __restrict__ o, float* __restrict__ lse, int64_t q_sh, int64_t q_sr, int64_t k_sh,
                              int64_t k_sr, int64_t v_sh, int64_t v_sr, int64_t o_sh, int64_t o_sr,
                              uint64_t kv_group_magic, const int* __restrict__ cu_seqlens_q,
                              const int* __restrict__ cu_seqlens_k, int total_q, float scale_log2) {
  if (is_tail_slice()) {  // rows past the last sequence: O = 0, lse = -inf
    zero_tail_rows<kHeadDim, kWarps * 32>(o + blockIdx.y * o_sh, o_sr, lse + static_cast<int64_t>(blockIdx.y) * total_q,
                                          cu_seqlens_q[gridDim.z - 1], total_q);
    return;
  }
  attention_fwd_body<kHeadDim, kBlockM, kBlockN, kWarps, kStages, kCausal, kIsBF16, true>(
      q, k, v, o, lse, 0, q_sh, q_sr, 0, k_sh, k_sr, 0, v_sh, v_sr, 0, o_sh, o_sr, 0, kv_group_magic, 0, 0, scale_log2,
      cu_seqlens_q, cu_seqlens_k, total_q, Variants{});
}

// Packed variable-length batches with variants: the varlen kernel's parameters, then VARIANT_PARAMS
// (kRngState as the dense kernel's).
template <int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kIsBF16, bool kRngState = false>
__global__ void __launch_bounds__(kWarps * 32, 1)
    attention_fwd_varlen_variants_sm80(const u16* __restrict__ q, const u16* __restrict__ k,
                                       const u16* __restrict__ v, u16* __restrict__ o, float* __restrict__ lse,
                                       int64_t q_sh, int64_t q_sr, int64_t k_sh, int64_t k_sr, int64_t v_sh,
                                       int64_t v_sr, int64_t o_sh, int64_t o_sr, uint64_t kv_group_magic,
                                       const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
                                       int total_q, float scale_log2, VARIANT_PARAMS) {
  if (is_tail_slice()) {  // rows past the last sequence: O = 0, lse = -inf
    zero_tail_rows<kHeadDim, kWarps * 32>(o + blockIdx.y * o_sh, o_sr, lse + static_cast<int64_t>(blockIdx.y) * total_q,
                                          cu_seqlens_q[gridDim.z - 1], total_q);
    return;
  }
  attention_fwd_body<kHeadDim, kBlockM, kBlockN, kWarps, kStages, false, kIsBF16, true, true>(
      q, k, v, o, lse, 0, q_sh, q_sr, 0, k_sh, k_sr, 0, v_sh, v_sr, 0, o_sh, o_sr, 0, kv_group_magic, 0, 0, scale_log2,
      cu_seqlens_q, cu_seqlens_k, total_q, resolved_variants<kRngState>(VARIANTS_FROM_PARAMS));
}

}  // namespace tileattn
