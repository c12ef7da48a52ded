// Shared-memory tile building blocks of the sm_80 tensor-core kernels (attention forward and
// backward, and the paged / decode kernels): swizzled 16-bit tiles, cp.async tile loaders with
// edge handling, ldmatrix lane addressing, the launch-time shared-memory check, and the few
// constants and optimiser barriers the kernels share. Instruction wrappers live in sm80.cuh.
//
// Addresses are 32-bit shared-state-space byte addresses (u32, what cp.async and ldmatrix take):
// a tile is named by the address of its first byte, and every offset below is in bytes.
#pragma once
#include "sm80.cuh"

namespace tileattn {

// ---- constants ---------------------------------------------------------------------------------
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.693147180559945309417f;
// +-inf without <cmath> (NVRTC has no INFINITY macro without it).
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

__host__ __device__ constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

// ---- optimiser barriers -----------------------------------------------------------------------
// Identity the optimiser cannot see through. Applied to loop-invariant inputs of address
// arithmetic inside a main loop, so that the (cheap, integer) addresses are recomputed per
// iteration instead of being hoisted and kept live in registers the accumulators need.
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}
// %laneid through volatile asm: never CSE'd or hoisted, for the same reason as opaque().
__device__ __forceinline__ int opaque_lane() {
  int l;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(l));
  return l;
}

// ---- launch check: dynamic shared memory ----------------------------------------------------------
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned r;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(r));
  return r;
}
// The dynamic shared memory the kernel was launched with must cover `need` bytes and start on a
// 1 KB boundary (LdsmLane XORs chunk bits into absolute tile addresses, and every tile starts at
// a multiple of 1 KB from the base): trap loudly instead of reading past the allocation. Every
// thread tests the (CTA-uniform) condition: a threadIdx-dependent branch around the trap would make
// ptxas treat the rest of the kernel as possibly divergent (WARPSYNC / ENDCOLLECTIVE around every
// shuffle and vote, and CTA-uniform values moved out of the uniform datapath).
__device__ __forceinline__ void check_dynamic_smem(const void* smem, int need) {
  if (dynamic_smem_bytes() < static_cast<unsigned>(need) || (smem_addr(smem) & 1023u) != 0) __trap();
}

// ---- swizzled shared-memory tiles ---------------------------------------------------------------
// A row-major tile of kCols 16-bit elements per row (kCols in {32, 64, 96, 128, 256}), stored as
// 16-byte chunks. The 32 banks are 8 groups of 16 bytes; ldmatrix reads the same logical chunk
// of 8 consecutive rows per phase (8-row groups start at multiples of 8), so the physical chunk's
// bank group must differ across any 8 consecutive rows. Chunk c of row r is stored at physical
// chunk phys(r, c) of its row:
//   pitch of 8, 16 or 32 chunks (rows of 128 * n bytes): phys = c ^ (r & 7).
//   pitch of 4 chunks (d = 32, 64-byte rows): two rows share a 128-byte line, bank group =
//     4 (r & 1) + phys, so phys = c ^ ((r >> 1) & 3) makes (r & 1, (r >> 1) & 3) a bijection.
//   pitch of 12 chunks (d = 96 without padding, kPow2Pitch = false): chunks 0..7 use r & 7,
//     chunks 8..11 use (r >> 1) & 3 (rows start at 0 or 64 bytes mod 128). ldmatrix is
//     conflict-free; cp.async phases that straddle two rows can be 2-way (writes only).
// kPow2Pitch rounds the pitch up to a power of two (d = 96: 128 elements, 33% more shared memory),
// which buys the XOR identities below for every head dim:
//   offset(r + R, c) = offset(r, c) + R * kRowBytes      for R % 8 == 0
//   offset(r, c ^ C) = offset(r, c) ^ (16 * C)           for C < kPitchChunks, power-of-two pitch
// The swizzle permutes chunks inside a row, so a warp's cp.async writes of 8 consecutive chunks of
// a row, its 32-bit stores of mma accumulator pairs and 16-byte epilogue reads stay conflict-free.
template <int kCols, bool kPow2Pitch = true>
struct SwizzledTile {
  static_assert(kCols == 32 || kCols == 64 || kCols == 96 || kCols == 128 || kCols == 256,
                "tile width must be 32, 64, 96, 128 or 256 elements");
  static constexpr int kChunks = kCols / 8;  // chunks holding data
  static constexpr int kPitchChunks =
      !kPow2Pitch ? kChunks : kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  static constexpr bool kXorPitch = is_pow2(kPitchChunks);  // the XOR identities hold
  static constexpr int kRowBytes = kPitchChunks * 16;
  // Row term of the swizzle (power-of-two pitch).
  __device__ __forceinline__ static int row_swizzle(int r) { return kPitchChunks >= 8 ? (r & 7) : ((r >> 1) & 3); }
  // Physical chunk of logical chunk c in row r.
  __device__ __forceinline__ static int phys(int r, int c) {
    if constexpr (kXorPitch) {
      return c ^ row_swizzle(r);
    } else {
      static_assert(kPitchChunks == 12, "a non-power-of-two pitch is only the unpadded d = 96 tile");
      return c < 8 ? (c ^ (r & 7)) : (8 + ((c - 8) ^ ((r >> 1) & 3)));
    }
  }
  // Byte offset of 16-byte chunk c of row r.
  __device__ __forceinline__ static int chunk(int r, int c) { return r * kRowBytes + (phys(r, c) << 4); }
  // Byte offset of element (r, col).
  __device__ __forceinline__ static int elem(int r, int col) { return chunk(r, col >> 3) + (col & 7) * 2; }
  __host__ __device__ static constexpr int bytes(int rows) { return rows * kRowBytes; }
};

// ---- global -> shared tile loads ---------------------------------------------------------------
// kRows x Tile::kCols tile from rows [0, valid_rows) of a row-strided global matrix (pitch
// row_stride elements, 16-byte aligned rows); rows at or past valid_rows are zero-filled (cp.async
// with source size 0) and read from the clamped source row 0, so edge tiles compute on zeros and no
// out-of-range address is formed. valid_rows >= 1 (blocks start inside the matrix).
// Thread tid copies chunk c = tid % kChunks of rows tid / kChunks + i * kRowStep when the row step
// keeps the swizzle (a multiple of 8 rows): its shared address and global pointer then advance by
// constants (no per-chunk multiply). Otherwise chunks are dealt out round-robin.
template <int kRows, class Tile, int kThreads>
__device__ __forceinline__ void load_tile_async(u32 smem_tile, const u16* gmem, int64_t row_stride, int valid_rows,
                                                int tid) {
  constexpr int kChunks = Tile::kChunks;
  constexpr int kTotal = kRows * kChunks;
  if constexpr (kThreads % kChunks == 0 && (kThreads / kChunks) % 8 == 0) {
    constexpr int kRowStep = kThreads / kChunks;
    const int r0 = tid / kChunks, c = tid % kChunks;
    const u32 dst = smem_tile + Tile::chunk(r0, c);
    const u16* src = gmem + static_cast<int64_t>(r0) * row_stride + c * 8;
    const int64_t step = kRowStep * row_stride;
#pragma unroll
    for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
      if (kTotal % kThreads == 0 || r0 + i * kRowStep < kRows) {
        const bool ok = r0 + i * kRowStep < valid_rows;
        cp_async_16(dst + i * kRowStep * Tile::kRowBytes, ok ? src + i * step : gmem, ok);
      }
    }
  } else {
#pragma unroll
    for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
      const int idx = tid + it * kThreads;
      if (kTotal % kThreads == 0 || idx < kTotal) {
        const int r = idx / kChunks;
        const int c = idx - r * kChunks;
        const bool ok = r < valid_rows;
        const u16* src = gmem + (ok ? static_cast<int64_t>(r) * row_stride : 0) + c * 8;
        cp_async_16(smem_tile + Tile::chunk(r, c), src, ok);
      }
    }
  }
}

// A full kRows x Tile::kCols tile (every row in range) from `block`, its first row. For main loops
// where registers are scarce: `block` is CTA-uniform (its 64-bit arithmetic stays in uniform
// registers) and the per-thread part is a 32-bit element offset (the caller guarantees
// kRows * row_stride < 2^31), recomputed from an opaque thread index at each call, so nothing
// thread-specific and 64-bit stays live across the loop.
template <int kRows, class Tile, int kThreads>
__device__ __forceinline__ void load_tile_full_async(u32 smem_tile, const u16* block, int row_stride, int tid) {
  constexpr int kChunks = Tile::kChunks;
  constexpr int kTotal = kRows * kChunks;
  tid = opaque(tid);
#pragma unroll
  for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
    const int id = tid + i * kThreads;
    if (kTotal % kThreads == 0 || id < kTotal) {
      const int r = id / kChunks, c = id % kChunks;
      cp_async_16(smem_tile + Tile::chunk(r, c), block + (r * row_stride + c * 8), true);
    }
  }
}

// kRows x Tile::kCols tile from shared memory to global rows [0, valid_rows), 16 B per thread.
template <int kRows, class Tile, int kThreads>
__device__ __forceinline__ void store_tile(u16* gmem, int64_t row_stride, int valid_rows, const char* smem_tile,
                                           int tid) {
  constexpr int kTotal = kRows * Tile::kChunks;
  constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int idx = tid + it * kThreads;
    if (kTotal % kThreads == 0 || idx < kTotal) {
      const int r = idx / Tile::kChunks;
      const int c = idx - r * Tile::kChunks;
      if (r < valid_rows) {
        const uint4 val = *reinterpret_cast<const uint4*>(smem_tile + Tile::chunk(r, c));
        *reinterpret_cast<uint4*>(gmem + static_cast<int64_t>(r) * row_stride + c * 8) = val;
      }
    }
  }
}

// ---- ldmatrix lane addressing ----------------------------------------------------------------
// One ldmatrix.x4 reads a 16 x 16 block of a tile (16 rows x 2 chunks) as four 8x8 matrices; lanes
// 8i..8i+7 give the row addresses of matrix i, which lands in register i. Two lane orders:
//   kRowsFirst:  matrices (rows 0-7, chunk 0) (rows 8-15, chunk 0) (rows 0-7, chunk 1) (rows 8-15,
//                chunk 1) -> lane row l % 16, chunk l / 16. This is the A fragment a0..a3 of a
//                tile whose rows are m (no .trans), and the B fragments b0,b1 of two n8 tiles of a
//                tile whose rows are k (with .trans).
//   !kRowsFirst: (rows 0-7, chunk 0) (rows 0-7, chunk 1) (rows 8-15, chunk 0) (rows 8-15, chunk 1)
//                -> lane row l % 8 + 8 * (l / 16), chunk (l / 8) % 2. This is the B fragments of
//                two n8 tiles of a tile whose rows are n (no .trans), and the A fragment of a tile
//                whose rows are k (with .trans).
// at(i, j) addresses the block at rows row0 + 16 i, columns col0 + 16 j, for j < kPairs.
//   kXor (power-of-two pitch, tile at a multiple of 1 KB, and the lane's chunk col0 / 8 + lane bit
//   sharing no bits with 2 j: col0 == 0, or col0 a multiple of 16 * the power-of-two count of j):
//   by the SwizzledTile identities at(i, j) = (base ^ 32 (j & 3)) + 128 (j >> 2) + i * 16 *
//   kRowBytes: one LOP3 per distinct j & 3, everything else an immediate folded into LDSM (j's
//   higher bits select chunks 8.. whose bits the lane's chunk and the row swizzle never touch, so
//   the XOR there is an add). One register per lane and operand.
//   Otherwise (d = 96 tiles, warp tiles of 48 columns): a table of the kPairs lane addresses.
template <class Tile, bool kRowsFirst, bool kXor, int kPairs = 1>
struct LdsmLane {
  static_assert(!kXor || Tile::kXorPitch, "the XOR addressing needs a power-of-two pitch");
  static constexpr int kCount = kXor ? 1 : kPairs;
  u32 addr[kCount];  // kXor: the lane's (row, chunk); else one per chunk pair
  __device__ __forceinline__ LdsmLane(u32 tile, int row0, int col0, int lane) {
    const int r = row0 + (kRowsFirst ? (lane & 15) : ((lane & 7) + ((lane >> 4) << 3)));
    const int c = (col0 >> 3) + (kRowsFirst ? (lane >> 4) : ((lane >> 3) & 1));
#pragma unroll
    for (int j = 0; j < kCount; ++j) addr[j] = tile + Tile::chunk(r, c + 2 * j);
  }
  __device__ __forceinline__ u32 at(int i, int j) const {
    if constexpr (kXor) {
      // A j known at compile time (unrolled loops) folds its high bits into the LDSM immediate; a
      // run-time j (partly rolled k loops) costs one shift + LOP3 either way, so it XORs whole.
      if (__builtin_constant_p(j)) return (addr[0] ^ (32 * (j & 3))) + 128 * (j >> 2) + i * 16 * Tile::kRowBytes;
      return (addr[0] ^ (32 * j)) + i * 16 * Tile::kRowBytes;
    } else {
      return addr[j] + i * 16 * Tile::kRowBytes;
    }
  }
};

}  // namespace tileattn
