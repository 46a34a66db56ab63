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
// NORM (the decoder block's rms_norm fused in front, norm_prologue below): x is the block
// output h and the kernel first forms s = h + residual (fp32) and x' = rms_norm(s) * norm_weight
// in T, in shared memory, with exactly rms_norm_kernel's arithmetic (elementwise.cuh: the same
// per-chunk sums, combined in the same butterfly order), so the GEMM multiplies the very bits the
// separate fused_add_rms_norm would have written. Every CTA computes the norm of the whole row
// (a few KB from L2); CTA 0 also writes s to residual_out, a buffer no CTA reads. At batch 1 this
// removes the 64 norm launches of a Llama-3.1-8B step, each a chain of dependent latencies that
// sat between two weight streams.
//
// Accumulation order: each lane sums its chunks in k order, then the 32 lane sums are combined
// by a butterfly; this differs from cuBLAS's order, so outputs agree with F.linear to fp32
// rounding of the sum (then one rounding to T), not bit for bit.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "radixserve/launch_utils.cuh"
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
  // NORM launches only (see above):
  const float* residual;     // [m, k] fp32, row stride res_stride; nullptr: s = x alone
  int64_t res_stride;
  float* residual_out;       // [m, k] fp32 contiguous, s; aliases nothing the kernel reads
  const void* norm_weight;   // [k] T
  float eps;
  int norm_threads;          // rms_norm_kernel's CTA size for this k (norm_reduce_threads)
};

constexpr int kMaxRows = 4;        // the largest m this kernel serves (the caller checks)
constexpr int kWarps = 8;          // warps (output columns) per CTA
constexpr int kThreads = kWarps * 32;
constexpr int kNormMaxChunks = 1024;                      // NORM: k <= 1024 chunks of 16 bytes
constexpr int kNormPer = kNormMaxChunks / kThreads;       // chunks of the row per thread

// The CTA size launch_rms_norm (elementwise.cuh) picks on its vector path for rows of `chunks`
// 16-byte chunks: NORM reproduces that kernel's reduction tree, which this sizes.
inline int norm_reduce_threads(int64_t chunks) {
  return chunks <= 128 ? 128 : chunks <= 256 ? 256 : chunks <= 512 ? 512 : 1024;
}

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

// Two elements of T as one 32-bit word (lo in the low half), unpack2's inverse.
__device__ __forceinline__ uint32_t pack2(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
}
__device__ __forceinline__ uint32_t pack2(__half lo, __half hi) {
  return (uint32_t)__half_as_ushort(lo) | ((uint32_t)__half_as_ushort(hi) << 16);
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

// NORM's prologue: xs[mi][c] (shared, 16-byte chunks of T) = rms_norm(x + residual) * norm
// weight for every row mi, and residual_out = x + residual from CTA 0. rms_norm_kernel gives
// chunk c to thread c of a CTA of p.norm_threads and sums with block_sum: a butterfly over each
// 32 consecutive chunks, then one over those partial sums. Here thread t holds chunks
// t + kThreads * i, so chunk c sits in lane c % 32 of this CTA's warps as it does there, each
// "virtual warp" c / 32 is reduced by the same butterfly, and the partials meet in the same
// order: the sums, and so the scale and every output bit, are equal.
// The fp32 sums wait in shared memory (sf [M][chunks][8]) across the reduction rather than in
// registers: this runs while the first trip's weight loads hold ~64 registers, and two CTAs of
// 256 threads must stay resident per SM. wn: this thread's chunks of the norm weight (loaded
// before pdl_wait by the caller).
template <typename T, int M>
__device__ __forceinline__ void norm_prologue(const SkinnyParams& p, uint4* xs, float4* sf,
                                              const uint4 (&wn)[kNormPer]) {
  __shared__ float red[M][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t chunks = p.k / 8;
  const int partials = p.norm_threads / 32;  // rms_norm_kernel's warps
  const T* x = static_cast<const T*>(p.x);
#pragma unroll
  for (int mi = 0; mi < M; ++mi) {
#pragma unroll 2
    for (int i = 0; i < kNormPer; ++i) {
      const int64_t c = threadIdx.x + (int64_t)kThreads * i;
      float ss = 0.f;
      if (c < chunks) {
        const uint4 xv = *reinterpret_cast<const uint4*>(x + mi * p.x_stride + c * 8);
        const uint32_t xw[4] = {xv.x, xv.y, xv.z, xv.w};
        float a[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = unpack2(xw[e], static_cast<T*>(nullptr));
          a[2 * e] = f.x;
          a[2 * e + 1] = f.y;
        }
        if (p.residual != nullptr) {
          const float4* rr = reinterpret_cast<const float4*>(p.residual + mi * p.res_stride + c * 8);
          const float4 r0 = rr[0], r1 = rr[1];
          const float r[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
#pragma unroll
          for (int e = 0; e < 8; ++e) a[e] += r[e];
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += a[e] * a[e];
        const float4 s0 = make_float4(a[0], a[1], a[2], a[3]), s1 = make_float4(a[4], a[5], a[6], a[7]);
        sf[2 * (mi * chunks + c)] = s0;
        sf[2 * (mi * chunks + c) + 1] = s1;
        if (blockIdx.x == 0) {
          float4* ro = reinterpret_cast<float4*>(p.residual_out + mi * p.k + c * 8);
          ro[0] = s0;
          ro[1] = s1;
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      const int vwarp = warp + kWarps * i;  // chunk c's warp in rms_norm_kernel's CTA
      if (lane == 0 && vwarp < partials) red[mi][vwarp] = ss;
    }
  }
  __syncthreads();
#pragma unroll
  for (int mi = 0; mi < M; ++mi) {
    float t = lane < partials ? red[mi][lane] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
    const float scale = rsqrtf(t / (float)p.k + p.eps);
#pragma unroll
    for (int i = 0; i < kNormPer; ++i) {
      const int64_t c = threadIdx.x + (int64_t)kThreads * i;
      if (c >= chunks) continue;
      const float4 s0 = sf[2 * (mi * chunks + c)], s1 = sf[2 * (mi * chunks + c) + 1];
      const float a[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
      const uint32_t ww[4] = {wn[i].x, wn[i].y, wn[i].z, wn[i].w};
      uint32_t o[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 w = unpack2(ww[e], static_cast<T*>(nullptr));
        o[e] = pack2(from_f<T>((a[2 * e] * scale) * w.x), from_f<T>((a[2 * e + 1] * scale) * w.y));
      }
      xs[mi * chunks + c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  __syncthreads();  // xs complete before any warp's first trip reads it
}

// Dynamic shared memory of a NORM launch of m rows of k: xs (T) then sf (fp32).
inline size_t norm_smem_bytes(int m, int64_t k, size_t t_size) {
  return (size_t)m * (size_t)k * (t_size + sizeof(float));
}

// One warp per output column j; ROWS weight rows per warp (1 plain, 2 GATED: gate and up); M
// activation rows (p.m, one instantiation each).
// Lane l owns chunks l, l + 32, l + 64, ... of each row; a trip covers U = LOADS / ROWS of them
// per row. With PREFETCH the next trip's loads are issued before this trip's
// arithmetic (two register buffers), so a warp always has loads in flight.
template <typename T, bool GATED, int M, int LOADS, bool PREFETCH, bool NORM>
__global__ void __launch_bounds__(kThreads) skinny_gemm_kernel(SkinnyParams p) {
  constexpr int ROWS = GATED ? 2 : 1;
  constexpr int U = LOADS / ROWS;
  constexpr int64_t kStep = 32 * U;  // chunks per trip per row (whole warp)
  extern __shared__ uint4 smem[];    // NORM: xs [M][chunks] (the normalised rows), then sf
  uint4* xs = smem;
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  // j >= n: whole warps leave together (no shuffle below misses a lane), after the prologue
  // under NORM (whose __syncthreads every thread reaches)
  const int64_t j = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  const bool active = j < p.n;
  if (!NORM && !active) return;
  const int64_t chunks = p.k / 8;
  const uint4* wrow[ROWS];
  const int64_t jr = active ? j : 0;  // an idle NORM warp's loads stay in bounds
  wrow[0] = reinterpret_cast<const uint4*>(static_cast<const T*>(p.w) + jr * p.k);
  if constexpr (GATED) wrow[1] = reinterpret_cast<const uint4*>(static_cast<const T*>(p.w) + (p.n + jr) * p.k);
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
      for (int u = 0; u < U; ++u) {  // all of the trip's x chunks first: L1 / shared hits
        const int64_t c = c0 + 32 * u;
        if (c >= chunks) xv[u] = make_uint4(0, 0, 0, 0);
        else if constexpr (NORM) xv[u] = xs[mi * chunks + c];
        else xv[u] = __ldg(xr + c);
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r][mi] = dot8<T>(b[r][u], xv[u], acc[r][mi]);
    }
  };
  // The first trip's weight loads go out before pdl_wait(): the weights are constant, and only x
  // (and out) belong to the kernels before this one.
  if (active) load(buf[0], lane);
  if constexpr (NORM) {
    uint4 wn[kNormPer];
    const uint4* nw = static_cast<const uint4*>(p.norm_weight);
#pragma unroll
    for (int i = 0; i < kNormPer; ++i) {
      const int64_t c = threadIdx.x + (int64_t)kThreads * i;
      wn[i] = c < chunks ? __ldg(nw + c) : make_uint4(0, 0, 0, 0);
    }
    pdl_wait();
    norm_prologue<T, M>(p, xs, reinterpret_cast<float4*>(xs + M * chunks), wn);
    if (!active) return;
  } else {
    pdl_wait();
  }
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

template <typename T, bool GATED, bool NORM, int L, bool F>
cudaError_t launch_skinny_planned(const SkinnyParams& p, dim3 grid, dim3 block, cudaStream_t stream) {
  const size_t smem = NORM ? norm_smem_bytes(p.m, p.k, sizeof(T)) : 0;
  switch (p.m) {  // one instantiation per row count: accumulators and x chunks stay in registers
#define RS_SKINNY(MROWS, LOADS)                                                                   \
  {                                                                                               \
    constexpr auto kernel = skinny_gemm_kernel<T, GATED, MROWS, LOADS, F, NORM>;                  \
    if (NORM) {                                                                                   \
      const cudaError_t err = set_max_dynamic_smem<kernel>(                                       \
          (int)norm_smem_bytes(kMaxRows, 8 * kNormMaxChunks, sizeof(T)));                         \
      if (err != cudaSuccess) return err;                                                         \
    }                                                                                             \
    return launch_with_pdl(p.pdl, kernel, grid, block, smem, stream, p);                          \
  }
    case 1: RS_SKINNY(1, L)
    case 2: RS_SKINNY(2, L)
    // 3-4 rows keep at most 8 loads a trip: 16 (with 4 rows of x chunks beside them) spill
    case 3: RS_SKINNY(3, (L > 8 ? 8 : L))
    case 4: RS_SKINNY(4, (L > 8 ? 8 : L))
#undef RS_SKINNY
    default: return cudaErrorInvalidValue;
  }
}

// NORM: p.k <= 8 * kNormMaxChunks and p.norm_threads = norm_reduce_threads(p.k / 8) (the caller
// checks and sets both).
template <typename T, bool GATED, bool NORM = false>
cudaError_t launch_skinny_gemm(const SkinnyParams& p, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  if (NORM && (p.k > 8 * kNormMaxChunks || p.norm_threads != norm_reduce_threads(p.k / 8)))
    return cudaErrorInvalidValue;
  const dim3 grid((unsigned)((p.n + kWarps - 1) / kWarps)), block(kThreads);
  if constexpr (GATED) return launch_skinny_planned<T, true, NORM, 8, true>(p, grid, block, stream);
  if (p.k <= 4096) return launch_skinny_planned<T, false, NORM, 16, false>(p, grid, block, stream);
  return launch_skinny_planned<T, false, NORM, 8, false>(p, grid, block, stream);
}

}  // namespace gemv
}  // namespace radixserve
