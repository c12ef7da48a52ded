// The reduction lab (labs/csrc/reduction.cu, versions 5 and 6) ported to HIP, with the subgroup
// width as a template parameter instead of the constant 32 the CUDA version bakes in.
//
//   kWave = 64: AMD CDNA (gfx90a MI200, gfx942 MI300): wavefronts of 64 lanes.
//   kWave = 32: NVIDIA warps; AMD RDNA (gfx10xx/gfx11xx) in wave32 mode.
// The host reads the device's width (hipDeviceProp_t::warpSize) and launches the matching
// instantiation; a kernel built for the wrong width refuses to run rather than compute garbage
// (a kWave=32 butterfly on a 64-lane wavefront would combine only half of it).
//
// Build (compile only where no AMD GPU exists): labs/hip/build.sh. Run on a GPU:
//   ./build/reduction_hip [n]   -> validates sum and max at n = 1, 31, 32, 33, 1003, 64 Mi
//                                  and prints bandwidth of the two-launch and one-launch versions.
//
// What changed from the CUDA source, and why (docs/labs/portability.md has the full list):
// - warp_reduce loops over log2(kWave) butterfly steps, not 5.
// - Shuffles: CUDA's __shfl_xor_sync(mask, v, lane) names the participating lanes with a 32-bit
//   mask; HIP (ROCm 5.x) has __shfl_xor(v, lane, width) without a mask: every lane of the
//   wavefront must be active, which the callers guarantee (warp-uniform branches only).
// - The block combine keeps one shared slot per wavefront (kBlock / kWave), and the final
//   wavefront-level pass needs kBlock / kWave <= kWave.
// - Memory model: __threadfence() + atomicInc for the last-block-done counter exist in HIP with
//   the same meaning (device-scope fence, wrapping increment); __ldcg (L2-only load) does not,
//   so the last block reads the partials through a volatile pointer instead.
#include <hip/hip_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

struct SumOp {
  static __device__ __forceinline__ float identity() { return 0.0f; }
  static __device__ __forceinline__ float combine(float a, float b) { return a + b; }
};
struct MaxOp {
  static __device__ __forceinline__ float identity() { return -INFINITY; }
  static __device__ __forceinline__ float combine(float a, float b) { return fmaxf(a, b); }
};

// Butterfly over the kWave lanes of one wavefront; every lane ends with the result. All kWave
// lanes must be active (no mask to say otherwise in HIP's __shfl_xor).
template <class Op, int kWave>
__device__ __forceinline__ float wave_reduce(float v) {
  static_assert(kWave == 32 || kWave == 64, "subgroup width is 32 or 64");
#pragma unroll
  for (int offset = kWave / 2; offset > 0; offset >>= 1) v = Op::combine(v, __shfl_xor(v, offset, kWave));
  return v;
}

template <class Op, int kBlock, int kWave>
__device__ __forceinline__ float block_reduce(float v, float* wave_sums /* [kBlock / kWave] */) {
  static_assert(kBlock % kWave == 0 && kBlock / kWave <= kWave, "whole wavefronts; their count fits one wavefront");
  const int lane = threadIdx.x % kWave, wave = threadIdx.x / kWave;
  v = wave_reduce<Op, kWave>(v);
  if (lane == 0) wave_sums[wave] = v;
  __syncthreads();  // reached by every thread of the block
  v = Op::identity();
  if (wave == 0) {  // wavefront-uniform branch: all lanes of wavefront 0 enter
    v = lane < kBlock / kWave ? wave_sums[lane] : Op::identity();
    v = wave_reduce<Op, kWave>(v);
  }
  return v;
}

// Grid-stride float4 loads, kUnroll in flight per thread (same as thread_partial_vec4 in CUDA).
template <class Op, int kBlock, int kUnroll>
__device__ __forceinline__ float thread_partial_vec4(const float* __restrict__ x, int64_t n) {
  const int64_t tid = int64_t(blockIdx.x) * kBlock + threadIdx.x;
  const int64_t nthreads = int64_t(gridDim.x) * kBlock;
  const int misalign = int((reinterpret_cast<uintptr_t>(x) >> 2) & 3);
  const int64_t head = misalign == 0 ? 0 : (4 - misalign < n ? 4 - misalign : n);
  const int64_t n4 = (n - head) / 4;
  const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x + head);
  const float id = Op::identity();
  float4 acc[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) acc[u] = make_float4(id, id, id, id);
  int64_t j = tid;
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
  for (; j < n4; j += nthreads) {
    const float4 v = x4[j];
    acc[0].x = Op::combine(acc[0].x, v.x);
    acc[0].y = Op::combine(acc[0].y, v.y);
    acc[0].z = Op::combine(acc[0].z, v.z);
    acc[0].w = Op::combine(acc[0].w, v.w);
  }
  float r = tid < head ? x[tid] : id;
  const int64_t t = head + 4 * n4 + tid;
  if (t < n) r = Op::combine(r, x[t]);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    r = Op::combine(r, Op::combine(Op::combine(acc[u].x, acc[u].y), Op::combine(acc[u].z, acc[u].w)));
  return r;
}

// x: [n], out: [gridDim.x]. *wave_mismatch is set when the device's wavefront is not kWave.
template <class Op, int kBlock, int kUnroll, int kWave>
__global__ void __launch_bounds__(kBlock) reduce_vec4(const float* __restrict__ x, float* __restrict__ out, int64_t n,
                                                     int* __restrict__ wave_mismatch) {
  if (warpSize != kWave) {  // uniform over the grid: every thread returns, no barrier is skipped
    if (threadIdx.x == 0 && blockIdx.x == 0) *wave_mismatch = warpSize;
    return;
  }
  __shared__ float wave_sums[kBlock / kWave];
  const float v = block_reduce<Op, kBlock, kWave>(thread_partial_vec4<Op, kBlock, kUnroll>(x, n), wave_sums);
  if (threadIdx.x == 0) out[blockIdx.x] = v;
}

// One launch, last-block-done counter (see reduction.cu version 6). counter: 0 before and after.
template <class Op, int kBlock, int kUnroll, int kWave>
__global__ void __launch_bounds__(kBlock) reduce_vec4_onepass(const float* __restrict__ x, float* __restrict__ out,
                                                             float* __restrict__ partials, unsigned int* __restrict__ counter,
                                                             int64_t n, int* __restrict__ wave_mismatch) {
  if (warpSize != kWave) {
    if (threadIdx.x == 0 && blockIdx.x == 0) *wave_mismatch = warpSize;
    return;
  }
  __shared__ float wave_sums[kBlock / kWave];
  __shared__ bool is_last;
  const float v = block_reduce<Op, kBlock, kWave>(thread_partial_vec4<Op, kBlock, kUnroll>(x, n), wave_sums);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = v;
    __threadfence();
    is_last = atomicInc(counter, gridDim.x - 1) == gridDim.x - 1;
  }
  __syncthreads();
  if (is_last) {
    __threadfence();
    const volatile float* p = partials;  // no stale cached copy (HIP has no __ldcg)
    float acc = Op::identity();
    for (int i = threadIdx.x; i < int(gridDim.x); i += kBlock) acc = Op::combine(acc, p[i]);
    acc = block_reduce<Op, kBlock, kWave>(acc, wave_sums);
    if (threadIdx.x == 0) out[0] = acc;
  }
}

// ---- host -------------------------------------------------------------------------------------
#define HIP_CHECK(expr)                                                                        \
  do {                                                                                         \
    hipError_t err_ = (expr);                                                                  \
    if (err_ != hipSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, hipGetErrorString(err_)); \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)

constexpr int kBlock = 256, kUnroll = 4;

struct Device {
  int sms = 0, wave = 0;
  float* partials = nullptr;
  unsigned int* counter = nullptr;
  int* mismatch = nullptr;
  float* out = nullptr;
  int max_grid = 0;
};

template <class Op, int kWave>
float reduce_twopass(Device& d, const float* x, int64_t n) {
  const int64_t wanted = (n + int64_t(kBlock) * 4 * kUnroll - 1) / (int64_t(kBlock) * 4 * kUnroll);
  const int grid = int(wanted < 1 ? 1 : (wanted > d.max_grid ? d.max_grid : wanted));
  hipLaunchKernelGGL((reduce_vec4<Op, kBlock, kUnroll, kWave>), dim3(grid), dim3(kBlock), 0, 0, x, d.partials, n, d.mismatch);
  hipLaunchKernelGGL((reduce_vec4<Op, kBlock, kUnroll, kWave>), dim3(1), dim3(kBlock), 0, 0, d.partials, d.out, int64_t(grid), d.mismatch);
  float r;
  HIP_CHECK(hipMemcpy(&r, d.out, sizeof r, hipMemcpyDeviceToHost));
  return r;
}

template <class Op, int kWave>
float reduce_onepass(Device& d, const float* x, int64_t n) {
  const int64_t wanted = (n + int64_t(kBlock) * 4 * kUnroll - 1) / (int64_t(kBlock) * 4 * kUnroll);
  const int grid = int(wanted < 1 ? 1 : (wanted > d.max_grid ? d.max_grid : wanted));
  hipLaunchKernelGGL((reduce_vec4_onepass<Op, kBlock, kUnroll, kWave>), dim3(grid), dim3(kBlock), 0, 0, x, d.out, d.partials,
                     d.counter, n, d.mismatch);
  float r;
  HIP_CHECK(hipMemcpy(&r, d.out, sizeof r, hipMemcpyDeviceToHost));
  return r;
}

// The width is a run-time fact of the device; the kernels need it at compile time.
template <class Op>
float reduce(Device& d, const float* x, int64_t n, bool onepass) {
  if (d.wave == 64) return onepass ? reduce_onepass<Op, 64>(d, x, n) : reduce_twopass<Op, 64>(d, x, n);
  if (d.wave == 32) return onepass ? reduce_onepass<Op, 32>(d, x, n) : reduce_twopass<Op, 32>(d, x, n);
  std::fprintf(stderr, "unsupported subgroup width %d\n", d.wave);
  std::exit(2);
}

int main(int argc, char** argv) {
  const int64_t big = argc > 1 ? std::atoll(argv[1]) : (int64_t(1) << 26);
  hipDeviceProp_t prop;
  HIP_CHECK(hipGetDeviceProperties(&prop, 0));
  Device d;
  d.sms = prop.multiProcessorCount;
  d.wave = prop.warpSize;
  d.max_grid = d.sms * 8;
  std::printf("device: %s, %d compute units, subgroup width %d\n", prop.name, d.sms, d.wave);
  HIP_CHECK(hipMalloc(&d.partials, sizeof(float) * d.max_grid));
  HIP_CHECK(hipMalloc(&d.out, sizeof(float)));
  HIP_CHECK(hipMalloc(&d.counter, sizeof(unsigned int)));
  HIP_CHECK(hipMalloc(&d.mismatch, sizeof(int)));
  HIP_CHECK(hipMemset(d.counter, 0, sizeof(unsigned int)));
  HIP_CHECK(hipMemset(d.mismatch, 0, sizeof(int)));

  int failures = 0;
  std::srand(12345);
  for (int64_t n : {int64_t(1), int64_t(31), int64_t(32), int64_t(33), int64_t(1003), big}) {
    std::vector<float> h(n);
    double ref_sum = 0;
    float ref_max = -INFINITY;
    for (auto& v : h) {
      v = float(double(std::rand()) / RAND_MAX * 2.0 - 0.5);  // mean 0.5: the sum is far from 0
      ref_sum += v;
      ref_max = std::fmax(ref_max, v);
    }
    float* x;
    HIP_CHECK(hipMalloc(&x, sizeof(float) * n));
    HIP_CHECK(hipMemcpy(x, h.data(), sizeof(float) * n, hipMemcpyHostToDevice));
    for (bool onepass : {false, true}) {
      const float s = reduce<SumOp>(d, x, n, onepass);
      const float m = reduce<MaxOp>(d, x, n, onepass);
      const double rel = std::fabs(s - ref_sum) / std::fabs(ref_sum);
      const bool ok = rel <= (n <= 4096 ? 2e-6 : 1e-4) && m == ref_max;
      failures += !ok;
      std::printf("n=%-10lld %s  sum rel err %.2e  max %s  %s\n", (long long)n, onepass ? "one-launch" : "two-launch", rel,
                  m == ref_max ? "exact" : "DIFF", ok ? "ok" : "WRONG");
    }
    if (n == big) {  // bandwidth of the one-launch version
      hipEvent_t a, b;
      HIP_CHECK(hipEventCreate(&a));
      HIP_CHECK(hipEventCreate(&b));
      float best = 1e30f;
      for (int rep = 0; rep < 10; ++rep) {
        HIP_CHECK(hipEventRecord(a));
        reduce<SumOp>(d, x, n, true);
        HIP_CHECK(hipEventRecord(b));
        HIP_CHECK(hipEventSynchronize(b));
        float ms;
        HIP_CHECK(hipEventElapsedTime(&ms, a, b));
        best = ms < best ? ms : best;
      }
      std::printf("one-launch sum, n=%lld: %.3f ms (min of 10, includes the 4-byte copy back), %.3f TB/s\n",
                  (long long)n, best, 4.0 * n / (best * 1e-3) / 1e12);
    }
    HIP_CHECK(hipFree(x));
  }
  int mismatch = 0;
  HIP_CHECK(hipMemcpy(&mismatch, d.mismatch, sizeof mismatch, hipMemcpyDeviceToHost));
  if (mismatch) {
    std::printf("a kernel was built for another subgroup width than the device's %d\n", mismatch);
    failures++;
  }
  std::printf("%s\n", failures ? "FAILED" : "all ok");
  return failures ? 1 : 0;
}
