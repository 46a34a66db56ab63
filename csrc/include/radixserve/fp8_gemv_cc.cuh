// FP8-weight skinny GEMM on CUDA cores, for 1..4 bf16 activation rows: the same contract and
// Params as fp8_gemv.cuh (out[m, j] = w_scale[j] * sum_k x[m, k] * w[j, k] (+ bias[j]); GATED:
// each projection scaled, biased and rounded to bf16, then silu(g) * u), in gemv.cuh's layout:
// one warp per output column, each lane streaming 16-byte chunks of the row, a whole 4 KB row
// in flight per warp, fp32 accumulation, a butterfly at the end.
//
// Why: fp8_gemv.cuh's tensor-core kernel gives each CTA 16 output columns, so a q|k|v or o
// projection has 256-384 CTAs, each with a few KB of loads in flight; at batch 1 it reached
// 0.66 / 0.68 of copy bandwidth there (bench/results/logs/fp8-gemv-sweep-h200.txt), while the
// bf16 kernel of this layout reaches 0.97 / 0.86 on twice the bytes. Here a q|k|v projection
// is 768 CTAs of 8 warps. The cost moves to the ALUs: per 16 weight bytes, 4 dequant4
// (fp8_gemv.cuh's bit placement, 5 integer ops each), 16 unpacks and 16 FMAs per activation
// row, which bounds the row count it can serve under the memory stream.
//
// Dispatch (csrc/ops/fp8_gemv.cu): by default where serves_by_default() says, the tensor cores
// elsewhere; the op's cuda_core_rows argument overrides it (bench/fp8_speed.py's A/B). Measured
// on an H100 (bench/variants/fp8_gemv_sweep.cu: graphs of 32 launches over 32 weight copies;
// us, tensor cores / this kernel, bench/results/logs/fp8-gemv-cc-sweep-h100-2026-12-07.txt):
//   gate|up fused, 2 x 14336 x 4096:  m=1 46.8 / 41.1   m=2 47.6 / 43.7   m=4 48.5 / 56.9
//   down, 4096 x 14336:                m=1 24.5 / 21.5   m=2 22.4 / 31.1
//   q|k|v, 6144 x 4096:                m=1 11.5 / 12.2   o, 4096 x 4096: m=1 7.7 / 8.5
// Here the gated pair is 1,792 CTAs and a down row 3.5 trips of streaming loads; the short
// q|k|v and o rows leave each warp one trip, where the tensor-core kernel's 16-column CTAs
// start sooner. With m the FMAs grow and the CUDA cores fall behind at 2-4 rows.
//
// Results equal fp8_gemv::launch's up to fp32 summation order: each lane sums its chunks in k
// order (within a chunk in dequant4's permuted order), then the butterfly.
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
// 16-byte chunks per row per lane per trip; PF: the next trip's loads go out before this trip's
// math (twice the registers for chunks), else each trip's loads wait for the previous trip.
template <bool GATED, int M, int U, bool PF>
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
  uint4 nxt[PF ? ROWS : 1][PF ? U : 1];
  auto load = [&](auto& dst, int64_t c0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + 32 * u;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) dst[r][u] = c < chunks ? __ldcs(wrow[r] + c) : make_uint4(0, 0, 0, 0);
    }
  };
  load(buf, lane);
  pdl_wait();  // x belongs to the kernels before this one
  for (int64_t c0 = lane; c0 < chunks; c0 += 32 * U) {
    if constexpr (PF) {
      if (c0 + 32 * U < chunks) load(nxt, c0 + 32 * U);
    } else {
      if (c0 != lane) load(buf, c0);
    }
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
    if constexpr (PF) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) buf[r][u] = nxt[r][u];
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
    for (int r = 0; r < ROWS; ++r) v[r] = fp8_gemv::scaled_row(p, r * p.n + j, acc[r][mi]);
    if constexpr (GATED) v[0] = fp8_gemv::gated_silu(v[0], v[1]);
    p.out[mi * p.out_stride + j] = __float2bfloat16_rn(v[0]);
  }
}

template <bool GATED, int U, bool PF>
cudaError_t launch_rows(const Params& p, dim3 grid, dim3 block, cudaStream_t stream) {
  switch (p.m) {
    case 1: return launch_with_pdl(p.pdl, fp8_cc_kernel<GATED, 1, U, PF>, grid, block, 0, stream, p);
    case 2: return launch_with_pdl(p.pdl, fp8_cc_kernel<GATED, 2, U, PF>, grid, block, 0, stream, p);
    case 3: return launch_with_pdl(p.pdl, fp8_cc_kernel<GATED, 3, U, PF>, grid, block, 0, stream, p);
    case 4: return launch_with_pdl(p.pdl, fp8_cc_kernel<GATED, 4, U, PF>, grid, block, 0, stream, p);
    default: return cudaErrorInvalidValue;
  }
}

// Chunks a lane per trip (plain; gated: a trip of the gated pair loads both rows) and whether
// the next trip's loads go out before this trip's math. Same sweep, at 1 row: 8 / 4 chunks and
// no prefetch gave gate|up 41.1 us, down 24.4; 4 / 2 with prefetch 41.1 and 21.5; 8 / 4 with
// prefetch 41.8 and 27.7; 4 warps a CTA instead of 8, 41.0 and 24.6.
constexpr int kPlainU = 4, kGatedU = 2;
constexpr bool kPrefetch = true;

// Where the op runs this kernel unless told otherwise (the measurements above): the fused
// gate|up projection at 1-2 rows, plain projections at 1 row with rows of at least 8192 bytes
// (the 70B's q|k|v and o at 8192: 34.2 / 32.3 and 27.7 / 26.1 us). In the decode step (H100,
// bench/results/h100-2026-12-07-fp8gemv.md): batch 1 3.63 ms against 3.91-3.93 with the tensor
// cores alone; batch 2 3.75 against 3.97 in the two calls whose steps ran undisturbed (GPU busy
// 0.999; two disturbed runs, 0.99 busy, gave 4.18 with it and 4.38 without).
inline bool serves_by_default(const Params& p) {
  return p.gated ? p.m <= 2 : p.m == 1 && p.k >= 8192;
}

inline cudaError_t launch(const Params& p, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  if (p.m < 1 || p.m > kMaxRows || p.k % 16 != 0) return cudaErrorInvalidValue;
  const dim3 grid((unsigned)((p.n + kWarps - 1) / kWarps)), block(kWarps * 32);
  if (p.gated) return launch_rows<true, kGatedU, kPrefetch>(p, grid, block, stream);
  return launch_rows<false, kPlainU, kPrefetch>(p, grid, block, stream);
}

}  // namespace fp8_gemv_cc
}  // namespace radixserve
