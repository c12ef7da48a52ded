// Vector addition c = a + b (fp32): the first kernel through the whole tileattn path
// (NVRTC compile -> cubin cache -> load -> launch on torch's stream).
//
// Versions (python -m labs.vector_add validates each, then times it):
//   vector_add_scalar   one 4-byte load per operand per element, grid-stride loop. Any alignment.
//   vector_add_vec4<U>  16-byte loads (LDG.E.128) when a, b and c are 16-byte aligned; each thread
//                       issues U independent float4 loads per operand before the first add, so
//                       U x 32 bytes per thread are in flight (HBM needs ~tens of KB in flight
//                       per SM to reach its bandwidth). Elements past the last full float4 are
//                       the scalar tail, done by the first n % 4 threads.
// Bytes moved: 12 per element (2 reads + 1 write); no arithmetic to speak of, so the floor is
// 12 n / copy bandwidth (4.3 TB/s measured on the H200: 0.75 ms at n = 2^28).
#include <cuda/std/cstdint>

__global__ void vector_add_scalar(const float* __restrict__ a, const float* __restrict__ b,
                                  float* __restrict__ c, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    c[i] = a[i] + b[i];
  }
}

template <int kUnroll>
__global__ void vector_add_vec4(const float* __restrict__ a, const float* __restrict__ b,
                                float* __restrict__ c, int64_t n) {
  const int64_t n4 = n / 4;  // full float4 groups
  const float4* a4 = reinterpret_cast<const float4*>(a);
  const float4* b4 = reinterpret_cast<const float4*>(b);
  float4* c4 = reinterpret_cast<float4*>(c);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t base = tid; base < n4; base += stride * kUnroll) {
    float4 x[kUnroll], y[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll independent requests in flight
      const int64_t i = base + u * stride;
      if (i < n4) {
        x[u] = a4[i];
        y[u] = b4[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < n4) c4[i] = make_float4(x[u].x + y[u].x, x[u].y + y[u].y, x[u].z + y[u].z, x[u].w + y[u].w);
    }
  }
  const int64_t tail = n4 * 4 + tid;  // at most 3 elements
  if (tail < n) c[tail] = a[tail] + b[tail];
}
