// Standalone check of csrc/include/radixserve/elementwise.cuh against CPU references (fp32 data;
// the bf16/fp16 paths share the same templates and are covered by tests/gpu/test_elementwise.py).
#include "harness.h"
#include "radixserve/elementwise.cuh"

using namespace radixserve;

static std::vector<float> randv(size_t n, std::mt19937& rng, float lo = -2.f, float hi = 2.f) {
  std::uniform_real_distribution<float> U(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = U(rng);
  return v;
}

static void expect_close(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  for (size_t i = 0; i < want.size(); ++i)
    HX_EXPECT(std::fabs(got[i] - want[i]) <= 1e-5f + 1e-5f * std::fabs(want[i]), "%s[%zu] = %g, want %g",
              what, i, got[i], want[i]);
}

static void check_rms_norm(int tokens, int hidden, bool fused, std::mt19937& rng) {
  auto x = randv((size_t)tokens * hidden, rng), res = randv((size_t)tokens * hidden, rng);
  auto w = randv(hidden, rng, 0.5f, 1.5f);
  const float eps = 1e-6f;
  std::vector<float> want_x(x.size()), want_res(res);
  for (int t = 0; t < tokens; ++t) {
    double ss = 0;
    std::vector<float> row(hidden);
    for (int i = 0; i < hidden; ++i) {
      row[i] = x[(size_t)t * hidden + i] + (fused ? res[(size_t)t * hidden + i] : 0.f);
      ss += (double)row[i] * row[i];
      if (fused) want_res[(size_t)t * hidden + i] = row[i];
    }
    const float scale = 1.f / std::sqrt((float)(ss / hidden) + eps);
    for (int i = 0; i < hidden; ++i) want_x[(size_t)t * hidden + i] = row[i] * scale * w[i];
  }
  hx::DeviceBuffer<float> dx(x), dres(res), dw(w), dout(x.size());
  dout.poison();
  elementwise::RmsNormParams p{};
  p.out = fused ? dx.ptr : dout.ptr;
  p.out_stride = hidden;
  p.x = dx.ptr;
  p.x_stride = hidden;
  p.residual = fused ? dres.ptr : nullptr;
  p.res_stride = hidden;
  p.weight = dw.ptr;
  p.num_tokens = tokens;
  p.hidden = hidden;
  p.eps = eps;
  const bool vec = hidden % 4 == 0;
  if (fused)
    HX_CHECK((elementwise::launch_rms_norm<float, true>(p, vec, nullptr)));
  else
    HX_CHECK((elementwise::launch_rms_norm<float, false>(p, vec, nullptr)));
  HX_CHECK(cudaDeviceSynchronize());
  expect_close(fused ? dx.download() : dout.download(), want_x, fused ? "fused_add_rms_norm x" : "rms_norm");
  if (fused) expect_close(dres.download(), want_res, "fused_add_rms_norm residual");
}

// fused_add_rms_norm with bf16 x and weight beside an fp32 residual (half-precision models keep
// their residual stream in fp32): the residual must come back as the exact fp32 sum, x as the
// norm of that sum rounded once to bf16.
static void check_rms_norm_f32_residual(int tokens, int hidden, std::mt19937& rng) {
  const auto xf = randv((size_t)tokens * hidden, rng, -6.f, 6.f);
  const auto res = randv((size_t)tokens * hidden, rng, -80.f, 80.f);
  const auto wf = randv(hidden, rng, 0.5f, 1.5f);
  std::vector<__nv_bfloat16> x(xf.size()), w(wf.size());
  for (size_t i = 0; i < xf.size(); ++i) x[i] = __float2bfloat16(xf[i]);
  for (size_t i = 0; i < wf.size(); ++i) w[i] = __float2bfloat16(wf[i]);
  const float eps = 1e-6f;
  std::vector<float> want_x(x.size()), want_res(res.size());
  for (int t = 0; t < tokens; ++t) {
    double ss = 0;
    for (int i = 0; i < hidden; ++i) {
      const size_t k = (size_t)t * hidden + i;
      want_res[k] = __bfloat162float(x[k]) + res[k];
      ss += (double)want_res[k] * want_res[k];
    }
    const float scale = 1.f / std::sqrt((float)(ss / hidden) + eps);
    for (int i = 0; i < hidden; ++i) {
      const size_t k = (size_t)t * hidden + i;
      want_x[k] = want_res[k] * scale * __bfloat162float(w[i]);
    }
  }
  hx::DeviceBuffer<__nv_bfloat16> dx(x), dw(w);
  hx::DeviceBuffer<float> dres(res);
  elementwise::RmsNormParams p{};
  p.out = dx.ptr;
  p.out_stride = hidden;
  p.x = dx.ptr;
  p.x_stride = hidden;
  p.residual = dres.ptr;
  p.res_stride = hidden;
  p.weight = dw.ptr;
  p.num_tokens = tokens;
  p.hidden = hidden;
  p.eps = eps;
  const bool vec = hidden % 8 == 0;
  HX_CHECK((elementwise::launch_rms_norm<__nv_bfloat16, true, float>(p, vec, nullptr)));
  HX_CHECK(cudaDeviceSynchronize());
  expect_close(dres.download(), want_res, "fused_add_rms_norm f32 residual");
  const auto got = dx.download();
  for (size_t i = 0; i < want_x.size(); ++i) {
    const float g = __bfloat162float(got[i]);
    HX_EXPECT(std::fabs(g - want_x[i]) <= 1e-5f + (1.f / 256) * std::fabs(want_x[i]),
              "fused_add_rms_norm bf16 x[%zu] = %g, want %g", i, g, want_x[i]);
  }
}

static void check_rotary(int tokens, int hq, int hk, int head_dim, int rot, std::mt19937& rng) {
  // q and k as views into one fused [tokens, (hq + 2 hk) * head_dim] buffer
  const int tstride = (hq + 2 * hk) * head_dim;
  auto qkv = randv((size_t)tokens * tstride, rng);
  const int max_pos = 5000;
  std::vector<float> cs((size_t)max_pos * rot);
  for (int p = 0; p < max_pos; ++p)
    for (int i = 0; i < rot / 2; ++i) {
      const double f = std::pow(10000.0, -2.0 * i / rot);
      cs[(size_t)p * rot + i] = (float)std::cos(p * f);
      cs[(size_t)p * rot + rot / 2 + i] = (float)std::sin(p * f);
    }
  std::vector<int64_t> pos(tokens);
  for (auto& p : pos) p = rng() % max_pos;
  auto want = qkv;
  const int half = rot / 2;
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < hq + hk; ++h) {
      float* b = want.data() + (size_t)t * tstride + (size_t)h * head_dim;
      const float* c = cs.data() + (size_t)pos[t] * rot;
      for (int i = 0; i < half; ++i) {
        const float x1 = b[i], x2 = b[half + i];
        b[i] = x1 * c[i] - x2 * c[half + i];
        b[half + i] = x2 * c[i] + x1 * c[half + i];
      }
    }
  hx::DeviceBuffer<float> dqkv(qkv), dcs(cs);
  hx::DeviceBuffer<int64_t> dpos(pos);
  elementwise::RotaryParams p{};
  p.positions = dpos.ptr;
  p.q = dqkv.ptr;
  p.k = dqkv.ptr + (size_t)hq * head_dim;
  p.cos_sin_cache = dcs.ptr;
  p.num_tokens = tokens;
  p.q_stride_t = tstride;
  p.q_stride_h = head_dim;
  p.k_stride_t = tstride;
  p.k_stride_h = head_dim;
  p.num_q_heads = hq;
  p.num_kv_heads = hk;
  p.rotary_dim = rot;
  p.max_pos = max_pos;
  const bool vec = half % 4 == 0 && head_dim % 4 == 0 && tstride % 4 == 0 && (hq * head_dim) % 4 == 0;
  HX_CHECK(elementwise::launch_rotary<float>(p, vec, nullptr));
  HX_CHECK(cudaDeviceSynchronize());
  expect_close(dqkv.download(), want, "rotary_embedding");
}

static void check_silu(int tokens, int d, std::mt19937& rng) {
  auto x = randv((size_t)tokens * 2 * d, rng, -6.f, 6.f);
  std::vector<float> want((size_t)tokens * d);
  for (int t = 0; t < tokens; ++t)
    for (int i = 0; i < d; ++i) {
      const float g = x[(size_t)t * 2 * d + i], u = x[(size_t)t * 2 * d + d + i];
      want[(size_t)t * d + i] = g / (1.f + std::exp(-g)) * u;
    }
  hx::DeviceBuffer<float> dx(x), dout(want.size());
  dout.poison();
  HX_CHECK(elementwise::launch_silu_and_mul<float>(dout.ptr, dx.ptr, tokens, d, d % 4 == 0, nullptr));
  HX_CHECK(cudaDeviceSynchronize());
  expect_close(dout.download(), want, "silu_and_mul");
}

int main() {
  if (!hx::have_gpu()) return 0;
  std::mt19937 rng(99);
  for (int tokens : {1, 19, 99})
    for (int hidden : {64, 989, 4096, 16384}) {
      check_rms_norm(tokens, hidden, false, rng);
      check_rms_norm(tokens, hidden, true, rng);
      check_rms_norm_f32_residual(tokens, hidden, rng);
    }
  check_rms_norm_f32_residual(19, 17, rng);  // scalar path
  for (int tokens : {1, 17, 99}) {
    check_rotary(tokens, 8, 2, 128, 128, rng);
    check_rotary(tokens, 4, 4, 64, 64, rng);
    check_rotary(tokens, 6, 1, 64, 32, rng);  // partial rotary
    check_rotary(tokens, 3, 1, 10, 6, rng);   // scalar path
  }
  for (int tokens : {1, 19, 99}) {
    check_silu(tokens, 4096, rng);
    check_silu(tokens, 989, rng);
  }
  std::printf("test_elementwise: OK\n");
  return 0;
}
