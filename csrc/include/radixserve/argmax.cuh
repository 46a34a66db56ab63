// Row-wise argmax of float32 logits [rows, vocab] for greedy decoding: the first index of the
// row's maximum (torch.argmax's rule; a NaN counts as larger than every number, the first NaN
// wins). Header-only, no torch.
//
// Why: torch's argmax reduces a row in one CTA; at batch 1 that was 36 us for a 128,256-entry
// row on the H200, 9x a read of the row (bench/results/decode-profile-h200-bs1.json). Here a
// row is split over up to kMaxSplits CTAs, each reducing its slice to one 64-bit key
// (order-preserving bits of the value << 32 | ~index, so the largest key is the largest value
// at the smallest index), and a second one-warp kernel reduces a row's keys. With one split
// the first kernel writes the index itself.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace radixserve {
namespace argmax {

constexpr int kThreads = 256;
constexpr int kMaxSplits = 64;
constexpr int64_t kMinSplitLen = 2048;   // elements: below this a split is mostly launch cost

struct ArgmaxParams {
  const float* logits;     // [rows, vocab], row stride `stride` elements
  int64_t stride;
  int64_t rows;
  int64_t vocab;           // < 2^31
  int splits;              // CTAs per row, 1..kMaxSplits
  int64_t split_len;       // elements per split (a multiple of 4)
  uint64_t* keys;          // [rows, splits] (splits > 1), else unused
  int64_t* out;            // [rows] int64
};

// The value's bits mapped so that unsigned order is float order; every NaN maps to the top.
__device__ __forceinline__ uint32_t ordered_bits(float v) {
  if (v != v) return 0xffffffffu;
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint64_t make_key(float v, int64_t idx) {
  return ((uint64_t)ordered_bits(v) << 32) | (uint32_t)(0xffffffffu - (uint32_t)idx);
}

__device__ __forceinline__ int64_t key_index(uint64_t key) {
  return (int64_t)(0xffffffffu - (uint32_t)(key & 0xffffffffu));
}

__device__ __forceinline__ uint64_t warp_max(uint64_t k) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const uint64_t o = __shfl_xor_sync(0xffffffffu, k, off);
    k = o > k ? o : k;
  }
  return k;
}

// grid (splits, rows): CTA (s, r) reduces row r's elements [s * split_len, (s + 1) * split_len).
template <bool VEC4>
__global__ void __launch_bounds__(kThreads) argmax_split_kernel(ArgmaxParams p) {
  __shared__ uint64_t warp_keys[kThreads / 32];
  const int64_t r = blockIdx.y;
  const int s = blockIdx.x;
  const float* row = p.logits + r * p.stride;
  const int64_t begin = (int64_t)s * p.split_len;
  const int64_t end = begin + p.split_len < p.vocab ? begin + p.split_len : p.vocab;
  uint64_t best = 0;  // below every real key
  if constexpr (VEC4) {
    // begin is a multiple of 4 and the row start 16-byte aligned (the host checks)
    for (int64_t i = begin + 4 * (int64_t)threadIdx.x; i < end; i += 4 * kThreads) {
      if (i + 4 <= end) {
        const float4 v = *reinterpret_cast<const float4*>(row + i);
        const uint64_t k0 = make_key(v.x, i), k1 = make_key(v.y, i + 1);
        const uint64_t k2 = make_key(v.z, i + 2), k3 = make_key(v.w, i + 3);
        const uint64_t a = k0 > k1 ? k0 : k1, b = k2 > k3 ? k2 : k3;
        const uint64_t m = a > b ? a : b;
        best = m > best ? m : best;
      } else {
        for (int64_t e = i; e < end; ++e) {
          const uint64_t k = make_key(row[e], e);
          best = k > best ? k : best;
        }
      }
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      const uint64_t k = make_key(row[i], i);
      best = k > best ? k : best;
    }
  }
  best = warp_max(best);
  if ((threadIdx.x & 31) == 0) warp_keys[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x >= 32) return;
  best = threadIdx.x < kThreads / 32 ? warp_keys[threadIdx.x] : 0;
  best = warp_max(best);
  if (threadIdx.x != 0) return;
  if (p.splits == 1)
    p.out[r] = key_index(best);
  else
    p.keys[r * p.splits + s] = best;
}

// grid (rows), one warp: the row's split keys -> its index.
__global__ void argmax_merge_kernel(ArgmaxParams p) {
  const int64_t r = blockIdx.x;
  uint64_t best = 0;
  for (int s = threadIdx.x; s < p.splits; s += 32) {
    const uint64_t k = p.keys[r * p.splits + s];
    best = k > best ? k : best;
  }
  best = warp_max(best);
  if (threadIdx.x == 0) p.out[r] = key_index(best);
}

// Splits per row: enough CTAs for about two per SM over the batch, each at least kMinSplitLen
// elements, at most kMaxSplits.
inline int choose_splits(int64_t rows, int64_t vocab, int num_sms) {
  const int64_t by_len = (vocab + kMinSplitLen - 1) / kMinSplitLen;
  const int64_t by_fill = (2 * (int64_t)num_sms + rows - 1) / rows;
  int64_t s = by_len < by_fill ? by_len : by_fill;
  if (s > kMaxSplits) s = kMaxSplits;
  return s < 1 ? 1 : (int)s;
}

// p.splits, p.split_len and p.keys set by the caller (keys: rows * splits entries when splits > 1).
inline cudaError_t launch_argmax(const ArgmaxParams& p, bool vec4, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const dim3 grid((unsigned)p.splits, (unsigned)p.rows);
  if (vec4)
    argmax_split_kernel<true><<<grid, kThreads, 0, stream>>>(p);
  else
    argmax_split_kernel<false><<<grid, kThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.splits == 1) return err;
  argmax_merge_kernel<<<(unsigned)p.rows, 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace argmax
}  // namespace radixserve
