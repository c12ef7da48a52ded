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
// - One block of 16 warps per SM (grid = min(SMs, tasks)). A task is kRows consecutive output rows
//   over the whole K; block b owns tasks [b T / G, (b + 1) T / G), its warps take them in turn, so
//   blocks differ by at most one task (N = 4096, M = 1: 31 or 32 rows per SM).
// - At M <= 2 the block is built to fit twice per SM (<= 64 registers, __launch_bounds__(512, 2);
//   shared memory 2 x M x K x 4 B <= 228 KB at K <= 14336): under PDL the NEXT GEMV's block is
//   resident beside this one's while it still streams, and issues its own first weight reads.
// - Before griddepcontrol.wait (weights are never the previous kernel's output): each warp's first
//   step into registers (48-64 KB per SM) and the next prefetch_chunks chunks of its first row
//   into L2 (default 2 KB per warp, 32 KB per SM): 10-13 MB of the stream over 132 SMs lands during the
//   previous kernel's tail and this one's x staging. Warp 0 (the most tasks of its block) releases
//   the next kernel (griddepcontrol.launch_dependents, once per block) when it has release_chunks
//   chunks left to stream (default 8 KB per warp, ~128 KB per SM, 17 MB over the GPU, ~4 us at
//   4.4 TB/s): released at the start, the next kernel's L2 prefetch would be evicted by this
//   kernel's remaining stream (gate_up: 235 MB through a 50 MB L2) before it is used.
// - The prologue writes the M prepared input rows into shared memory once per block, as fp32 (the
//   16-bit values the unfused op would have stored, widened: the inner loop then converts only the
//   weights).
// - A warp streams its rows: lane l reads 16-byte chunks l, l + 32, ... of each row,
//   loads_per_step independent loads per lane per step (kRows x kUnroll): 16 warps x 32 lanes x 8
//   x 16 B = 64 KB in flight per SM (48 KB with 6 loads: M = 1 SiLU, M = 2), kept in flight by
//   reloading each chunk's registers with the next step's chunk as soon as its FMAs are issued.
// - fp32 FMAs, a warp shuffle sum per (row, m), lane 0 stores y rounded once (bias added in fp32).
// - kRows (rows per warp): 1 at M <= 2 (shared-memory bytes per weight byte = 2 M: 2 or 4), 4 in
//   the M = 8 bucket (each x chunk read once for 4 rows: 4), against the ~128 B/clk of shared
//   memory and ~16.5 B/clk of HBM per SM. Above M = 2 the kernel is slower than cuBLAS (issue-bound)
//   and the dispatcher does not choose it (kernels/dispatch.py GEMV_TABLE_MAX_ROWS).
//
// Numerics: the prologues are add_rms_norm's and silu_mul's step for step (common/elementwise.cuh's
// helpers), including the order of add_rms_norm's sum of squares (its 1024-thread layout replayed), so the
// input rows are the 16-bit values the unfused ops produce. y's fp32 sum is in this kernel's order.
#include "common/elementwise.cuh"

namespace tileattn {

namespace gemv_detail {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRowsM = 8;

enum Prologue : int { kNone = 0, kSiluMul = 1, kAddRmsNorm = 2 };

// Output rows per warp task by M bucket. At M <= 2 one row: each 2-byte weight element meets M fp32
// x elements from shared memory, 2 M shared-memory bytes per weight byte (2 or 4: 33-66 B/clk of the
// ~128 B/clk shared memory delivers, at the ~16.5 B/clk per SM of HBM), and the registers stay
// within the 64 that two co-resident blocks allow. The M = 8 bucket (forced-on tests only: slower than
// cuBLAS above M = 2) reads each x chunk once for 4 rows.
__host__ __device__ constexpr int rows_per_task(int max_m) { return max_m <= 2 ? 1 : 4; }
// Blocks of 512 threads that must fit per SM: 2 at M <= 2 (<= 64 registers), so that under PDL the
// next GEMV's block is resident beside this one's and issues its first loads before this one ends.
__host__ __device__ constexpr int min_blocks(int max_m) { return max_m <= 2 ? 2 : 1; }
// 16-byte weight loads in flight per lane per step: 8 (16 warps x 32 lanes x 8 x 16 B = 64 KB per
// SM, the first revision's, measured at 4.38 TB/s on the lm_head) where they fit in 64 registers
// with 0 spills: M = 1 without the SiLU prologue (qkv, o, gate_up, lm_head: 90% of the bytes).
// Otherwise 6 (48 KB, still 2x the ~23 KB that 4.4 TB/s x ~0.7 us / 132 SMs needs): at M = 1 the
// SiLU prologue's staging (gate and up, two chunks per iteration) is live beside the 32 registers
// of pre-wait loads and spills with 8, as do M = 2's SiLU and norm prologues; the M = 8 bucket
// (one block per SM, 128 registers) keeps 8.
__host__ __device__ constexpr int loads_per_step(int max_m, int prologue) {
  return max_m == 1 ? (prologue == kSiluMul ? 6 : 8) : (max_m <= 2 ? 6 : 8);
}

// Start streaming `bytes` (a multiple of 16) at p (16-byte aligned) into L2, no registers held:
// sm_90's bulk prefetch (one instruction, lane 0), else one prefetch per 128-byte line over the warp.
__device__ __forceinline__ void prefetch_l2(const uint4* p, int bytes, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (lane == 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes));
#else
  for (int off = lane * 128; off < bytes; off += 32 * 128)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(reinterpret_cast<const char*>(p) + off));
#endif
}


// A weight chunk: touched once per launch, so it is not allocated in L1 (no reuse to gain, and no
// line of anything else evicted for it), and read through the non-coherent path (the weights are
// read-only for the kernel's lifetime).
__device__ __forceinline__ uint4 load_weight(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
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
#pragma unroll 2
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
__global__ void __launch_bounds__(gemv_detail::kThreads, gemv_detail::min_blocks(kMaxM))
    gemv(u16* __restrict__ y, const uint4* __restrict__ x, const uint4* __restrict__ weight,
         const u16* __restrict__ bias, const uint4* __restrict__ residual, const uint4* __restrict__ norm_weight,
         uint4* __restrict__ new_residual, int M, int N, int chunks, int64_t x_st, int64_t res_st, float eps,
         int prefetch_chunks, int release_chunks) {
  using namespace layer_ops;
  using namespace gemv_detail;
  static_assert(kMaxM >= 1 && kMaxM <= kMaxRowsM, "M bucket");
  constexpr int kRows = rows_per_task(kMaxM);  // output rows per warp task
  constexpr int kUnroll = loads_per_step(kMaxM, kPrologue) / kRows;  // chunks per row per step
  constexpr int kStep = 32 * kUnroll;          // chunks of a row per warp step
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
        w[r][u] = c < chunks ? load_weight(p + c) : make_uint4(0, 0, 0, 0);
      }
    }
  };

  // Before the wait (weights are never the previous kernel's output): the first step's loads into
  // registers, and the next prefetch_chunks chunks of each first row into L2, so that under PDL
  // this launch's first 64 (or 48) + 32 KB per SM (defaults) stream during the previous kernel's tail.
  int task = task_begin + warp;
  if (task < task_end) {
    load_step(task, 0);
    const int pf_end = min(chunks, kStep + min(prefetch_chunks, chunks));  // no int overflow for any knob
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      if (pf_end > kStep) prefetch_l2(row_ptr(task, r) + kStep, (pf_end - kStep) * 16, lane);
  }
  // Chunks this warp streams in all (its tasks x K; int: a warp's share of the weights is far
  // below 2^31 chunks = 32 GB). Warp 0, which has the most tasks of its block (warps take them in
  // turn from the first), releases the block's share of the next kernel when it has at most
  // release_chunks left, i.e. when the block has ~16 x release_chunks x 16 B left to stream.
  int left = task < task_end ? ((task_end - 1 - task) / kWarps + 1) * chunks : 0;
  pdl_wait();
  if (warp == 0 && left <= release_chunks) pdl_release_dependents();
  if constexpr (kPrologue == kAddRmsNorm) {
    stage_add_rms_norm<kIsBF16>(xs, partial, x, residual, new_residual, norm_weight, M, chunks, x_st, res_st, eps);
  } else {
    stage_elementwise<kIsBF16, kPrologue>(xs, x, M, chunks, x_st);
  }
  __syncthreads();

  // A rolling prefetch: as soon as chunk u's FMAs are issued, its registers are reloaded with
  // chunk u of the warp's next step (the next K slice of this task, or the first slice of its next
  // task), so each lane keeps loads_per_step loads in flight through its whole stream with no extra
  // registers.
  for (; task < task_end; task += kWarps) {
    float acc[kRows][kMaxM];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int m = 0; m < kMaxM; ++m) acc[r][m] = 0.f;
    for (int base = 0; base < chunks; base += kStep) {
      const int step_chunks = min(kStep, chunks - base);
      left -= step_chunks;
      if (warp == 0 && left <= release_chunks && left + step_chunks > release_chunks) pdl_release_dependents();
      int next_task = task, next_base = base + kStep;
      if (next_base >= chunks) next_task += kWarps, next_base = 0;
      const bool prefetch = next_task < task_end;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = base + u * 32 + lane;
        if (c < chunks) {
          float wf[kRows][8];
#pragma unroll
          for (int r = 0; r < kRows; ++r) load8<kIsBF16>(w[r][u], wf[r]);
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
        // Chunk u's registers are free: reload them with chunk u of the next step.
        const int c_next = next_base + u * 32 + lane;
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (prefetch) w[r][u] = c_next < chunks ? load_weight(row_ptr(next_task, r) + c_next) : make_uint4(0, 0, 0, 0);
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
