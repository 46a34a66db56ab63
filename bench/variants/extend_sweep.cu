// Times the extend kernels of a variant of extend_attention_sm90.cuh (see README.md), head_dim 128,
// bf16, KV slots consecutive per request (whole tiles take the sm_90a kernel's TMA path):
//   (unlabelled) one request of 4096 new tokens, causal, 32 q / 32 kv heads (bench/attention_bench.py's shape);
//   4k-gqa4      the same with Llama-3.1-8B's 32 q / 8 kv heads (GQA group 4);
//   gqa-short    Llama-3.1-8B's heads, 32 requests of 64 new tokens after a cached prefix of 4032 each.
// Prints TFLOP/s (causal: a new token at position i of its request attends prefix + i + 1 keys, 4 D
// flops per (query, key) pair and q head) and a checksum of the output.
#include <cstdio>
#include <string>
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
// batch requests, each of `fresh` new tokens after `prefix` cached ones; request b's KV positions in
// slots 1 + b (prefix + fresh) ..
struct Shape { const char* label; int batch, prefix, fresh, hq, hkv; };
constexpr int D = 128;
void time_shape(const Shape& s) {
  const int kv_len = s.prefix + s.fresh, nq = s.batch * s.fresh;
  const int64_t slots = 1 + (int64_t)s.batch * kv_len;
  __nv_bfloat16 *q, *k, *v, *o; int32_t *qo, *kv, *idx;
  CK(cudaMalloc(&q, (size_t)nq * s.hq * D * 2)); CK(cudaMalloc(&k, (size_t)slots * s.hkv * D * 2));
  CK(cudaMalloc(&v, (size_t)slots * s.hkv * D * 2)); CK(cudaMalloc(&o, (size_t)nq * s.hq * D * 2));
  gen_input<<<1024, 256>>>(q, (int64_t)nq * s.hq * D, 1); gen_input<<<1024, 256>>>(k, slots * s.hkv * D, 2); gen_input<<<1024, 256>>>(v, slots * s.hkv * D, 3);
  std::vector<int32_t> hind((size_t)s.batch * kv_len); for (size_t i = 0; i < hind.size(); ++i) hind[i] = (int32_t)i + 1;
  std::vector<int32_t> hqo(s.batch + 1), hkv(s.batch + 1);
  for (int b = 0; b <= s.batch; ++b) { hqo[b] = b * s.fresh; hkv[b] = b * kv_len; }
  CK(cudaMalloc(&qo, hqo.size() * 4)); CK(cudaMalloc(&kv, hkv.size() * 4)); CK(cudaMalloc(&idx, hind.size() * 4));
  CK(cudaMemcpy(qo, hqo.data(), hqo.size() * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(kv, hkv.data(), hkv.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(idx, hind.data(), hind.size() * 4, cudaMemcpyHostToDevice));
  ExtendParams p{};
  p.q = q; p.k = k; p.v = v; p.out = o; p.qo_indptr = qo; p.kv_indptr = kv; p.kv_indices = idx;
  p.q_stride_t = s.hq * D; p.q_stride_h = D; p.kv_stride_slot = s.hkv * D; p.kv_stride_h = D;
  p.batch = s.batch; p.num_q_heads = s.hq; p.group = s.hq / s.hkv; p.scale_log2 = 1.4426950408889634f / sqrtf((float)D);
  int* work; CK(cudaMalloc(&work, 8)); CK(cudaMemset(work, 0, 8)); p.work_counters = work;   // left zero
  p.num_slots = slots;
  CK(cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, 0));
  // sum over new tokens of the keys each attends: prefix + i + 1 for token i of a request
  const double pairs = (double)s.batch * s.fresh * (s.prefix + (s.fresh + 1) / 2.0);
  const double flops = 4.0 * D * s.hq * pairs;
  for (int wg = 1; wg >= 0; --wg) {
    auto launch = [&] { CK((launch_paged_extend<__nv_bfloat16, D>(p, nq, wg == 1, 0))); };
    for (int i = 0; i < 3; ++i) launch();
    CK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    cudaEventRecord(e0); for (int i = 0; i < 20; ++i) launch(); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
    float ms; cudaEventElapsedTime(&ms, e0, e1); ms /= 20;
    std::vector<uint16_t> h((size_t)nq * s.hq * D); CK(cudaMemcpy(h.data(), o, h.size() * 2, cudaMemcpyDeviceToHost));
    double cs = 0; for (size_t i = 0; i < h.size(); i += 7) { uint32_t u = (uint32_t)h[i] << 16; float f; memcpy(&f, &u, 4); cs += f; }
    const std::string name = std::string(wg ? "wgmma" : "mma") + (*s.label ? std::string(" ") + s.label : "");
    printf("%-10s %-8s %8.1f us  %6.1f TFLOP/s  checksum %.6f\n", VARIANT, name.c_str(), ms * 1e3, flops / (ms * 1e-3) / 1e12, cs);
    cudaEventDestroy(e0); cudaEventDestroy(e1);
  }
  for (void* ptr : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)qo, (void*)kv, (void*)idx, (void*)work}) CK(cudaFree(ptr));
}
int main() {
  for (const Shape& s : {Shape{"", 1, 0, 4096, 32, 32}, Shape{"4k-gqa4", 1, 0, 4096, 32, 8}, Shape{"gqa-short", 32, 4032, 64, 32, 8}})
    time_shape(s);
  return 0;
}
