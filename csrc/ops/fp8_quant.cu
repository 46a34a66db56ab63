// fp8_quantize and rmsnorm_quant_fp8: input checks, dtype dispatch, launch on the current stream.
// Kernels: csrc/include/radixserve/fp8_quant.cuh. Contracts: pysrc/radixserve/ops/__init__.py.
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ops/check.h"
#include "ops/ops.h"
#include "radixserve/fp8_quant.cuh"

namespace radixserve {
namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

void check_rows(const at::Tensor& x, const char* name) {
  RS_CHECK(x.is_cuda(), name, " must be a CUDA tensor");
  RS_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, name,
           " must be bf16 or fp16, got ", x.scalar_type());
  RS_CHECK(x.dim() == 2, name, " must be [rows, hidden]");
  RS_CHECK(x.size(1) % 8 == 0, name, "'s rows must hold a multiple of 8 elements, got ", x.size(1));
  RS_CHECK(x.stride(1) == 1 && x.stride(0) % 8 == 0 && aligned16(x.data_ptr()), name,
           " rows must be contiguous and start at 16-byte boundaries");
}

const float* static_scale(const std::optional<at::Tensor>& input_scale, const at::Tensor& x) {
  if (!input_scale) return nullptr;
  RS_CHECK(input_scale->is_cuda() && input_scale->device() == x.device() &&
               input_scale->scalar_type() == at::kFloat && input_scale->numel() == 1,
           "input_scale must be one fp32 value on x's device");
  return input_scale->data_ptr<float>();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fp8_quantize(const at::Tensor& x,
                                                const std::optional<at::Tensor>& input_scale) {
  check_rows(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kFloat8_e4m3fn));
  auto scale = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  fp8_quant::Params p{};
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.input_scale = static_scale(input_scale, x);
  p.out = reinterpret_cast<uint8_t*>(out.data_ptr());
  p.scale = scale.data_ptr<float>();
  p.rows = x.size(0);
  p.hidden = x.size(1);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaError_t err = x.scalar_type() == at::kBFloat16
                              ? fp8_quant::launch_quantize<__nv_bfloat16>(p, stream)
                              : fp8_quant::launch_quantize<__half>(p, stream);
  RS_CHECK(err == cudaSuccess, "fp8_quantize launch failed: ", cudaGetErrorString(err));
  return {out, scale};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_quant_fp8(const at::Tensor& x,
                                                     const std::optional<at::Tensor>& residual,
                                                     const at::Tensor& weight, double eps,
                                                     const std::optional<at::Tensor>& input_scale) {
  check_rows(x, "x");
  const int64_t hidden = x.size(1);
  RS_CHECK(fp8_quant::rmsnorm_fits(hidden), "rmsnorm_quant_fp8 serves rows of up to 8192 "
           "elements, got ", hidden);
  RS_CHECK(weight.is_cuda() && weight.device() == x.device() && weight.scalar_type() == x.scalar_type(),
           "weight must be a CUDA tensor of x's device and dtype");
  RS_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous() &&
               aligned16(weight.data_ptr()),
           "weight must be contiguous [", hidden, "] and 16-byte aligned");
  if (residual) {
    RS_CHECK(residual->is_cuda() && residual->device() == x.device(),
             "residual must be a CUDA tensor on x's device");
    RS_CHECK(residual->scalar_type() == x.scalar_type() || residual->scalar_type() == at::kFloat,
             "residual must be x's dtype or float32, got ", residual->scalar_type());
    RS_CHECK(residual->dim() == 2 && residual->size(0) == x.size(0) && residual->size(1) == hidden,
             "residual must be [", x.size(0), ", ", hidden, "]");
    RS_CHECK(residual->stride(1) == 1 && residual->stride(0) % 8 == 0 &&
                 aligned16(residual->data_ptr()),
             "residual rows must be contiguous and start at 16-byte boundaries");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({x.size(0), hidden}, x.options().dtype(at::kFloat8_e4m3fn));
  auto scale = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  fp8_quant::Params p{};
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.residual = residual ? residual->data_ptr() : nullptr;
  p.res_stride = residual ? residual->stride(0) : 0;
  p.weight = weight.data_ptr();
  p.input_scale = static_scale(input_scale, x);
  p.out = reinterpret_cast<uint8_t*>(out.data_ptr());
  p.scale = scale.data_ptr<float>();
  p.rows = x.size(0);
  p.hidden = hidden;
  p.eps = static_cast<float>(eps);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const bool f32res = residual && residual->scalar_type() == at::kFloat;
  cudaError_t err;
  if (!residual)
    err = bf16 ? fp8_quant::launch_rmsnorm_quant<__nv_bfloat16, false>(p, stream)
               : fp8_quant::launch_rmsnorm_quant<__half, false>(p, stream);
  else if (f32res)
    err = bf16 ? fp8_quant::launch_rmsnorm_quant<__nv_bfloat16, true, float>(p, stream)
               : fp8_quant::launch_rmsnorm_quant<__half, true, float>(p, stream);
  else
    err = bf16 ? fp8_quant::launch_rmsnorm_quant<__nv_bfloat16, true>(p, stream)
               : fp8_quant::launch_rmsnorm_quant<__half, true>(p, stream);
  RS_CHECK(err == cudaSuccess, "rmsnorm_quant_fp8 launch failed: ", cudaGetErrorString(err));
  return {out, scale};
}

}  // namespace radixserve
