// Skinny GEMM for decode: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for m < M <= 8.
//
// At decode a linear layer reads its whole weight matrix to produce a handful of rows: the work is
// pure weight streaming (Llama-3-8B: 15 GB per token; 2 FLOPs per weight element per row of x,
// far below the tensor cores' need). The time is bytes / bandwidth, so the kernel's one job is to
// keep enough 16-byte loads of W in flight on every SM to reach the HBM's ~4.3 TB/s copy rate.
// On the H200 the engine's Llama-3-8B decode forward with torch's F.linear ran at 3.1 TB/s
// effective (4.85 ms for 15 GB, small kernels included; docs/layer_ops.md).
//
// ---- Work decomposition ---------------------------------------------------------------------
// A warp owns kRows = 4 consecutive output columns n (rows of W). Its 32 lanes walk K in 16-byte
// chunks (8 elements): lane l takes chunks l, l + 32, ..., so one warp-wide load instruction reads
// 512 contiguous bytes of one W row (full 128-byte lines). Each step of the walk loads the 4 rows'
// chunks and the M rows' matching x chunks, and does 4 * M * 8 FMAs in fp32.
// Loads in flight: the walk is unrolled kUnroll = 4 steps deep, the 16 W loads (4 rows x 4 steps)
// issued before any of them is used: 16 x 16 B = 256 B per lane, 8 KB per warp. With 16 warps per
// SM resident that is 128 KB per SM, 17 MB over 132 SMs: several times the ~4 MB that the HBM's
// bandwidth-latency product needs.
// x is read through L1 (M * K * 2 bytes <= 229 KB for K = 14336, M = 8; every warp of the grid
// reads all of it, so it stays cache-resident); the x:W load ratio is M / kRows, at most 2.
// End: each lane holds M * kRows partial sums; 5 butterfly shuffles per sum give every lane the
// totals, and lane (m * kRows + r) % 32 writes y[m, n0 + r] (one 16-bit store each).
//
// ---- Registers -------------------------------------------------------------------------------
// W chunks in flight: 16 x 4 = 64; accumulators: M * kRows <= 32; x chunk: 4; addresses ~10.
// NVRTC 13.5 for sm_90a: 90 registers at M = 1, 144 at M = 8, no spills (tileattn check).
#include <cuda/std/cstdint>

#include "common/sm80.cuh"

namespace tileattn {

constexpr int kGemvRows = 4;
constexpr int kGemvUnroll = 4;
constexpr int kGemvWarps = 4;  // 128 threads per block

template <bool kIsBF16, int kMaxM>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv(u16* __restrict__ y, const uint4* __restrict__ x, const uint4* __restrict__ w, const u16* __restrict__ bias,
         int m_rows, int n, int k_chunks, int64_t x_stride, int64_t w_stride, int64_t y_stride) {
  const int lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * kGemvWarps + (threadIdx.x >> 5)) * kGemvRows;
  if (n0 >= n) return;  // whole warps leave together

  // Rows past n read row n0 instead (valid memory) and are never stored.
  const uint4* wrow[kGemvRows];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) wrow[r] = w + static_cast<int64_t>(n0 + r < n ? n0 + r : n0) * w_stride;

  float acc[kMaxM][kGemvRows];
#pragma unroll
  for (int m = 0; m < kMaxM; ++m)
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) acc[m][r] = 0.f;

  for (int base = lane; base < k_chunks; base += 32 * kGemvUnroll) {
    uint4 wc[kGemvUnroll][kGemvRows];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int c = base + 32 * u;
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) wc[u][r] = c < k_chunks ? __ldcs(wrow[r] + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int c = base + 32 * u;
      if (c >= k_chunks) break;
#pragma unroll
      for (int m = 0; m < kMaxM; ++m) {
        if (m >= m_rows) break;
        const uint4 xc = __ldg(x + m * x_stride + c);
        const u32 xs[4] = {xc.x, xc.y, xc.z, xc.w};
#pragma unroll
        for (int r = 0; r < kGemvRows; ++r) {
          const u32 ws[4] = {wc[u][r].x, wc[u][r].y, wc[u][r].z, wc[u][r].w};
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            float x0, x1, w0, w1;
            unpack2<kIsBF16>(xs[p], x0, x1);
            unpack2<kIsBF16>(ws[p], w0, w1);
            acc[m][r] = fmaf(x0, w0, fmaf(x1, w1, acc[m][r]));
          }
        }
      }
    }
  }

#pragma unroll
  for (int m = 0; m < kMaxM; ++m) {
    if (m >= m_rows) break;
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      float v = acc[m][r];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      const int col = n0 + r;
      if (lane == ((m * kGemvRows + r) & 31) && col < n) {
        if (bias != nullptr) v += to_float<kIsBF16>(bias[col]);
        y[m * y_stride + col] = from_float<kIsBF16>(v);
      }
    }
  }
}

}  // namespace tileattn
