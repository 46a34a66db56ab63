// What the sweeps in this folder share (see README.md): the error check, the hash that fills
// their inputs, and the device-to-device copy bandwidth their fractions are taken against,
// measured in the same process. Included by path from beside the sweep sources.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(2);} } while (0)

// A 32-bit hash of element i under seed: the sweeps' deterministic "random" inputs.
__device__ __forceinline__ uint32_t sweep_hash(int64_t i, uint32_t seed) {
  uint32_t h = (uint32_t)i * 2654435761u ^ seed;
  h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
  return h;
}

// x[i] uniform in [-scale / 2, scale / 2).
__global__ void gen(__nv_bfloat16* x, int64_t n, uint32_t seed, float scale = 3.f) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = __float2bfloat16(((sweep_hash(i, seed) & 0xffff) / 65536.f - 0.5f) * scale);
}

__global__ void copy_kernel(const float4* a, float4* b, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) b[i] = a[i];
}

// Bytes per second (read + write) of 10 copies of 1 GiB on stream st, after one warm-up copy.
inline double copy_bandwidth(cudaStream_t st) {
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  float4 *ca, *cb; const int64_t cn = (1ll << 30) / 16;
  CK(cudaMalloc(&ca, cn * 16)); CK(cudaMalloc(&cb, cn * 16));
  copy_kernel<<<sms * 8, 512, 0, st>>>(ca, cb, cn);
  CK(cudaEventRecord(e0, st));
  for (int i = 0; i < 10; ++i) copy_kernel<<<sms * 8, 512, 0, st>>>(ca, cb, cn);
  CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
  float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaFree(ca)); CK(cudaFree(cb)); CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
  return 2.0 * cn * 16 * 10 / (ms * 1e-3);
}

// B requests of L KV tokens each, over `layers` layers of consecutive slots (slot 0 unused, as
// in the server's pool): kv_indptr [B + 1] and kv_indices [layers * B * L] on the device,
// layer i's indices at *idx + i * B * L.
inline void contiguous_pages(int B, int L, int layers, int32_t** ptr, int32_t** idx) {
  const int64_t nnz = (int64_t)B * L;
  std::vector<int32_t> hptr(B + 1), hidx(nnz * layers);
  for (int b = 0; b <= B; ++b) hptr[b] = b * L;
  for (int64_t i = 0; i < nnz * layers; ++i) hidx[i] = (int32_t)(i + 1);
  CK(cudaMalloc(ptr, (B + 1) * 4)); CK(cudaMalloc(idx, nnz * layers * 4));
  CK(cudaMemcpy(*ptr, hptr.data(), (B + 1) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(*idx, hidx.data(), nnz * layers * 4, cudaMemcpyHostToDevice));
}
