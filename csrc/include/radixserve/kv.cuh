// KV-pool kernels: store_kv (scatter new K/V rows into pool slots) and build_kv_indices
// (flatten a batch's token-to-slot rows into kv_indptr / kv_indices for attention).
// Header-only, no torch: csrc/ops/kv.cu validates inputs and launches; csrc/harness/test_kv.cu
// runs these templates standalone.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "radixserve/fp8_kv.cuh"

namespace radixserve {
namespace kv {

// ----------------------------------------------------------------------------- store_kv
//
// One CTA-row per token: k/v row t ([num_kv_heads * head_dim] elements, contiguous) is copied to
// k_cache/v_cache row slot_indices[t]. Rows are moved as 16-byte words when every row start is
// 16-byte aligned (VEC16), else element by element. Slots outside [0, num_slots) are skipped
// (a device-side guard; the host cannot check without a sync).
// An FP8 pool (store_kv_fp8_kernel) takes bf16/fp16/fp32 rows and stores each value times
// k_inv_scale / v_inv_scale (fp32 1 / scale), saturated (fp8_kv.cuh).

struct StoreKvParams {
  void* k_cache;             // [num_slots, row_elems]
  void* v_cache;             // [num_slots, row_elems]
  const void* k;             // [num_tokens, row_elems], token stride k_stride (elements)
  const void* v;             // [num_tokens, row_elems], token stride v_stride (elements)
  const void* slot_indices;  // [num_tokens] int32 or int64
  int64_t num_tokens;
  int64_t num_slots;
  int64_t row_elems;         // num_kv_heads * head_dim
  int64_t k_stride;
  int64_t v_stride;
  float k_inv_scale = 1.f;   // FP8 pools only: 1 / k_scale, 1 / v_scale (fp32)
  float v_inv_scale = 1.f;
};

// One token's k row and v row into their pool rows kd / vd, thread threadIdx.x of blockDim.x
// taking every blockDim.x-th 16-byte word (VEC16: every row start 16-byte aligned) or element.
// Shared by store_kv_kernel and rotary_store_kv_kernel (elementwise.cuh).
template <typename T, bool VEC16>
__device__ __forceinline__ void copy_kv_row(T* kd, T* vd, const T* ks, const T* vs,
                                            int64_t row_elems) {
  if constexpr (VEC16) {
    const int64_t words = row_elems * (int64_t)sizeof(T) / 16;
    const uint4* ks4 = reinterpret_cast<const uint4*>(ks);
    const uint4* vs4 = reinterpret_cast<const uint4*>(vs);
    uint4* kd4 = reinterpret_cast<uint4*>(kd);
    uint4* vd4 = reinterpret_cast<uint4*>(vd);
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) {
      const uint4 a = ks4[i];
      const uint4 b = vs4[i];
      kd4[i] = a;
      vd4[i] = b;
    }
  } else {
    for (int64_t i = threadIdx.x; i < row_elems; i += blockDim.x) {
      kd[i] = ks[i];
      vd[i] = vs[i];
    }
  }
}

template <typename T, typename IdxT, bool VEC16>
__global__ void store_kv_kernel(StoreKvParams p) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.y + threadIdx.y;
  if (t >= p.num_tokens) return;
  const int64_t slot = static_cast<int64_t>(static_cast<const IdxT*>(p.slot_indices)[t]);
  if (slot < 0 || slot >= p.num_slots) return;
  copy_kv_row<T, VEC16>(static_cast<T*>(p.k_cache) + slot * p.row_elems,
                        static_cast<T*>(p.v_cache) + slot * p.row_elems,
                        static_cast<const T*>(p.k) + t * p.k_stride,
                        static_cast<const T*>(p.v) + t * p.v_stride, p.row_elems);
}

// Threads along a row (x) and tokens per CTA (y), chosen so that one CTA moves >= ~4 KB.
inline dim3 store_kv_block(int64_t row_words) {
  int x = 32;
  while (x < row_words && x < 256) x *= 2;
  int y = 256 / x;
  return dim3(x, y < 1 ? 1 : y, 1);
}

template <typename T, typename IdxT>
cudaError_t launch_store_kv(const StoreKvParams& p, bool vec16, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int64_t row_words = vec16 ? p.row_elems * (int64_t)sizeof(T) / 16 : p.row_elems;
  const dim3 block = store_kv_block(row_words);
  const dim3 grid((unsigned)((p.num_tokens + block.y - 1) / block.y));
  if (vec16)
    store_kv_kernel<T, IdxT, true><<<grid, block, 0, stream>>>(p);
  else
    store_kv_kernel<T, IdxT, false><<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

// FP8 pool: row t quantized into row slot_indices[t] (fp8::quantize_kv_row; vec8: every k / v
// row start 16-byte aligned, every pool row 8-byte aligned, row_elems % 8 == 0).
template <typename T, typename F8, typename IdxT>
__global__ void store_kv_fp8_kernel(StoreKvParams p, bool vec8) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.y + threadIdx.y;
  if (t >= p.num_tokens) return;
  const int64_t slot = static_cast<int64_t>(static_cast<const IdxT*>(p.slot_indices)[t]);
  if (slot < 0 || slot >= p.num_slots) return;
  fp8::quantize_kv_row<T, F8>(static_cast<uint8_t*>(p.k_cache) + slot * p.row_elems,
                              static_cast<uint8_t*>(p.v_cache) + slot * p.row_elems,
                              static_cast<const T*>(p.k) + t * p.k_stride,
                              static_cast<const T*>(p.v) + t * p.v_stride, p.row_elems,
                              p.k_inv_scale, p.v_inv_scale, vec8);
}

// T: the dtype of k / v; F8: __nv_fp8_e4m3 or __nv_fp8_e5m2, the pool's.
template <typename T, typename F8, typename IdxT>
cudaError_t launch_store_kv_fp8(const StoreKvParams& p, bool vec8, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const dim3 block = store_kv_block(vec8 ? p.row_elems / 8 : p.row_elems);
  const dim3 grid((unsigned)((p.num_tokens + block.y - 1) / block.y));
  store_kv_fp8_kernel<T, F8, IdxT><<<grid, block, 0, stream>>>(p, vec8);
  return cudaGetLastError();
}

// ----------------------------------------------------------------------------- build_kv_indices
//
// Two kernels, no host round trip:
//  1. kv_indptr_kernel: one CTA of 1024 threads scans seq_lens in chunks of 1024 (block-level
//     exclusive scan, running carry) and writes kv_indptr[0..batch].
//  2. gather_kv_indices_kernel: grid (batch, ny); CTA (b, y) copies a strided share of
//     req_to_token[req_pool_indices[b], :seq_lens[b]] to kv_indices[kv_indptr[b]:], reading the
//     offset that kernel 1 wrote (stream order). ny is chosen on the host from the batch size only
//     (no knowledge of lengths needed), so the launch is graph-capturable.

constexpr int kScanThreads = 1024;

template <typename LenT>
__global__ void __launch_bounds__(kScanThreads) kv_indptr_kernel(const LenT* __restrict__ seq_lens,
                                                                  int32_t* __restrict__ kv_indptr,
                                                                  int64_t batch) {
  __shared__ int64_t warp_sums[kScanThreads / 32];
  __shared__ int64_t carry_s;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    carry_s = 0;
    kv_indptr[0] = 0;
  }
  __syncthreads();
  for (int64_t base = 0; base < batch; base += kScanThreads) {
    const int64_t i = base + threadIdx.x;
    const int64_t len = i < batch ? static_cast<int64_t>(seq_lens[i]) : 0;
    int64_t x = len;  // inclusive warp scan
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int64_t y = __shfl_up_sync(0xffffffffu, x, off);
      if (lane >= off) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int64_t w = warp_sums[lane];
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int64_t y = __shfl_up_sync(0xffffffffu, w, off);
        if (lane >= off) w += y;
      }
      warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int64_t carry = carry_s;
    const int64_t incl = carry + x + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (i < batch) kv_indptr[i + 1] = static_cast<int32_t>(incl);
    __syncthreads();
    if (threadIdx.x == kScanThreads - 1) carry_s = incl;
    __syncthreads();
  }
}

template <typename PoolIdxT, typename LenT>
__global__ void gather_kv_indices_kernel(const int32_t* __restrict__ req_to_token,
                                         int64_t req_to_token_stride,
                                         const PoolIdxT* __restrict__ req_pool_indices,
                                         const LenT* __restrict__ seq_lens,
                                         const int32_t* __restrict__ kv_indptr,
                                         int32_t* __restrict__ kv_indices) {
  const int64_t b = blockIdx.x;
  const int64_t len = static_cast<int64_t>(seq_lens[b]);
  const int64_t row = static_cast<int64_t>(req_pool_indices[b]);
  const int64_t out0 = kv_indptr[b];
  const int32_t* src = req_to_token + row * req_to_token_stride;
  int32_t* dst = kv_indices + out0;
  const int64_t step = (int64_t)gridDim.y * blockDim.x;
  for (int64_t j = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; j < len; j += step) dst[j] = src[j];
}

struct BuildKvIndicesParams {
  const int32_t* req_to_token;  // [max_reqs, max_context_len], row stride req_to_token_stride
  int64_t req_to_token_stride;
  const void* req_pool_indices;  // [batch] int32 or int64
  const void* seq_lens;          // [batch] int32 or int64
  int32_t* kv_indptr;            // [batch + 1]
  int32_t* kv_indices;           // [>= sum(seq_lens)]
  int64_t batch;
};

template <typename PoolIdxT, typename LenT>
cudaError_t launch_build_kv_indices(const BuildKvIndicesParams& p, int num_sms, cudaStream_t stream) {
  kv_indptr_kernel<LenT><<<1, kScanThreads, 0, stream>>>(static_cast<const LenT*>(p.seq_lens),
                                                         p.kv_indptr, p.batch);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.batch == 0) return err;
  // Enough CTAs to fill the chip whatever the lengths are: ~16 per SM in total.
  int64_t ny = (16LL * (num_sms > 0 ? num_sms : 132) + p.batch - 1) / p.batch;
  if (ny < 1) ny = 1;
  if (ny > 64) ny = 64;
  const dim3 grid((unsigned)p.batch, (unsigned)ny);
  gather_kv_indices_kernel<PoolIdxT, LenT><<<grid, 256, 0, stream>>>(
      p.req_to_token, p.req_to_token_stride, static_cast<const PoolIdxT*>(p.req_pool_indices),
      static_cast<const LenT*>(p.seq_lens), p.kv_indptr, p.kv_indices);
  return cudaGetLastError();
}

}  // namespace kv
}  // namespace radixserve
