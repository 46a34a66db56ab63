// Times a variant of fp8_gemv.cuh (see README.md): the FP8-weight skinny GEMM on the
// Llama-3.1-8B weight shapes (q|k|v, o, gate|up unfused, down; and the 70B's q|k|v and o) at
// 1, 2, 4, 8 and 16 bf16 activation rows, each shape one CUDA graph of 32 launches with
// programmatic dependent launch over 32 distinct e4m3 weight copies (the 32 layers: no launch
// reads its weight from L2), and beside it, at 1 row, the bf16 skinny GEMM (gemv.cuh, from the
// tree) on bf16 copies of the same shape. Prints microseconds per launch, the fraction of copy
// bandwidth the weight bytes reach (e4m3 bytes for FP8, bf16 bytes for bf16; the time over a
// measured device copy) and a checksum of the last outputs (equal across variants up to fp32
// summation order). Rows fp8cc / fp8ccg: the CUDA-core kernel of fp8_gemv_cc.cuh
// (csrc/include/radixserve) at 1, 2 and 4 rows on the same weights, its checksums against the
// tensor-core kernel's at the same row count.
#include <cstdio>
#include <vector>
#include "radixserve/fp8_gemv.cuh"
#include "radixserve/gemv.cuh"
#include "radixserve/fp8_gemv_cc.cuh"
#include "sweep_common.cuh"

// e4m3 codes from the hash: any sign, exponent 0..14 (no NaN: 0x7f / 0xff need exponent 15)
__global__ void gen_e4m3(uint8_t* w, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const uint32_t h = sweep_hash(i, seed);
    w[i] = (uint8_t)((h & 0x80u) | ((h >> 8) % 15u) << 3 | ((h >> 16) & 7u));
  }
}

__global__ void fill_f32(float* p, int64_t n, float v) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) p[i] = v;
}

int main() {
  const int kLayers = 32;
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  const double copy_bw = copy_bandwidth(st);
  printf("%-8s copy %.2f TB/s\n", VARIANT, copy_bw / 1e12);
  struct Shape { const char* name; int64_t n, k; };
  const Shape shapes[] = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 28672, 4096},
                          {"down", 4096, 14336},
                          // Llama-3.1-70B's q|k|v and o: rows of 8192 bytes
                          {"qkv70", 10240, 8192}, {"o70", 8192, 8192}};
  for (const Shape& sh : shapes) {
    const int64_t welems = sh.n * sh.k;
    std::vector<uint8_t*> w(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      CK(cudaMalloc(&w[l], welems));
      gen_e4m3<<<1024, 256, 0, st>>>(w[l], welems, 7 + l);
    }
    float* scale; CK(cudaMalloc(&scale, sh.n * 4));
    fill_f32<<<64, 256, 0, st>>>(scale, sh.n, 1.f / 256);
    __nv_bfloat16 *x, *out; CK(cudaMalloc(&x, 16 * sh.k * 2)); CK(cudaMalloc(&out, 16 * sh.n * 2));
    gen<<<64, 256, 0, st>>>(x, 16 * sh.k, 1, 2.f);
    auto time_graph = [&](auto&& capture_one) {
      cudaGraph_t g; cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int l = 0; l < kLayers; ++l) capture_one(l);
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
      const int reps = 10;
      CK(cudaEventRecord(e0, st));
      for (int i = 0; i < reps; ++i) CK(cudaGraphLaunch(ge, st));
      CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
      return 1e3 * ms / (reps * kLayers);
    };
    auto checksum = [&](int m, int64_t cols) {
      std::vector<__nv_bfloat16> ho(m * cols);
      CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
      double sum = 0; for (auto v : ho) sum += __bfloat162float(v);
      return sum;
    };
    for (int m : {1, 2, 4, 8, 16}) {
      const double us = time_graph([&](int l) {
        radixserve::fp8_gemv::Params p{x, sh.k, w[l], scale, 1, nullptr, out, sh.n, m, sh.n, sh.k, true};
        CK(radixserve::fp8_gemv::launch(p, st));
      });
      printf("%-8s %-7s fp8    m=%-2d %8.2f us  %.3f of copy bw  checksum %.4f\n", VARIANT, sh.name, m,
             us, (welems / (us * 1e-6)) / copy_bw, checksum(m, sh.n));
      if (sh.n == 28672) {  // gate|up fused with the activation: [m, 14336] out of the same weight
        const double gus = time_graph([&](int l) {
          radixserve::fp8_gemv::Params p{x, sh.k, w[l], scale, 1, nullptr, out, sh.n / 2, m, sh.n / 2, sh.k, true};
          p.gated = true;
          CK(radixserve::fp8_gemv::launch(p, st));
        });
        printf("%-8s %-7s fp8gat m=%-2d %8.2f us  %.3f of copy bw  checksum %.4f\n", VARIANT, sh.name, m,
               gus, (welems / (gus * 1e-6)) / copy_bw, checksum(m, sh.n / 2));
      }
    }
    for (int m : {1, 2, 4}) {
      const double us = time_graph([&](int l) {
        radixserve::fp8_gemv::Params p{x, sh.k, w[l], scale, 1, nullptr, out, sh.n, m, sh.n, sh.k, true};
        CK(radixserve::fp8_gemv_cc::launch(p, st));
      });
      printf("%-8s %-7s fp8cc  m=%-2d %8.2f us  %.3f of copy bw  checksum %.4f\n", VARIANT, sh.name, m,
             us, (welems / (us * 1e-6)) / copy_bw, checksum(m, sh.n));
      if (sh.n == 28672) {
        const double gus = time_graph([&](int l) {
          radixserve::fp8_gemv::Params p{x, sh.k, w[l], scale, 1, nullptr, out, sh.n / 2, m, sh.n / 2, sh.k, true};
          p.gated = true;
          CK(radixserve::fp8_gemv_cc::launch(p, st));
        });
        printf("%-8s %-7s fp8ccg m=%-2d %8.2f us  %.3f of copy bw  checksum %.4f\n", VARIANT, sh.name, m,
               gus, (welems / (gus * 1e-6)) / copy_bw, checksum(m, sh.n / 2));
      }
    }
    for (auto p : w) CK(cudaFree(p));
    // the bf16 skinny GEMM on the same shape at 1 row (gate|up here unfused: 2 x 14336 rows)
    std::vector<__nv_bfloat16*> wb(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      CK(cudaMalloc(&wb[l], welems * 2));
      gen<<<1024, 256, 0, st>>>(wb[l], welems, 7 + l, 2.f / sqrtf((float)sh.k));
    }
    const double us = time_graph([&](int l) {
      radixserve::gemv::SkinnyParams p{x, sh.k, wb[l], nullptr, out, sh.n, 1, sh.n, sh.k, true};
      CK((radixserve::gemv::launch_skinny_gemm<__nv_bfloat16, false>(p, st)));
    });
    printf("%-8s %-7s bf16   m=1  %8.2f us  %.3f of copy bw  checksum %.4f\n", VARIANT, sh.name, us,
           (welems * 2.0 / (us * 1e-6)) / copy_bw, checksum(1, sh.n));
    for (auto p : wb) CK(cudaFree(p));
    CK(cudaFree(x)); CK(cudaFree(out)); CK(cudaFree(scale));
  }
  return 0;
}
