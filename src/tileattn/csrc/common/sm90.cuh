// PTX wrappers for the Hopper (sm_90a) path: TMA bulk tensor copies (2-D to 4-D loads and stores),
// mbarriers, wgmma (A from shared memory or from registers), stmatrix, named barriers, setmaxnreg
// and the proxy fences. Shared by the GEMM ladder's rung 10 (labs/csrc/gemm.cu) and the Hopper
// attention kernels (csrc/attention_fwd_sm90.cu); every instruction is spelled once, here. Compile for sm_90a: wgmma and
// setmaxnreg exist only there (plain sm_90 rejects them); TMA and mbarrier tx-counts need sm_90.
//
// The pieces and how they fit (one K step of a warp-specialized GEMM):
//
//   producer (1 thread)                         consumer warpgroup (128 threads)
//   ----------------------------------------    ---------------------------------------------
//   mbar_wait(empty[s], phase^1)  <- free?      mbar_wait(full[s], phase)      <- data landed?
//   mbar_arrive_expect_tx(full[s], bytes)       wgmma_fence(); wgmma...(desc(sA[s]), desc(sB[s]))
//   tma_load_2d(sA[s], &tmap_a, k, m, full[s])  wgmma_commit(); wgmma_wait<0>();
//   tma_load_2d(sB[s], &tmap_b, k, n, full[s])  mbar_arrive(empty[s])          <- slot free again
//
// - mbarrier: a 64-bit shared-memory object with an arrival count and a transaction (byte) count.
//   A phase completes when all expected arrivals happened AND all expected bytes landed; waiters
//   name the phase by its parity (0, 1, 0, ...). The TMA engine's complete_tx decrements the
//   byte count, so the producer thread's single arrive.expect_tx plus the copy's bytes complete
//   the phase: no thread ever polls the data itself.
// - TMA (cp.async.bulk.tensor): one thread asks the copy engine for a whole box (up to 256 x 256
//   elements, 5-D) described by a CUtensorMap built on the host (cuTensorMapEncodeTiled) and passed
//   as a `const __grid_constant__` kernel parameter (it then lives in the kernel's parameter
//   space; its generic address is what the instruction wants). Out-of-bounds box elements are
//   zero-filled and still counted in complete_tx (the byte count is always the full box).
//   Host-side rules: the global base address 16-byte aligned, every stride but the innermost a
//   multiple of 16 bytes, box inner extent x element size <= the swizzle span (128 B for 128B).
// - wgmma: a warpgroup (4 consecutive warps, first warp index % 4 == 0) issues one
//   m64nNk16 matrix multiply-accumulate asynchronously; operands come from shared memory through
//   64-bit matrix descriptors (make_smem_desc). Rules:
//   wgmma_fence() before the first wgmma that touches accumulator registers written by ordinary
//   instructions; wgmma_commit() closes a group; wgmma_wait<N>() waits until at most N groups are
//   pending, after which the accumulators may be read and the shared memory reused.
// - Shared memory written with ordinary stores (st.shared, stmatrix) and then read by wgmma or a
//   TMA store needs fence_proxy_async() in the writing threads before the barrier: those readers
//   are the "async proxy", which ordinary barriers alone do not order. Memory written by TMA and
//   awaited on an mbarrier needs no fence.
// - setmaxnreg: a warpgroup gives registers back (producer: dec) or takes them (consumers: inc).
//   Works only when the kernel has a register cap at entry (__launch_bounds__(threads, 1)); the
//   register counts must be multiples of 8 in [24, 256] and their sum over the block must fit the
//   register file (64 K): e.g. 384 threads = 1 producer WG at 40 + 2 consumer WGs at 232.
//
// Shared-memory tiles that wgmma reads with the 128-byte swizzle must start at a 1024-byte aligned
// address (the swizzle pattern repeats every 8 rows x 128 B); align dynamic shared memory by hand.
#pragma once
#include <cuda/std/cstdint>

namespace tileattn {
namespace sm90 {

using u32 = uint32_t;
using u64 = uint64_t;

// The host-built tensor map: 128 opaque bytes, 64-byte aligned (CUtensorMap in cuda.h). Declared
// here so device code needs no cuda.h. Kernel parameter: `const __grid_constant__ TmaDescriptor`.
struct alignas(64) TmaDescriptor {
  u64 opaque[16];
};
static_assert(sizeof(TmaDescriptor) == 128, "CUtensorMap is 128 bytes");

__device__ __forceinline__ u32 smem_u32(const void* ptr) {
  return static_cast<u32>(__cvta_generic_to_shared(ptr));
}

// ---- mbarrier -------------------------------------------------------------------------------
// Initialize with the number of arrivals a phase expects (e.g. 1 for "the producer's
// arrive.expect_tx", number of consumer warpgroups for "slot released"). One thread inits, then
// fence_barrier_init() + __syncthreads() before any other thread or the TMA engine uses it.
__device__ __forceinline__ void mbar_init(u64* bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}
// Makes initialized mbarriers visible to the async proxy (the TMA engine) and other threads.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival, and `bytes` more expected from asynchronous copies (TMA complete_tx) this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
// Only expect bytes, no arrival (when another instruction will do the arrival).
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
// One plain arrival (release semantics: this thread's earlier memory accesses happen before).
__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Non-blocking probe: true once the phase with this parity has completed.
__device__ __forceinline__ bool mbar_try_wait(u64* bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
// Block until the phase with this parity has completed (acquire: the data it guards is visible).
// try_wait suspends the thread for a hardware-chosen time before returning false, so the loop does
// not hammer the barrier.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// ---- TMA: bulk tensor copies global -> shared, completing on an mbarrier --------------------
// Hint the tensor map into the descriptor cache before the first copy (optional).
__device__ __forceinline__ void tma_prefetch_descriptor(const TmaDescriptor* desc) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(desc)) : "memory");
}
// 2-D box at element coordinates (c0 = innermost, c1) into `smem_dst`; complete_tx on `bar`.
// Coordinates may lie partly or wholly outside the tensor: those elements are zero-filled.
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const TmaDescriptor* desc, int c0, int c1, u64* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<u64>(desc)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}
// 3-D box (c0 innermost): e.g. (head_dim, seq, batch*heads) tiles for attention.
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const TmaDescriptor* desc, int c0, int c1, int c2,
                                            u64* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<u64>(desc)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}
// 4-D box (c0 innermost): attention tiles of a [B, H, N, d] tensor with any strides, as
// (d, row, head, batch). The row bound of the map is N, so rows >= N of a box are zero-filled on
// load (and skipped on store): one sequence's edge tile never touches the next head's rows.
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const TmaDescriptor* desc, int c0, int c1, int c2, int c3,
                                            u64* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<u64>(desc)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
      : "memory");
}
// Shared -> global 2-D box store (bulk-group completion; out-of-bounds elements are not written).
// The writing threads must fence_proxy_async() and synchronize before one thread issues it.
__device__ __forceinline__ void tma_store_2d(const TmaDescriptor* desc, const void* smem_src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<u64>(desc)),
               "r"(c0), "r"(c1), "r"(smem_u32(smem_src))
               : "memory");
}
// Shared -> global 4-D box store; box elements outside the tensor (rows >= N) are not written.
__device__ __forceinline__ void tma_store_4d(const TmaDescriptor* desc, const void* smem_src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                   reinterpret_cast<u64>(desc)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(smem_src))
               : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Wait until the committed stores have finished reading shared memory (the buffer may be reused).
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// ---- proxy fence ------------------------------------------------------------------------------
// Orders this thread's ordinary shared-memory accesses before later async-proxy accesses
// (wgmma operand reads, TMA stores) once a barrier has been passed.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- named barriers ---------------------------------------------------------------------------
// Synchronize `kThreads` threads (whole warps) on hardware barrier `id` (1..15; 0 is
// __syncthreads). Lets one warpgroup synchronize without stalling the others.
template <int kThreads>
__device__ __forceinline__ void named_barrier_sync(int id) {
  static_assert(kThreads % 32 == 0, "named barriers count whole warps");
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// Arrive on barrier `id` without waiting: the producer side of a named-barrier handshake (the
// waiting side calls named_barrier_sync with the same total count).
template <int kThreads>
__device__ __forceinline__ void named_barrier_arrive(int id) {
  static_assert(kThreads % 32 == 0, "named barriers count whole warps");
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// Synchronize like named_barrier_sync and return whether `pred` was true in any of the kThreads
// threads (bar.red.or): one flag per warpgroup without shared memory.
template <int kThreads>
__device__ __forceinline__ bool named_barrier_or(int id, bool pred) {
  static_assert(kThreads % 32 == 0, "named barriers count whole warps");
  u32 any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 q, %2, 0;\n bar.red.or.pred p, %1, %3, q;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(any)
      : "r"(id), "r"(static_cast<u32>(pred)), "n"(kThreads)
      : "memory");
  return any != 0;
}

// ---- stmatrix: four 8x8 b16 matrices from the mma fragment layout into shared memory ----------
// The inverse of ldmatrix.x4: register i holds (row g, columns 2t, 2t+1) of matrix i (g = lane / 4,
// t = lane % 4), i.e. exactly one m16n8 accumulator half packed to 16 bits; lane l gives the
// address of row (l % 8) of matrix (l / 8). One instruction writes 4 x 128 bytes: 16-byte rows,
// so a swizzled destination keeps it free of bank conflicts.
__device__ __forceinline__ void stmatrix_x4(u32 smem_row, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_row), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// ---- setmaxnreg (sm_90a) ----------------------------------------------------------------------
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- wgmma: descriptors and group control (sm_90a) --------------------------------------------
// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format" for wgmma):
//   bits  0-13  start address >> 4          bits 16-29  leading-dimension byte offset >> 4
//   bits 32-45  stride-dimension byte offset >> 4
//   bits 49-51  base offset (0: tiles start 1024-byte aligned)   bits 62-63  swizzle mode
// For a K-major tile whose rows are exactly 128 bytes (64 bf16/fp16) stored with the 128-byte
// swizzle (what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B): the 8-row core-matrix groups are
// 8 x 128 B = 1024 B apart (stride offset), the leading offset is unused (1 by convention), and
// the k-th 16-element slice starts 32 bytes further: desc + 2 * k (the hardware applies the
// swizzle to the final address, which is why the tile itself must be 1024-byte aligned).
enum class Swizzle : u32 { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

__device__ __forceinline__ u64 make_smem_desc(const void* smem_tile, u32 leading_bytes, u32 stride_bytes,
                                               Swizzle swizzle) {
  const u64 addr = smem_u32(smem_tile);
  u64 desc = (addr & 0x3FFFFull) >> 4;
  desc |= static_cast<u64>((leading_bytes >> 4) & 0x3FFFu) << 16;
  desc |= static_cast<u64>((stride_bytes >> 4) & 0x3FFFu) << 32;
  desc |= static_cast<u64>(static_cast<u32>(swizzle)) << 62;
  return desc;
}
// The common case: K-major, 128-byte rows, 128B swizzle (one TMA box of 64 x rows, 16-bit data).
__device__ __forceinline__ u64 make_desc_k128_sw128(const void* smem_tile) {
  return make_smem_desc(smem_tile, 16, 1024, Swizzle::k128B);
}

// MN-major operand (wgmma's transposed B, e.g. V [keys][d] for O += P V: N = d is the contiguous
// dimension), stored as TMA writes it with the 128-byte swizzle: 64-element (128 B) column panels,
// each [rows][64] with 128-byte rows. PTX defines, for swizzled MN-major layouts, the leading
// offset as the distance between 64-element panels along N (`panel_bytes`) and the stride offset
// as the distance between 8-row groups along K (8 x 128 B = 1024 B). The k-th 16-row slice starts
// k * 16 * 128 B = 2048 k bytes further (1024-aligned, so the base offset stays 0).
__device__ __forceinline__ u64 make_desc_mn_sw128(const void* smem_tile, u32 panel_bytes) {
  return make_smem_desc(smem_tile, panel_bytes, 1024, Swizzle::k128B);
}

// Before the first wgmma that reads or writes accumulator registers last touched by ordinary code.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// The compiler must not move accumulator reads/writes across the asynchronous wgmma: pass each
// accumulator register through an empty asm (as CUTLASS's warpgroup_fence_operand does).
template <int kN>
__device__ __forceinline__ void fence_accumulators(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Accumulator layout of m64nNk16 (fp32, per thread of the warpgroup), the mma.sync m16n8 layout
// repeated: warp w = (thread % 128) / 32 owns rows 16w..16w+15; with g = lane / 4, t = lane % 4,
// d[4j + 0..1] are row 16w + g, columns 8j + 2t + 0..1; d[4j + 2..3] are row 16w + g + 8.

// wgmma.mma_async m64nNk16, fp32 accumulators (N / 2 per thread), 16-bit A and B, for N in
// kWgmmaN below. wgmma_ss<N, kIsBF16>(d, desc_a, desc_b, scale_d): A and B from shared memory
// (descriptors, both K-major). scale_d == 0 ignores the old accumulator (d = A B), 1 accumulates.
// PTX needs the register list spelled out in the instruction text, so it is assembled from
// 8-register pieces (TILEATTN_WR<c> = "%8c, ..., %8c+7") per N, and the asm statement of one
// (N, type) is generated by one macro line; the operand numbers after the accumulators are N/2,
// N/2 + 1, ... (given as string literals).
#define TILEATTN_WR0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define TILEATTN_WR1 "%8, %9, %10, %11, %12, %13, %14, %15"
#define TILEATTN_WR2 "%16, %17, %18, %19, %20, %21, %22, %23"
#define TILEATTN_WR3 "%24, %25, %26, %27, %28, %29, %30, %31"
#define TILEATTN_WR4 "%32, %33, %34, %35, %36, %37, %38, %39"
#define TILEATTN_WR5 "%40, %41, %42, %43, %44, %45, %46, %47"
#define TILEATTN_WR6 "%48, %49, %50, %51, %52, %53, %54, %55"
#define TILEATTN_WR7 "%56, %57, %58, %59, %60, %61, %62, %63"
#define TILEATTN_WR8 "%64, %65, %66, %67, %68, %69, %70, %71"
#define TILEATTN_WR9 "%72, %73, %74, %75, %76, %77, %78, %79"
#define TILEATTN_WR10 "%80, %81, %82, %83, %84, %85, %86, %87"
#define TILEATTN_WR11 "%88, %89, %90, %91, %92, %93, %94, %95"
#define TILEATTN_WR12 "%96, %97, %98, %99, %100, %101, %102, %103"
#define TILEATTN_WR13 "%104, %105, %106, %107, %108, %109, %110, %111"
#define TILEATTN_WR14 "%112, %113, %114, %115, %116, %117, %118, %119"
#define TILEATTN_WR15 "%120, %121, %122, %123, %124, %125, %126, %127"
#define TILEATTN_WREGS_64 TILEATTN_WR0 ", " TILEATTN_WR1 ", " TILEATTN_WR2 ", " TILEATTN_WR3
#define TILEATTN_WREGS_80 TILEATTN_WR0 ", " TILEATTN_WR1 ", " TILEATTN_WR2 ", " TILEATTN_WR3 ", " TILEATTN_WR4
#define TILEATTN_WREGS_96 TILEATTN_WR0 ", " TILEATTN_WR1 ", " TILEATTN_WR2 ", " TILEATTN_WR3 ", " TILEATTN_WR4 ", " TILEATTN_WR5
#define TILEATTN_WREGS_128 TILEATTN_WR0 ", " TILEATTN_WR1 ", " TILEATTN_WR2 ", " TILEATTN_WR3 ", " TILEATTN_WR4 ", " TILEATTN_WR5 ", " TILEATTN_WR6 ", " TILEATTN_WR7
#define TILEATTN_WREGS_176 TILEATTN_WR0 ", " TILEATTN_WR1 ", " TILEATTN_WR2 ", " TILEATTN_WR3 ", " TILEATTN_WR4 ", " TILEATTN_WR5 ", " TILEATTN_WR6 ", " TILEATTN_WR7 ", " TILEATTN_WR8 ", " TILEATTN_WR9 ", " TILEATTN_WR10
#define TILEATTN_WREGS_192 TILEATTN_WR0 ", " TILEATTN_WR1 ", " TILEATTN_WR2 ", " TILEATTN_WR3 ", " TILEATTN_WR4 ", " TILEATTN_WR5 ", " TILEATTN_WR6 ", " TILEATTN_WR7 ", " TILEATTN_WR8 ", " TILEATTN_WR9 ", " TILEATTN_WR10 ", " TILEATTN_WR11
#define TILEATTN_WREGS_256 TILEATTN_WR0 ", " TILEATTN_WR1 ", " TILEATTN_WR2 ", " TILEATTN_WR3 ", " TILEATTN_WR4 ", " TILEATTN_WR5 ", " TILEATTN_WR6 ", " TILEATTN_WR7 ", " TILEATTN_WR8 ", " TILEATTN_WR9 ", " TILEATTN_WR10 ", " TILEATTN_WR11 ", " TILEATTN_WR12 ", " TILEATTN_WR13 ", " TILEATTN_WR14 ", " TILEATTN_WR15
#define TILEATTN_WACC8(d, i)                                                                          \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define TILEATTN_WACC_64(d) TILEATTN_WACC8(d, 0), TILEATTN_WACC8(d, 8), TILEATTN_WACC8(d, 16), TILEATTN_WACC8(d, 24)
#define TILEATTN_WACC_80(d) TILEATTN_WACC8(d, 0), TILEATTN_WACC8(d, 8), TILEATTN_WACC8(d, 16), TILEATTN_WACC8(d, 24), TILEATTN_WACC8(d, 32)
#define TILEATTN_WACC_96(d) TILEATTN_WACC8(d, 0), TILEATTN_WACC8(d, 8), TILEATTN_WACC8(d, 16), TILEATTN_WACC8(d, 24), TILEATTN_WACC8(d, 32), TILEATTN_WACC8(d, 40)
#define TILEATTN_WACC_128(d) TILEATTN_WACC8(d, 0), TILEATTN_WACC8(d, 8), TILEATTN_WACC8(d, 16), TILEATTN_WACC8(d, 24), TILEATTN_WACC8(d, 32), TILEATTN_WACC8(d, 40), TILEATTN_WACC8(d, 48), TILEATTN_WACC8(d, 56)
#define TILEATTN_WACC_176(d) TILEATTN_WACC8(d, 0), TILEATTN_WACC8(d, 8), TILEATTN_WACC8(d, 16), TILEATTN_WACC8(d, 24), TILEATTN_WACC8(d, 32), TILEATTN_WACC8(d, 40), TILEATTN_WACC8(d, 48), TILEATTN_WACC8(d, 56), TILEATTN_WACC8(d, 64), TILEATTN_WACC8(d, 72), TILEATTN_WACC8(d, 80)
#define TILEATTN_WACC_192(d) TILEATTN_WACC8(d, 0), TILEATTN_WACC8(d, 8), TILEATTN_WACC8(d, 16), TILEATTN_WACC8(d, 24), TILEATTN_WACC8(d, 32), TILEATTN_WACC8(d, 40), TILEATTN_WACC8(d, 48), TILEATTN_WACC8(d, 56), TILEATTN_WACC8(d, 64), TILEATTN_WACC8(d, 72), TILEATTN_WACC8(d, 80), TILEATTN_WACC8(d, 88)
#define TILEATTN_WACC_256(d) TILEATTN_WACC8(d, 0), TILEATTN_WACC8(d, 8), TILEATTN_WACC8(d, 16), TILEATTN_WACC8(d, 24), TILEATTN_WACC8(d, 32), TILEATTN_WACC8(d, 40), TILEATTN_WACC8(d, 48), TILEATTN_WACC8(d, 56), TILEATTN_WACC8(d, 64), TILEATTN_WACC8(d, 72), TILEATTN_WACC8(d, 80), TILEATTN_WACC8(d, 88), TILEATTN_WACC8(d, 96), TILEATTN_WACC8(d, 104), TILEATTN_WACC8(d, 112), TILEATTN_WACC8(d, 120)

__host__ __device__ constexpr bool wgmma_n_supported(int n) {
  return n == 64 || n == 80 || n == 96 || n == 128 || n == 176 || n == 192 || n == 256;
}

// Operands: accumulators %0..%(N/2 - 1), then desc_a, desc_b, scale_d (IA, IB, IS).
#define TILEATTN_WGMMA_SS(SHAPE, TYPE, REGS, IA, IB, IS)                                              \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" IS ", 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE \
  " {" REGS "}, %" IA ", %" IB ", p, 1, 1, 0, 0;\n}\n"
#define TILEATTN_WGMMA_SS_CASE(N, IA, IB, IS)                                                                 \
  if constexpr (kN == N) {                                                                                  \
    if constexpr (kIsBF16) {                                                                                \
      asm volatile(TILEATTN_WGMMA_SS("m64n" #N "k16", "bf16", TILEATTN_WREGS_##N, IA, IB, IS)                \
                   : TILEATTN_WACC_##N(d)                                                                   \
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                               \
    } else {                                                                                                \
      asm volatile(TILEATTN_WGMMA_SS("m64n" #N "k16", "f16", TILEATTN_WREGS_##N, IA, IB, IS)                 \
                   : TILEATTN_WACC_##N(d)                                                                   \
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                               \
    }                                                                                                       \
  }

template <int kN, bool kIsBF16>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 2], u64 desc_a, u64 desc_b, int scale_d) {
  static_assert(wgmma_n_supported(kN), "wgmma_ss: N in {64, 80, 96, 128, 176, 192, 256}");
  TILEATTN_WGMMA_SS_CASE(64, "32", "33", "34")
  TILEATTN_WGMMA_SS_CASE(80, "40", "41", "42")
  TILEATTN_WGMMA_SS_CASE(96, "48", "49", "50")
  TILEATTN_WGMMA_SS_CASE(128, "64", "65", "66")
  TILEATTN_WGMMA_SS_CASE(176, "88", "89", "90")
  TILEATTN_WGMMA_SS_CASE(192, "96", "97", "98")
  TILEATTN_WGMMA_SS_CASE(256, "128", "129", "130")
}

// d = A B^T over kKSteps k16 steps (issued, not committed), A and B K-major in shared memory as
// TMA writes them with the 128-byte swizzle: 64-column panels, a_panel_step / b_panel_step
// descriptor units (16 B) apart; k-step ks is panel ks / 4, 32 bytes (2 units) further per step
// inside it. The first step overwrites d.
template <int kN, bool kIsBF16, int kKSteps>
__device__ __forceinline__ void wgmma_ss_panels(float (&d)[kN / 2], u64 desc_a, u64 a_panel_step, u64 desc_b,
                                                u64 b_panel_step) {
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks)
    wgmma_ss<kN, kIsBF16>(d, desc_a + (ks / 4) * a_panel_step + 2 * (ks % 4),
                          desc_b + (ks / 4) * b_panel_step + 2 * (ks % 4), ks > 0 ? 1 : 0);
}

// Register-A form: A (64 x 16, 16-bit) from four packed registers per thread, B from shared memory.
// A fragment (PTX "Register Fragments", m64nNk16): warp w of the warpgroup holds rows 16w..16w+15
// in the mma.sync m16n8k16 A layout: a[0] = row g, columns 2t..2t+1; a[1] = row g + 8, same
// columns; a[2] = row g, columns 8 + 2t..; a[3] = row g + 8, columns 8 + 2t... That is exactly
// the accumulator of two adjacent n8 blocks packed pairwise: accumulator d[8k .. 8k + 7] of an
// m64nN wgmma, packed as (d0, d1), (d2, d3), (d4, d5), (d6, d7), is the A fragment of k-step k
// (how attention feeds P = softmax(S) into O += P V without a trip through shared memory).
// kTransB = 1: B is MN-major (make_desc_mn_sw128), 0: K-major (make_desc_k128_sw128).
// The A registers are read asynchronously: they must not be rewritten before the wgmma_wait that
// retires this group (ptxas tracks that; older ptxas, < 13.3, could get it wrong: docs/attention_fwd_sm90.md).
// Operands: accumulators %0..%(N/2 - 1), then a[0..3], desc_b, scale_d, kTransB (an immediate).
#define TILEATTN_WGMMA_RS(SHAPE, TYPE, REGS, IA0, IA1, IA2, IA3, IB, IS, IT)                            \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" IS ", 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE \
  " {" REGS "}, {%" IA0 ", %" IA1 ", %" IA2 ", %" IA3 "}, %" IB ", p, 1, 1, %" IT ";\n}\n"
#define TILEATTN_WGMMA_RS_CASE(N, IA0, IA1, IA2, IA3, IB, IS, IT)                                              \
  if constexpr (kN == N) {                                                                                     \
    if constexpr (kIsBF16) {                                                                                   \
      asm volatile(TILEATTN_WGMMA_RS("m64n" #N "k16", "bf16", TILEATTN_WREGS_##N, IA0, IA1, IA2, IA3, IB, IS, IT) \
                   : TILEATTN_WACC_##N(d)                                                                      \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));     \
    } else {                                                                                                   \
      asm volatile(TILEATTN_WGMMA_RS("m64n" #N "k16", "f16", TILEATTN_WREGS_##N, IA0, IA1, IA2, IA3, IB, IS, IT)  \
                   : TILEATTN_WACC_##N(d)                                                                      \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));     \
    }                                                                                                          \
  }

template <int kN, bool kIsBF16, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 2], const u32 (&a)[4], u64 desc_b, int scale_d) {
  static_assert(wgmma_n_supported(kN), "wgmma_rs: N in {64, 80, 96, 128, 176, 192, 256}");
  static_assert(kTransB == 0 || kTransB == 1, "wgmma_rs: kTransB is 0 (K-major B) or 1 (MN-major B)");
  TILEATTN_WGMMA_RS_CASE(64, "32", "33", "34", "35", "36", "37", "38")
  TILEATTN_WGMMA_RS_CASE(80, "40", "41", "42", "43", "44", "45", "46")
  TILEATTN_WGMMA_RS_CASE(96, "48", "49", "50", "51", "52", "53", "54")
  TILEATTN_WGMMA_RS_CASE(128, "64", "65", "66", "67", "68", "69", "70")
  TILEATTN_WGMMA_RS_CASE(176, "88", "89", "90", "91", "92", "93", "94")
  TILEATTN_WGMMA_RS_CASE(192, "96", "97", "98", "99", "100", "101", "102")
  TILEATTN_WGMMA_RS_CASE(256, "128", "129", "130", "131", "132", "133", "134")
}
#undef TILEATTN_WGMMA_RS_CASE
#undef TILEATTN_WGMMA_RS
#undef TILEATTN_WGMMA_SS_CASE
#undef TILEATTN_WGMMA_SS
#undef TILEATTN_WACC8
#undef TILEATTN_WACC_64
#undef TILEATTN_WREGS_64
#undef TILEATTN_WACC_80
#undef TILEATTN_WREGS_80
#undef TILEATTN_WACC_96
#undef TILEATTN_WREGS_96
#undef TILEATTN_WACC_128
#undef TILEATTN_WREGS_128
#undef TILEATTN_WACC_176
#undef TILEATTN_WREGS_176
#undef TILEATTN_WACC_192
#undef TILEATTN_WREGS_192
#undef TILEATTN_WACC_256
#undef TILEATTN_WREGS_256
#undef TILEATTN_WR0
#undef TILEATTN_WR1
#undef TILEATTN_WR2
#undef TILEATTN_WR3
#undef TILEATTN_WR4
#undef TILEATTN_WR5
#undef TILEATTN_WR6
#undef TILEATTN_WR7
#undef TILEATTN_WR8
#undef TILEATTN_WR9
#undef TILEATTN_WR10
#undef TILEATTN_WR11
#undef TILEATTN_WR12
#undef TILEATTN_WR13
#undef TILEATTN_WR14
#undef TILEATTN_WR15

}  // namespace sm90
}  // namespace tileattn
