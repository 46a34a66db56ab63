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
// ADD + NORM (SkinnyParams::arrivals set; plain form only): the decoder block's residual add and
// rms_norm run in this kernel's epilogue, by its last CTA to finish. Every CTA writes its output
// columns, fences and arrives on a counter; the CTA that arrives last reads the whole output rows
// back from L2, forms residual += out (fp32) and out = rms_norm(residual) * norm_w exactly as
// fused_add_rms_norm does (elementwise.cuh's one-chunk-per-thread path, its reduction order
// replayed over the same chunks, so the two are bit-identical), and resets the counter. At batch 1
// a separate norm kernel was a launch plus a chain of dependent loads between two weight
// streams, 64 times a step; here it is one CTA's tail, while the next projection (launched with
// PDL) already streams its weights.
//
// Tried and dropped: the block's pre-norm fused into this kernel's prologue (every CTA forms
// residual + x and its rms_norm in shared memory, bit-identical to the norm kernel; commit
// f47f4d7). On the H200 the batch-1 decode step took 4.74 ms against 4.39 with the separate
// norm: the q|k|v launch went from ~16 to ~28 us, its 768 CTAs all reading the same 24 KB of
// the row from L2 at the same moment (bench/results/logs/fused-norm-ab-h200.txt). A norm fused
// here needs one CTA to compute it (the producer's last CTA) and the others to read its output.
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
  // ADD + NORM epilogue (plain form only; arrivals == nullptr: none). residual [m, n] float32,
  // row stride res_stride, updated in place; norm_w [n] of T; out receives the norm's output.
  int* arrivals;       // one int32, zero on entry, left zero (the last CTA resets it)
  float* residual;
  int64_t res_stride;
  const void* norm_w;
  float eps;
};

constexpr int kMaxRows = 4;        // the largest m this kernel serves (the caller checks)
constexpr int kWarps = 8;          // warps (output columns) per CTA
// ADD + NORM: rows of up to this many 16-byte chunks (8192 bf16/fp16 elements), the norm
// kernel's one-chunk-per-thread range (up to 1024 threads, elementwise.cuh)
constexpr int kNormMaxChunks = 1024;

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

// Two floats rounded to T, packed in a 32-bit word (low half first, as in memory).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const T l = from_f<T>(lo), h = from_f<T>(hi);
  return (uint32_t)*reinterpret_cast<const uint16_t*>(&l) |
         ((uint32_t)*reinterpret_cast<const uint16_t*>(&h) << 16);
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

// Output column j of every activation row, computed by one warp: ROWS weight rows per warp (1
// plain, 2 GATED: gate and up); M activation rows (p.m, one instantiation each).
// Lane l owns chunks l, l + 32, l + 64, ... of each row; a trip covers U = LOADS / ROWS of them
// per row. With PREFETCH the next trip's loads are issued before this trip's
// arithmetic (two register buffers), so a warp always has loads in flight. Lane 0 writes out[:, j].
template <typename T, bool GATED, int M, int LOADS, bool PREFETCH>
__device__ __forceinline__ void skinny_column(const SkinnyParams& p, int64_t j, int lane) {
  constexpr int ROWS = GATED ? 2 : 1;
  constexpr int U = LOADS / ROWS;
  constexpr int64_t kStep = 32 * U;  // chunks per trip per row (whole warp)
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
  // ADD + NORM: the column is visible device-wide before this CTA arrives (add_norm_epilogue)
  if (p.arrivals != nullptr) __threadfence();
}

// ADD + NORM of one activation row mi, by the whole (last) CTA: residual += out; out =
// rms_norm(residual) * norm_w, equal bit for bit to elementwise.cuh's rms_norm_kernel<T, true,
// THREADS, true, float> on its one-chunk-per-thread path. That kernel's thread c owns 16-byte
// chunk c and sums the squares of its 8 elements in order; warp w's butterfly sums chunks 32 w
// .. 32 w + 31; a second butterfly sums the warp totals (zeros past the last warp). Here thread
// t plays chunks t, t + 256, t + 512, t + 768, which sit in the same lane of warps w, w + 8,
// w + 16, w + 24: the same partial sums meet in the same order. The out row is read from L2
// (__ldcg): other CTAs wrote it during this kernel.
template <typename T>
__device__ __forceinline__ void add_norm_row(const SkinnyParams& p, int mi, float* red /* [32] */) {
  constexpr int N = 8;                       // elements of T per 16-byte chunk
  constexpr int kThreads = kWarps * 32;
  constexpr int R = kNormMaxChunks / kThreads;
  static_assert(kNormMaxChunks / 32 == 32, "one second-level butterfly lane per chunk warp");
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int chunks = (int)(p.n / N);
  T* out = static_cast<T*>(p.out) + mi * p.out_stride;
  float* res = p.residual + mi * p.res_stride;
  const uint4* w = static_cast<const uint4*>(p.norm_w);
  float a[R][N], ss[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = t + r * kThreads;
    ss[r] = 0.f;
    if (c < chunks) {
      const uint4 xv = __ldcg(reinterpret_cast<const uint4*>(out) + c);
      const float4 r0 = reinterpret_cast<const float4*>(res)[2 * c];
      const float4 r1 = reinterpret_cast<const float4*>(res)[2 * c + 1];
      const float rv[N] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
      const uint32_t xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const float2 f = unpack2(xw[i], static_cast<T*>(nullptr));
        a[r][2 * i] = f.x;
        a[r][2 * i + 1] = f.y;
      }
#pragma unroll
      for (int i = 0; i < N; ++i) a[r][i] += rv[i];
#pragma unroll
      for (int i = 0; i < N; ++i) ss[r] += a[r][i] * a[r][i];
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    ss[r] = warp_sum(ss[r]);
    if (lane == 0) red[warp + r * kWarps] = ss[r];
  }
  __syncthreads();
  const float total = warp_sum(red[lane]);
  __syncthreads();  // red is reused by the next row
  const float scale = rsqrtf(total / (float)p.n + p.eps);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = t + r * kThreads;
    if (c >= chunks) continue;
    reinterpret_cast<float4*>(res)[2 * c] = make_float4(a[r][0], a[r][1], a[r][2], a[r][3]);
    reinterpret_cast<float4*>(res)[2 * c + 1] = make_float4(a[r][4], a[r][5], a[r][6], a[r][7]);
    const uint4 wv = w[c];
    const uint32_t ww[4] = {wv.x, wv.y, wv.z, wv.w};
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 g = unpack2(ww[i], static_cast<T*>(nullptr));
      o[i] = pack2<T>((a[r][2 * i] * scale) * g.x, (a[r][2 * i + 1] * scale) * g.y);
    }
    reinterpret_cast<uint4*>(out)[c] = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// ADD + NORM: every CTA arrives once its columns are written and fenced; the last to arrive
// resets the counter and normalises every row (as the split decode's last-CTA merge does,
// decode_attention.cuh). Uniform over the CTA.
template <typename T>
__device__ __forceinline__ void add_norm_epilogue(const SkinnyParams& p) {
  __shared__ float red[32];
  __syncthreads();  // this CTA's columns written and fenced (skinny_column)
  bool last = false;
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(p.arrivals, 1) == (int)gridDim.x - 1;
    if (last) {
      *p.arrivals = 0;  // every CTA arrived: none of this launch touches it again
      __threadfence();
    }
  }
  if (!__syncthreads_or(last)) return;
  pdl_wait();  // the residual belongs to the kernels before this one (a no-op by now)
  for (int mi = 0; mi < p.m; ++mi) add_norm_row<T>(p, mi, red);
}

template <typename T, bool GATED, int M, int LOADS, bool PREFETCH>
__global__ void __launch_bounds__(kWarps * 32) skinny_gemm_kernel(SkinnyParams p) {
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t j = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  // whole warps skip together: no shuffle misses a lane
  if (j < p.n) skinny_column<T, GATED, M, LOADS, PREFETCH>(p, j, lane);
  if constexpr (!GATED) {
    if (p.arrivals != nullptr) add_norm_epilogue<T>(p);
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
