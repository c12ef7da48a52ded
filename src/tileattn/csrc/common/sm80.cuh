// PTX wrappers for the sm_80 tensor-core path (also runs on sm_90): cp.async, ldmatrix,
// mma.sync m16n8k16, and the 16-bit <-> fp32 conversions. Every kernel family includes this
// header instead of writing its own asm, so each instruction is spelled once.
//
// 16-bit elements travel as raw uint16_t / packed uint32_t; the element type is a template flag
// (kIsBF16) instead of cuda_fp16.h / cuda_bf16.h types, so the kernels compile under NVRTC with
// nothing but <cuda/std/cstdint> and need no header search path for the fp16 headers.
#pragma once
#include <cuda/std/cstdint>

namespace tileattn {

using u16 = uint16_t;
using u32 = uint32_t;

// Shared-memory address as the 32-bit offset that cp.async / ldmatrix take.
__device__ __forceinline__ u32 smem_addr(const void* ptr) {
  return static_cast<u32>(__cvta_generic_to_shared(ptr));
}

// ---- cp.async: global -> shared without passing through registers (sm_80+) ------------------
// 16 bytes per call, L1 bypassed (.cg). When `valid` is false the source size is 0, so the 16
// destination bytes are zero-filled: edge tiles read zeros instead of out-of-bounds memory.
__device__ __forceinline__ void cp_async_16(u32 smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  cp_async_16(smem_addr(smem_dst), gmem_src, valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ---- ldmatrix: four 8x8 b16 matrices from shared memory into the mma fragment layout --------
// Lane l supplies the row address of row (l % 8) of matrix (l / 8), as a shared-memory address
// (u32: kernels that keep precomputed lane addresses) or a generic pointer.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row));
}
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem_row) { ldmatrix_x4(r, smem_addr(smem_row)); }
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem_row) {
  ldmatrix_x4_trans(r, smem_addr(smem_row));
}
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(u32 (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem_row)));
}

// ---- mma.sync m16n8k16, 16-bit inputs, fp32 accumulate: d = a * b + d -----------------------
// a: 16x16 row-major fragment (4 regs), b: 16x8 "col" fragment (2 regs), d: 16x8 fp32 (4 regs).
// Fragment ownership (PTX ISA, "Matrix Fragments for mma.m16n8k16"): with g = lane / 4 and
// t = lane % 4, d[0..1] are row g, cols 2t..2t+1; d[2..3] are row g + 8, same cols.
template <bool kIsBF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  if constexpr (kIsBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// ---- conversions ---------------------------------------------------------------------------
// Two fp32 values -> one packed 16-bit pair, round to nearest even; `lo` lands in bits 0..15
// (the lower column index in mma fragments).
template <bool kIsBF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if constexpr (kIsBF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}
template <bool kIsBF16>
__device__ __forceinline__ float to_float(u16 x) {
  if constexpr (kIsBF16) {
    return __uint_as_float(static_cast<u32>(x) << 16);
  } else {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
    return f;
  }
}
template <bool kIsBF16>
__device__ __forceinline__ u16 from_float(float x) {
  return static_cast<u16>(pack2<kIsBF16>(x, 0.f) & 0xffffu);
}
// Packed pair -> two floats (lo = bits 0..15).
template <bool kIsBF16>
__device__ __forceinline__ void unpack2(u32 p, float& lo, float& hi) {
  lo = to_float<kIsBF16>(static_cast<u16>(p & 0xffffu));
  hi = to_float<kIsBF16>(static_cast<u16>(p >> 16));
}

// ---- numerics ------------------------------------------------------------------------------
// 2^x on the SFU (MUFU.EX2). Softmax works in base 2 with log2(e) folded into the scale, so one
// FFMA + one MUFU per score instead of a full-precision expf.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Butterfly reductions over the 4 lanes (t = lane % 4) that share one mma accumulator row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// ---- fp32 reductions into global memory (RED: no value comes back, so no round trip) --------
// Used for fp32 gradient accumulators that several blocks add into (attention backward dQ).
__device__ __forceinline__ void red_add_f32(float* gmem, float v) {
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(gmem), "f"(v));
}
// Four adjacent floats; `gmem` must be 16-byte aligned. sm_90 has a vector RED (one request for
// 16 bytes: a warp's 32 lanes cover 512 contiguous bytes in one instruction); older archs issue
// four scalar REDs.
__device__ __forceinline__ void red_add_f32x4(float* gmem, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(gmem), "f"(a), "f"(b), "f"(c), "f"(d));
#else
  red_add_f32(gmem, a);
  red_add_f32(gmem + 1, b);
  red_add_f32(gmem + 2, c);
  red_add_f32(gmem + 3, d);
#endif
}

}  // namespace tileattn
