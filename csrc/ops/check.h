// Input-check helpers shared by the host code of csrc/ops/*.cu: RS_CHECK(cond, parts...) raises
// a torch error whose message is the concatenation of parts (strings, integers, dtypes, devices,
// shapes).
#pragma once

#include <string>

#include <ATen/ATen.h>

namespace radixserve {
namespace check {

// Error messages are built without std::ostream: in this extension, inserting an integer into a
// stream from nvcc-compiled host code crashed (SIGSEGV in basic_ostream::_M_insert<long>, seen on
// the H200 image with torch 2.11), so numbers go through std::to_string and the message reaches
// TORCH_CHECK as one const char*.
inline std::string piece(const char* s) { return s; }
inline std::string piece(const std::string& s) { return s; }
inline std::string piece(int64_t v) { return std::to_string(v); }
inline std::string piece(int v) { return std::to_string(v); }
inline std::string piece(at::ScalarType t) { return c10::toString(t); }
inline std::string piece(const at::Device& d) { return d.str(); }
inline std::string piece(at::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}
template <typename... A>
inline std::string message(const A&... a) {
  return (std::string() + ... + piece(a));
}
}  // namespace check
}  // namespace radixserve

#define RS_CHECK(cond, ...) TORCH_CHECK(cond, ::radixserve::check::message(__VA_ARGS__).c_str())
