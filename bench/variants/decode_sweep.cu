// Times a variant of decode_attention.cuh / attention_launch.cuh (see README.md): paged decode
// attention, Llama-3.1-8B heads (32 q / 8 kv, head_dim 128, bf16), one CUDA graph of 32 launches
// (32 layers, each with its own KV so small shapes do not replay from L2), for several
// (batch, context) shapes. Two split plans per shape: from the real nnz (eager) and from a
// capture-time nnz of batch x 8192 (a decode graph bucket). Prints microseconds per 32 layers,
// the fraction of copy bandwidth (K + V bytes / time), and an output checksum.
#include <cstdio>
#include <cstring>
#include <vector>
#include "radixserve/attention_launch.cuh"
#include "sweep_common.cuh"
using namespace radixserve::attn;
int main() {
  const int HQ = 32, HKV = 8, D = 128, kLayers = 32;
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  const double copy_bw = copy_bandwidth(st);
  printf("%-10s copy %.2f TB/s\n", VARIANT, copy_bw / 1e12);

  const int shapes[][2] = {{1, 128}, {1, 512}, {1, 1024}, {1, 2048}, {4, 1024}, {8, 128}, {8, 1024},
                           {8, 2048}, {32, 4096}, {64, 1024}, {128, 1024}, {256, 512}};
  for (auto& sh : shapes) {
    const int B = sh[0], L = sh[1];
    const int64_t nnz = (int64_t)B * L;
    const int64_t per_layer = nnz * HKV * D;                 // elements of K (or V) per layer
    const int layers = (int)std::max<int64_t>(1, std::min<int64_t>(kLayers, (1ll << 28) / (per_layer * 4)));
    __nv_bfloat16 *k, *v, *q, *o; float *po, *pl; int32_t *ptr, *idx;
    CK(cudaMalloc(&k, (per_layer * layers + HKV * D) * 2)); CK(cudaMalloc(&v, (per_layer * layers + HKV * D) * 2));
    CK(cudaMalloc(&q, (size_t)B * HQ * D * 2)); CK(cudaMalloc(&o, (size_t)B * HQ * D * 2));
    CK(cudaMalloc(&po, (size_t)B * HQ * 64 * D * 4)); CK(cudaMalloc(&pl, (size_t)B * HQ * 64 * 4));
    int* ctr; CK(cudaMalloc(&ctr, (size_t)B * HKV * 4)); CK(cudaMemset(ctr, 0, (size_t)B * HKV * 4));
    gen<<<1024, 256, 0, st>>>(k, per_layer * layers + HKV * D, 2); gen<<<1024, 256, 0, st>>>(v, per_layer * layers + HKV * D, 3);
    gen<<<1024, 256, 0, st>>>(q, (int64_t)B * HQ * D, 1);
    contiguous_pages(B, L, layers, &ptr, &idx);
    for (int mode = 0; mode < 2; ++mode) {
      const int64_t plan_nnz = mode == 0 ? nnz : (int64_t)B * 8192;
      DecodeParams p{};
      p.q = q; p.k = k; p.v = v; p.out = o; p.part_o = po; p.part_lse = pl; p.split_counters = ctr; p.kv_indptr = ptr;
      p.q_stride_b = HQ * D; p.q_stride_h = D; p.kv_stride_slot = HKV * D; p.kv_stride_h = D;
      p.num_q_heads = HQ; p.num_kv_heads = HKV; p.group = HQ / HKV; p.num_sub = 1;
      p.num_splits = decode_num_splits(B, HKV, 1, plan_nnz, sms);
      p.num_sms = sms;
      p.scale_log2 = 1.4426950408889634f / sqrtf((float)D);
      cudaGraph_t g; cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < kLayers; ++i) {
        p.kv_indices = idx + (int64_t)(i % layers) * nnz;
        CK((launch_paged_decode<__nv_bfloat16, D>(p, B, st)));
      }
      CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
      for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
      CK(cudaEventRecord(e0, st)); for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ge, st));
      CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
      float ms; cudaEventElapsedTime(&ms, e0, e1); const double us = ms * 1e3 / 20;
      std::vector<uint16_t> h((size_t)B * HQ * D); CK(cudaMemcpy(h.data(), o, h.size() * 2, cudaMemcpyDeviceToHost));
      double cs = 0; for (size_t i = 0; i < h.size(); ++i) { uint32_t u = (uint32_t)h[i] << 16; float f; memcpy(&f, &u, 4); cs += f; }
      const double bytes = 2.0 * per_layer * 2 * kLayers;
      printf("%-10s b%-4d ctx%-5d %-6s splits %2d  %9.1f us/32 layers  %5.2f bw  checksum %.6f\n", VARIANT, B, L,
             mode == 0 ? "eager" : "graph", p.num_splits, us, bytes / (us * 1e-6) / copy_bw, cs);
      CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
    }
    CK(cudaFree(k)); CK(cudaFree(v)); CK(cudaFree(q)); CK(cudaFree(o)); CK(cudaFree(po)); CK(cudaFree(pl)); CK(cudaFree(ctr));
    CK(cudaFree(ptr)); CK(cudaFree(idx));
  }
  return 0;
}
