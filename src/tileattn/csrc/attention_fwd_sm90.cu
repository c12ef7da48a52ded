// Fused attention forward for Hopper (sm_90a), FlashAttention-3 style: TMA loads into a shared-
// memory ring completed on mbarriers, warp specialization (one producer warpgroup, two consumer
// warpgroups), S = Q K^T by wgmma from shared memory, O += P V by register-A wgmma with P kept in
// registers, and the softmax of key block j overlapped with the P V product of block j - 1.
//
//   O[b, h, i, :] = sum_j softmax_j(scale * Q[b, h, i, :] . K[b, h / kv_group, j, :]) V[b, h / kv_group, j, :]
//   lse[b, h, i]  = log sum_j exp(scale * Q[b, h, i, :] . K[b, h / kv_group, j, :])   (natural log)
//
// Causal masking is aligned bottom-right: query i sees key j iff j <= i + Nk - Nq. A query that
// sees no key (causal with Nq > Nk) gets O = 0 and lse = -inf, never NaN. Same contract as
// attention_fwd_sm80.cu; see docs/attention_fwd_sm90.md for the design and its numbers.
//
// ---- Work decomposition -------------------------------------------------------------------------
// A tile is 128 query rows: `pack` query heads (1, or the kv_group heads that share one K/V head:
// "GQA packing") x R = 128 / pack consecutive positions of one batch entry. Tile row r is head
// head0 + r / R, position m_block * R + r % R, and Q / O move as one 4-D TMA box (64, R, pack, 1)
// (a consumer's O rows as (64, min(R, 64), 64 / min(R, 64), 1)), so a packed tile reads each K/V
// block once for all `pack` heads: with few queries per head (decode, short chunks) that divides
// the K/V traffic and the number of tiles by `pack`. Tiles are numbered so that tile order is work
// order (tile_coords), over "units" = (batch, head group) pairs: non-causal, the query tiles of one
// unit are consecutive (CTAs running at the same time share its K/V in L2); causal, units are taken
// l2_group at a time (the host sizes l2_group so that their K/V fit in half the L2) and inside a
// group the tiles go longest first (the last position blocks of all its units, then the ones
// before): long tiles start early, short ones fill the tail, and K/V is still read from L2.
// A 1-D grid of CTAs walks the tiles: one tile per CTA when the host launches one CTA per tile, or
// persistent (grid = #SMs), where each CTA's producer already loads the next tile's Q and K/V while
// its consumers finish the current one. A persistent CTA takes its first tile by blockIdx.x and the
// next ones from a grid-wide counter (tile_counter, atomicAdd), so a CTA that finishes early takes
// more and the CTAs in flight stay on neighbouring tiles (the L2 groups above); without the counter
// it takes blockIdx.x + k gridDim.x. The producer hands each tile to the consumers through sched_tile
// (two slots), so they walk exactly the producer's sequence, ending at -1. 384 threads = 3
// warpgroups, one CTA per SM (kConsumers = 3, the plain dense and varlen kernels, ALiBi or softcap alone:
// 512 threads and 192-row tiles, FlashAttention-3's d = 64 shape, a third warpgroup's softmax to
// interleave where the exponentials take as long as the GEMMs; 160 registers per consumer thread,
// so S + P + O must fit: d = 64 at 128-key blocks, d = 128 at 64 / 80):
//   warpgroup 0 (producer)   one thread issues every TMA copy: Q per tile, then K and V blocks into
//                            kStages-deep rings; setmaxnreg.dec gives its registers away.
//   warpgroups 1 ..          consumer c owns query rows [64 c, 64 c + 64) of the tile and
//   (consumers)              walks all K/V blocks; setmaxnreg.inc to kConsumerRegsOf.
// The consumers read the same K/V slots, so each slot is released by kConsumers arrivals.
//
// ---- Shared memory (dynamic, rounded up to 1024 B: the 128-byte swizzle repeats every 1024 B) ---
// Every tile is stored as TMA writes it with CU_TENSOR_MAP_SWIZZLE_128B: in 64-column panels
// (64 x 16 bit = 128 B, the swizzle span), each panel [rows][64] with 16-byte chunk q of row r at
// chunk q ^ (r % 8). A [rows][d] tile is d / 64 panels, one TMA box each.
//   sQ  [d/64][128][64]                    Q tile (and the O staging when there is no sO)
//   sK  [kStages][d/64][kBlockN][64]       K ring (K-major B operand of S = Q K^T)
//   sV  [kStages][d/64][kBlockN][64]       V ring (MN-major B operand of O += P V)
//   sO  [d/64][128][64]                    O staging for the store, where it fits (kOwnO)
// bytes = 2 d (128 + 2 kStages kBlockN) + 1024 (alignment slack), plus 2 d 128 for sO when that
// total stays within the 227 KB a block may have (d = 64 and 128 at their default tiles; not d = 256
// nor d = 128 with 176-key blocks); the Python side computes the same number (Sm90Config.smem_bytes).
// mbarriers are static shared memory.
// Why sO: staged in sQ, O kept the next tile's Q out until the store had read it, and the producer,
// which loads a tile's Q before its K/V, could not prefetch anything of the next tile during the
// epilogue. With sO, Q is released as soon as the tile's last S = Q K^T has retired, and on a
// persistent grid the next tile's Q and first K/V blocks load during the last P V and the epilogue.
//
// ---- mbarriers and their phases ------------------------------------------------------------------
//   q_full          1 arrival (producer's arrive.expect_tx) + the Q bytes. Phase i = the i-th tile
//                   of this CTA: consumers wait parity i & 1.
//   q_empty         2 arrivals: one thread of each consumer once the last S = Q K^T of the tile
//                   has retired (kOwnO), else its storing thread once its TMA store has finished
//                   reading sQ (the O staging); packed layouts: 256, every consumer thread (after
//                   its own row copies without sO). Before loading Q of tile i >= 1 the producer
//                   waits parity (i - 1) & 1.
//   k_full[s]       1 arrival + the K block's bytes.   K/V visits are counted across the CTA's
//   v_full[s]       1 arrival + the V block's bytes.   tiles (g); visit g uses slot s = g % kStages
//                   for the u = g / kStages-th time and completes phase u: consumers wait u & 1.
//   k_empty[s]      2 arrivals: one thread of each consumer warpgroup, once its wgmma that read K
//                   from slot s has retired (wgmma_wait). The producer refills slot s for use u >= 1
//   v_empty[s]      after phase u - 1 completed: it waits parity (u - 1) & 1. Packed layouts:
//                   v_empty[s] 256 arrivals, every consumer thread (clear_rows, see below).
//   sched_full[2]   1 arrival: the producer's, after writing the i-th tile (or -1) into sched_tile[i % 2];
//   sched_empty[2]  256 arrivals: every consumer thread after reading it; the producer waits for use
//                   i - 2 of a slot before writing use i. Consumers wait parity (i / 2) & 1. (The
//                   q_empty wait before tile i - 1's Q already implies it; the wait is kept so that
//                   every reading thread releases its own read, the order racecheck follows.)
// A waiter is never more than one phase behind (the producer waits on every refill, a consumer
// cannot start use u + 1 of a slot before the producer refilled it), so parities are unambiguous.
//
// ---- Consumer schedule (per warpgroup; FA3's intra-warpgroup overlap) ----------------------------
// K/V blocks are visited from the last one to the first, so the blocks that need masking (the Nk
// edge block and, causal, the blocks crossing the diagonal) come first and get their own loop.
//   block 0:  S = Q K^T; wait; release K; mask; softmax -> P (in the fp32 S registers)
//   block j:  issue S_j = Q K_j^T; issue O += P_{j-1} V_{j-1}            (two wgmma groups)
//             wait<1> (S_j done: groups retire in order); release K_j
//             mask; row max (and alpha if it moved); p = 2^(s scale_log2 - m) in place  (MUFU work
//                                                     runs while the tensor cores do P_{j-1} V_{j-1})
//             wait<0> (P V done); release V_{j-1}; O *= alpha if the max moved; pack P_j to 16 bit
//   tail:     O += P_last V_last; wait; release V.
// The plain dense kernel with three consumers (kSkipUnseen): a consumer first releases, unread,
// the visits none of its rows sees (unseen_visits: causal blocks past its last row's diagonal, or
// all of them for rows past Nq), waiting for each block's full barrier before its empty arrival so
// that the arrival counts toward that use's phase and not the previous one (whose other consumers
// may still be reading), then runs the schedule above from its first seen block. Its tensor-core
// and MUFU time goes to the other consumers of the SM.
// P_j is packed only after the wait that retires the P V group still reading P_{j-1}'s registers:
// the S registers are passed through fence_accumulators after wgmma_wait<0>, so the packing
// instructions depend on the wait and cannot be hoisted above it. The same fences pin every
// accumulator read behind the wgmma_wait that makes it valid.
//
// ---- Ping-pong between the two consumers (kPingPong) --------------------------------------------
// Without it the warp schedulers interleave the consumers freely, and each hides its own softmax
// behind its P V product. With it (FA3's warp-group scheduling) the consumers take turns issuing
// their GEMMs through two named barriers, so that one warpgroup's softmax runs while the other's
// wgmmas own the tensor cores: consumer c waits on barrier kTurnBarrier + c (256 threads: its own
// 128 sync, the other consumer's 128 arrive) before issuing, and arrives on the other's barrier
// right after. Each consumer has the same n_end + 1 issue events (first S, n_end - 1 steps, the
// last P V); consumer 1 opens with one arrival so that consumer 0 goes first, and skips the arrival
// of its last event, so every sync has exactly one matching arrival and no barrier is left
// half-arrived when the CTA exits. The tuning benchmark times both (docs/attention_fwd_sm90.md).
//
// ---- Per-thread registers of a consumer ----------------------------------------------------------
//   O accumulator  d / 2 fp32 (m64 x d over 128 threads)     d=128: 64, d=256: 128
//   S / P fp32     kBlockN / 2                                kBlockN=128: 64
//   P packed       kBlockN / 4 (16-bit pairs)                 kBlockN=128: 32
//   softmax state  row max m and partial row sum l for rows g and g + 8: 4
// plus addressing: 160-200 of the 232 registers that setmaxnreg grants with two consumers (ptxas -v: 0 spills).
//
// ---- Online softmax (fp32, base 2, scale folded) ---------------------------------------------
// m = running row max of s * scale_log2, allowed to lag the true max by up to kRescaleThreshold
// = 8 (see softmax_step); p = 2^(s * scale_log2 - m) <= 2^8 (one FFMA + one MUFU.EX2 per score);
// when m moves, O and l are multiplied by alpha = 2^(m_old - m_new). A row that has seen no
// key keeps m = kNoKeyShift = -2^100 (finite): its masked scores give 2^(-inf) = 0 and alpha =
// 2^0 = 1 while it sees nothing, 2^(-2^100 - m_new) = 0 on its first visible key (O, l are still 0
// then). Never -inf - -inf. The final l = 0 marks a fully masked row: O = 0, lse = -inf; otherwise
// lse = (m + log2 l) ln 2.
//
// ---- Epilogue ------------------------------------------------------------------------------------
// Each consumer normalizes O, packs it to 16 bit and writes it with stmatrix into its own 64 rows
// of sO (kOwnO: after its storing thread saw the previous tile's store finish reading them, and a
// 128-thread named barrier) or of sQ (its S wgmmas, the only readers of those rows, have retired),
// in the same swizzled panel layout, then fence.proxy.async + a 128-thread named barrier, and one
// thread issues d / 64 TMA stores (one box of this consumer's 64 rows per 64-column panel). The O
// tensor map's row bound is Nq, so rows past the end of a head's sequence are never written. lse
// goes straight from registers (one lane per row). Without sO the storing thread then waits for
// the store to read sQ and releases it to the producer (q_empty) for the next tile's Q.
//
// ---- Dropout (kVariant bit kDropout) -------------------------------------------------------------
// The keep bit of score (b, h, i, j) is variants.cuh's Philox function of (seed, offset, b * H + h,
// i, j), the one the sm_80 kernels and tileattn.dropout.dropout_mask use, so the mask does not
// depend on the tiles or the GQA packing. Per block, each consumer thread draws the bits of its 64
// (kBlockN = 128) scores with 2 kBlockN / 32 Philox calls (dropout_keep_bits) right after issuing
// the block's wgmmas, before waiting for them: the ~40 integer instructions per call issue while
// the tensor cores run S_j and P_{j-1} V_{j-1}. After softmax_step has added the undropped p to the
// row sums, apply_dropout zeroes the dropped ones before they are packed for P V; the epilogue
// multiplies 1 / l by 1 / (1 - p) and writes the undropped lse. Counts per block and where they
// run: docs/attention_fwd_sm90.md, "Dropout".
//
// ---- Packed queries: variable-length batches (kVariant = kVarlen) and paged K/V (kPaged) -------
// q [Tq, H, d], out [Tq, H, d], lse [H, Tq]; sequence b owns query tokens cu_seqlens_q[b] ..
// cu_seqlens_q[b + 1] - 1 (common/varlen.cuh). Varlen k / v [Tk, Hkv, d] likewise by cu_seqlens_k;
// paged k / v caches [num_blocks, block_size, Hkv, d] hold key j of sequence b at row j % block_size
// of block block_table[b, j / block_size], seqlens_k[b] keys, the queries being the last of them.
// The tensor maps describe q, out and varlen k / v as [1, H, T, d] views, and a tile adds its
// sequence's first token to the row coordinate (batch coordinate 0); a paged K/V block is
// min(block_size, kBlockN)-row boxes over a [num_blocks, Hkv, block_size, d] view, each at the
// block id the producer read from the table (a bad id, or a key past the length or the table's
// capacity: block coordinate num_blocks, zero fill, never dereferenced). Tiles are numbered as for
// a dense batch of B sequences of max_seqlen_q queries; a tile past its sequence's end is skipped
// by producer and consumers alike (not counted as one of the CTA's tiles, so any grid works).
// What a box reads past the sequence's end belongs to the next sequence, to token padding, to a
// stale cache row, or is TMA's zero fill: Q rows there are never stored; K columns there are
// masked (the edge block is always in the masked loop, and the mask overwrites whatever the score
// was, NaN included); V rows there would meet P = 0, but 0 * NaN = NaN in P V and those rows may
// hold anything, so both consumers zero them in the edge block's V slot before its P V
// (clear_rows). Paged keys in bad blocks must be masked, not scored 0: a sequence with any gets
// every visit masked and page_mask. O is not stored by TMA: a box past the sequence's end would
// overwrite the next sequence's first rows, and choosing TMA for whole boxes only is a branch on
// the sequence length between the wgmma loops, which makes ptxas serialize the wgmmas (C7519).
// Each consumer's threads copy its staged rows to global instead, 16 bytes each under a per-row
// predicate (d / 16 stores per thread). The consumers of every CTA, after its tiles, write a
// share of the rows past cu_seqlens_q[B] (out 0, lse -inf), as the sm_80 varlen kernel does.
// clear_rows and the staged O rows (stmatrix, then the row copies) are the only ordinary-instruction
// accesses to buffers that TMA later refills, so with the packed layouts every consumer thread
// releases each V slot and sQ itself (v_empty / q_empty count 256) right after its own accesses: a
// direct release -> acquire edge from each access to the next copy into the buffer. With one
// releasing thread the order still holds in the PTX model (bar.sync, then that thread's arrive),
// but compute-sanitizer's racecheck follows only the arriving thread's own accesses: it reported
// that pattern in the Hopper backward (docs/attention_bwd_sm90.md, "Racecheck: the lse2 ring
// slot"), fixed there the same way. The plain kernel's code is unchanged: every difference is
// under `if constexpr` or a constant-folded choice.
// Both packed layouts also combine with the window, softcap and ALiBi bits (kVariant = kVarlen or
// kPaged | a set of kWindow, kSoftcap, kAlibi; kCausal false, causal being the window's right edge
// 0; two consumers): the trailing parameters are the layout's, then VARIANT_PARAMS. The variant
// arithmetic is the dense kernel's with each sequence's own lengths (the window's block range and
// edge test take nq / nk, the ALiBi distance and the window edges the sequence's diag = nk - nq), and
// ALiBi slopes [B, H] are indexed by sequence. The window's first visit is block n_end - 1, as the
// plain kernel's, so the edge block's V rows past nk are cleared the same way.
#include "common/sm80.cuh"
#include "common/sm90.cuh"
#include "common/varlen.cuh"
#include "common/variants.cuh"

namespace tileattn {
namespace fwd90 {

namespace s9 = tileattn::sm90;
using u64 = uint64_t;

// wgmma.wait_group 0 placed in one arm of a branch; kArm only makes the asm text differ per arm.
// Where the main loop waits for P_{j-1} V_{j-1} after the softmax, ptxas (NVRTC 13.0 and 13.5)
// hoisted that wait above 54 of the block's 66 MUFU.EX2, so the exponentials no longer ran under
// the P V wgmmas; one wait in each arm of a branch that starts after the last exponential stays
// there (two identical asm statements would be merged back above the branch). The branch must be
// warpgroup-uniform: wait_group is .aligned, every warp of the warpgroup executes the same one.
// The rescale vote is only warp-uniform (one __any_sync per warp), and branching on it let warps
// of one warpgroup wait at different PCs (compute-sanitizer synccheck: "Mismatching warpgroup
// instruction pc between warps", Hopper paged prefill, 2026-12-02): the branch is on a kernel
// argument instead (scale_log2 > 0, which ptxas cannot evaluate; either arm waits the same).
template <int kArm>
__device__ __forceinline__ void wgmma_wait_all_in_arm() {
  asm volatile("wgmma.wait_group.sync.aligned 0; // arm %0\n" ::"n"(kArm) : "memory");
}

// Query rows per CTA: kConsumers warpgroups x 64 (a template parameter: 2, or 3 for the plain
// dense and varlen kernels, ALiBi or softcap alone). setmaxnreg budgets (multiples of 8; x 128 threads,
// summed over the warpgroups, within the 64 K register file):
//   2 consumers: producer 40 + 2 x 232 = 504 per thread slot;
//   3 consumers: producer 32 + 3 x 160 = 512 (per thread: d = 64 at 128 keys S 64 + P 32 + O 32,
//                d = 128 at 80 keys S 40 + P 20 + O 64).
template <int kConsumers>
constexpr int kThreadsOf = 128 * (1 + kConsumers);
template <int kConsumers>
constexpr int kProducerRegsOf = kConsumers == 2 ? 40 : 32;
template <int kConsumers>
constexpr int kConsumerRegsOf = kConsumers == 2 ? 232 : 160;
constexpr int kPanel = 64;            // elements per 128-byte swizzle row
constexpr u32 kSmemLimit = 232448;    // dynamic + static shared memory per block (227 KB)
constexpr int kTurnBarrier = 4;       // named barriers 4, 5: ping-pong turns (1 .. 3: epilogue, 1 + consumer)
constexpr float kLn2 = 0.693147180559945309417f;
constexpr float kNoKeyShift = -1.2676506002282294e30f;  // -2^100: "no key seen yet" (see above)
constexpr float kRescaleThreshold = 8.0f;  // row-max growth (log2 units) absorbed without a rescale

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// After a CTA's producer took its last index from counter[0] (one past the tiles): the grid's last
// CTA to get here resets both words, so the next launch on the stream finds zeros (counter[1]
// counts the CTAs done taking). The first fence orders each CTA's last take before its count, the
// second the reset after the last count.
__device__ __forceinline__ void release_tile_counter(int* counter) {
  __threadfence();
  if (atomicAdd(counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
    __threadfence();
    atomicExch(counter, 0);
    atomicExch(counter + 1, 0);
  }
}

// Which K/V blocks a query tile visits: [n_begin, n_end), visited from n_end - 1 down (the non-causal
// ALiBi-alone kernel: in diagonal_first_block's order); visits [0, n_masked) and [n_unmasked_end,
// n_end - n_begin) need masking (the Nk edge block, and when causal or windowed the blocks that cross
// an edge of some row of the tile; only a window has masked visits at the bottom). n_end = n_begin:
// every row of the tile sees nothing.
struct BlockRange {
  int n_end, n_masked, n_begin, n_unmasked_end;
};
template <bool kCausal, int kBlockN>
__device__ __forceinline__ BlockRange block_range(int m_block, int rows, int seqlen_q, int seqlen_k) {
  const int n_total = (seqlen_k + kBlockN - 1) / kBlockN;
  const int edge = (seqlen_k % kBlockN) != 0 ? 1 : 0;
  if constexpr (!kCausal) {
    return {n_total, edge, 0, n_total};
  } else {
    const int row0 = m_block * rows;                        // the tile's positions: row0 .. row0 + rows - 1
    const int diag = seqlen_k - seqlen_q;                   // query i sees keys j <= i + diag
    const int last_key = min(row0 + rows, seqlen_q) - 1 + diag;  // last key any row sees
    if (last_key < 0) return {0, 0, 0, 0};
    const int n_end = min(n_total, last_key / kBlockN + 1);
    // Block n is unmasked for every row iff its last key is visible to the tile's first row.
    const int first_limit = row0 + diag;
    const int n_unmasked = first_limit + 1 <= 0 ? 0 : min(n_end, (first_limit + 1) / kBlockN);
    const int masked = max(n_end - n_unmasked, n_end == n_total ? edge : 0);
    return {n_end, masked, 0, n_end};
  }
}

// Visit order of the non-causal ALiBi-alone kernel (kDiagonalFirst): the first visit stays block
// n_end - 1 (the masked edge block, if any, comes first as everywhere), then the block holding the
// tile's lowest diagonal key (diag_lo) and those right of it, nearest first, then those left of it,
// nearest first. ALiBi's bias falls with the distance from the diagonal, so after the diagonal block
// a row's max rarely grows and O is rarely rescaled; in the plain order (right to left) every block
// right of the diagonal raised the max of a steep head (> 8 in log2 units per 128 keys from slope 0.04:
// 17 of 32 geometric heads), rescaling O on ~30 % of the visits at d = 64 (ncu, docs/attention_variants.md,
// "Non-causal ALiBi: the diagonal block first": +2-4 % at d = 64 and 128 on the H200).
template <int kBlockN>
__device__ __forceinline__ int diagonal_first_block(int it, int n_end, int diag_lo) {
  if (it == 0) return n_end - 1;
  const int d0 = min(max(diag_lo, 0) / kBlockN, n_end - 2);  // it >= 1 implies n_end >= 2
  const int r = it - 1, right = n_end - 1 - d0;                 // blocks d0 .. n_end - 2 first
  return r < right ? d0 + r : d0 - 1 - (r - right);
}

// The key block of a tile's visit `it`: right to left from n_end - 1, or in diagonal_first_block's
// order (kDiagonalFirst). The producer loads and the consumers read the visits through this one
// function; diag = Nk - Nq of the tile's sequence.
template <bool kDiagonalFirst, int kBlockN>
__device__ __forceinline__ int visit_block(int it, int n_end, int m_block, int rows, int diag) {
  return kDiagonalFirst ? diagonal_first_block<kBlockN>(it, n_end, m_block * rows + diag) : n_end - 1 - it;
}

// How many of a tile's first visits (blocks n_end - 1, n_end - 2, ...) no row of consumer c sees:
// causal, the blocks past the diagonal of its last row (with 192-row tiles and 128-key blocks the
// first consumer's rows end a block or more before the tile's); causal or not, every visit when
// all of its rows lie past Nq (the last tile's third consumer at 2048 queries). The consumer
// releases those visits unread (see "Consumer schedule"). Its 64 rows are positions
// [m_block rows + (64 c) % rows, + min(64, rows)) of one head, or of every packed head when a
// head has fewer than 64 rows in the tile.
template <bool kCausal, int kBlockN>
__device__ __forceinline__ int unseen_visits(int n_end, int m_block, int rows, int c, int seqlen_q, int seqlen_k) {
  const int first = m_block * rows + (c * 64) % rows;
  if (first >= seqlen_q) return n_end;
  if constexpr (!kCausal) {
    return 0;
  } else {
    const int last_key = min(first + min(64, rows), seqlen_q) - 1 + seqlen_k - seqlen_q;
    return last_key < 0 ? n_end : n_end - min(n_end, last_key / kBlockN + 1);
  }
}

// ---- Variants (attention_fwd_variants_sm90; definitions in common/variants.cuh) -----------------
// Compile-time flags (bits of kVariant), so that each combination pays only for what it uses and
// the plain kernel (kVariant = 0) compiles to the code it had.
constexpr int kWindow = 1;   // sliding window; causal is its right edge 0 (kCausal false), except below
constexpr int kSoftcap = 2;  // logit = cap * tanh(scale q.k / cap)
constexpr int kAlibi = 4;    // logit += -slope[b, h] * |i + Nk - Nq - j|
constexpr int kDropout = 32; // P *= keep(b, h, i, j) / (1 - p), keep from Philox (dropout_bits); lse undropped
// Softcap without ALiBi, bf16: the softmax's row max fixed at cap log2(e), the largest logit a capped
// score can have (scores are t = tanh in [-1, 1], scale cap log2 e), instead of the online max: no
// row max, no vote, no O rescale per block. p = 2^(cap log2 e (t - 1)) lies in [2^(-2 cap log2 e), 1];
// the host takes it only where that range, and Nk keys' worth of what ex2.approx.ftz flushes below
// 2^-126, stay far inside bf16's (and fp32's) exponent range (attention_fwd_sm90.fixed_max_applies).
constexpr int kFixedMax = 64;
// With kDropout: the seed and offset are read from VARIANT_PARAMS' rng_state (device memory) by the
// consumers, not taken from the seed / offset parameters (common/variants.cuh, with_rng_state).
constexpr int kRngState = 256;
constexpr int kVariantBits = kWindow | kSoftcap | kAlibi | kDropout | kFixedMax | kRngState;
// ALiBi alone and softcap alone (with or without the fixed max) also exist with kCausal true: a
// causal call without a window takes the plain kernel's causal blocks and mask (block_range,
// apply_mask, unseen visits skipped on three consumers) instead of the window's per-row edges
// (window_range, apply_window), whose extra live state makes WINDOW | ALIBI and WINDOW | SOFTCAP
// spill on three consumers. Softcap's fixed max too: its main loop here is 652 instructions per
// 128-key visit at d = 128 (bf16, 128 x 128 / s2) against the windowed fixed-max kernel's 724 and
// the plain causal kernel's 678, and it has the three-consumer form (455 per 80-key visit, plain
// 505) that the windowed kernel lacks (scripts/sass_loop_census.py, NVRTC 13.5).
template <int kVariant>
constexpr bool kCausalVariant = kVariant == kAlibi || kVariant == kSoftcap || kVariant == (kSoftcap | kFixedMax);
// Layout bit of kVariant (not a variant: the plain kernel's arithmetic on packed sequences; a bit
// of the existing parameter rather than a new template parameter, so that the dense kernels keep
// their mangled names and their cubins stay byte-identical).
constexpr int kVarlen = 8;
constexpr int kPaged = 16;        // packed queries against a paged K/V cache (see the header)
constexpr int kClearBarrier = 6;  // named barrier 6: every consumer cleared the edge block's V rows

// The varlen kernel's trailing parameters (after the plain ones): cu_seqlens_q / cu_seqlens_k
// int32 [B + 1], out [Tq, H, d] (token / head strides in elements) for the per-row stores and the
// rows past the last sequence, and Tq (lse is [H, Tq]).
#define VARLEN_PARAMS                                                                                     \
  const int *__restrict__ cu_seqlens_q, const int *__restrict__ cu_seqlens_k, u16 *__restrict__ out, \
      int64_t out_sr, int64_t out_sh, int total_q
// The paged kernel's: cu_seqlens_q, seqlens_k int32 [B] (keys of each sequence, its queries
// included: they are its last keys), out, its strides, Tq as above, then block_table int32
// [B, max_blocks] (row stride bt_stride), num_blocks and log2(block_size).
#define PAGED_PARAMS                                                                                       \
  const int *__restrict__ cu_seqlens_q, const int *__restrict__ seqlens_k, u16 *__restrict__ out,     \
      int64_t out_sr, int64_t out_sh, int total_q, const int *__restrict__ block_table, int bt_stride, \
      int max_blocks, int num_blocks, int log2_bs
// Both packed layouts' parameters (lens_k: cu_seqlens_k, or paged seqlens_k; the paged fields are
// unused by varlen).
struct Packed {
  const int* cu_q;
  const int* lens_k;
  u16* out;
  int64_t out_sr, out_sh;
  int total_q;
  const int* block_table;
  int bt_stride, max_blocks, num_blocks, log2_bs;
};
__device__ __forceinline__ Packed packed_of(VARLEN_PARAMS) {
  return {cu_seqlens_q, cu_seqlens_k, out, out_sr, out_sh, total_q, nullptr, 0, 0, 0, 0};
}
__device__ __forceinline__ Packed packed_of(PAGED_PARAMS) {
  return {cu_seqlens_q, seqlens_k, out, out_sr, out_sh, total_q, block_table, bt_stride, max_blocks, num_blocks,
          log2_bs};
}
// A packed layout with variants: the layout's parameters, then VARIANT_PARAMS (variants_of below).
__device__ __forceinline__ Packed packed_of(VARLEN_PARAMS, VARIANT_PARAMS) {
  return packed_of(cu_seqlens_q, cu_seqlens_k, out, out_sr, out_sh, total_q);
}
__device__ __forceinline__ Packed packed_of(PAGED_PARAMS, VARIANT_PARAMS) {
  return packed_of(cu_seqlens_q, seqlens_k, out, out_sr, out_sh, total_q, block_table, bt_stride, max_blocks,
                   num_blocks, log2_bs);
}

// Sequence `batch`'s first tokens and lengths for layout kLayout (0 dense, kVarlen, kPaged): dense
// is the batch entry at token 0 (its batch coordinate does the rest); paged keys have no first
// token (their rows come through the block table) and a negative length counts as 0.
template <int kLayout>
__device__ __forceinline__ SeqSpan tile_span(const Packed& pk, int batch, int seqlen_q, int seqlen_k) {
  if constexpr (kLayout == kPaged) {
    const int q0 = __ldg(pk.cu_q + batch);
    return {q0, 0, __ldg(pk.cu_q + batch + 1) - q0, max(__ldg(pk.lens_k + batch), 0)};
  } else {
    return seq_span<kLayout == kVarlen>(pk.cu_q, pk.lens_k, batch, seqlen_q, seqlen_k);
  }
}

// Paged: the cache block that holds key `key` of sequence `batch`, or num_blocks (past the cache
// map's bound: TMA zero-fills the box) when the key is past the sequence's length or the table's
// capacity, or its block id is outside [0, num_blocks): such an id is never dereferenced, and
// page_mask masks its keys as the reference does.
__device__ __forceinline__ int page_block(const Packed& pk, int batch, int key, int nk) {
  const int page = key >> pk.log2_bs;
  const int id = key < nk && page < pk.max_blocks
                     ? __ldg(pk.block_table + static_cast<int64_t>(batch) * pk.bt_stride + page)
                     : pk.num_blocks;
  return id >= 0 && id < pk.num_blocks ? id : pk.num_blocks;
}

// Paged, masked visits of a tile whose sequence has some bad page (see page_block): keys of bad
// pages -> -inf. Columns 8 j + 2 t and 8 j + 2 t + 1 lie in one cache block (block_size >= 16).
template <int kBlockN>
__device__ __forceinline__ void page_mask(float (&s)[kBlockN / 2], int n, int t, const Packed& pk, int batch,
                                          int nk) {
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
    if (page_block(pk, batch, n * kBlockN + 8 * j + 2 * t, nk) == pk.num_blocks) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[4 * j + i] = neg_inf();
    }
  }
}

// Varlen: zero rows [valid, kBlockN) of a V slot ([d/64][kBlockN][64], swizzled within a row, so
// whole rows are cleared whatever the swizzle). `thread` in [0, kThreads): the consumers share the work.
template <int kHeadDim, int kBlockN, int kThreads>
__device__ __forceinline__ void clear_rows(u16* slot, int valid, int thread) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  const int count = (kBlockN - valid) * kChunks;
  for (int idx = thread; idx < count; idx += kThreads) {
    const int r = valid + idx / kChunks, ch = idx % kChunks;
    *reinterpret_cast<uint4*>(slot + ((ch / 8) * kBlockN + r) * 64 + (ch % 8) * 8) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// 16-byte global store under a predicate, not a branch: the varlen epilogue runs between wgmma
// loops, and a data-dependent branch there makes ptxas serialize the wgmmas (C7519).
__device__ __forceinline__ void st_global_if(void* ptr, uint4 val, bool pred) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}\n" ::"l"(ptr),
      "r"(val.x), "r"(val.y), "r"(val.z), "r"(val.w), "r"(static_cast<int>(pred))
      : "memory");
}

// Varlen: a consumer's 64 staged O rows (sO: its rows of panel 0 of sQ, 128B-swizzled) to global,
// each row only if its position is inside the sequence: rows of another sequence are never written.
// Tile row 64 c + r is head head0 + (64 c + r) / rows, position pos_base + (64 c + r) % rows.
template <int kHeadDim, int kBlockM>
__device__ __forceinline__ void store_rows_masked(const u16* sO, const Packed& vl, int q0, int nq, int pos_base,
                                                  int rows, int head0, int c, int tid) {
  constexpr int kChunks = kHeadDim / 8;
  static_assert((64 * kChunks) % 128 == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < 64 * kChunks / 128; ++i) {
    const int idx = tid + 128 * i, r = idx / kChunks, ch = idx % kChunks, tr = 64 * c + r;
    const int pos = pos_base + tr % rows;
    const uint4 val = *reinterpret_cast<const uint4*>(sO + ((ch / 8) * kBlockM + r) * 64 + ((ch % 8) ^ (r % 8)) * 8);
    st_global_if(vl.out + (q0 + pos) * vl.out_sr + (head0 + tr / rows) * vl.out_sh + ch * 8, val, pos < nq);
  }
}

// Packed layouts: rows cu_seqlens_q[B] .. Tq - 1 of every head (token padding, no sequence) get
// out 0 and lse -inf, so no output element is left unwritten whatever the lengths on the device
// are. Run by the consumer warpgroups of every CTA after their tiles (`kThreads` threads, `thread`
// in [0, kThreads); the producer warpgroup's idle warps have 40 registers, too few): the grid's
// threads take whole rows (all heads, 16-byte stores, no division).
template <int kHeadDim, int kThreads>
__device__ __forceinline__ void zero_rows_past_last(const Packed& vl, float* lse, int batches, int heads, int thread) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t row = __ldg(vl.cu_q + batches) + static_cast<int64_t>(blockIdx.x) * kThreads + thread;
       row < vl.total_q; row += stride) {
    for (int h = 0; h < heads; ++h) {
      u16* const dst = vl.out + row * vl.out_sr + h * vl.out_sh;
#pragma unroll
      for (int ch = 0; ch < kHeadDim / 8; ++ch) *reinterpret_cast<uint4*>(dst + ch * 8) = make_uint4(0u, 0u, 0u, 0u);
      lse[static_cast<int64_t>(h) * vl.total_q + row] = neg_inf();
    }
  }
}

// block_range for a window: the keys any row of the tile sees are [window_lo(first row),
// window_hi(last row)] (both edges move monotonically with the row), so the blocks below and above
// them are never loaded and the cost scales with the window. A visited block needs the per-score
// test when some row's upper edge cuts it (from the top: its last key is past the first row's
// upper edge, which includes the Nk edge block) or some row's lower edge does (from the bottom: its
// first key is below the last row's lower edge).
template <int kBlockN>
__device__ __forceinline__ BlockRange window_range(int m_block, int rows, int seqlen_q, int seqlen_k,
                                                   const Variants& va) {
  const int diag = seqlen_k - seqlen_q;
  const int first = m_block * rows, last = min(first + rows, seqlen_q) - 1;  // the tile's positions
  const int key_lo = window_lo(va, first, diag), key_hi = window_hi(va, last, diag, seqlen_k);
  if (key_hi < key_lo) return {0, 0, 0, 0};
  const int n_begin = key_lo / kBlockN, n_end = key_hi / kBlockN + 1, iters = n_end - n_begin;
  const int hi_first = window_hi(va, first, diag, seqlen_k);
  const int hi_cut = hi_first < 0 ? 0 : (hi_first + 1) / kBlockN;            // blocks < hi_cut: below every upper edge
  int masked = n_end - max(hi_cut, n_begin);                                 // 0 <= masked <= iters
  const int lo_cut = (window_lo(va, last, diag) + kBlockN - 1) / kBlockN;   // blocks >= lo_cut: above every lower edge
  const int lo_from = n_end - lo_cut;                                        // first visit cut by a lower edge
  if (lo_from <= 0) masked = iters;
  return {n_end, masked, n_begin, max(min(lo_from, iters), masked)};
}

// Window test of one edge block (accumulator layout as apply_mask): key j is visible to position i
// iff i + diag - left <= j <= min(Nk - 1, i + diag + right).
template <int kBlockN>
__device__ __forceinline__ void apply_window(float (&s)[kBlockN / 2], int n, const int (&pos)[2], int t, int seqlen_k,
                                             int diag, const Variants& va) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int lo = pos[h] + diag - va.left, hi = min(seqlen_k - 1, pos[h] + diag + va.right);
    const int key0 = n * kBlockN + 2 * t;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = key0 + 8 * j + e;
        if (key < lo || key > hi) s[4 * j + 2 * h + e] = neg_inf();
      }
  }
}

// Softcap kernels: raw scores q.k of block n -> tanh(scale q.k / cap) (softcap alone, with or without
// a window: the softmax's scale is then cap_out = cap * log2(e), folded into its exponent FFMA the
// way the plain kernel folds scale_log2, and cap_out > 0 keeps the row max of t the row max of the
// logits), or, with ALiBi, logits in log2 units (the softmax then runs with scale 1): cap_out * tanh
// plus the bias slope[h] * |i + diag - j| (slope[h] = -log2(e) * the slope of row h's head). The same
// hardware tanh as the sm_80 kernels and the backwards (variants.cuh); a backward's logit cap_out * t
// differs from the folded FFMA's by at most one rounding, as the plain kernels' scale does. The ALiBi distance of column 2t + 8j + e is
// dist0 - (8j + e) with dist0 converted once per row and block: an I2F per score would run on the
// 16/clk/SM conversion pipe, as slow as MUFU (exact while |i + diag - j| < 2^24).
template <int kBlockN, int kVariant>
__device__ __forceinline__ void variant_logits(float (&s)[kBlockN / 2], int n, const int (&pos)[2], int t, int diag,
                                               const Variants& va, const float (&slope)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float dist0 = static_cast<float>(pos[h] + diag - (n * kBlockN + 2 * t));
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float t = softcap_tanh(va, s[4 * j + 2 * h + e]);
        if constexpr ((kVariant & kAlibi) != 0)
          s[4 * j + 2 * h + e] = fmaf(slope[h], fabsf(dist0 - static_cast<float>(8 * j + e)), va.cap_out * t);
        else
          s[4 * j + 2 * h + e] = t;
      }
  }
}

// ALiBi without softcap (kAlibiRaw): the scores stay in raw q.k units, where the softmax's scale
// folds into its exponent FFMA as in the plain kernel, and gain the bias in those units,
// slope_raw[h] = -slope / scale of row h's head, times |i + diag - j|:
//   crossing (side 0: the block holds keys on both sides of some row's diagonal key i + diag, or
//     is masked): x = s + slope_raw |dist0 - c|, c = 8j + e: an FADD and an FFMA per score;
//   one-sided (side +1: every key at or left of every row's diagonal, |dist| = dist0 - c; side -1:
//     every key at or right of it, |dist| = c - dist0): x = s + k c with k = -side slope_raw, a
//     compile-time c and one FFMA per score, and the constant R = side slope_raw dist0 goes to
//     softmax_step as the shift of this thread's scores of the row (dist0 holds the thread's column
//     2t, so the 4 threads of a row have different shifts: each adds its own before the row max).
// Per score that is 1 FP32 instruction beyond the plain kernel on one-sided blocks (all but the ~2
// per tile that the diagonal band crosses) instead of 3 (docs/attention_variants.md, "ALiBi on
// one-sided blocks"). The logits equal the softcap path's up to fp32 rounding of the same sum.
template <int kBlockN>
__device__ __forceinline__ void alibi_scores(float (&s)[kBlockN / 2], float (&shift)[2], int n, const int (&pos)[2],
                                             int t, int diag, int side, const float (&slope_raw)[2]) {
  float dist0[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) dist0[h] = static_cast<float>(pos[h] + diag - (n * kBlockN + 2 * t));
  if (side == 0) {  // block-uniform: one of the two loops runs
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) {
      const int h = (i >> 1) & 1;
      s[i] = fmaf(slope_raw[h], fabsf(dist0[h] - static_cast<float>(8 * (i / 4) + (i & 1))), s[i]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) shift[h] = 0.f;
  } else {
    float k[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      k[h] = side > 0 ? -slope_raw[h] : slope_raw[h];
      shift[h] = -k[h] * dist0[h];
    }
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) s[i] = fmaf(k[(i >> 1) & 1], static_cast<float>(8 * (i / 4) + (i & 1)), s[i]);
  }
}

// ---- Dropout (kDropout) -------------------------------------------------------------------------
// Keep bits of this thread's scores of block n: bit i % 32 of keep[i / 32] is s[i], i = 4 j + 2 h + e
// (row g + 8 h at position pos[h], key n kBlockN + 8 j + 2 t + e). The counters are variants.cuh's
// (dropout_bits), a function of (b * H + head, position, key) alone, so neither the tile shape nor
// GQA packing (a row's head is head0 + (r0 + 8 h) / rows) changes the mask. One Philox call per
// row and 32-key group gives the 8 uniforms of the thread's 8 scores in it (key 32 G + 8 w + 2 t + e
// is half e of word w): 2 kBlockN / 32 calls per block. Nothing here reads S, so the caller runs it
// between issuing the block's wgmmas and waiting for them: the 28 integer instructions per call
// (7 rounds of 2 IMAD.WIDE.U32 + 2 three-input LOP3; the key schedule is warp-uniform and stays in
// uniform registers) issue while the tensor cores work.
// A 16-bit half >= drop_thr is compared in the word's upper half: (word << 16) for the low half,
// the word itself for the high half, against drop_thr << 16 (one shift, no mask or second shift).
template <int kBlockN>
__device__ __forceinline__ void dropout_keep_bits(u32 (&keep)[kBlockN / 64], int n, const int (&pos)[2], int bh0,
                                                  int r0, int rows, int t, const Variants& va) {
  const unsigned thr16 = va.drop_thr << 16;
#pragma unroll
  for (int w = 0; w < kBlockN / 64; ++w) keep[w] = 0u;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int bh = bh0 + (r0 + 8 * h) / rows;
#pragma unroll
    for (int grp = 0; grp < kBlockN / 32; ++grp) {
      const uint4 bits = dropout_bits(va, bh, pos[h], n * (kBlockN / 32) + grp, t);
      const unsigned words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const int i = 4 * (4 * grp + w) + 2 * h;  // s index of (row h, key 32 grp + 8 w + 2 t)
        keep[i / 32] |= (words[w] << 16 >= thr16 ? 1u : 0u) << (i % 32);
        keep[i / 32] |= (words[w] >= thr16 ? 1u : 0u) << (i % 32 + 1);
      }
    }
  }
}

// P (after the row sums took it, as the sm_80 kernels do: lse and the normalization stay those of
// the undropped softmax) -> 0 where dropped; the 1 / (1 - p) goes into the epilogue's 1 / l.
template <int kBlockN>
__device__ __forceinline__ void apply_dropout(float (&s)[kBlockN / 2], const u32 (&keep)[kBlockN / 64]) {
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i)
    if (((keep[i / 32] >> (i % 32)) & 1u) == 0u) s[i] = 0.f;
}

// Tile t -> (position block, first head, batch), in work order (see the header). m_blocks =
// ceil(Nq / R), groups = heads / pack; a unit u = batch * groups + head group.
struct Tile {
  int m_block, head0, batch;
};
template <bool kCausal>
__device__ __forceinline__ Tile tile_coords(int t, int m_blocks, int groups, int pack, int batches, int l2_group) {
  int m_block, unit;
  if constexpr (kCausal) {
    const int per_group = l2_group * m_blocks;         // tiles of a full L2 group
    const int first = (t / per_group) * l2_group;      // its first unit
    const int size = min(l2_group, groups * batches - first);  // the last group may be smaller
    const int i = t % per_group;
    m_block = m_blocks - 1 - i / size;                  // longest first inside the group
    unit = first + i % size;
  } else {                                              // the position blocks of one unit back to back
    m_block = t % m_blocks;
    unit = t / m_blocks;
  }
  return {m_block, (unit % groups) * pack, unit / groups};
}

// Per-thread view of one consumer's m64 x N accumulator (sm90.cuh): element 4j + 2h + e is row
// g + 8h of the thread's warp slice, column 8j + 2t + e. pos[h]: that row's query position.
template <int kBlockN, bool kCausal>
__device__ __forceinline__ void apply_mask(float (&s)[kBlockN / 2], int n, const int (&pos)[2], int t, int seqlen_k,
                                           int diag) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int limit = kCausal ? min(seqlen_k - 1, pos[h] + diag) : seqlen_k - 1;  // last visible key
    const int key0 = n * kBlockN + 2 * t;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (key0 + 8 * j + e > limit) s[4 * j + 2 * h + e] = neg_inf();
  }
}

// 2^x on the FP32 pipe, for softcap at d = 64, where the exponential unit is the bound: two MUFU
// per score (tanh, EX2) at 16 per SM and clock. H200 (2026-12-04, ncu, B=4 H=32 N=8192 bf16, the
// fixed-max kernel at 192 x 128): XU 81 % of peak, tensor pipe 40 %, FP32 pipe 16 %, issue 37 %,
// the top stall "mio throttle" (MUFU's queue); the plain kernel XU 60 %, tensor 60 %. Softcap's two
// MUFU per score cannot then run faster than 0.83 of plain, so part of the EX2s move here.
// x = j + f with j = rint(x), read from the low mantissa bits of x + 1.5 * 2^23, and f = x - j in
// [-0.5, 0.5]; 2^f by a degree-3 polynomial (relative error <= 7.5e-5 evaluated in fp32, a 26th of
// a bf16 P's rounding, a 6th of fp16's; tests/test_variants_cpu.py checks it against float64); 2^j
// added to the exponent field. Seven instructions (3 FADD, 3 FFMA, 1 LEA) against one MUFU.EX2.
// Domain: x in [-125, 2^22): the fixed-max kernels, its only users, have x = cap_out t - cap log2 e
// >= -114 (fixed_max_applies) on unmasked visits (masked scores are -inf, which this does not map to 0).
__device__ __forceinline__ float exp2_poly(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: x + kRound lies in [2^23, 2^24), whose ulp is 1
  const float t = __fadd_rn(x, kRound);                // bits(t) = bits(kRound) + rint(x)
  const float f = __fsub_rn(x, __fsub_rn(t, kRound));  // x - rint(x), exact
  const float p = fmaf(fmaf(fmaf(0.0551714599f, f, 0.242610857f), f, 0.693260968f), f, 0.999928117f);
  // bits(kRound) << 23 is 0 mod 2^32, so bits(t) << 23 = rint(x) << 23: 2^rint(x) in the exponent field
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// Online softmax of one score block, in place: s <- p = 2^(s * scale_log2 - m); m, l updated.
// kShifted: this thread's scores of row h are s + shift[h] (ALiBi's constant on one-sided blocks,
// alibi_scores; it differs between the row's 4 threads).
// The row max m only moves when some row of the warp would otherwise see p > 2^kRescaleThreshold
// (one vote per warp and block): a stale max is exact, because O, l and lse all use the same m,
// and p <= 2^8 is far from fp16/bf16 overflow. Returns whether it moved (warp-uniform); then
// alpha[h] = 2^(m_old - m_new) is what O must be multiplied by before P V is added to it (l is
// rescaled here). After a row's first blocks the O rescale (d / 2 FMULs per thread, on the path
// between the P V wait and the next wgmma issue) is almost always skipped.
// kFixed (kFixedMax kernels): m is the constant cap log2 e set at the tile's start; only the
// exponentials and the row sums remain, and O is never rescaled (returns false).
// kFmaPer8 (kFixed only: kExp2FmaPer8 in the kernel): on an unmasked visit (`unmasked`, a constant
// at every call site) the scores of kFmaPer8 of every 8 groups of 4 take exp2_poly on the FP32 pipe
// instead of MUFU.EX2 (see exp2_poly for why).
template <int kBlockN, bool kShifted = false, bool kFixed = false, int kFmaPer8 = 0>
__device__ __forceinline__ bool softmax_step(float (&s)[kBlockN / 2], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2], float scale_log2, const float (&shift)[2],
                                             bool unmasked = false) {
  static_assert(kFmaPer8 == 0 || kFixed, "exp2_poly's domain needs the fixed max's bound on the exponents");
  auto exp2_of = [&](int i, float x) {  // i: the score's index (a constant after unrolling)
    return kFmaPer8 > 0 && unmasked && (i / 4) % 8 < kFmaPer8 ? exp2_poly(x) : fast_exp2(x);
  };
  if constexpr (kFixed) {
    static_assert(!kShifted, "a fixed row max has no ALiBi shift");
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) {
      const int h = (i >> 1) & 1;
      s[i] = exp2_of(i, fmaf(s[i], scale_log2, -m[h]));
      sum[h] += s[i];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] += sum[h];
    return false;
  }
  float blk[2];
  bool grow = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = neg_inf();
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
    // scale_log2 > 0; -inf for a row that sees nothing here
    // (the shift differs between the 4 threads of a row, whose keys differ by 2t: added before the
    // quad's max, so that the row max is the max of the shifted scores)
    blk[h] = quad_max(kShifted ? mx + shift[h] : mx) * scale_log2;
    grow |= blk[h] - m[h] > kRescaleThreshold;
  }
  const bool rescale = __any_sync(0xffffffffu, grow);
  if (rescale) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m[h], blk[h]);
      alpha[h] = fast_exp2(m[h] - m_new);  // 0 on a row's first visible key, 1 if it sees nothing
      m[h] = m_new;
      l[h] *= alpha[h];
    }
  }
  // The exponent's row offset: -m, or shift * scale_log2 - m in one rounding (kShifted: a large
  // shift and m cancel, and fmaf rounds only their difference).
  float offset[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) offset[h] = kShifted ? fmaf(shift[h], scale_log2, -m[h]) : -m[h];
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) {
    const int h = (i >> 1) & 1;
    s[i] = exp2_of(i, fmaf(s[i], scale_log2, offset[h]));
    sum[h] += s[i];
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) l[h] += sum[h];
  return rescale;
}

// fp32 P (accumulator layout) -> 16-bit register-A fragments, one per k16 step of O += P V.
template <int kBlockN, bool kIsBF16>
__device__ __forceinline__ void pack_p(u32 (&p)[kBlockN / 16][4], const float (&s)[kBlockN / 2]) {
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) p[kk][r] = pack2<kIsBF16>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

template <int kHeadDim>
__device__ __forceinline__ void rescale_o(float (&o)[kHeadDim / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
}

// The Variants of a variant kernel's trailing parameters (VARIANT_PARAMS' order and widths).
__device__ __forceinline__ Variants variants_of(float scale_log2, VARIANT_PARAMS) { return VARIANTS_FROM_PARAMS; }
// ... of a packed layout's variant kernel: the layout's parameters first (packed_of).
__device__ __forceinline__ Variants variants_of(float scale_log2, VARLEN_PARAMS, VARIANT_PARAMS) {
  return VARIANTS_FROM_PARAMS;
}
__device__ __forceinline__ Variants variants_of(float scale_log2, PAGED_PARAMS, VARIANT_PARAMS) {
  return VARIANTS_FROM_PARAMS;
}

}  // namespace fwd90

// tmap_q: q [B, H, Nq, d] as a 4-D map (d, Nq, H, B), box (64, R, pack, 1) with R = 128 / pack,
// 128B swizzle, zero fill. pack: 1 or a divisor of kv_group that divides 128 (GQA packing).
// tmap_k, tmap_v: k / v [B, Hkv, Nk, d], box (64, kBlockN, 1, 1). tmap_o: out [B, H, Nq, d], box
// (64, min(R, 64), 64 / min(R, 64), 1). lse: [B, H, Nq] fp32 contiguous, natural log. kv head = head / kv_group.
// l2_group: units per L2 group (causal tile order, >= 1). tile_counter: nullptr (CTA c takes tiles
// c, c + gridDim.x, ...) or two zeroed ints in global memory that no other kernel uses while this
// one runs (CTAs take tiles from counter[0]; the kernel leaves both words 0 again).
// 1-D grid of at most ceil(Nq / R) * (H / pack) * B <= 2^30 CTAs (fewer = persistent), 384 threads;
// dynamic shared memory 2 d (128 + 2 kStages kBlockN) + 1024 (+ 2 d 128 for sO where it fits).
//
// Variants (kVariant: a non-empty set of bits fwd90::kWindow, kSoftcap, kAlibi, kDropout; kCausal
// false, causal folded into win_right, except ALiBi or softcap alone, fwd90::kCausalVariant, which
// also exist with kCausal true and then ignore win_left / win_right): the parameters above, then VARIANT_PARAMS
// (common/variants.cuh), as the trailing pack `variant_params` (the host names their types in the
// instantiation). The plain kernel (kVariant = 0) has an empty pack: its parameters and code are
// what they were before the variants existed (a separate variant entry point calling a shared body
// changed the plain kernel's SASS). Without kDropout, seed, offset, drop_thr and drop_scale are
// ignored; with it (dense only, kBlockN a multiple of 64), P is multiplied by the keep mask of
// tileattn.dropout.dropout_mask(seed, offset, B, H, Nq, Nk, p) (drop_thr = round(p * 65536)) after
// the row sums took it, and O by drop_scale = 1 / (1 - p). The lse written is that of the variant
// logits before dropout (natural log), as the sm_80 variant backward reads it.
//
// Varlen (kVariant == fwd90::kVarlen, plain arithmetic, causal or not; see the header): tmap_q /
// tmap_o over q / out [Tq, H, d] as [1, H, Tq, d], tmap_k / tmap_v over k / v [Tk, Hkv, d] as
// [1, Hkv, Tk, d] (boxes as above); batches = B, seqlen_q = max_seqlen_q (the tile grid),
// seqlen_k unused; then VARLEN_PARAMS. lse [H, Tq]. Grid: up to ceil(max_seqlen_q / R) * (H / pack)
// * B CTAs (one per tile, or fewer: persistent), at least 1.
// Paged (kVariant == fwd90::kPaged): as varlen with PAGED_PARAMS; tmap_k / tmap_v over k_cache /
// v_cache [num_blocks, block_size, Hkv, d] as [num_blocks, Hkv, block_size, d], box (64,
// min(block_size, kBlockN), 1, 1).
// Packed with variants (kVariant == kVarlen or kPaged | a set of kWindow, kSoftcap, kAlibi; kCausal
// false): the layout's parameters, then VARIANT_PARAMS (dropout stays dense).
template <int kHeadDim, int kBlockN, int kStages, bool kPingPong, bool kCausal, bool kIsBF16, int kConsumers = 2,
          int kVariant = 0, class... VariantParams>
__global__ void __launch_bounds__(fwd90::kThreadsOf<kConsumers>, 1)
    attention_fwd_sm90(const __grid_constant__ sm90::TmaDescriptor tmap_q,
                       const __grid_constant__ sm90::TmaDescriptor tmap_k,
                       const __grid_constant__ sm90::TmaDescriptor tmap_v,
                       const __grid_constant__ sm90::TmaDescriptor tmap_o, float* __restrict__ lse, int batches,
                       int heads, int kv_group, int pack, int l2_group, int seqlen_q, int seqlen_k,
                       float scale_log2, int* __restrict__ tile_counter, VariantParams... variant_params) {
  using namespace fwd90;
  constexpr int kLayout = kVariant & (kVarlen | kPaged);  // 0 dense, kVarlen or kPaged
  constexpr int kBits = kVariant & kVariantBits;          // the variants
  constexpr bool kPagedLayout = kLayout == kPaged;
  constexpr bool kVarlenLayout = kLayout != 0;            // packed queries (varlen or paged)
  constexpr int kLayoutParams = kLayout == kVarlen ? 6 : kPagedLayout ? 11 : 0;  // VARLEN_PARAMS, PAGED_PARAMS
  static_assert((kVariant & ~(kVariantBits | kVarlen | kPaged)) == 0 && kLayout != (kVarlen | kPaged) &&
                    sizeof...(VariantParams) == kLayoutParams + (kBits != 0 ? 11 : 0),
                "kVariant: a set of kWindow | kSoftcap | kAlibi | kDropout and at most one layout bit; the "
                "trailing parameters: the layout's (VARLEN_PARAMS, PAGED_PARAMS), then VARIANT_PARAMS with variants");
  static_assert(!kVarlenLayout || ((kBits & ~(kWindow | kSoftcap | kAlibi | kDropout | kRngState)) == 0 &&
                                    (kBits == 0 || !kCausal)),
                "packed layouts: window, softcap, ALiBi and (varlen) dropout only (causal as the window's right edge 0)");
  static_assert((kVariant & kRngState) == 0 || (kVariant & kDropout) != 0, "kRngState: a dropout kernel's");
  static_assert((kVariant & kDropout) == 0 || (!kPagedLayout && kBlockN % 64 == 0),
                "dropout: dense or varlen layout; whole 32-key Philox groups and whole keep words (64 scores) per block");
  static_assert(!kPagedLayout || (kBlockN & (kBlockN - 1)) == 0,
                "paged: kBlockN a power of two (whole cache blocks)");
  static_assert(!kPagedLayout || (kBlockN / 16) * (kHeadDim / 64) <= 32,
                "paged: at most one K / V box per lane of the producer warp (16-row boxes x 64-column panels)");
  static_assert((kVariant & kVariantBits) == 0 || !kCausal || kCausalVariant<kVariant>,
                "variants: causal is the window's right edge 0 (kCausal only for ALiBi or softcap alone, "
                "softcap with or without the fixed max)");
  Variants va{};
  if constexpr (kBits != 0) va = variants_of(scale_log2, variant_params...);
  Packed vl{};
  if constexpr (kVarlenLayout) vl = packed_of(variant_params...);
  constexpr bool kWindowed = (kVariant & kWindow) != 0;
  constexpr bool kLogits = (kVariant & kSoftcap) != 0;  // scores become tanh or log2-unit logits first
  constexpr bool kCapFolded = kLogits && (kVariant & kAlibi) == 0;  // scores are tanh, scale cap_out
  constexpr bool kAlibiRaw = (kVariant & (kSoftcap | kAlibi)) == kAlibi;  // ALiBi in raw units (alibi_scores)
  constexpr bool kDropped = (kVariant & kDropout) != 0;
  constexpr bool kFixed = (kVariant & kFixedMax) != 0;
  // Softcap with the fixed max at d = 64: kExp2FmaPer8 of every 8 exponentials of an unmasked visit on
  // the FP32 pipe (exp2_poly), the rest on MUFU with the tanh. H200, 2026-12-04 (session 27, call 2,
  // scripts/fwd_sm90_softcap_kernels.py, B=4 H=32 bf16, median of 6 rounds in two processes per tree;
  // docs/attention_variants.md "Softcap's exponentials at d = 64, again"), ratio to plain for 0 / 2 / 3
  // / 4 of 8: non-causal 2048 0.772 / 0.794 / 0.797 / 0.789, 8192 0.757 / 0.770 / 0.785 / 0.781; causal
  // (kCausal, 192 x 96) 2048 0.788 / 0.814 / 0.836 / 0.822, 8192 0.755 / 0.769 / 0.793 / 0.769. The
  // online-max kernels lost 1-5 points at every share (their max and rescale already fill the issue
  // slots the polynomial needs) and keep MUFU. Not at the three-consumer 128-key tile (192 x 128):
  // there any share spills 8-32 bytes (NVRTC 13.5), so it keeps MUFU too; 96-key blocks fit, and the
  // non-causal fixed max takes them (FIXED_MAX_WIDE: 0.715-0.747 -> 0.757-0.762 of plain, call 5).
  // At d = 128 (both pipes at 73 %) 20 % and 40 % of the exponentials moved measured within the
  // spread (call 7): d = 128 keeps MUFU.
  constexpr int kExp2FmaPer8 = kFixed && kHeadDim == 64 && (kConsumers == 2 || kBlockN <= 96) ? 3 : 0;
  static_assert(!kFixed || (kIsBF16 && ((kVariant & ~kFixedMax) == kSoftcap || (kVariant & ~kFixedMax) == (kWindow | kSoftcap))),
                "kFixedMax: bf16 softcap alone or with a window (the fixed max is softcap's bound; fp16 P underflows)");
  // Consumers release the leading visits none of their rows sees (unseen_visits): the plain dense
  // kernel with three consumers (no ping-pong: the consumers need not take the same turns), and the
  // causal ALiBi / softcap kernels on three consumers (whose unseen visits are the plain kernel's). H200,
  // 2026-12-03, call H2, TFLOP/s without / with at d = 64, 192 x 128 / s3: causal 343 / 365 (N =
  // 2048) and 422 / 440 (4096), non-causal 452 / 468 (2048: the last tile's third consumer has no
  // rows). The two-consumer kernels gained nothing measurable (d = 256 causal 128 x 64 / s2 526 /
  // 526 and 614 / 619; d = 128 non-causal 2048 within its round-to-round spread) and keep their code.
  constexpr bool kSkipUnseen = kConsumers == 3 && (kVariant == 0 || (kCausal && kCausalVariant<kVariant>));
  // Tile order: the causal one (longest tiles first) for windows too, whose first tiles see fewer keys.
  constexpr bool kReverse = kCausal || kWindowed;
  constexpr bool kDiagonalFirst = kVariant == kAlibi && !kCausal;  // diagonal_first_block's visit order
  // The softmax's scale: cap_out for softcap alone (variant_logits leaves tanh), 1 with ALiBi too
  // (variant_logits made log2-unit logits).
  const float sl2 = kCapFolded ? va.cap_out : kLogits ? 1.f : scale_log2;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dim 64, 128 or 256");
  // Paged with three consumers spills 16 bytes (NVRTC 13.5): its producer warp needs more than 32 registers.
  // ALiBi alone (non-causal, or causal with kCausal) fits 160 registers too (its extra live state:
  // the two held slopes and the two one-sided shifts): 0 spills at WIDE_DEFAULTS' non-causal tiles
  // and CAUSAL_VARIANT_WIDE's (NVRTC 13.5). The windowed ALiBi kernel spills there (d = 128 192 x 80: 56 bytes of spill stores,
  // d = 64 192 x 128: 244) and keeps two consumers. Softcap alone (its logits computed in place, tanh
  // by tanh.approx) fits too: 0 spills at both tiles (NVRTC 13.5).
  constexpr bool kThreeConsumerForm =
      kVariant == 0 || kVariant == kVarlen || kVariant == kAlibi || (kVariant & ~kFixedMax) == kSoftcap;
  static_assert(kConsumers == 2 || (kConsumers == 3 && kThreeConsumerForm && !kPingPong),
                "three consumer warpgroups: the plain dense and varlen kernels, ALiBi or softcap alone, "
                "without ping-pong");
  constexpr int kBlockM = 64 * kConsumers;                   // query rows per tile
  static_assert(sm90::wgmma_n_supported(kBlockN) && kBlockN % 16 == 0,
                "kBlockN is the wgmma N of S = Q K^T (sm90.cuh) and the K of O += P V (k16 steps)");
  static_assert(kStages >= 2, "at least double buffering");
  constexpr int kPanels = kHeadDim / kPanel;                 // 64-column panels per row
  constexpr u32 kQBytes = kBlockM * kHeadDim * 2;
  constexpr u32 kKVBytes = kBlockN * kHeadDim * 2;           // one K or V block (full box, always)
  constexpr int kKSteps = kHeadDim / 16;                     // k16 steps of S = Q K^T
  constexpr int kPSteps = kBlockN / 16;                      // k16 steps of O += P V
  // Arrivals that release sQ (q_empty) and a V slot (v_empty): one thread per consumer, or, with
  // the packed layouts, every consumer thread (see "Packed queries" in the header: their threads
  // write V slots and read sQ with ordinary instructions before the next TMA copy into them).
  constexpr int kEmptyCount = kVarlenLayout ? kConsumers * 128 : kConsumers;
  // O staged in its own buffer when it fits (see "Shared memory" in the header).
  constexpr bool kOwnO = 2 * kQBytes + 2 * kStages * kKVBytes + 1024 + 256 <= kSmemLimit;  // 256: static mbarriers

  extern __shared__ uint8_t smem_raw[];
  __shared__ uint64_t q_full, q_empty, k_full[kStages], v_full[kStages], k_empty[kStages], v_empty[kStages];
  __shared__ uint64_t sched_full[2], sched_empty[2];  // the tile handed to the consumers (see the header)
  __shared__ int sched_tile[2];
  uint8_t* const smem = smem_raw + ((1024 - (s9::smem_u32(smem_raw) & 1023)) & 1023);
  u16* const sQ = reinterpret_cast<u16*>(smem);             // [kPanels][128][64]
  u16* const sK = sQ + kBlockM * kHeadDim;                   // [kStages][kPanels][kBlockN][64]
  u16* const sV = sK + kStages * kBlockN * kHeadDim;         // [kStages][kPanels][kBlockN][64]
  u16* const sO = kOwnO ? sV + kStages * kBlockN * kHeadDim : sQ;  // [kPanels][128][64]

  const int rows = kBlockM / pack;                           // R: positions per tile (per head)
  const int m_blocks = (seqlen_q + rows - 1) / rows;
  const int groups = heads / pack;
  const int num_tiles = m_blocks * groups * batches;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    s9::tma_prefetch_descriptor(&tmap_q);
    s9::tma_prefetch_descriptor(&tmap_k);
    s9::tma_prefetch_descriptor(&tmap_v);
    s9::tma_prefetch_descriptor(&tmap_o);
    s9::mbar_init(&q_full, 1);
    s9::mbar_init(&q_empty, kEmptyCount);
    for (int s = 0; s < 2; ++s) {
      s9::mbar_init(&sched_full[s], 1);
      s9::mbar_init(&sched_empty[s], kConsumers * 128);
    }
    for (int s = 0; s < kStages; ++s) {
      s9::mbar_init(&k_full[s], 1);
      s9::mbar_init(&v_full[s], 1);
      s9::mbar_init(&k_empty[s], kConsumers);
      s9::mbar_init(&v_empty[s], kEmptyCount);
    }
    s9::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------ producer warpgroup
    s9::setmaxnreg_dec<kProducerRegsOf<kConsumers>>();
    // One thread issues every copy; paged, the whole first warp walks the tiles (every lane the same
    // waits) and each lane issues one K / V box of a visit (see the paged branch below), lane 0 the
    // rest. So the dense and varlen kernels keep their one-thread producer.
    const int producer_lane = threadIdx.x;
    if (kPagedLayout ? producer_lane < 32 : producer_lane == 0) {
      // The tile after t: t + gridDim.x, or, with a tile counter (persistent grids), the next index
      // the grid-wide counter hands out (each once, in order: CTAs that finish early take more).
      auto next_tile = [&](int t) {
        if (tile_counter == nullptr) return t + static_cast<int>(gridDim.x);
        int n = 0;
        if (producer_lane == 0) n = static_cast<int>(gridDim.x) + atomicAdd(tile_counter, 1);
        return kPagedLayout ? __shfl_sync(0xffffffffu, n, 0) : n;
      };
      int g = 0;  // K/V visits so far, across this CTA's tiles: ring slot and phase
      int t = blockIdx.x;
      for (int i = 0;; ++i) {  // i: tiles so far: the q_full / q_empty and sched_* phases
        // This CTA's next tile with rows (varlen: a tile past its sequence's end is skipped), and its
        // sequence (dense: the whole batch entry at token 0, the batch coordinate below).
        Tile tile{};
        SeqSpan span{};
        for (; t < num_tiles; t = next_tile(t)) {
          tile = tile_coords<kReverse>(t, m_blocks, groups, pack, batches, l2_group);
          span = tile_span<kLayout>(vl, tile.batch, seqlen_q, seqlen_k);
          if (!kVarlenLayout || tile.m_block * rows < span.nq) break;
        }
        // Hand it (-1: none left) to the consumers in slot i % 2, once they have read its last use.
        if (i >= 2) s9::mbar_wait(&sched_empty[i & 1], ((i >> 1) - 1) & 1);
        if (producer_lane == 0) {
          sched_tile[i & 1] = t < num_tiles ? t : -1;
          s9::mbar_arrive(&sched_full[i & 1]);  // release: the store above before the consumers' read
        }
        if (t >= num_tiles) break;
        const int tma_batch = kVarlenLayout ? 0 : tile.batch;
        const BlockRange range = kWindowed ? window_range<kBlockN>(tile.m_block, rows, kVarlenLayout ? span.nq : seqlen_q,
                                                                   kVarlenLayout ? span.nk : seqlen_k, va)
                                           : block_range<kCausal, kBlockN>(tile.m_block, rows, span.nq, span.nk);
        const int kv_head = tile.head0 / kv_group;                // the same for all `pack` heads
        // Q always (even for a fully masked tile): without sO the epilogue stages O in sQ, so the Q
        // copy must have landed before anyone writes there. sQ is free once both consumers' last
        // S = Q K^T of the previous tile retired (kOwnO), else once their TMA stores have read it.
        if (i > 0) s9::mbar_wait(&q_empty, (i - 1) & 1);
        if (producer_lane == 0) {
          s9::mbar_arrive_expect_tx(&q_full, kQBytes);
#pragma unroll
          for (int p = 0; p < kPanels; ++p)
            s9::tma_load_4d(sQ + p * kBlockM * kPanel, &tmap_q, p * kPanel, span.q0 + tile.m_block * rows, tile.head0,
                            tma_batch, &q_full);
        }
        for (int it = 0; it < (kWindowed ? range.n_end - range.n_begin : range.n_end); ++it, ++g) {
          const int n = visit_block<kDiagonalFirst, kBlockN>(it, range.n_end, tile.m_block, rows, span.nk - span.nq);
          const int s = g % kStages;
          const u32 refill_parity = ((g / kStages) - 1) & 1;
          if constexpr (kPagedLayout) {
            // Block n of keys from the cache ([num_blocks, Hkv, block_size, d] maps, boxes of
            // box_rows = min(block_size, kBlockN) rows): one box per (cache block it spans, 64-column
            // panel), at that block's row in the slot (multiples of 16 rows keep the 1024-byte swizzle
            // period). Lane l of the producer warp issues box (slab l / kPanels, panel l % kPanels),
            // its own block-table read first: at block_size 16 a 128-key visit is 8 x kPanels boxes
            // per tensor, which one thread issued back to back (docs/attention_paged.md, "Chunked
            // prefill at block_size 16"). Lane 0's expect_tx is ordered before every lane's copy.
            const int box_rows = min(1 << vl.log2_bs, kBlockN);
            const int row = (producer_lane / kPanels) * box_rows, p = producer_lane % kPanels;
#pragma unroll
            for (int pass = 0; pass < 2; ++pass) {  // K, then V: the block id is read again (an L1 hit)
              u64* const full = pass == 0 ? &k_full[s] : &v_full[s];
              if (g >= kStages) s9::mbar_wait(pass == 0 ? &k_empty[s] : &v_empty[s], refill_parity);
              if (producer_lane == 0) s9::mbar_arrive_expect_tx(full, kKVBytes);
              __syncwarp();
              if (row < kBlockN) {
                u16* const slot = (pass == 0 ? sK : sV) + s * kPanels * kBlockN * kPanel;
                const int block = page_block(vl, tile.batch, n * kBlockN + row, span.nk);
                s9::tma_load_4d(slot + (p * kBlockN + row) * kPanel, pass == 0 ? &tmap_k : &tmap_v, p * kPanel,
                                (n * kBlockN + row) & ((1 << vl.log2_bs) - 1), kv_head, block, full);
              }
            }
            continue;
          }
          if (g >= kStages) s9::mbar_wait(&k_empty[s], refill_parity);
          s9::mbar_arrive_expect_tx(&k_full[s], kKVBytes);
#pragma unroll
          for (int p = 0; p < kPanels; ++p)
            s9::tma_load_4d(sK + (s * kPanels + p) * kBlockN * kPanel, &tmap_k, p * kPanel, span.k0 + n * kBlockN,
                            kv_head, tma_batch, &k_full[s]);
          if (g >= kStages) s9::mbar_wait(&v_empty[s], refill_parity);
          s9::mbar_arrive_expect_tx(&v_full[s], kKVBytes);
#pragma unroll
          for (int p = 0; p < kPanels; ++p)
            s9::tma_load_4d(sV + (s * kPanels + p) * kBlockN * kPanel, &tmap_v, p * kPanel, span.k0 + n * kBlockN,
                            kv_head, tma_batch, &v_full[s]);
        }
        t = next_tile(t);
      }
      if (tile_counter != nullptr && producer_lane == 0) release_tile_counter(tile_counter);
    }
  } else {  // ------------------------------------------------------ consumer warpgroups
    s9::setmaxnreg_inc<kConsumerRegsOf<kConsumers>>();
    if constexpr ((kVariant & kRngState) != 0) va = with_rng_state(va);  // after the role split: not the producer's
    const int c = wg - 1;                                  // rows [64 c, 64 c + 64) of the tile
    const int tid = threadIdx.x % 128;
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int diag_arg = seqlen_k - seqlen_q;              // dense: the same for every tile
    const bool releaser = tid == 0;                        // arrives on the empty barriers
    const bool v_releaser = kVarlenLayout || releaser;     // arrives on v_empty and q_empty (kEmptyCount)

    // Descriptors: Q rows of this consumer (panel p, k-step within the panel = +32 B = +2 units).
    const u64 desc_q = s9::make_desc_k128_sw128(sQ + c * 64 * kPanel);
    constexpr u64 kQPanelStep = (kBlockM * kPanel * 2) >> 4;       // descriptor units (16 B)
    constexpr u64 kKVPanelStep = (kBlockN * kPanel * 2) >> 4;
    constexpr u64 kStageStep = (kBlockN * kHeadDim * 2) >> 4;

    float o[kHeadDim / 2];
    float s[kBlockN / 2];
    u32 p[kPSteps][4];
    float m[2], l[2], alpha[2];
    float shift[2] = {0.f, 0.f};  // ALiBi (kAlibiRaw): the row constants of a one-sided block
    u32 keep[kDropped ? kBlockN / 64 : 1];  // dropout: keep bits of the block in flight (dropout_keep_bits)

    // S = Q K^T of slot `stage` into s (issued, committed, not waited for).
    auto issue_s = [&](int stage) {
      const u64 desc_k = s9::make_desc_k128_sw128(sK) + stage * kStageStep;
      s9::fence_accumulators(s);
      s9::wgmma_ss_panels<kBlockN, kIsBF16, kKSteps>(s, desc_q, kQPanelStep, desc_k, kKVPanelStep);
      s9::wgmma_commit();
    };
    // O += P V of slot `stage` (issued, committed, not waited for). V is the MN-major B operand:
    // 64-column panels kKVPanelStep apart, k-step kk = keys 16 kk.. = 2048 kk bytes further.
    auto issue_pv = [&](int stage) {
      const u64 desc_v = s9::make_desc_mn_sw128(sV + stage * kBlockN * kHeadDim, kBlockN * kPanel * 2);
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk) s9::wgmma_rs<kHeadDim, kIsBF16, 1>(o, p[kk], desc_v + kk * (2048 >> 4), 1);
      s9::wgmma_commit();
    };

    // Ping-pong turns (see the header): wait for this consumer's turn before an issue event, pass
    // the turn on after it; consumer 1 keeps the turn after its last event (nobody waits for it).
    auto take_turn = [&]() {
      if constexpr (kPingPong) s9::named_barrier_sync<256>(kTurnBarrier + c);
    };
    auto pass_turn = [&](bool last_event) {
      if constexpr (kPingPong) {
        if (!(c == 1 && last_event)) s9::named_barrier_arrive<256>(kTurnBarrier + 1 - c);
      }
    };

    int g0 = 0;  // K/V visits of this CTA before the current tile (the producer counts the same)
    // The i-th tile the producer handed out (-1: none left); broadcast from lane 0 so that ptxas sees
    // it warp-uniform, then released by every thread after its own read.
    auto take_tile = [&](int i) {
      s9::mbar_wait(&sched_full[i & 1], (i >> 1) & 1);
      const int handed = __shfl_sync(0xffffffffu, sched_tile[i & 1], 0);
      s9::mbar_arrive(&sched_empty[i & 1]);
      return handed;
    };
    // i: tiles so far (q_full and sched_full phases)
    for (int i = 0, tl = take_tile(0); tl >= 0; tl = take_tile(++i)) {
      const Tile tile = tile_coords<kReverse>(tl, m_blocks, groups, pack, batches, l2_group);
      // This tile's query / key lengths (varlen: its sequence's; q0 is re-read in the epilogue).
      const SeqSpan span = tile_span<kLayout>(vl, tile.batch, seqlen_q, seqlen_k);
      // Varlen lengths come from memory: broadcast from lane 0 so that ptxas sees them warp-uniform
      // (a branch on a value it cannot prove uniform makes it serialize the wgmmas after it, C7519).
      const int nq = kVarlenLayout ? __shfl_sync(0xffffffffu, span.nq, 0) : span.nq;
      const int nk = kVarlenLayout ? __shfl_sync(0xffffffffu, span.nk, 0) : span.nk;
      const int diag = kVarlenLayout ? nk - nq : diag_arg;
      const BlockRange range = kWindowed ? window_range<kBlockN>(tile.m_block, rows, kVarlenLayout ? nq : seqlen_q,
                                                                 kVarlenLayout ? nk : seqlen_k, va)
                                         : block_range<kCausal, kBlockN>(tile.m_block, rows, nq, nk);
      // Paged: whether some cache block of the sequence is bad (page_block: an id outside [0,
      // num_blocks) or keys past the table's capacity). Then every visit is masked, with page_mask;
      // otherwise the masked visits are block_range's. The vote makes the flag warp-uniform for ptxas.
      bool any_bad = false;
      int n_masked = range.n_masked;
      if constexpr (kPagedLayout) {
        bool bad = false;
        const int pages = (nk + (1 << vl.log2_bs) - 1) >> vl.log2_bs;
        for (int pg = tid; pg < pages; pg += 128)
          bad |= page_block(vl, tile.batch, pg << vl.log2_bs, nk) == vl.num_blocks;
        any_bad = __any_sync(0xffffffffu, s9::named_barrier_or<128>(1 + c, bad));
        if (any_bad) n_masked = kWindowed ? range.n_end - range.n_begin : range.n_end;
      }
      // Tile row of this thread's accumulator rows g (h = 0) and g + 8 (h = 1), and their query
      // positions (the heads, r / rows, are recomputed in the epilogue: registers are scarce).
      const int r0 = c * 64 + warp * 16 + g;
      const int pos[2] = {tile.m_block * rows + r0 % rows, tile.m_block * rows + (r0 + 8) % rows};
      const int bh0 = tile.batch * heads + tile.head0;  // dropout: b * H + head of tile row 0
      // Dropout keep bits of block n, computed while the wgmmas just issued run (see dropout_keep_bits).
      auto draw_keep = [&](int n) {
        if constexpr (kDropped) dropout_keep_bits<kBlockN>(keep, n, pos, bh0, r0, rows, t, va);
      };
      auto drop = [&]() {
        if constexpr (kDropped) apply_dropout<kBlockN>(s, keep);
      };
      // ALiBi: the tile's query positions span [m_block rows, + rows - 1] (the lowest and highest
      // diagonal keys, key = position + diag): a block wholly at or left of the lowest, or at or
      // right of the highest, is one-sided (alibi_scores).
      const int diag_lo = tile.m_block * rows + diag, diag_hi = diag_lo + rows - 1;
      // The key block of visit `it` (the producer's order).
      auto block_of = [&](int it) { return visit_block<kDiagonalFirst, kBlockN>(it, range.n_end, tile.m_block, rows, diag); };
      // Scores of block n -> what the softmax takes: variant logits, then -inf where masked.
      // ALiBi alone (kAlibiRaw): -slope / scale of the heads of rows g, g + 8, held across the
      // tile's blocks (two registers; a reload per block cost ~100 instructions of address and
      // division per visit, docs/attention_variants.md "ALiBi on one-sided blocks"), except in the
      // d = 256 dropout kernels, where the two registers spill (8 bytes, NVRTC 13.5): reloaded there.
      constexpr bool kHoldSlopes = kAlibiRaw && !(kDropped && kHeadDim == 256);
      auto raw_slopes = [&](float (&slope_raw)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
          slope_raw[h] = __fdividef(alibi_slope_log2(va, tile.batch, tile.head0 + (r0 + 8 * h) / rows), va.scale_log2);
      };
      float held_slopes[2] = {0.f, 0.f};
      if constexpr (kHoldSlopes) raw_slopes(held_slopes);
      auto scores = [&](int n, bool masked) {
        if constexpr (kLogits) {
          // Softcap (+ ALiBi): -log2(e) * the slopes of the heads of rows g, g + 8, re-read per
          // block (L1 hits) rather than held across the loop: with all three variants at d = 128
          // the two registers made NVRTC 13.0's ptxas spill 8 bytes (a shift for the power-of-two
          // `rows` instead of the division spilled 56 there: ptxas's allocation is that fickle;
          // `tileattn check` and scripts/check_nvrtc_version.py audit both).
          float slope[2] = {0.f, 0.f};
          if constexpr ((kVariant & kAlibi) != 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h) slope[h] = alibi_slope_log2(va, tile.batch, tile.head0 + (r0 + 8 * h) / rows);
          }
          variant_logits<kBlockN, kVariant>(s, n, pos, t, diag, va, slope);
        }
        if constexpr (kAlibiRaw) {
          float slope_raw[2] = {held_slopes[0], held_slopes[1]};
          if constexpr (!kHoldSlopes) raw_slopes(slope_raw);
          const int side = masked ? 0 : (n + 1) * kBlockN - 1 <= diag_lo ? 1 : n * kBlockN >= diag_hi ? -1 : 0;
          alibi_scores<kBlockN>(s, shift, n, pos, t, diag, side, slope_raw);
        }
        if constexpr (kWindowed) {
          if (masked) apply_window<kBlockN>(s, n, pos, t, kVarlenLayout ? nk : seqlen_k, diag, va);
        } else {
          if (masked) apply_mask<kBlockN, kCausal>(s, n, pos, t, nk, diag);
        }
        if constexpr (kPagedLayout) {
          if (masked && any_bad) page_mask<kBlockN>(s, n, t, vl, tile.batch, nk);
        }
      };
#pragma unroll
      for (int k = 0; k < kHeadDim / 2; ++k) o[k] = 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) m[h] = kFixed ? sl2 : kNoKeyShift, l[h] = 0.f;

      s9::mbar_wait(&q_full, i & 1);
      // Blocks visited (n_begin is 0 unless windowed; spelled so that the plain kernel's code is unchanged).
      const int n_iters = kWindowed ? range.n_end - range.n_begin : range.n_end;
      // Leading visits none of this consumer's rows sees: released unread (kSkipUnseen kernels).
      // Broadcast from lane 0: c comes from threadIdx, and a branch on a value ptxas cannot prove
      // warp-uniform serializes the wgmmas after it (C7519).
      const int skip =
          kSkipUnseen ? __shfl_sync(0xffffffffu, unseen_visits<kCausal, kBlockN>(n_iters, tile.m_block, rows, c, nq, nk), 0)
                      : 0;
      for (int it = 0; it < skip; ++it) {
        const int gs = g0 + it, ss = gs % kStages;
        s9::mbar_wait(&k_full[ss], (gs / kStages) & 1);
        if (releaser) s9::mbar_arrive(&k_empty[ss]);
        s9::mbar_wait(&v_full[ss], (gs / kStages) & 1);
        if (v_releaser) s9::mbar_arrive(&v_empty[ss]);
      }
      if (n_iters > skip) {
        if (c == 1) pass_turn(false);  // consumer 0 issues first
        // ---- first block seen (block_of(skip)): S, softmax; no P V yet
        const int gf = g0 + skip, s0 = gf % kStages;
        s9::mbar_wait(&k_full[s0], (gf / kStages) & 1);
        take_turn();
        s9::wgmma_fence();
        issue_s(s0);
        pass_turn(false);
        draw_keep(block_of(skip));
        s9::wgmma_wait<0>();
        s9::fence_accumulators(s);
        if (releaser) s9::mbar_arrive(&k_empty[s0]);
        scores(block_of(skip), n_masked > skip);
        softmax_step<kBlockN, kAlibiRaw, kFixed>(s, m, l, alpha, sl2, shift);  // O is still 0: no rescale needed
        drop();
        pack_p<kBlockN, kIsBF16>(p, s);
        if constexpr (kVarlenLayout) {
          // The first block visited is the edge block when it holds fewer than kBlockN keys of
          // the sequence: zero its other V rows before the first P V (see the header). The test
          // is the same in every consumer (same tile; skip is 0), so all meet on the barrier or none.
          static_assert(!kSkipUnseen, "every consumer visits the edge block first");
          const int valid = nk - (range.n_end - 1) * kBlockN;
          if (valid < kBlockN) {
            s9::mbar_wait(&v_full[s0], (g0 / kStages) & 1);
            clear_rows<kHeadDim, kBlockN, kConsumers * 128>(sV + s0 * kBlockN * kHeadDim, valid, c * 128 + tid);
            s9::fence_proxy_async();  // generic-proxy stores -> wgmma's async-proxy reads of the slot
            s9::named_barrier_sync<kConsumers * 128>(kClearBarrier);
          }
        }

        // ---- blocks 1 .. n_end - 1: S_j overlapped with P_{j-1} V_{j-1}
        auto step = [&](int it, bool masked) {  // `masked` is a constant at every call site
          const int gk = g0 + it, gv = gk - 1;
          const int sk = gk % kStages, sv = gv % kStages;
          s9::mbar_wait(&k_full[sk], (gk / kStages) & 1);
          s9::fence_accumulators(o);
          take_turn();
          s9::wgmma_fence();  // O (rescaled) and P (packed) were written by ordinary instructions
          issue_s(sk);
          s9::mbar_wait(&v_full[sv], (gv / kStages) & 1);
          issue_pv(sv);
          pass_turn(false);
          draw_keep(block_of(it));
          s9::wgmma_wait<1>();  // S_j retired (groups retire in order); P V still running
          s9::fence_accumulators(s);
          if (releaser) s9::mbar_arrive(&k_empty[sk]);
          scores(block_of(it), masked);
          const bool rescale = softmax_step<kBlockN, kAlibiRaw, kFixed, kExp2FmaPer8>(s, m, l, alpha, sl2, shift, !masked);
          drop();
          // P_{j-1} V_{j-1} retired: O readable, P registers and V slot free. Without dropout the
          // wait sits in both arms of a warpgroup-uniform branch so that it stays after the
          // exponentials; dropout kernels keep it before the branch (with the keep bits also live,
          // the other placement spills 16-76 bytes at d = 128 / 256).
          if constexpr (kDropped) {
            s9::wgmma_wait<0>();
            s9::fence_accumulators(o);
            s9::fence_accumulators(s);  // the packing below must not move above the wait
            if (v_releaser) s9::mbar_arrive(&v_empty[sv]);
            if (rescale) rescale_o<kHeadDim>(o, alpha);
          } else {
            if (scale_log2 > 0.f) {  // warpgroup-uniform (see wgmma_wait_all_in_arm)
              wgmma_wait_all_in_arm<0>();
            } else {
              wgmma_wait_all_in_arm<1>();
            }
            s9::fence_accumulators(o);
            s9::fence_accumulators(s);
            if (rescale) rescale_o<kHeadDim>(o, alpha);
            if (v_releaser) s9::mbar_arrive(&v_empty[sv]);
          }
          pack_p<kBlockN, kIsBF16>(p, s);
        };
        int it = skip + 1;
        for (; it < n_masked; ++it) step(it, true);
        for (; it < (kWindowed ? range.n_unmasked_end : range.n_end); ++it) step(it, false);
        if constexpr (kWindowed) {
          for (; it < n_iters; ++it) step(it, true);  // blocks cut by some row's lower edge
        }
        // The tile's last S = Q K^T has retired: with sO, nothing reads sQ any more.
        if constexpr (kOwnO) {
          if (v_releaser) s9::mbar_arrive(&q_empty);
        }

        // ---- tail: P V of the last block visited
        const int gv = g0 + n_iters - 1, sv = gv % kStages;
        s9::mbar_wait(&v_full[sv], (gv / kStages) & 1);
        s9::fence_accumulators(o);
        take_turn();
        s9::wgmma_fence();
        issue_pv(sv);
        pass_turn(true);
        s9::wgmma_wait<0>();
        s9::fence_accumulators(o);
        if (v_releaser) s9::mbar_arrive(&v_empty[sv]);
      } else if constexpr (kOwnO) {
        if (v_releaser) s9::mbar_arrive(&q_empty);  // no S issued: Q (loaded regardless) is not read
      }
      g0 += n_iters;

      // ---- epilogue: normalize, lse, O -> 16 bit -> stmatrix into this consumer's rows of sO ----
      // Varlen: the sequence's first query token, re-read rather than kept across the loop.
      const int q0 = kVarlenLayout ? ld_nc_volatile(vl.cu_q + tile.batch) : 0;
      float inv[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sum = quad_sum(l[h]);
        inv[h] = sum > 0.f ? 1.f / sum : 0.f;  // sum == 0 <=> the row saw no key: O = 0
        if constexpr (kDropped) inv[h] *= va.drop_scale;  // kept P times 1 / (1 - p); lse below is undropped
        if (t == 0 && pos[h] < nq)
          lse[kVarlenLayout  // lse [H, Tq] or [B, H, Nq]
                  ? static_cast<int64_t>(tile.head0 + (r0 + 8 * h) / rows) * vl.total_q + q0 + pos[h]
                  : (static_cast<int64_t>(tile.batch) * heads + tile.head0 + (r0 + 8 * h) / rows) * seqlen_q + pos[h]] =
              sum > 0.f ? (m[h] + log2f(sum)) * kLn2 : neg_inf();
      }
      // stmatrix.x4 j covers columns 16 j .. 16 j + 15 of the warp's 16 rows: matrix i = (rows
      // 8 (i & 1).., columns 16 j + 8 (i >> 1)..) is accumulator pair 4 (2 j + (i >> 1)) + 2 (i & 1).
      // Lane l addresses row 8 ((l / 8) & 1) + l % 8 of the warp's rows, 16-byte chunk 2 j + l / 16
      // of the row: panel (2 j + l / 16) / 8, swizzled chunk ((2 j + l / 16) % 8) ^ (row % 8).
      if constexpr (kOwnO) {
        // This consumer's rows of sO are free once its previous tile's TMA store has read them
        // (dense), or its threads' row copies out of them are done (packed: the barrier orders them).
        if (!kVarlenLayout && tid == 0) s9::tma_store_wait_read();
        s9::named_barrier_sync<128>(1 + c);
      }
      {
        const int mi = lane / 8, rr = lane % 8;
        const int row = warp * 16 + 8 * (mi & 1) + rr;  // within this consumer's 64 rows
        const u32 base = s9::smem_u32(sO + c * 64 * kPanel) + row * 128;
#pragma unroll
        for (int j = 0; j < kHeadDim / 16; ++j) {
          const int chunk = 2 * j + (mi >> 1);
          const u32 addr = base + (chunk / 8) * (kBlockM * kPanel * 2) + (((chunk % 8) ^ rr) << 4);
          s9::stmatrix_x4(addr, pack2<kIsBF16>(o[8 * j + 0] * inv[0], o[8 * j + 1] * inv[0]),
                          pack2<kIsBF16>(o[8 * j + 2] * inv[1], o[8 * j + 3] * inv[1]),
                          pack2<kIsBF16>(o[8 * j + 4] * inv[0], o[8 * j + 5] * inv[0]),
                          pack2<kIsBF16>(o[8 * j + 6] * inv[1], o[8 * j + 7] * inv[1]));
        }
      }
      s9::fence_proxy_async();               // generic-proxy stmatrix writes -> async-proxy TMA store
      s9::named_barrier_sync<128>(1 + c);    // this consumer's 128 threads only (varlen: its copy reads all rows)
      if constexpr (kVarlenLayout) {
        // Every row stored by its own threads under a per-row predicate (no TMA store: see the header).
        store_rows_masked<kHeadDim, kBlockM>(sO + c * 64 * kPanel, vl, q0, nq, tile.m_block * rows, rows, tile.head0,
                                             c, tid);
        if constexpr (!kOwnO) s9::mbar_arrive(&q_empty);  // each thread once its own reads of sQ are done (kEmptyCount)
        continue;
      }
      if (tid == 0) {
        // This consumer's rows 64 c .. 64 c + 63 as one box: first position and head of row 64 c.
        const int pos0 = tile.m_block * rows + (c * 64) % rows, head = tile.head0 + (c * 64) / rows;
        if (pos0 < seqlen_q) {
#pragma unroll
          for (int pnl = 0; pnl < kPanels; ++pnl)
            s9::tma_store_4d(&tmap_o, sO + pnl * kBlockM * kPanel + c * 64 * kPanel, pnl * kPanel, pos0, head,
                             tile.batch);
          s9::tma_store_commit();
          // Without sO: sQ must not be refilled before the copy read it (with sO the next epilogue
          // waits, and the end of the kernel below).
          if constexpr (!kOwnO) s9::tma_store_wait_read();
        }
        if constexpr (!kOwnO) s9::mbar_arrive(&q_empty);  // this consumer is done with sQ for this tile
      }
    }
    if constexpr (kOwnO && !kVarlenLayout) {
      if (tid == 0) s9::tma_store_wait_read();  // shared memory outlives the last store's reads
    }
    if constexpr (kVarlenLayout) {  // after this CTA's tiles: its share of the rows past the last sequence
      zero_rows_past_last<kHeadDim, kConsumers * 128>(vl, lse, batches, heads, c * 128 + tid);
    }
  }
}

}  // namespace tileattn
