// PTX wrappers the Hopper attention backward (csrc/attention_bwd_sm90.cu) needs beyond
// common/sm90.cuh: a 1-D bulk copy global -> shared completing on an mbarrier (the per-query lse2 /
// delta vectors, which are plain contiguous fp32 runs and need no tensor map), the shared-memory
// wgmma with both operands MN-major (dQ = dS K: dS is stored as dS^T [keys][queries] and K as
// [keys][d], so both have the wgmma M / N dimension contiguous), and the deterministic mode's
// pieces: the bulk fp32 reduce-add shared -> global, its completion wait, the proxy fence, and the
// GPU-scope acquire / release accesses of the turn counters. Compile for sm_90a.
#pragma once
#include "sm90.cuh"

namespace tileattn {
namespace sm90 {

// `bytes` (a multiple of 16) contiguous bytes from global `src` (16-byte aligned) to shared `dst`
// (16-byte aligned); completes `bytes` transactions on `bar` like a TMA tensor copy, so one
// arrive.expect_tx covering tensor boxes and these bytes completes the phase.
__device__ __forceinline__ void bulk_load_1d(void* smem_dst, const void* gmem_src, u32 bytes, u64* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_u32(smem_dst)),
      "l"(reinterpret_cast<u64>(gmem_src)), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// wgmma m64n64k16, fp32 accumulators, A and B from shared memory, both MN-major (imm-trans-a =
// imm-trans-b = 1): A (64 x 16) stored with M contiguous, B (16 x 64) with N contiguous, each as
// TMA / stmatrix write a 128-byte-swizzled [k rows][64] panel: make_desc_mn_sw128 for both, the
// k-th 16-row slice 2048 k bytes further. scale_d == 0 overwrites d, 1 accumulates.
template <bool kIsBF16>
__device__ __forceinline__ void wgmma_ss_n64_mn_mn(float (&d)[32], u64 desc_a, u64 desc_b, int scale_d) {
#define TILEATTN_WGMMA_MNMN(TYPE)                                                                                \
  asm volatile(                                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                               \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                                                \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                 \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),           \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),     \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),   \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])    \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))
  if constexpr (kIsBF16) {
    TILEATTN_WGMMA_MNMN("bf16");
  } else {
    TILEATTN_WGMMA_MNMN("f16");
  }
#undef TILEATTN_WGMMA_MNMN
}

// Adds `bytes` (a multiple of 16) of fp32 from shared `src` into global `dst` (both 16-byte aligned)
// element by element, performed at L2 by the async proxy as one bulk operation of the current
// bulk async-group (commit with tma_store_commit; tma_store_wait_read frees `src`, bulk_wait_all
// waits until the additions are done). The deterministic mode's ordered dQ addition.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem_dst, const float* smem_src, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                   reinterpret_cast<u64>(gmem_dst)),
               "r"(smem_u32(smem_src)), "r"(bytes)
               : "memory");
}
// Wait until every committed bulk async-group of this thread is complete (writes included).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Orders this thread's generic-proxy global accesses with its async-proxy ones (either direction).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// GPU-scope acquire load / release store of an int32 flag in global memory, and the acq_rel fence
// that (after a barrier) makes the whole CTA's earlier writes visible to whoever acquires the flag.
__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(int* ptr, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

}  // namespace sm90
}  // namespace tileattn
