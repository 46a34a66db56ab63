// rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul: input checks, dtype dispatch,
// launch on the current stream. Kernels: csrc/include/radixserve/elementwise.cuh.
#include <string>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ops/check.h"
#include "ops/fp8_kv.h"
#include "ops/ops.h"
#include "radixserve/elementwise.cuh"

namespace radixserve {
namespace {

namespace ew = radixserve::elementwise;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto d = t.scalar_type();
  RS_CHECK(d == at::kBFloat16 || d == at::kHalf || d == at::kFloat, name,
              " must be bf16, fp16 or fp32, got ", d);
}

void check_on(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  RS_CHECK(t.is_cuda() && t.device() == ref.device(), name, " must be a CUDA tensor on ",
              ref.device());
}

#define RS_DISPATCH(dtype, ...)                                          \
  [&] {                                                                  \
    switch (dtype) {                                                     \
      case at::kBFloat16: { using T = __nv_bfloat16; return __VA_ARGS__(); } \
      case at::kHalf: { using T = __half; return __VA_ARGS__(); }        \
      default: { using T = float; return __VA_ARGS__(); }                \
    }                                                                    \
  }()

void check_err(cudaError_t err, const char* what) {
  RS_CHECK(err == cudaSuccess, what, " launch failed: ", cudaGetErrorString(err));
}

void rms_norm_impl(at::Tensor out, const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight,
                   double eps) {
  const int64_t hidden = x.size(1);
  ew::RmsNormParams p;
  p.out = out.data_ptr();
  p.out_stride = out.stride(0);
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.residual = residual ? residual->data_ptr() : nullptr;
  p.res_stride = residual ? residual->stride(0) : 0;
  p.weight = weight.data_ptr();
  p.num_tokens = x.size(0);
  p.hidden = hidden;
  p.eps = static_cast<float>(eps);
  const int64_t es = x.element_size();
  bool vec = (hidden * es) % 16 == 0 && (p.out_stride * es) % 16 == 0 && (p.x_stride * es) % 16 == 0 &&
             aligned16(p.out) && aligned16(p.x) && aligned16(p.weight);
  if (residual) {
    const int64_t res_es = residual->element_size();
    vec = vec && (p.res_stride * res_es) % 16 == 0 && aligned16(p.residual);
  }
  // an fp32 residual beside a bf16/fp16 x (half-precision models keep the residual stream fp32)
  const bool res_f32 = residual && residual->scalar_type() == at::kFloat;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaError_t err = RS_DISPATCH(x.scalar_type(), [&] {
    if (!residual) return ew::launch_rms_norm<T, false>(p, vec, stream);
    return res_f32 ? ew::launch_rms_norm<T, true, float>(p, vec, stream)
                   : ew::launch_rms_norm<T, true, T>(p, vec, stream);
  });
  check_err(err, residual ? "fused_add_rms_norm" : "rms_norm");
}

void check_norm_inputs(const at::Tensor& x, const at::Tensor& weight) {
  check_on(x, "x", x);
  check_on(weight, "weight", x);
  check_float_dtype(x, "x");
  RS_CHECK(x.dim() == 2, "x must be [num_tokens, hidden], got ", x.sizes());
  RS_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  RS_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [hidden=", x.size(1),
              "], got ", weight.sizes());
  RS_CHECK(weight.scalar_type() == x.scalar_type(), "weight dtype ", weight.scalar_type(),
              " must equal x dtype ", x.scalar_type());
  RS_CHECK(weight.is_contiguous(), "weight must be contiguous");
  RS_CHECK(x.size(0) < (1LL << 31), "too many tokens");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_inputs(x, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({x.size(0), x.size(1)}, x.options());  // [num_tokens, hidden]
  if (x.numel() == 0) return out;
  rms_norm_impl(out, x, nullptr, weight, eps);
  return out;
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_norm_inputs(x, weight);
  check_on(residual, "residual", x);
  RS_CHECK(x.is_contiguous() && residual.is_contiguous(), "x and residual must be contiguous");
  RS_CHECK(residual.sizes() == x.sizes(), "residual shape ", residual.sizes(), " must equal x shape ",
              x.sizes());
  RS_CHECK(residual.scalar_type() == x.scalar_type() || residual.scalar_type() == at::kFloat,
           "residual dtype must equal x dtype (", x.scalar_type(), ") or be float32, got ",
           residual.scalar_type());
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  rms_norm_impl(x, x, &residual, weight, eps);
}

namespace {

// Checks rotary_embedding's inputs and fills its params; *vec: the 16-byte path applies.
ew::RotaryParams rotary_params(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& cos_sin_cache, bool* vec) {
  check_on(q, "q", q);
  check_on(k, "k", q);
  check_on(positions, "positions", q);
  check_on(cos_sin_cache, "cos_sin_cache", q);
  check_float_dtype(q, "q");
  RS_CHECK(k.scalar_type() == q.scalar_type(), "k dtype must equal q dtype");
  RS_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be a contiguous int64 [num_tokens] tensor");
  const int64_t num_tokens = positions.size(0);
  RS_CHECK(q.dim() == 3 && k.dim() == 3, "q, k must be [num_tokens, heads, head_dim]");
  RS_CHECK(q.size(0) == num_tokens && k.size(0) == num_tokens, "q, k must have num_tokens=",
              num_tokens, " rows");
  RS_CHECK(q.size(2) == k.size(2), "q and k head_dim differ");
  RS_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q, k last dim must be contiguous");
  RS_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.scalar_type() == at::kFloat &&
                  cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be a contiguous float32 [max_pos, rotary_dim] tensor");
  const int64_t rotary_dim = cos_sin_cache.size(1);
  RS_CHECK(rotary_dim % 2 == 0 && rotary_dim >= 2 && rotary_dim <= q.size(2),
              "rotary_dim must be even and <= head_dim, got ", rotary_dim);
  RS_CHECK(num_tokens < (1LL << 31), "too many tokens");
  ew::RotaryParams p;
  p.positions = positions.data_ptr<int64_t>();
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.cos_sin_cache = cos_sin_cache.data_ptr<float>();
  p.num_tokens = num_tokens;
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_stride_t = k.stride(0);
  p.k_stride_h = k.stride(1);
  p.num_q_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = static_cast<int>(k.size(1));
  p.rotary_dim = static_cast<int>(rotary_dim);
  p.max_pos = cos_sin_cache.size(0);
  const int64_t es = q.element_size();
  const int64_t n = 16 / es;
  *vec = (rotary_dim / 2) % n == 0 && p.q_stride_t % n == 0 && p.q_stride_h % n == 0 &&
         p.k_stride_t % n == 0 && p.k_stride_h % n == 0 && aligned16(p.q) && aligned16(p.k);
  return p;
}

// k or v of rotary_embedding_store_kv: [num_tokens, num_kv_heads, head_dim] like the cache, each
// token's row contiguous across heads.
void check_kv_row_view(const at::Tensor& t, const char* name, int64_t num_tokens, const at::Tensor& cache) {
  check_on(t, name, cache);
  RS_CHECK(t.dim() == 3 && t.size(0) == num_tokens && t.size(1) == cache.size(1) &&
               t.size(2) == cache.size(2),
           name, " must be [num_tokens, num_kv_heads, head_dim] = [", num_tokens, ", ",
           cache.size(1), ", ", cache.size(2), "]");
  RS_CHECK(t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2)), name,
           " rows ([num_kv_heads, head_dim]) must be contiguous");
  RS_CHECK(t.scalar_type() == cache.scalar_type() || is_fp8_kv_dtype(cache.scalar_type()), name,
           " dtype must equal the cache dtype (or the cache be FP8)");
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor q, at::Tensor k,
                      const at::Tensor& cos_sin_cache) {
  bool vec = false;
  const ew::RotaryParams p = rotary_params(positions, q, k, cos_sin_cache, &vec);
  if (p.num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaError_t err = RS_DISPATCH(q.scalar_type(), [&] { return ew::launch_rotary<T>(p, vec, stream); });
  check_err(err, "rotary_embedding");
}

void rotary_embedding_store_kv(const at::Tensor& positions, at::Tensor q, at::Tensor k,
                               const at::Tensor& v, const at::Tensor& cos_sin_cache,
                               at::Tensor k_cache, at::Tensor v_cache,
                               const at::Tensor& slot_indices, double k_scale, double v_scale) {
  bool vec = false;
  const ew::RotaryParams p = rotary_params(positions, q, k, cos_sin_cache, &vec);
  check_on(k_cache, "k_cache", q);
  check_on(v_cache, "v_cache", q);
  check_on(slot_indices, "slot_indices", q);
  RS_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
               v_cache.is_contiguous(),
           "k_cache, v_cache must be contiguous [num_slots, num_kv_heads, head_dim] of one shape");
  RS_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  const int64_t num_tokens = p.num_tokens;
  check_kv_row_view(k, "k", num_tokens, k_cache);
  check_kv_row_view(v, "v", num_tokens, k_cache);
  RS_CHECK(slot_indices.dim() == 1 && slot_indices.size(0) == num_tokens &&
               slot_indices.is_contiguous() &&
               (slot_indices.scalar_type() == at::kInt || slot_indices.scalar_type() == at::kLong),
           "slot_indices must be a contiguous int32/int64 [num_tokens] tensor");
  if (num_tokens == 0) return;
  ew::KvRowTarget kv;
  kv.k_cache = k_cache.data_ptr();
  kv.v_cache = v_cache.data_ptr();
  kv.v = v.data_ptr();
  kv.v_stride = v.stride(0);
  kv.slot_indices = slot_indices.data_ptr();
  kv.num_slots = k_cache.size(0);
  kv.row_elems = k_cache.size(1) * k_cache.size(2);
  const int64_t n = 16 / q.element_size();
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool i64 = slot_indices.scalar_type() == at::kLong;
  const auto cache_dtype = k_cache.scalar_type();
  if (is_fp8_kv_dtype(cache_dtype)) {
    // vec (the rotation's 16-byte vectors) stays as rotary_params said; the FP8 rows move in
    // groups of 8 where the k / v rows are 16-byte aligned and the pool rows 8-byte aligned
    kv.k_inv_scale = fp8_inv_scale(k_scale, "k_scale");
    kv.v_inv_scale = fp8_inv_scale(v_scale, "v_scale");
    const int64_t es = q.element_size();
    kv.fp8_vec8 = kv.row_elems % 8 == 0 && (p.k_stride_t * es) % 16 == 0 &&
                  (kv.v_stride * es) % 16 == 0 && aligned16(p.k) && aligned16(kv.v) &&
                  (reinterpret_cast<uintptr_t>(kv.k_cache) & 7) == 0 &&
                  (reinterpret_cast<uintptr_t>(kv.v_cache) & 7) == 0;
    const bool e4m3 = cache_dtype == at::kFloat8_e4m3fn;
    cudaError_t err = RS_DISPATCH(q.scalar_type(), [&] {
      if (e4m3)
        return i64 ? ew::launch_rotary_store_kv<T, int64_t, __nv_fp8_e4m3>(p, kv, vec, stream)
                   : ew::launch_rotary_store_kv<T, int32_t, __nv_fp8_e4m3>(p, kv, vec, stream);
      return i64 ? ew::launch_rotary_store_kv<T, int64_t, __nv_fp8_e5m2>(p, kv, vec, stream)
                 : ew::launch_rotary_store_kv<T, int32_t, __nv_fp8_e5m2>(p, kv, vec, stream);
    });
    check_err(err, "rotary_embedding_store_kv");
    return;
  }
  vec = vec && kv.row_elems % n == 0 && kv.v_stride % n == 0 && aligned16(kv.v) &&
        aligned16(kv.k_cache) && aligned16(kv.v_cache);
  cudaError_t err = RS_DISPATCH(q.scalar_type(), [&] {
    return i64 ? ew::launch_rotary_store_kv<T, int64_t>(p, kv, vec, stream)
               : ew::launch_rotary_store_kv<T, int32_t>(p, kv, vec, stream);
  });
  check_err(err, "rotary_embedding_store_kv");
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_on(x, "x", x);
  check_float_dtype(x, "x");
  RS_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [num_tokens, 2 * inter], got ", x.sizes());
  RS_CHECK(x.is_contiguous(), "x must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t d = x.size(1) / 2;
  auto out = at::empty({x.size(0), d}, x.options());  // [num_tokens, inter]
  if (out.numel() == 0) return out;
  const int64_t es = x.element_size();
  const bool vec = (d * es) % 16 == 0 && aligned16(x.data_ptr()) && aligned16(out.data_ptr());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaError_t err = RS_DISPATCH(x.scalar_type(), [&] {
    return ew::launch_silu_and_mul<T>(out.data_ptr(), x.data_ptr(), x.size(0), d, vec, stream);
  });
  check_err(err, "silu_and_mul");
  return out;
}

}  // namespace radixserve
