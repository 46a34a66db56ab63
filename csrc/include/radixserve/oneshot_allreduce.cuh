// One-shot all-reduce for small messages (issue 37, point 3): N <= 8 ranks of ONE process, each
// on its GPU (or, for tests, all on one GPU), every rank's staging buffer and signal area
// reachable from every rank's kernels through peer access (cudaDeviceEnablePeerAccess + UVA: a
// device pointer of GPU p is dereferenced by GPU r as is, over NVLink / PCIe). Torch-free.
//
// Per rank r, registered once (csrc/ops/oneshot_allreduce.cu):
//   buffers[r]  2 * capacity bytes on r's GPU: two staging halves, used by epoch parity
//   signals[r]  a Signal on r's GPU (zeroed before first use)
//
// One call on rank r (all ranks launch the same call with the same numel and dtype, in the same
// order; the grid is the same fixed number of CTAs on every rank and every call):
//   CTA b of rank r
//   0. epoch = ++signals[r]->epoch[b] (kept in device memory, read and written only by CTA b of
//      rank r's own kernels: CUDA-graph replays advance it with no host argument).
//   1. copies its part of the input (grid-stride over 16-byte vectors; the sub-16-byte tail
//      belongs to CTA 0) into half (epoch & 1) of buffers[r];
//   2. __syncthreads, then thread p (p < N) stores `epoch` into signals[p]->start[b][r] with a
//      system-scope release store ("CTA b of rank r has staged epoch's data");
//   3. thread p (p < N) spins with system-scope acquire loads until signals[r]->start[b][p]
//      has reached epoch (wrap-safe: (int32)(flag - epoch) >= 0), then __syncthreads;
//   4. reads the same part of half (epoch & 1) of every buffers[p], p = 0..N-1 with 16-byte
//      loads, sums in fp32 in rank order (acc = x0; acc += x1; ...), rounds once to T and
//      writes the output. Every rank does the same float operations in the same order on the
//      same bits: the results are bit-identical on every rank (and equal to
//      ThreadGroup.all_reduce's fp32 rank-order sum).
//   5. thread 0 stores epoch into signals[r]->epoch[b].
//
// Why it is correct (memory ordering):
//  * Data before flag. CTA b of peer p writes its staged part with plain stores, bar.sync
//    (__syncthreads) orders those stores before the release store of its signalling thread, and
//    st.release.sys makes everything that precedes it (in causality order, which bar.sync
//    extends to the whole CTA) visible at system scope before the flag. Our waiting thread's
//    ld.acquire.sys that observes the flag, followed by our bar.sync, orders every later load of
//    our CTA after it. So CTA b of rank r reads peer p's staged part only after it is complete.
//    Peer data is read with ld.global.cg (L2, not L1): nothing of a peer's buffer is reused
//    within a call, and no line of it can linger stale in our L1 from an earlier call.
//  * The partition is the same everywhere. Element i is staged and read by the same CTA index
//    on every rank (same grid, same numel), so CTA b's barrier covers exactly the data CTA b
//    reads: no grid-wide barrier is needed, and CTAs wait only for their counterparts.
//  * No overwrite while a peer reads (double buffering instead of a second barrier). Rank r's
//    call e + 2 overwrites half (e & 1) of buffers[r]. Peer p's CTA b read that part in its call
//    e. Rank r's CTA b only reaches call e + 2 after its call e + 1 passed step 3, i.e. after
//    CTA b of p signalled e + 1, which p's kernel e + 1 does only after its kernel e finished
//    (stream order), all its loads of half (e & 1) included. Call e + 1 writes the other half.
//  * Flags never need a reset. While CTA b of r waits for epoch e, peer p's flag there is e - 1
//    (not arrived), e, or already e + 1 (p finished e and signalled e + 1 before we looked), but
//    never e + 2 (p's call e + 1 waits for our e + 1). Hence ">= e", not "== e".
//  * Counters stay in step: every rank runs the same sequence of calls with the same grid, so
//    epoch[b] is the same on every rank at every call; a graph replay or an eager call both
//    advance it by one. After an abort (a rank failed and never launched its call) they are out
//    of step: the host sets `abort` (word 0 of each Signal, on a side stream) to release any CTA
//    still spinning, synchronizes, and zeroes the signal areas (OneShotAllReduce.reset).
//
// All ranks' kernels must be resident at once (they spin on each other): the grid is small
// (kMaxBlocks CTAs at most per rank), so even N ranks emulated on one GPU fit.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace radixserve {
namespace oneshot {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 32;
constexpr int kThreads = 512;

// A rank's signal area: one per rank, on its GPU, zeroed before first use. Layout is part of the
// Python contract only through "word 0 is the abort word" and "all zeros is the initial state".
struct alignas(128) Signal {
  uint32_t abort;                               // nonzero: stop spinning (set by the host)
  uint32_t pad0[31];
  uint32_t epoch[kMaxBlocks];                   // calls this rank's CTA b has completed
  uint32_t start[kMaxBlocks][kMaxRanks];        // start[b][p]: last epoch CTA b of rank p staged
};

struct Params {
  void* buffers[kMaxRanks];     // rank p's staging buffer: halves [0, capacity), [capacity, 2c)
  Signal* signals[kMaxRanks];   // rank p's signal area
  const void* input;            // this rank's input (16-byte aligned), on this rank's GPU
  void* output;                 // this rank's output (16-byte aligned)
  int64_t numel;                // elements (numel * sizeof(T) <= capacity)
  int64_t capacity;             // bytes of one half (a multiple of 16)
  int rank;
};

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_volatile(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// 16 bytes <-> kPer floats
template <typename T>
struct Vec;

template <>
struct Vec<float> {
  static constexpr int kPer = 4;
  __device__ __forceinline__ static void load(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static uint4 store(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
  __device__ __forceinline__ static float to_float(float x) { return x; }
  __device__ __forceinline__ static float from_float(float x) { return x; }
};

template <>
struct Vec<__nv_bfloat16> {
  static constexpr int kPer = 8;
  __device__ __forceinline__ static void load(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&w[i]);
      const float2 p = __bfloat1622float2(h);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  __device__ __forceinline__ static uint4 store(const float* f) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
};

template <>
struct Vec<__half> {
  static constexpr int kPer = 8;
  __device__ __forceinline__ static void load(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h = *reinterpret_cast<const __half2*>(&w[i]);
      const float2 p = __half22float2(h);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  __device__ __forceinline__ static uint4 store(const float* f) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
};

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) oneshot_allreduce_kernel(const Params p) {
  using V = Vec<T>;
  constexpr int kPer = V::kPer;
  __shared__ uint32_t s_epoch;

  Signal* const self = p.signals[p.rank];
  const int b = blockIdx.x;
  const int tid = threadIdx.x;

  // 0. this call's epoch for CTA b (written back in step 5, after every use)
  if (tid == 0) s_epoch = self->epoch[b] + 1;
  __syncthreads();
  const uint32_t epoch = s_epoch;
  const int64_t half = (epoch & 1) ? p.capacity : 0;

  const int64_t nvec = p.numel / kPer;
  const int64_t tail_begin = nvec * kPer;
  const int64_t first = static_cast<int64_t>(b) * blockDim.x + tid;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;

  // 1. stage this CTA's part of the input in our half
  {
    const uint4* in = static_cast<const uint4*>(p.input);
    uint4* mine = reinterpret_cast<uint4*>(static_cast<char*>(p.buffers[p.rank]) + half);
    for (int64_t i = first; i < nvec; i += stride) mine[i] = in[i];
    if (b == 0) {
      const T* in_t = static_cast<const T*>(p.input);
      T* mine_t = reinterpret_cast<T*>(mine);
      for (int64_t j = tail_begin + tid; j < p.numel; j += blockDim.x) mine_t[j] = in_t[j];
    }
  }
  __syncthreads();

  // 2. + 3. signal every rank (ourselves included), wait for every rank
  if (tid < N) {
    st_release_sys(&p.signals[tid]->start[b][p.rank], epoch);
    const uint32_t* flag = &self->start[b][tid];
    while (static_cast<int32_t>(ld_acquire_sys(flag) - epoch) < 0) {
      if (ld_volatile(&self->abort) != 0) break;   // reset in progress: results are discarded
    }
  }
  __syncthreads();

  // 4. sum the N staged parts in rank order, in fp32
  const uint4* parts[N];
#pragma unroll
  for (int q = 0; q < N; ++q) {
    parts[q] = reinterpret_cast<const uint4*>(static_cast<const char*>(p.buffers[q]) + half);
  }
  uint4* out = static_cast<uint4*>(p.output);
  for (int64_t i = first; i < nvec; i += stride) {
    uint4 raw[N];
#pragma unroll
    for (int q = 0; q < N; ++q) raw[q] = __ldcg(parts[q] + i);   // all N loads in flight at once
    float acc[kPer];
    V::load(raw[0], acc);
#pragma unroll
    for (int q = 1; q < N; ++q) {
      float f[kPer];
      V::load(raw[q], f);
#pragma unroll
      for (int k = 0; k < kPer; ++k) acc[k] += f[k];
    }
    out[i] = V::store(acc);
  }
  if (b == 0) {
    T* out_t = static_cast<T*>(p.output);
    for (int64_t j = tail_begin + tid; j < p.numel; j += blockDim.x) {
      float acc = 0.f;
#pragma unroll
      for (int q = 0; q < N; ++q) {
        const T* part = reinterpret_cast<const T*>(parts[q]);
        // __ldcg has no 2-byte bf16/fp16 overload: load the containing 16-bit word
        T v;
        if constexpr (sizeof(T) == 2) {
          const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(part + j));
          v = *reinterpret_cast<const T*>(&bits);
        } else {
          v = __ldcg(part + j);
        }
        acc = q == 0 ? V::to_float(v) : acc + V::to_float(v);
      }
      out_t[j] = V::from_float(acc);
    }
  }

  // 5. this call is done for CTA b (nothing above reads self->epoch[b] after step 0)
  if (tid == 0) self->epoch[b] = epoch;
}

// Launches rank p.rank's share of one all-reduce on stream: `blocks` CTAs (1..kMaxBlocks, the
// same on every rank and every call of a registration), world ranks (2..kMaxRanks).
template <typename T>
cudaError_t launch_oneshot_allreduce(const Params& p, int world, int blocks, cudaStream_t stream) {
  if (world < 2 || world > kMaxRanks || blocks < 1 || blocks > kMaxBlocks) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(blocks), block(kThreads);
  switch (world) {
    case 2: oneshot_allreduce_kernel<T, 2><<<grid, block, 0, stream>>>(p); break;
    case 3: oneshot_allreduce_kernel<T, 3><<<grid, block, 0, stream>>>(p); break;
    case 4: oneshot_allreduce_kernel<T, 4><<<grid, block, 0, stream>>>(p); break;
    case 5: oneshot_allreduce_kernel<T, 5><<<grid, block, 0, stream>>>(p); break;
    case 6: oneshot_allreduce_kernel<T, 6><<<grid, block, 0, stream>>>(p); break;
    case 7: oneshot_allreduce_kernel<T, 7><<<grid, block, 0, stream>>>(p); break;
    default: oneshot_allreduce_kernel<T, 8><<<grid, block, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

}  // namespace oneshot
}  // namespace radixserve
