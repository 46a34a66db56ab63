// store_kv and build_kv_indices: input checks, dtype dispatch, launch on the current stream.
// store_kv into an FP8 pool quantizes (fp8_kv.cuh): bf16/fp16/fp32 k / v, fp32 1 / scale.
// Kernels: csrc/include/radixserve/kv.cuh. Contracts: pysrc/radixserve/ops/__init__.py.
#include <string>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "ops/check.h"
#include "ops/fp8_kv.h"
#include "ops/ops.h"
#include "radixserve/kv.cuh"

namespace radixserve {
namespace {

void check_cuda(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  RS_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  RS_CHECK(t.device() == ref.device(), name, " must be on ", ref.device(), ", got ", t.device());
}

// k or v: [num_tokens, num_kv_heads, head_dim] matching the cache, each token's row contiguous.
void check_kv_rows(const at::Tensor& t, const char* name, int64_t num_tokens, const at::Tensor& cache) {
  const bool shape_ok = t.dim() == 3 && t.size(0) == num_tokens && t.size(1) == cache.size(1) &&
                        t.size(2) == cache.size(2);
  RS_CHECK(shape_ok, name, " must be [num_tokens, num_kv_heads, head_dim] = [", num_tokens, ", ",
              cache.size(1), ", ", cache.size(2), "]");
  const bool rows_ok = t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2));
  RS_CHECK(rows_ok, name, " rows ([num_kv_heads, head_dim]) must be contiguous");
}

void check_index_vector(const at::Tensor& t, const char* name) {
  RS_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
              " must be int32 or int64");
  RS_CHECK(t.is_contiguous(), name, " must be contiguous");
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <typename T>
void store_kv_typed(kv::StoreKvParams& p, const at::Tensor& slot_indices, bool vec16,
                    cudaStream_t stream) {
  cudaError_t err;
  if (slot_indices.scalar_type() == at::kInt)
    err = kv::launch_store_kv<T, int32_t>(p, vec16, stream);
  else
    err = kv::launch_store_kv<T, int64_t>(p, vec16, stream);
  RS_CHECK(err == cudaSuccess, "store_kv launch failed: ", cudaGetErrorString(err));
}

template <typename F8>
void store_kv_fp8_typed(kv::StoreKvParams& p, at::ScalarType in_dtype,
                        const at::Tensor& slot_indices, bool vec8, cudaStream_t stream) {
  const bool i32 = slot_indices.scalar_type() == at::kInt;
  cudaError_t err;
  switch (in_dtype) {
    case at::kBFloat16:
      err = i32 ? kv::launch_store_kv_fp8<__nv_bfloat16, F8, int32_t>(p, vec8, stream)
                : kv::launch_store_kv_fp8<__nv_bfloat16, F8, int64_t>(p, vec8, stream);
      break;
    case at::kHalf:
      err = i32 ? kv::launch_store_kv_fp8<__half, F8, int32_t>(p, vec8, stream)
                : kv::launch_store_kv_fp8<__half, F8, int64_t>(p, vec8, stream);
      break;
    default:
      err = i32 ? kv::launch_store_kv_fp8<float, F8, int32_t>(p, vec8, stream)
                : kv::launch_store_kv_fp8<float, F8, int64_t>(p, vec8, stream);
      break;
  }
  RS_CHECK(err == cudaSuccess, "store_kv launch failed: ", cudaGetErrorString(err));
}

bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7) == 0; }

}  // namespace

void store_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_indices, double k_scale, double v_scale) {
  check_cuda(k_cache, "k_cache", k_cache);
  check_cuda(v_cache, "v_cache", k_cache);
  check_cuda(k, "k", k_cache);
  check_cuda(v, "v", k_cache);
  check_cuda(slot_indices, "slot_indices", k_cache);
  RS_CHECK(k_cache.dim() == 3, "k_cache must be [num_slots, num_kv_heads, head_dim], got ",
              k_cache.sizes());
  RS_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache shape ", v_cache.sizes(),
              " must equal k_cache shape ", k_cache.sizes());
  RS_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache/v_cache must be contiguous");
  const auto dtype = k_cache.scalar_type();
  const bool fp8 = is_fp8_kv_dtype(dtype);
  RS_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat || fp8,
              "store_kv: cache dtype must be bf16, fp16, fp32 or float8_e4m3fn / float8_e5m2, "
              "got ", dtype);
  RS_CHECK(v_cache.scalar_type() == dtype, "store_kv: k_cache and v_cache dtypes differ");
  if (fp8) {
    const auto in = k.scalar_type();
    RS_CHECK((in == at::kBFloat16 || in == at::kHalf || in == at::kFloat) &&
                 v.scalar_type() == in,
             "store_kv: an FP8 cache takes k and v of one dtype, bf16, fp16 or fp32");
  } else {
    RS_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype,
             "store_kv: k, v, k_cache, v_cache must share one dtype");
  }
  const int64_t num_tokens = slot_indices.size(0);
  RS_CHECK(slot_indices.dim() == 1, "slot_indices must be 1-D [num_tokens]");
  RS_CHECK(slot_indices.scalar_type() == at::kInt || slot_indices.scalar_type() == at::kLong,
              "slot_indices must be int32 or int64, got ", slot_indices.scalar_type());
  RS_CHECK(slot_indices.is_contiguous(), "slot_indices must be contiguous");
  check_kv_rows(k, "k", num_tokens, k_cache);
  check_kv_rows(v, "v", num_tokens, k_cache);
  if (num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  kv::StoreKvParams p;
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.slot_indices = slot_indices.data_ptr();
  p.num_tokens = num_tokens;
  p.num_slots = k_cache.size(0);
  p.row_elems = k_cache.size(1) * k_cache.size(2);
  p.k_stride = k.stride(0);
  p.v_stride = v.stride(0);
  if (fp8) {
    p.k_inv_scale = fp8_inv_scale(k_scale, "k_scale");
    p.v_inv_scale = fp8_inv_scale(v_scale, "v_scale");
    const int64_t in_size = k.element_size();
    const bool vec8 = p.row_elems % 8 == 0 && (p.k_stride * in_size) % 16 == 0 &&
                      (p.v_stride * in_size) % 16 == 0 && aligned16(p.k) && aligned16(p.v) &&
                      aligned8(p.k_cache) && aligned8(p.v_cache);
    if (dtype == at::kFloat8_e4m3fn)
      store_kv_fp8_typed<__nv_fp8_e4m3>(p, k.scalar_type(), slot_indices, vec8, stream);
    else
      store_kv_fp8_typed<__nv_fp8_e5m2>(p, k.scalar_type(), slot_indices, vec8, stream);
    return;
  }
  const int64_t esize = k_cache.element_size();
  const bool vec16 = (p.row_elems * esize) % 16 == 0 && (p.k_stride * esize) % 16 == 0 &&
                     (p.v_stride * esize) % 16 == 0 && aligned16(p.k_cache) &&
                     aligned16(p.v_cache) && aligned16(p.k) && aligned16(p.v);
  switch (dtype) {
    case at::kBFloat16: store_kv_typed<__nv_bfloat16>(p, slot_indices, vec16, stream); break;
    case at::kHalf: store_kv_typed<__half>(p, slot_indices, vec16, stream); break;
    default: store_kv_typed<float>(p, slot_indices, vec16, stream); break;
  }
}

void build_kv_indices(const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                      const at::Tensor& seq_lens, at::Tensor kv_indptr, at::Tensor kv_indices) {
  check_cuda(req_to_token, "req_to_token", req_to_token);
  check_cuda(req_pool_indices, "req_pool_indices", req_to_token);
  check_cuda(seq_lens, "seq_lens", req_to_token);
  check_cuda(kv_indptr, "kv_indptr", req_to_token);
  check_cuda(kv_indices, "kv_indices", req_to_token);
  RS_CHECK(req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kInt,
              "req_to_token must be [max_reqs, max_context_len] int32");
  RS_CHECK(req_to_token.stride(1) == 1, "req_to_token rows must be contiguous");
  RS_CHECK(req_pool_indices.dim() == 1 && seq_lens.dim() == 1 &&
                  req_pool_indices.size(0) == seq_lens.size(0),
              "req_pool_indices and seq_lens must be [batch]");
  check_index_vector(req_pool_indices, "req_pool_indices");
  check_index_vector(seq_lens, "seq_lens");
  const int64_t batch = seq_lens.size(0);
  RS_CHECK(batch < (1LL << 31), "batch too large");
  RS_CHECK(kv_indptr.dim() == 1 && kv_indptr.size(0) == batch + 1 &&
                  kv_indptr.scalar_type() == at::kInt && kv_indptr.is_contiguous(),
              "kv_indptr must be a contiguous int32 [batch + 1] tensor");
  RS_CHECK(kv_indices.dim() == 1 && kv_indices.scalar_type() == at::kInt &&
                  kv_indices.is_contiguous(),
              "kv_indices must be a contiguous 1-D int32 tensor");
  const c10::cuda::CUDAGuard guard(req_to_token.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  kv::BuildKvIndicesParams p;
  p.req_to_token = req_to_token.data_ptr<int32_t>();
  p.req_to_token_stride = req_to_token.stride(0);
  p.req_pool_indices = req_pool_indices.data_ptr();
  p.seq_lens = seq_lens.data_ptr();
  p.kv_indptr = kv_indptr.data_ptr<int32_t>();
  p.kv_indices = kv_indices.data_ptr<int32_t>();
  p.batch = batch;
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const bool pool32 = req_pool_indices.scalar_type() == at::kInt;
  const bool len32 = seq_lens.scalar_type() == at::kInt;
  cudaError_t err;
  if (pool32 && len32) err = kv::launch_build_kv_indices<int32_t, int32_t>(p, num_sms, stream);
  else if (pool32) err = kv::launch_build_kv_indices<int32_t, int64_t>(p, num_sms, stream);
  else if (len32) err = kv::launch_build_kv_indices<int64_t, int32_t>(p, num_sms, stream);
  else err = kv::launch_build_kv_indices<int64_t, int64_t>(p, num_sms, stream);
  RS_CHECK(err == cudaSuccess, "build_kv_indices launch failed: ", cudaGetErrorString(err));
}

}  // namespace radixserve
