// Times a variant of decode_attention_mma_fp8.cuh / fp8_kv.cuh (see README.md): paged decode
// attention over an FP8 (e4m3) KV pool against the same shapes over a bf16 pool, Llama-3.1-8B
// heads (32 q / 8 kv, head_dim 128, bf16 q and output), each shape one CUDA graph of 32
// launches (layers), each launch over its own KV while they fit 8 GB (so that no launch reads
// its KV from L2), the split plan from the real nnz. Both the tensor-core and the CUDA-core
// kernel (launch_paged_decode's tensor_cores flag). Prints microseconds per launch, the
// fraction of copy bandwidth counted in the pool's own bytes (K + V), and an output checksum
// (equal checksums: equal outputs, within a variant's pool type). Issue 35's bar: batch 256 x
// 1k context on the FP8 pool >= 0.85 of copy bandwidth (0.485 on an H200 at 7f37cc4, while the
// bf16 pool reaches 0.998 in about the same time: bench/results/attention-fp8kv-h200.json).
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <vector>
#include "radixserve/attention_launch.cuh"
#include "sweep_common.cuh"
using namespace radixserve::attn;

// e4m3 bytes with the top exponent bit clear: finite, |x| < 2 (no NaN codes)
__global__ void gen_fp8(uint8_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = (uint8_t)(sweep_hash(i, seed) & 0xbfu);
}

template <typename KV>
void run_shape(int B, int L, int sms, double copy_bw, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1) {
  constexpr int HQ = 32, HKV = 8, D = 128, kLaunches = 32;
  constexpr bool kFp8 = radixserve::fp8::is_fp8<KV>();
  constexpr int kBytes = kFp8 ? 1 : 2;
  const int64_t nnz = (int64_t)B * L;
  const int64_t per_layer = nnz * HKV * D;  // elements of K (or V) per layer
  const int layers = (int)std::max<int64_t>(1, std::min<int64_t>(kLaunches, (8ll << 30) / (2 * per_layer * kBytes)));
  const int64_t pool = per_layer * layers + HKV * D;  // slot 0 unused, as in the server's pool
  void *k, *v;
  __nv_bfloat16 *q, *o;
  int32_t *ptr, *idx;
  CK(cudaMalloc(&k, pool * kBytes)); CK(cudaMalloc(&v, pool * kBytes));
  CK(cudaMalloc(&q, (size_t)B * HQ * D * 2)); CK(cudaMalloc(&o, (size_t)B * HQ * D * 2));
  if constexpr (kFp8) {
    gen_fp8<<<1024, 256, 0, st>>>((uint8_t*)k, pool, 2); gen_fp8<<<1024, 256, 0, st>>>((uint8_t*)v, pool, 3);
  } else {
    gen<<<1024, 256, 0, st>>>((__nv_bfloat16*)k, pool, 2); gen<<<1024, 256, 0, st>>>((__nv_bfloat16*)v, pool, 3);
  }
  gen<<<1024, 256, 0, st>>>(q, (int64_t)B * HQ * D, 1);
  contiguous_pages(B, L, layers, &ptr, &idx);
  DecodeParams p{};
  p.q = q; p.k = k; p.v = v; p.out = o; p.kv_indptr = ptr;
  p.q_stride_b = HQ * D; p.q_stride_h = D; p.kv_stride_slot = HKV * D; p.kv_stride_h = D;
  // SWEEP_LAYOUT=hmajor: the pool as [head][slot][D] (a head's consecutive slots adjacent)
  // instead of the server's [slot][head][D], same bytes: does the kernel's time follow the
  // bytes or the number of separate 128-byte (FP8) / 256-byte (bf16) rows it touches?
  const char* layout = getenv("SWEEP_LAYOUT");
  const bool hmajor = layout != nullptr && strcmp(layout, "hmajor") == 0;
  if (hmajor) { p.kv_stride_slot = D; p.kv_stride_h = (nnz * layers + 1) * D; }
  p.num_q_heads = HQ; p.num_kv_heads = HKV; p.group = HQ / HKV; p.num_sub = 1;
  p.num_splits = decode_num_splits(B, HKV, 1, nnz, sms);
  p.num_sms = sms;
  p.scale_log2 = 1.4426950408889634f / sqrtf((float)D);
  float* po = nullptr; float* pl = nullptr; int* ctr = nullptr;
  if (p.num_splits > 1) {
    CK(cudaMalloc(&po, (size_t)B * HQ * p.num_splits * D * 4)); CK(cudaMalloc(&pl, (size_t)B * HQ * p.num_splits * 4));
    CK(cudaMalloc(&ctr, (size_t)B * HKV * 4)); CK(cudaMemset(ctr, 0, (size_t)B * HKV * 4));
  }
  p.part_o = po; p.part_lse = pl; p.split_counters = ctr;
  // the index copies and the counters' memset ran on the legacy stream, the generators on st:
  // all of it done before the first replay on st (a non-blocking stream orders nothing with it)
  CK(cudaDeviceSynchronize());
  for (int tc = 1; tc >= 0; --tc) {
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < kLaunches; ++i) {
      p.kv_indices = idx + (int64_t)(i % layers) * nnz;
      CK((launch_paged_decode<__nv_bfloat16, D, KV>(p, B, st, tc == 1)));
    }
    CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e0, st)); for (int i = 0; i < 10; ++i) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
    float ms; cudaEventElapsedTime(&ms, e0, e1); const double us = ms * 1e3 / (10 * kLaunches);
    std::vector<uint16_t> h((size_t)B * HQ * D); CK(cudaMemcpy(h.data(), o, h.size() * 2, cudaMemcpyDeviceToHost));
    double cs = 0; for (size_t i = 0; i < h.size(); ++i) { uint32_t u = (uint32_t)h[i] << 16; float f; memcpy(&f, &u, 4); cs += f; }
    const double bytes = 2.0 * per_layer * kBytes;
    printf("%-12s %-6s %-5s b%-4d ctx%-5d %-4s splits %2d layers %2d  %8.1f us/launch  %5.3f bw  checksum %.6f\n",
           VARIANT, hmajor ? "hmajor" : "slot", kFp8 ? "e4m3" : "bf16", B, L, tc ? "tc" : "simt", p.num_splits, layers, us,
           bytes / (us * 1e-6) / copy_bw, cs);
    CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
  }
  CK(cudaFree(k)); CK(cudaFree(v)); CK(cudaFree(q)); CK(cudaFree(o)); CK(cudaFree(ptr)); CK(cudaFree(idx));
  if (po) { CK(cudaFree(po)); CK(cudaFree(pl)); CK(cudaFree(ctr)); }
}

int main() {
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  const double copy_bw = copy_bandwidth(st);
  printf("%-12s copy %.2f TB/s\n", VARIANT, copy_bw / 1e12);
  const int shapes[][2] = {{256, 1024}, {128, 1024}, {64, 2048}, {32, 4096}, {8, 8192}};
  for (auto& sh : shapes) {
    run_shape<__nv_fp8_e4m3>(sh[0], sh[1], sms, copy_bw, st, e0, e1);
    if (getenv("SWEEP_NO_BF16") == nullptr) run_shape<__nv_bfloat16>(sh[0], sh[1], sms, copy_bw, st, e0, e1);
  }
  return 0;
}
