// paged_decode_attention and paged_extend_attention: input checks, dtype / head_dim / pool dtype
// dispatch, launch on the current stream. An FP8 pool (float8_e4m3fn / float8_e5m2, with q
// bf16 or fp16) has k_scale folded into the softmax scale and v_scale into the output's
// normalisation (DecodeParams / ExtendParams::v_scale); other pools ignore the scales. Kernels live in include/radixserve/{decode,extend}_attention.cuh;
// contracts in pysrc/radixserve/ops/__init__.py.
#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops/check.h"
#include "ops/fp8_kv.h"
#include "ops/ops.h"
#include "radixserve/attention_launch.cuh"

namespace radixserve {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// Integers go into error messages as strings: on one build machine (g++ from /opt/gcc against
// the image's torch) streaming an integer through c10::str crashed while throwing.
std::string num(int64_t v) { return std::to_string(v); }
std::string shape(at::IntArrayRef sizes) {
  std::string r = "[";
  for (size_t i = 0; i < sizes.size(); ++i) r += (i ? ", " : "") + num(sizes[i]);
  return r + "]";
}

void check_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  TORCH_CHECK(q.dim() == 3, "q must be 3-D [tokens, num_q_heads, head_dim], got ", shape(q.sizes()));
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "q must be bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(q.stride(2) == 1, "q's last dim must be contiguous");
  TORCH_CHECK(q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0,
              "q rows must be 16-byte aligned");
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->device() == q.device(), "k_cache/v_cache must be on q's device");
    TORCH_CHECK(t->scalar_type() == q.scalar_type() || is_fp8_kv_dtype(t->scalar_type()),
                "k_cache/v_cache dtype must match q (or be float8_e4m3fn / float8_e5m2)");
    TORCH_CHECK(t->scalar_type() == k_cache.scalar_type(), "k_cache and v_cache dtypes differ");
    TORCH_CHECK(t->dim() == 3, "k_cache/v_cache must be [num_slots, num_kv_heads, head_dim]");
    TORCH_CHECK(t->is_contiguous(), "k_cache/v_cache must be contiguous");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "k_cache/v_cache must be 16-byte aligned");
  }
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128, "head_dim must be 64 or 128, got ", num(d));
  TORCH_CHECK(k_cache.size(2) == d, "k_cache head_dim ", num(k_cache.size(2)), " != q head_dim ",
              num(d));
  const int64_t hkv = k_cache.size(1);
  TORCH_CHECK(hkv > 0 && q.size(1) % hkv == 0, "num_q_heads (", num(q.size(1)),
              ") must be a multiple of num_kv_heads (", num(hkv), ")");
}

void check_index(const at::Tensor& t, const at::Tensor& q, const char* name) {
  TORCH_CHECK(t.device() == q.device(), name, " must be on q's device");
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

template <typename F>
void dispatch_dtype_dim(at::ScalarType st, int64_t d, F&& f) {
  if (st == at::kBFloat16) {
    if (d == 64) f(__nv_bfloat16{}, std::integral_constant<int, 64>{});
    else f(__nv_bfloat16{}, std::integral_constant<int, 128>{});
  } else {
    if (d == 64) f(__half{}, std::integral_constant<int, 64>{});
    else f(__half{}, std::integral_constant<int, 128>{});
  }
}

// f(T tag, D, KV tag): KV the pool's element type (T, or __nv_fp8_e4m3 / __nv_fp8_e5m2)
template <typename F>
void dispatch_dtype_dim_kv(at::ScalarType st, int64_t d, at::ScalarType kv, F&& f) {
  dispatch_dtype_dim(st, d, [&](auto tag, auto dim) {
    using T = decltype(tag);
    if (kv == at::kFloat8_e4m3fn) f(tag, dim, __nv_fp8_e4m3{});
    else if (kv == at::kFloat8_e5m2) f(tag, dim, __nv_fp8_e5m2{});
    else f(tag, dim, T{});
  });
}

// The softmax scale in the log2 domain, times k_scale for an FP8 pool; and the output factor
// (v_scale for an FP8 pool, else 1). The scales of an FP8 pool must be finite and > 0.
std::pair<float, float> kv_scales(const at::Tensor& k_cache, double sm_scale, double k_scale,
                                  double v_scale) {
  if (!is_fp8_kv_dtype(k_cache.scalar_type())) return {(float)sm_scale * kLog2e, 1.f};
  check_fp8_scale(k_scale, "k_scale");
  check_fp8_scale(v_scale, "v_scale");
  return {(float)(sm_scale * k_scale) * kLog2e, (float)v_scale};
}

// Counters a kernel finds zero and leaves zero (the split decode's last-CTA merge,
// DecodeParams::split_counters; the extend kernel's item queue, ExtendParams::work_counters):
// int32, one buffer per device and pool, zero-initialised once (at::zeros) and left zero by every
// launch, so it is reused without a memset, by eager launches and CUDA-graph replays alike. Grown
// (a new zeroed buffer) when a launch needs more than it holds, but only outside a CUDA-graph
// capture: a capture would record the growth's memset and bake in a pointer of its own. The eager
// warm-up that precedes every capture (model/cuda_graph_runner.py runs each bucket twice on the
// capture stream, largest bucket first; torch.cuda.graphs' recipe) grows it first; a capture that
// finds it too small fails. An outgrown buffer is kept alive, not freed: graphs captured with its
// pointer still replay into it. Launches of one device share a pool's buffer: they must not run
// concurrently (the attention ops run on one stream). The tensors are never destroyed (no
// teardown-order issue with the caching allocator at exit).
enum CounterPool { kDecodeSplits = 0, kExtendItems = 1, kCounterPools = 2 };

int* left_zero_counters(const at::Tensor& q, CounterPool pool, int64_t needed, const char* what) {
  static std::mutex mu;
  static auto* buffers = new std::vector<at::Tensor>();  // [device index * kCounterPools + pool]
  static auto* outgrown = new std::vector<at::Tensor>();
  const std::lock_guard<std::mutex> lock(mu);
  const int dev = q.get_device();
  const size_t slot = (size_t)dev * kCounterPools + pool;
  if (buffers->size() <= slot) buffers->resize(slot + 1);
  at::Tensor& buf = (*buffers)[slot];
  if (!buf.defined() || buf.numel() < needed) {
    RS_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
             what, " of device ", (int64_t)dev, " hold ", buf.defined() ? buf.numel() : (int64_t)0,
             " entries but this launch needs ", needed,
             ", and they cannot grow during CUDA graph capture: run the same call eagerly once "
             "before capturing it");
    if (buf.defined()) outgrown->push_back(buf);
    const int64_t size = std::max<int64_t>(needed, buf.defined() ? 2 * buf.numel() : 1024);
    buf = at::zeros({size}, q.options().dtype(at::kInt));
  }
  return buf.data_ptr<int32_t>();
}

// The kernels read no environment variable: the choices below are the ops' arguments, which
// the op seam (pysrc/radixserve/ops/__init__.py) takes from pysrc/radixserve/knobs.py (the
// RADIXSERVE_* variables and the hidden --debug-* flags of `serve`) on every call.

// no_split_tokens: requests of at most this many KV tokens are not split (0 or less: split at
// any length, the earlier plan; for A/B runs); none: attn::kDecodeNoSplitTokens.
int decode_no_split_tokens(std::optional<int64_t> no_split_tokens) {
  if (!no_split_tokens.has_value()) return attn::kDecodeNoSplitTokens;
  return (int)std::clamp<int64_t>(*no_split_tokens, std::numeric_limits<int>::min(),
                                  std::numeric_limits<int>::max());
}

int* decode_split_counters(const at::Tensor& q, int64_t needed) {
  return left_zero_counters(q, kDecodeSplits, needed,
                            "paged_decode_attention: the split counters (batch * num_kv_heads * "
                            "q-head subgroups)");
}

// kernel "auto": the wgmma extend kernel where attention_launch.cuh says it can run; "mma" forces
// the mma.sync kernel (for comparisons and tests).
bool extend_forces_mma(c10::string_view kernel) {
  TORCH_CHECK(kernel == "auto" || kernel == "mma", "extend attention: kernel must be auto or mma, "
              "got '", std::string(kernel), "'");
  return kernel == "mma";
}

template <typename T, int D>
bool use_wgmma_kernel(bool force_mma) {
  return !force_mma && attn::extend_wgmma_available<T, D>();
}

// kernel "auto": decode's tensor-core kernel where attention_launch.cuh says it serves; "simt"
// forces the CUDA-core kernel (for comparisons and tests).
bool decode_tensor_cores_allowed(c10::string_view kernel) {
  TORCH_CHECK(kernel == "auto" || kernel == "simt", "paged_decode_attention: kernel must be auto "
              "or simt, got '", std::string(kernel), "'");
  return kernel == "auto";
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& kv_indptr,
                                  const at::Tensor& kv_indices, double sm_scale, double k_scale,
                                  double v_scale, c10::string_view kernel,
                                  std::optional<int64_t> no_split_tokens, int64_t window) {
  check_cache(q, k_cache, v_cache);
  check_index(kv_indptr, q, "kv_indptr");
  check_index(kv_indices, q, "kv_indices");
  const bool tensor_cores = decode_tensor_cores_allowed(kernel);
  const int64_t batch = q.size(0);
  TORCH_CHECK(kv_indptr.numel() == batch + 1, "kv_indptr must have batch + 1 = ", num(batch + 1),
              " entries, got ", num(kv_indptr.numel()));
  TORCH_CHECK(std::isfinite(sm_scale) && sm_scale > 0, "sm_scale must be finite and > 0");
  TORCH_CHECK(batch <= 65535, "batch must be <= 65535");
  TORCH_CHECK(kv_indices.numel() < (int64_t(1) << 31), "kv_indices too long for int32");
  TORCH_CHECK(window >= 0 && window < (int64_t(1) << 31), "window must be >= 0 (0: none), got ",
              num(window));

  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({batch, q.size(1), q.size(2)}, q.options());  // [batch, hq, d]
  if (batch == 0) return out;

  const int hq = (int)q.size(1);
  const int hkv = (int)k_cache.size(1);
  const int group = hq / hkv;
  const int gmax = attn::decode_group_max(group);
  const int num_sub = (group + gmax - 1) / gmax;

  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int no_split = decode_no_split_tokens(no_split_tokens);
  // a window bounds every request's attended length (attn::decode_kv_range)
  const int64_t nnz = window > 0 ? std::min<int64_t>(kv_indices.numel(), batch * window)
                                 : kv_indices.numel();
  const int num_splits = attn::decode_num_splits(batch, hkv, num_sub, nnz, sms, no_split);

  at::Tensor part_o, part_lse;
  if (num_splits > 1) {
    part_o = at::empty({batch, hq, num_splits, q.size(2)}, q.options().dtype(at::kFloat));
    part_lse = at::empty({batch, hq, num_splits}, q.options().dtype(at::kFloat));
  }

  attn::DecodeParams p{};
  p.q = q.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.part_o = num_splits > 1 ? part_o.data_ptr<float>() : nullptr;
  p.part_lse = num_splits > 1 ? part_lse.data_ptr<float>() : nullptr;
  p.split_counters = num_splits > 1 ? decode_split_counters(q, batch * hkv * num_sub) : nullptr;
  p.kv_indptr = kv_indptr.data_ptr<int32_t>();
  p.kv_indices = kv_indices.data_ptr<int32_t>();
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.kv_stride_slot = k_cache.stride(0);
  p.kv_stride_h = k_cache.stride(1);
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.group = group;
  p.num_sub = num_sub;
  p.num_splits = num_splits;
  p.num_sms = sms;
  std::tie(p.scale_log2, p.v_scale) = kv_scales(k_cache, sm_scale, k_scale, v_scale);
  p.no_split_tokens = no_split;
  p.window = (int)window;

  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype_dim_kv(q.scalar_type(), q.size(2), k_cache.scalar_type(),
                        [&](auto tag, auto dim, auto kv) {
    const cudaError_t err =
        attn::launch_paged_decode<decltype(tag), decltype(dim)::value, decltype(kv)>(
            p, (int)batch, stream, tensor_cores);
    C10_CUDA_CHECK(err);
  });
  return out;
}

at::Tensor paged_extend_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& qo_indptr,
                                  const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                                  double sm_scale, double k_scale, double v_scale,
                                  c10::string_view kernel, int64_t window) {
  check_cache(q, k_cache, v_cache);
  const bool force_mma = extend_forces_mma(kernel);
  TORCH_CHECK(window >= 0 && window < (int64_t(1) << 31), "window must be >= 0 (0: none), got ",
              num(window));
  check_index(qo_indptr, q, "qo_indptr");
  check_index(kv_indptr, q, "kv_indptr");
  check_index(kv_indices, q, "kv_indices");
  TORCH_CHECK(qo_indptr.numel() >= 1, "qo_indptr must have batch + 1 entries");
  const int64_t batch = qo_indptr.numel() - 1;
  TORCH_CHECK(kv_indptr.numel() == batch + 1, "kv_indptr and qo_indptr lengths differ");
  TORCH_CHECK(std::isfinite(sm_scale) && sm_scale > 0, "sm_scale must be finite and > 0");
  TORCH_CHECK(q.size(1) <= 65535, "num_q_heads must be <= 65535");
  TORCH_CHECK(q.size(0) < (int64_t(1) << 31), "too many query tokens");

  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());  // [nq, hq, d]
  if (batch == 0 || q.size(0) == 0) return out;

  const int hq = (int)q.size(1);
  const int hkv = (int)k_cache.size(1);
  attn::ExtendParams p;
  p.q = q.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.qo_indptr = qo_indptr.data_ptr<int32_t>();
  p.kv_indptr = kv_indptr.data_ptr<int32_t>();
  p.kv_indices = kv_indices.data_ptr<int32_t>();
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.kv_stride_slot = k_cache.stride(0);
  p.kv_stride_h = k_cache.stride(1);
  p.batch = (int)batch;
  p.num_q_heads = hq;
  p.group = hq / hkv;
  std::tie(p.scale_log2, p.v_scale) = kv_scales(k_cache, sm_scale, k_scale, v_scale);
  p.work_counters = nullptr;
  p.num_slots = k_cache.size(0);
  p.num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  p.window = (int)window;

  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype_dim_kv(q.scalar_type(), q.size(2), k_cache.scalar_type(),
                        [&](auto tag, auto dim, auto kv) {
    using T = decltype(tag);
    using KV = decltype(kv);
    constexpr int D = decltype(dim)::value;
    // an FP8 pool runs the mma.sync kernel (the wgmma kernel's tiles are 16-bit, by TMA), and so
    // does a sliding window (the wgmma kernel takes none)
    const bool wgmma = !fp8::is_fp8<KV>() && window == 0 && use_wgmma_kernel<T, D>(force_mma);
    if (wgmma)
      p.work_counters = left_zero_counters(q, kExtendItems, 2,
                                           "paged_extend_attention: the work-item counters");
    const cudaError_t err = attn::launch_paged_extend<T, D, KV>(p, q.size(0), wgmma, stream);
    C10_CUDA_CHECK(err);
  });
  return out;
}

std::string extend_attention_kernel(const at::Tensor& q, c10::string_view kernel) {
  const bool force_mma = extend_forces_mma(kernel);
  TORCH_CHECK(q.is_cuda() && q.dim() == 3, "q must be a 3-D CUDA tensor");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "q must be bfloat16 or float16");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "head_dim must be 64 or 128");
  const c10::cuda::CUDAGuard guard(q.device());
  bool wgmma = false;
  dispatch_dtype_dim(q.scalar_type(), q.size(2), [&](auto tag, auto dim) {
    wgmma = use_wgmma_kernel<decltype(tag), decltype(dim)::value>(force_mma);
  });
  return wgmma ? "wgmma_sm90" : "mma_sm80";
}

}  // namespace radixserve
