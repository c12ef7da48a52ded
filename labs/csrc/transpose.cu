// Matrix transpose out = in^T, in: [rows, cols] row-major, out: [cols, rows] row-major. Pure data
// movement, so the only question is how the bytes move: coalescing on the global side, bank
// conflicts on the shared side. T = float (fp32) or unsigned short (bf16 moved as its raw 16 bits:
// a transpose never does arithmetic, so no bf16 header is needed).
//
//   python -m labs.transpose          validates every version (fp32 and bf16, square, rectangular
//                                     and edge-tile shapes), then times each beside torch
//                                     x.t().contiguous() and a device copy (same run).
//   python -m labs.transpose --ncu    also re-runs itself under Nsight Compute for sectors per
//                                     request and shared-memory bank conflicts per version.
//
// Versions (useful bandwidth = 2 * rows * cols * sizeof(T) / time):
//   1 transpose_naive<T>    block 32x8, each thread moves 4 elements of a 32x32 tile. Reads are
//                           coalesced (a warp reads 32 consecutive elements of one row); writes
//                           are not: the warp's 32 elements land in 32 different output rows,
//                           32 sectors per request for 32 useful elements.
//   2 transpose_tiled<T>    the 32x32 tile is staged through shared memory: coalesced read of a
//                           row into tile[y][x], barrier, coalesced write of a row of the output
//                           from a column tile[x][y]. fp32: the column's 32 words are 32 words
//                           apart -> all in one bank, a 32-way conflict on every shared load.
//   3 transpose_padded<T>   tile[32][32 + one 4-byte word]: fp32 stride 33, bf16 stride 34. The
//                           pad shifts each row by one bank, so a column read touches 32
//                           different banks. No conflicts. (bf16 with stride 33 would leave
//                           some: two elements share a word, a one-element pad is half a bank.)
//   4 transpose_vec4<T>     64x64 tile, 256 threads, 4 consecutive elements per global access
//                           (16-byte LDG/STG for fp32, 8-byte for bf16) and 4 rows of the tile per
//                           thread in flight before the barrier (16 elements per thread). The tile
//                           is stored to shared memory already transposed, row stride 64 + one
//                           word (fp32 65), with 8 lanes per 32-element row segment and 4 rows
//                           per warp: both the scalar stores and the scalar loads of shared
//                           memory then hit 32 distinct banks (fp32; bf16 loads keep a 2-way
//                           conflict, see docs/labs/transpose.md). Full interior tiles of suitably aligned
//                           matrices use vector accesses; edge tiles fall back to guarded scalar
//                           accesses through the same shared layout.
// Every version handles any rows, cols >= 1 (edge tiles are guarded element by element).
#include <cuda/std/cstdint>

constexpr int kTile = 32;     // versions 1-3: 32x32 tile
constexpr int kRowsPerPass = 8;  // block 32x8: each thread moves kTile / kRowsPerPass = 4 elements

// ---- 1: naive ----------------------------------------------------------------------------------
// grid (ceil(cols/32), ceil(rows/32)), block (32, 8).
template <class T>
__global__ void __launch_bounds__(kTile * kRowsPerPass) transpose_naive(const T* __restrict__ in, T* __restrict__ out, int rows, int cols) {
  const int c = blockIdx.x * kTile + threadIdx.x;
  const int r0 = blockIdx.y * kTile + threadIdx.y;
#pragma unroll
  for (int j = 0; j < kTile; j += kRowsPerPass) {
    const int r = r0 + j;
    if (r < rows && c < cols) out[int64_t(c) * rows + r] = in[int64_t(r) * cols + c];  // write stride: rows
  }
}

// ---- 2 and 3: tiled through shared memory, unpadded (kPadWords = 0) or padded (kPadWords = 1) --
// grid (ceil(cols/32), ceil(rows/32)), block (32, 8).
// kPadWords: 0 or 1 extra 4-byte word at the end of each tile row (1 element fp32, 2 bf16).
template <class T, int kPadWords>
__device__ __forceinline__ void transpose_tile_smem(const T* __restrict__ in, T* __restrict__ out, int rows, int cols) {
  constexpr int kPad = kPadWords * int(4 / sizeof(T));
  __shared__ T tile[kTile][kTile + kPad];  // tile[local input row][local input col]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int c = blockIdx.x * kTile + tx;
  const int r0 = blockIdx.y * kTile + ty;
#pragma unroll
  for (int j = 0; j < kTile; j += kRowsPerPass) {
    const int r = r0 + j;
    if (r < rows && c < cols) tile[ty + j][tx] = in[int64_t(r) * cols + c];  // row of the tile: coalesced
  }
  __syncthreads();  // every thread, no condition around it
  // This block writes output rows blockIdx.x*32 + (0..31) (input columns), output columns
  // blockIdx.y*32 + (0..31) (input rows). Lane tx reads tile[tx][ty + j]: a column of the tile.
  const int oc = blockIdx.y * kTile + tx;
  const int or0 = blockIdx.x * kTile + ty;
#pragma unroll
  for (int j = 0; j < kTile; j += kRowsPerPass) {
    const int orow = or0 + j;
    if (orow < cols && oc < rows) out[int64_t(orow) * rows + oc] = tile[tx][ty + j];  // the same guard as the load
  }
}

template <class T>
__global__ void __launch_bounds__(kTile * kRowsPerPass) transpose_tiled(const T* __restrict__ in, T* __restrict__ out, int rows, int cols) {
  transpose_tile_smem<T, 0>(in, out, rows, cols);
}

template <class T>
__global__ void __launch_bounds__(kTile * kRowsPerPass) transpose_padded(const T* __restrict__ in, T* __restrict__ out, int rows, int cols) {
  transpose_tile_smem<T, 1>(in, out, rows, cols);
}

// ---- 4: vectorized and coarsened --------------------------------------------------------------
constexpr int kVTile = 64;             // 64x64 tile per block
constexpr int kVThreads = 256;
constexpr int kVSteps = kVTile / 16;   // 8 warps x 4 rows = 16 rows per step -> 4 steps

template <class T>
struct alignas(4 * sizeof(T)) Vec4 {
  T v[4];
};

// grid (ceil(cols/64), ceil(rows/64)), block 256. vec_ok (host): rows % 4 == 0, cols % 4 == 0 and
// both pointers aligned to 4 * sizeof(T); only then may full tiles use vector accesses.
//
// Lane layout (both phases): warp w, lane l -> m = l % 8, q = l / 8;
//   local column group  col4 = 32 * (w % 2) + 4 * m   (4 consecutive elements)
//   local row           row  = 16 * step + 4 * (w / 2) + q
// so a warp covers 4 rows x 32 consecutive elements: 4 full 128-byte lines for fp32.
// Shared memory, fp32, stride 65 (= 1 mod 32 words): the store of element i goes to word
// (col4 + i) * 65 + row, whose bank is (4m + q + const) mod 32: 32 distinct banks for the
// 8 x 4 lanes; the load of element i reads word row * 65 + col4 + i: bank (q + 4m + const) mod 32,
// again 32 distinct. (bf16: two elements share a word; see docs/labs/transpose.md.)
template <class T>
__global__ void __launch_bounds__(kVThreads) transpose_vec4(const T* __restrict__ in, T* __restrict__ out, int rows, int cols, int vec_ok) {
  constexpr int kVStride = kVTile + int(4 / sizeof(T));  // row stride: 64 elements + one word
  __shared__ T tile_t[kVTile * kVStride];  // tile_t[local input col][local input row]: already transposed
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int m = lane % 8, q = lane / 8;
  const int col4 = 32 * (warp % 2) + 4 * m;
  const int row_in_step = 4 * (warp / 2) + q;
  const int r0 = blockIdx.y * kVTile, c0 = blockIdx.x * kVTile;
  // Block-uniform: the whole block takes the same path, so the barrier below is never skipped.
  const bool full = vec_ok && r0 + kVTile <= rows && c0 + kVTile <= cols;

  T v[kVSteps][4];  // all 4 rows' loads issued before the first shared store: 4 requests in flight
#pragma unroll
  for (int s = 0; s < kVSteps; ++s) {
    const int r = r0 + 16 * s + row_in_step;
    const int c = c0 + col4;
    if (full) {
      const Vec4<T> t = *reinterpret_cast<const Vec4<T>*>(in + int64_t(r) * cols + c);
#pragma unroll
      for (int i = 0; i < 4; ++i) v[s][i] = t.v[i];
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[s][i] = (r < rows && c + i < cols) ? in[int64_t(r) * cols + c + i] : T(0);
    }
  }
#pragma unroll
  for (int s = 0; s < kVSteps; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) tile_t[(col4 + i) * kVStride + 16 * s + row_in_step] = v[s][i];
  __syncthreads();
  // Output rows c0 + j (input columns), output columns r0 + col4 + i (input rows).
#pragma unroll
  for (int s = 0; s < kVSteps; ++s) {
    const int j = 16 * s + row_in_step;
    Vec4<T> w;
#pragma unroll
    for (int i = 0; i < 4; ++i) w.v[i] = tile_t[j * kVStride + col4 + i];
    const int orow = c0 + j, ocol = r0 + col4;
    if (full) {
      *reinterpret_cast<Vec4<T>*>(out + int64_t(orow) * rows + ocol) = w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (orow < cols && ocol + i < rows) out[int64_t(orow) * rows + ocol + i] = w.v[i];
    }
  }
}
