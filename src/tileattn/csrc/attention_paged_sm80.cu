// Attention of packed queries against a paged KV cache, on the sm_80 tensor-core path (mma.sync
// m16n8k16 + ldmatrix + cp.async; also runs on sm_90). One kernel family serves decode (one query
// token per sequence), chunked prefill against a cached prefix, speculative verification (a few
// tokens) and any mix of them in one launch; a second kernel combines split-KV partials.
//
//   q        [Tq, H, d]       packed queries; sequence b owns tokens cu_seqlens_q[b] .. cu_seqlens_q[b+1]
//   k_cache  [num_blocks, block_size, Hkv, d], v_cache likewise (any strides, last dim contiguous)
//   block_table [B, max_blocks] int32: key j of sequence b is row j % block_size of cache block
//                                      block_table[b, j / block_size]
//   seqlens_k [B] int32: keys of sequence b, its own query tokens included (they are its last keys)
//   out      [Tq, H, d] contiguous; lse [H, Tq] fp32 (natural log), optional
//
// Causal masking is aligned bottom-right per sequence: query token i of a sequence with nq queries
// and nk keys sees key j iff j <= i + nk - nq. A row that sees no key gets O = 0 and lse = -inf.
//
// ---- Never outside the caches --------------------------------------------------------------------
// The index tensors live on the device and are not checked by the host (that would need a sync).
// So: keys at or past the table's capacity (max_blocks * block_size) are not visited; a block id
// outside [0, num_blocks) is never dereferenced: its rows are zero-filled (cp.async src-size 0,
// source address clamped to the cache's base) and its keys are masked to -inf, exactly as the
// reference treats them. A negative length counts as 0; query tokens outside [0, Tq) are neither
// read nor written. Rows past cu_seqlens_q[B] (padding) get out = 0, lse = -inf
// (paged::zero_padding_rows: every CTA a share, in the prologue).
//
// ---- Work decomposition: GQA packing ------------------------------------------------------------
// The G = H / Hkv query heads that share a KV head are rows of one M tile: row r of the (sequence,
// KV head) problem is query token r / G, query head kv_head * G + r % G. Each K/V tile is then read
// from memory once per KV head (not once per query head, which is what a dense kernel on decode
// shapes does: G times the bytes). grid = (M tiles, Hkv * num_splits, B), the M tile count from
// max_seqlen_q * G, never from the actual lengths, so one captured CUDA graph serves every step.
// A CTA whose rows all lie past its sequence's nq * G exits at once.
//
// Two warp layouts (template kWarpsM x kWarpsN, one of them 1):
//  - rows (kWarpsN = 1): kWarpsM warps of 16 or 32 rows (one or two m16 tiles) each, every warp
//    walks all keys of a tile (the FlashAttention-2 layout; chunked prefill, many rows). 32 rows
//    per warp halve the shared-memory K/V reads per FLOP. A warp whose rows are all padding skips
//    the math but still loads and synchronises.
//  - keys (kWarpsM = 1, 16 rows): decode. One m16 tile holds the G (<= 16) heads of one token, and
//    the kWarpsN warps each take kBlockN / kWarpsN keys of every tile, with their own online
//    softmax; the warps' (shift, sum, O) are merged through shared memory at the end. Without this
//    a decode CTA would have one warp of math and three idle.
//
// ---- Split-KV ---------------------------------------------------------------------------------
// Each (M tile, KV head, sequence) group has num_splits CTAs in the grid (the host's count, from
// the launch shape and the table's capacity: the grid never depends on the lengths). How many of
// them work is decided on the device: a group whose rows meet `tiles` key tiles (after the length,
// causal and window limits) runs S = min(num_splits, max(1, tiles)) splits (the effective count),
// or S = 1 when tiles <= unsplit_tiles (a kernel parameter, below), and split s takes tiles
// s, s + S, s + 2 S, ... (the variant kernels with a window start at its
// first tile instead of 0: first_tile + s, ...). Every CTA of the group computes the same S from
// the same device-side lengths (nothing in it depends on the split or the KV head). Splits >= S
// leave right after reading the lengths: no Q or K/V load, no partial, no arrival (an engine's
// decode graph is captured for its longest context, so at short lengths most of a group's CTAs
// are such). Strided rather than contiguous ranges, so split sizes differ by at most one tile and
// a split's first tile (s) does not depend on the length: its block-table entries are read
// together with the lengths, see the prologue. With S == 1 the one CTA writes out/lse directly;
// otherwise each of the S splits writes its normalised O (fp32) and its lse to
// o_part [num_splits, Tq, H, d] / lse_part [num_splits, Tq, H] (rows 0 .. S - 1 used), arrives on
// its group's counter, and the S-th CTA to arrive merges the S partials (paged::combine_row):
//   L = log sum_s exp(lse_s),  O = sum_s exp(lse_s - L) O_s   (splits with lse_s = -inf weigh 0).
// Why min(num_splits, tiles) and not fewer (say two tiles per split): a short decode is a chain of
// dependent latencies, not bytes, and one tile per split is the shortest chain per CTA; and with
// this rule 1 < S < num_splits only when every split has at most one tile, so the prologue's second
// and later tiles (s + S, ...) are past the length whenever S differs from num_splits and the
// block ids read before the lengths (for tiles s + i num_splits) stay exact; S == 1 by the rule
// below is the one other case, handled in the prologue.
// One launch, no second kernel: the combine of a group overlaps the other groups' key loops.
//
// No split at short contexts (unsplit_tiles = T, a run-time parameter; 0: the rule above alone;
// the 16- and 64-row layouts only, see the prologue).
// At a few tiles the split is not bandwidth but latency: after its tile, a split's chain goes on
// with the partial stores + the acq_rel arrival (one global round trip) and, in the last CTA, the
// partials' read-back (another) before out is written. One CTA walking all T tiles instead loads
// them through the kStages-deep ring: with tiles <= kStages - 1 every load is in flight at once
// (the same one round trip as one tile per split), with tiles <= 2 (kStages - 1) two round trips
// (one more, but no arrival and no combine), plus the math of the extra tiles in one CTA.
// docs/attention_paged.md ("Latency at short contexts") counts it; the host
// chooses T (TILEATTN_PAGED_UNSPLIT_TILES; default "auto" = kStages - 1, measured +0.3 % in the engine decode).

// ---- Memory pipeline ----------------------------------------------------------------------------
// Decode reads K and V once and does G FLOPs per byte of them (G = H / Hkv): it is bound by HBM
// bandwidth, so the design goal is bytes in flight. Each K/V tile is kBlockN keys x d, loaded with
// 16-byte cp.async into a kStages-deep ring (kStages - 1 tiles in flight per CTA while one is
// consumed; one CTA barrier per tile). Bytes in flight are counted in whole 128-byte lines: the
// loader's warp instructions each request whole lines of a few rows (not one 32-byte sector of
// many rows, which holds 4x the memory requests per byte in flight), and a thread owns a few
// consecutive key rows of one cache block, so it reads one block-table entry per tile (L1/L2
// hits: the prologue prefetches the CTA's slice of the table into L2) and forms two 64-bit
// source pointers (see load_tile). Tiles are visited in increasing order; the ones that need
// masking (the length edge, the causal diagonal) are found per tile. A per-tile flag (bar.red.or
// at the barrier that starts the tile) says whether any of its block ids was out of range, and
// only then is the page validity re-derived per key.
//
// ---- Online softmax (fp32, base 2) ------------------------------------------------------------
// As in attention_fwd_sm80.cu: p = 2^(s * scale_log2 - shift) with one FFMA + MUFU.EX2 per score;
// the shift moves (and O, l are rescaled) only when a row's max grows by more than 2^8 (warp vote);
// kNoKeyShift (-2^100) marks a row that has seen no key (never -inf - -inf).
//
// ---- Shared memory ----------------------------------------------------------------------------
//   sQ [kBlockM][d]               Q tile (loaded once)
//   sK [kStages][kBlockN][d]      ring of K tiles;  sV likewise
// rows are common/sm80_tile.cuh's SwizzledTile (16-byte chunks XOR-swizzled so ldmatrix's 8 rows of
// one chunk column hit 8 different bank groups; d = 96 rows padded to a 128-element pitch), so a
// "row" below is a power-of-two pitch. After the main loop the K ring is reused for the key-split merge.
//
// ---- Programmatic dependent launch ----------------------------------------------------------------
// The host may launch these kernels with the PDL attribute (runtime.pdl_enabled; common/pdl.cuh):
// the grid is then scheduled while the kernel before it on the stream (an engine's rotary + KV
// write) is still running, and the next kernel (the o projection) may be scheduled while this one
// runs. So every CTA executes griddepcontrol.wait before its first global access of any kind (the
// block table, lengths, q, the caches, the split counters and partials, out / lse, the L2
// prefetches): only index arithmetic on kernel parameters and blockIdx precedes it (unless the
// caller states the engine contract below: then reads of what the previous kernel cannot write). Every CTA,
// including the splits and M tiles that turn out idle: a successor's own wait returns when this
// grid completes, and that implies the predecessor's writes only if no CTA of this grid could
// complete before them. The release (griddepcontrol.launch_dependents) follows right after the
// wait: it only lets the next grid be scheduled once every CTA of this one has run it or exited
// (so all of this grid's CTAs are resident or done: the next grid never takes their slots), and
// that grid's wait still waits for this one's completion and memory flush, so the split counters
// are back at zero and out / lse written before it reads them. Without the attribute both are
// no-ops; on sm_80 they compile to nothing.
// The engine contract (prewait != 0; attention_paged's prior_kernel_writes_only_new_keys): the
// kernel launched just before this one writes, of what this kernel reads, only q and the cache
// slots of each sequence's newest nq keys (positions >= nk - nq), and it ran its own
// griddepcontrol.wait before letting this grid be scheduled (every tileattn kernel does, at entry),
// so everything before it on the stream has completed and flushed when a CTA of this grid first
// runs. Then the block table, cu_seqlens_q / seqlens_k and every key below nk - nq are final at
// the CTA's start: it reads the table and lengths and issues the cp.async of its prologue tiles
// that lie wholly below nk - nq BEFORE the wait (off the critical path: the previous kernel's tail
// hides them), and only Q, the tile holding the new keys and everything after waits. Every store
// (out, lse, the padding rows, the partials, the counters) stays after the wait: torch's
// stream-ordered allocator may hand this launch memory the previous kernel still uses. And the
// release still follows the wait: the next kernel (the o GEMV) relies on the same induction
// ("two launches back has completed") that this contract does.
#include "common/pdl.cuh"
#include "common/sm80_tile.cuh"
#include "common/variants.cuh"

namespace tileattn {
namespace paged {

// Largest growth of the row max (log2 units) absorbed without rescaling O.
constexpr float kRescaleThreshold = 8.0f;
// Shift of a row that has seen no key yet (see attention_fwd_sm80.cu: a finite sentinel keeps
// s * scale_log2 - shift finite and makes the first real key's rescale factor exactly 0).
constexpr float kNoKeyShift = -1.2676506002282294e30f;  // -2^100

// cp.async of 16 bytes of a cache row with an L2 prefetch-size hint: on a miss L2 fetches the
// aligned 128 (or 64) bytes around it, never bytes of another head's row: rows of a multiple of
// 128 bytes (d = 64, 128, 256) take the 128-byte hint, d = 32 (64-byte rows) and d = 96 (192) the
// 64-byte one. The loader's quarter-warps request whole aligned 128-byte lines (64-byte pieces at
// d = 32, 96) already, so on caches whose rows start on 128-byte boundaries the hint asks for
// nothing more; it brings both lines in whole where a row starts 64 bytes into one (a strided
// view), at no instruction cost.
template <int kRowBytes>
__device__ __forceinline__ void cp_async_16_row(u32 smem_dst, const void* gmem_src, bool valid) {
  static_assert(kRowBytes % 64 == 0, "cache rows of whole 64-byte units");
  const int src_bytes = valid ? 16 : 0;
  if constexpr (kRowBytes % 128 != 0) {
    asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
                 "r"(src_bytes)
                 : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
                 "r"(src_bytes)
                 : "memory");
  }
}

// Fetch the 128-byte line holding `ptr` into L2, without waiting (PTX prefetch; no register is
// written). Used to warm the block-table slice a CTA will read, so that each tile's table read,
// which sits in front of the tile's cp.async, costs an L2 hit instead of an HBM round trip.
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
}

// A read-only global load kept in program order with the other asm volatile statements (the
// cp.async): the length and block-id loads of the prologue are issued together, before anything
// waits for one of them.
__device__ __forceinline__ int ldg_now(const int* ptr) {
  int v;
  asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr));
  return v;
}

// atomicAdd(counter, 1) with acq_rel semantics at GPU scope; returns the old value.
__device__ __forceinline__ int arrive_acq_rel(int* counter) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// Which keys a CTA visits. Keys [0, kv_end) are visible to some row of the M tile; keys below
// unmasked_end are visible to every row (no causal or length mask needed there).
struct KeyRange {
  int kv_end, unmasked_end, n_iter;  // the CTA visits tiles first_tile + split + i * S, i < n_iter
};

constexpr int kMaxSplits = 128;  // splits the combine handles (the host caps num_splits)
// Splits whose O partials one combine round reads at once (a round is one dependent L2 round trip):
// 8 covers the effective split count of a sequence of up to 8 key tiles in one round.
constexpr int kCombineBatch = 8;

// Split-KV combine of one (token, head) row of [Tq, H] by one warp; lane l owns the dim pairs
// (2p, 2p + 1) with p = l + 32 i (a warp moves 256 contiguous bytes of partials per step).
//   L = log sum_s exp(lse_s),  O = sum_s exp(lse_s - L) O_s   (lse_s = -inf: split s saw no key)
// Latency, not bandwidth, is its cost (a few KB per row): every split's lse is loaded at once
// (lane l holds splits l + 32 i, num_splits <= kMaxSplits), the weights are formed in registers and
// broadcast by shuffle, and the O loads of kCombineBatch splits are issued together before any of
// them is used, predicated rather than looped (a 2-split combine is one round trip, not two). A
// split of weight 0 (no key for this row) is not read and adds 0. Loads are ld.global.cg: the
// partials were written by other CTAs of the same launch.
template <int kHeadDim, bool kIsBF16>
__device__ __forceinline__ void combine_row(const float* o_part, const float* lse_part, u16* out, float* lse,
                                            int num_tokens, int heads, int num_splits, int tok, int head, int lane) {
  constexpr int kPairs = kHeadDim / 2;
  constexpr int kSteps = (kPairs + 31) / 32;  // pair steps per lane
  constexpr int kLaneSplits = kMaxSplits / 32;
  const int64_t rows = static_cast<int64_t>(num_tokens) * heads;
  const int64_t row = static_cast<int64_t>(tok) * heads + head;

  float ls[kLaneSplits];  // lse of splits lane + 32 i, -inf past num_splits
  float mx = neg_inf();
#pragma unroll
  for (int i = 0; i < kLaneSplits; ++i) {
    const int s = lane + 32 * i;
    ls[i] = s < num_splits ? __ldcg(lse_part + s * rows + row) : neg_inf();
    mx = fmaxf(mx, ls[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float total = 0.f;
  if (mx != neg_inf()) {
#pragma unroll
    for (int i = 0; i < kLaneSplits; ++i) total += fast_exp2((ls[i] - mx) * kLog2e);  // -inf -> 0
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  }
  const float row_lse = total > 0.f ? mx + __logf(total) : neg_inf();
  float w[kLaneSplits];  // weight exp(lse_s - L) of splits lane + 32 i (0: no key or no row key)
#pragma unroll
  for (int i = 0; i < kLaneSplits; ++i) w[i] = total > 0.f ? fast_exp2((ls[i] - row_lse) * kLog2e) : 0.f;

  float2 acc[kSteps];
#pragma unroll
  for (int i = 0; i < kSteps; ++i) acc[i] = make_float2(0.f, 0.f);
#pragma unroll
  for (int i = 0; i < kLaneSplits; ++i) {  // splits 32 i .. 32 i + 31, weights in lanes (w[i])
    const int count = min(32, num_splits - 32 * i);
#pragma unroll 1
    for (int s0 = 0; s0 < count; s0 += kCombineBatch) {
      float wt[kCombineBatch];               // warp-uniform: 0 past count
      float2 x[kCombineBatch][kSteps];       // O pairs of splits s0 .. s0 + kCombineBatch - 1
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        const int sl = s0 + u;
        const float wu = __shfl_sync(0xffffffffu, w[i], sl & 31);
        wt[u] = sl < count ? wu : 0.f;
        const float2* const src = reinterpret_cast<const float2*>(o_part + ((32 * i + sl) * rows + row) * kHeadDim);
#pragma unroll
        for (int j = 0; j < kSteps; ++j) {
          const int pair = lane + 32 * j;
          const bool read = wt[u] != 0.f && (kPairs % 32 == 0 || pair < kPairs);
          x[u][j] = read ? __ldcg(src + pair) : make_float2(0.f, 0.f);
        }
      }
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u)
#pragma unroll
        for (int j = 0; j < kSteps; ++j) {
          acc[j].x = fmaf(wt[u], x[u][j].x, acc[j].x);
          acc[j].y = fmaf(wt[u], x[u][j].y, acc[j].y);
        }
    }
  }
  u32* const dst = reinterpret_cast<u32*>(out + row * kHeadDim);
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int pair = lane + 32 * i;
    if (kPairs % 32 == 0 || pair < kPairs) dst[pair] = pack2<kIsBF16>(acc[i].x, acc[i].y);
  }
  if (lse != nullptr && lane == 0) lse[static_cast<int64_t>(head) * num_tokens + tok] = row_lse;
}

// Rows past the last sequence (tokens cu_seqlens_q[B] .. Tq - 1: an engine pads its token count to
// a captured CUDA-graph size) belong to no sequence; they get out = 0 and lse = -inf so no element
// of the outputs is left unwritten. `first` = cu_seqlens_q[B] clamped to [0, Tq]. out [Tq, H, d] is
// contiguous, so those rows are one range of (Tq - first) * H * d elements: every CTA of the grid
// takes an interleaved share of its 16-byte chunks (the grid does not depend on the lengths, and
// any share is tiny beside the CTA's K/V traffic). Called in the prologue, after the first K/V
// cp.async are issued and before the main loop's accumulators exist: the stores overlap the tile
// loads and add no register to the main loop.
template <int kHeadDim, int kThreads>
__device__ __forceinline__ void zero_padding_rows(u16* out, float* lse, int first, int num_tokens, int heads) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * gridDim.y * gridDim.z * kThreads;
  const int64_t start =
      ((static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * kThreads + threadIdx.x;
  const int pad = num_tokens - first;
  const int pad_rows = pad * heads;  // (token, head) rows; <= Tq * H < 2^31 (host check)
  uint4* const dst = reinterpret_cast<uint4*>(out + static_cast<int64_t>(first) * heads * kHeadDim);
#pragma unroll 1
  for (int64_t i = start; i < static_cast<int64_t>(pad_rows) * (kHeadDim / 8); i += stride)
    dst[i] = make_uint4(0u, 0u, 0u, 0u);
  if (lse == nullptr) return;
#pragma unroll 1
  for (int64_t i = start; i < pad_rows; i += stride) {  // lse [H, Tq]: columns first .. Tq - 1 of every head
    const int row = static_cast<int>(i), head = row / pad;
    lse[static_cast<int64_t>(head) * num_tokens + first + (row - head * pad)] = neg_inf();
  }
}

}  // namespace paged

// The body of both entry points below. Strides in elements; bt_stride = block_table.stride(0);
// block_size = 1 << log2_block_size (16..256); group = H / Hkv; causal is 0 or 1 (a runtime flag:
// decode needs no mask at all, so it costs nothing there). When num_splits > 1, o_part/lse_part
// take the partials of the groups whose effective split count S (see the header) is > 1, and
// `counters` (int32 [M tiles * Hkv * B], zero at launch, zero again at the end) counts each such
// group's arrivals; lse may be null. unsplit_tiles >= 0: groups of at most that many key tiles
// run as one split (see the header); prewait: 1 under the engine contract (the PDL section).
// kVariants (common/variants.cuh; the plain entry point passes false and Variants{}, and every
// variant line is under `if constexpr`, so the plain kernels keep their code): window, softcap and
// ALiBi from `va`, each a run-time, CTA-uniform choice; causal is the window's right edge 0 (the
// host passes causal = 0). Query token i of a sequence with nq queries and nk keys sits at key
// position i + nk - nq. The CTA visits only the key tiles that meet the union of its rows' windows
// [window_lo(first token), window_hi(last token)] (windows move monotonically with the token), so a
// sliding window costs O(window) per CTA in decode and prefill alike; a split takes every S-th of
// those tiles (S: the effective split count, see the header). Scores become log2-unit logits right
// after Q K^T (softcap or scale, the ALiBi bias, -inf outside the row's window) and the online
// softmax runs with scale 1.
template <int kHeadDim, int kBlockM, int kWarpsM, int kWarpsN, int kBlockN, int kStages, bool kIsBF16,
          bool kVariants>
__device__ __forceinline__ void attention_paged_body(
    const u16* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
    const int* __restrict__ block_table, const int* __restrict__ cu_seqlens_q, const int* __restrict__ seqlens_k,
    u16* __restrict__ out, float* __restrict__ lse, float* __restrict__ o_part, float* __restrict__ lse_part,
    int* __restrict__ counters, int64_t q_st, int64_t q_sh, int64_t k_sb, int64_t k_sr, int64_t k_sh, int64_t v_sb,
    int64_t v_sr, int64_t v_sh, int bt_stride, int num_blocks, int max_blocks, int log2_block_size, int num_tokens,
    int heads, int group, int num_splits, int causal, float scale_log2, int unsplit_tiles, int prewait,
    const Variants& va) {
  using namespace paged;
  constexpr int kWarps = kWarpsM * kWarpsN;
  constexpr int kThreads = kWarps * 32;
  constexpr int kChunks = kHeadDim / 8;            // 16-byte chunks per row
  constexpr int kWarpKeys = kBlockN / kWarpsN;     // keys of a tile one warp multiplies
  constexpr int kKSteps = kHeadDim / 16;           // k16 steps of S = Q K^T
  constexpr int kNBlocks = kWarpKeys / 8;          // n8 blocks of a warp's S
  constexpr int kPSteps = kWarpKeys / 16;          // k16 steps of O += P V
  constexpr int kDBlocks = kHeadDim / 8;           // n8 blocks of O
  constexpr int kMTiles = kBlockM / (16 * kWarpsM);  // m16 tiles per warp (1 or 2)
  constexpr int kRowsPerWarp = 16 * kMTiles;
  // Q fragments stay in registers for one m-tile at d <= 128; otherwise (32 rows, or d = 256) Q is
  // re-read from shared memory every k-step: the registers go to O.
  constexpr bool kQInRegs = kMTiles == 1 && kHeadDim <= 128;
  static_assert(kBlockM == kRowsPerWarp * kWarpsM && (kMTiles == 1 || kMTiles == 2), "16 or 32 rows per warp");
  static_assert(kWarpsM == 1 || kWarpsN == 1, "warps split either rows or keys");
  static_assert(kWarpsN == 1 || kMTiles == 1, "the key split is for one m16 tile");
  static_assert(kWarpKeys % 16 == 0 && kStages >= 2, "16-key mma steps per warp, double buffering");
  // Rows at a power-of-two pitch (d = 96: 128 elements), so every ldmatrix address of the main loop
  // is one lane register XOR / plus an immediate (LdsmLane's kXor form).
  using Tile = SwizzledTile<kHeadDim>;
  constexpr int kTileQ = Tile::bytes(kBlockM), kTileKV = Tile::bytes(kBlockN);
  // Tile loader geometry (see load_tile): kLoadTPR threads per key row, each owning kLoadRows
  // consecutive rows. 8 threads x 16 bytes = one 128-byte line per quarter-warp where rows are
  // whole lines (d = 64, 128, 256); 4 threads = the whole 64-byte row at d = 32 and a 64-byte
  // piece of the 192-byte row at d = 96 (pieces at multiples of 64 bytes: never across a line).
  // Two m-tiles per warp (the 128-row prefill tiles: compute-bound, 240-255 registers, nothing to
  // spare for several rows' addresses; the sm_90a 128 x 64 tile spills 80 bytes with 4 rows per
  // thread) keep one row per thread: kThreads / kBlockN threads per row.
  constexpr int kLoadTPR = kMTiles == 2 ? kThreads / kBlockN : kChunks % 8 == 0 ? 8 : 4;
  constexpr int kLoadRows = kBlockN * kLoadTPR / kThreads;
  static_assert(kThreads % kLoadTPR == 0 && kBlockN * kLoadTPR % kThreads == 0 && kChunks % kLoadTPR == 0,
                "loader: the CTA's threads cover a tile's rows in whole row groups and whole chunks");
  // A power of two <= 8 that divides every block size (>= 16): a thread's rows share one cache
  // block (one table entry), and row r0 + i with r0 % kLoadRows == 0 is r0 | i, which the swizzle
  // maps linearly (see load_tile).
  static_assert(is_pow2(kLoadRows) && kLoadRows <= 8, "loader: 1, 2, 4 or 8 rows per thread");
  static_assert(kWarpsN == 1 || (kWarpsN - 1) * (kDBlocks + 1) * 4 * 32 * 4 <= kStages * kTileKV,
                "the key-split merge buffer fits in the K ring");
  static_assert(kTileQ % 1024 == 0 && kTileKV % 1024 == 0, "tiles start on 1 KB boundaries (LdsmLane XOR)");

  extern __shared__ __align__(1024) char smem[];
  check_dynamic_smem(smem, kTileQ + 2 * kStages * kTileKV);
  const u32 sQ = smem_addr(smem);         // [kBlockM][d], swizzled
  const u32 sK = sQ + kTileQ;             // [kStages][kBlockN][d], swizzled
  const u32 sV = sK + kStages * kTileKV;  // [kStages][kBlockN][d], swizzled

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp % kWarpsM, wn = warp / kWarpsM;  // row group / key group of this warp
  const int m_tile = blockIdx.x;
  const int kv_head = blockIdx.y / num_splits, split = blockIdx.y - kv_head * num_splits;
  const int b = blockIdx.z;
  const int* const bt_row = block_table + static_cast<int64_t>(b) * bt_stride;

  // Programmatic dependent launch (see the header): nothing above touches global memory. Without
  // the engine contract (prewait == 0) every CTA waits here for the previous kernel's writes (the
  // rotary's q, the KV write), then lets the next kernel be scheduled. With it, the CTA first does
  // what the contract allows (the block table, the lengths, the old keys' tiles) and waits below,
  // before its first load of anything the previous kernel may write.
  const bool early = prewait != 0;  // CTA-uniform (a kernel parameter)
  if (!early) {
    pdl_wait();
    pdl_release_dependents();
  }

  // ---- Block ids of the prologue's tiles, read before the lengths --------------------------------
  // Split s visits tiles s, s + S, s + 2 S, ...; S (the effective split count) needs the lengths.
  // Where S > 1, either S == num_splits or every split has at most one tile (see the header), so
  // the tiles s + i num_splits name every prologue tile that can be visible (pre_id). Where S == 1
  // only split 0 works and it walks tiles 0, 1, 2, ...: with num_splits == 1 those are the same
  // tiles; otherwise S == 1 either because the group has at most one tile (tile 0 is
  // `split + 0 num_splits`, the others are past the length and their ids unused) or because it has
  // at most T of them, where split 0's prologue tiles 1 .. kStages - 2 differ from
  // pre_id's: split 0 reads those entries too (pre_one; one more table entry per stage in the same
  // round trip, only when T > 1 and num_splits > 1; kReadTable elsewhere: a split > 0
  // with S == 1 is idle). So whichever S the lengths give, the entries the prologue uses are exact,
  // and reading them together with the lengths takes one dependent global round trip (~1 us after
  // an L2 miss) off the path to the first K/V load. (A split that turns out to be idle has read
  // kStages - 1 table entries in that same round trip, and waits for nothing else.) Only entries
  // inside the table row (keys below its capacity) are read; whether a key is visible is decided
  // once the lengths are known. (Variants: with a window's left edge the first tile depends on the
  // lengths, so those launches read these entries after them, in the loader; softcap / ALiBi alone
  // start at tile 0 like the plain kernel.) `pre`: the row's block id when already read (the
  // prologue's tiles), kReadTable otherwise.
  constexpr int kReadTable = -2;
  // The no-split rule's tile count T (see the header), on the 16- and 64-row layouts only: the
  // two-m-tile prefill tiles are compute-bound, and the sm_90a 128 x 64 one sits at 255 registers,
  // where the rule's one run-time compare makes ptxas spill 88 bytes in the main loop.
  const int unsplit = kMTiles == 1 ? unsplit_tiles : 0;
  const bool table_first = !(kVariants && va.left < kUnbounded);
  const int capacity = max_blocks << log2_block_size;
  const int my_row = tid / kLoadTPR * kLoadRows;  // this thread's first loader row in a tile
  int pre_id[kStages - 1];   // tile split + s num_splits (the split walk, S > 1 or num_splits == 1)
  int pre_one[kStages - 1];  // tile s of split 0's walk when S == 1
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (!table_first) {
      pre_id[s] = kReadTable;
    } else {
      const int key = (split + s * num_splits) * kBlockN + my_row;
      pre_id[s] = key < capacity ? ldg_now(bt_row + (key >> log2_block_size)) : -1;
    }
    if (s == 0 || num_splits == 1) {
      pre_one[s] = pre_id[s];  // the same tile
    } else if (table_first && split == 0 && unsplit > 1) {
      const int key = s * kBlockN + my_row;
      pre_one[s] = key < capacity ? ldg_now(bt_row + (key >> log2_block_size)) : -1;
    } else {
      pre_one[s] = kReadTable;
    }
  }

  // ---- This CTA's rows and keys (all CTA-uniform) -------------------------------------------------
  const int q_start = ldg_now(cu_seqlens_q + b);
  const int nq = max(ldg_now(cu_seqlens_q + b + 1) - q_start, 0);
  const int nk = max(ldg_now(seqlens_k + b), 0);
  const int q_total = ldg_now(cu_seqlens_q + gridDim.z);  // cu_seqlens_q[B]: later rows are padding
  const int rows = nq * group;          // valid rows of this (sequence, KV head) problem
  const int row0 = m_tile * kBlockM;
  // An M tile past this sequence's queries (the grid comes from max_seqlen_q) visits no key and
  // leaves after the prologue: an exit here would let the compiler sink the block-id loads above
  // below it, behind the lengths.
  const bool live = row0 < rows;
  const int nk_read = min(nk, capacity);  // never past the block table
  const int diag = nk - nq;             // token i sees keys j <= i + diag; keys >= diag are the new ones
  KeyRange kr;
  int s_eff;                 // S: the splits of this group that work, the same in all its CTAs
  int first_tile = 0;        // variants: the first tile that meets a row's window (plain: 0)
  int n_unmasked_first = 0;  // variants: tiles below this hold keys before some row's window
  {
    const int first_tok = row0 / group, last_tok = (min(row0 + kBlockM, rows) - 1) / group;
    if constexpr (kVariants) {
      // Rows' windows [window_lo, window_hi] move monotonically with the token: their union is
      // [lo(first_tok), hi(last_tok)], their intersection [lo(last_tok), hi(first_tok)].
      kr.kv_end = !live ? 0 : max(0, min(nk_read, window_hi(va, last_tok, diag, nk) + 1));
      kr.unmasked_end = !live ? 0 : max(0, min(nk_read, window_hi(va, first_tok, diag, nk) + 1));
      first_tile = !live ? 0 : window_lo(va, first_tok, diag) / kBlockN;
      n_unmasked_first = (window_lo(va, last_tok, diag) + kBlockN - 1) / kBlockN;
    } else {
      kr.kv_end = !live ? 0 : causal ? max(0, min(nk_read, last_tok + diag + 1)) : nk_read;
      kr.unmasked_end = !live ? 0 : causal ? max(0, min(nk_read, first_tok + diag + 1)) : nk_read;
    }
    // Key tiles some row of the group sees (< 0 when a window lies past the table's capacity).
    // At most `unsplit` of them: one split (see the header, "No split at short contexts").
    const int tiles = (kr.kv_end + kBlockN - 1) / kBlockN - first_tile;
    s_eff = tiles <= unsplit ? 1 : min(num_splits, max(1, tiles));
    // 0 for the splits >= S (with S == 1 by the T rule a split > 0 can lie below `tiles`): they
    // must issue no cp.async (the contract's early loads included: a CTA that exits with copies in
    // flight would let them land in the shared memory of the next CTA on its SM) and no prefetch.
    kr.n_iter = split < s_eff && tiles > split ? (tiles - 1 - split) / s_eff + 1 : 0;
  }
  const int n_iter = kr.n_iter;
  if (n_iter > kStages - 1) {
    // Warm the table slice: entries [first, last] of the table row, from the first tile the main
    // loop reads to the last key this split visits (the other splits' entries in between come
    // along: a few 128-byte lines): addresses 128 B apart (the last one clamped) touch every line
    // of the slice once. (Before the wait under the contract: the table is not the previous
    // kernel's to write.)
    const int first = ((first_tile + split + (kStages - 1) * s_eff) * kBlockN) >> log2_block_size;
    const int last =
        (min((first_tile + split + (n_iter - 1) * s_eff + 1) * kBlockN, kr.kv_end) - 1) >> log2_block_size;
    for (int e = first + 32 * tid; e < last + 32; e += 32 * kThreads) prefetch_l2(bt_row + min(e, last));
  }
  // The variant kernels' scores are log2-unit logits already when the softmax sees them.
  const float sl2 = kVariants ? 1.f : scale_log2;
  const int n_unmasked_tiles = kr.unmasked_end / kBlockN;  // tiles below this need no length/causal mask
  const int block_mask = (1 << log2_block_size) - 1;
  const u16* const k_head = k_cache + kv_head * k_sh;
  const u16* const v_head = v_cache + kv_head * v_sh;

  // ---- Tile loader: kBlockN keys of K and V into ring slot `stage` ------------------------------------
  // Line-owner mapping: thread (g, q), g = tid / kLoadTPR, q = tid % kLoadTPR, owns the kLoadRows
  // consecutive key rows r0 + i, r0 = g kLoadRows, and copies their chunks q + kLoadTPR j. The
  // cp.async of one (i, j) across a warp: each quarter-warp (8 threads) copies 128 consecutive
  // bytes of one row, i.e. a whole aligned line at d = 64, 128, 256 (two 64-byte pieces of two
  // rows at d = 32, 96): 4 lines of 4 rows per instruction, so each L2 request carries 4 sectors
  // (a mapping of 2 threads per row requested one sector of each of 16 rows: 4x the requests
  // for the same bytes in flight). A thread's rows lie in one cache block (kLoadRows divides the
  // block size), so it reads one table entry per tile, checks it once and forms its two 64-bit
  // source pointers once; row i adds i row strides, chunk j the immediate 16 kLoadTPR j bytes.
  // Destinations: r0 | i and q | kLoadTPR j are bitwise sums (r0 % kLoadRows == 0, i < kLoadRows;
  // q < kLoadTPR, powers of two), the swizzle's row term (r & 7, or (r >> 1) & 3 at d = 32) is
  // XOR-linear over such sums and a row's physical chunks stay below its power-of-two pitch, so
  // chunk(r0 | i, q | kLoadTPR j) = chunk(r0, q) ^ chunk(i, kLoadTPR j): one XOR with a constant
  // (stage * kTileKV and r0's pitch multiple have no bit below kLoadRows rows' bytes).
  // The thread coordinates come from an opaque thread index at each call (recomputed, not held in
  // registers across the main loop). A key past kv_end or in a block whose id is outside
  // [0, num_blocks) is zero-filled (cp.async src-size 0; an invalid block's source rows are
  // clamped to block 0 of the head). Returns whether this thread's rows were visible but sat in an
  // invalid block. `pre`: the block id of the rows when already read (kReadTable otherwise).
  const int k_sr32 = static_cast<int>(k_sr), v_sr32 = static_cast<int>(v_sr);
  auto load_tile = [&](int n, int stage, int pre) -> bool {
    const int tid_l = opaque(tid);
    const int r0 = tid_l / kLoadTPR * kLoadRows, q = tid_l % kLoadTPR;
    const int key0 = n * kBlockN + r0;
    const bool in_range = key0 < kr.kv_end;  // row r0 + i is visible iff key0 + i < kv_end
    const int id = !in_range ? -1 : pre != kReadTable ? pre : __ldg(bt_row + (key0 >> log2_block_size));
    const bool ok = id >= 0 && id < num_blocks;
    const bool valid = in_range && ok;
    const int row = key0 & block_mask;
    // u32 x int64: the block id is non-negative here.
    const u16* const kp = valid ? k_head + static_cast<u32>(id) * k_sb + (row * k_sr32 + q * 8) : k_head;
    const u16* const vp = valid ? v_head + static_cast<u32>(id) * v_sb + (row * v_sr32 + q * 8) : v_head;
    const u32 dst = stage * kTileKV + Tile::chunk(r0, q);
#pragma unroll
    for (int i = 0; i < kLoadRows; ++i)
#pragma unroll
      for (int j = 0; j < kChunks / kLoadTPR; ++j) {
        const u32 at = dst ^ Tile::chunk(i, kLoadTPR * j);
        const bool copy = valid && (i == 0 || key0 + i < kr.kv_end);
        cp_async_16_row<2 * kHeadDim>(sK + at, kp + (i * k_sr32 + 8 * kLoadTPR * j), copy);
        cp_async_16_row<2 * kHeadDim>(sV + at, vp + (i * v_sr32 + 8 * kLoadTPR * j), copy);
      }
    return in_range && !ok;
  };
  // The prologue's tile of ring slot s, and its block id as read above (pre_one: split 0's walk
  // when S == 1, the only split working then; pre_id otherwise).
  auto prologue_tile = [&](int s) { return first_tile + split + s * s_eff; };
  auto prologue_pre = [&](int s) { return s_eff == 1 ? pre_one[s] : pre_id[s]; };

  // Bit s: some thread-visible key of the tile in ring slot s had an invalid block id (this
  // thread's view; the CTA-wide OR is taken at the barrier that starts the tile).
  unsigned bad_slots = 0;
  // Bit s: ring slot s's prologue tile was issued before the wait (the engine contract).
  unsigned early_slots = 0;
  if (early) {
    // ---- Under the engine contract: the old keys' tiles before the wait ---------------------------
    // The kernel launched just before this one writes, of what this kernel reads, only q and the
    // cache slots of each sequence's newest nq keys (positions >= nk - nq = diag), and it waited
    // for everything before it (every tileattn kernel runs griddepcontrol.wait before its
    // launch_dependents): so the table, the lengths and every key below diag are final already,
    // and a prologue tile wholly below diag ((n + 1) kBlockN <= diag) may be issued now. The tile
    // holding diag (the new keys), Q, the later tiles (the main loop), the partials, the counters
    // and every store stay after the wait: each is an asm volatile ("memory") or follows one in
    // program order, and pdl_wait's "memory" clobber keeps the compiler from hoisting them above
    // it. These cp.async form their own commit group, older than Q's: every cp_async_wait below
    // allows only the newest groups to be pending, so an older group only ever completes sooner,
    // and the Q wait (and the first tile's) waits for it too; the accounting of Q and the ring
    // slots below is exactly the one without the contract. Idle splits and M tiles past the rows
    // (n_iter == 0) issue nothing and still wait (see the header: every CTA waits).
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      const int n = prologue_tile(s);
      if (s < n_iter && (n + 1) * kBlockN <= diag) {
        bad_slots |= static_cast<unsigned>(load_tile(n, s, prologue_pre(s))) << s;
        early_slots |= 1u << s;
      }
    }
    cp_async_commit();
    pdl_wait();
    pdl_release_dependents();
  }
  // A split past S has no tile and no part in the combine: it only takes its share of the padding
  // rows (the share is per CTA of the grid) and leaves, with no Q or K/V load, no partial and no
  // arrival (the S-th arrival resets the group's counter, so counters still end at zero; with
  // S == 1 nothing arrives at all).
  if (split >= s_eff) {
    if (q_total < num_tokens)
      zero_padding_rows<kHeadDim, kThreads>(out, lse, max(q_total, 0), num_tokens, heads);
    return;
  }

  // ---- Prologue: Q (own commit group), then kStages - 1 K/V tiles ---------------------------------
  for (int id = tid; id < kBlockM * kChunks; id += kThreads) {
    const int r = id / kChunks, c = id % kChunks;
    const int grow = row0 + r;
    const int tok = q_start + grow / group;
    const int head = kv_head * group + grow % group;
    const bool valid = grow < rows && tok >= 0 && tok < num_tokens;
    const u16* src = valid ? q + tok * q_st + head * q_sh + c * 8 : q;
    cp_async_16(sQ + Tile::chunk(r, c), src, valid);
  }
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    // Unconditional apart from the contract's early tiles (s >= n_iter: keys past kv_end,
    // zero-filled, nothing read), so the block-id loads feed a use and are issued with the length
    // loads. prologue_pre(s) is the entry of tile prologue_tile(s) wherever that tile is visible
    // (see "Block ids of the prologue's tiles").
    if (!((early_slots >> s) & 1u))
      bad_slots |= static_cast<unsigned>(load_tile(prologue_tile(s), s, prologue_pre(s))) << s;
    cp_async_commit();  // empty groups keep "tile it has landed" = wait_group(kStages - 2)
  }
  // Padding rows (past cu_seqlens_q[B]): every CTA its share, while its first tiles land.
  if (q_total < num_tokens)
    zero_padding_rows<kHeadDim, kThreads>(out, lse, max(q_total, 0), num_tokens, heads);
  if (!live) {
    cp_async_wait<0>();
    return;
  }

  const int g = lane >> 2, t = lane & 3;  // mma fragment: rows g, g + 8; columns 2t, 2t + 1
  const int warp_row0 = row0 + wm * kRowsPerWarp;  // first row of this warp (in the problem)
  const bool warp_active = warp_row0 < rows;       // warp-uniform: some row of this warp is real
  // ldmatrix lane addresses: common/sm80_tile.cuh's LdsmLane (XOR form: one lane register per
  // operand, every (16-row block, chunk pair) an XOR / immediate on it). Q without .trans and V with
  // .trans use the rows-first lane order, K the other (see attention_fwd_sm80.cu).

  u32 q_frag[kQInRegs ? kKSteps : 1][4];
  if constexpr (kQInRegs) {
    cp_async_wait<kStages - 1>();  // the Q group (and the contract's older early group) landed for this thread
    __syncthreads();               // ... and for every thread
    const LdsmLane<Tile, true, true, kKSteps> lq(sQ, wm * kRowsPerWarp, 0, lane);  // this warp's rows
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) ldmatrix_x4(q_frag[ks], lq.at(0, ks));
  }

  // O, fp32: [m-tile][d-block][c0..c3], rows g (c0, c1) and g + 8 (c2, c3) of each m-tile.
  float o_acc[kMTiles][kDBlocks][4];
  float row_shift[kMTiles][2];  // running max * scale_log2 of rows g, g + 8; kNoKeyShift: no key yet
  float row_sum[kMTiles][2];    // this thread's partial sums of p
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int db = 0; db < kDBlocks; ++db)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[mt][db][e] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_shift[mt][h] = kNoKeyShift;
      row_sum[mt][h] = 0.f;
    }
  }

  // ---- Main loop over this split's key tiles: first_tile + split, + S, ... ------------------------
  for (int it = 0; it < n_iter; ++it) {
    const int n = first_tile + split + it * s_eff;
    const int stage = it % kStages;
    cp_async_wait<kStages - 2>();  // tile `it` (and Q) landed for this thread
    // ... for all threads, all warps are done with tile it - 1, and the CTA learns whether tile
    // `it` had an invalid block id.
    const bool tile_bad = __syncthreads_or(static_cast<int>((bad_slots >> stage) & 1u)) != 0;
    {
      const int pf = it + kStages - 1;  // prefetch into the slot tile it - 1 used
      if (pf < n_iter) {
        const int ps = pf % kStages;
        const bool bad = load_tile(first_tile + split + pf * s_eff, ps, kReadTable);
        bad_slots = (bad_slots & ~(1u << ps)) | (static_cast<unsigned>(bad) << ps);
      }
      cp_async_commit();
    }
    if (!warp_active) continue;
    // Lane addresses from an opaque thread index (a few integer ops per tile instead of registers
    // held across the loop): Q (this warp's rows), K and V (this warp's keys of this stage).
    const int tid_l = opaque(tid);
    const int lane_l = tid_l & 31, warp_l = tid_l >> 5;
    const int wm_l = warp_l % kWarpsM, wn_l = warp_l / kWarpsM;
    const LdsmLane<Tile, true, true, kKSteps> lq(sQ, wm_l * kRowsPerWarp, 0, lane_l);
    const LdsmLane<Tile, false, true, kKSteps> lk(sK + stage * kTileKV, wn_l * kWarpKeys, 0, lane_l);
    const LdsmLane<Tile, true, true, kDBlocks / 2> lv(sV + stage * kTileKV, wn_l * kWarpKeys, 0, lane_l);

    // S = Q K^T over this warp's kWarpKeys keys: [kMTiles][kNBlocks][4] fp32.
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
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if constexpr (kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[ks][e];
        } else {
          ldmatrix_x4(a[mt], lq.at(mt, ks));
        }
      }
#pragma unroll
      for (int np = 0; np < kNBlocks / 2; ++np) {
        u32 bk[4];
        ldmatrix_x4(bk, lk.at(np, ks));
        const u32 b0[2] = {bk[0], bk[1]};  // keys 16 np + 0..7
        const u32 b1[2] = {bk[2], bk[3]};  // keys 16 np + 8..15
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<kIsBF16>(s_acc[mt][2 * np], a[mt], b0);
          mma_16816<kIsBF16>(s_acc[mt][2 * np + 1], a[mt], b1);
        }
      }
    }

    // Whether the cache block of each of this thread's key pairs (keys key0 + 8 nb, + 1) is valid
    // (only a flagged tile can hold an invalid one).
    auto pages_ok = [&](int key0, bool (&page_ok)[kNBlocks]) {
#pragma unroll
      for (int nb = 0; nb < kNBlocks; ++nb) {
        page_ok[nb] = true;
        if (tile_bad) {  // rare: re-derive the block id of this thread's key pair
          const int key = key0 + nb * 8;
          const int page = key < kr.kv_end ? __ldg(bt_row + (key >> log2_block_size)) : -1;
          page_ok[nb] = page >= 0 && page < num_blocks;
        }
      }
    };
    if constexpr (kVariants) {
      // Logits in log2 units: softcap or scale, the ALiBi bias, and -inf outside the row's window
      // (which ends at kv_end: the length and the table's capacity) or in an invalid block. A tile
      // inside every row's window, with valid blocks, skips the per-score window test.
      const bool masked = n < n_unmasked_first || n >= n_unmasked_tiles || tile_bad;
      const int key0 = n * kBlockN + wn * kWarpKeys + 2 * t;
      bool page_ok[kNBlocks];
      pages_ok(key0, page_ok);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = warp_row0 + 16 * mt + g + 8 * h;
          const int tok = row / group;
          const int pos = tok + diag;  // the query's key position
          const int lo = pos - va.left, hi = min(kr.kv_end - 1, pos + va.right);
          const float slope = alibi_slope_log2(va, b, kv_head * group + (row - tok * group));
#pragma unroll
          for (int nb = 0; nb < kNBlocks; ++nb)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = key0 + nb * 8 + e;
              float x = variant_logit(va, s_acc[mt][nb][2 * h + e]);
              if (va.alibi != nullptr) x = fmaf(slope, static_cast<float>(abs(pos - j)), x);
              if (masked && (!page_ok[nb] || j < lo || j > hi)) x = neg_inf();
              s_acc[mt][nb][2 * h + e] = x;
            }
        }
    } else if (n >= n_unmasked_tiles || tile_bad) {
      // Mask: the length edge / causal diagonal tiles, and tiles with an out-of-range block id.
      const int key0 = n * kBlockN + wn * kWarpKeys + 2 * t;
      bool page_ok[kNBlocks];
      pages_ok(key0, page_ok);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int tok = (warp_row0 + 16 * mt + g + 8 * h) / group;
          // keys >= limit are invisible to this row
          const int limit = causal ? min(kr.kv_end, tok + diag + 1) : kr.kv_end;
#pragma unroll
          for (int nb = 0; nb < kNBlocks; ++nb)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (!page_ok[nb] || key0 + nb * 8 + e >= limit) s_acc[mt][nb][2 * h + e] = neg_inf();
        }
    }

    // Online softmax (rows g and g + 8 of each m-tile; the quad of 4 lanes sharing a row reduces
    // its max). The shift moves only when some row of the warp grows by more than 2^8 (vote).
    float blk_max[kMTiles][2];
    bool grow = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = neg_inf();
#pragma unroll
        for (int nb = 0; nb < kNBlocks; ++nb) mx = fmaxf(mx, fmaxf(s_acc[mt][nb][2 * h], s_acc[mt][nb][2 * h + 1]));
        blk_max[mt][h] = quad_max(mx) * sl2;
        grow |= blk_max[mt][h] - row_shift[mt][h] > kRescaleThreshold;
      }
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float shift_new = fmaxf(row_shift[mt][h], blk_max[mt][h]);
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
    // P in 16 bits, packed straight into the A fragments of O += P V (key blocks 2kk, 2kk + 1 of S
    // are the A fragment of k-step kk).
    u32 p_frag[kMTiles][kPSteps][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nb = 0; nb < kNBlocks; ++nb) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          p[e] = fast_exp2(fmaf(s_acc[mt][nb][e], sl2, -row_shift[mt][e >> 1]));
          row_sum[mt][e >> 1] += p[e];
        }
        p_frag[mt][nb >> 1][2 * (nb & 1)] = pack2<kIsBF16>(p[0], p[1]);
        p_frag[mt][nb >> 1][2 * (nb & 1) + 1] = pack2<kIsBF16>(p[2], p[3]);
      }
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
#pragma unroll
      for (int dp = 0; dp < kDBlocks / 2; ++dp) {
        u32 bv[4];
        ldmatrix_x4_trans(bv, lv.at(kk, dp));
        const u32 b0[2] = {bv[0], bv[1]};  // d-block 2 dp
        const u32 b1[2] = {bv[2], bv[3]};  // d-block 2 dp + 1
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<kIsBF16>(o_acc[mt][2 * dp], p_frag[mt][kk], b0);
          mma_16816<kIsBF16>(o_acc[mt][2 * dp + 1], p_frag[mt][kk], b1);
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can remain; keep the invariant explicit

#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) row_sum[mt][h] = quad_sum(row_sum[mt][h]);

  // ---- Key-split merge: warps 1.. hand their (shift, sum, O) to warp 0 through the K ring ----------
  if constexpr (kWarpsN > 1) {  // kMTiles == 1
    // [kWarpsN - 1][kDBlocks][4][32] O values, then [kWarpsN - 1][2][2][32] (shift, sum): every
    // warp has the same fragment layout, so lane l of warp 0 reads what lane l of warp w wrote
    // (consecutive lanes, consecutive words: no bank conflicts).
    float* const mO = reinterpret_cast<float*>(smem + kTileQ);
    float* const mStat = mO + (kWarpsN - 1) * kDBlocks * 4 * 32;
    __syncthreads();  // every warp is done with the K ring
    if (wn > 0) {
      float* const o_w = mO + (wn - 1) * kDBlocks * 4 * 32;
#pragma unroll
      for (int db = 0; db < kDBlocks; ++db)
#pragma unroll
        for (int e = 0; e < 4; ++e) o_w[(db * 4 + e) * 32 + lane] = o_acc[0][db][e];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mStat[((wn - 1) * 4 + 2 * h) * 32 + lane] = row_shift[0][h];
        mStat[((wn - 1) * 4 + 2 * h + 1) * 32 + lane] = row_sum[0][h];
      }
    }
    __syncthreads();
    // Rows that saw no key in a warp have shift kNoKeyShift and O = 0, sum = 0: their weight
    // 2^(kNoKeyShift - shift) is 0 once any warp saw a key, and 1 (times zeros) otherwise.
#pragma unroll
    for (int h = 0; h < 2 && wn == 0; ++h) {
      float shift = row_shift[0][h];
#pragma unroll
      for (int w = 1; w < kWarpsN; ++w) shift = fmaxf(shift, mStat[((w - 1) * 4 + 2 * h) * 32 + lane]);
      const float alpha0 = fast_exp2(row_shift[0][h] - shift);
      row_sum[0][h] *= alpha0;
#pragma unroll
      for (int db = 0; db < kDBlocks; ++db) {
        o_acc[0][db][2 * h] *= alpha0;
        o_acc[0][db][2 * h + 1] *= alpha0;
      }
#pragma unroll
      for (int w = 1; w < kWarpsN; ++w) {
        const float alpha = fast_exp2(mStat[((w - 1) * 4 + 2 * h) * 32 + lane] - shift);
        row_sum[0][h] += alpha * mStat[((w - 1) * 4 + 2 * h + 1) * 32 + lane];
        const float* const o_w = mO + (w - 1) * kDBlocks * 4 * 32;
#pragma unroll
        for (int db = 0; db < kDBlocks; ++db) {
          o_acc[0][db][2 * h] += alpha * o_w[(db * 4 + 2 * h) * 32 + lane];
          o_acc[0][db][2 * h + 1] += alpha * o_w[(db * 4 + 2 * h + 1) * 32 + lane];
        }
      }
      row_shift[0][h] = shift;
    }
  }
  // ---- Epilogue: rows g, g + 8 of each m-tile -> (token, head); O / l and lse ----------------------
  // (warp 0 holds the merged rows of a key split; every thread stays for the split-KV arrival)
#pragma unroll
  for (int mt = 0; mt < kMTiles && warp_active && wn == 0; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int grow = warp_row0 + 16 * mt + g + 8 * h;
      const int tok = q_start + grow / group;
      if (grow >= rows || tok < 0 || tok >= num_tokens) continue;
      const int head = kv_head * group + grow % group;
      const float l = row_sum[mt][h];
      const float inv = l > 0.f ? 1.f / l : 0.f;  // l == 0 <=> the row saw no key: O = 0
      const float row_lse = l > 0.f ? (row_shift[mt][h] + log2f(l)) * kLn2 : neg_inf();
      const int64_t row_id = static_cast<int64_t>(tok) * heads + head;  // row of [Tq * H]
      if (s_eff == 1) {
        u16* const o_row = out + row_id * kHeadDim;
#pragma unroll
        for (int db = 0; db < kDBlocks; ++db)
          *reinterpret_cast<u32*>(o_row + db * 8 + 2 * t) =
              pack2<kIsBF16>(o_acc[mt][db][2 * h] * inv, o_acc[mt][db][2 * h + 1] * inv);
        if (lse != nullptr && t == 0) lse[static_cast<int64_t>(head) * num_tokens + tok] = row_lse;
      } else {
        const int64_t part_row = static_cast<int64_t>(split) * num_tokens * heads + row_id;
        float* const o_row = o_part + part_row * kHeadDim;
#pragma unroll
        for (int db = 0; db < kDBlocks; ++db)
          *reinterpret_cast<float2*>(o_row + db * 8 + 2 * t) =
              make_float2(o_acc[mt][db][2 * h] * inv, o_acc[mt][db][2 * h + 1] * inv);
        if (t == 0) lse_part[part_row] = row_lse;
      }
    }
  if (s_eff == 1) return;

  // ---- Split-KV: the last split of this (M tile, KV head, sequence) to finish combines ---------
  // Each split publishes its partials with one arrival per CTA on the group's counter: the barrier
  // orders every thread's partial stores before thread 0's atom.acq_rel.gpu, whose release half
  // (cumulative) publishes them device-wide and whose acquire half, in the CTA that completes the
  // count, makes the other splits' partials visible; the barrier that broadcasts "last" extends
  // that to the CTA's threads (CUTLASS's semaphore pattern, without a membar per thread). That CTA
  // reads the partials back from L2 (ld.global.cg: other SMs wrote them during this launch), writes
  // out / lse, and resets the counter, so counters are zero between launches (also across
  // CUDA-graph replays) and no second kernel, launch gap or host launch is needed. Counters are
  // per launch stream (host).
  __syncthreads();
  int* const counter = counters + (static_cast<int64_t>(b) * (gridDim.y / num_splits) + kv_head) * gridDim.x + m_tile;
  int arrived = 0;
  if (tid == 0) arrived = arrive_acq_rel(counter) + 1;
  if (!__syncthreads_or(arrived == s_eff)) return;
  if (tid == 0) *counter = 0;  // all S arrivals of this launch are in
  const int row_end = min(row0 + kBlockM, rows);
  for (int r = row0 + warp; r < row_end; r += kWarps) {
    const int tok = q_start + r / group;
    if (tok < 0 || tok >= num_tokens) continue;
    combine_row<kHeadDim, kIsBF16>(o_part, lse_part, out, lse, num_tokens, heads, s_eff, tok,
                                   kv_head * group + r % group, lane);
  }
}

// See the header for the layouts and attention_paged_body for the parameters.
template <int kHeadDim, int kBlockM, int kWarpsM, int kWarpsN, int kBlockN, int kStages, bool kIsBF16>
__global__ void __launch_bounds__(kWarpsM * kWarpsN * 32, 1)
    attention_paged_sm80(const u16* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
                         const int* __restrict__ block_table, const int* __restrict__ cu_seqlens_q,
                         const int* __restrict__ seqlens_k, u16* __restrict__ out, float* __restrict__ lse,
                         float* __restrict__ o_part, float* __restrict__ lse_part, int* __restrict__ counters,
                         int64_t q_st, int64_t q_sh,
                         int64_t k_sb, int64_t k_sr, int64_t k_sh, int64_t v_sb, int64_t v_sr, int64_t v_sh,
                         int bt_stride, int num_blocks, int max_blocks, int log2_block_size, int num_tokens,
                         int heads, int group, int num_splits, int causal, float scale_log2, int unsplit_tiles,
                         int prewait) {
  attention_paged_body<kHeadDim, kBlockM, kWarpsM, kWarpsN, kBlockN, kStages, kIsBF16, false>(
      q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, out, lse, o_part, lse_part, counters, q_st, q_sh,
      k_sb, k_sr, k_sh, v_sb, v_sr, v_sh, bt_stride, num_blocks, max_blocks, log2_block_size, num_tokens, heads, group,
      num_splits, causal, scale_log2, unsplit_tiles, prewait, Variants{});
}

// With variants (window, softcap, ALiBi; common/variants.cuh): the plain kernel's parameters, then
// VARIANT_PARAMS (the dropout ones are unused: inference has no dropout; the host passes 0).
// causal must be 0: it is folded into the window (right edge 0).
template <int kHeadDim, int kBlockM, int kWarpsM, int kWarpsN, int kBlockN, int kStages, bool kIsBF16>
__global__ void __launch_bounds__(kWarpsM * kWarpsN * 32, 1)
    attention_paged_variants_sm80(const u16* __restrict__ q, const u16* __restrict__ k_cache,
                                  const u16* __restrict__ v_cache, const int* __restrict__ block_table,
                                  const int* __restrict__ cu_seqlens_q, const int* __restrict__ seqlens_k,
                                  u16* __restrict__ out, float* __restrict__ lse, float* __restrict__ o_part,
                                  float* __restrict__ lse_part, int* __restrict__ counters, int64_t q_st,
                                  int64_t q_sh, int64_t k_sb, int64_t k_sr, int64_t k_sh, int64_t v_sb, int64_t v_sr,
                                  int64_t v_sh, int bt_stride, int num_blocks, int max_blocks, int log2_block_size,
                                  int num_tokens, int heads, int group, int num_splits, int causal, float scale_log2,
                                  int unsplit_tiles, int prewait, VARIANT_PARAMS) {
  attention_paged_body<kHeadDim, kBlockM, kWarpsM, kWarpsN, kBlockN, kStages, kIsBF16, true>(
      q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, out, lse, o_part, lse_part, counters, q_st, q_sh,
      k_sb, k_sr, k_sh, v_sb, v_sr, v_sh, bt_stride, num_blocks, max_blocks, log2_block_size, num_tokens, heads, group,
      num_splits, causal, scale_log2, unsplit_tiles, prewait, VARIANTS_FROM_PARAMS);
}

}  // namespace tileattn
