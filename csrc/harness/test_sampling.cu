// Standalone check of csrc/include/radixserve/sampling.cuh: greedy rows, logprobs, masked tokens,
// determinism, and the empirical distribution of many draws of one row (distinct offsets) against
// a CPU (double) implementation of reference.filtered_probs.
#include <algorithm>
#include <numeric>

#include "harness.h"
#include "radixserve/sampling.cuh"

using namespace radixserve;

struct RowConfig {
  const char* name;
  int vocab;
  bool bf16;
  bool masked;
  float temperature, top_p, min_p;
  int top_k;
};

static std::vector<float> make_logits(int vocab, bool bf16, std::mt19937& rng) {
  std::normal_distribution<float> N(0.f, 2.f);
  std::vector<float> x(vocab);
  for (auto& v : x) v = N(rng);
  if (bf16)
    for (auto& v : x) v = hx::bf2f(hx::f2bf(v));
  return x;
}

static std::vector<int32_t> make_mask(int vocab, std::mt19937& rng) {
  std::vector<int32_t> m((vocab + 31) / 32, 0);
  for (int i = 0; i < vocab; ++i)
    if (rng() % 10 < 7) m[i / 32] |= (int32_t)(1u << (i % 32));
  return m;
}

static bool allowed(const std::vector<int32_t>& m, int i) {
  return m.empty() || (((uint32_t)m[i / 32] >> (i % 32)) & 1u);
}

// reference.filtered_probs for one row, in double.
static std::vector<double> filtered_probs(const std::vector<float>& x, const std::vector<int32_t>& m,
                                          const RowConfig& c) {
  const int V = (int)x.size();
  std::vector<int> ids;
  for (int i = 0; i < V; ++i)
    if (allowed(m, i)) ids.push_back(i);
  double M = -INFINITY;
  for (int i : ids) M = std::max(M, (double)x[i]);
  const double t = std::max((double)c.temperature, 1e-6);
  std::vector<double> e(V, 0.0);
  double Z = 0;
  for (int i : ids) Z += (e[i] = std::exp(((double)x[i] - M) / t));
  std::sort(ids.begin(), ids.end(), [&](int a, int b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  const int k = (c.top_k <= 0 || c.top_k > V) ? V : c.top_k;
  std::vector<double> out(V, 0.0);
  double cum = 0, S = 0;
  for (int r = 0; r < (int)ids.size(); ++r) {
    const int i = ids[r];
    const bool keep = r == 0 || (r < k && cum < c.top_p * Z && e[i] >= c.min_p);
    cum += e[i];
    if (!keep) break;
    out[i] = e[i];
    S += e[i];
  }
  for (auto& v : out) v /= S;
  return out;
}

struct Run {
  std::vector<int64_t> ids;
  std::vector<float> logprobs;
};

// Samples `rows` copies of one logits row (row stride 0), offsets 0..rows-1.
static Run sample(const std::vector<float>& x, const std::vector<int32_t>& m, const RowConfig& c, int rows,
                  int64_t seed) {
  const int V = c.vocab;
  std::vector<uint16_t> xb;
  if (c.bf16) {
    xb.resize(V);
    for (int i = 0; i < V; ++i) xb[i] = hx::f2bf(x[i]);
  }
  hx::DeviceBuffer<float> dx(c.bf16 ? 1 : V);
  hx::DeviceBuffer<uint16_t> dxb(c.bf16 ? V : 1);
  if (c.bf16) dxb.upload(xb); else dx.upload(x);
  hx::DeviceBuffer<int32_t> dm(m.empty() ? 1 : m.size());
  if (!m.empty()) dm.upload(m);
  hx::DeviceBuffer<float> dt(std::vector<float>(rows, c.temperature)), dp(std::vector<float>(rows, c.top_p)),
      dmp(std::vector<float>(rows, c.min_p));
  hx::DeviceBuffer<int32_t> dk(std::vector<int32_t>(rows, c.top_k));
  std::vector<int64_t> offs(rows);
  std::iota(offs.begin(), offs.end(), 0);
  hx::DeviceBuffer<int64_t> ds(std::vector<int64_t>(rows, seed)), doff(offs), dids(rows);
  hx::DeviceBuffer<float> dlp(rows);
  dids.poison();
  dlp.poison();
  sampling::SampleParams p{};
  p.logits = c.bf16 ? (const void*)dxb.ptr : (const void*)dx.ptr;
  p.logits_stride = 0;
  p.bitmask = m.empty() ? nullptr : dm.ptr;
  p.bitmask_stride = 0;
  p.temperature = dt.ptr;
  p.top_k = dk.ptr;
  p.top_p = dp.ptr;
  p.min_p = dmp.ptr;
  p.seeds = ds.ptr;
  p.offsets = doff.ptr;
  p.out_ids = dids.ptr;
  p.out_logprobs = dlp.ptr;
  p.batch = rows;
  p.vocab = V;
  const bool vec = (V * (c.bf16 ? 2 : 4)) % 16 == 0;
  if (c.bf16)
    HX_CHECK(sampling::launch_bitmask_sample<__nv_bfloat16>(p, vec, nullptr));
  else
    HX_CHECK(sampling::launch_bitmask_sample<float>(p, vec, nullptr));
  HX_CHECK(cudaDeviceSynchronize());
  return {dids.download(), dlp.download()};
}

static void check_config(const RowConfig& c, std::mt19937& rng) {
  const auto x = make_logits(c.vocab, c.bf16, rng);
  const auto m = c.masked ? make_mask(c.vocab, rng) : std::vector<int32_t>{};
  double mx = -INFINITY, s = 0;
  for (float v : x) mx = std::max(mx, (double)v);
  for (float v : x) s += std::exp((double)v - mx);
  const double lse = mx + std::log(s);
  const int rows = c.temperature > 0 ? 1 << 16 : 4;
  const Run a = sample(x, m, c, rows, 42);
  for (int r = 0; r < rows; ++r) {
    const int64_t id = a.ids[r];
    HX_EXPECT(id >= 0 && id < c.vocab, "[%s] id %lld out of range", c.name, (long long)id);
    HX_EXPECT(allowed(m, (int)id), "[%s] masked token %lld returned", c.name, (long long)id);
    const double want = (double)x[id] - lse;
    HX_EXPECT(std::fabs(a.logprobs[r] - want) <= 1e-4 + 1e-5 * std::fabs(want),
              "[%s] logprob %f want %f", c.name, a.logprobs[r], want);
  }
  if (c.temperature <= 0) {
    int best = -1;
    for (int i = 0; i < c.vocab; ++i)
      if (allowed(m, i) && (best < 0 || x[i] > x[best])) best = i;
    for (int r = 0; r < rows; ++r) HX_EXPECT(a.ids[r] == best, "[%s] greedy %lld want %d", c.name, (long long)a.ids[r], best);
    std::printf("  %-28s greedy ok\n", c.name);
    return;
  }
  const Run b = sample(x, m, c, rows, 42);
  HX_EXPECT(a.ids == b.ids, "[%s] not deterministic for equal (seed, offset)", c.name);
  const auto probs = filtered_probs(x, m, c);
  std::vector<double> freq(c.vocab, 0.0);
  for (int r = 0; r < rows; ++r) freq[a.ids[r]] += 1.0 / rows;
  double tv = 0, expected_tv = 0;
  int support = 0;
  for (int i = 0; i < c.vocab; ++i) {
    HX_EXPECT(!(freq[i] > 0 && probs[i] == 0), "[%s] token %d sampled outside the kept set", c.name, i);
    tv += 0.5 * std::fabs(freq[i] - probs[i]);
    expected_tv += 0.5 * std::sqrt(2.0 * probs[i] * (1 - probs[i]) / (3.141592653589793 * rows));
    support += probs[i] > 0;
  }
  std::printf("  %-28s support %5d  TV %.4f (expected ~%.4f)\n", c.name, support, tv, expected_tv);
  HX_EXPECT(tv <= 1.5 * expected_tv + 0.005, "[%s] TV %.4f too large (expected ~%.4f)", c.name, tv, expected_tv);
}

int main() {
  if (!hx::have_gpu()) return 0;
  std::mt19937 rng(7);
  const RowConfig configs[] = {
      {"greedy f32 masked", 5000, false, true, 0.f, 1.f, 0.f, 0},
      {"greedy bf16 odd vocab", 1001, true, true, 0.f, 0.9f, 0.f, 10},
      {"topk40 topp0.9 masked", 4096, false, true, 1.f, 0.9f, 0.f, 40},
      {"topk5 bf16 odd vocab", 1001, true, true, 0.8f, 1.f, 0.f, 5},
      {"topk900 topp0.95 minp", 20000, false, true, 1.3f, 0.95f, 0.001f, 900},
      {"topp0.8 t0.7 (stream)", 3000, false, true, 0.7f, 0.8f, 0.f, 0},
      {"minp0.05 t1.5 (stream)", 3000, false, false, 1.5f, 1.f, 0.05f, 0},
      {"plain t1 (one pass)", 777, false, true, 1.f, 1.f, 0.f, 0},
      {"plain t0.6 bf16 (one pass)", 40000, true, true, 0.6f, 1.f, 0.f, 0},
      {"topk2000>cap topp (stream)", 20000, false, true, 1.f, 0.97f, 0.f, 2000},
  };
  for (const auto& c : configs) check_config(c, rng);
  std::printf("test_sampling: OK\n");
  return 0;
}
