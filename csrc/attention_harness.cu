// Standalone check of the attention kernels (no torch, no Python): random bf16 inputs, KV slots
// scattered through a pool, decode (split and unsplit) and extend against a double-precision
// CPU reference. Exit status 0 = pass. Build: nvcc -std=c++20 -Icsrc/include
//   -gencode=arch=compute_90a,code=sm_90a csrc/attention_harness.cu -o attention_harness
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "radixserve/decode_attention.cuh"
#include "radixserve/extend_attention.cuh"

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                  \
                   cudaGetErrorString(e_));                                           \
      std::exit(2);                                                                   \
    }                                                                                 \
  } while (0)

using bf16 = __nv_bfloat16;
namespace ra = radixserve::attn;

static float bf(bf16 x) { return __bfloat162float(x); }

template <typename T>
static T* upload(const std::vector<T>& h) {
  T* d;
  CK(cudaMalloc(&d, h.size() * sizeof(T) + 16));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// out[t][h][:] = softmax over allowed kv positions of q.k * scale, times v
static void reference(const std::vector<bf16>& q, const std::vector<bf16>& k,
                      const std::vector<bf16>& v, const std::vector<int>& qo_indptr,
                      const std::vector<int>& kv_indptr, const std::vector<int>& idx, int hq,
                      int hkv, int d, float scale, std::vector<double>& out) {
  const int batch = (int)qo_indptr.size() - 1;
  out.assign(q.size(), 0.0);
  for (int b = 0; b < batch; ++b) {
    const int qo_len = qo_indptr[b + 1] - qo_indptr[b];
    const int kv_len = kv_indptr[b + 1] - kv_indptr[b];
    for (int i = 0; i < qo_len; ++i) {
      const int t = qo_indptr[b] + i;
      const int last = kv_len - qo_len + i;
      for (int h = 0; h < hq; ++h) {
        const int kh = h / (hq / hkv);
        std::vector<double> s(last + 1);
        double mx = -1e300;
        for (int j = 0; j <= last; ++j) {
          const long long slot = idx[kv_indptr[b] + j];
          double a = 0;
          for (int e = 0; e < d; ++e)
            a += (double)bf(q[((size_t)t * hq + h) * d + e]) * bf(k[(slot * hkv + kh) * d + e]);
          s[j] = a * scale;
          mx = std::max(mx, s[j]);
        }
        double den = 0;
        for (int j = 0; j <= last; ++j) den += (s[j] = std::exp(s[j] - mx));
        for (int j = 0; j <= last; ++j) {
          const long long slot = idx[kv_indptr[b] + j];
          for (int e = 0; e < d; ++e)
            out[((size_t)t * hq + h) * d + e] += s[j] / den * bf(v[(slot * hkv + kh) * d + e]);
        }
      }
    }
  }
}

static double rel_err(const std::vector<bf16>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = bf(got[i]);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - ref[i]) * (g - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

int main() {
  constexpr int D = 128;
  const int hq = 9, hkv = 3;
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd;
  const std::vector<int> kv_lens = {1, 17, 989, 300, 1500};
  const std::vector<int> qo_lens = {1, 17, 200, 1, 129};
  const int batch = (int)kv_lens.size();
  std::vector<int> kv_indptr(batch + 1, 0), qo_indptr(batch + 1, 0), dec_indptr(batch + 1, 0);
  for (int b = 0; b < batch; ++b) {
    kv_indptr[b + 1] = kv_indptr[b] + kv_lens[b];
    qo_indptr[b + 1] = qo_indptr[b] + qo_lens[b];
    dec_indptr[b + 1] = dec_indptr[b] + 1;
  }
  const int nnz = kv_indptr[batch];
  const int num_slots = nnz * 2 + 5;
  std::vector<int> perm(num_slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int> idx(perm.begin(), perm.begin() + nnz);
  std::vector<bf16> k((size_t)num_slots * hkv * D), v(k.size());
  for (auto& x : k) x = __float2bfloat16(nd(rng));
  for (auto& x : v) x = __float2bfloat16(nd(rng));
  const int nq = qo_indptr[batch];
  std::vector<bf16> q((size_t)nq * hq * D);
  for (auto& x : q) x = __float2bfloat16(nd(rng));
  const float scale = 1.0f / std::sqrt((float)D);
  const float scale_log2 = scale * 1.4426950408889634f;

  bf16 *dq = upload(q), *dk = upload(k), *dv = upload(v);
  int *d_idx = upload(idx), *d_kv = upload(kv_indptr), *d_qo = upload(qo_indptr);
  int fails = 0;

  // ---- extend
  {
    bf16* dout;
    CK(cudaMalloc(&dout, q.size() * sizeof(bf16)));
    CK(cudaMemset(dout, 0xff, q.size() * sizeof(bf16)));  // NaN poison
    ra::ExtendParams p{};
    p.q = dq; p.k = dk; p.v = dv; p.out = dout;
    p.qo_indptr = d_qo; p.kv_indptr = d_kv; p.kv_indices = d_idx;
    p.q_stride_t = hq * D; p.q_stride_h = D; p.kv_stride_slot = hkv * D; p.kv_stride_h = D;
    p.batch = batch; p.num_q_heads = hq; p.group = hq / hkv; p.scale_log2 = scale_log2;
    constexpr int smem = ra::extend_smem_bytes<D>();
    CK(cudaFuncSetAttribute(ra::paged_extend_kernel<bf16, D>,
                            cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    dim3 grid((nq + ra::kExtendBlockM - 1) / ra::kExtendBlockM + batch, hq);
    ra::paged_extend_kernel<bf16, D><<<grid, ra::kExtendThreads, smem>>>(p);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<bf16> got(q.size());
    CK(cudaMemcpy(got.data(), dout, got.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    std::vector<double> ref;
    reference(q, k, v, qo_indptr, kv_indptr, idx, hq, hkv, D, scale, ref);
    const double e = rel_err(got, ref);
    std::printf("extend  rel err %.3e %s\n", e, e < 1e-2 ? "ok" : "FAIL");
    fails += !(e < 1e-2);
    CK(cudaFree(dout));
  }

  // ---- decode: the first query of every request, 1 split and 7 splits
  for (int splits : {1, 7}) {
    std::vector<bf16> qd((size_t)batch * hq * D);
    for (int b = 0; b < batch; ++b)
      std::copy_n(q.begin() + (size_t)qo_indptr[b] * hq * D, hq * D, qd.begin() + (size_t)b * hq * D);
    bf16* dqd = upload(qd);
    bf16* dout;
    float *po = nullptr, *pl = nullptr;
    CK(cudaMalloc(&dout, qd.size() * sizeof(bf16)));
    CK(cudaMemset(dout, 0xff, qd.size() * sizeof(bf16)));
    CK(cudaMalloc(&po, (size_t)batch * hq * splits * D * sizeof(float)));
    CK(cudaMalloc(&pl, (size_t)batch * hq * splits * sizeof(float)));
    ra::DecodeParams p{};
    p.q = dqd; p.k = dk; p.v = dv; p.out = dout; p.part_o = po; p.part_lse = pl;
    p.kv_indptr = d_kv; p.kv_indices = d_idx;
    p.q_stride_b = hq * D; p.q_stride_h = D; p.kv_stride_slot = hkv * D; p.kv_stride_h = D;
    p.num_q_heads = hq; p.num_kv_heads = hkv; p.group = hq / hkv; p.num_sub = 1;
    p.num_splits = splits; p.scale_log2 = scale_log2;
    dim3 grid(splits, hkv, batch);
    constexpr int smem = ra::kDecodeSmemBytes;
    if (splits > 1) {
      CK(cudaFuncSetAttribute(ra::paged_decode_kernel<bf16, D, 3, true>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      ra::paged_decode_kernel<bf16, D, 3, true><<<grid, ra::kDecodeThreads, smem>>>(p);
      CK(cudaGetLastError());
      ra::decode_merge_kernel<bf16, D><<<batch * hq, 128>>>(po, pl, dout, splits);
    } else {
      CK(cudaFuncSetAttribute(ra::paged_decode_kernel<bf16, D, 3, false>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      ra::paged_decode_kernel<bf16, D, 3, false><<<grid, ra::kDecodeThreads, smem>>>(p);
    }
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<bf16> got(qd.size());
    CK(cudaMemcpy(got.data(), dout, got.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    std::vector<double> ref;
    reference(qd, k, v, dec_indptr, kv_indptr, idx, hq, hkv, D, scale, ref);
    const double e = rel_err(got, ref);
    std::printf("decode splits=%d rel err %.3e %s\n", splits, e, e < 1e-2 ? "ok" : "FAIL");
    fails += !(e < 1e-2);
    CK(cudaFree(dout)); CK(cudaFree(po)); CK(cudaFree(pl)); CK(cudaFree(dqd));
  }
  std::printf(fails ? "FAILED\n" : "PASSED\n");
  return fails ? 1 : 0;
}
