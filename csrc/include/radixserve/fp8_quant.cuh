// Per-token FP8 (e4m3) quantization of activations for the W8A8 GEMMs, alone (fp8_quantize) and
// fused behind the block's RMSNorm (rmsnorm_quant_fp8: residual add + norm + quantization in one
// pass over the row). Header-only, no torch.
//
// Math (the references in ops/reference.py, bit for bit): a row's scale is max(amax, 1e-12) /
// 448 in fp32, or the static input scale when one is given; each value becomes
// rne_e4m3(clamp(v / scale, -448, 448)) with an IEEE fp32 division (as torch divides). The
// fused kernel's normalised row y is rms_norm_kernel's (elementwise.cuh): the same fp32 sum of
// squares in the same block reduction, (a * rsqrt(ss / hidden + eps)) * w, rounded to T, so y
// equals what fused_add_rms_norm / rms_norm would write, and its quantization what fp8_quantize
// makes of that. The scales are written on the device ([rows] fp32): they never reach the host.
//
// One CTA per token. rmsnorm_quant_fp8 keeps the row in registers (one 16-byte chunk of T per
// thread: rows of up to 1024 chunks, 8192 bf16 elements; the host sends longer rows to the
// reference); fp8_quantize loops over chunks twice (amax, then cast), the second pass reading
// the row back from L1/L2.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "radixserve/elementwise.cuh"

namespace radixserve {
namespace fp8_quant {

constexpr float kMax = 448.f;
constexpr float kMinAmax = 1e-12f;

template <int THREADS>
__device__ __forceinline__ float block_max(float x, float* red /* [32] shared */) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float t = lane < THREADS / 32 ? red[lane] : 0.f;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, off));
  __syncthreads();
  return t;
}

__device__ __forceinline__ uint8_t to_e4m3(float v, float scale) {
  const float q = fminf(fmaxf(__fdiv_rn(v, scale), -kMax), kMax);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3));
}

// N values of one chunk -> N e4m3 bytes at out (N = 8 for 16-bit T: one 8-byte store).
template <int N>
__device__ __forceinline__ void store_e4m3(uint8_t* out, const float (&v)[N], float scale) {
  static_assert(N == 8, "16-byte chunks of a 16-bit type");
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < N; ++i) w[i / 4] |= static_cast<uint32_t>(to_e4m3(v[i], scale)) << (8 * (i % 4));
  *reinterpret_cast<uint2*>(out) = make_uint2(w[0], w[1]);
}

struct Params {
  const void* x;          // [rows, hidden] T, row stride x_stride
  int64_t x_stride;
  void* residual;         // rmsnorm_quant_fp8 with a residual: [rows, hidden] R, in place
  int64_t res_stride;
  const void* weight;     // rmsnorm_quant_fp8: [hidden] T
  const float* input_scale;  // static scale ([1] fp32) or nullptr (per-token amax)
  uint8_t* out;           // [rows, hidden] e4m3, contiguous
  float* scale;           // [rows] fp32
  int64_t rows;
  int64_t hidden;         // a multiple of 8
  float eps;
};

// fp8_quantize: one CTA per row, chunks of 8 values (16 bytes of T).
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS) quantize_kernel(Params p) {
  using A = elementwise::Access<T, true>;
  constexpr int N = A::N;
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  const T* xr = static_cast<const T*>(p.x) + r * p.x_stride;
  const int64_t chunks = p.hidden / N;
  float s;
  if (p.input_scale) {
    s = *p.input_scale;
  } else {
    float m = 0.f;
    for (int64_t c = threadIdx.x; c < chunks; c += THREADS) {
      float a[N];
      A::load(xr + c * N, a);
#pragma unroll
      for (int i = 0; i < N; ++i) m = fmaxf(m, fabsf(a[i]));
    }
    s = fmaxf(block_max<THREADS>(m, red), kMinAmax) / kMax;
  }
  if (threadIdx.x == 0) p.scale[r] = s;
  uint8_t* orow = p.out + r * p.hidden;
  for (int64_t c = threadIdx.x; c < chunks; c += THREADS) {
    float a[N];
    A::load(xr + c * N, a);
    store_e4m3<N>(orow + c * N, a, s);
  }
}

// rmsnorm_quant_fp8: the row in registers, one chunk per thread (chunks <= THREADS).
template <typename T, int THREADS, bool FUSED_ADD, typename R>
__global__ void __launch_bounds__(THREADS) rmsnorm_quant_kernel(Params p) {
  using A = elementwise::Access<T, true>;
  constexpr int N = A::N;
  using AR = elementwise::AccessN<R, N, true>;
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  const T* xr = static_cast<const T*>(p.x) + r * p.x_stride;
  R* rr = FUSED_ADD ? static_cast<R*>(p.residual) + r * p.res_stride : nullptr;
  const int64_t chunks = p.hidden / N;
  const int c = threadIdx.x;
  const bool mine = c < chunks;
  float a[N], w[N];
  float ss = 0.f;
  if (mine) {
    A::load(static_cast<const T*>(p.weight) + c * N, w);
    A::load(xr + c * N, a);
    if constexpr (FUSED_ADD) {
      float res[N];
      AR::load(rr + c * N, res);
#pragma unroll
      for (int i = 0; i < N; ++i) a[i] += res[i];
    }
#pragma unroll
    for (int i = 0; i < N; ++i) ss += a[i] * a[i];
  }
  ss = elementwise::block_sum<THREADS>(ss, red);
  const float inv = rsqrtf(ss / (float)p.hidden + p.eps);
  float m = 0.f;
  if (mine) {
    if constexpr (FUSED_ADD) AR::store(rr + c * N, a);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      // y rounded to T, as the norm kernel writes it
      a[i] = elementwise::to_f(elementwise::from_f<T>((a[i] * inv) * w[i]));
      m = fmaxf(m, fabsf(a[i]));
    }
  }
  float s;
  if (p.input_scale) {
    s = *p.input_scale;
  } else {
    s = fmaxf(block_max<THREADS>(m, red), kMinAmax) / kMax;
  }
  if (threadIdx.x == 0) p.scale[r] = s;
  if (mine) store_e4m3<N>(p.out + r * p.hidden + c * N, a, s);
}

// Whether rmsnorm_quant_fp8's kernel serves rows of this many elements of a 16-bit T.
inline bool rmsnorm_fits(int64_t hidden) { return hidden % 8 == 0 && hidden / 8 <= 1024; }

template <typename T>
cudaError_t launch_quantize(const Params& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const dim3 grid((unsigned)p.rows);
  const int64_t chunks = p.hidden / 8;
  if (chunks <= 128) quantize_kernel<T, 128><<<grid, 128, 0, stream>>>(p);
  else if (chunks <= 512) quantize_kernel<T, 256><<<grid, 256, 0, stream>>>(p);
  else quantize_kernel<T, 512><<<grid, 512, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, bool FUSED_ADD, typename R = T>
cudaError_t launch_rmsnorm_quant(const Params& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (!rmsnorm_fits(p.hidden)) return cudaErrorInvalidValue;
  const dim3 grid((unsigned)p.rows);
  const int64_t chunks = p.hidden / 8;
  // the thread counts of launch_rms_norm's vector path, so the sum of squares is reduced the
  // same way (elementwise.cuh)
  if (chunks <= 128) rmsnorm_quant_kernel<T, 128, FUSED_ADD, R><<<grid, 128, 0, stream>>>(p);
  else if (chunks <= 256) rmsnorm_quant_kernel<T, 256, FUSED_ADD, R><<<grid, 256, 0, stream>>>(p);
  else if (chunks <= 512) rmsnorm_quant_kernel<T, 512, FUSED_ADD, R><<<grid, 512, 0, stream>>>(p);
  else rmsnorm_quant_kernel<T, 1024, FUSED_ADD, R><<<grid, 1024, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fp8_quant
}  // namespace radixserve
