// Variable-length batches: where sequence b of a packed batch lives.
//
// A varlen batch packs B sequences along one token axis: q [Tq, H, d], k/v [Tk, Hkv, d], with
// cu_seqlens_q / cu_seqlens_k int32 [B + 1] (prefix sums: sequence b owns query tokens
// cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1). Kernels that serve dense [B, H, N, d] batches and
// packed ones are templated on kVarlen; the dense instantiation gets a span at token 0 of its batch
// slice (the batch stride does the rest) with the lengths from its arguments, all compile-time
// known to be what the dense code always used, so its code does not change.
//
// Rows past the last sequence (cu_seqlens[B] .. T - 1, e.g. a token buffer padded to a captured
// size) belong to no sequence. Varlen grids get one extra z-slice (blockIdx.z == B) whose CTAs
// write those rows of the outputs as zeros (lse -inf), so no output element is ever left unwritten,
// whatever the lengths on the device are.
#pragma once
#include <cuda/std/cstdint>

namespace tileattn {

struct SeqSpan {
  int q0, k0;  // first query / key token of the sequence (0 for dense batches)
  int nq, nk;  // its query / key lengths (>= 0; 0 for an empty sequence)
};

// Read-only load the compiler can neither hoist nor CSE (asm volatile): for values re-read inside a
// main loop instead of occupying a register across it (see seq_span's kReload).
__device__ __forceinline__ int ld_nc_volatile(const int* p) {
  int v;
  asm volatile("ld.global.nc.s32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// kReload: load again at each call (a few L1-hit loads) rather than keep the span live across a
// loop whose accumulators need every register; dense spans are compile-time/parameter values.
template <bool kVarlen, bool kReload = false>
__device__ __forceinline__ SeqSpan seq_span(const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
                                            int batch, int seqlen_q, int seqlen_k) {
  if constexpr (kVarlen) {
    auto ld = [](const int* p) { return kReload ? ld_nc_volatile(p) : __ldg(p); };
    const int q0 = ld(cu_seqlens_q + batch), k0 = ld(cu_seqlens_k + batch);
    return {q0, k0, ld(cu_seqlens_q + batch + 1) - q0, ld(cu_seqlens_k + batch + 1) - k0};
  } else {
    return {0, 0, seqlen_q, seqlen_k};
  }
}

// Whether this CTA is the extra z-slice of a varlen grid (it owns the rows past the last sequence).
__device__ __forceinline__ bool is_tail_slice() { return blockIdx.z == gridDim.z - 1; }

// Zero rows [begin, end) of one head's [T, kD] slice of a 16-bit tensor (row pitch row_stride
// elements, 16-byte aligned rows), 16 bytes per thread; the CTAs of the grid's x dimension stride
// over the rows. `lse` (may be null): the same rows of one head's fp32 [T] lse get -inf.
template <int kD, int kThreads>
__device__ __forceinline__ void zero_tail_rows(uint16_t* base, int64_t row_stride, float* lse, int begin, int end) {
  constexpr int kChunks = kD / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t count = static_cast<int64_t>(end - begin) * kChunks;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; idx < count; idx += stride) {
    const int64_t r = begin + idx / kChunks;
    *reinterpret_cast<uint4*>(base + r * row_stride + (idx % kChunks) * 8) = make_uint4(0u, 0u, 0u, 0u);
  }
  if (lse != nullptr) {
    for (int64_t r = begin + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; r < end; r += stride) {
      lse[r] = __int_as_float(0xff800000);  // -inf
    }
  }
}

}  // namespace tileattn
