// Skinny GEMM for decode: out[m, j] = sum_k x[m, k] * w[j, k] (+ bias[j]) for a handful of
// activation rows (m < MAXM <= 4) against a bf16/fp16 weight [n, k] (nn.Linear layout, k
// contiguous). Header-only, no torch.
//
// Why: at batch 1-4 a decode step is a weight read. cuBLAS reached 0.65-0.75 of copy bandwidth
// on the Llama-3.1-8B q|k|v and o projections at M = 1 (and split k of the down projection into
// a second reduce kernel), bench/results/decode-profile-h200-bs1.json. This kernel is a plain
// memory stream: one warp per output column j, each lane loading 16-byte chunks of w's row j
// (a plan per shape below: how many per trip, whether the next trip's go out first), x read through
// L1 (it is a few KB and every warp of the SM reads it), fp32 accumulation, a warp shuffle
// reduction at the end.
//
// GATED (the MLP's gate|up projection fused with silu_and_mul): w is [2 * n, k] = [gate | up]
// rows, and warp j reads both row j and row n + j, rounds each dot product to T as the
// unfused GEMM's output would be, and writes silu(g) * u exactly as silu_and_mul does
// (elementwise.cuh): out [m, n] is the activation itself, and the [m, 2n] GEMM output is never
// written or read back.
//
// Launched with programmatic dependent launch on sm_90+ (pdl.cuh): the kernel can be resident
// while the kernel before it (a norm, attention, the previous projection) finishes, with its
// first trip of weight loads already issued; it waits for that kernel only before reading x. At
// batch 1 the launch and the first DRAM round trip were a visible share of a 10-15 us projection.
//
// Tried and dropped: the block's pre-norm fused into this kernel's prologue (every CTA forms
// residual + x and its rms_norm in shared memory, bit-identical to the norm kernel; commit
// f47f4d7). On the H200 the batch-1 decode step took 4.74 ms against 4.39 with the separate
// norm: the q|k|v launch went from ~16 to ~28 us, its 768 CTAs all reading the same 24 KB of
// the row from L2 at the same moment (bench/results/logs/fused-norm-ab-h200.txt). A norm fused
// here needs one CTA to compute it (the producer's last CTA) and the others to read its output.
// That was tried too (commit 4cd8383): the residual add + norm in the epilogue of o_proj and
// down_proj, run by the last CTA to arrive (fence, one atomic, then that CTA reads the row back
// from L2 and replays the norm kernel's reduction, bit-identical). On the H200 the batch-1
// step took 5.03 ms against 4.67 ms with the fusion switched off in the same build and call:
// the fences, the arrival and one CTA's chain of dependent loads and reductions all sit on the
// critical path after the last column, which costs more than the separate norm kernel did.
//
// Accumulation order: each lane sums its chunks in k order, then the 32 lane sums are combined
// by a butterfly; this differs from cuBLAS's order, so outputs agree with F.linear to fp32
// rounding of the sum (then one rounding to T), not bit for bit.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "radixserve/pdl.cuh"

namespace radixserve {
namespace gemv {

struct SkinnyParams {
  const void* x;       // [m, k] (GATED: the MLP input), row stride x_stride elements
  int64_t x_stride;
  const void* w;       // [n_rows, k] contiguous; n_rows = n (plain) or 2 * n (GATED)
  const void* bias;    // [n_rows] or nullptr
  void* out;           // [m, n], row stride out_stride elements
  int64_t out_stride;
  int m;               // activation rows, 1..kMaxRows (the launch picks the instantiation)
  int64_t n;           // output columns
  int64_t k;           // reduction length, a multiple of 8 (16-byte chunks of T)
  bool pdl;            // launch with programmatic dependent launch (sm_90+ only; see below)
};

constexpr int kMaxRows = 4;        // the largest m this kernel serves (the caller checks)
constexpr int kWarps = 8;          // warps (output columns) per CTA

// How a warp streams its rows: LOADS 16-byte weight loads per lane per loop trip (over all its
// rows), and whether trip t + 1's loads are issued before trip t's arithmetic (PREFETCH: two
// register buffers). Chosen per shape from the same-run sweep of every combination on the
// Llama-3.1-8B projections at M = 1 with PDL (bench/variants/gemv_sweep.cu; H200, us per launch,
// cuBLAS in the same graph-of-32 setting in brackets):
//   q|k|v  6144 x 4096:   16 loads, no prefetch 13.4; 8 + prefetch 14.0; 8 plain 14.6   [15.8]
//   o      4096 x 4096:   16 loads, no prefetch  9.9; 8 + prefetch 10.7; 8 plain 10.2   [12.4]
//   gate|up 2 x 14336 x 4096: 8 + prefetch 53.9; 16 plain 56.3; 8 plain 55.6    [56.1 + silu]
//   down   4096 x 14336:  8 loads, no prefetch 30.9; 8 + prefetch 32.5; 16 plain 34.6  [31.0]
// so a row of up to 4096 elements is one trip of 16 loads, a longer row trips of 8, and the
// gated pair (two rows per warp) 4 chunks of each row per trip with prefetch.

__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

// The two elements of a 32-bit word of T as floats.
__device__ __forceinline__ float2 unpack2(uint32_t v, __nv_bfloat16*) {
  // a bf16 is the top half of an fp32: no conversion instruction needed
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
__device__ __forceinline__ float2 unpack2(uint32_t v, __half*) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// acc += dot(8 elements of w, 8 elements of x), both 16-byte words of T.
template <typename T>
__device__ __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
  const uint32_t wv[4] = {w.x, w.y, w.z, w.w}, xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = unpack2(wv[i], static_cast<T*>(nullptr));
    const float2 b = unpack2(xv[i], static_cast<T*>(nullptr));
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

// A weight chunk: read once, so streamed past L1 (evict-first) to leave L1 to x.
__device__ __forceinline__ uint4 load_stream(const uint4* p) { return __ldcs(p); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// One warp per output column j; ROWS weight rows per warp (1 plain, 2 GATED: gate and up); M
// activation rows (p.m, one instantiation each).
// Lane l owns chunks l, l + 32, l + 64, ... of each row; a trip covers U = LOADS / ROWS of them
// per row. With PREFETCH the next trip's loads are issued before this trip's
// arithmetic (two register buffers), so a warp always has loads in flight.
template <typename T, bool GATED, int M, int LOADS, bool PREFETCH>
__global__ void __launch_bounds__(kWarps * 32) skinny_gemm_kernel(SkinnyParams p) {
  constexpr int ROWS = GATED ? 2 : 1;
  constexpr int U = LOADS / ROWS;
  constexpr int64_t kStep = 32 * U;  // chunks per trip per row (whole warp)
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t j = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (j >= p.n) return;  // whole warps leave together: no shuffle below misses a lane
  const int64_t chunks = p.k / 8;
  const uint4* wrow[ROWS];
  wrow[0] = reinterpret_cast<const uint4*>(static_cast<const T*>(p.w) + j * p.k);
  if constexpr (GATED) wrow[1] = reinterpret_cast<const uint4*>(static_cast<const T*>(p.w) + (p.n + j) * p.k);
  const T* x = static_cast<const T*>(p.x);

  float acc[ROWS][M] = {};
  uint4 buf[2][ROWS][U];
  auto load = [&](uint4 (&b)[ROWS][U], int64_t c0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + 32 * u;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) b[r][u] = c < chunks ? load_stream(wrow[r] + c) : make_uint4(0, 0, 0, 0);
    }
  };
  auto consume = [&](const uint4 (&b)[ROWS][U], int64_t c0) {
#pragma unroll
    for (int mi = 0; mi < M; ++mi) {
      const uint4* xr = reinterpret_cast<const uint4*>(x + mi * p.x_stride);
      uint4 xv[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {  // all of the trip's x chunks first: L1 hits, issued together
        const int64_t c = c0 + 32 * u;
        xv[u] = c < chunks ? __ldg(xr + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r][mi] = dot8<T>(b[r][u], xv[u], acc[r][mi]);
    }
  };
  // The first trip's weight loads go out before pdl_wait(): the weights are constant, and only x
  // (and out) belong to the kernels before this one.
  load(buf[0], lane);
  pdl_wait();
  if constexpr (PREFETCH) {
    for (int64_t c0 = lane; c0 < chunks; c0 += 2 * kStep) {
      if (c0 + kStep < chunks) load(buf[1], c0 + kStep);
      consume(buf[0], c0);
      if (c0 + kStep >= chunks) break;
      if (c0 + 2 * kStep < chunks) load(buf[0], c0 + 2 * kStep);
      consume(buf[1], c0 + kStep);
    }
  } else {
    for (int64_t c0 = lane; c0 < chunks; c0 += kStep) {
      if (c0 != lane) load(buf[0], c0);
      consume(buf[0], c0);
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int mi = 0; mi < M; ++mi) acc[r][mi] = warp_sum(acc[r][mi]);
  if (lane != 0) return;

  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int mi = 0; mi < M; ++mi) {
    float v = acc[0][mi] + (bias ? to_f(bias[j]) : 0.f);
    if constexpr (GATED) {
      // the unfused path rounds the GEMM output to T, then silu_and_mul computes in fp32
      const float g = to_f(from_f<T>(v));
      const float up = to_f(from_f<T>(acc[1][mi] + (bias ? to_f(bias[p.n + j]) : 0.f)));
      v = g / (1.f + __expf(-g)) * up;
    }
    out[mi * p.out_stride + j] = from_f<T>(v);
  }
}

template <typename T, bool GATED, int L, bool F>
cudaError_t launch_skinny_planned(const SkinnyParams& p, dim3 grid, dim3 block, cudaStream_t stream) {
  switch (p.m) {  // one instantiation per row count: accumulators and x chunks stay in registers
    case 1: return launch_with_pdl(p.pdl, skinny_gemm_kernel<T, GATED, 1, L, F>, grid, block, 0, stream, p);
    case 2: return launch_with_pdl(p.pdl, skinny_gemm_kernel<T, GATED, 2, L, F>, grid, block, 0, stream, p);
    // 3-4 rows keep at most 8 loads a trip: 16 (with 4 rows of x chunks beside them) spill
    case 3: return launch_with_pdl(p.pdl, skinny_gemm_kernel<T, GATED, 3, (L > 8 ? 8 : L), F>, grid, block, 0, stream, p);
    case 4: return launch_with_pdl(p.pdl, skinny_gemm_kernel<T, GATED, 4, (L > 8 ? 8 : L), F>, grid, block, 0, stream, p);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, bool GATED>
cudaError_t launch_skinny_gemm(const SkinnyParams& p, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  const dim3 grid((unsigned)((p.n + kWarps - 1) / kWarps)), block(kWarps * 32);
  if constexpr (GATED) return launch_skinny_planned<T, true, 8, true>(p, grid, block, stream);
  if (p.k <= 4096) return launch_skinny_planned<T, false, 16, false>(p, grid, block, stream);
  return launch_skinny_planned<T, false, 8, false>(p, grid, block, stream);
}

}  // namespace gemv
}  // namespace radixserve
