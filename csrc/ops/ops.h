// Host-side entry points of every op, one declaration each. Implemented in csrc/ops/*.cu,
// registered in csrc/bindings.cpp. Contracts (shapes, dtypes, mutation) are documented once,
// in pysrc/radixserve/ops/__init__.py; each implementation checks every input it is given.
#pragma once

#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>

namespace radixserve {

// kv.cu
void store_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_indices, double k_scale, double v_scale);
void build_kv_indices(const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                      const at::Tensor& seq_lens, at::Tensor kv_indptr, at::Tensor kv_indices);

// attention.cu (kernel: "auto", or "simt" / "mma" forcing the CUDA-core decode / mma.sync extend
// kernel; no_split_tokens: none = attn::kDecodeNoSplitTokens; window: a sliding window, 0 none
// (extend: the mma.sync kernel). The kernels read no environment.)
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& kv_indptr,
                                  const at::Tensor& kv_indices, double sm_scale, double k_scale,
                                  double v_scale, c10::string_view kernel,
                                  std::optional<int64_t> no_split_tokens, int64_t window);
at::Tensor paged_extend_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& qo_indptr,
                                  const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                                  double sm_scale, double k_scale, double v_scale,
                                  c10::string_view kernel, int64_t window);
// which kernel paged_extend_attention runs for q's dtype / head_dim on q's device with this
// kernel argument: "wgmma_sm90" or "mma_sm80"
std::string extend_attention_kernel(const at::Tensor& q, c10::string_view kernel);

// sampling.cu
std::tuple<at::Tensor, at::Tensor> bitmask_sample(
    const at::Tensor& logits, const std::optional<at::Tensor>& bitmask,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& min_p, const at::Tensor& seeds, const at::Tensor& offsets);
at::Tensor argmax_rows(const at::Tensor& logits);

// gemv.cu
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, bool gated);

// fp8_gemv.cu
at::Tensor fp8_skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                             bool gated, int64_t cuda_core_rows);

// fp8_quant.cu
std::tuple<at::Tensor, at::Tensor> fp8_quantize(const at::Tensor& x,
                                                const std::optional<at::Tensor>& input_scale);
std::tuple<at::Tensor, at::Tensor> rmsnorm_quant_fp8(const at::Tensor& x,
                                                     const std::optional<at::Tensor>& residual,
                                                     const at::Tensor& weight, double eps,
                                                     const std::optional<at::Tensor>& input_scale);

// elementwise.cu
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void rotary_embedding(const at::Tensor& positions, at::Tensor q, at::Tensor k,
                      const at::Tensor& cos_sin_cache);
void rotary_embedding_store_kv(const at::Tensor& positions, at::Tensor q, at::Tensor k,
                               const at::Tensor& v, const at::Tensor& cos_sin_cache,
                               at::Tensor k_cache, at::Tensor v_cache,
                               const at::Tensor& slot_indices, double k_scale, double v_scale);
at::Tensor silu_and_mul(const at::Tensor& x);

// oneshot_allreduce.cu (issue 37 point 3: one-shot all-reduce over peer-mapped buffers of one
// process; parallel/oneshot.py). register: per-rank uint8 buffers (two halves of the capacity)
// and signal areas (>= oneshot_signal_bytes(), zeroed), enables peer access between their GPUs,
// returns a handle; all_reduce: rank's share of one all-reduce, on the current stream.
int64_t oneshot_signal_bytes();
int64_t oneshot_register(at::TensorList buffers,
                         at::TensorList signals, int64_t blocks);
void oneshot_all_reduce(int64_t handle, int64_t rank, const at::Tensor& input, at::Tensor output);

}  // namespace radixserve
