// A candidate for issue 35's batch-1 bar, timed by fp8_gemv_sweep.cu beside the tree's kernel
// (not used by the server): the FP8-weight skinny GEMM on CUDA cores, laid out as gemv.cuh's
// bf16 kernel (one warp per output column, each lane streaming 16-byte chunks of the row, all of
// a trip's loads in flight, fp32 accumulation, a butterfly at the end), for 1..4 activation rows.
//
// Why: the tree's tensor-core kernel (fp8_gemv.cuh) gives each CTA 16 output columns, so a
// q|k|v or o projection has 256-384 CTAs, each with a few KB of loads in flight; at batch 1 it
// reaches 0.66 / 0.68 of copy bandwidth there (bench/results/logs/fp8-gemv-sweep-h200.txt),
// while the bf16 kernel of this layout reaches 0.97 / 0.86 on twice the bytes. Here a q|k|v
// projection is 768 CTAs of 8 warps, each warp with its whole 4 KB row in flight at once.
// The cost moves to the ALUs: per 16 weight bytes, 4 dequant4 (fp8_gemv.cuh's bit placement,
// 5 integer ops each), 16 unpacks and 16 FMAs per activation row. The sweep says whether that
// fits under the memory stream at 1, 2 and 4 rows.
//
// Same Params and the same results as fp8_gemv::launch up to fp32 summation order (GATED too:
// each projection scaled, biased and rounded to bf16, then silu(g) * u).
#pragma once

#include <cstdint>

#include "radixserve/fp8_gemv.cuh"

namespace radixserve {
namespace fp8_gemv_cc {

using fp8_gemv::Params;
constexpr int kWarps = 8;       // warps (output columns) per CTA
constexpr int kMaxRows = 4;

// the two bf16 of a 32-bit word as floats (low half .x)
__device__ __forceinline__ float2 bf16x2_f2(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// ROWS weight rows per warp (1 plain; 2 GATED: gate j and up n + j), M activation rows, U
// 16-byte chunks per row per lane per trip.
template <bool GATED, int M, int U>
__global__ void __launch_bounds__(kWarps * 32) fp8_cc_kernel(Params p) {
  constexpr int ROWS = GATED ? 2 : 1;
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t j = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (j >= p.n) return;  // whole warps leave together
  const int64_t chunks = p.k / 16;  // 16 e4m3 per chunk
  const uint4* wrow[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) wrow[r] = reinterpret_cast<const uint4*>(p.w + (r * p.n + j) * p.k);

  float acc[ROWS][M] = {};
  uint4 buf[ROWS][U];
  auto load = [&](int64_t c0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + 32 * u;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) buf[r][u] = c < chunks ? __ldcs(wrow[r] + c) : make_uint4(0, 0, 0, 0);
    }
  };
  load(lane);
  pdl_wait();  // x belongs to the kernels before this one
  for (int64_t c0 = lane; c0 < chunks; c0 += 32 * U) {
    if (c0 != lane) load(c0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + 32 * u;
      if (c >= chunks) break;
      // 16 weights of each row as floats (times 2^-56), k order
      float wf[ROWS][16];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const uint32_t wv[4] = {buf[r][u].x, buf[r][u].y, buf[r][u].z, buf[r][u].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint32_t lo, hi;
          fp8_gemv::dequant4(wv[i], lo, hi);  // lo = (q0, q2), hi = (q1, q3)
          const float2 a = bf16x2_f2(lo), b = bf16x2_f2(hi);
          wf[r][4 * i + 0] = a.x;
          wf[r][4 * i + 1] = b.x;
          wf[r][4 * i + 2] = a.y;
          wf[r][4 * i + 3] = b.y;
        }
      }
#pragma unroll
      for (int mi = 0; mi < M; ++mi) {
        const uint4* xr = reinterpret_cast<const uint4*>(p.x + mi * p.x_stride) + 2 * c;
        const uint4 xa = __ldg(xr), xb = __ldg(xr + 1);
        const uint32_t xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int w = 0; w < 8; ++w) {
          const float2 xf = bf16x2_f2(xv[w]);
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            acc[r][mi] = fmaf(wf[r][2 * w], xf.x, acc[r][mi]);
            acc[r][mi] = fmaf(wf[r][2 * w + 1], xf.y, acc[r][mi]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int mi = 0; mi < M; ++mi) acc[r][mi] = warp_sum(acc[r][mi]);
  if (lane != 0) return;
#pragma unroll
  for (int mi = 0; mi < M; ++mi) {
    float v[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t jr = r * p.n + j;
      v[r] = __fmul_rn(acc[r][mi], p.w_scale[jr * p.scale_stride] * fp8_gemv::kDequantScale);
      if (p.bias) v[r] = __fadd_rn(v[r], __bfloat162float(p.bias[jr]));
    }
    if constexpr (GATED) {
      const float gate = __bfloat162float(__float2bfloat16_rn(v[0]));
      const float up = __bfloat162float(__float2bfloat16_rn(v[1]));
      v[0] = gate / (1.f + __expf(-gate)) * up;
    }
    p.out[mi * p.out_stride + j] = __float2bfloat16_rn(v[0]);
  }
}

template <bool GATED, int U>
cudaError_t launch_rows(const Params& p, dim3 grid, dim3 block, cudaStream_t stream) {
  switch (p.m) {
    case 1: return launch_with_pdl(p.pdl, fp8_cc_kernel<GATED, 1, U>, grid, block, 0, stream, p);
    case 2: return launch_with_pdl(p.pdl, fp8_cc_kernel<GATED, 2, U>, grid, block, 0, stream, p);
    case 3: return launch_with_pdl(p.pdl, fp8_cc_kernel<GATED, 3, U>, grid, block, 0, stream, p);
    case 4: return launch_with_pdl(p.pdl, fp8_cc_kernel<GATED, 4, U>, grid, block, 0, stream, p);
    default: return cudaErrorInvalidValue;
  }
}

// U: a row of up to 4096 e4m3 (256 chunks) is one trip of 8 chunks a lane; longer rows trips
// of 8; the gated pair 4 chunks of each row a trip (8 loads)
inline cudaError_t launch(const Params& p, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  if (p.m < 1 || p.m > kMaxRows || p.k % 16 != 0) return cudaErrorInvalidValue;
  const dim3 grid((unsigned)((p.n + kWarps - 1) / kWarps)), block(kWarps * 32);
  if (p.gated) return launch_rows<true, 4>(p, grid, block, stream);
  return launch_rows<false, 8>(p, grid, block, stream);
}

}  // namespace fp8_gemv_cc
}  // namespace radixserve
