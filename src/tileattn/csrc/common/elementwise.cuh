// Element helpers of the decoder's small fused steps (layer_ops.cu) and of the GEMV prologues
// (gemv.cu), which must compute the same roundings bit for bit: 16-bit values travel 8 per 16-byte
// chunk and are widened to fp32; round16 is what a torch op returning a 16-bit tensor does.
#pragma once

#include <cuda/std/cstdint>

#include "pdl.cuh"
#include "sm80.cuh"

namespace tileattn {

// 8-element chunks per thread in add_rms_norm (its block has at most 1024 threads: D <= 32768);
// the GEMV's norm prologue sums squares in the same order, so it uses the same layout.
constexpr int kNormMaxChunks = 4;

namespace layer_ops {

// 8 elements <-> 8 floats.
template <bool kIsBF16>
__device__ __forceinline__ void load8(uint4 c, float (&f)[8]) {
  unpack2<kIsBF16>(c.x, f[0], f[1]);
  unpack2<kIsBF16>(c.y, f[2], f[3]);
  unpack2<kIsBF16>(c.z, f[4], f[5]);
  unpack2<kIsBF16>(c.w, f[6], f[7]);
}
template <bool kIsBF16>
__device__ __forceinline__ uint4 store8(const float (&f)[8]) {
  return make_uint4(pack2<kIsBF16>(f[0], f[1]), pack2<kIsBF16>(f[2], f[3]), pack2<kIsBF16>(f[4], f[5]),
                    pack2<kIsBF16>(f[6], f[7]));
}
// Round to the 16-bit type and back (what a torch op that returns a 16-bit tensor does).
template <bool kIsBF16>
__device__ __forceinline__ float round16(float x) {
  return to_float<kIsBF16>(from_float<kIsBF16>(x));
}

// One rotate-half rotary pair (elements j and j + d/2 of a head, lo and hi) with the fp32 table
// values cos_j and sin_j (rounded to the 16-bit type, as the model's Rotary module hands them to
// the layers): lo cos - hi sin and hi cos + lo sin, each product and sum an explicit
// round-to-nearest intrinsic (no FMA contraction a compiler could choose differently in two
// kernels), rounded once to 16 bits. layer_ops' rotary kernels call it (rotate_row); the GEMV's
// rotary + KV-cache epilogue, which shared it, was removed on 2026-12-02 (docs/gemv.md).
template <bool kIsBF16>
__device__ __forceinline__ void rotate_pair(float lo, float hi, float cos_j, float sin_j, u16& out_lo, u16& out_hi) {
  const float c = round16<kIsBF16>(cos_j), sn = round16<kIsBF16>(sin_j);
  out_lo = from_float<kIsBF16>(__fsub_rn(__fmul_rn(lo, c), __fmul_rn(hi, sn)));
  out_hi = from_float<kIsBF16>(__fadd_rn(__fmul_rn(hi, c), __fmul_rn(lo, sn)));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Both PDL steps: wait for the previous kernel's writes, then let the next kernel's blocks be
// scheduled (it waits for this grid's completion itself before it reads anything).
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_release_dependents();
}

// silu(g) rounded to the 16-bit type, times u (in fp32; the caller's store rounds the product):
// transformers' act_fn(gate) * up, whose SiLU returns a 16-bit tensor.
template <bool kIsBF16>
__device__ __forceinline__ float silu_times(float g, float u) {
  return round16<kIsBF16>(g / (1.f + __expf(-g))) * u;
}

}  // namespace layer_ops

}  // namespace tileattn
