// bitmask_sample and argmax_rows: input checks, dtype dispatch, launch on the current stream.
// Kernels and algorithms: csrc/include/radixserve/sampling.cuh, argmax.cuh. Contracts:
// pysrc/radixserve/ops/__init__.py.
#include <string>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include "ops/check.h"
#include "ops/ops.h"
#include "radixserve/argmax.cuh"
#include "radixserve/sampling.cuh"

namespace radixserve {
namespace {

void check_param(const at::Tensor& t, const char* name, const at::Tensor& logits, at::ScalarType dtype) {
  RS_CHECK(t.is_cuda() && t.device() == logits.device(), name, " must be on ", logits.device());
  RS_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  RS_CHECK(t.dim() == 1 && t.size(0) == logits.size(0), name, " must be [batch=", logits.size(0),
              "], got ", t.sizes());
  RS_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> bitmask_sample(
    const at::Tensor& logits, const std::optional<at::Tensor>& bitmask,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& min_p, const at::Tensor& seeds, const at::Tensor& offsets) {
  RS_CHECK(logits.is_cuda(), "logits must be a CUDA tensor");
  RS_CHECK(logits.dim() == 2, "logits must be [batch, vocab], got ", logits.sizes());
  RS_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "logits must be float32 or bfloat16, got ", logits.scalar_type());
  RS_CHECK(logits.stride(1) == 1, "logits rows must be contiguous");
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  RS_CHECK(vocab >= 1 && vocab < (1LL << 31) - 1, "vocab must be in [1, 2^31 - 1)");
  RS_CHECK(batch < (1LL << 31), "batch too large");
  check_param(temperature, "temperature", logits, at::kFloat);
  check_param(top_k, "top_k", logits, at::kInt);
  check_param(top_p, "top_p", logits, at::kFloat);
  check_param(min_p, "min_p", logits, at::kFloat);
  check_param(seeds, "seeds", logits, at::kLong);
  check_param(offsets, "offsets", logits, at::kLong);
  const int32_t* mask_ptr = nullptr;
  int64_t mask_stride = 0;
  if (bitmask.has_value()) {
    const at::Tensor& m = *bitmask;
    RS_CHECK(m.is_cuda() && m.device() == logits.device(), "bitmask must be on ", logits.device());
    RS_CHECK(m.scalar_type() == at::kInt, "bitmask must be int32, got ", m.scalar_type());
    RS_CHECK(m.dim() == 2 && m.size(0) == batch && m.size(1) == (vocab + 31) / 32,
                "bitmask must be [batch=", batch, ", ceil(vocab/32)=", (vocab + 31) / 32, "], got ",
                m.sizes());
    RS_CHECK(m.stride(1) == 1, "bitmask rows must be contiguous");
    mask_ptr = m.data_ptr<int32_t>();
    mask_stride = m.stride(0);
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  auto ids = at::empty({batch}, logits.options().dtype(at::kLong));        // [batch]
  auto logprobs = at::empty({batch}, logits.options().dtype(at::kFloat));  // [batch]
  if (batch == 0) return {ids, logprobs};
  sampling::SampleParams p;
  p.logits = logits.data_ptr();
  p.logits_stride = logits.stride(0);
  p.bitmask = mask_ptr;
  p.bitmask_stride = mask_stride;
  p.temperature = temperature.data_ptr<float>();
  p.top_k = top_k.data_ptr<int32_t>();
  p.top_p = top_p.data_ptr<float>();
  p.min_p = min_p.data_ptr<float>();
  p.seeds = seeds.data_ptr<int64_t>();
  p.offsets = offsets.data_ptr<int64_t>();
  p.out_ids = ids.data_ptr<int64_t>();
  p.out_logprobs = logprobs.data_ptr<float>();
  p.batch = batch;
  p.vocab = vocab;
  const int64_t esize = logits.element_size();
  const bool vec = (reinterpret_cast<uintptr_t>(p.logits) & 15) == 0 &&
                   (p.logits_stride * esize) % 16 == 0 && (vocab * esize) % 16 == 0;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaError_t err;
  if (logits.scalar_type() == at::kFloat)
    err = sampling::launch_bitmask_sample<float>(p, vec, stream);
  else
    err = sampling::launch_bitmask_sample<__nv_bfloat16>(p, vec, stream);
  RS_CHECK(err == cudaSuccess, "bitmask_sample launch failed: ", cudaGetErrorString(err));
  return {ids, logprobs};
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  RS_CHECK(logits.is_cuda(), "logits must be a CUDA tensor");
  RS_CHECK(logits.dim() == 2, "logits must be [rows, vocab], got ", logits.sizes());
  RS_CHECK(logits.scalar_type() == at::kFloat, "argmax_rows takes float32 logits, got ",
           logits.scalar_type());
  RS_CHECK(logits.stride(1) == 1, "logits rows must be contiguous");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  RS_CHECK(vocab >= 1 && vocab < (1LL << 31), "vocab must be in [1, 2^31)");
  RS_CHECK(rows < 65536, "argmax_rows takes at most 65535 rows, got ", rows);
  const c10::cuda::CUDAGuard guard(logits.device());
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));  // [rows]
  if (rows == 0) return out;
  argmax::ArgmaxParams p;
  p.logits = logits.data_ptr<float>();
  p.stride = logits.stride(0);
  p.rows = rows;
  p.vocab = vocab;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  p.splits = argmax::choose_splits(rows, vocab, sms);
  const int64_t per = (vocab + p.splits - 1) / p.splits;
  p.split_len = (per + 3) / 4 * 4;
  p.splits = static_cast<int>((vocab + p.split_len - 1) / p.split_len);  // no empty split
  at::Tensor keys;
  if (p.splits > 1) keys = at::empty({rows, p.splits}, logits.options().dtype(at::kLong));  // [rows, splits]
  p.keys = p.splits > 1 ? reinterpret_cast<uint64_t*>(keys.data_ptr<int64_t>()) : nullptr;
  p.out = out.data_ptr<int64_t>();
  const bool vec4 = (reinterpret_cast<uintptr_t>(p.logits) & 15) == 0 && p.stride % 4 == 0;
  const cudaError_t err = argmax::launch_argmax(p, vec4, at::cuda::getCurrentCUDAStream());
  RS_CHECK(err == cudaSuccess, "argmax_rows launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace radixserve
