// Test kernel for the runtime: copies n floats through dynamic shared memory (exercises the
// > 48 KB opt-in). One block; n <= dynamic shared memory / 4.
__global__ void smem_roundtrip(const float* __restrict__ in, float* __restrict__ out, int n) {
  extern __shared__ float buffer[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) buffer[i] = in[i];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = buffer[n - 1 - i];
}
