// Fused elementwise kernels around attention: rms_norm, fused_add_rms_norm, rotary_embedding
// (neox, rotate halves), silu_and_mul. Header-only, no torch. All arithmetic is fp32; inputs
// and outputs are T in {float, __half, __nv_bfloat16}, except fused_add_rms_norm's residual,
// which may also be float beside a half-precision x. Vector paths move 16 bytes per thread
// access; the host picks them only when every row start is 16-byte aligned.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "radixserve/kv.cuh"
#include "radixserve/pdl.cuh"

namespace radixserve {
namespace elementwise {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N elements of T packed in one 16-byte word.
template <typename T>
struct alignas(16) Vec {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T, int N>
struct Pack {  // VEC ? 16-byte pack : one element
  T v[N];
};

template <typename T, bool VEC>
struct Access {
  static constexpr int N = VEC ? 16 / (int)sizeof(T) : 1;
  __device__ __forceinline__ static void load(const T* p, float (&out)[N]) {
    if constexpr (VEC) {
      const Vec<T> w = *reinterpret_cast<const Vec<T>*>(p);
#pragma unroll
      for (int i = 0; i < N; ++i) out[i] = to_f(w.v[i]);
    } else {
      out[0] = to_f(*p);
    }
  }
  __device__ __forceinline__ static void store(T* p, const float (&in)[N]) {
    if constexpr (VEC) {
      Vec<T> w;
#pragma unroll
      for (int i = 0; i < N; ++i) w.v[i] = from_f<T>(in[i]);
      *reinterpret_cast<Vec<T>*>(p) = w;
    } else {
      *p = from_f<T>(in[0]);
    }
  }
};

// N elements of R starting at p: on the vector path as N * sizeof(R) / 16 16-byte words (the
// caller guarantees 16-byte alignment of p), else element by element. This lets a kernel walk
// two arrays of different element sizes in lockstep (an fp32 residual beside bf16 x: 8 elements
// are one word of x and two words of the residual).
template <typename R, int N, bool VEC>
struct AccessN {
  static constexpr int kPerWord = 16 / (int)sizeof(R);
  static_assert(!VEC || N % kPerWord == 0, "a vector access must cover whole 16-byte words");
  __device__ __forceinline__ static void load(const R* p, float (&out)[N]) {
    if constexpr (VEC) {
#pragma unroll
      for (int w = 0; w < N / kPerWord; ++w) {
        const Vec<R> v = reinterpret_cast<const Vec<R>*>(p)[w];
#pragma unroll
        for (int i = 0; i < kPerWord; ++i) out[w * kPerWord + i] = to_f(v.v[i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) out[i] = to_f(p[i]);
    }
  }
  __device__ __forceinline__ static void store(R* p, const float (&in)[N]) {
    if constexpr (VEC) {
#pragma unroll
      for (int w = 0; w < N / kPerWord; ++w) {
        Vec<R> v;
#pragma unroll
        for (int i = 0; i < kPerWord; ++i) v.v[i] = from_f<R>(in[w * kPerWord + i]);
        reinterpret_cast<Vec<R>*>(p)[w] = v;
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) p[i] = from_f<R>(in[i]);
    }
  }
};

template <int THREADS>
__device__ __forceinline__ float block_sum(float x, float* red /* [32] shared */) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float t = lane < THREADS / 32 ? red[lane] : 0.f;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
  __syncthreads();  // red may be reused by the caller
  return t;
}

// ----------------------------------------------------------------------------- rms_norm
//
// One CTA per token. Pass 1 accumulates sum(x^2) in fp32 (reading 16 bytes per access); pass 2
// writes (x * rsqrt(mean + eps)) * w, the reference's order of operations, from registers when
// the row is one chunk per thread (rows up to 1024 x 16 bytes), else re-reading the row (from
// L1/L2: the row is at most 64 KB). fused_add_rms_norm reads x and residual in both passes
// and writes residual only in pass 2, so the norm uses the fp32 sum (as the reference does),
// never the rounded residual.
//
// The residual has its own element type R: T (as x) or float. Half-precision models keep their
// residual stream in fp32 (model/llama.py), so the sum of all blocks' outputs is never rounded
// to bf16/fp16; only x (the normalised output, a GEMM input) is. A thread handles the same N
// elements of x and of the residual (N = 16 bytes of T), i.e. 16 * sizeof(R) / sizeof(T) bytes
// of the residual on the vector path.
//
// The norm itself is launched plainly: launched with PDL (its weight loaded before waiting for
// x's producer) a batch-1 decode step took 4.63 ms instead of 4.43 on the H200.

template <typename T, bool VEC, int THREADS, bool FUSED_ADD, typename R>
__global__ void __launch_bounds__(THREADS) rms_norm_kernel(T* out, int64_t out_stride,
                                                           const T* x, int64_t x_stride,
                                                           R* residual, int64_t res_stride,
                                                           const T* __restrict__ weight,
                                                           int64_t hidden, float eps) {
  pdl_launch_dependents();  // the projection after the norm may start streaming its weights
  using A = Access<T, VEC>;
  constexpr int N = A::N;
  using AR = AccessN<R, N, VEC>;
  __shared__ float red[32];
  const int64_t t = blockIdx.x;
  const T* xr = x + t * x_stride;
  R* rr = FUSED_ADD ? residual + t * res_stride : nullptr;
  T* orow = out + t * out_stride;
  const int64_t chunks = hidden / N;
  if (chunks <= THREADS) {
    // The launch sizes THREADS so that a row of up to 8192 bf16 (1024 threads) is one chunk per
    // thread: the row stays in registers and the weight is loaded before the reduction, so pass
    // 2 costs no second round of global loads (batch-1 decode runs 64 of these per step, each a
    // chain of dependent latencies). Same operations in the same order as the loop below.
    const int c = threadIdx.x;
    const bool mine = c < chunks;
    float a[N], w[N];
    float ss = 0.f;
    if (mine) {
      A::load(weight + c * N, w);
      A::load(xr + c * N, a);
      if constexpr (FUSED_ADD) {
        float r[N];
        AR::load(rr + c * N, r);
#pragma unroll
        for (int i = 0; i < N; ++i) a[i] += r[i];
      }
#pragma unroll
      for (int i = 0; i < N; ++i) ss += a[i] * a[i];
    }
    ss = block_sum<THREADS>(ss, red);
    const float scale = rsqrtf(ss / (float)hidden + eps);
    if (mine) {
      if constexpr (FUSED_ADD) AR::store(rr + c * N, a);
#pragma unroll
      for (int i = 0; i < N; ++i) a[i] = (a[i] * scale) * w[i];
      A::store(orow + c * N, a);
    }
    return;
  }
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += THREADS) {
    float a[N];
    A::load(xr + c * N, a);
    if constexpr (FUSED_ADD) {
      float r[N];
      AR::load(rr + c * N, r);
#pragma unroll
      for (int i = 0; i < N; ++i) a[i] += r[i];
    }
#pragma unroll
    for (int i = 0; i < N; ++i) ss += a[i] * a[i];
  }
  ss = block_sum<THREADS>(ss, red);
  const float scale = rsqrtf(ss / (float)hidden + eps);
  for (int64_t c = threadIdx.x; c < chunks; c += THREADS) {
    float a[N], w[N];
    A::load(xr + c * N, a);
    A::load(weight + c * N, w);
    if constexpr (FUSED_ADD) {
      float r[N];
      AR::load(rr + c * N, r);
#pragma unroll
      for (int i = 0; i < N; ++i) a[i] += r[i];
      AR::store(rr + c * N, a);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] = (a[i] * scale) * w[i];
    A::store(orow + c * N, a);
  }
}

struct RmsNormParams {
  void* out;
  int64_t out_stride;
  const void* x;
  int64_t x_stride;
  void* residual;  // fused_add only (then out == x); element type R of launch_rms_norm
  int64_t res_stride;
  const void* weight;
  int64_t num_tokens;
  int64_t hidden;
  float eps;
};

// vec: every row start of out, x, weight (and residual) is 16-byte aligned and hidden * sizeof(T)
// is a multiple of 16 (then hidden * sizeof(R) is too, for R = float).
template <typename T, bool FUSED_ADD, typename R = T>
cudaError_t launch_rms_norm(const RmsNormParams& p, bool vec, cudaStream_t stream) {
  static_assert(sizeof(R) >= sizeof(T), "the residual is T or a wider type (float)");
  if (p.num_tokens == 0) return cudaSuccess;
  const int64_t chunks = vec ? p.hidden / (16 / (int64_t)sizeof(T)) : p.hidden;
  const dim3 grid((unsigned)p.num_tokens);
#define RS_LAUNCH(VEC, THREADS)                                                                   \
  rms_norm_kernel<T, VEC, THREADS, FUSED_ADD, R><<<grid, THREADS, 0, stream>>>(                   \
      static_cast<T*>(p.out), p.out_stride, static_cast<const T*>(p.x), p.x_stride,               \
      static_cast<R*>(p.residual), p.res_stride, static_cast<const T*>(p.weight), p.hidden, p.eps)
  if (vec) {
    if (chunks <= 128) RS_LAUNCH(true, 128);
    else if (chunks <= 256) RS_LAUNCH(true, 256);
    else if (chunks <= 512) RS_LAUNCH(true, 512);
    else RS_LAUNCH(true, 1024);
  } else {
    if (chunks <= 256) RS_LAUNCH(false, 256);
    else RS_LAUNCH(false, 1024);
  }
#undef RS_LAUNCH
  return cudaGetLastError();
}

// ----------------------------------------------------------------------------- rotary_embedding
//
// Neox style over the first rotary_dim dims of each head: with h = rotary_dim / 2,
//   x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin,  x1 = x[:h], x2 = x[h:2h].
// One CTA per token; a thread owns N consecutive pairs (N = 16 bytes of T on the vector path)
// of one head and loops over q's heads then k's heads. q/k are addressed through their token and
// head strides (they may be views into a fused qkv buffer); the last dim must be contiguous.

struct RotaryParams {
  const int64_t* positions;      // [num_tokens]
  void* q;                       // [num_tokens, num_q_heads, head_dim] strided
  void* k;                       // [num_tokens, num_kv_heads, head_dim] strided
  const float* cos_sin_cache;    // [max_pos, rotary_dim]
  int64_t num_tokens;
  int64_t q_stride_t, q_stride_h, k_stride_t, k_stride_h;  // elements
  int num_q_heads, num_kv_heads;
  int rotary_dim;
  int64_t max_pos;
};

// Rotates token t's q and k heads in place (the whole CTA takes part).
template <typename T, bool VEC>
__device__ __forceinline__ void rotate_token(const RotaryParams& p, int64_t t) {
  using A = Access<T, VEC>;
  constexpr int N = A::N;
  const int64_t pos = p.positions[t];
  if (pos < 0 || pos >= p.max_pos) return;  // device-side guard (host cannot check without sync)
  const int half = p.rotary_dim / 2;
  const int chunks = half / N;  // per head
  const float* cs = p.cos_sin_cache + pos * p.rotary_dim;
  const int total = (p.num_q_heads + p.num_kv_heads) * chunks;
  for (int w = threadIdx.x; w < total; w += blockDim.x) {
    const int head = w / chunks, c = w - head * chunks;
    T* base = head < p.num_q_heads
                  ? static_cast<T*>(p.q) + t * p.q_stride_t + (int64_t)head * p.q_stride_h
                  : static_cast<T*>(p.k) + t * p.k_stride_t +
                        (int64_t)(head - p.num_q_heads) * p.k_stride_h;
    const int i0 = c * N;
    float x1[N], x2[N], r1[N], r2[N];
    A::load(base + i0, x1);
    A::load(base + half + i0, x2);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float co = cs[i0 + i], si = cs[half + i0 + i];
      r1[i] = x1[i] * co - x2[i] * si;
      r2[i] = x2[i] * co + x1[i] * si;
    }
    A::store(base + i0, r1);
    A::store(base + half + i0, r2);
  }
}

template <typename T, bool VEC>
__global__ void rotary_kernel(RotaryParams p) {
  rotate_token<T, VEC>(p, blockIdx.x);
}

// rotary_embedding followed by store_kv in one launch (decode runs one per layer; batch-1 decode
// paid ~1.4 us a layer for the second launch): the CTA of token t rotates its q and k heads, then
// (after a barrier, so the rotated k is what it reads back) copies its k row and v row
// ([num_kv_heads * head_dim], contiguous across heads) into the pool at slot_indices[t]. Slots
// outside [0, num_slots) are skipped, as in store_kv; the copy runs also when the position is
// out of range (rotation skipped), as the two separate ops would. An FP8 pool (C = __nv_fp8_e4m3
// / __nv_fp8_e5m2) gets the rows quantized as store_kv quantizes them (fp8::quantize_kv_row).
struct KvRowTarget {
  void* k_cache;             // [num_slots, row_elems]
  void* v_cache;             // [num_slots, row_elems]
  const void* v;             // [num_tokens, row_elems], token stride v_stride (elements)
  int64_t v_stride;
  const void* slot_indices;  // [num_tokens] IdxT
  int64_t num_slots;
  int64_t row_elems;         // num_kv_heads * head_dim
  // FP8 pools only: fp32 1 / k_scale, 1 / v_scale, and whether rows move in groups of 8
  // (fp8::quantize_kv_row's vec8)
  float k_inv_scale = 1.f;
  float v_inv_scale = 1.f;
  bool fp8_vec8 = false;
};

template <typename T, bool VEC, typename IdxT, typename C = T>
__global__ void rotary_store_kv_kernel(RotaryParams p, KvRowTarget kv) {
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  rotate_token<T, VEC>(p, t);
  __syncthreads();  // the rotated k rows of this token are visible to every thread of the CTA
  const int64_t slot = static_cast<int64_t>(static_cast<const IdxT*>(kv.slot_indices)[t]);
  if (slot < 0 || slot >= kv.num_slots) return;
  if constexpr (fp8::is_fp8<C>()) {
    fp8::quantize_kv_row<T, C>(static_cast<uint8_t*>(kv.k_cache) + slot * kv.row_elems,
                               static_cast<uint8_t*>(kv.v_cache) + slot * kv.row_elems,
                               static_cast<const T*>(p.k) + t * p.k_stride_t,
                               static_cast<const T*>(kv.v) + t * kv.v_stride, kv.row_elems,
                               kv.k_inv_scale, kv.v_inv_scale, kv.fp8_vec8);
  } else {
    kv::copy_kv_row<T, VEC>(static_cast<T*>(kv.k_cache) + slot * kv.row_elems,
                            static_cast<T*>(kv.v_cache) + slot * kv.row_elems,
                            static_cast<const T*>(p.k) + t * p.k_stride_t,
                            static_cast<const T*>(kv.v) + t * kv.v_stride, kv.row_elems);
  }
}

template <typename T>
cudaError_t launch_rotary(const RotaryParams& p, bool vec, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int n = vec ? 16 / (int)sizeof(T) : 1;
  const int work = (p.num_q_heads + p.num_kv_heads) * (p.rotary_dim / 2 / n);
  int threads = 32;
  while (threads < work && threads < 512) threads *= 2;
  if (vec)
    rotary_kernel<T, true><<<(unsigned)p.num_tokens, threads, 0, stream>>>(p);
  else
    rotary_kernel<T, false><<<(unsigned)p.num_tokens, threads, 0, stream>>>(p);
  return cudaGetLastError();
}

// vec: as for launch_rotary, and additionally (16-bit pools) every k/v/cache row start 16-byte
// aligned. C: the pool's element type, T or an FP8 type (then kv.fp8_vec8 says how rows move).
template <typename T, typename IdxT, typename C = T>
cudaError_t launch_rotary_store_kv(const RotaryParams& p, const KvRowTarget& kv, bool vec,
                                   cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int n = vec ? 16 / (int)sizeof(T) : 1;
  const int64_t rope_work = (p.num_q_heads + p.num_kv_heads) * (p.rotary_dim / 2 / n);
  const int64_t copy_work =
      fp8::is_fp8<C>() ? (kv.fp8_vec8 ? kv.row_elems / 8 : kv.row_elems) : kv.row_elems / n;
  const int64_t work = rope_work > copy_work ? rope_work : copy_work;
  int threads = 32;
  while (threads < work && threads < 512) threads *= 2;
  if (vec)
    rotary_store_kv_kernel<T, true, IdxT, C><<<(unsigned)p.num_tokens, threads, 0, stream>>>(p, kv);
  else
    rotary_store_kv_kernel<T, false, IdxT, C><<<(unsigned)p.num_tokens, threads, 0, stream>>>(p, kv);
  return cudaGetLastError();
}

// ----------------------------------------------------------------------------- silu_and_mul
//
// out[t, i] = silu(x[t, i]) * x[t, d + i]; silu(g) = g / (1 + exp(-g)). A 2-D grid (tokens x
// column chunks) so both many tokens and one wide token fill the chip.

template <typename T, bool VEC>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t d) {
  using A = Access<T, VEC>;
  constexpr int N = A::N;
  const int64_t t = blockIdx.y;
  const T* xr = x + t * 2 * d;
  T* orow = out + t * d;
  const int64_t chunks = d / N;
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < chunks;
       c += (int64_t)gridDim.x * blockDim.x) {
    float g[N], u[N];
    A::load(xr + c * N, g);
    A::load(xr + d + c * N, u);
#pragma unroll
    for (int i = 0; i < N; ++i) g[i] = g[i] / (1.f + __expf(-g[i])) * u[i];
    A::store(orow + c * N, g);
  }
}

template <typename T>
cudaError_t launch_silu_and_mul(void* out, const void* x, int64_t num_tokens, int64_t d, bool vec,
                                cudaStream_t stream) {
  if (num_tokens == 0 || d == 0) return cudaSuccess;
  const int64_t chunks = vec ? d / (16 / (int64_t)sizeof(T)) : d;
  const int threads = 256;
  int64_t gx = (chunks + threads - 1) / threads;
  if (gx > 1024) gx = 1024;
  int64_t gy = num_tokens;
  // gridDim.y is limited to 65535: fold extra tokens into launches of at most that many rows.
  for (int64_t t0 = 0; t0 < gy; t0 += 65535) {
    const int64_t rows = gy - t0 < 65535 ? gy - t0 : 65535;
    const dim3 grid((unsigned)gx, (unsigned)rows);
    T* o = static_cast<T*>(out) + t0 * d;
    const T* xi = static_cast<const T*>(x) + t0 * 2 * d;
    if (vec)
      silu_and_mul_kernel<T, true><<<grid, threads, 0, stream>>>(o, xi, d);
    else
      silu_and_mul_kernel<T, false><<<grid, threads, 0, stream>>>(o, xi, d);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace elementwise
}  // namespace radixserve
