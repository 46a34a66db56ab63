// Registrations only: the schema of every op in the torch.ops.radixserve namespace and its
// CUDA implementation. Python reaches them through pysrc/radixserve/ops/__init__.py.
#include <Python.h>
#include <torch/library.h>

#include "ops/ops.h"

TORCH_LIBRARY(radixserve, m) {
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_indices, "
        "float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def("build_kv_indices(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "Tensor(a!) kv_indptr, Tensor(b!) kv_indices) -> ()");
  // kernel / no_split_tokens: the seam's knobs (pysrc/radixserve/knobs.py), passed per call
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indptr, "
        "Tensor kv_indices, float sm_scale, float k_scale=1.0, float v_scale=1.0, "
        "str kernel=\"auto\", int? no_split_tokens=None, int window=0) -> Tensor");
  m.def("paged_extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor qo_indptr, "
        "Tensor kv_indptr, Tensor kv_indices, float sm_scale, float k_scale=1.0, "
        "float v_scale=1.0, str kernel=\"auto\", int window=0) -> Tensor");
  m.def("extend_attention_kernel(Tensor q, str kernel=\"auto\") -> str");
  m.def("bitmask_sample(Tensor logits, Tensor? bitmask, Tensor temperature, Tensor top_k, "
        "Tensor top_p, Tensor min_p, Tensor seeds, Tensor offsets) -> (Tensor, Tensor)");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias, bool gated) -> Tensor");
  m.def("fp8_skinny_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, "
        "bool gated=False, int cuda_core_rows=-1) -> Tensor");
  m.def("fp8_quantize(Tensor x, Tensor? input_scale) -> (Tensor, Tensor)");
  m.def("rmsnorm_quant_fp8(Tensor x, Tensor(a!)? residual, Tensor weight, float eps, "
        "Tensor? input_scale) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache) -> ()");
  m.def("rotary_embedding_store_kv(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor v, "
        "Tensor cos_sin_cache, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_indices, "
        "float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  // one-shot all-reduce (csrc/ops/oneshot_allreduce.cu); the first takes no tensor: registered
  // here as a catch-all kernel
  m.def("oneshot_signal_bytes() -> int", &radixserve::oneshot_signal_bytes);
  m.def("oneshot_register(Tensor[] buffers, Tensor[] signals, int blocks) -> int");
  m.def("oneshot_all_reduce(int handle, int rank, Tensor input, Tensor(a!) output) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CUDA, m) {
  m.impl("store_kv", &radixserve::store_kv);
  m.impl("build_kv_indices", &radixserve::build_kv_indices);
  m.impl("paged_decode_attention", &radixserve::paged_decode_attention);
  m.impl("paged_extend_attention", &radixserve::paged_extend_attention);
  m.impl("extend_attention_kernel", &radixserve::extend_attention_kernel);
  m.impl("bitmask_sample", &radixserve::bitmask_sample);
  m.impl("argmax_rows", &radixserve::argmax_rows);
  m.impl("skinny_linear", &radixserve::skinny_linear);
  m.impl("fp8_skinny_linear", &radixserve::fp8_skinny_linear);
  m.impl("fp8_quantize", &radixserve::fp8_quantize);
  m.impl("rmsnorm_quant_fp8", &radixserve::rmsnorm_quant_fp8);
  m.impl("rms_norm", &radixserve::rms_norm);
  m.impl("fused_add_rms_norm", &radixserve::fused_add_rms_norm);
  m.impl("rotary_embedding", &radixserve::rotary_embedding);
  m.impl("rotary_embedding_store_kv", &radixserve::rotary_embedding_store_kv);
  m.impl("silu_and_mul", &radixserve::silu_and_mul);
  m.impl("oneshot_register", &radixserve::oneshot_register);
  m.impl("oneshot_all_reduce", &radixserve::oneshot_all_reduce);
}

// Importing radixserve._C runs the registrations above. The module carries one constant,
// CUDA_ARCHS: the archs it was built for ("90a,80", from RADIXSERVE_CUDA_ARCHS via setup.py;
// "" when not recorded), read by pysrc/radixserve/ops/kernel_status.py.
#ifndef RADIXSERVE_CUDA_ARCHS
#define RADIXSERVE_CUDA_ARCHS
#endif
#define RADIXSERVE_STR_(...) #__VA_ARGS__
#define RADIXSERVE_STR(...) RADIXSERVE_STR_(__VA_ARGS__)

static struct PyModuleDef radixserve_c_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&radixserve_c_module);
  if (m != nullptr &&
      PyModule_AddStringConstant(m, "CUDA_ARCHS", RADIXSERVE_STR(RADIXSERVE_CUDA_ARCHS)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
