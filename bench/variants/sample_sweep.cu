// Times a variant of sampling.cuh (see README.md) on batch 256 x vocab 128256 fp32 logits (normal, std 3) with a
// ~75% bitmask on every row, against a one-read reduction kernel in the same run.
#include <cstdio>
#include <vector>
#include <random>
#include "radixserve/sampling.cuh"
#include "sweep_common.cuh"
using namespace radixserve::sampling;

__global__ void gen_logits(float* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t c[4] = {(uint32_t)i, (uint32_t)(i >> 32), 1u, 2u};
    philox4x32_10(seed, 7u, c);
    float u1 = (c[0] >> 8) * (1.f / 16777216.f) + 1e-7f, u2 = (c[1] >> 8) * (1.f / 16777216.f);
    x[i] = 3.f * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
  }
}
__global__ void genmask(int32_t* m, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t c[4] = {(uint32_t)i, 5u, 1u, 2u};
    philox4x32_10(99u, 3u, c);
    m[i] = (int32_t)(c[0] | c[1]);
  }
}
__global__ void boost(float* x, int64_t V, int64_t first) {
  for (int64_t i = first + threadIdx.x * 4001; i < V; i += 64 * 4001) x[blockIdx.x * V + i] += 20.f;
}
// one read: each block sums rows' tiles (grid-stride), atomically adds to out
__global__ void read_sum(const float4* x, int64_t n4, float* out) {
  float s = 0.f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4; i += (int64_t)gridDim.x * blockDim.x) {
    float4 v = x[i]; s += v.x + v.y + v.z + v.w;
  }
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, s);
}

int main() {
  const int B = 256; const int64_t V = 128256; const int64_t W = (V + 31) / 32;
  float* logits; int32_t* mask; float *temp, *topp, *minp, *outlp, *acc; int32_t* topk; int64_t *seeds, *offs, *ids;
  CK(cudaMalloc(&logits, B * V * 4)); CK(cudaMalloc(&mask, B * W * 4));
  CK(cudaMalloc(&temp, B * 4)); CK(cudaMalloc(&topp, B * 4)); CK(cudaMalloc(&minp, B * 4)); CK(cudaMalloc(&topk, B * 4));
  CK(cudaMalloc(&seeds, B * 8)); CK(cudaMalloc(&offs, B * 8)); CK(cudaMalloc(&ids, B * 8)); CK(cudaMalloc(&outlp, B * 4)); CK(cudaMalloc(&acc, 4));
  gen_logits<<<1024, 256>>>(logits, B * V, 1234u); genmask<<<256, 256>>>(mask, B * W);
  std::vector<int64_t> hs(B), ho(B, 0); for (int i = 0; i < B; ++i) hs[i] = i;
  CK(cudaMemcpy(seeds, hs.data(), B * 8, cudaMemcpyHostToDevice)); CK(cudaMemcpy(offs, ho.data(), B * 8, cudaMemcpyHostToDevice));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  auto timeit = [&](auto fn) { for (int i = 0; i < 5; ++i) fn(); CK(cudaDeviceSynchronize());
    cudaEventRecord(e0); for (int i = 0; i < 50; ++i) fn(); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
    float ms; cudaEventElapsedTime(&ms, e0, e1); return ms * 1000.f / 50; };
  float read_us = timeit([&] { read_sum<<<132 * 8, 512>>>((const float4*)logits, B * V / 4, acc); });
  struct Cfg { const char* name; float t; int k; float p; float mp; int pk = 0; };  // pk: 1 peaked, 2 late
  float* peaked; CK(cudaMalloc(&peaked, B * V * 4)); CK(cudaMemcpy(peaked, logits, B * V * 4, cudaMemcpyDeviceToDevice));
  boost<<<B, 64>>>(peaked, V, 0);
  // peaked rows whose boosted tokens all lie past the first tile (a language model's nucleus is
  // rarely among token ids 0..8191): the two-pass top-p's first-tile test sees a flat tile
  float* late; CK(cudaMalloc(&late, B * V * 4)); CK(cudaMemcpy(late, logits, B * V * 4, cudaMemcpyDeviceToDevice));
  boost<<<B, 64>>>(late, V, 8192);
  Cfg cfgs[] = {{"target k50 p0.9", 1.f, 50, 0.9f, 0.f}, {"k50 p0.9 t0.7", 0.7f, 50, 0.9f, 0.f}, {"k50", 1.f, 50, 1.f, 0.f}, {"k1000 p0.9", 1.f, 1000, 0.9f, 0.f}, {"greedy", 0.f, 0, 1.f, 0.f}, {"plain", 1.f, 0, 1.f, 0.f}, {"plain t0.7", 0.7f, 0, 1.f, 0.f},
                {"k256", 1.f, 256, 1.f, 0.f}, {"k300", 1.f, 300, 1.f, 0.f}, {"k600", 1.f, 600, 1.f, 0.f}, {"p0.9", 1.f, 0, 0.9f, 0.f}, {"minp0.05", 1.f, 0, 1.f, 0.05f},
                {"p0.9 peaked", 1.f, 0, 0.9f, 0.f, true}, {"minp peaked", 1.f, 0, 1.f, 0.05f, true}, {"k50p.9 peaked", 1.f, 50, 0.9f, 0.f, true},
                {"p0.9 late peak", 1.f, 0, 0.9f, 0.f, 2}, {"p0.95 t0.7", 0.7f, 0, 0.95f, 0.f}};
  printf("%-10s read %.1f us\n", VARIANT, read_us);
  for (auto& c : cfgs) {
    std::vector<float> t(B, c.t), p(B, c.p), mp(B, c.mp); std::vector<int32_t> k(B, c.k);
    CK(cudaMemcpy(temp, t.data(), B * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(topp, p.data(), B * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(minp, mp.data(), B * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(topk, k.data(), B * 4, cudaMemcpyHostToDevice));
    SampleParams prm{c.pk == 2 ? late : c.pk ? peaked : logits, V, mask, W, temp, topk, topp, minp, seeds, offs, ids, outlp, B, V};
#ifdef DIAG
    unsigned int zero[8] = {0}; CK(cudaMemcpyToSymbol(g_diag, zero, sizeof zero));
#endif
    float us = timeit([&] { CK(launch_bitmask_sample<float>(prm, true, 0)); });
    std::vector<int64_t> h(B); CK(cudaMemcpy(h.data(), ids, B * 8, cudaMemcpyDeviceToHost));
    uint64_t cs = 0; for (int i = 0; i < B; ++i) cs = cs * 1000003u + (uint64_t)h[i];
    printf("%-10s %-16s %8.1f us  %5.2fx read  ids %016llx", VARIANT, c.name, us, us / read_us, (unsigned long long)cs);
#ifdef DIAG
    // a diagnostic variant's counters (make_variant --sub puts `__device__ unsigned g_diag[8]` and
    // atomicAdds into the header), per launch: 55 launches of B rows
    unsigned int d[8]; CK(cudaMemcpyFromSymbol(d, g_diag, sizeof d));
    printf("  diag"); for (unsigned int v : d) printf(" %.1f", v / 55.0);
#endif
    printf("\n");
  }
  return 0;
}
