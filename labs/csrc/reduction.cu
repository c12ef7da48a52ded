// Reductions of a 1-D fp32 array (sum and max): the ladder from a textbook block reduction to a
// bandwidth-bound multi-block kernel, and deliberately broken versions for the sanitizer lab.
//
//   python -m labs.reduction   validates every correct version at n = 1, 31, 32, 33, 1003 and 2^30
//                              (sum against a float64 torch sum, max exactly), then times each at
//                              2^30 beside torch.sum / torch.amax measured in the same run.
//   python -m labs.sanitize    runs correct and broken versions under compute-sanitizer
//                              memcheck / racecheck / synccheck / initcheck.
//
// Correct versions (each adds one idea to the one before; Op = SumOp | MaxOp, B = threads/block):
//   1 reduce_interleaved<Op,B>    one element per thread into shared memory, then a tree with
//                                 interleaved addressing: at stride s, threads with tid % 2s == 0
//                                 combine sm[tid] and sm[tid+s]. Active threads are scattered over
//                                 every warp, so all warps stay resident (and divergent) to the end.
//   2 reduce_sequential<Op,B>     sequential addressing: at stride s, threads tid < s combine
//                                 sm[tid] and sm[tid+s]. Active threads are contiguous, so whole
//                                 warps retire early and consecutive lanes hit consecutive banks.
//   3 reduce_first_add<Op,B>      each thread loads two elements (i and i+B) and combines them
//                                 during the load: half the blocks, and no thread idles at level 1.
//   4 reduce_warp_shuffle<Op,B>   3, with the last 64 -> 1 done by warp 0 in registers with
//                                 __shfl_xor_sync(0xffffffff, ...): no shared memory and no block
//                                 barrier for the last six levels; the mask names all 32 lanes.
//   5 reduce_vec4<Op,B,U>         grid-stride loop of 16-byte loads (float4), U independent loads
//                                 in flight per thread, accumulators in registers; the block
//                                 combines its threads with warp shuffles (block_reduce). This is
//                                 the two-launch multi-block reduction: pass 1 runs one wave of
//                                 blocks (one partial each), pass 2 the same kernel with one block.
//   6 reduce_vec4_onepass<Op,B,U> 5 in a single launch. Blocks cannot wait for each other inside a
//                                 launch, so the documented alternative is used (the CUDA
//                                 programming guide's threadFenceReduction pattern): every block
//                                 writes its partial, __threadfence(), then atomicInc on a counter;
//                                 the block that draws the last ticket reduces all partials. The
//                                 atomicInc bound (gridDim.x - 1) wraps the counter back to 0, so
//                                 it is ready for the next launch without a memset.
// Versions 1-4 write one partial per block; the host launches them again on the partials until a
// single value is left (ceil(log_{B or 2B} n) launches: 4 at n = 2^30).
//
// Lanes past the end of the array load the operation's identity (0 for sum, -inf for max), so
// every barrier stays outside any data-dependent condition.
//
// Broken versions, kept on purpose (registry `broken=`; never run by labs.reduction):
//   reduce_bug_barrier_in_branch<Op,B>  2 with __syncthreads() inside `if (tid < s)`: threads
//                                       tid >= s never reach it and wait at the barrier after the
//                                       loop instead (undefined behaviour; on sm_70+ the hardware
//                                       counts arrivals per barrier id, not per call site, and
//                                       exited warps as arrived, so it tends to "work"). synccheck.
//   reduce_bug_missing_barrier<Op,B>    2 without the barrier between tree levels: a level reads
//                                       sm[tid+s] before another warp wrote it. racecheck.
//   reduce_bug_oob_store<Op,B>          2 storing its partial to out[blockIdx.x + 1] (a 1-based
//                                       slip): the last block writes past the end. memcheck; the
//                                       never-written out[0] is then read: initcheck.
//   reduce_bug_uninit_shared<Op,B>      2 where lanes past the end skip their shared store instead
//                                       of storing the identity: the tree reads stale shared
//                                       memory. No tool tracks shared-memory initialization.
//   reduce_bug_final_reads_all<Op,B>    a final pass over a partials buffer padded to B entries
//                                       that reads all B, not the `count` that pass 1 wrote: a read
//                                       of never-written global memory. initcheck.
#include <cuda/std/cstdint>

// ---- the two operations -----------------------------------------------------------------------
struct SumOp {
  static __device__ __forceinline__ float identity() { return 0.0f; }
  static __device__ __forceinline__ float combine(float a, float b) { return a + b; }
};
struct MaxOp {
  // -inf; fmaxf ignores a NaN operand (torch.amax propagates it): the lab uses finite inputs.
  static __device__ __forceinline__ float identity() { return __int_as_float(0xff800000); }
  static __device__ __forceinline__ float combine(float a, float b) { return fmaxf(a, b); }
};

constexpr unsigned kFullWarp = 0xffffffffu;  // every lane of the warp takes part in the shuffle

// Butterfly over the 32 lanes: afterwards every lane holds the warp's result. All 32 lanes must
// be active and converged here; the full mask says so (a lane missing from the mask, or an
// inactive lane named in it, is undefined behaviour).
template <class Op>
__device__ __forceinline__ float warp_reduce(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = Op::combine(v, __shfl_xor_sync(kFullWarp, v, offset));
  return v;
}

// Block of kBlock threads -> one value, valid in warp 0 (thread 0 stores it). Warp results go
// through kBlock/32 shared floats. Every thread of the block must call it (it holds a barrier);
// a second call needs a barrier in between, because warp 0 reads warp_sums after this one.
template <class Op, int kBlock>
__device__ __forceinline__ float block_reduce(float v, float* warp_sums /* [kBlock/32] */) {
  static_assert(kBlock % 32 == 0 && kBlock <= 1024, "whole warps, at most 32 of them");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_reduce<Op>(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();  // outside every branch: all kBlock threads reach it
  v = Op::identity();
  if (warp == 0) {  // warp-uniform branch: all 32 lanes of warp 0 enter, so the full mask holds
    v = lane < kBlock / 32 ? warp_sums[lane] : Op::identity();
    v = warp_reduce<Op>(v);
  }
  return v;
}

// ---- 1: interleaved addressing -----------------------------------------------------------------
// x: [n], out: [ceil(n / kBlock)] one partial per block.
template <class Op, int kBlock>
__global__ void __launch_bounds__(kBlock) reduce_interleaved(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  __shared__ float sm[kBlock];
  const int tid = threadIdx.x;
  const int64_t i = int64_t(blockIdx.x) * kBlock + tid;
  sm[tid] = i < n ? x[i] : Op::identity();  // lanes past the end hold the identity
  __syncthreads();
  for (int s = 1; s < kBlock; s *= 2) {
    // tid % 2s == 0: active lanes are 2s apart, so every warp keeps a few active lanes (divergent)
    // until s >= 32, and the `%` costs several instructions.
    if (tid % (2 * s) == 0) sm[tid] = Op::combine(sm[tid], sm[tid + s]);
    __syncthreads();  // after the `if`, never inside it
  }
  if (tid == 0) out[blockIdx.x] = sm[0];
}

// ---- 2: sequential addressing ------------------------------------------------------------------
// x: [n], out: [ceil(n / kBlock)].
template <class Op, int kBlock>
__global__ void __launch_bounds__(kBlock) reduce_sequential(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  __shared__ float sm[kBlock];
  const int tid = threadIdx.x;
  const int64_t i = int64_t(blockIdx.x) * kBlock + tid;
  sm[tid] = i < n ? x[i] : Op::identity();
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    // Lanes 0..s-1 are active: whole warps are either all in or all out while s >= 32, and lane l
    // reads word tid + s -> bank (tid + s) % 32, 32 different banks: no conflict.
    if (tid < s) sm[tid] = Op::combine(sm[tid], sm[tid + s]);
    __syncthreads();
  }
  if (tid == 0) out[blockIdx.x] = sm[0];
}

// ---- 3: first combine during the load ----------------------------------------------------------
// x: [n], out: [ceil(n / (2 kBlock))].
template <class Op, int kBlock>
__global__ void __launch_bounds__(kBlock) reduce_first_add(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  __shared__ float sm[kBlock];
  const int tid = threadIdx.x;
  const int64_t i = int64_t(blockIdx.x) * (2 * kBlock) + tid;
  float v = i < n ? x[i] : Op::identity();
  if (i + kBlock < n) v = Op::combine(v, x[i + kBlock]);  // both loads coalesced, 2 in flight
  sm[tid] = v;
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (tid < s) sm[tid] = Op::combine(sm[tid], sm[tid + s]);
    __syncthreads();
  }
  if (tid == 0) out[blockIdx.x] = sm[0];
}

// ---- 4: warp-shuffle tail ----------------------------------------------------------------------
// x: [n], out: [ceil(n / (2 kBlock))].
template <class Op, int kBlock>
__global__ void __launch_bounds__(kBlock) reduce_warp_shuffle(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  static_assert(kBlock >= 64, "the tail starts from 64 values");
  __shared__ float sm[kBlock];
  const int tid = threadIdx.x;
  const int64_t i = int64_t(blockIdx.x) * (2 * kBlock) + tid;
  float v = i < n ? x[i] : Op::identity();
  if (i + kBlock < n) v = Op::combine(v, x[i + kBlock]);
  sm[tid] = v;
  __syncthreads();
  for (int s = kBlock / 2; s > 32; s >>= 1) {  // shared-memory levels down to 64 values
    if (tid < s) sm[tid] = Op::combine(sm[tid], sm[tid + s]);
    __syncthreads();
  }
  if (tid < 32) {  // exactly warp 0, all of it: the shuffles' full mask is true
    v = warp_reduce<Op>(Op::combine(sm[tid], sm[tid + 32]));
    if (tid == 0) out[blockIdx.x] = v;
  }
}

// ---- 5: 16-byte loads, several per thread, grid-stride -----------------------------------------
// One thread's partial over its grid-stride share of x[0, n). x only needs 4-byte alignment: the
// first `head` (< 4) elements up to the next 16-byte boundary and the last (n - head) % 4 are
// scalar loads; everything between is float4 loads, kUnroll of them issued before the first use
// (kUnroll x 16 bytes in flight per thread; HBM wants tens of KB in flight per SM).
template <class Op, int kBlock, int kUnroll>
__device__ __forceinline__ float thread_partial_vec4(const float* __restrict__ x, int64_t n) {
  const int64_t tid = int64_t(blockIdx.x) * kBlock + threadIdx.x;
  const int64_t nthreads = int64_t(gridDim.x) * kBlock;
  const int misalign = int((reinterpret_cast<unsigned long long>(x) >> 2) & 3);  // floats past a 16 B boundary
  const int64_t head = misalign == 0 ? 0 : (4 - misalign < n ? 4 - misalign : n);
  const int64_t n4 = (n - head) / 4;  // whole float4 groups after the head
  const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x + head);
  const float id = Op::identity();

  float4 acc[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) acc[u] = make_float4(id, id, id, id);
  int64_t j = tid;
  // Main loop: all kUnroll groups in range, no bounds checks between the loads.
  for (; j + (kUnroll - 1) * nthreads < n4; j += kUnroll * nthreads) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = x4[j + u * nthreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      acc[u].x = Op::combine(acc[u].x, v[u].x);
      acc[u].y = Op::combine(acc[u].y, v[u].y);
      acc[u].z = Op::combine(acc[u].z, v[u].z);
      acc[u].w = Op::combine(acc[u].w, v[u].w);
    }
  }
  for (; j < n4; j += nthreads) {  // fewer than kUnroll groups left for this thread
    const float4 v = x4[j];
    acc[0].x = Op::combine(acc[0].x, v.x);
    acc[0].y = Op::combine(acc[0].y, v.y);
    acc[0].z = Op::combine(acc[0].z, v.z);
    acc[0].w = Op::combine(acc[0].w, v.w);
  }
  float r = tid < head ? x[tid] : id;                      // scalar head (< 4 elements)
  const int64_t t = head + 4 * n4 + tid;                   // scalar tail (< 4 elements)
  if (t < n) r = Op::combine(r, x[t]);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    r = Op::combine(r, Op::combine(Op::combine(acc[u].x, acc[u].y), Op::combine(acc[u].z, acc[u].w)));
  return r;
}

// x: [n] (4-byte aligned), out: [gridDim.x] one partial per block. With gridDim.x == 1 it is the
// final pass (pass 2 of the two-launch reduction) and out[0] is the result.
template <class Op, int kBlock, int kUnroll>
__global__ void __launch_bounds__(kBlock) reduce_vec4(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  __shared__ float warp_sums[kBlock / 32];
  const float v = block_reduce<Op, kBlock>(thread_partial_vec4<Op, kBlock, kUnroll>(x, n), warp_sums);
  if (threadIdx.x == 0) out[blockIdx.x] = v;
}

// ---- 6: one launch, last-block-done counter ----------------------------------------------------
// x: [n]; out: [1]; partials: [gridDim.x] workspace; counter: [1], 0 before the launch and 0
// again after it. One counter per stream: two launches sharing a counter concurrently would mix
// their tickets.
template <class Op, int kBlock, int kUnroll>
__global__ void __launch_bounds__(kBlock) reduce_vec4_onepass(const float* __restrict__ x, float* __restrict__ out,
                                                             float* __restrict__ partials, unsigned int* __restrict__ counter,
                                                             int64_t n) {
  __shared__ float warp_sums[kBlock / 32];
  __shared__ bool is_last;
  const float v = block_reduce<Op, kBlock>(thread_partial_vec4<Op, kBlock, kUnroll>(x, n), warp_sums);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = v;
    __threadfence();  // release: the partial is visible device-wide before the ticket is drawn
    // atomicInc stores (old >= bound) ? 0 : old + 1: the last block (old == gridDim.x - 1) both
    // learns it is last and resets the counter.
    const unsigned int ticket = atomicInc(counter, gridDim.x - 1);
    is_last = ticket == gridDim.x - 1;
  }
  __syncthreads();  // broadcasts is_last; also separates the two uses of warp_sums
  if (is_last) {    // block-uniform condition: the barrier in block_reduce is reached by all threads
    __threadfence();  // acquire: order the partial reads after the ticket
    float p = Op::identity();
    for (int i = threadIdx.x; i < int(gridDim.x); i += kBlock) p = Op::combine(p, __ldcg(partials + i));  // from L2
    p = block_reduce<Op, kBlock>(p, warp_sums);
    if (threadIdx.x == 0) out[0] = p;
  }
}

// ==== deliberately broken versions =============================================================
// Each is reduce_sequential with one mistake; the comment marked BUG says which.

template <class Op, int kBlock>
__global__ void __launch_bounds__(kBlock) reduce_bug_barrier_in_branch(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  __shared__ float sm[kBlock];
  const int tid = threadIdx.x;
  const int64_t i = int64_t(blockIdx.x) * kBlock + tid;
  sm[tid] = i < n ? x[i] : Op::identity();
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (tid < s) {
      sm[tid] = Op::combine(sm[tid], sm[tid + s]);
      __syncthreads();  // BUG: inside the divergent branch; threads tid >= s never arrive here
    }
  }
  __syncthreads();  // "the tree is done": threads that left the loop early wait here instead, so
                    // one barrier generation is completed by arrivals at two different barriers
  if (tid == 0) out[blockIdx.x] = sm[0];
}

template <class Op, int kBlock>
__global__ void __launch_bounds__(kBlock) reduce_bug_missing_barrier(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  __shared__ float sm[kBlock];
  const int tid = threadIdx.x;
  const int64_t i = int64_t(blockIdx.x) * kBlock + tid;
  sm[tid] = i < n ? x[i] : Op::identity();
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (tid < s) sm[tid] = Op::combine(sm[tid], sm[tid + s]);
    // BUG: no __syncthreads() here: the next level reads sm[tid + s/2], written in this level by
    // a thread of another warp that may not have run yet.
  }
  if (tid == 0) out[blockIdx.x] = sm[0];
}

template <class Op, int kBlock>
__global__ void __launch_bounds__(kBlock) reduce_bug_oob_store(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  __shared__ float sm[kBlock];
  const int tid = threadIdx.x;
  const int64_t i = int64_t(blockIdx.x) * kBlock + tid;
  sm[tid] = i < n ? x[i] : Op::identity();
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (tid < s) sm[tid] = Op::combine(sm[tid], sm[tid + s]);
    __syncthreads();
  }
  if (tid == 0) out[blockIdx.x + 1] = sm[0];  // BUG: 1-based slot; block gridDim.x-1 writes out[gridDim.x]
}

template <class Op, int kBlock>
__global__ void __launch_bounds__(kBlock) reduce_bug_uninit_shared(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  __shared__ float sm[kBlock];
  const int tid = threadIdx.x;
  const int64_t i = int64_t(blockIdx.x) * kBlock + tid;
  if (i < n) sm[tid] = x[i];  // BUG: lanes past the end leave sm[tid] as whatever was there
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (tid < s) sm[tid] = Op::combine(sm[tid], sm[tid + s]);
    __syncthreads();
  }
  if (tid == 0) out[blockIdx.x] = sm[0];
}

// partials: [kBlock] (padded), of which pass 1 wrote the first `count`; out: [1].
template <class Op, int kBlock>
__global__ void __launch_bounds__(kBlock) reduce_bug_final_reads_all(const float* __restrict__ partials, float* __restrict__ out, int64_t count) {
  __shared__ float sm[kBlock];
  const int tid = threadIdx.x;
  sm[tid] = partials[tid];  // BUG: should be tid < count ? partials[tid] : identity
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (tid < s) sm[tid] = Op::combine(sm[tid], sm[tid + s]);
    __syncthreads();
  }
  if (tid == 0) out[0] = sm[0];
}
