// Times the extend kernels of a variant of extend_attention_sm90.cuh (see README.md): one request of
// 4096 new tokens, causal, 32 q / 32 kv heads, head_dim 128, bf16 (bench/attention_bench.py's
// shape). Prints TFLOP/s and a checksum of the output.
#include <cstdio>
#include <vector>
#include "radixserve/attention_launch.cuh"
#include "sweep_common.cuh"
using namespace radixserve::attn;
// the inputs: sweep_common.cuh's uniform values, or standard normal ones with -DNORMAL
__global__ void gen_input(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const uint32_t h = sweep_hash(i, seed);
#ifdef NORMAL
    uint32_t h2 = h * 0x9E3779B1u ^ 0x85EBCA6Bu; h2 ^= h2 >> 16;
    const float u1 = ((h >> 8) + 1) * (1.f / 16777217.f), u2 = (h2 >> 8) * (1.f / 16777216.f);
    x[i] = __float2bfloat16(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
#else
    x[i] = __float2bfloat16(((h & 0xffff) / 65536.f - 0.5f) * 3.f);
#endif
  }
}
int main() {
  const int S = 4096, H = 32, D = 128;
  __nv_bfloat16 *q, *k, *v, *o; int32_t *qo, *kv, *idx;
  CK(cudaMalloc(&q, (size_t)S * H * D * 2)); CK(cudaMalloc(&k, (size_t)(S + 1) * H * D * 2));
  CK(cudaMalloc(&v, (size_t)(S + 1) * H * D * 2)); CK(cudaMalloc(&o, (size_t)S * H * D * 2));
  gen_input<<<1024, 256>>>(q, (int64_t)S * H * D, 1); gen_input<<<1024, 256>>>(k, (int64_t)(S + 1) * H * D, 2); gen_input<<<1024, 256>>>(v, (int64_t)(S + 1) * H * D, 3);
  std::vector<int32_t> hind(S); for (int i = 0; i < S; ++i) hind[i] = i + 1;
  int32_t hptr[2] = {0, S};
  CK(cudaMalloc(&qo, 8)); CK(cudaMalloc(&kv, 8)); CK(cudaMalloc(&idx, S * 4));
  CK(cudaMemcpy(qo, hptr, 8, cudaMemcpyHostToDevice)); CK(cudaMemcpy(kv, hptr, 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(idx, hind.data(), S * 4, cudaMemcpyHostToDevice));
  ExtendParams p{};
  p.q = q; p.k = k; p.v = v; p.out = o; p.qo_indptr = qo; p.kv_indptr = kv; p.kv_indices = idx;
  p.q_stride_t = H * D; p.q_stride_h = D; p.kv_stride_slot = H * D; p.kv_stride_h = D;
  p.batch = 1; p.num_q_heads = H; p.group = 1; p.scale_log2 = 1.4426950408889634f / sqrtf((float)D);
  int* work; CK(cudaMalloc(&work, 8)); CK(cudaMemset(work, 0, 8)); p.work_counters = work;   // left zero
  p.num_slots = S + 1;
  CK(cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, 0));
  for (int wg = 1; wg >= 0; --wg) {
    auto launch = [&] { CK((launch_paged_extend<__nv_bfloat16, D>(p, S, wg == 1, 0))); };
    for (int i = 0; i < 3; ++i) launch();
    CK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    cudaEventRecord(e0); for (int i = 0; i < 20; ++i) launch(); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
    float ms; cudaEventElapsedTime(&ms, e0, e1); ms /= 20;
    std::vector<uint16_t> h((size_t)S * H * D); CK(cudaMemcpy(h.data(), o, h.size() * 2, cudaMemcpyDeviceToHost));
    double cs = 0; for (size_t i = 0; i < h.size(); i += 7) { uint32_t u = (uint32_t)h[i] << 16; float f; memcpy(&f, &u, 4); cs += f; }
    const double flops = 4.0 * S * (double)S * D * H / 2;
    printf("%-10s %-8s %8.1f us  %6.1f TFLOP/s  checksum %.6f\n", VARIANT, wg ? "wgmma" : "mma", ms * 1e3, flops / (ms * 1e-3) / 1e12, cs);
  }
  return 0;
}
