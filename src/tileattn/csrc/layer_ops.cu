// The decoder layer's small elementwise steps, each one launch where eager torch needs two to
// four: residual add + RMSNorm, per-head RMSNorm + rotary embedding in place, SiLU(gate) * up.
//
// Why: at decode a Llama layer's weights are read by four GEMVs of 8-60 us each, and the rest is
// a dozen elementwise kernels that move a few kilobytes each. Inside a CUDA graph each of those
// still costs ~2-3 us of GPU time (launch latency, one wave, the tail), so 32 layers x 9 of
// them are ~0.7 ms of a ~6 ms token on Llama-3-8B, and more on small models whose GEMVs are short.
// Fusing them removes launches; the bytes moved are the same (these kernels are far from any
// bandwidth or compute limit: a [1, 4096] row is 8 KB).
//
// Numerics follow the transformers implementations the engine is tested against, including
// their roundings to the 16-bit type between steps: RMSNorm rounds x / rms(x) to 16 bits and then
// multiplies by the weight (one more rounding); the residual sum is rounded before it is
// normalised; SiLU's output is rounded before the product. Sums of squares are fp32.
//
// Elements travel as raw 16-bit values (kIsBF16 picks bf16 or fp16), 8 per 16-byte chunk; the
// host guarantees 16-byte aligned rows and pointers.
//
// Programmatic dependent launch: every kernel here calls pdl_wait() before its first global
// access and then pdl_release_dependents() (common/pdl.cuh), so the host may launch it with the
// PDL attribute (TILEATTN_PDL=1) and let its blocks start during the previous kernel's tail.
#include <cuda/std/cstdint>

#include "common/elementwise.cuh"

namespace tileattn {

namespace layer_ops {

// One (token, head) row of the rotary step, held by one warp: lane l owns the pairs
// j = l, l + 32, ... (j < d/2) of elements (j, j + d/2). Loads the row from `src`, applies the
// optional per-head RMSNorm with weight `w`, rotates with the fp32 table rows (rounded to the
// 16-bit type), and returns the 16-bit results in out_lo/out_hi (pairs past d/2 are left alone).
// norm_rotary and norm_rotary_write_kv both run this one function, so the key a fused launch
// writes into the cache is bit for bit the key norm_rotary leaves in place. Every product and sum
// is an explicit round-to-nearest intrinsic (the rotation: common/elementwise.cuh's rotate_pair),
// rounding as torch's fp32 `x * cos + roll(x) * sin`.
constexpr int kRotaryMaxPairs = 4;

template <bool kIsBF16, bool kNorm>
__device__ __forceinline__ void rotate_row(const u16* src, const u16* w, const float* cos_row,
                                           const float* sin_row, int lane, int half, float eps,
                                           u16 (&out_lo)[kRotaryMaxPairs], u16 (&out_hi)[kRotaryMaxPairs]) {
  float lo[kRotaryMaxPairs], hi[kRotaryMaxPairs];
  float sumsq = 0.f;
#pragma unroll
  for (int i = 0; i < kRotaryMaxPairs; ++i) {
    const int j = lane + 32 * i;
    lo[i] = hi[i] = 0.f;
    if (j < half) {
      lo[i] = to_float<kIsBF16>(src[j]);
      hi[i] = to_float<kIsBF16>(src[j + half]);
      sumsq = __fmaf_rn(hi[i], hi[i], __fmaf_rn(lo[i], lo[i], sumsq));
    }
  }
  if constexpr (kNorm) {
    const float inv_rms = rsqrtf(__fadd_rn(__fdiv_rn(warp_sum(sumsq), static_cast<float>(2 * half)), eps));
#pragma unroll
    for (int i = 0; i < kRotaryMaxPairs; ++i) {
      const int j = lane + 32 * i;
      if (j < half) {
        lo[i] = round16<kIsBF16>(__fmul_rn(to_float<kIsBF16>(w[j]), round16<kIsBF16>(__fmul_rn(lo[i], inv_rms))));
        hi[i] = round16<kIsBF16>(
            __fmul_rn(to_float<kIsBF16>(w[j + half]), round16<kIsBF16>(__fmul_rn(hi[i], inv_rms))));
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRotaryMaxPairs; ++i) {
    const int j = lane + 32 * i;
    // sin_row[j + half] = +sin_j (the table's second half)
    if (j < half) rotate_pair<kIsBF16>(lo[i], hi[i], cos_row[j], sin_row[j + half], out_lo[i], out_hi[i]);
  }
}

// The row rotate_row produced: pair i of this lane (elements j = lane + 32 i and j + d/2) to dst.
__device__ __forceinline__ void store_row(u16* dst, const u16 (&lo)[kRotaryMaxPairs], const u16 (&hi)[kRotaryMaxPairs],
                                          int lane, int half) {
#pragma unroll
  for (int i = 0; i < kRotaryMaxPairs; ++i) {
    const int j = lane + 32 * i;
    if (j < half) {
      dst[j] = lo[i];
      dst[j + half] = hi[i];
    }
  }
}

}  // namespace layer_ops

// ---- residual add + RMSNorm ------------------------------------------------------------------
//   s = x + residual (rounded; written back into residual)  or  s = x  (no residual)
//   out = weight * round(s / sqrt(mean(s^2) + eps))
// One block per row; thread i owns chunks i, i + blockDim, ... (at most kMaxChunks, kept in
// registers between the two passes). The host picks blockDim = min(1024, chunks) rounded up to a
// warp, so D <= 1024 * 8 * kMaxChunks = 32768.
template <bool kIsBF16>
__global__ void __launch_bounds__(1024)
    add_rms_norm(uint4* __restrict__ out, uint4* __restrict__ residual, const uint4* __restrict__ x,
                 const uint4* __restrict__ weight, int chunks, int64_t out_stride, int64_t res_stride,
                 int64_t x_stride, float eps, int has_residual) {
  using namespace layer_ops;
  pdl_enter();
  const int64_t row = blockIdx.x;
  float s[kNormMaxChunks][8];
  float sumsq = 0.f;
#pragma unroll
  for (int i = 0; i < kNormMaxChunks; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < chunks) {
      load8<kIsBF16>(x[row * x_stride + c], s[i]);
      if (has_residual) {
        float r[8];
        load8<kIsBF16>(residual[row * res_stride + c], r);
#pragma unroll
        for (int e = 0; e < 8; ++e) s[i][e] = round16<kIsBF16>(s[i][e] + r[e]);
        residual[row * res_stride + c] = store8<kIsBF16>(s[i]);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) sumsq += s[i][e] * s[i][e];
    }
  }
  // Block sum: warp shuffles, then the warps' partials through shared memory.
  __shared__ float partial[32];
  sumsq = warp_sum(sumsq);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) partial[warp] = sumsq;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  float total = lane < warps ? partial[lane] : 0.f;
  total = warp_sum(total);
  const float inv_rms = rsqrtf(total / static_cast<float>(chunks * 8) + eps);
#pragma unroll
  for (int i = 0; i < kNormMaxChunks; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < chunks) {
      float w[8];
      load8<kIsBF16>(weight[c], w);
#pragma unroll
      for (int e = 0; e < 8; ++e) s[i][e] = w[e] * round16<kIsBF16>(s[i][e] * inv_rms);
      out[row * out_stride + c] = store8<kIsBF16>(s[i]);
    }
  }
}

// ---- per-head RMSNorm (optional) + rotary embedding, in place ---------------------------------
//   x: [T, heads, d] (row stride x_st, head stride x_sh, in elements; d contiguous)
//   heads [0, q_heads) use q_weight, the others k_weight (when kNorm)
//   a position outside [0, num_positions) leaves its token's heads untouched (the host's
//   validate=True reports it): the tables are never read out of bounds
//   rotate-half rotary with cos/sin [P, d] float32 tables (cos twice; (-sin, sin)), rounded to
//   the 16-bit type as the model's Rotary module hands them to the layers:
//     y_j = x_j cos_j - x_{j+d/2} sin_j,  y_{j+d/2} = x_{j+d/2} cos_j + x_j sin_j   (j < d/2)
// One warp per (token, head) (layer_ops::rotate_row); d <= 256.
template <bool kIsBF16, bool kNorm>
__global__ void __launch_bounds__(256)
    norm_rotary(u16* __restrict__ x, const int64_t* __restrict__ positions, const float* __restrict__ cos_table,
                const float* __restrict__ sin_table, const u16* __restrict__ q_weight,
                const u16* __restrict__ k_weight, int num_rows, int heads, int q_heads, int head_dim,
                int64_t x_st, int64_t x_sh, int64_t num_positions, float eps) {
  using namespace layer_ops;
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);  // token * heads + head
  if (row >= num_rows) return;  // whole warps leave together
  pdl_enter();
  const int lane = threadIdx.x & 31, half = head_dim >> 1;
  const int t = row / heads, h = row - t * heads;
  const int64_t p = positions[t];
  if (p < 0 || p >= num_positions) return;  // never read past the tables: the row stays as it is
  u16* head = x + t * x_st + h * x_sh;
  // Zero-initialised: ptxas otherwise keeps the pairs past d/2 (never written) on the stack (sm_80).
  u16 lo[kRotaryMaxPairs] = {}, hi[kRotaryMaxPairs] = {};
  rotate_row<kIsBF16, kNorm>(head, h < q_heads ? q_weight : k_weight, cos_table + p * head_dim,
                             sin_table + p * head_dim, lane, half, eps, lo, hi);
  store_row(head, lo, hi, lane, half);
}

// ---- the same, with the keys and values written into the paged KV cache -------------------------
// norm_rotary of the q heads in place, and for each kv head: its k row normalised and rotated in
// registers and stored straight into k_cache at the token's slot, its v row copied into v_cache
// there. One launch where norm_rotary + write_kv_cache take two; the k rows of the input are read
// only (left as they were: nothing downstream reads them, attention reads the cache).
//   q: [T, q_heads, d] (strides q_st, q_sh elements); k, v: [T, kv_heads, d] (k strides in
//   elements, v strides in 16-byte chunks); k_cache, v_cache: [blocks, 1 << log2_block_size,
//   kv_heads, d] (k_cache strides in elements, v_cache strides in chunks)
//   slot = slot_mapping[t]: cache block slot >> log2_block_size, row slot & (block_size - 1); a
//   slot outside [0, num_slots) skips the token's k and v (padding), as write_kv_cache does
//   a position outside [0, num_positions) leaves the token's q heads untouched and writes its k
//   rows unrotated: exactly what norm_rotary followed by write_kv_cache produce
// Rows: one warp per (token, head) over the q_heads + kv_heads heads of a token, q heads first.
// A kv warp's lane c < d / 8 also moves 16-byte chunk c of the v row.
template <bool kIsBF16, bool kNorm, typename Index>
__global__ void __launch_bounds__(256)
    norm_rotary_write_kv(u16* __restrict__ q, const u16* __restrict__ k, const uint4* __restrict__ v,
                         u16* __restrict__ k_cache, uint4* __restrict__ v_cache,
                         const Index* __restrict__ slot_mapping, const int64_t* __restrict__ positions,
                         const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                         const u16* __restrict__ q_weight, const u16* __restrict__ k_weight, int num_rows,
                         int q_heads, int kv_heads, int head_dim, int64_t q_st, int64_t q_sh, int64_t k_st,
                         int64_t k_sh, int64_t v_st, int64_t v_sh, int64_t kc_sb, int64_t kc_sr, int64_t kc_sh,
                         int64_t vc_sb, int64_t vc_sr, int64_t vc_sh, int log2_block_size, int64_t num_slots,
                         int64_t num_positions, float eps) {
  using namespace layer_ops;
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);  // token * heads + head
  if (row >= num_rows) return;  // whole warps leave together
  pdl_enter();
  const int lane = threadIdx.x & 31, half = head_dim >> 1;
  const int heads = q_heads + kv_heads;
  const int t = row / heads, h = row - t * heads;
  const int64_t p = positions[t];
  const bool in_table = p >= 0 && p < num_positions;
  u16 lo[kRotaryMaxPairs] = {}, hi[kRotaryMaxPairs] = {};  // zeroed: see norm_rotary
  if (h < q_heads) {
    if (!in_table) return;
    u16* head = q + t * q_st + h * q_sh;
    rotate_row<kIsBF16, kNorm>(head, q_weight, cos_table + p * head_dim, sin_table + p * head_dim, lane, half, eps,
                               lo, hi);
    store_row(head, lo, hi, lane, half);
    return;
  }
  const int hk = h - q_heads;
  const int64_t slot = static_cast<int64_t>(slot_mapping[t]);
  if (slot < 0 || slot >= num_slots) return;  // padding token, or a slot outside the cache
  const int64_t blk = slot >> log2_block_size, off = slot & ((int64_t{1} << log2_block_size) - 1);
  const u16* src = k + t * k_st + hk * k_sh;
  if (in_table) {
    rotate_row<kIsBF16, kNorm>(src, k_weight, cos_table + p * head_dim, sin_table + p * head_dim, lane, half, eps,
                               lo, hi);
  } else {
#pragma unroll
    for (int i = 0; i < kRotaryMaxPairs; ++i) {
      const int j = lane + 32 * i;
      if (j < half) {
        lo[i] = src[j];
        hi[i] = src[j + half];
      }
    }
  }
  u16* dst = k_cache + blk * kc_sb + off * kc_sr + hk * kc_sh;
  store_row(dst, lo, hi, lane, half);
  if (lane < (head_dim >> 3)) v_cache[blk * vc_sb + off * vc_sr + hk * vc_sh + lane] = v[t * v_st + hk * v_sh + lane];
}

// ---- SiLU(gate) * up ---------------------------------------------------------------------------
//   x: [T, 2F] (gate = columns [0, F), up = [F, 2F); row stride x_st chunks), out: [T, F]
//   out = round(silu(gate)) * up, silu(g) = g / (1 + e^-g)
// One thread per 8-element chunk of out.
template <bool kIsBF16>
__global__ void __launch_bounds__(256)
    silu_mul(uint4* __restrict__ out, const uint4* __restrict__ x, int64_t num_chunks, int chunks_per_row,
             int64_t x_st, int64_t out_st) {
  using namespace layer_ops;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_chunks) return;
  pdl_enter();
  const int64_t t = i / chunks_per_row;
  const int c = static_cast<int>(i - t * chunks_per_row);
  float g[8], u[8];
  load8<kIsBF16>(x[t * x_st + c], g);
  load8<kIsBF16>(x[t * x_st + chunks_per_row + c], u);
#pragma unroll
  for (int e = 0; e < 8; ++e) g[e] = silu_times<kIsBF16>(g[e], u[e]);
  out[t * out_st + c] = store8<kIsBF16>(g);
}

}  // namespace tileattn
