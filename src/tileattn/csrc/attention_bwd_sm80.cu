// Fused attention backward for sm_80+ (mma.sync m16n8k16 + ldmatrix + cp.async), FlashAttention-2
// style: probabilities are recomputed from the forward's log-sum-exp, never stored in device memory.
//
// Shapes (elements; every tensor has its own batch / head / row strides and a contiguous last dim):
//   q, out, dout, dq   [B, H,   Nq, d]     16-bit (fp16 or bf16 by kIsBF16), raw uint16_t
//   k, v, dk, dv       [B, Hkv, Nk, d]     kv head of query head h: h / group, group = H / Hkv
//   lse                [B, H, Nq]          fp32, natural log, -inf for fully masked rows
//   workspace lse2     [B, H, NqPad]       fp32: lse * log2(e); +inf for fully masked / padded rows
//   workspace delta    [B, H, NqPad]       fp32: D_i = sum_c dO[i,c] * O[i,c]; 0 for padded rows
//   dq_accum           [B, H, NqPad/16, d/8, 32, 4]  fp32 (atomic mode only): 16 x 8 tiles in mma
//                      C-fragment order. Element (i, c) of a head sits in tile (i/16, c/8) at lane
//                      4*(i%8) + (c%8)/2, slot 2*((i%16)/8) + c%2: a thread's c0..c3 are contiguous.
//   NqPad = Nq rounded up to 128, so every query block reads lse2/delta and adds into dq_accum
//   without a bounds check.
// Causal masking is aligned bottom-right: query i sees key j iff j <= i + Nk - Nq.
//
// Math (S = scale * Q K^T, P = softmax(S), O = P V; dO given):
//   dV = P^T dO                   dP = dO V^T            dS = P o (dP - D)
//   dQ = scale * dS K             dK = scale * dS^T Q
// with P recomputed as exp2(QK^T * scale*log2(e) - lse2): one FFMA + one MUFU.EX2 per score.
//
// Kernels (one launch each, in this order, all on the caller's stream):
//   1. attn_bwd_preprocess_kernel: delta, lse2 (and zeroes dq_accum in atomic mode).
//   2. attn_bwd_main_kernel: one block per (key block of kBN keys, kv head, batch). K and V stay in
//      shared memory; the block walks over the query heads of its GQA group and their query blocks
//      of kBM rows, keeping dK and dV in fp32 registers for the whole walk (no atomics for dK/dV,
//      and GQA's sum over the group's heads happens in those registers). dQ contributions go to
//      dq_accum through fp32 RED (kDq) or are left to kernel 3b (deterministic mode).
//   3a. attn_bwd_convert_dq_kernel: dq = scale * dq_accum in the input dtype (atomic mode).
//   3b. attn_bwd_dq_kernel: deterministic mode. One block per (query block, head, batch) walks over
//      the key blocks in a fixed order, recomputes P and dS, and accumulates dQ in registers: no
//      atomics, so dq is bit-identical run to run (dk/dv are deterministic in both modes).
//
// Shared-memory tiles are row-major with 16-byte chunks XOR-swizzled (SwizzledTile, in
// common/sm80_tile.cuh with the tile loaders and LdsmLane), so every ldmatrix phase (8 rows x 16
// bytes), every cp.async row write and every 32-bit fragment store touches 8 distinct 16-byte
// bank groups: conflict-free without padding (d = 96 rows are stored with a 128-element pitch).
//
// Address arithmetic is budgeted like the math: every ldmatrix costs at most one LOP3 (an XOR with
// a compile-time constant on a per-lane base address, LdsmLane) and immediate offsets. The
// first version rebuilt each address from (row, chunk) with 4-5 integer instructions and executed
// 1.69x FlashAttention-2's instruction count for the same 320 HMMA per warp and query block
// (ncu on the H200, docs/attention_bwd_sm80.md).
#include "common/sm80_tile.cuh"
#include "common/variants.cuh"
#include "common/varlen.cuh"

namespace tileattn {
namespace bwd {

// ---- warp-level GEMM from swizzled shared memory ------------------------------------------------
// acc[MT][NT] (a (16*MT) x (8*NT) fp32 tile in mma C layout) += A (16*MT x 16*KS) * B (16*KS x 8*NT),
// the reduction always over the tile's full extent from 0:
//   A: kATrans == false: A(m, k) = tileA[a_m0 + m][k]   (rows = m, "row-major A")
//      kATrans == true:  A(m, k) = tileA[k][a_m0 + m]   (tile holds A^T)
//   B: kBTrans == false: B(k, n) = tileB[b_n0 + n][k]   (tile rows = n, e.g. K for Q K^T)
//      kBTrans == true:  B(k, n) = tileB[k][b_n0 + n]   (tile rows = k, e.g. V for P V)
// a_m0 / b_n0 are multiples of the warp tile (16 MT / 8 NT). Fragment facts (PTX ISA,
// mma.m16n8k16 .f16/.bf16; g = lane/4, t = lane%4):
//   A regs: a0 = (row g, cols 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B regs: b0 = (rows k 2t..2t+1, col g), b1 = (k 2t+8..2t+9, col g)
//   C regs: c0,c1 = (row g, cols 2t, 2t+1), c2,c3 = (row g+8, same cols)
// kUnroll < KS keeps the k loop partly rolled (a register-pressure knob: a fully unrolled loop lets
// ptxas load the next k step's fragments during this step's mma, which costs registers).
template <bool kIsBF16, int MT, int NT, int KS, bool kATrans, bool kBTrans, int kACols, int kBCols, int kUnroll = KS>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][NT][4], u32 tile_a, int a_m0, u32 tile_b, int b_n0,
                                         int lane) {
  static_assert(NT % 2 == 0, "B fragments are loaded two n8 tiles at a time");
  // Trans operands step their columns over mt / np: XOR-addressable when that count is a power of 2.
  // j runs over the k steps (non-trans) or over the mt / np tiles (trans).
  const LdsmLane<SwizzledTile<kACols>, !kATrans, !kATrans || is_pow2(MT), kATrans ? MT : KS> la(
      tile_a, kATrans ? 0 : a_m0, kATrans ? a_m0 : 0, lane);
  const LdsmLane<SwizzledTile<kBCols>, kBTrans, !kBTrans || is_pow2(NT / 2), kBTrans ? NT / 2 : KS> lb(
      tile_b, kBTrans ? 0 : b_n0, kBTrans ? b_n0 : 0, lane);
#pragma unroll kUnroll
  for (int ks = 0; ks < KS; ++ks) {
    u32 a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if constexpr (kATrans) {
        ldmatrix_x4_trans(a[mt], la.at(ks, mt));
      } else {
        ldmatrix_x4(a[mt], la.at(mt, ks));
      }
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 b[4];
      if constexpr (kBTrans) {
        ldmatrix_x4_trans(b, lb.at(ks, np));
      } else {
        ldmatrix_x4(b, lb.at(np, ks));
      }
      const u32 b_lo[2] = {b[0], b[1]};
      const u32 b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<kIsBF16>(acc[mt][2 * np], a[mt], b_lo);
        mma_16816<kIsBF16>(acc[mt][2 * np + 1], a[mt], b_hi);
      }
    }
  }
}

template <int MT, int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}

// Store a C-layout fp32 accumulator (rows r0.., cols c0..) as 16-bit pairs into a swizzled tile,
// multiplied by `mul`.
template <bool kIsBF16, int kCols, int MT, int NT>
__device__ __forceinline__ void store_acc_to_smem(char* tile, const float (&acc)[MT][NT][4], int r0, int c0, float mul,
                                                  int lane) {
  using T = SwizzledTile<kCols>;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = r0 + mt * 16 + g + 8 * half;
        const int c = c0 + nt * 8 + 2 * t;
        *reinterpret_cast<u32*>(tile + T::elem(r, c)) =
            pack2<kIsBF16>(acc[mt][nt][2 * half] * mul, acc[mt][nt][2 * half + 1] * mul);
      }
}

// ---- variable-length batches ------------------------------------------------------------------
// Every kernel below has a dense entry point and a varlen one (kVarlen, see common/varlen.cuh):
// q/out/dout/dq [Tq, H, d], k/v/dk/dv [Tk, Hkv, d], lse [H, Tq], sequence b at tokens
// cu_seqlens_q[b] / cu_seqlens_k[b]; the batch strides are 0 and the grids cover the longest
// sequence (blocks past a sequence's end exit). The lse2 / delta workspaces are [H, ws_pitch] with
// ws_pitch = roundup(Tq, 4) + 132 B, and dq_accum the same rows times d. Sequence b's rows start at
// roundup(cu_seqlens_q[b], 4) + 132 b: a multiple of 4 rows (the query blocks cp.async 16 bytes of
// lse2 / delta at a time), and its queries rounded up to a multiple of 128 rows (what the query
// blocks read and add into without bounds checks, as in the dense NqPad layout) end at most
// 3 + 127 rows past its last query, before the next sequence's rows begin (>= 132 rows past it).
constexpr int kVarlenWsGap = 132;
// Row of query 0 of (b, h) in lse2 / delta (times d in dq_accum).
template <bool kVarlen>
__device__ __forceinline__ int64_t ws_row(int b, int h, int heads, int nq_pad, const SeqSpan& sp, int ws_pitch) {
  if constexpr (kVarlen) {
    return static_cast<int64_t>(h) * ws_pitch + ((sp.q0 + 3) & ~3) + kVarlenWsGap * b;
  } else {
    return (static_cast<int64_t>(b) * heads + h) * nq_pad;
  }
}
// Rows of the sequence in the workspaces (a multiple of 128).
template <bool kVarlen>
__device__ __forceinline__ int seq_nq_pad(int nq_pad, const SeqSpan& sp) {
  return kVarlen ? (sp.nq + 127) / 128 * 128 : nq_pad;
}

// ================================================================================================
// 1. Preprocess: delta = rowsum(dO * O), lse2 = lse * log2(e) (+inf where lse = -inf or the row is
//    padding), dq_accum = 0 (all NqPad rows). Grid (NqPad / 64, H, B), 128 threads; kLanes lanes share one row, each
//    lane reading 16-byte chunks of O and dO (memory bound: 4 bytes read per fp32 product).
// ================================================================================================
template <int kD, bool kIsBF16, bool kVarlen>
__device__ __forceinline__ void attn_bwd_preprocess_body(
    const u16* __restrict__ out, const u16* __restrict__ dout, const float* __restrict__ lse,
    float* __restrict__ lse2, float* __restrict__ delta, float* __restrict__ dq_accum,  // dq_accum may be null
    int64_t o_sb, int64_t o_sh, int64_t o_sr, int64_t do_sb, int64_t do_sh, int64_t do_sr, int nq_arg, int heads,
    int nq_pad_arg, const int* __restrict__ cu_seqlens_q, int total_q, int ws_pitch) {
  constexpr int kChunks = kD / 8;
  constexpr int kLanes = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  constexpr int kRowsPerPass = 4 * (32 / kLanes);  // 4 warps
  constexpr int kRowsPerBlock = 64;
  static_assert(kRowsPerBlock % kRowsPerPass == 0, "");
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int sub = lane % kLanes;
  const SeqSpan sp = seq_span<kVarlen>(cu_seqlens_q, cu_seqlens_q, b, nq_arg, 0);
  const int nq = sp.nq, nq_pad = seq_nq_pad<kVarlen>(nq_pad_arg, sp);
  if (kVarlen && blockIdx.x * 64 >= nq_pad) return;
  const int64_t ws_bh = ws_row<kVarlen>(b, h, heads, nq_pad_arg, sp, ws_pitch);  // row of query 0
  // lse of query 0 of (b, h): dense [B, H, Nq], varlen [H, Tq]
  const float* lse_bh = lse + (kVarlen ? static_cast<int64_t>(h) * total_q + sp.q0 : (static_cast<int64_t>(b) * heads + h) * nq);
  const u16* o_bh = out + b * o_sb + sp.q0 * o_sr + h * o_sh;
  const u16* do_bh = dout + b * do_sb + sp.q0 * do_sr + h * do_sh;
#pragma unroll 1
  for (int pass = 0; pass < kRowsPerBlock / kRowsPerPass; ++pass) {
    const int row = blockIdx.x * kRowsPerBlock + pass * kRowsPerPass + warp * (32 / kLanes) + lane / kLanes;
    const bool valid = row < nq;
    float sum = 0.f;
#pragma unroll
    for (int c = sub; c < kChunks; c += kLanes) {
      if (valid) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o_bh + row * o_sr + c * 8);
        const uint4 dv = *reinterpret_cast<const uint4*>(do_bh + row * do_sr + c * 8);
        const u32 o4[4] = {ov.x, ov.y, ov.z, ov.w};
        const u32 d4[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float o0, o1, d0, d1;
          unpack2<kIsBF16>(o4[e], o0, o1);
          unpack2<kIsBF16>(d4[e], d0, d1);
          sum = fmaf(o0, d0, sum);
          sum = fmaf(o1, d1, sum);
        }
      }
      // dq_accum has NqPad rows: the main kernel adds (zero) contributions of padding rows too
      // instead of bounds-checking every RED.
      if (dq_accum != nullptr && row < nq_pad) {
        float4* dst = reinterpret_cast<float4*>(dq_accum + (ws_bh + row) * kD + c * 8);
        dst[0] = make_float4(0.f, 0.f, 0.f, 0.f);
        dst[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (sub == 0 && row < nq_pad) {
      float l2 = pos_inf();
      if (valid) {
        const float l = lse_bh[row];
        l2 = (l == neg_inf()) ? pos_inf() : l * kLog2e;
      }
      lse2[ws_bh + row] = l2;
      delta[ws_bh + row] = valid ? sum : 0.f;
    }
  }
}

template <int kD, bool kIsBF16>
__global__ void __launch_bounds__(128) attn_bwd_preprocess_kernel(
    const u16* __restrict__ out, const u16* __restrict__ dout, const float* __restrict__ lse,
    float* __restrict__ lse2, float* __restrict__ delta, float* __restrict__ dq_accum, int64_t o_sb, int64_t o_sh,
    int64_t o_sr, int64_t do_sb, int64_t do_sh, int64_t do_sr, int nq, int heads, int nq_pad) {
  attn_bwd_preprocess_body<kD, kIsBF16, false>(out, dout, lse, lse2, delta, dq_accum, o_sb, o_sh, o_sr, do_sb, do_sh,
                                               do_sr, nq, heads, nq_pad, nullptr, 0, 0);
}

// Varlen: grid (ceil(max_seqlen_q / 128) * 2, H, B + 1).
template <int kD, bool kIsBF16>
__global__ void __launch_bounds__(128) attn_bwd_preprocess_varlen_kernel(
    const u16* __restrict__ out, const u16* __restrict__ dout, const float* __restrict__ lse,
    float* __restrict__ lse2, float* __restrict__ delta, float* __restrict__ dq_accum, int64_t o_sh, int64_t o_sr,
    int64_t do_sh, int64_t do_sr, const int* __restrict__ cu_seqlens_q, int total_q, int ws_pitch) {
  if (is_tail_slice()) return;  // rows past the last sequence have no workspace rows
  attn_bwd_preprocess_body<kD, kIsBF16, true>(out, dout, lse, lse2, delta, dq_accum, 0, o_sh, o_sr, 0, do_sh, do_sr,
                                              0, 0, 0, cu_seqlens_q, total_q, ws_pitch);
}

// ================================================================================================
// 3a. dq = scale * dq_accum, cast to the input dtype. Grid (ceil(Nq / 64), H, B), 128 threads.
//     dq_accum is in fragment order: warp w reads the 16-row tile row w of the block, each lane one
//     16-byte fragment per tile (512 contiguous bytes per warp load), and scatters its two packed
//     pairs (rows g and g + 8) into a padded shared tile; the block then writes whole rows with
//     16-byte stores. Row pitch 2d + 16 bytes: the 8 rows g of one scatter land 4 banks apart, so
//     the 32 lanes (4g + t) hit 32 distinct banks.
// ================================================================================================
template <int kD, bool kIsBF16, bool kVarlen>
__device__ __forceinline__ void attn_bwd_convert_dq_body(const float* __restrict__ dq_accum, u16* __restrict__ dq,
                                                         int64_t dq_sb, int64_t dq_sh, int64_t dq_sr, int nq_arg,
                                                         int heads, int nq_pad, float scale,
                                                         const int* __restrict__ cu_seqlens_q, int ws_pitch) {
  constexpr int kChunks = kD / 8;
  constexpr int kRows = 64;  // 4 warps x one 16-row tile row each
  constexpr int kPitch = kD * 2 + 16;
  __shared__ __align__(16) char rows[kRows * kPitch];
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * kRows;
  const SeqSpan sp = seq_span<kVarlen>(cu_seqlens_q, cu_seqlens_q, b, nq_arg, 0);
  const int nq = sp.nq;
  if (kVarlen && m0 >= nq) return;
  const float* src = dq_accum + (ws_row<kVarlen>(b, h, heads, nq_pad, sp, ws_pitch) + m0) * kD + warp * 16 * kD + lane * 4;
#pragma unroll 4
  for (int tile = 0; tile < kChunks; ++tile) {
    const float4 f = *reinterpret_cast<const float4*>(src + tile * 128);
    char* dst = rows + (warp * 16 + g) * kPitch + (tile * 8 + 2 * t) * 2;
    *reinterpret_cast<u32*>(dst) = pack2<kIsBF16>(f.x * scale, f.y * scale);
    *reinterpret_cast<u32*>(dst + 8 * kPitch) = pack2<kIsBF16>(f.z * scale, f.w * scale);
  }
  __syncthreads();
  u16* out = dq + b * dq_sb + h * dq_sh + static_cast<int64_t>(sp.q0 + m0) * dq_sr;
#pragma unroll 1
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += 128) {
    const int r = idx / kChunks, c = idx - (idx / kChunks) * kChunks;
    if (m0 + r < nq) {
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(r) * dq_sr + c * 8) =
          *reinterpret_cast<const uint4*>(rows + r * kPitch + c * 16);
    }
  }
}

template <int kD, bool kIsBF16>
__global__ void __launch_bounds__(128) attn_bwd_convert_dq_kernel(const float* __restrict__ dq_accum,
                                                                  u16* __restrict__ dq, int64_t dq_sb, int64_t dq_sh,
                                                                  int64_t dq_sr, int nq, int heads, int nq_pad,
                                                                  float scale) {
  attn_bwd_convert_dq_body<kD, kIsBF16, false>(dq_accum, dq, dq_sb, dq_sh, dq_sr, nq, heads, nq_pad, scale, nullptr,
                                               0);
}

// Varlen: grid (ceil(max_seqlen_q / 64), H, B + 1); the last z-slice zeroes the rows of dq past the
// last sequence.
template <int kD, bool kIsBF16>
__global__ void __launch_bounds__(128) attn_bwd_convert_dq_varlen_kernel(const float* __restrict__ dq_accum,
                                                                         u16* __restrict__ dq, int64_t dq_sh,
                                                                         int64_t dq_sr,
                                                                         const int* __restrict__ cu_seqlens_q,
                                                                         int total_q, int ws_pitch, float scale) {
  if (is_tail_slice()) {  // dq rows past the last sequence: 0
    zero_tail_rows<kD, 128>(dq + blockIdx.y * dq_sh, dq_sr, nullptr, cu_seqlens_q[gridDim.z - 1], total_q);
    return;
  }
  attn_bwd_convert_dq_body<kD, kIsBF16, true>(dq_accum, dq, 0, dq_sh, dq_sr, 0, 0, 0, scale, cu_seqlens_q, ws_pitch);
}

// ================================================================================================
// 2. Main kernel: dK, dV (and dQ through RED when kDq).
// ================================================================================================
// Work per query block of kBM rows, in three phases; each phase spreads its output tile over the
// kWarps warps in its own layout (a warp tile of MT m16 x NT n8 mma tiles):
//   phase 1  S^T, dP^T  [kBN keys x kBM queries]   kWN1 x kWM1 warps   K, V (A) x Q, dO (B), k = d
//            P^T = exp2(S^T*scale_log2 - lse2), dS^T = P^T o (dP^T - D) -> shared memory (16-bit)
//   phase 2  dV, dK     [kBN keys x d]             kWN2 x kWD2 warps   P^T, dS^T (A) x dO, Q (B^T), k = kBM
//   phase 3  dQ         [kBM queries x d]          kWM3 x kWD3 warps   dS (A, from dS^T by ldmatrix.trans)
//                                                                      x K (B^T), k = kBN -> fp32 RED
// Registers per thread (fp32 accumulators; the rest is fragments, addresses and loop state):
//   dK + dV: 2 * kBN * d / (32 * kWarps), live for the whole kernel
//   phase 1: dP^T and S^T, kBN * kBM / (32 * kWarps) each
//   phase 3: kBM * d / (32 * kWarps)
//   e.g. d=128, kBN=128, kBM=64, 8 warps: 128 + 32 + 32 (phase 1) or 128 + 32 (phase 3); ptxas
//   fills the rest of the 255 registers with fragments in flight and addresses.
// Per-warp shared-memory reads per query block (d=128, kBN=128, kBM=64):
//   phase 1, layout kWN1 = 4 (32 keys x 32 queries): V, dO, K, Q 8 KB each = 32 KB
//            (kWN1 = 8, 16 keys x 64 queries: 4 + 16 + 4 + 16 = 40 KB); P^T + dS^T stores 4 KB;
//   phase 2, kWN2 = 2 or 4: (P^T + dO) + (dS^T + Q) = 24 KB; phase 3: dS^T 8 KB + K 8 KB.
//   8 warps, kWN1 = 4: 608 KB per 10.5 MFLOP -> 17.3 FLOP per shared-memory byte.
// Shared memory: K, V (kBN x d each), Q and dO double-buffered (2 x kBM x d each), P^T and dS^T
// (kBN x kBM each), lse2 and delta double-buffered (2 x kBM fp32 each); 16-bit elements:
//   d=128, kBN=128, kBM=64: 32 + 32 + 32 + 32 + 16 + 16 + 1 KB = 161 KB (one block per SM).
// Template knobs: kWN1 / kWN2 / kWM3 pick the warp layouts above, kMinBlocks feeds
// __launch_bounds__, kUnroll is the unroll factor of the k loops of phases 1 and 3 (phase 2's
// kBM / 16 steps are fully unrolled).
// Barriers per query block: (A) after the cp.async wait, making this block's Q/dO/lse2/delta
// visible and proving every warp finished the previous block (so the other stage and P^T/dS^T may
// be overwritten); the next block's loads are issued right after (A), a whole iteration ahead of
// use. (B) after phase 1, making P^T/dS^T visible. Phase 3 runs before phase 2; they need no barrier
// between them (both only read dS^T, K, P^T, dO, Q).
template <int kD, int kBN, int kBM, int kWarps, int kWN1, int kWN2, int kWM3>
struct MainCfg {
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWM1 = kWarps / kWN1, kWD2 = kWarps / kWN2, kWD3 = kWarps / kWM3;
  static constexpr int kTN1 = kBN / kWN1, kTM1 = kBM / kWM1;
  static constexpr int kTN2 = kBN / kWN2, kTD2 = kD / kWD2;
  static constexpr int kTM3 = kBM / kWM3, kTD3 = kD / kWD3;
  static constexpr int MT1 = kTN1 / 16, NT1 = kTM1 / 8;
  static constexpr int MT2 = kTN2 / 16, NT2 = kTD2 / 8;
  static constexpr int MT3 = kTM3 / 16, NT3 = kTD3 / 8;
  static_assert(kWM1 * kWN1 == kWarps && kWD2 * kWN2 == kWarps && kWD3 * kWM3 == kWarps, "warp layouts");
  static_assert(kTN1 * kWN1 == kBN && kTM1 * kWM1 == kBM && MT1 * 16 == kTN1 && NT1 * 8 == kTM1, "phase 1");
  static_assert(kTN2 * kWN2 == kBN && kTD2 * kWD2 == kD && MT2 * 16 == kTN2 && NT2 * 8 == kTD2, "phase 2");
  static_assert(kTM3 * kWM3 == kBM && kTD3 * kWD3 == kD && MT3 * 16 == kTM3 && NT3 * 8 == kTD3, "phase 3");
  static_assert(MT1 >= 1 && MT2 >= 1 && MT3 >= 1 && NT1 % 2 == 0 && NT2 % 2 == 0 && NT3 % 2 == 0, "tiles");
  static_assert(is_pow2(NT1), "phase-1 P^T/dS^T stores step their chunk by XOR");
  static_assert(kBM % 32 == 0 && 128 % kBM == 0, "query block must divide the 128-row lse2/delta padding");
  static_assert(kBN % 16 == 0 && kD % 32 == 0, "");
  static_assert(kThreads >= kBM / 2, "lse2/delta loaders");
  static constexpr int kKVBytes = SwizzledTile<kD>::bytes(kBN);
  static constexpr int kQBytes = SwizzledTile<kD>::bytes(kBM);
  static constexpr int kPBytes = SwizzledTile<kBM>::bytes(kBN);
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKVBytes;
  static constexpr int kOffQ = kOffV + kKVBytes;       // 2 stages
  static constexpr int kOffDO = kOffQ + 2 * kQBytes;   // 2 stages
  static constexpr int kOffPt = kOffDO + 2 * kQBytes;  // P^T  [kBN][kBM]
  static constexpr int kOffDSt = kOffPt + kPBytes;     // dS^T [kBN][kBM]
  static constexpr int kOffLse = kOffDSt + kPBytes;    // 2 stages x kBM fp32
  static constexpr int kOffDelta = kOffLse + 2 * kBM * 4;
  static constexpr int kSmem = kOffDelta + 2 * kBM * 4;
  // Every swizzled tile starts at a multiple of 1 KB (>= its row bytes), as LdsmLane's XOR needs.
  static_assert(kKVBytes % 1024 == 0 && kQBytes % 1024 == 0 && kPBytes % 1024 == 0, "tile alignment");
};

// kVariants: the variant kernels (common/variants.cuh; causal is the window's right edge 0, `causal`
// is 0): P recomputed from the variant logits, dropout's mask on P^T (dV) and dP, softcap's
// derivative on dS, and only the query blocks inside the key block's window are walked.
// kRngState: va's dropout seed and offset are read from va.rng_state, once per query block where the
// block's Philox words are drawn (read once at the entry, the d = 32 deterministic kernels spilled 16 bytes).
template <int kD, int kBN, int kBM, int kWarps, int kWN1, int kWN2, int kWM3, bool kIsBF16, bool kDq, int kUnroll,
          bool kVarlen, bool kVariants = false, bool kRngState = false>
__device__ __forceinline__ void attn_bwd_main_body(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ dout,
    u16* __restrict__ dk, u16* __restrict__ dv, float* __restrict__ dq_accum, const float* __restrict__ lse2,
    const float* __restrict__ delta, int64_t q_sb, int64_t q_sh, int64_t q_sr, int64_t k_sb, int64_t k_sh,
    int64_t k_sr, int64_t v_sb, int64_t v_sh, int64_t v_sr, int64_t do_sb, int64_t do_sh, int64_t do_sr,
    int64_t dk_sb, int64_t dk_sh, int64_t dk_sr, int64_t dv_sb, int64_t dv_sh, int64_t dv_sr, int nq_arg, int nk_arg,
    int heads, int group, int nq_pad, int causal, float scale_log2, float scale, const int* __restrict__ cu_seqlens_q,
    const int* __restrict__ cu_seqlens_k, int ws_pitch, const Variants& va) {
  using C = MainCfg<kD, kBN, kBM, kWarps, kWN1, kWN2, kWM3>;
  static_assert(!kVariants || 32 % C::kTN1 == 0, "variants: a warp's phase-1 keys share one 32-key dropout group");
  using TM = SwizzledTile<kBM>;
  extern __shared__ __align__(1024) char smem[];
  check_dynamic_smem(smem, C::kSmem);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * kBN, hk = blockIdx.y, b = blockIdx.z;
  const SeqSpan span = seq_span<kVarlen>(cu_seqlens_q, cu_seqlens_k, b, nq_arg, nk_arg);
  const int nq = span.nq, nk = span.nk;
  if (kVarlen && n0 >= nk) return;  // the varlen grid covers the longest sequence
  const int delta_nk = nk - nq;  // query i sees key j iff j <= i + delta_nk (causal)
  // Inside the walk the span is re-read (varlen: a few L1-hit loads per query block) instead of
  // holding four more registers next to dK and dV; the dense one is the kernel's arguments.
  auto span_l = [&]() { return seq_span<kVarlen, true>(cu_seqlens_q, cu_seqlens_k, b, nq_arg, nk_arg); };

  const u32 s0 = smem_addr(smem);
  const u32 sK = s0 + C::kOffK, sV = s0 + C::kOffV, sPt = s0 + C::kOffPt, sDSt = s0 + C::kOffDSt;

  // Query blocks this key block needs: causal skips the ones entirely above the diagonal. The first
  // query that sees key n0 is i = n0 - delta_nk; it lies in block floor(max(0, i) / kBM). It is < nq
  // because n0 <= nk - 1, so every key block has at least one query block.
  int m_first = causal ? max(0, n0 - delta_nk) / kBM * kBM : 0;
  int m_end = (nq + kBM - 1) / kBM * kBM;
  if constexpr (kVariants) {
    // Queries whose window holds a key of this block: i in [n0 - diag - right, n0 + kBN - 1 - diag + left].
    const int i_lo = max(0, n0 - delta_nk - va.right);
    const int i_hi = min(nq - 1, n0 + kBN - 1 - delta_nk + va.left);
    m_first = i_lo / kBM * kBM;
    m_end = i_hi < i_lo ? m_first : (i_hi / kBM + 1) * kBM;  // none: dK = dV = 0
  }
  const int n_iters = group * ((m_end - m_first) / kBM);

  // The walk: query heads h of the group, and for each, query blocks m0 = m_first, ..., m_end - kBM.
  auto issue_loads = [&](int h, int m0, int stage) {
    const SeqSpan sp = span_l();
    const int64_t r0 = sp.q0 + m0;  // token of the block's first query
    load_tile_async<kBM, SwizzledTile<kD>, C::kThreads>(s0 + C::kOffQ + stage * C::kQBytes,
                                                         q + b * q_sb + h * q_sh + r0 * q_sr, q_sr, sp.nq - m0, tid);
    load_tile_async<kBM, SwizzledTile<kD>, C::kThreads>(s0 + C::kOffDO + stage * C::kQBytes,
                                                         dout + b * do_sb + h * do_sh + r0 * do_sr, do_sr, sp.nq - m0,
                                                         tid);
    const int64_t ws = ws_row<kVarlen>(b, h, heads, nq_pad, sp, ws_pitch) + m0;  // padded: always in bounds
    if (tid < kBM / 4) {
      cp_async_16(s0 + C::kOffLse + stage * kBM * 4 + tid * 16, lse2 + ws + tid * 4, true);
    } else if (tid < kBM / 2) {
      const int c = tid - kBM / 4;
      cp_async_16(s0 + C::kOffDelta + stage * kBM * 4 + c * 16, delta + ws + c * 4, true);
    }
  };

  // Prologue: K, V for this block, and the first query block.
  const int64_t kr0 = span.k0 + n0;  // token of the block's first key
  load_tile_async<kBN, SwizzledTile<kD>, C::kThreads>(sK, k + b * k_sb + hk * k_sh + kr0 * k_sr, k_sr, nk - n0, tid);
  load_tile_async<kBN, SwizzledTile<kD>, C::kThreads>(sV, v + b * v_sb + hk * v_sh + kr0 * v_sr, v_sr, nk - n0, tid);
  int h = hk * group, m0 = m_first;  // the current query block
  int h_next = h, m_next = m0;       // the block whose loads are in flight
  if (n_iters > 0) issue_loads(h, m0, 0);
  cp_async_commit();

  // This warp's tiles in each phase.
  const int key1 = (warp / C::kWM1) * C::kTN1, qry1 = (warp % C::kWM1) * C::kTM1;
  const int key2 = (warp / C::kWD2) * C::kTN2, dim2 = (warp % C::kWD2) * C::kTD2;
  const int qry3 = (warp / C::kWD3) * C::kTM3, dim3 = (warp % C::kWD3) * C::kTD3;

  float dv_acc[C::MT2][C::NT2][4];
  float dk_acc[C::MT2][C::NT2][4];
  zero_acc(dv_acc);
  zero_acc(dk_acc);

#pragma unroll 1
  for (int it = 0; it < n_iters; ++it) {
    const int stage = it & 1;
    h = h_next;
    m0 = m_next;
    cp_async_wait<0>();
    __syncthreads();  // (A)
    m_next += kBM;
    if (m_next == m_end) {
      m_next = m_first;
      ++h_next;
    }
    if (it + 1 < n_iters) issue_loads(h_next, m_next, stage ^ 1);
    cp_async_commit();

    const u32 sQ = s0 + C::kOffQ + stage * C::kQBytes;
    const u32 sDO = s0 + C::kOffDO + stage * C::kQBytes;
    const float* sLse = reinterpret_cast<const float*>(smem + C::kOffLse + stage * kBM * 4);
    const float* sDelta = reinterpret_cast<const float*>(smem + C::kOffDelta + stage * kBM * 4);
    const int ln = opaque_lane();

    // ---- phase 1: dP^T = V dO^T, then S^T = K Q^T (this warp: keys key1 .. key1 + kTN1, queries
    // qry1 .. qry1 + kTM1), then P^T and dS^T to shared memory. dP^T and S^T are both live at the
    // end (2 * MT1 * NT1 * 4 registers next to dK/dV's); each k step loads MT1 A and NT1 / 2 B
    // fragments for 2 * MT1 * NT1 mma.
    {
      float dp[C::MT1][C::NT1][4];
      float s[C::MT1][C::NT1][4];
      zero_acc(dp);
      zero_acc(s);
      warp_mma<kIsBF16, C::MT1, C::NT1, kD / 16, false, false, kD, kD, kUnroll>(dp, sV, key1, sDO, qry1, ln);
      warp_mma<kIsBF16, C::MT1, C::NT1, kD / 16, false, false, kD, kD, kUnroll>(s, sK, key1, sQ, qry1, ln);

      // Masking is needed only where this tile holds keys past nk or (causal) keys above the
      // diagonal: max key n0 + kBN - 1 against min query m0. Query rows past nq need no mask: their
      // lse2 is +inf (P = 0) and their dO and delta are 0 (dS = 0).
      const SeqSpan sp = span_l();
      const int nk_l = sp.nk, delta_l = sp.nk - sp.nq;
      const bool need_mask = kVariants ? !(n0 >= window_lo(va, m0 + kBM - 1, delta_l) &&
                                           n0 + kBN - 1 <= window_hi(va, m0, delta_l, nk_l))
                                       : (n0 + kBN > nk_l) || (causal && n0 + kBN - 1 > m0 + delta_l);
      // P^T / dS^T element (key1 + g + 16 mt + 8 half, qry1 + 8 nt + 2t): the lane's tile offset
      // XOR 16 nt (qry1 / 8 is a multiple of the power-of-two NT1) plus row offsets.
      const u32 st_lane = TM::elem(key1 + g, qry1 + 2 * t);
#pragma unroll
      for (int nt = 0; nt < C::NT1; ++nt) {
        const int il = qry1 + nt * 8 + 2 * t;  // local query of c0 and c2 (c1, c3: il + 1)
        const float2 l2 = *reinterpret_cast<const float2*>(sLse + il);
        const float2 dl = *reinterpret_cast<const float2*>(sDelta + il);
        // Variants, dropout: the Philox words of queries il + qe (qe = e & 1) for this warp's 32-key
        // group. Without kDq they are reduced at once to keep bits (bit 2 mt + (e >> 1) of keep[qe]
        // for key n0 + key1 + 16 mt + g + 8 (e >> 1)), 2 live registers instead of 8; the kDq kernels
        // keep the words. Each form is the one that fits 255 registers at d = 128 under NVRTC 13.5
        // with the 7-round Philox (the words spilled 52 bytes without kDq, the bits 24 with it).
        uint4 bits[2];
        unsigned keep[2] = {0u, 0u};
        if constexpr (kVariants) {
          if (va.drop_thr != 0u) {
            const int bh = b * static_cast<int>(gridDim.y) * group + h;
            const Variants vd = resolved_variants<kRngState>(va);
#pragma unroll
            for (int qe = 0; qe < 2; ++qe) {
              bits[qe] = dropout_bits(vd, bh, m0 + il + qe, (n0 + key1) >> 5, (g >> 1) & 3);
              if constexpr (!kDq) {
#pragma unroll
                for (int mt = 0; mt < C::MT1; ++mt)
#pragma unroll
                  for (int hi = 0; hi < 2; ++hi)
                    keep[qe] |= (dropout_keep(va, bits[qe], n0 + key1 + mt * 16 + g + 8 * hi) ? 1u : 0u)
                                << (2 * mt + hi);
              }
            }
          }
        }
#pragma unroll
        for (int mt = 0; mt < C::MT1; ++mt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float lse_e = (e & 1) ? l2.y : l2.x;
            const float d_e = (e & 1) ? dl.y : dl.x;
            if constexpr (kVariants) {
              const int j = n0 + key1 + mt * 16 + g + 8 * (e >> 1);
              const int i = m0 + il + (e & 1);
              float x, dcap = 1.f;  // log2-unit logit; d logit / d (scale q.k)
              if (va.cap_in != 0.f) {
                const float th = softcap_tanh(va, s[mt][nt][e]);
                x = va.cap_out * th;
                dcap = fmaf(-th, th, 1.f);
              } else {
                x = s[mt][nt][e] * va.scale_log2;
              }
              if (va.alibi != nullptr) x = fmaf(alibi_slope_log2(va, b, h), static_cast<float>(abs(i + delta_l - j)), x);
              float p = fast_exp2(x - lse_e);
              if (need_mask && (j < window_lo(va, i, delta_l) || j > window_hi(va, i, delta_l, nk_l))) p = 0.f;
              float dpv = dp[mt][nt][e];
              float pz = p;  // the P that multiplied V in the forward (dropout: masked, times 1 / (1 - p))
              if (va.drop_thr != 0u) {
                const bool kept = kDq ? dropout_keep(va, bits[e & 1], j) : (keep[e & 1] >> (2 * mt + (e >> 1))) & 1u;
                const float z = kept ? va.drop_scale : 0.f;
                pz = p * z;
                dpv *= z;
              }
              s[mt][nt][e] = pz;
              dp[mt][nt][e] = p * (dpv - d_e) * dcap;
            } else {
              float p = fast_exp2(fmaf(s[mt][nt][e], scale_log2, -lse_e));
              if (need_mask) {
                const int j = n0 + key1 + mt * 16 + g + 8 * (e >> 1);
                const int i = m0 + il + (e & 1);
                if (j >= nk_l || (causal && j > i + delta_l)) p = 0.f;
              }
              s[mt][nt][e] = p;
              dp[mt][nt][e] = p * (dp[mt][nt][e] - d_e);
            }
          }
          // P^T and dS^T rows key1 + mt*16 + g (+8), columns il, il + 1: one 32-bit store each.
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const u32 off = (st_lane ^ (16 * nt)) + (mt * 16 + 8 * half) * TM::kRowBytes;
            *reinterpret_cast<u32*>(smem + C::kOffPt + off) = pack2<kIsBF16>(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]);
            *reinterpret_cast<u32*>(smem + C::kOffDSt + off) =
                pack2<kIsBF16>(dp[mt][nt][2 * half], dp[mt][nt][2 * half + 1]);
          }
        }
      }
    }
    __syncthreads();  // (B)

    // ---- phase 3: dQ (partial over this key block) = dS K -> fp32 RED into dq_accum ----------
    // dq_accum holds 16 x 8 tiles in mma C-fragment order (see the file header), so the fragment
    // c0..c3 of one n8 tile is 16 contiguous bytes: one RED.v4 per n8 tile, 512 contiguous bytes
    // per warp instruction. (Row-major it took two RED.v2 over 8 rows x 32 bytes, and those 16
    // back-to-back REDs drew 19% of the stall samples, mostly mio_throttle, in ncu.) Run before
    // phase 2, so the REDs drain under its mma. Rows of this block past nq add zeros into the
    // NqPad-row workspace: no bounds check.
    if constexpr (kDq) {
      float dq[C::MT3][C::NT3][4];
      zero_acc(dq);
      warp_mma<kIsBF16, C::MT3, C::NT3, kBN / 16, true, true, kBM, kD, kUnroll>(dq, sDSt, qry3, sK, dim3,
                                                                                opaque_lane());
      float* const dq_frag = dq_accum + (ws_row<kVarlen>(b, h, heads, nq_pad, span_l(), ws_pitch) + m0) * kD +
                             ((qry3 / 16) * (kD / 8) + dim3 / 8) * 128 + lane * 4;
#pragma unroll
      for (int mt = 0; mt < C::MT3; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::NT3; ++nt)
          red_add_f32x4(dq_frag + (mt * (kD / 8) + nt) * 128, dq[mt][nt][0], dq[mt][nt][1], dq[mt][nt][2],
                        dq[mt][nt][3]);
    }

    // ---- phase 2: dV += P^T dO, dK += dS^T Q (this warp: keys key2.., dims dim2..) -------------
    warp_mma<kIsBF16, C::MT2, C::NT2, kBM / 16, false, true, kBM, kD>(dv_acc, sPt, key2, sDO, dim2, opaque_lane());
    warp_mma<kIsBF16, C::MT2, C::NT2, kBM / 16, false, true, kBM, kD>(dk_acc, sDSt, key2, sQ, dim2, opaque_lane());
  }

  // ---- epilogue: dK (times scale) and dV through shared memory (K, V tiles reused) ------------
  cp_async_wait<0>();
  __syncthreads();
  store_acc_to_smem<kIsBF16, kD>(smem + C::kOffK, dk_acc, key2, dim2, scale, lane);
  store_acc_to_smem<kIsBF16, kD>(smem + C::kOffV, dv_acc, key2, dim2, 1.f, lane);
  __syncthreads();
  const SeqSpan sp = span_l();
  const int64_t kr = sp.k0 + n0;
  store_tile<kBN, SwizzledTile<kD>, C::kThreads>(dk + b * dk_sb + hk * dk_sh + kr * dk_sr, dk_sr, sp.nk - n0,
                                                 smem + C::kOffK, tid);
  store_tile<kBN, SwizzledTile<kD>, C::kThreads>(dv + b * dv_sb + hk * dv_sh + kr * dv_sr, dv_sr, sp.nk - n0,
                                                 smem + C::kOffV, tid);
}

template <int kD, int kBN, int kBM, int kWarps, int kWN1, int kWN2, int kWM3, int kMinBlocks, bool kIsBF16,
          bool kDq, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) attn_bwd_main_kernel(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ dout,
    u16* __restrict__ dk, u16* __restrict__ dv, float* __restrict__ dq_accum, const float* __restrict__ lse2,
    const float* __restrict__ delta, int64_t q_sb, int64_t q_sh, int64_t q_sr, int64_t k_sb, int64_t k_sh,
    int64_t k_sr, int64_t v_sb, int64_t v_sh, int64_t v_sr, int64_t do_sb, int64_t do_sh, int64_t do_sr,
    int64_t dk_sb, int64_t dk_sh, int64_t dk_sr, int64_t dv_sb, int64_t dv_sh, int64_t dv_sr, int nq, int nk,
    int heads, int group, int nq_pad, int causal, float scale_log2, float scale) {
  attn_bwd_main_body<kD, kBN, kBM, kWarps, kWN1, kWN2, kWM3, kIsBF16, kDq, kUnroll, false>(
      q, k, v, dout, dk, dv, dq_accum, lse2, delta, q_sb, q_sh, q_sr, k_sb, k_sh, k_sr, v_sb, v_sh, v_sr, do_sb, do_sh,
      do_sr, dk_sb, dk_sh, dk_sr, dv_sb, dv_sh, dv_sr, nq, nk, heads, group, nq_pad, causal, scale_log2, scale, nullptr,
      nullptr, 0, Variants{});
}

// With variants (common/variants.cuh): the dense parameters (causal = 0), then VARIANT_PARAMS; kRngState:
// the dropout seed and offset from rng_state (device memory), as in attention_fwd_sm80.cu.
template <int kD, int kBN, int kBM, int kWarps, int kWN1, int kWN2, int kWM3, int kMinBlocks, bool kIsBF16,
          bool kDq, int kUnroll, bool kRngState = false>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) attn_bwd_main_variants_kernel(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ dout,
    u16* __restrict__ dk, u16* __restrict__ dv, float* __restrict__ dq_accum, const float* __restrict__ lse2,
    const float* __restrict__ delta, int64_t q_sb, int64_t q_sh, int64_t q_sr, int64_t k_sb, int64_t k_sh,
    int64_t k_sr, int64_t v_sb, int64_t v_sh, int64_t v_sr, int64_t do_sb, int64_t do_sh, int64_t do_sr,
    int64_t dk_sb, int64_t dk_sh, int64_t dk_sr, int64_t dv_sb, int64_t dv_sh, int64_t dv_sr, int nq, int nk,
    int heads, int group, int nq_pad, int causal, float scale_log2, float scale, VARIANT_PARAMS) {
  attn_bwd_main_body<kD, kBN, kBM, kWarps, kWN1, kWN2, kWM3, kIsBF16, kDq, kUnroll, false, true, kRngState>(
      q, k, v, dout, dk, dv, dq_accum, lse2, delta, q_sb, q_sh, q_sr, k_sb, k_sh, k_sr, v_sb, v_sh, v_sr, do_sb, do_sh,
      do_sr, dk_sb, dk_sh, dk_sr, dv_sb, dv_sh, dv_sr, nq, nk, heads, group, nq_pad, 0, scale_log2, scale, nullptr,
      nullptr, 0, VARIANTS_FROM_PARAMS);
}

// Varlen: grid (ceil(max_seqlen_k / kBN), Hkv, B + 1); the last z-slice zeroes the rows of dk and dv
// past the last sequence.
template <int kD, int kBN, int kBM, int kWarps, int kWN1, int kWN2, int kWM3, int kMinBlocks, bool kIsBF16,
          bool kDq, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) attn_bwd_main_varlen_kernel(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ dout,
    u16* __restrict__ dk, u16* __restrict__ dv, float* __restrict__ dq_accum, const float* __restrict__ lse2,
    const float* __restrict__ delta, int64_t q_sh, int64_t q_sr, int64_t k_sh, int64_t k_sr, int64_t v_sh,
    int64_t v_sr, int64_t do_sh, int64_t do_sr, int64_t dk_sh, int64_t dk_sr, int64_t dv_sh, int64_t dv_sr,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k, int total_k, int group, int ws_pitch,
    int causal, float scale_log2, float scale) {
  if (is_tail_slice()) {  // dk, dv rows past the last sequence: 0
    const int begin = cu_seqlens_k[gridDim.z - 1];
    zero_tail_rows<kD, kWarps * 32>(dk + blockIdx.y * dk_sh, dk_sr, nullptr, begin, total_k);
    zero_tail_rows<kD, kWarps * 32>(dv + blockIdx.y * dv_sh, dv_sr, nullptr, begin, total_k);
    return;
  }
  attn_bwd_main_body<kD, kBN, kBM, kWarps, kWN1, kWN2, kWM3, kIsBF16, kDq, kUnroll, true>(
      q, k, v, dout, dk, dv, dq_accum, lse2, delta, 0, q_sh, q_sr, 0, k_sh, k_sr, 0, v_sh, v_sr, 0, do_sh, do_sr, 0,
      dk_sh, dk_sr, 0, dv_sh, dv_sr, 0, 0, 0, group, 0, causal, scale_log2, scale, cu_seqlens_q, cu_seqlens_k,
      ws_pitch, Variants{});
}

// Varlen with variants: the varlen parameters (causal = 0), then VARIANT_PARAMS.
template <int kD, int kBN, int kBM, int kWarps, int kWN1, int kWN2, int kWM3, int kMinBlocks, bool kIsBF16,
          bool kDq, int kUnroll, bool kRngState = false>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) attn_bwd_main_varlen_variants_kernel(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ dout,
    u16* __restrict__ dk, u16* __restrict__ dv, float* __restrict__ dq_accum, const float* __restrict__ lse2,
    const float* __restrict__ delta, int64_t q_sh, int64_t q_sr, int64_t k_sh, int64_t k_sr, int64_t v_sh,
    int64_t v_sr, int64_t do_sh, int64_t do_sr, int64_t dk_sh, int64_t dk_sr, int64_t dv_sh, int64_t dv_sr,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k, int total_k, int group, int ws_pitch,
    int causal, float scale_log2, float scale, VARIANT_PARAMS) {
  if (is_tail_slice()) {  // dk, dv rows past the last sequence: 0
    const int begin = cu_seqlens_k[gridDim.z - 1];
    zero_tail_rows<kD, kWarps * 32>(dk + blockIdx.y * dk_sh, dk_sr, nullptr, begin, total_k);
    zero_tail_rows<kD, kWarps * 32>(dv + blockIdx.y * dv_sh, dv_sr, nullptr, begin, total_k);
    return;
  }
  attn_bwd_main_body<kD, kBN, kBM, kWarps, kWN1, kWN2, kWM3, kIsBF16, kDq, kUnroll, true, true, kRngState>(
      q, k, v, dout, dk, dv, dq_accum, lse2, delta, 0, q_sh, q_sr, 0, k_sh, k_sr, 0, v_sh, v_sr, 0, do_sh, do_sr, 0,
      dk_sh, dk_sr, 0, dv_sh, dv_sr, 0, 0, 0, group, 0, 0, scale_log2, scale, cu_seqlens_q, cu_seqlens_k,
      ws_pitch, VARIANTS_FROM_PARAMS);
}

// ================================================================================================
// 3b. Deterministic dQ: one block per (query block of kBM rows, head, batch), kBM / 16 warps, each
//     warp owning 16 query rows for the whole walk over key blocks of kBN keys (K and V
//     double-buffered with cp.async). S = Q K^T and dP = dO V^T land in registers in mma C layout
//     (rows = queries), so dS is repacked in registers into A fragments for dQ += dS K without a
//     trip through shared memory (C tiles 2j, 2j+1 of a 16-key step are exactly a0..a3).
// Registers per thread: dQ d*16/32 = d/2 fp32, S and dP 16*kBN/32 = kBN/2 each.
//   d=128, kBN=64: 64 + 32 + 32.   d=256, kBN=32: 128 + 16 + 16.
// Shared memory: Q, dO (kBM x d), K, V double-buffered (2 x kBN x d each).
// ================================================================================================
template <int kD, int kBM, int kBN>
struct DqCfg {
  static constexpr int kWarps = kBM / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int NT = kBN / 8;   // S / dP n8 tiles (keys)
  static constexpr int NTD = kD / 8;   // dQ n8 tiles (dims)
  static_assert(kBM % 32 == 0 && 128 % kBM == 0 && kBN % 16 == 0, "");
  static constexpr int kQBytes = SwizzledTile<kD>::bytes(kBM);
  static constexpr int kKBytes = SwizzledTile<kD>::bytes(kBN);
  static constexpr int kOffQ = 0;
  static constexpr int kOffDO = kQBytes;
  static constexpr int kOffK = 2 * kQBytes;                // 2 stages
  static constexpr int kOffV = kOffK + 2 * kKBytes;        // 2 stages
  static constexpr int kSmem = kOffV + 2 * kKBytes;
  static_assert(kQBytes % 1024 == 0 && kKBytes % 1024 == 0, "tile alignment");
};

// kVariants: as the main kernel; the walk covers only the key blocks inside the window.
template <int kD, int kBM, int kBN, bool kIsBF16, bool kVarlen, bool kVariants = false>
__device__ __forceinline__ void attn_bwd_dq_body(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ dout,
    u16* __restrict__ dq, const float* __restrict__ lse2, const float* __restrict__ delta, int64_t q_sb,
    int64_t q_sh, int64_t q_sr, int64_t k_sb, int64_t k_sh, int64_t k_sr, int64_t v_sb, int64_t v_sh, int64_t v_sr,
    int64_t do_sb, int64_t do_sh, int64_t do_sr, int64_t dq_sb, int64_t dq_sh, int64_t dq_sr, int nq_arg,
    int nk_arg, int heads, int group, int nq_pad, int causal, float scale_log2, float scale,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k, int ws_pitch, const Variants& va) {
  using C = DqCfg<kD, kBM, kBN>;
  static_assert(!kVariants || kBN % 32 == 0, "variants: dropout bits per 32 keys");
  using TD = SwizzledTile<kD>;
  extern __shared__ __align__(1024) char smem[];
  check_dynamic_smem(smem, C::kSmem);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * kBM, h = blockIdx.y, b = blockIdx.z;
  const SeqSpan span = seq_span<kVarlen>(cu_seqlens_q, cu_seqlens_k, b, nq_arg, nk_arg);
  const int nq = span.nq, nk = span.nk;
  if (kVarlen && m0 >= nq) return;  // the varlen grid covers the longest sequence
  const int hk = h / group;
  const int delta_nk = nk - nq;
  const u32 s0 = smem_addr(smem);
  const u32 sQ = s0 + C::kOffQ, sDO = s0 + C::kOffDO;

  // Keys this query block sees: causal stops after the last key visible to its last row.
  int n_end = nk;
  if (causal) n_end = min(nk, min(m0 + kBM, nq) - 1 + delta_nk + 1);
  int nb_begin = 0;  // key blocks [nb_begin, n_blocks)
  if constexpr (kVariants) {
    const int lo = window_lo(va, m0, delta_nk), hi = window_hi(va, min(m0 + kBM, nq) - 1, delta_nk, nk);
    n_end = hi >= lo ? hi + 1 : 0;
    nb_begin = hi >= lo ? lo / kBN : 0;
  }
  const int n_blocks = n_end > 0 ? (n_end + kBN - 1) / kBN : 0;

  const u16* k_bh = k + b * k_sb + span.k0 * k_sr + hk * k_sh;  // [Nk, d] of this kv head
  const u16* v_bh = v + b * v_sb + span.k0 * v_sr + hk * v_sh;
  auto issue_kv = [&](int nb, int stage) {
    const int n0 = nb * kBN;
    load_tile_async<kBN, SwizzledTile<kD>, C::kThreads>(s0 + C::kOffK + stage * C::kKBytes, k_bh + n0 * k_sr, k_sr, nk - n0, tid);
    load_tile_async<kBN, SwizzledTile<kD>, C::kThreads>(s0 + C::kOffV + stage * C::kKBytes, v_bh + n0 * v_sr, v_sr, nk - n0, tid);
  };
  const int64_t r0 = span.q0 + m0;  // token of the block's first query
  load_tile_async<kBM, SwizzledTile<kD>, C::kThreads>(sQ, q + b * q_sb + h * q_sh + r0 * q_sr, q_sr, nq - m0, tid);
  load_tile_async<kBM, SwizzledTile<kD>, C::kThreads>(sDO, dout + b * do_sb + h * do_sh + r0 * do_sr, do_sr, nq - m0,
                                                       tid);
  if (n_blocks > nb_begin) issue_kv(nb_begin, 0);
  cp_async_commit();

  // lse2 / delta of this thread's rows (g and g + 8 of the warp's 16): padded workspace, no check.
  const int64_t ws = ws_row<kVarlen>(b, h, heads, nq_pad, span, ws_pitch) + m0 + warp * 16 + g;
  const float lse_r[2] = {lse2[ws], lse2[ws + 8]};
  const float del_r[2] = {delta[ws], delta[ws + 8]};

  float dq_acc[1][C::NTD][4];
  zero_acc(dq_acc);

#pragma unroll 1
  for (int nb = nb_begin; nb < n_blocks; ++nb) {
    const int stage = (nb - nb_begin) & 1;
    const int n0 = nb * kBN;
    cp_async_wait<0>();
    __syncthreads();  // K/V[nb] visible; every warp is done with stage ^ 1
    if (nb + 1 < n_blocks) issue_kv(nb + 1, stage ^ 1);
    cp_async_commit();
    const u32 sK = s0 + C::kOffK + stage * C::kKBytes;
    const u32 sV = s0 + C::kOffV + stage * C::kKBytes;

    float s[1][C::NT][4];
    float dp[1][C::NT][4];
    zero_acc(s);
    zero_acc(dp);
    warp_mma<kIsBF16, 1, C::NT, kD / 16, false, false, kD, kD>(s, sQ, warp * 16, sK, 0, lane);
    warp_mma<kIsBF16, 1, C::NT, kD / 16, false, false, kD, kD>(dp, sDO, warp * 16, sV, 0, lane);

    if constexpr (kVariants) {
      const bool need_mask = !(n0 >= window_lo(va, m0 + kBM - 1, delta_nk) &&
                               n0 + kBN - 1 <= window_hi(va, m0, delta_nk, nk));
      const int bh = b * static_cast<int>(gridDim.y) + h;
      uint4 bits[2];  // dropout bits of rows g, g + 8 for the current 32-key group
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) {
        if (va.drop_thr != 0u && (nt & 3) == 0) {
#pragma unroll
          for (int half = 0; half < 2; ++half)
            bits[half] = dropout_bits(va, bh, m0 + warp * 16 + g + 8 * half, (n0 + nt * 8) >> 5, t);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int half = e >> 1;
          const int i = m0 + warp * 16 + g + 8 * half;
          const int j = n0 + nt * 8 + 2 * t + (e & 1);
          float x, dcap = 1.f;  // log2-unit logit; d logit / d (scale q.k)
          if (va.cap_in != 0.f) {
            const float th = softcap_tanh(va, s[0][nt][e]);
            x = va.cap_out * th;
            dcap = fmaf(-th, th, 1.f);
          } else {
            x = s[0][nt][e] * va.scale_log2;
          }
          if (va.alibi != nullptr) x = fmaf(alibi_slope_log2(va, b, h), static_cast<float>(abs(i + delta_nk - j)), x);
          float p = fast_exp2(x - lse_r[half]);
          if (need_mask && (j < window_lo(va, i, delta_nk) || j > window_hi(va, i, delta_nk, nk))) p = 0.f;
          float dpv = dp[0][nt][e];
          if (va.drop_thr != 0u) dpv *= dropout_keep(va, bits[half], j) ? va.drop_scale : 0.f;
          dp[0][nt][e] = p * (dpv - del_r[half]) * dcap;
        }
      }
    } else {
      const bool need_mask = (n0 + kBN > nk) || (causal && n0 + kBN - 1 > m0 + delta_nk);
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int half = e >> 1;
          float p = fast_exp2(fmaf(s[0][nt][e], scale_log2, -lse_r[half]));
          if (need_mask) {
            const int i = m0 + warp * 16 + g + 8 * half;
            const int j = n0 + nt * 8 + 2 * t + (e & 1);
            if (j >= nk || (causal && j > i + delta_nk)) p = 0.f;
          }
          dp[0][nt][e] = p * (dp[0][nt][e] - del_r[half]);
        }
    }

    // dQ += dS K: A = dS from registers (16 queries x 16 keys per step), B = K rows = keys (trans).
    const LdsmLane<SwizzledTile<kD>, true, is_pow2(C::NTD / 2), C::NTD / 2> lk(sK, 0, 0, lane);
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      const u32 a[4] = {pack2<kIsBF16>(dp[0][2 * kk][0], dp[0][2 * kk][1]),
                        pack2<kIsBF16>(dp[0][2 * kk][2], dp[0][2 * kk][3]),
                        pack2<kIsBF16>(dp[0][2 * kk + 1][0], dp[0][2 * kk + 1][1]),
                        pack2<kIsBF16>(dp[0][2 * kk + 1][2], dp[0][2 * kk + 1][3])};
#pragma unroll
      for (int np = 0; np < C::NTD / 2; ++np) {
        u32 bf[4];
        ldmatrix_x4_trans(bf, lk.at(kk, np));
        const u32 b_lo[2] = {bf[0], bf[1]};
        const u32 b_hi[2] = {bf[2], bf[3]};
        mma_16816<kIsBF16>(dq_acc[0][2 * np], a, b_lo);
        mma_16816<kIsBF16>(dq_acc[0][2 * np + 1], a, b_hi);
      }
    }
  }

  // Epilogue: the warp's own 16 rows of sQ are read by no other warp, but cp.async fills of sQ
  // were issued by all threads: wait for them block-wide before overwriting.
  cp_async_wait<0>();
  __syncthreads();
  char* const q_tile = smem + C::kOffQ;
  store_acc_to_smem<kIsBF16, kD>(q_tile, dq_acc, warp * 16, 0, scale, lane);
  __syncwarp();
  {
    const SeqSpan sp = seq_span<kVarlen, true>(cu_seqlens_q, cu_seqlens_k, b, nq_arg, nk_arg);
    u16* dst = dq + b * dq_sb + h * dq_sh + static_cast<int64_t>(sp.q0 + m0 + warp * 16) * dq_sr;
    const int valid = sp.nq - (m0 + warp * 16);
#pragma unroll
    for (int idx = lane; idx < 16 * TD::kChunks; idx += 32) {
      const int r = idx / TD::kChunks, c = idx - (idx / TD::kChunks) * TD::kChunks;
      if (r < valid) {
        const uint4 val = *reinterpret_cast<const uint4*>(q_tile + TD::chunk(warp * 16 + r, c));
        *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(r) * dq_sr + c * 8) = val;
      }
    }
  }
}

template <int kD, int kBM, int kBN, bool kIsBF16>
__global__ void __launch_bounds__(kBM / 16 * 32) attn_bwd_dq_kernel(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ dout,
    u16* __restrict__ dq, const float* __restrict__ lse2, const float* __restrict__ delta, int64_t q_sb,
    int64_t q_sh, int64_t q_sr, int64_t k_sb, int64_t k_sh, int64_t k_sr, int64_t v_sb, int64_t v_sh, int64_t v_sr,
    int64_t do_sb, int64_t do_sh, int64_t do_sr, int64_t dq_sb, int64_t dq_sh, int64_t dq_sr, int nq, int nk,
    int heads, int group, int nq_pad, int causal, float scale_log2, float scale) {
  attn_bwd_dq_body<kD, kBM, kBN, kIsBF16, false>(q, k, v, dout, dq, lse2, delta, q_sb, q_sh, q_sr, k_sb, k_sh, k_sr,
                                                 v_sb, v_sh, v_sr, do_sb, do_sh, do_sr, dq_sb, dq_sh, dq_sr, nq, nk,
                                                 heads, group, nq_pad, causal, scale_log2, scale, nullptr, nullptr, 0,
                                                 Variants{});
}

// With variants: the dense parameters (causal = 0), then VARIANT_PARAMS.
template <int kD, int kBM, int kBN, bool kIsBF16, bool kRngState = false>
__global__ void __launch_bounds__(kBM / 16 * 32) attn_bwd_dq_variants_kernel(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ dout,
    u16* __restrict__ dq, const float* __restrict__ lse2, const float* __restrict__ delta, int64_t q_sb,
    int64_t q_sh, int64_t q_sr, int64_t k_sb, int64_t k_sh, int64_t k_sr, int64_t v_sb, int64_t v_sh, int64_t v_sr,
    int64_t do_sb, int64_t do_sh, int64_t do_sr, int64_t dq_sb, int64_t dq_sh, int64_t dq_sr, int nq, int nk,
    int heads, int group, int nq_pad, int causal, float scale_log2, float scale, VARIANT_PARAMS) {
  attn_bwd_dq_body<kD, kBM, kBN, kIsBF16, false, true>(q, k, v, dout, dq, lse2, delta, q_sb, q_sh, q_sr, k_sb, k_sh,
                                                       k_sr, v_sb, v_sh, v_sr, do_sb, do_sh, do_sr, dq_sb, dq_sh,
                                                       dq_sr, nq, nk, heads, group, nq_pad, 0, scale_log2, scale,
                                                       nullptr, nullptr, 0, resolved_variants<kRngState>(VARIANTS_FROM_PARAMS));
}

// Varlen: grid (ceil(max_seqlen_q / kBM), H, B + 1); the last z-slice zeroes the rows of dq past the
// last sequence.
template <int kD, int kBM, int kBN, bool kIsBF16>
__global__ void __launch_bounds__(kBM / 16 * 32) attn_bwd_dq_varlen_kernel(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ dout,
    u16* __restrict__ dq, const float* __restrict__ lse2, const float* __restrict__ delta, int64_t q_sh,
    int64_t q_sr, int64_t k_sh, int64_t k_sr, int64_t v_sh, int64_t v_sr, int64_t do_sh, int64_t do_sr,
    int64_t dq_sh, int64_t dq_sr, const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
    int total_q, int group, int ws_pitch, int causal, float scale_log2, float scale) {
  if (is_tail_slice()) {  // dq rows past the last sequence: 0
    zero_tail_rows<kD, kBM / 16 * 32>(dq + blockIdx.y * dq_sh, dq_sr, nullptr, cu_seqlens_q[gridDim.z - 1], total_q);
    return;
  }
  attn_bwd_dq_body<kD, kBM, kBN, kIsBF16, true>(q, k, v, dout, dq, lse2, delta, 0, q_sh, q_sr, 0, k_sh, k_sr, 0, v_sh,
                                                v_sr, 0, do_sh, do_sr, 0, dq_sh, dq_sr, 0, 0, 0, group, 0, causal,
                                                scale_log2, scale, cu_seqlens_q, cu_seqlens_k, ws_pitch, Variants{});
}

// Varlen with variants: the varlen parameters (causal = 0), then VARIANT_PARAMS.
template <int kD, int kBM, int kBN, bool kIsBF16, bool kRngState = false>
__global__ void __launch_bounds__(kBM / 16 * 32) attn_bwd_dq_varlen_variants_kernel(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ dout,
    u16* __restrict__ dq, const float* __restrict__ lse2, const float* __restrict__ delta, int64_t q_sh,
    int64_t q_sr, int64_t k_sh, int64_t k_sr, int64_t v_sh, int64_t v_sr, int64_t do_sh, int64_t do_sr,
    int64_t dq_sh, int64_t dq_sr, const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
    int total_q, int group, int ws_pitch, int causal, float scale_log2, float scale, VARIANT_PARAMS) {
  if (is_tail_slice()) {  // dq rows past the last sequence: 0
    zero_tail_rows<kD, kBM / 16 * 32>(dq + blockIdx.y * dq_sh, dq_sr, nullptr, cu_seqlens_q[gridDim.z - 1], total_q);
    return;
  }
  attn_bwd_dq_body<kD, kBM, kBN, kIsBF16, true, true>(q, k, v, dout, dq, lse2, delta, 0, q_sh, q_sr, 0, k_sh, k_sr, 0,
                                                      v_sh, v_sr, 0, do_sh, do_sr, 0, dq_sh, dq_sr, 0, 0, 0, group, 0,
                                                      0, scale_log2, scale, cu_seqlens_q, cu_seqlens_k, ws_pitch,
                                                      resolved_variants<kRngState>(VARIANTS_FROM_PARAMS));
}

}  // namespace bwd
}  // namespace tileattn
