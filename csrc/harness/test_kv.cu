// Standalone check of csrc/include/radixserve/kv.cuh against a CPU reference.
#include <algorithm>
#include <numeric>

#include "harness.h"
#include "radixserve/kv.cuh"

using namespace radixserve;

template <typename IdxT>
static void check_store_kv(int num_slots, int num_tokens, int heads, int head_dim, bool strided,
                           std::mt19937& rng) {
  const int row = heads * head_dim;
  const int kstride = strided ? row * 3 : row;  // token stride of k/v (a fused qkv buffer)
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  std::vector<float> kc(num_slots * (size_t)row), vc(num_slots * (size_t)row);
  for (auto& x : kc) x = U(rng);
  for (auto& x : vc) x = U(rng);
  std::vector<float> k(num_tokens * (size_t)kstride), v(num_tokens * (size_t)kstride);
  for (auto& x : k) x = U(rng);
  for (auto& x : v) x = U(rng);
  std::vector<int> perm(num_slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<IdxT> slots(num_tokens);
  for (int t = 0; t < num_tokens; ++t) slots[t] = (IdxT)perm[t];
  hx::DeviceBuffer<float> dkc(kc), dvc(vc), dk(k), dv(v);
  hx::DeviceBuffer<IdxT> ds(slots);
  kv::StoreKvParams p{dkc.ptr, dvc.ptr, dk.ptr, dv.ptr, ds.ptr, num_tokens, num_slots, row, kstride, kstride};
  const bool vec = (row * 4) % 16 == 0 && (kstride * 4) % 16 == 0;
  HX_CHECK((kv::launch_store_kv<float, IdxT>(p, vec, nullptr)));
  HX_CHECK(cudaDeviceSynchronize());
  for (int t = 0; t < num_tokens; ++t)
    for (int i = 0; i < row; ++i) {
      kc[(size_t)slots[t] * row + i] = k[(size_t)t * kstride + i];
      vc[(size_t)slots[t] * row + i] = v[(size_t)t * kstride + i];
    }
  HX_EXPECT(dkc.download() == kc, "store_kv k_cache mismatch (tokens=%d heads=%d d=%d)", num_tokens, heads, head_dim);
  HX_EXPECT(dvc.download() == vc, "store_kv v_cache mismatch (tokens=%d heads=%d d=%d)", num_tokens, heads, head_dim);
}

static void check_build_kv_indices(int batch, int max_len, std::mt19937& rng) {
  const int max_reqs = batch + 7;
  std::vector<int32_t> r2t((size_t)max_reqs * max_len);
  for (auto& x : r2t) x = (int32_t)(rng() % 1000003) + 1;
  std::vector<int> rows(max_reqs);
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  std::vector<int64_t> rpi(batch), lens(batch);
  int64_t total = 0;
  for (int b = 0; b < batch; ++b) {
    rpi[b] = rows[b];
    lens[b] = 1 + (int64_t)(rng() % max_len);
    total += lens[b];
  }
  hx::DeviceBuffer<int32_t> dr2t(r2t), dindptr(batch + 1), dind(total + 5);
  hx::DeviceBuffer<int64_t> drpi(rpi), dlens(lens);
  dindptr.poison();
  dind.poison();
  kv::BuildKvIndicesParams p{dr2t.ptr, max_len, drpi.ptr, dlens.ptr, dindptr.ptr, dind.ptr, batch};
  HX_CHECK((kv::launch_build_kv_indices<int64_t, int64_t>(p, 132, nullptr)));
  HX_CHECK(cudaDeviceSynchronize());
  auto indptr = dindptr.download();
  auto ind = dind.download();
  int64_t off = 0;
  HX_EXPECT(indptr[0] == 0, "indptr[0] = %d", indptr[0]);
  for (int b = 0; b < batch; ++b) {
    for (int j = 0; j < lens[b]; ++j)
      HX_EXPECT(ind[off + j] == r2t[(size_t)rpi[b] * max_len + j], "kv_indices[%lld] (b=%d j=%d)",
                (long long)(off + j), b, j);
    off += lens[b];
    HX_EXPECT(indptr[b + 1] == off, "indptr[%d] = %d, want %lld", b + 1, indptr[b + 1], (long long)off);
  }
}

int main() {
  if (!hx::have_gpu()) return 0;
  std::mt19937 rng(1234);
  for (int tokens : {1, 19, 99})
    for (int hd : {64, 128}) {
      check_store_kv<int32_t>(1000, tokens, 8, hd, false, rng);
      check_store_kv<int64_t>(1000, tokens, 2, hd, true, rng);
    }
  check_store_kv<int32_t>(300, 17, 3, 5, false, rng);  // odd row: scalar path
  for (int batch : {1, 19, 99, 3000}) check_build_kv_indices(batch, batch > 1000 ? 300 : 4097, rng);
  std::printf("test_kv: OK\n");
  return 0;
}
