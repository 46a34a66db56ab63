// skinny_linear: input checks, dtype dispatch, launch on the current stream.
// Kernel: csrc/include/radixserve/gemv.cuh. Contract: pysrc/radixserve/ops/__init__.py.
#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ops/check.h"
#include "ops/ops.h"
#include "radixserve/gemv.cuh"

namespace radixserve {
namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

void check_skinny_inputs(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, bool gated) {
  RS_CHECK(x.is_cuda() && weight.is_cuda() && weight.device() == x.device(),
           "x and weight must be CUDA tensors on one device");
  const auto dtype = x.scalar_type();
  RS_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "skinny_linear takes bf16 or fp16, got ", dtype);
  RS_CHECK(weight.scalar_type() == dtype, "weight dtype ", weight.scalar_type(), " must equal x dtype ", dtype);
  RS_CHECK(x.dim() == 2 && weight.dim() == 2, "x must be [m, k] and weight [n, k]");
  const int64_t m = x.size(0), k = x.size(1);
  RS_CHECK(m >= 1 && m <= gemv::kMaxRows, "skinny_linear serves 1..", gemv::kMaxRows, " rows, got ", m);
  RS_CHECK(weight.size(1) == k, "weight must be [n, k=", k, "], got ", weight.sizes());
  RS_CHECK(k >= 8 && k % 8 == 0, "k must be a positive multiple of 8, got ", k);
  RS_CHECK(!gated || weight.size(0) % 2 == 0, "a gated weight must be [2 * n, k], got ", weight.sizes());
  RS_CHECK(weight.is_contiguous() && aligned16(weight.data_ptr()), "weight must be contiguous and 16-byte aligned");
  RS_CHECK(x.stride(1) == 1 && x.stride(0) % 8 == 0 && aligned16(x.data_ptr()),
           "x rows must be contiguous and start at 16-byte boundaries");
  if (bias) {
    RS_CHECK(bias->is_cuda() && bias->device() == x.device() && bias->scalar_type() == dtype,
             "bias must be a CUDA tensor of x's device and dtype");
    RS_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous(),
             "bias must be contiguous [", weight.size(0), "]");
  }
}

gemv::SkinnyParams skinny_params(const at::Tensor& x, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias, bool gated,
                                 const at::Tensor& out) {
  gemv::SkinnyParams p{};
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.w = weight.data_ptr();
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.out_stride = out.stride(0);
  p.m = static_cast<int>(x.size(0));
  p.n = gated ? weight.size(0) / 2 : weight.size(0);
  p.k = x.size(1);
  p.pdl = at::cuda::getCurrentDeviceProperties()->major >= 9;
  return p;
}

template <bool NORM>
void launch_skinny(const at::Tensor& x, bool gated, const gemv::SkinnyParams& p, const char* what) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaError_t err;
  if (x.scalar_type() == at::kBFloat16)
    err = gated ? gemv::launch_skinny_gemm<__nv_bfloat16, true, NORM>(p, stream)
                : gemv::launch_skinny_gemm<__nv_bfloat16, false, NORM>(p, stream);
  else
    err = gated ? gemv::launch_skinny_gemm<__half, true, NORM>(p, stream)
                : gemv::launch_skinny_gemm<__half, false, NORM>(p, stream);
  RS_CHECK(err == cudaSuccess, what, " launch failed: ", cudaGetErrorString(err));
}

void check_norm_inputs(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                       const at::Tensor& norm_weight) {
  const int64_t m = x.size(0), k = x.size(1);
  RS_CHECK(k <= 8 * gemv::kNormMaxChunks, "skinny_norm_linear takes rows of at most ",
           8 * gemv::kNormMaxChunks, " elements, got ", k);
  RS_CHECK(norm_weight.is_cuda() && norm_weight.device() == x.device() &&
               norm_weight.scalar_type() == x.scalar_type(),
           "norm_weight must be a CUDA tensor of x's device and dtype");
  RS_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == k && norm_weight.is_contiguous() &&
               aligned16(norm_weight.data_ptr()),
           "norm_weight must be contiguous [", k, "] and 16-byte aligned");
  if (residual) {
    RS_CHECK(residual->is_cuda() && residual->device() == x.device() &&
                 residual->scalar_type() == at::kFloat,
             "residual must be a float32 CUDA tensor on x's device");
    RS_CHECK(residual->dim() == 2 && residual->size(0) == m && residual->size(1) == k,
             "residual must be [", m, ", ", k, "], got ", residual->sizes());
    RS_CHECK(residual->stride(1) == 1 && residual->stride(0) % 4 == 0 && aligned16(residual->data_ptr()),
             "residual rows must be contiguous and start at 16-byte boundaries");
  }
}

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, bool gated) {
  check_skinny_inputs(x, weight, bias, gated);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = gated ? weight.size(0) / 2 : weight.size(0);
  auto out = at::empty({x.size(0), n}, x.options());  // [m, n]
  launch_skinny<false>(x, gated, skinny_params(x, weight, bias, gated, out), "skinny_linear");
  return out;
}

std::tuple<at::Tensor, at::Tensor> skinny_norm_linear(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& norm_weight,
    double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias, bool gated) {
  check_skinny_inputs(x, weight, bias, gated);
  check_norm_inputs(x, residual, norm_weight);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = gated ? weight.size(0) / 2 : weight.size(0);
  auto out = at::empty({x.size(0), n}, x.options());                       // [m, n]
  auto residual_out = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));  // [m, k]
  gemv::SkinnyParams p = skinny_params(x, weight, bias, gated, out);
  p.residual = residual ? residual->data_ptr<float>() : nullptr;
  p.res_stride = residual ? residual->stride(0) : 0;
  p.residual_out = residual_out.data_ptr<float>();
  p.norm_weight = norm_weight.data_ptr();
  p.eps = static_cast<float>(eps);
  p.norm_threads = gemv::norm_reduce_threads(p.k / 8);
  launch_skinny<true>(x, gated, p, "skinny_norm_linear");
  return {out, residual_out};
}

}  // namespace radixserve
