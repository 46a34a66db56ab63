// Times a variant of gemv.cuh (see README.md): the skinny GEMM on the Llama-3.1-8B weight shapes
// at M = 1, 2, 4 activation rows (bf16), each shape as one CUDA graph of 32 launches over 32
// distinct weight copies (the 32 layers: no launch reads a weight from L2), launched plainly and
// with programmatic dependent launch (each launch overlapping the previous one's tail), beside
// cuBLAS on the same copies when built with -DWITH_CUBLAS -lcublas. Prints microseconds per launch, the
// fraction of copy bandwidth (weight bytes / time over a measured device copy), and a checksum
// of the last outputs (equal across variants up to fp32 summation order).
#include <cstdio>
#include <vector>
#include "radixserve/gemv.cuh"
#ifdef WITH_CUBLAS
#include <cublas_v2.h>
#endif
#include "sweep_common.cuh"
using namespace radixserve::gemv;
int main() {
  const int kLayers = 32;
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  const double copy_bw = copy_bandwidth(st);
  printf("%-8s copy %.2f TB/s\n", VARIANT, copy_bw / 1e12);
#ifdef WITH_CUBLAS
  cublasHandle_t h; cublasCreate(&h); cublasSetStream(h, st);
#endif
  struct Shape { const char* name; int64_t n, k; bool gated; };
  // n: output columns (gated: the activation's; the weight has 2n rows)
  const Shape shapes[] = {{"qkv", 6144, 4096, false}, {"o", 4096, 4096, false},
                          {"gate_up", 14336, 4096, true}, {"down", 4096, 14336, false}};
  for (const Shape& sh : shapes) {
    const int64_t rows = sh.gated ? 2 * sh.n : sh.n, welems = rows * sh.k;
    std::vector<__nv_bfloat16*> w(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      CK(cudaMalloc(&w[l], welems * 2));
      gen<<<1024, 256, 0, st>>>(w[l], welems, 7 + l, 2.f / sqrtf((float)sh.k));
    }
    __nv_bfloat16 *x, *out; CK(cudaMalloc(&x, 4 * sh.k * 2)); CK(cudaMalloc(&out, 4 * rows * 2));
    gen<<<64, 256, 0, st>>>(x, 4 * sh.k, 1, 2.f);
    for (int m : {1, 2, 4}) {
      for (int impl = 0; impl < 3; ++impl) {  // skinny, skinny with PDL, cuBLAS
#ifndef WITH_CUBLAS
        if (impl == 2) continue;
#endif
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int l = 0; l < kLayers; ++l) {
          if (impl < 2) {
            SkinnyParams p{x, sh.k, w[l], nullptr, out, sh.n, m, sh.n, sh.k, impl == 1};
            CK((sh.gated ? launch_skinny_gemm<__nv_bfloat16, true>(p, st)
                         : launch_skinny_gemm<__nv_bfloat16, false>(p, st)));
          } else {
#ifdef WITH_CUBLAS
            // out^T [rows, m] = W [rows, k] . x^T (column-major: W is k x rows, op T)
            const float one = 1.f, zero = 0.f;
            cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, m, (int)sh.k, &one, w[l], CUDA_R_16BF,
                         (int)sh.k, x, CUDA_R_16BF, (int)sh.k, &zero, out, CUDA_R_16BF, (int)rows,
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
#endif
          }
        }
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
        const int reps = 10;
        CK(cudaEventRecord(e0, st));
        for (int i = 0; i < reps; ++i) CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
        float ms; cudaEventElapsedTime(&ms, e0, e1);
        const double us = 1e3 * ms / (reps * kLayers);
        std::vector<__nv_bfloat16> ho(m * sh.n);
        CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
        double sum = 0; for (auto v : ho) sum += __bfloat162float(v);
        printf("%-8s %-7s %-6s m=%d %8.2f us  %.3f of copy bw  checksum %.4f\n", VARIANT, sh.name,
               impl == 2 ? "cublas" : impl == 1 ? "pdl" : "skinny", m, us, (welems * 2.0 / (us * 1e-6)) / copy_bw, sum);
        cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
      }
    }
    for (auto p : w) CK(cudaFree(p));
    CK(cudaFree(x)); CK(cudaFree(out));
  }
  return 0;
}
