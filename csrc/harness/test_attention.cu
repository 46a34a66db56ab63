// Standalone check of the attention kernels (csrc/include/radixserve/{decode,extend}_attention.cuh)
// against a double-precision CPU reference:
//   paged decode: one query per request over its paged KV, unsplit and split along the sequence;
//                 unsplit, both the tensor-core kernel (groups of 4 and 8 per subgroup) and the
//                 CUDA-core kernel;
//   paged extend: a chunk of new queries per request over its cached prefix plus the chunk,
//                 causal among the chunk; the mma.sync kernel everywhere, and the wgmma kernel
//                 too where ops/attention.cu would pick it (a 9.0 device, an sm_90a image).
// bf16 and fp16, head_dim 64 and 128, GQA groups 1, 3, 4, 6 and 8 (the wgmma extend kernel packs
// 1, 1, 4, 2 and 8 q heads per tile), variable lengths (1 token up to a few hundred, crossing the
// kernels' tile sizes; short chunks over long prefixes), KV slots scattered through a larger pool,
// q as a strided view of a fused qkv buffer (groups above 1), outputs poisoned with NaN and
// followed by a guard region that must stay untouched. Tolerances are
// tests/gpu/test_attention.py's. Decode runs twice per split count, extend twice per problem and
// kernel: the same bits, and the counters left zero. Where the wgmma kernel packs heads, it must
// also give the bits of the same problem with the K/V heads copied out to one per q head (group
// 1, one head per tile): packing regroups rows, the arithmetic of each row stays as it was.
//
// Launch: through radixserve/attention_launch.cuh, the same launchers (split count, kernel choice,
// grids) csrc/ops/attention.cu uses.
#include <algorithm>
#include <numeric>
#include <type_traits>
#include <utility>

#include "harness.h"
#include "radixserve/attention_launch.cuh"

using namespace radixserve;

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr uint16_t kPoison = 0xFFFF;  // a NaN in bf16 and in fp16

// ----------------------------------------------------------------------------- dtypes

struct Bf16 {
  using Device = __nv_bfloat16;
  static constexpr const char* kName = "bf16";
  static constexpr double kRelTol = 1e-2, kAbsTol = 3e-2;  // relative Frobenius, max abs
  static uint16_t from_float(float x) { return hx::f2bf(x); }
  static float to_float(uint16_t b) { return hx::bf2f(b); }
};

struct Fp16 {
  using Device = __half;
  static constexpr const char* kName = "fp16";
  static constexpr double kRelTol = 2e-3, kAbsTol = 5e-3;
  static uint16_t from_float(float x) { return hx::f2h(x); }
  static float to_float(uint16_t b) { return hx::h2f(b); }
};

// ----------------------------------------------------------------------------- launches
// Through radixserve/attention_launch.cuh, the launchers csrc/ops/attention.cu uses.
using attn::decode_group_max;
using attn::decode_num_splits;

// ----------------------------------------------------------------------------- problems

// One batch: request b has qo_len[b] new queries at KV positions prefix_len[b] ..
// prefix_len[b] + qo_len[b] - 1, kv_len[b] = prefix_len[b] + qo_len[b]. Decode is qo_len = 1.
template <typename H>
struct Problem {
  int hq = 0, hkv = 0, d = 0, num_slots = 0;
  int64_t q_stride_t = 0;  // elements between consecutive query tokens (> hq * d: fused qkv)
  std::vector<int32_t> qo_indptr, kv_indptr, kv_indices;  // [batch + 1], [batch + 1], [nnz]
  std::vector<uint16_t> q;     // [num_q, q_stride_t], the q heads first: H's bits
  std::vector<uint16_t> k, v;  // [num_slots, hkv, d]
  int batch() const { return (int)qo_indptr.size() - 1; }
  int num_q() const { return qo_indptr.back(); }
};

template <typename H>
Problem<H> make_problem(int hq, int hkv, int d, const std::vector<int>& qo_lens,
                        const std::vector<int>& prefix_lens, bool strided_q, std::mt19937& rng,
                        bool consecutive_slots = false) {
  Problem<H> pr;
  pr.hq = hq;
  pr.hkv = hkv;
  pr.d = d;
  pr.q_stride_t = (int64_t)(strided_q ? hq + 2 * hkv : hq) * d;
  const int batch = (int)qo_lens.size();
  pr.qo_indptr.assign(batch + 1, 0);
  pr.kv_indptr.assign(batch + 1, 0);
  for (int b = 0; b < batch; ++b) {
    pr.qo_indptr[b + 1] = pr.qo_indptr[b] + qo_lens[b];
    pr.kv_indptr[b + 1] = pr.kv_indptr[b] + prefix_lens[b] + qo_lens[b];
  }
  const int nnz = pr.kv_indptr[batch];
  pr.num_slots = nnz + nnz / 3 + 97;
  std::vector<int32_t> perm(pr.num_slots);
  std::iota(perm.begin(), perm.end(), 0);
  // scattered slots, or (consecutive_slots) the requests' KV in one run from slot 5 on, as a
  // fresh pool hands it out: whole tiles of it take the wgmma kernel's TMA path
  if (consecutive_slots) std::rotate(perm.begin(), perm.begin() + 5, perm.end());
  else std::shuffle(perm.begin(), perm.end(), rng);
  pr.kv_indices.assign(perm.begin(), perm.begin() + nnz);
  std::normal_distribution<float> N(0.f, 1.f);
  pr.q.resize((size_t)pr.num_q() * pr.q_stride_t);
  pr.k.resize((size_t)pr.num_slots * hkv * d);
  pr.v.resize(pr.k.size());
  for (auto* t : {&pr.q, &pr.k, &pr.v})
    for (auto& x : *t) x = H::from_float(N(rng));
  return pr;
}

// The same problem with every q head given its own copy of its kv head (hkv = hq, group 1).
template <typename H>
Problem<H> with_kv_per_q_head(const Problem<H>& pr) {
  Problem<H> x = pr;
  const int group = pr.hq / pr.hkv;
  x.hkv = pr.hq;
  x.k.resize((size_t)pr.num_slots * pr.hq * pr.d);
  x.v.resize(x.k.size());
  for (size_t slot = 0; slot < (size_t)pr.num_slots; ++slot)
    for (int h = 0; h < pr.hq; ++h) {
      const size_t from = (slot * pr.hkv + h / group) * pr.d, to = (slot * pr.hq + h) * pr.d;
      std::copy_n(&pr.k[from], pr.d, &x.k[to]);
      std::copy_n(&pr.v[from], pr.d, &x.v[to]);
    }
  return x;
}

// out[t][h][:] = sum over allowed kv positions j of softmax_j(q_t,h . k_j * scale) v_j, where
// query i of request b sits at kv position prefix_len + i and sees positions <= it.
template <typename H>
std::vector<double> reference(const Problem<H>& pr, double scale) {
  const int hq = pr.hq, d = pr.d, group = pr.hq / pr.hkv;
  auto widen = [](const std::vector<uint16_t>& x) {
    std::vector<double> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = H::to_float(x[i]);
    return r;
  };
  const std::vector<double> q = widen(pr.q), k = widen(pr.k), v = widen(pr.v);
  std::vector<double> out((size_t)pr.num_q() * hq * d, 0.0);
  std::vector<double> s;
  for (int b = 0; b < pr.batch(); ++b) {
    const int qo_len = pr.qo_indptr[b + 1] - pr.qo_indptr[b];
    const int kv_len = pr.kv_indptr[b + 1] - pr.kv_indptr[b];
    for (int i = 0; i < qo_len; ++i) {
      const int t = pr.qo_indptr[b] + i;
      const int last = kv_len - qo_len + i;
      s.assign(last + 1, 0.0);
      for (int h = 0; h < hq; ++h) {
        const int kh = h / group;
        const double* qv = &q[(size_t)t * pr.q_stride_t + (size_t)h * d];
        double mx = -INFINITY;
        for (int j = 0; j <= last; ++j) {
          const size_t row = ((size_t)pr.kv_indices[pr.kv_indptr[b] + j] * pr.hkv + kh) * d;
          double a = 0;
          for (int e = 0; e < d; ++e) a += qv[e] * k[row + e];
          s[j] = a * scale;
          mx = std::max(mx, s[j]);
        }
        double den = 0;
        for (int j = 0; j <= last; ++j) den += (s[j] = std::exp(s[j] - mx));
        double* o = &out[((size_t)t * hq + h) * d];
        for (int j = 0; j <= last; ++j) {
          const size_t row = ((size_t)pr.kv_indices[pr.kv_indptr[b] + j] * pr.hkv + kh) * d;
          const double w = s[j] / den;
          for (int e = 0; e < d; ++e) o[e] += w * v[row + e];
        }
      }
    }
  }
  return out;
}

// got: [ref.size() + guard] bits of H; the first ref.size() against ref, the guard untouched.
template <typename H>
void expect_close(const std::vector<uint16_t>& got, const std::vector<double>& ref, const char* what) {
  double num = 0, den = 0, max_abs = 0, max_ref = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = H::to_float(got[i]);
    HX_EXPECT(std::isfinite(g), "%s: out[%zu] = %g (unwritten or NaN)", what, i, g);
    num += (g - ref[i]) * (g - ref[i]);
    den += ref[i] * ref[i];
    max_abs = std::max(max_abs, std::fabs(g - ref[i]));
    max_ref = std::max(max_ref, std::fabs(ref[i]));
  }
  for (size_t i = ref.size(); i < got.size(); ++i)
    HX_EXPECT(got[i] == kPoison, "%s: wrote past the output (element %zu)", what, i);
  const double rel = std::sqrt(num / den);
  std::printf("  %-52s rel %.2e  max abs %.2e\n", what, rel, max_abs);
  HX_EXPECT(rel < H::kRelTol, "%s: relative error %.3e >= %.1e", what, rel, H::kRelTol);
  HX_EXPECT(max_abs < H::kAbsTol * std::max(1.0, max_ref), "%s: max abs error %.3e", what, max_abs);
}

constexpr int kGuard = 4096;  // poisoned elements after each output

template <typename H, int D>
void check_decode(int hq, int hkv, bool strided_q, int sms, std::mt19937& rng) {
  using T = typename H::Device;
  // crossing the kernel's per-step token counts (32 or 64) and the 64-token split floor
  const std::vector<int> kv_lens = {1, 17, 64, 129, 300, 2, 77, 513};
  const int batch = (int)kv_lens.size();
  std::vector<int> prefix(batch);
  for (int b = 0; b < batch; ++b) prefix[b] = kv_lens[b] - 1;
  const auto pr = make_problem<H>(hq, hkv, D, std::vector<int>(batch, 1), prefix, strided_q, rng);
  const double scale = 1.0 / std::sqrt((double)D);
  const auto ref = reference(pr, scale);

  hx::DeviceBuffer<uint16_t> dq(pr.q), dk(pr.k), dv(pr.v), dout(ref.size() + kGuard);
  hx::DeviceBuffer<int32_t> dindptr(pr.kv_indptr), dindices(pr.kv_indices);
  const int group = hq / hkv, gmax = decode_group_max(group);
  const int num_sub = (group + gmax - 1) / gmax;
  const int heuristic = decode_num_splits(batch, hkv, num_sub, (int64_t)pr.kv_indices.size(), sms);
  // ops' choice, then 1, 5 and 64 (grids of more splits than a request's own plan uses: its
  // extra splits exit, and the 1- and 2-token requests run as one split writing directly)
  std::vector<int> split_counts = {heuristic};
  for (int s : {1, 5, 64})
    if (s != heuristic) split_counts.push_back(s);
  // the last-CTA merge's arrival counters: zero once, and every launch must leave them zero
  const size_t num_counters = (size_t)batch * hkv * num_sub;
  hx::DeviceBuffer<int32_t> counters(num_counters);
  HX_CHECK(cudaMemset(counters.ptr, 0, num_counters * sizeof(int32_t)));
  for (int splits : split_counts) {
    hx::DeviceBuffer<float> part_o((size_t)batch * hq * splits * D), part_lse((size_t)batch * hq * splits);
    part_o.poison(0xFF);
    part_lse.poison(0xFF);
    dout.poison(0xFF);
    attn::DecodeParams p{};
    p.q = dq.ptr;
    p.k = dk.ptr;
    p.v = dv.ptr;
    p.out = dout.ptr;
    p.part_o = splits > 1 ? part_o.ptr : nullptr;
    p.part_lse = splits > 1 ? part_lse.ptr : nullptr;
    p.split_counters = splits > 1 ? counters.ptr : nullptr;
    p.kv_indptr = dindptr.ptr;
    p.kv_indices = dindices.ptr;
    p.q_stride_b = pr.q_stride_t;
    p.q_stride_h = D;
    p.kv_stride_slot = (int64_t)hkv * D;
    p.kv_stride_h = D;
    p.num_q_heads = hq;
    p.num_kv_heads = hkv;
    p.group = group;
    p.num_sub = num_sub;
    p.num_splits = splits;
    p.num_sms = sms;
    p.scale_log2 = (float)scale * kLog2e;
    // one split: the tensor-core kernel where it serves, and the CUDA-core kernel
    for (bool tc : {true, false}) {
      const bool mma = attn::decode_uses_tensor_cores(group, splits, D, tc);
      if (!tc && !attn::decode_uses_tensor_cores(group, splits, D, true)) continue;  // same run
      dout.poison(0xFF);
      HX_CHECK((attn::launch_paged_decode<T, D>(p, batch, nullptr, tc)));
      HX_CHECK(cudaDeviceSynchronize());
      char what[160];
      std::snprintf(what, sizeof what, "decode %s d%d hq%d/hkv%d%s splits=%d%s %s", H::kName, D,
                    hq, hkv, strided_q ? " strided-q" : "", splits,
                    splits == heuristic ? " (ops' choice)" : "", mma ? "mma" : "simt");
      const std::vector<uint16_t> first = dout.download();
      expect_close<H>(first, ref, what);
      for (int32_t c : counters.download())
        HX_EXPECT(c == 0, "%s: a split counter left at %d", what, c);
      // again over the same counters: the same bits
      dout.poison(0xFF);
      HX_CHECK((attn::launch_paged_decode<T, D>(p, batch, nullptr, tc)));
      HX_CHECK(cudaDeviceSynchronize());
      HX_EXPECT(dout.download() == first, "%s: a second launch wrote other bits", what);
    }
  }
}

// New tokens per request and the cached prefix before them.
struct ExtendLengths {
  const char* name;
  std::vector<int> qo, prefix;
};
// one token with and without a prefix, chunks longer than a 128-row query tile, prefixes off the
// 64-row KV tile
const ExtendLengths kMixedLengths = {
    "mixed", {1, 17, 130, 3, 64, 40, 1, 129}, {0, 40, 7, 255, 0, 1, 300, 64}};
// short chunks over prefixes of hundreds of tokens (odd lengths: packed tiles of 16, 32 and 64
// tokens end part-filled, their rows' causal limits far from a KV tile's start)
const ExtendLengths kShortLengths = {
    "short", {1, 3, 17, 33, 2, 9, 64, 1}, {300, 517, 260, 389, 129, 700, 255, 1023}};

// Runs the problem through the extend launcher into dout, twice (the wgmma kernel's CTAs take
// items in any order: the same bits; its item queue left zero); returns the output.
template <typename H, int D>
std::vector<uint16_t> run_extend(const Problem<H>& pr, bool wgmma, int sms,
                                 hx::DeviceBuffer<uint16_t>& dout, const char* what) {
  using T = typename H::Device;
  hx::DeviceBuffer<uint16_t> dq(pr.q), dk(pr.k), dv(pr.v);
  hx::DeviceBuffer<int32_t> dqo(pr.qo_indptr), dkv(pr.kv_indptr), dindices(pr.kv_indices);
  attn::ExtendParams p{};
  p.q = dq.ptr;
  p.k = dk.ptr;
  p.v = dv.ptr;
  p.out = dout.ptr;
  p.qo_indptr = dqo.ptr;
  p.kv_indptr = dkv.ptr;
  p.kv_indices = dindices.ptr;
  p.q_stride_t = pr.q_stride_t;
  p.q_stride_h = D;
  p.kv_stride_slot = (int64_t)pr.hkv * D;
  p.kv_stride_h = D;
  p.batch = pr.batch();
  p.num_q_heads = pr.hq;
  p.group = pr.hq / pr.hkv;
  p.scale_log2 = (float)(1.0 / std::sqrt((double)D)) * kLog2e;
  hx::DeviceBuffer<int32_t> work(std::vector<int32_t>(2, 0));   // the wgmma kernel's item queue
  p.work_counters = work.ptr;
  p.num_slots = pr.num_slots;
  p.num_sms = sms;
  std::vector<uint16_t> first;
  for (int run = 0; run < 2; ++run) {
    dout.poison(0xFF);
    HX_CHECK((attn::launch_paged_extend<T, D>(p, pr.num_q(), wgmma, nullptr)));
    HX_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> got = dout.download();
    if (run == 0) first = std::move(got);
    else HX_EXPECT(got == first, "%s: a second launch gave other bits", what);
    const std::vector<int32_t> left = work.download();
    HX_EXPECT(left[0] == 0 && left[1] == 0, "%s: work counters left at %d, %d", what, left[0],
              left[1]);
  }
  return first;
}

template <typename H, int D>
void check_extend(int hq, int hkv, bool strided_q, bool consecutive_slots,
                  const ExtendLengths& lens, int sms, std::mt19937& rng) {
  using T = typename H::Device;
  const auto pr =
      make_problem<H>(hq, hkv, D, lens.qo, lens.prefix, strided_q, rng, consecutive_slots);
  const auto ref = reference(pr, 1.0 / std::sqrt((double)D));
  hx::DeviceBuffer<uint16_t> dout(ref.size() + kGuard);
  std::vector<bool> kernels = {false};
  if (attn::extend_wgmma_available<T, D>()) kernels.push_back(true);
  for (bool wgmma : kernels) {
    char what[128];
    std::snprintf(what, sizeof what, "extend %s d%d hq%d/hkv%d%s%s %s %s", H::kName, D, hq, hkv,
                  strided_q ? " strided-q" : "", consecutive_slots ? " consecutive" : "",
                  lens.name, wgmma ? "wgmma" : "mma.sync");
    const std::vector<uint16_t> got = run_extend<H, D>(pr, wgmma, sms, dout, what);
    expect_close<H>(got, ref, what);
    if (wgmma && attn::sm90::extend_pack_log2(hq / hkv) > 0) {
      const std::vector<uint16_t> one_head =
          run_extend<H, D>(with_kv_per_q_head(pr), true, sms, dout, what);
      HX_EXPECT(got == one_head, "%s: other bits than one q head per tile", what);
    }
  }
}

template <typename H, int D>
void check_family(int sms, std::mt19937& rng) {
  // group 1 with contiguous q; groups 4, 8, 6 and 3 with q a view of a fused qkv buffer; 32 q
  // heads: more extend work items than multiprocessors, so the persistent wgmma kernel's CTAs
  // take several
  for (auto [hq, hkv] : {std::pair{4, 4}, std::pair{8, 2}, std::pair{16, 2}, std::pair{12, 2},
                         std::pair{6, 2}, std::pair{32, 8}}) {
    const bool strided_q = hq != hkv;
    check_decode<H, D>(hq, hkv, strided_q, sms, rng);
    for (const ExtendLengths* lens : {&kMixedLengths, &kShortLengths})
      for (bool consecutive_slots : {false, true})
        check_extend<H, D>(hq, hkv, strided_q, consecutive_slots, *lens, sms, rng);
  }
}

}  // namespace

int main() {
  if (!hx::have_gpu()) return 0;
  int dev = 0, sms = 0;
  HX_CHECK(cudaGetDevice(&dev));
  HX_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  std::mt19937 rng(1234);
  check_family<Bf16, 64>(sms, rng);
  check_family<Bf16, 128>(sms, rng);
  check_family<Fp16, 64>(sms, rng);
  check_family<Fp16, 128>(sms, rng);
  std::printf("test_attention: OK\n");
  return 0;
}
