// GEMM, the optimization ladder: C = A B, one idea per rung, from a float loop to a warp-specialized
// TMA + wgmma kernel. `python -m labs.gemm` validates every rung, then times it beside cuBLAS.
//
// Layouts (row-major throughout):
//   fp32 rungs 1-7:         A [M, K], B [K, N], C [M, N] fp32            (torch: A @ B, TF32 off)
//   tensor-core rungs 8-10: A [M, K], Bt [N, K], C [M, N] bf16 or fp16  (torch: A @ Bt.T; both
//                           operands K-major, the layout the tensor cores and TMA want, and the one
//                           nn.Linear uses); accumulation in fp32, C rounded once at the end.
// Indices are 32-bit: the Python side requires M*K, K*N, M*N < 2^31.
//
// Rungs (kernel name<template arguments>: idea; what to look for in SASS)
//   1 sgemm_naive                  one thread per C element, threadIdx.x walks rows: each warp's
//                                  A loads are 32 different rows (uncoalesced), C stores likewise.
//   2 sgemm_coalesced              threadIdx.x walks columns: B loads and C stores coalesce, A is
//                                  a broadcast. Same FLOPs, ~ the bytes/request of rung 1 / 8.
//   3 sgemm_smem<32>               32x32 tiles of A and B staged in shared memory: each global
//                                  element is loaded once per tile instead of once per thread (LDS).
//   4 sgemm_1d<64,64,8,8>          each thread computes 8 outputs of a column: one B value from
//                                  shared memory feeds 8 FFMAs (1D register tiling).
//   5 sgemm_2d<64,64,8,8,8>        64x64 block tile, 8x8 outputs per thread in registers: 16 LDS
//                                  per 64 FFMA (2D register tiling). Partial tiles load zeros.
//   6 sgemm_vec<kVec>              rung 5 + A stored transposed in shared memory so both operand
//                                  fragments are LDS.128, and 16-byte global loads (LDG.E.128)
//                                  when kVec (N % 4 == 0, K % 4 == 0, 16-byte aligned pointers).
//   7 sgemm_warptile<kVec,kPre>    128x128x16 block, 8 warps of 64x32, each lane 2x2 sub-tiles of
//                                  4x4: a warp's LDS.128 hit 8 distinct float4 (conflict-free,
//                                  broadcast), 2 blocks/SM. kPre: the next tile's global loads are
//                                  issued into registers before the current tile's FFMAs.
//   8 hgemm_mma<kBF16,kAligned>    tensor cores: mma.sync m16n8k16 (HMMA) fed by ldmatrix from
//                                  padded shared memory (row stride 80 B: conflict-free); loads
//                                  staged through registers, one buffer (load, sync, math, sync).
//   9 hgemm_cp_async<kBF16,kStages,kAligned>
//                                  rung 8 + cp.async (LDGSTS) into a kStages-deep shared-memory
//                                  ring: copies of tiles t+1..t+S-1 overlap the math of tile t.
//                                  Timeline below. kStages = 1 is the synchronous baseline.
//  10 hgemm_tma_wgmma<kBF16,BN,kStages>   (sm_90a only)
//                                  Hopper: one producer warpgroup issues TMA box copies
//                                  (UTMALDG) of 128x64 A and BNx64 Bt tiles into a kStages ring
//                                  with the 128-byte swizzle, completing on mbarriers; two
//                                  consumer warpgroups run wgmma m64nBNk16 (HGMMA) straight from
//                                  shared memory, keep one wgmma group in flight, and release
//                                  each slot on an "empty" mbarrier once its group completed.
//                                  setmaxnreg moves registers from the producer (40) to the
//                                  consumers (232); tiles are visited in groups of 8 M-tiles so
//                                  concurrent blocks share B panels in L2.
//                                  Shapes: TMA needs 16-byte row strides, so K % 8 == 0 and both
//                                  operand bases 16-byte aligned; any M, N >= 1 (out-of-bounds
//                                  boxes are zero-filled). Other K: the host pads K (labs.gemm).
//   Deliberately bad (kept for the lesson, not for use):
//     sgemm_2d<128,128,8,16,16>    "bigger per-thread tile = more reuse": 256 accumulators per
//                                  thread exceed the 255-register limit, so ptxas spills them to
//                                  local memory (STL/LDL in the inner loop) and the rung loses.
//
// Rung 9's timeline (S = kStages, T = ceil(K / 32) tiles, buffer of tile t = t % S):
//   prologue:     issue tiles 0 .. S-2 (each its own cp.async group; groups for tiles >= T are
//                 empty but still committed, so the group arithmetic below holds for any T)
//   iteration t:  wait_group(S-2)    -> this thread's copies of tile t have landed
//                 __syncthreads()    -> everyone's copies of tile t landed (cp.async completion is
//                                       per thread: the barrier alone would not wait for them,
//                                       the wait alone would not cover other threads' copies),
//                                       AND everyone finished computing tile t-1
//                 issue tile t+S-1 into buffer (t-1) % S: freed by that same barrier
//                 compute tile t     (ldmatrix + mma.sync on buffer t % S)
//   S = 1:        issue tile t, wait_group(0), barrier, compute, barrier (the second barrier keeps
//                 the next iteration's copy from overwriting a buffer still being read).
//   Committed groups before iteration t's wait: (S-1) + t; waiting until S-2 remain pending means
//   groups 0..t are complete. K not a multiple of 32: the last tile's missing columns are
//   zero-filled by cp.async (src-size 0), contributing nothing to the sums.
#include <cuda/std/cstdint>

#include "common/sm80.cuh"
#include "common/sm90.cuh"

// Each family instantiates only its own rungs; the other rungs' namespace constants then look unused.
#pragma nv_diag_suppress 177

using tileattn::u16;
using tileattn::u32;

// =====================================================================================
// Rungs 1-7: fp32 (FFMA). C = A B with A [M, K], B [K, N] row-major.
// =====================================================================================

// ---- 1: naive ---------------------------------------------------------------------------------
// block (32, 32); grid (ceil(M/32), ceil(N/32)).
__global__ void sgemm_naive(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                            int M, int N, int K) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;  // lanes of a warp: 32 different rows
  const int col = blockIdx.y * blockDim.y + threadIdx.y;
  if (row < M && col < N) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += A[row * K + k] * B[k * N + col];
    C[row * N + col] = acc;
  }
}

// ---- 2: coalesced -----------------------------------------------------------------------------
// block (32, 32); grid (ceil(N/32), ceil(M/32)).
__global__ void sgemm_coalesced(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                                int M, int N, int K) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;  // lanes: 32 consecutive columns
  const int row = blockIdx.y * blockDim.y + threadIdx.y;
  if (row < M && col < N) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += A[row * K + k] * B[k * N + col];  // A: one address per warp
    C[row * N + col] = acc;
  }
}

// ---- 3: shared-memory tiling --------------------------------------------------------------------
// block (BS, BS); grid (ceil(N/BS), ceil(M/BS)). Out-of-range elements load as 0.
template <int BS>
__global__ void __launch_bounds__(BS* BS) sgemm_smem(const float* __restrict__ A, const float* __restrict__ B,
                                                     float* __restrict__ C, int M, int N, int K) {
  __shared__ float As[BS][BS];  // [row][k]
  __shared__ float Bs[BS][BS];  // [k][col]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int row = blockIdx.y * BS + ty, col = blockIdx.x * BS + tx;
  float acc = 0.f;
  for (int k0 = 0; k0 < K; k0 += BS) {
    As[ty][tx] = (row < M && k0 + tx < K) ? A[row * K + k0 + tx] : 0.f;
    Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(k0 + ty) * N + col] : 0.f;
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BS; ++kk) acc += As[ty][kk] * Bs[kk][tx];
    __syncthreads();
  }
  if (row < M && col < N) C[row * N + col] = acc;
}

// Guarded tile loads shared by rungs 4-5: tile[r * cols + c] = src[(r0 + r) * ld + c0 + c] or 0.
template <int ROWS, int COLS, int NT>
__device__ __forceinline__ void load_tile_guarded(float* tile, const float* __restrict__ src, int ld, int r0,
                                                  int c0, int rmax, int cmax) {
#pragma unroll
  for (int i = threadIdx.x; i < ROWS * COLS; i += NT) {
    const int r = i / COLS, c = i % COLS;
    tile[i] = (r0 + r < rmax && c0 + c < cmax) ? src[(r0 + r) * ld + c0 + c] : 0.f;
  }
}

// ---- 4: 1D register tiling ----------------------------------------------------------------------
// block BM*BN/TM threads (1-D); grid (ceil(N/BN), ceil(M/BM)).
template <int BM, int BN, int BK, int TM>
__global__ void __launch_bounds__(BM* BN / TM) sgemm_1d(const float* __restrict__ A, const float* __restrict__ B,
                                                        float* __restrict__ C, int M, int N, int K) {
  constexpr int NT = BM * BN / TM;
  __shared__ float As[BM * BK];  // [BM][BK]
  __shared__ float Bs[BK * BN];  // [BK][BN]
  const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;
  const int tcol = threadIdx.x % BN, trow = threadIdx.x / BN;  // thread owns rows trow*TM .. +TM-1
  float acc[TM] = {};
  for (int k0 = 0; k0 < K; k0 += BK) {
    load_tile_guarded<BM, BK, NT>(As, A, K, bm, k0, M, K);
    load_tile_guarded<BK, BN, NT>(Bs, B, N, k0, bn, K, N);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      const float b = Bs[kk * BN + tcol];  // one LDS feeds TM FFMAs
#pragma unroll
      for (int i = 0; i < TM; ++i) acc[i] += As[(trow * TM + i) * BK + kk] * b;
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int r = bm + trow * TM + i, c = bn + tcol;
    if (r < M && c < N) C[r * N + c] = acc[i];
  }
}

// ---- 5: 2D register tiling ----------------------------------------------------------------------
// block (BM/TM)*(BN/TN) threads; grid (ceil(N/BN), ceil(M/BM)). 64x64x8 with 8x8: 64 threads,
// 64 accumulators + 16 fragment registers per thread, 4 KB of shared memory per block.
template <int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__((BM / TM) * (BN / TN)) sgemm_2d(const float* __restrict__ A,
                                                                  const float* __restrict__ B,
                                                                  float* __restrict__ C, int M, int N, int K) {
  constexpr int NT = (BM / TM) * (BN / TN);
  __shared__ float As[BM * BK];  // [BM][BK]
  __shared__ float Bs[BK * BN];  // [BK][BN]
  const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;
  const int trow = threadIdx.x / (BN / TN), tcol = threadIdx.x % (BN / TN);
  float acc[TM][TN] = {};
  float a[TM], b[TN];
  for (int k0 = 0; k0 < K; k0 += BK) {
    load_tile_guarded<BM, BK, NT>(As, A, K, bm, k0, M, K);
    load_tile_guarded<BK, BN, NT>(Bs, B, N, k0, bn, K, N);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
#pragma unroll
      for (int i = 0; i < TM; ++i) a[i] = As[(trow * TM + i) * BK + kk];
#pragma unroll
      for (int j = 0; j < TN; ++j) b[j] = Bs[kk * BN + tcol * TN + j];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];  // TM*TN FFMA per TM+TN LDS
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int r = bm + trow * TM + i, c = bn + tcol * TN + j;
      if (r < M && c < N) C[r * N + c] = acc[i][j];
    }
}

// One float4 of a row-major matrix at (r, c): a 16-byte load when kVec (caller guarantees
// cols % 4 == 0 and c % 4 == 0, so the four are all in range or all out), else 4 guarded loads.
template <bool kVec>
__device__ __forceinline__ float4 load4(const float* __restrict__ src, int ld, int r, int c, int rows, int cols) {
  if constexpr (kVec) {
    return (r < rows && c < cols) ? *reinterpret_cast<const float4*>(src + r * ld + c)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
  } else {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = (r < rows && c + i < cols) ? src[r * ld + c + i] : 0.f;
    return make_float4(v[0], v[1], v[2], v[3]);
  }
}

// ---- 6: vectorized loads ------------------------------------------------------------------------
// 64x64x8 block, 8x8 per thread (64 threads) as rung 5; A stored transposed (AsT [BK][BM]) so a
// thread's 8 A values are 2 LDS.128 like its 8 B values; global loads are float4.
template <bool kVec>
__global__ void __launch_bounds__(64) sgemm_vec(const float* __restrict__ A, const float* __restrict__ B,
                                                float* __restrict__ C, int M, int N, int K) {
  constexpr int BM = 64, BN = 64, BK = 8, TM = 8, TN = 8, NT = 64;
  __shared__ __align__(16) float AsT[BK * BM];  // [BK][BM]
  __shared__ __align__(16) float Bs[BK * BN];   // [BK][BN]
  const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;
  const int trow = threadIdx.x / (BN / TN), tcol = threadIdx.x % (BN / TN);
  float acc[TM][TN] = {};
  for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
    for (int p = 0; p < BM * BK / 4 / NT; ++p) {  // A tile: 64 rows x 2 float4, 2 per thread
      const int i = threadIdx.x + p * NT, r = i / (BK / 4), c = (i % (BK / 4)) * 4;
      const float4 v = load4<kVec>(A, K, bm + r, k0 + c, M, K);
      AsT[(c + 0) * BM + r] = v.x;
      AsT[(c + 1) * BM + r] = v.y;
      AsT[(c + 2) * BM + r] = v.z;
      AsT[(c + 3) * BM + r] = v.w;
    }
#pragma unroll
    for (int p = 0; p < BK * BN / 4 / NT; ++p) {  // B tile: 8 rows x 16 float4, 2 per thread
      const int i = threadIdx.x + p * NT, r = i / (BN / 4), c = (i % (BN / 4)) * 4;
      *reinterpret_cast<float4*>(&Bs[r * BN + c]) = load4<kVec>(B, N, k0 + r, bn + c, K, N);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float a[TM], b[TN];
      *reinterpret_cast<float4*>(&a[0]) = *reinterpret_cast<const float4*>(&AsT[kk * BM + trow * TM]);
      *reinterpret_cast<float4*>(&a[4]) = *reinterpret_cast<const float4*>(&AsT[kk * BM + trow * TM + 4]);
      *reinterpret_cast<float4*>(&b[0]) = *reinterpret_cast<const float4*>(&Bs[kk * BN + tcol * TN]);
      *reinterpret_cast<float4*>(&b[4]) = *reinterpret_cast<const float4*>(&Bs[kk * BN + tcol * TN + 4]);
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int r = bm + trow * TM + i;
    if (r >= M) continue;
#pragma unroll
    for (int j = 0; j < TN; j += 4) {
      const int c = bn + tcol * TN + j;
      if constexpr (kVec) {
        if (c < N)
          *reinterpret_cast<float4*>(&C[r * N + c]) = make_float4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]);
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (c + q < N) C[r * N + c + q] = acc[i][j + q];
      }
    }
  }
}

// ---- 7: warp tiling -----------------------------------------------------------------------------
// 128x128x16 block tile, 256 threads = 8 warps as 2 (M) x 4 (N), warp tile 64x32. Lane (ly, lx) =
// (lane / 4, lane % 4) owns the 4x4 sub-tiles at rows wm*64 + i*32 + ly*4 and columns
// wn*32 + j*16 + lx*4 for i, j in {0, 1}: 64 accumulators. Per k: 2 LDS.128 of A (8 distinct
// float4 per warp = 128 contiguous bytes: one wavefront) and 2 of B (4 distinct, broadcast) feed
// 64 FFMA. 2 blocks/SM (launch bound: <= 128 registers) give 16 warps to hide latency.
// AsT rows are padded by 4 floats: the transposing stores would otherwise hit one bank 4 times.
template <bool kVec, bool kPrefetch>
__global__ void __launch_bounds__(256, 2) sgemm_warptile(const float* __restrict__ A, const float* __restrict__ B,
                                                         float* __restrict__ C, int M, int N, int K) {
  constexpr int BM = 128, BN = 128, BK = 16, NT = 256, PAD = 4;
  __shared__ __align__(16) float AsT[BK][BM + PAD];  // [k][m]
  __shared__ __align__(16) float Bs[BK][BN];         // [k][n]
  const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / 4, wn = warp % 4, ly = lane / 4, lx = lane % 4;

  // Each thread moves 2 float4 of A (row idx/4, k chunk idx%4) and 2 of B (row idx/32, col chunk
  // idx%32), idx = threadIdx.x + 256 p; the A rows of p = 1 are 64 below those of p = 0 and the B
  // rows 8 below, so the row/column guards and base offsets are computed once.
  float4 ra[2], rb[2];
  const int a_row = bm + threadIdx.x / 4, a_col = (threadIdx.x % 4) * 4;
  const int b_row = threadIdx.x / 32, b_col = bn + (threadIdx.x % 32) * 4;
  auto load_global = [&](int k0) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      ra[p] = load4<kVec>(A, K, a_row + 64 * p, k0 + a_col, M, K);
      rb[p] = load4<kVec>(B, N, k0 + b_row + 8 * p, b_col, K, N);
    }
  };
  auto store_shared = [&]() {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int ia = threadIdx.x + p * NT, r = ia / 4, c = (ia % 4) * 4;
      AsT[c + 0][r] = ra[p].x;
      AsT[c + 1][r] = ra[p].y;
      AsT[c + 2][r] = ra[p].z;
      AsT[c + 3][r] = ra[p].w;
      const int ib = threadIdx.x + p * NT;
      *reinterpret_cast<float4*>(&Bs[ib / 32][(ib % 32) * 4]) = rb[p];
    }
  };

  float acc[2][2][4][4] = {};  // [i sub-tile][j sub-tile][row][col]
  const int tiles = (K + BK - 1) / BK;
  load_global(0);
  store_shared();
  __syncthreads();
  for (int t = 0; t < tiles; ++t) {
    if (kPrefetch && t + 1 < tiles) load_global((t + 1) * BK);  // in flight during the FFMAs below
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float a[2][4], b[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        *reinterpret_cast<float4*>(a[i]) = *reinterpret_cast<const float4*>(&AsT[kk][wm * 64 + i * 32 + ly * 4]);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        *reinterpret_cast<float4*>(b[j]) = *reinterpret_cast<const float4*>(&Bs[kk][wn * 32 + j * 16 + lx * 4]);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][r][c] += a[i][r] * b[j][c];
    }
    __syncthreads();  // everyone is done reading this tile
    if (t + 1 < tiles) {
      if (!kPrefetch) load_global((t + 1) * BK);
      store_shared();
      __syncthreads();
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = bm + wm * 64 + i * 32 + ly * 4 + r;
      if (row >= M) continue;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = bn + wn * 32 + j * 16 + lx * 4;
        if constexpr (kVec) {
          if (col < N)
            *reinterpret_cast<float4*>(&C[row * N + col]) =
                make_float4(acc[i][j][r][0], acc[i][j][r][1], acc[i][j][r][2], acc[i][j][r][3]);
        } else {
#pragma unroll
          for (int c = 0; c < 4; ++c)
            if (col + c < N) C[row * N + col + c] = acc[i][j][r][c];
        }
      }
    }
}

// =====================================================================================
// Rungs 8-9: tensor cores with mma.sync (sm_80+). C = A Bt^T, A [M, K], Bt [N, K], 16-bit.
// Block tile 128x128x32, 256 threads = 8 warps as 2 (M) x 4 (N), warp tile 64x32 = 4 x 4 mma
// tiles of m16n8 (64 fp32 accumulators per thread). Shared tiles [128][32 + 8]: 80-byte rows put
// the 8 row addresses of each ldmatrix phase in 8 different bank groups.
// =====================================================================================
namespace tc {
constexpr int BM = 128, BN = 128, BK = 32, LDS = BK + 8, THREADS = 256;
constexpr int kTileElems = (BM + BN) * LDS;  // one stage: A tile then Bt tile (20480 bytes)

// Copy a [128][32] tile of a row-major [rows, K] 16-bit matrix (rows r0.., columns k0..) into
// shared [128][LDS]. 512 chunks of 16 bytes, 2 per thread. kAligned (K % 8 == 0, 16-byte aligned
// base): a chunk is all in range or all out; kAsync: cp.async (zero-fill when out), else through
// registers. Not kAligned: 8 guarded 2-byte loads per chunk (synchronous; correct for any K).
template <bool kAligned, bool kAsync>
__device__ __forceinline__ void load_tile(u16* smem, const u16* __restrict__ g, int r0, int k0, int rows, int K) {
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const int idx = threadIdx.x + p * THREADS, r = idx / 4, c = (idx % 4) * 8;
    u16* dst = smem + r * LDS + c;
    const int gr = r0 + r, gc = k0 + c;
    if constexpr (kAligned) {
      const bool ok = gr < rows && gc < K;
      const u16* src = ok ? g + static_cast<size_t>(gr) * K + gc : g;  // clamp: never form an OOB address
      if constexpr (kAsync) {
        tileattn::cp_async_16(dst, src, ok);
      } else {
        uint4 v = ok ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(dst) = v;
      }
    } else {
      u32 w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const u16 lo = (gr < rows && gc + 2 * q < K) ? g[static_cast<size_t>(gr) * K + gc + 2 * q] : u16(0);
        const u16 hi = (gr < rows && gc + 2 * q + 1 < K) ? g[static_cast<size_t>(gr) * K + gc + 2 * q + 1] : u16(0);
        w[q] = static_cast<u32>(lo) | (static_cast<u32>(hi) << 16);
      }
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// acc += sA[warp rows] * sB[warp cols]^T over the 32-wide K tile: 2 k16 steps x (4 ldmatrix.x4 for
// A + 2 for B + 16 mma).
template <bool kIsBF16>
__device__ __forceinline__ void compute_tile(const u16* sA, const u16* sB, float (&acc)[4][4][4], int wm, int wn,
                                             int lane) {
#pragma unroll
  for (int kk = 0; kk < BK; kk += 16) {
    u32 a[4][4], b[4][2];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {  // lanes 0-15: rows 0-15 at k, lanes 16-31: rows 0-15 at k+8
      const u16* p = sA + (wm * 64 + mi * 16 + (lane % 16)) * LDS + kk + (lane / 16) * 8;
      tileattn::ldmatrix_x4(a[mi], p);
    }
#pragma unroll
    for (int nj = 0; nj < 2; ++nj) {  // lanes: n rows (lane/16)*8 + lane%8, k offset ((lane/8)%2)*8
      const u16* p = sB + (wn * 32 + nj * 16 + (lane / 16) * 8 + (lane % 8)) * LDS + kk + ((lane / 8) % 2) * 8;
      u32 r[4];
      tileattn::ldmatrix_x4(r, p);
      b[2 * nj][0] = r[0];
      b[2 * nj][1] = r[1];
      b[2 * nj + 1][0] = r[2];
      b[2 * nj + 1][1] = r[3];
    }
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) tileattn::mma_16816<kIsBF16>(acc[mi][ni], a[mi], b[ni]);
  }
}

// Round the fp32 accumulators to 16 bits and store the warp's 64x32 piece of C [M, N]. Pairs of
// columns go out as one 32-bit store when N is even (then every pair is 4-byte aligned).
template <bool kIsBF16>
__device__ __forceinline__ void store_tile(u16* __restrict__ C, const float (&acc)[4][4][4], int row0, int col0,
                                           int M, int N, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row0 + mi * 16 + g + h * 8, c = col0 + ni * 8 + 2 * t;
        if (r >= M) continue;
        const float x = acc[mi][ni][2 * h], y = acc[mi][ni][2 * h + 1];
        u16* dst = C + static_cast<size_t>(r) * N + c;
        if ((N % 2 == 0) && c + 1 < N) {
          *reinterpret_cast<u32*>(dst) = tileattn::pack2<kIsBF16>(x, y);
        } else {
          if (c < N) dst[0] = tileattn::from_float<kIsBF16>(x);
          if (c + 1 < N) dst[1] = tileattn::from_float<kIsBF16>(y);
        }
      }
}
}  // namespace tc

// ---- 8: mma.sync, loads through registers ---------------------------------------------------------
// grid (ceil(N/128), ceil(M/128)), 256 threads, 20 KB static shared memory.
template <bool kIsBF16, bool kAligned>
__global__ void __launch_bounds__(tc::THREADS) hgemm_mma(const u16* __restrict__ A, const u16* __restrict__ Bt,
                                                        u16* __restrict__ C, int M, int N, int K) {
  __shared__ __align__(16) u16 smem[tc::kTileElems];
  u16* sA = smem;
  u16* sB = smem + tc::BM * tc::LDS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wm = warp / 4, wn = warp % 4;
  const int bm = blockIdx.y * tc::BM, bn = blockIdx.x * tc::BN;
  float acc[4][4][4] = {};
  for (int k0 = 0; k0 < K; k0 += tc::BK) {
    tc::load_tile<kAligned, false>(sA, A, bm, k0, M, K);
    tc::load_tile<kAligned, false>(sB, Bt, bn, k0, N, K);
    __syncthreads();
    tc::compute_tile<kIsBF16>(sA, sB, acc, wm, wn, lane);
    __syncthreads();
  }
  tc::store_tile<kIsBF16>(C, acc, bm + wm * 64, bn + wn * 32, M, N, lane);
}

// ---- 9: cp.async multi-stage pipeline -------------------------------------------------------------
// grid (ceil(N/128), ceil(M/128)), 256 threads, dynamic shared memory kStages x 20 KB.
// Timeline in the file header. Not kAligned: loads are synchronous (no 16-byte source alignment),
// the same loop stays correct because plain shared stores are ordered by the barriers.
template <bool kIsBF16, int kStages, bool kAligned>
__global__ void __launch_bounds__(tc::THREADS) hgemm_cp_async(const u16* __restrict__ A,
                                                             const u16* __restrict__ Bt, u16* __restrict__ C,
                                                             int M, int N, int K) {
  static_assert(kStages >= 1, "at least one stage");
  extern __shared__ __align__(16) u16 ring[];  // [kStages][A 128 x LDS | Bt 128 x LDS]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wm = warp / 4, wn = warp % 4;
  const int bm = blockIdx.y * tc::BM, bn = blockIdx.x * tc::BN;
  const int tiles = (K + tc::BK - 1) / tc::BK;
  auto issue = [&](int t) {  // tile t into its buffer; always commits a group (maybe empty)
    if (t < tiles) {
      u16* buf = ring + (t % kStages) * tc::kTileElems;
      tc::load_tile<kAligned, true>(buf, A, bm, t * tc::BK, M, K);
      tc::load_tile<kAligned, true>(buf + tc::BM * tc::LDS, Bt, bn, t * tc::BK, N, K);
    }
    tileattn::cp_async_commit();
  };
  float acc[4][4][4] = {};
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) issue(t);  // prologue
  for (int t = 0; t < tiles; ++t) {
    if constexpr (kStages == 1) {
      issue(t);
      tileattn::cp_async_wait<0>();
    } else {
      tileattn::cp_async_wait<kStages - 2>();  // my copies of tile t landed
    }
    __syncthreads();  // everyone's copies landed; everyone finished tile t-1
    if constexpr (kStages > 1) issue(t + kStages - 1);  // into buffer (t-1) % kStages
    const u16* buf = ring + (t % kStages) * tc::kTileElems;
    tc::compute_tile<kIsBF16>(buf, buf + tc::BM * tc::LDS, acc, wm, wn, lane);
    if constexpr (kStages == 1) __syncthreads();  // before the next copy overwrites the only buffer
  }
  tileattn::cp_async_wait<0>();  // no copy may still target shared memory when the block exits
  tc::store_tile<kIsBF16>(C, acc, bm + wm * 64, bn + wn * 32, M, N, lane);
}

// Everything below uses sm_90 instructions; the sm_80 build of this file (rungs 1-9) skips it.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// =====================================================================================
// Rung 10: Hopper (sm_90a). TMA -> shared-memory ring (mbarriers) -> wgmma; warp-specialized.
// =====================================================================================
namespace h100 {
namespace s9 = tileattn::sm90;
constexpr int BM = 128, BK = 64;  // BK * 2 bytes = 128: one 128-byte swizzle row per tile row
constexpr int kConsumers = 2;     // consumer warpgroups; each owns 64 rows of the 128-row tile
constexpr int kThreads = 128 * (1 + kConsumers);

__host__ __device__ constexpr int smem_bytes(int bn, int stages) { return stages * (BM + bn) * BK * 2 + 1024; }
}  // namespace h100

// tmap_a: A [M, K] box {64, 128}; tmap_b: Bt [N, K] box {64, BN}; both 128B-swizzled, 16-bit.
// grid ceil(M/128) * ceil(N/BN) (1-D), 384 threads, dynamic shared memory smem_bytes(BN, kStages).
template <bool kIsBF16, int BN, int kStages>
__global__ void __launch_bounds__(h100::kThreads, 1)
    hgemm_tma_wgmma(const __grid_constant__ tileattn::sm90::TmaDescriptor tmap_a,
                    const __grid_constant__ tileattn::sm90::TmaDescriptor tmap_b, u16* __restrict__ C, int M, int N,
                    int K) {
  namespace s9 = tileattn::sm90;
  using namespace h100;
  static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma N");
  constexpr u32 kStageBytes = (BM + BN) * BK * 2;  // what TMA delivers per stage (full boxes)
  extern __shared__ uint8_t smem_raw[];
  __shared__ uint64_t full[kStages], empty[kStages];
  // 128B-swizzled tiles must start 1024-byte aligned: round the dynamic base up (1 KB of slack).
  const u32 base = s9::smem_u32(smem_raw);
  uint8_t* smem = smem_raw + ((1024 - (base & 1023)) & 1023);
  u16* sA = reinterpret_cast<u16*>(smem);  // [kStages][128][64]
  u16* sB = sA + kStages * BM * BK;         // [kStages][BN][64]

  // Grouped tile order: consecutive blocks walk down 8 M-tiles before moving right in N, so the
  // ~132 resident blocks touch ~8 A panels and ~17 B panels instead of 1 and all of B.
  constexpr int kGroupM = 8;
  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const int per_group = kGroupM * tiles_n;
  const int group = blockIdx.x / per_group, first_m = group * kGroupM;
  const int group_rows = min(tiles_m - first_m, kGroupM);
  const int in_group = blockIdx.x % per_group;
  const int bm = first_m + in_group % group_rows, bn = in_group / group_rows;
  const int ktiles = (K + BK - 1) / BK;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    s9::tma_prefetch_descriptor(&tmap_a);
    s9::tma_prefetch_descriptor(&tmap_b);
    for (int s = 0; s < kStages; ++s) {
      s9::mbar_init(&full[s], 1);            // the producer's arrive.expect_tx (+ TMA bytes)
      s9::mbar_init(&empty[s], kConsumers);  // one arrival per consumer warpgroup
    }
    s9::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {  // ---------------- producer warpgroup: one thread drives the copy engine
    s9::setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      for (int t = 0; t < ktiles; ++t) {
        const int s = t % kStages;
        if (t >= kStages) s9::mbar_wait(&empty[s], ((t / kStages) - 1) & 1);  // slot released
        s9::mbar_arrive_expect_tx(&full[s], kStageBytes);
        s9::tma_load_2d(sA + s * BM * BK, &tmap_a, t * BK, bm * BM, &full[s]);
        s9::tma_load_2d(sB + s * BN * BK, &tmap_b, t * BK, bn * BN, &full[s]);
      }
    }
  } else {  // ------------------------ consumer warpgroups: 64 rows x BN columns each
    s9::setmaxnreg_inc<232>();
    const int c = wg - 1;
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    // One wgmma group stays in flight: after issuing step t, wait until step t-1's group is done
    // (wgmma_wait<1>) and only then release step t-1's slot. The tensor cores always have the next
    // group queued, and the producer refills slot t-1 while step t runs.
    for (int t = 0; t < ktiles; ++t) {
      const int s = t % kStages;
      s9::mbar_wait(&full[s], (t / kStages) & 1);  // A and Bt tiles of step t have landed
      const uint64_t da = s9::make_desc_k128_sw128(sA + s * BM * BK + c * 64 * BK);
      const uint64_t db = s9::make_desc_k128_sw128(sB + s * BN * BK);
      s9::fence_accumulators(d);
      s9::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) s9::wgmma_ss<BN, kIsBF16>(d, da + 2 * kk, db + 2 * kk, 1);
      s9::wgmma_commit();
      s9::wgmma_wait<1>();  // step t-1's group has finished reading its slot
      s9::fence_accumulators(d);
      if (t > 0 && threadIdx.x % 128 == 0) s9::mbar_arrive(&empty[(t - 1) % kStages]);
    }
    s9::wgmma_wait<0>();  // the last group; its slot is never refilled, so no release is needed
    s9::fence_accumulators(d);
    // Epilogue: accumulator layout in sm90.cuh; rows 16w + g (+8), columns 8j + 2t (+1).
    const int w = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int row0 = bm * BM + c * 64 + w * 16 + g, col0 = bn * BN + 2 * tq;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row0 + h * 8, col = col0 + 8 * j;
        if (r >= M) continue;
        const float x = d[4 * j + 2 * h], y = d[4 * j + 2 * h + 1];
        u16* dst = C + static_cast<size_t>(r) * N + col;
        if ((N % 2 == 0) && col + 1 < N) {
          *reinterpret_cast<u32*>(dst) = tileattn::pack2<kIsBF16>(x, y);
        } else {
          if (col < N) dst[0] = tileattn::from_float<kIsBF16>(x);
          if (col + 1 < N) dst[1] = tileattn::from_float<kIsBF16>(y);
        }
      }
  }
}

// ---- self-test probe for the TMA path (no wgmma): copy one 64 x 8 box of a 16-bit [rows, cols]
// tensor at (c0, c1) into shared memory through TMA + mbarrier, then write the 1024 bytes of shared
// memory out linearly. With the 128B swizzle the host expects 16-byte chunk q of row r at chunk
// q ^ (r % 8); out-of-bounds elements must read 0. One block of 128 threads.
__global__ void tma_probe(const __grid_constant__ tileattn::sm90::TmaDescriptor tmap, u16* __restrict__ out, int c0,
                          int c1) {
  namespace s9 = tileattn::sm90;
  __shared__ __align__(1024) u16 tile[8 * 64];
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    s9::mbar_init(&bar, 1);
    s9::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    s9::mbar_arrive_expect_tx(&bar, sizeof(tile));
    s9::tma_load_2d(tile, &tmap, c0, c1, &bar);
  }
  s9::mbar_wait(&bar, 0);
  for (int i = threadIdx.x; i < 8 * 64; i += blockDim.x) out[i] = tile[i];
}
#endif  // __CUDA_ARCH__ >= 900
