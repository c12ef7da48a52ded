// Paged KV-cache write: the keys and values of T new tokens into their cache slots.
//
//   k_cache[slot / block_size, slot % block_size, h, :] = k[t, h, :]     (same for v)
//   slot = slot_mapping[t]; slot < 0 (a padding token) or slot >= num_blocks * block_size skips t.
//
// One kernel for K and V, any element type (the copy moves raw 16-byte chunks: fp16, bf16, fp32
// and fp8 caches alike; k and the cache share a dtype, no conversion), block sizes that are powers
// of two (a shift and a mask instead of a 64-bit division per thread). Nothing
// depends on the host beyond the shapes, so it is captured by CUDA graphs like any launch.
//
// ---- Work decomposition -------------------------------------------------------------------------
// One thread per 16-byte chunk of one (token, kv head) row: T * Hkv * chunks threads, with
// chunks = row bytes / 16 (16 for d = 128 in 16 bits). Consecutive threads take consecutive
// chunks of one row, so a warp reads 512 contiguous bytes of k and writes 512 contiguous bytes of
// the cache (two heads' rows at d = 128): full 128-byte sectors on both sides. Each thread moves
// its chunk of K and then of V, so the slot_mapping load (one 4/8-byte read, shared by the
// chunks * Hkv threads of a token through L1) is amortised over two 16-byte copies.
// The copy is pure bandwidth: T * Hkv * d * 2 (K+V) * 2 (read + write) bytes.
//
// ---- Bounds --------------------------------------------------------------------------------
// A slot outside [0, num_blocks * block_size) is skipped, never clamped: the kernel never writes
// outside the caches whatever slot_mapping holds (the host's validate=True reports such slots).
// Offsets are 64-bit: a cache of 40 GB has more than 2^31 elements.
//
// ---- Programmatic dependent launch ---------------------------------------------------------
// The kernel waits for the previous kernel's writes (pdl_wait) before it reads slot_mapping or k,
// so the host may launch it with the PDL attribute (TILEATTN_PDL=1, common/pdl.cuh).
#include <cuda/std/cstdint>

#include "common/pdl.cuh"

namespace tileattn {

// Block (chunks, rows_per_block): threadIdx.x is the 16-byte chunk inside a row, threadIdx.y the
// row (token * kv_heads + head) inside this block's rows. Strides are in 16-byte chunks (the host
// checks that every stride and pointer is 16-byte aligned); block_size = 1 << log2_block_size.
template <typename Index>
__global__ void __launch_bounds__(256)
    write_kv_cache(const uint4* __restrict__ k, const uint4* __restrict__ v, uint4* __restrict__ k_cache,
                   uint4* __restrict__ v_cache, const Index* __restrict__ slot_mapping, int num_rows, int kv_heads,
                   int64_t k_st, int64_t k_sh, int64_t v_st, int64_t v_sh, int64_t kc_sb, int64_t kc_sr,
                   int64_t kc_sh, int64_t vc_sb, int64_t vc_sr, int64_t vc_sh, int log2_block_size,
                   int64_t num_slots) {
  const int row = blockIdx.x * blockDim.y + threadIdx.y;  // token * kv_heads + head
  if (row >= num_rows) return;
  pdl_wait();
  pdl_release_dependents();
  const int c = threadIdx.x;
  const int t = row / kv_heads, h = row - t * kv_heads;
  const int64_t slot = static_cast<int64_t>(slot_mapping[t]);
  if (slot < 0 || slot >= num_slots) return;  // padding token, or a slot outside the cache
  const int64_t blk = slot >> log2_block_size, off = slot & ((int64_t{1} << log2_block_size) - 1);
  k_cache[blk * kc_sb + off * kc_sr + h * kc_sh + c] = k[t * k_st + h * k_sh + c];
  v_cache[blk * vc_sb + off * vc_sr + h * vc_sh + c] = v[t * v_st + h * v_sh + c];
}

}  // namespace tileattn
