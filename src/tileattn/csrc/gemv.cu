// y = act(x) W^T (+ bias) for a few rows x (decode: M = 1..8), W [N, K] in nn.Linear's layout,
// optionally with the step before it fused in as a prologue: SiLU(gate) * up (the GatedMLP's
// down projection), or the residual add + RMSNorm (the attention and MLP input projections).
//
// Why: at M <= 8 a projection is a stream of weights. Llama-3-8B reads ~15 GB of bf16 weights per
// token; at 4.3 TB/s (the H200's copy rate) that is 3.5 ms, and cuBLAS's GEMV/split-K kernels reach
// ~3.9 TB/s plus a split-K reduce. The elementwise steps between the projections are ~2-3 us
// launches each. So: read every weight byte exactly once, with enough bytes in flight per SM to
// cover HBM latency (Little: 4.3 TB/s x ~0.7 us / 132 SMs ~ 23 KB per SM), and do the elementwise
// step in the same launch.
//
// Layout of the work (docs/gemv.md has the byte counts):
// - One block per SM (grid = min(SMs, tasks)), 16 warps. A task is kRows consecutive output rows
//   over the whole K; block b owns tasks [b T / G, (b + 1) T / G), its warps take them in turn, so
//   blocks differ by at most one task (N = 4096, M = 1: 31 or 32 rows per SM).
// - The prologue writes the M prepared input rows into shared memory once per block, as fp32 (the
//   16-bit values the unfused op would have stored, widened: the inner loop then converts only the
//   weights).
// - A warp streams its rows: lane l reads 16-byte chunks l, l + 32, ... of each row, kLoads = 8
//   independent loads per lane per step (kRows x kUnroll): 16 warps x 32 lanes x 8 x 16 B = 64 KB
//   in flight per SM, kept in flight by reloading each chunk's registers with the next step's
//   chunk as soon as they are unpacked. The loads of a warp's first step are issued before the
//   PDL wait and the prologue: weights do not depend on the previous kernel, so they arrive while
//   x is staged.
// - fp32 FMAs, a warp shuffle sum per (row, m), lane 0 stores y rounded once (bias added in fp32).
// - kRows (rows per warp) grows with M: each shared-memory chunk of x is read once per warp step
//   and used for kRows rows, so shared-memory bytes per weight byte = 2 M / kRows (fp32 x vs 16-bit
//   W); 2 at M = 1 (kRows 1), 4 at M = 4 (kRows 2), 4 at M = 8 (kRows 4), against the ~128 B/clk of
//   shared memory and ~25 B/clk of HBM per SM.
//
// Numerics: the prologues are add_rms_norm's and silu_mul's step for step (common/elementwise.cuh's
// helpers), including the order of add_rms_norm's sum of squares (its 1024-thread layout replayed), so the
// input rows are the 16-bit values the unfused ops produce. y's fp32 sum is in this kernel's order.
#include "common/elementwise.cuh"

namespace tileattn {

namespace gemv_detail {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kLoads = 8;  // 16-byte weight loads in flight per lane per step
constexpr int kMaxRowsM = 8;

enum Prologue : int { kNone = 0, kSiluMul = 1, kAddRmsNorm = 2 };

// A weight chunk: touched once per launch, so it is not allocated in L1 (no reuse to gain, and no
// line of anything else evicted for it), and read through the non-coherent path (the weights are
// read-only for the kernel's lifetime).
// When `pred`: v = the chunk at p; otherwise v keeps its (stale) registers and nothing is read.
// One predicated instruction: the select-to-zero and the branch around each load that a C++
// conditional compiled to cost 6% of the Llama-3-8B projection chain (measured, docs/gemv.md),
// and a chunk that was not loaded is never used (the FMAs check c < chunks themselves).
__device__ __forceinline__ void load_weight_if(uint4& v, const uint4* p, bool pred) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
               " @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
               : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
               : "l"(p), "r"(static_cast<int>(pred)));
}

// A staged input row in shared memory: [chunks] float4 of each chunk's elements 0-3, then
// [chunks] float4 of elements 4-7. Lane l reading chunk base + l then reads 16 consecutive bytes
// per lane per access (conflict-free); one 32-byte float[8] per chunk would make lanes l and l + 4
// share banks in every quarter-warp and double the shared-memory time.
__device__ __forceinline__ void store_chunk(float* row, int chunks, int c, const float (&f)[8]) {
  reinterpret_cast<float4*>(row)[c] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(row)[chunks + c] = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ void load_chunk(const float* row, int chunks, int c, float (&f)[8]) {
  const float4 lo = reinterpret_cast<const float4*>(row)[c], hi = reinterpret_cast<const float4*>(row)[chunks + c];
  f[0] = lo.x, f[1] = lo.y, f[2] = lo.z, f[3] = lo.w, f[4] = hi.x, f[5] = hi.y, f[6] = hi.z, f[7] = hi.w;
}

// Stage act(x) rows into xs [M][K] fp32. kNone: a copy; kSiluMul: layer_ops' silu_mul.
template <bool kIsBF16, int kPrologue>
__device__ __forceinline__ void stage_elementwise(float* xs, const uint4* __restrict__ x, int M, int chunks,
                                                  int64_t x_st) {
  using namespace layer_ops;
  for (int i = threadIdx.x; i < M * chunks; i += kThreads) {
    const int m = i / chunks, c = i - m * chunks;
    float g[8];
    load8<kIsBF16>(x[m * x_st + c], g);
    if constexpr (kPrologue == kSiluMul) {
      float u[8];
      load8<kIsBF16>(x[m * x_st + chunks + c], u);
#pragma unroll
      for (int e = 0; e < 8; ++e) g[e] = round16<kIsBF16>(silu_times<kIsBF16>(g[e], u[e]));
    }
    store_chunk(xs + static_cast<int64_t>(m) * chunks * 8, chunks, c, g);
  }
}

// Stage h = RMSNorm(x (+ residual)) rows into xs, as layer_ops' add_rms_norm computes them: its
// launch has norm_threads = min(chunks, 1024) rounded up to a warp, thread v owning chunks v + i *
// norm_threads (i < kNormMaxChunks) and summing their squares in that order, then a warp sum and a
// sum of the warp partials by one warp. Here each of the 512 threads plays threads v = tid, tid +
// 512 (warp-uniform: both counts are multiples of 32), so the fp32 sum, and h, are bit for bit
// the unfused kernel's. Block 0 alone writes the rounded sum to new_residual.
template <bool kIsBF16>
__device__ __forceinline__ void stage_add_rms_norm(float* xs, float (*partial)[32], const uint4* __restrict__ x,
                                                   const uint4* __restrict__ residual, uint4* __restrict__ new_residual,
                                                   const uint4* __restrict__ norm_weight, int M, int chunks,
                                                   int64_t x_st, int64_t res_st, float eps) {
  using namespace layer_ops;
  const int norm_threads = (min(chunks, 1024) + 31) / 32 * 32;
  const int lane = threadIdx.x & 31;
  for (int m = 0; m < M; ++m) {
    float* row = xs + static_cast<int64_t>(m) * chunks * 8;
    for (int v = threadIdx.x; v < norm_threads; v += kThreads) {
      float sumsq = 0.f;
#pragma unroll
      for (int i = 0; i < kNormMaxChunks; ++i) {
        const int c = v + i * norm_threads;
        if (c < chunks) {
          float s[8];
          load8<kIsBF16>(x[m * x_st + c], s);
          if (residual != nullptr) {
            float r[8];
            load8<kIsBF16>(residual[m * res_st + c], r);
#pragma unroll
            for (int e = 0; e < 8; ++e) s[e] = round16<kIsBF16>(s[e] + r[e]);
            if (blockIdx.x == 0) new_residual[static_cast<int64_t>(m) * chunks + c] = store8<kIsBF16>(s);
          }
#pragma unroll
          for (int e = 0; e < 8; ++e) sumsq += s[e] * s[e];
          store_chunk(row, chunks, c, s);
        }
      }
      sumsq = warp_sum(sumsq);
      if (lane == 0) partial[m][v >> 5] = sumsq;
    }
  }
  __syncthreads();
  const int norm_warps = norm_threads >> 5;
  for (int m = 0; m < M; ++m) {
    const float total = warp_sum(lane < norm_warps ? partial[m][lane] : 0.f);
    const float inv_rms = rsqrtf(total / static_cast<float>(chunks * 8) + eps);
    float* row = xs + static_cast<int64_t>(m) * chunks * 8;
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      float w[8], s[8];
      load8<kIsBF16>(norm_weight[c], w);
      load_chunk(row, chunks, c, s);
#pragma unroll
      for (int e = 0; e < 8; ++e) s[e] = round16<kIsBF16>(w[e] * round16<kIsBF16>(s[e] * inv_rms));
      store_chunk(row, chunks, c, s);
    }
  }
}

}  // namespace gemv_detail

// ---- the GEMV ---------------------------------------------------------------------------------
//   y [M, N] (contiguous) = act(x) [M, K] @ weight [N, K]^T (+ bias [N] when bias != nullptr)
//   kPrologue kNone:       act(x) = x [M, K] (row stride x_st chunks)
//              kSiluMul:    act(x) = silu_mul(x), x [M, 2K]
//              kAddRmsNorm: act(x) = add_rms_norm(x, residual) with norm_weight [K], eps; the
//                           rounded sum x + residual to new_residual [M, K] (contiguous) when
//                           residual != nullptr
//   chunks = K / 8; M <= kMaxM; dynamic shared memory M * K * 4 bytes.
template <bool kIsBF16, int kPrologue, int kMaxM>
__global__ void __launch_bounds__(gemv_detail::kThreads, 1)
    gemv(u16* __restrict__ y, const uint4* __restrict__ x, const uint4* __restrict__ weight,
         const u16* __restrict__ bias, const uint4* __restrict__ residual, const uint4* __restrict__ norm_weight,
         uint4* __restrict__ new_residual, int M, int N, int chunks, int64_t x_st, int64_t res_st, float eps) {
  using namespace layer_ops;
  using namespace gemv_detail;
  static_assert(kMaxM >= 1 && kMaxM <= kMaxRowsM, "M bucket");
  constexpr int kRows = kMaxM == 1 ? 1 : (kMaxM <= 4 ? 2 : 4);  // output rows per warp task
  constexpr int kUnroll = kLoads / kRows;                      // chunks per row per step
  constexpr int kStep = 32 * kUnroll;                          // chunks of a row per warp step
  extern __shared__ float4 smem_f4[];
  float* xs = reinterpret_cast<float*>(smem_f4);  // [M] rows of K fp32 (store_chunk's layout)
  __shared__ float partial[kPrologue == kAddRmsNorm ? kMaxM : 1][32];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tasks = (N + kRows - 1) / kRows;
  const int task_begin = static_cast<int>(static_cast<int64_t>(blockIdx.x) * tasks / gridDim.x);
  const int task_end = static_cast<int>(static_cast<int64_t>(blockIdx.x + 1) * tasks / gridDim.x);

  // Rows past N (the last task) read row N - 1 again and store nothing.
  auto row_ptr = [&](int task, int r) {
    return weight + static_cast<int64_t>(min(task * kRows + r, N - 1)) * chunks;
  };
  uint4 w[kRows][kUnroll];
  auto load_step = [&](int task, int base) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const uint4* p = row_ptr(task, r);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = base + u * 32 + lane;
        load_weight_if(w[r][u], p + c, c < chunks);
      }
    }
  };

  int task = task_begin + warp;
  if (task < task_end) load_step(task, 0);  // before the wait: weights are not the previous kernel's output

  pdl_enter();
  if constexpr (kPrologue == kAddRmsNorm) {
    stage_add_rms_norm<kIsBF16>(xs, partial, x, residual, new_residual, norm_weight, M, chunks, x_st, res_st, eps);
  } else {
    stage_elementwise<kIsBF16, kPrologue>(xs, x, M, chunks, x_st);
  }
  __syncthreads();

  // A rolling prefetch: as soon as chunk u of a step is unpacked, its registers are reloaded with
  // chunk u of the warp's next step (the next K slice of this task, or the first slice of its next
  // task), so each lane keeps ~kLoads loads in flight through its whole stream with no extra
  // registers.
  for (; task < task_end; task += kWarps) {
    float acc[kRows][kMaxM];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int m = 0; m < kMaxM; ++m) acc[r][m] = 0.f;
    for (int base = 0; base < chunks; base += kStep) {
      int next_task = task, next_base = base + kStep;
      if (next_base >= chunks) next_task += kWarps, next_base = 0;
      const bool prefetch = next_task < task_end;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = base + u * 32 + lane;
        float wf[kRows][8];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          load8<kIsBF16>(w[r][u], wf[r]);
          const int c_next = next_base + u * 32 + lane;
          load_weight_if(w[r][u], row_ptr(next_task, r) + c_next, prefetch && c_next < chunks);
        }
        if (c < chunks) {
#pragma unroll
          for (int m = 0; m < kMaxM; ++m) {
            if (m < M) {
              float xf[8];
              load_chunk(xs + static_cast<int64_t>(m) * chunks * 8, chunks, c, xf);
#pragma unroll
              for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][m] = fmaf(wf[r][e], xf[e], acc[r][m]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int n = task * kRows + r;
      const float b = (bias != nullptr && n < N) ? to_float<kIsBF16>(bias[n]) : 0.f;
#pragma unroll
      for (int m = 0; m < kMaxM; ++m) {
        if (m < M) {
          const float sum = warp_sum(acc[r][m]);
          if (lane == 0 && n < N) y[static_cast<int64_t>(m) * N + n] = from_float<kIsBF16>(sum + b);
        }
      }
    }
  }
}

}  // namespace tileattn
