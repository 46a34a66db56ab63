// Paged decode attention (page size 1), split along the sequence (flash-decoding).
//
// One CTA = (split, kv head [, q-head subgroup], request). It streams the KV rows of its split
// once and applies them to every q head of its GQA group (up to kGroupMax at a time; larger
// groups are cut into subgroups, one CTA each). Layout of the work inside a CTA:
//   kLanes = D / 8 threads hold one KV row (one 16-byte vector each); the CTA's 128 threads
//   are kRows = 128 / kLanes row groups, each walking its own tokens, kUnroll tokens a step.
//   K/V rows go through a thread-private cp.async pipeline of kDecodeStages steps in shared
//   memory (each thread reads back only what it copied, so no barriers), which keeps
//   2 * kUnroll * (kDecodeStages - 1) 16-byte loads per thread in flight; the slot indices of
//   the next step to issue are fetched one step ahead.
// Each row group keeps its own online-softmax state per q head; the row groups are merged
// in shared memory at the end.
// Split plan (decode_active_splits): the grid has num_splits splits per (request, kv head), from
// host-known shapes only, so the launch is graph-safe (under a CUDA graph num_splits comes from
// the capture's upper bound of the lengths). Each request then uses only as many of them as its
// real length and the batch's CTA count call for, computed on the device from kv_indptr by the
// decode and the merge kernel alike. A request with one active split writes its output
// directly; with more, every active split writes a normalised partial output and its
// log2-sum-exp, and decode_merge_kernel combines the active ones. Inactive splits exit.
#pragma once

#include <cstdint>

#include "radixserve/attention_common.cuh"

namespace radixserve {
namespace attn {

struct DecodeParams {
  const void* q;      // [batch, num_q_heads, D], last dim contiguous
  const void* k;      // [num_slots, num_kv_heads, D]
  const void* v;      // [num_slots, num_kv_heads, D]
  void* out;          // [batch, num_q_heads, D] contiguous
  float* part_o;      // [batch, num_q_heads, num_splits, D] (num_splits > 1 only)
  float* part_lse;    // [batch, num_q_heads, num_splits], log2 domain
  const int32_t* kv_indptr;   // [batch + 1]
  const int32_t* kv_indices;  // [nnz]
  int64_t q_stride_b, q_stride_h;      // elements
  int64_t kv_stride_slot, kv_stride_h; // elements
  int num_q_heads, num_kv_heads, group, num_sub, num_splits;
  int num_sms;       // of the device: the split plan's CTA target
  float scale_log2;  // sm_scale * log2(e)
};

constexpr int kDecodeThreads = 128;
constexpr int kDecodeUnroll = 4;   // tokens per row group per step
constexpr int kDecodeStages = 3;   // cp.async pipeline depth (48 KiB: 4 CTAs per SM)
constexpr int kDecodeMinSplitTokens = 64;    // a split is never shorter than this (but the last)
constexpr int kDecodeCtasPerSm = 2;          // splits stop adding CTAs beyond about this many
constexpr int kDecodeMaxSplits = 64;

// Splits of one request of kv_len tokens: enough CTAs for kDecodeCtasPerSm per SM over the whole
// batch (base_ctas = batch * kv heads * q-head subgroups), no split shorter than
// kDecodeMinSplitTokens, at most cap. Measured on the H200 (bench/variants/decode_sweep.cu,
// Llama-3.1-8B heads): a CTA has a fixed cost of a few microseconds (index and q loads, the
// pipeline's ramp, the row-group combine), so past about one wave more splits cost more than the
// parallelism they add, and at batch 1 a 64-token split on ~128 CTAs beats both fewer, longer
// splits and more, shorter ones.
__host__ __device__ __forceinline__ int decode_plan_splits(int64_t base_ctas, int64_t kv_len,
                                                           int num_sms, int cap) {
  const int64_t target = (int64_t)kDecodeCtasPerSm * num_sms;
  int64_t splits = (target + base_ctas - 1) / (base_ctas > 0 ? base_ctas : 1);
  const int64_t by_len = (kv_len + kDecodeMinSplitTokens - 1) / kDecodeMinSplitTokens;
  splits = splits < by_len ? splits : by_len;
  splits = splits < cap ? splits : cap;
  return splits > 1 ? (int)splits : 1;
}

// The active splits of a request on the device: chunk tokens each (the last may be shorter);
// n = ceil(kv_len / chunk) <= p.num_splits. Both kernels derive the same plan from kv_len.
struct SplitPlan {
  int n, chunk;
};
__device__ __forceinline__ SplitPlan decode_active_splits(const DecodeParams& p, int batch,
                                                          int kv_len) {
  const int64_t base = (int64_t)batch * p.num_kv_heads * p.num_sub;
  const int s = decode_plan_splits(base, kv_len, p.num_sms, p.num_splits);
  const int chunk = max((kv_len + s - 1) / s, 1);
  return {kv_len > 0 ? (kv_len + chunk - 1) / chunk : 0, chunk};
}
// dynamic shared memory of paged_decode_kernel: [stages][unroll][k|v][threads] 16-byte vectors
constexpr int kDecodeSmemBytes = kDecodeStages * kDecodeUnroll * 2 * kDecodeThreads * 16;

template <typename T, int D, int kGroupMax, bool kSplit>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode_kernel(const DecodeParams p) {
  constexpr int kLanes = D / 8;
  constexpr int kRows = kDecodeThreads / kLanes;
  constexpr int kUnroll = kDecodeUnroll;
  constexpr int kStages = kDecodeStages;
  constexpr int kStep = kRows * kUnroll;

  // its own name: an extern __shared__ array named like the extend kernel's but with another
  // alignment would change that kernel's dynamic shared-memory base in the same translation unit
  extern __shared__ __align__(16) unsigned char decode_smem[];
  __shared__ float sm_m[kRows][kGroupMax];
  __shared__ float sm_l[kRows][kGroupMax];
  // after the loop the pipeline buffer holds the row groups' accumulators [kRows][kGroupMax][D]
  static_assert(kRows * kGroupMax * D * 4 <= kDecodeSmemBytes, "combine buffer too large");
  auto sm_acc = reinterpret_cast<float (*)[kGroupMax][D]>(decode_smem);

  const int tid = threadIdx.x;
  const int rg = tid / kLanes;
  const int ln = tid % kLanes;
  const int sg = blockIdx.x % p.num_sub;
  const int split = blockIdx.x / p.num_sub;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int qh0 = kvh * p.group + sg * kGroupMax;
  const int gcount = min(kGroupMax, p.group - sg * kGroupMax);

  const int kv_start = p.kv_indptr[b];
  const int kv_len = p.kv_indptr[b + 1] - kv_start;
  // The split plan comes from the real length, on the device (a CUDA graph's grid is fixed at
  // capture, sized for the longest requests): splits past the request's plan exit here, and a
  // request planned as one split writes its output directly, as the unsplit kernel does.
  int lo = 0, hi = kv_len;
  bool partial = false;
  if constexpr (kSplit) {
    const SplitPlan plan = decode_active_splits(p, gridDim.z, kv_len);
    // uniform over the CTA: no barrier is left waiting. An empty request (n = 0) keeps split 0,
    // which writes zeros, as the unsplit kernel does.
    if (split >= max(plan.n, 1)) return;
    lo = split * plan.chunk;
    hi = min(kv_len, lo + plan.chunk);
    partial = plan.n > 1;
  }

  // q of every head of the subgroup, pre-scaled into the log2 domain. Padding heads
  // (g >= gcount) get q = 0 and are computed but never written: the hot loop carries no
  // per-head branches, which would cut it into small blocks the scheduler cannot interleave.
  float qf[kGroupMax][8];
  const T* qb = static_cast<const T*>(p.q) + (int64_t)b * p.q_stride_b + ln * 8;
#pragma unroll
  for (int g = 0; g < kGroupMax; ++g) {
    if (g < gcount) {
      uint4 raw = *reinterpret_cast<const uint4*>(qb + (int64_t)(qh0 + g) * p.q_stride_h);
      vec8_to_float<T>(raw, qf[g]);
#pragma unroll
      for (int i = 0; i < 8; ++i) qf[g][i] *= p.scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) qf[g][i] = 0.f;
    }
  }

  float m[kGroupMax], l[kGroupMax], acc[kGroupMax][8];
#pragma unroll
  for (int g = 0; g < kGroupMax; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
  }

  const int32_t* idx = p.kv_indices + kv_start;
  const int64_t head_off = (int64_t)kvh * p.kv_stride_h + ln * 8;
  const T* kbase = static_cast<const T*>(p.k) + head_off;
  const T* vbase = static_cast<const T*>(p.v) + head_off;

  // Thread-private cp.async pipeline: a thread copies exactly the 16-byte pieces it later reads,
  // so no barrier is needed; kStages - 1 steps (2 * kUnroll loads each) stay in flight.
  uint4* pipe = reinterpret_cast<uint4*>(decode_smem);
  auto pipe_at = [&](int stage, int u, int which) -> uint4* {
    return pipe + ((stage * kUnroll + u) * 2 + which) * kDecodeThreads + tid;
  };
  const int n_it = (hi - lo + kStep - 1) / kStep;
  int slots[kUnroll];
  auto fetch = [&](int it) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = lo + it * kStep + u * kRows + rg;
      slots[u] = t < hi ? __ldg(idx + t) : 0;
    }
  };
  auto issue = [&](int it) {
    if (it < n_it) {
      const int stage = it % kStages;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const bool ok = lo + it * kStep + u * kRows + rg < hi;
        const int64_t off = ok ? (int64_t)slots[u] * p.kv_stride_slot : 0;
        cp_async_16(smem_u32(pipe_at(stage, u, 0)), kbase + off, ok);
        cp_async_16(smem_u32(pipe_at(stage, u, 1)), vbase + off, ok);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    fetch(st);
    issue(st);
  }
  fetch(kStages - 1);

  for (int it = 0; it < n_it; ++it) {
    issue(it + kStages - 1);
    fetch(it + kStages);  // indices of the next issue, in flight while this step computes
    cp_async_wait<kStages - 1>();
    const int t0 = lo + it * kStep;
    const int stage = it % kStages;
    uint4 kr[kUnroll], vr[kUnroll];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      valid[u] = t0 + u * kRows + rg < hi;
      kr[u] = *pipe_at(stage, u, 0);
      vr[u] = *pipe_at(stage, u, 1);
    }

    float s[kUnroll][kGroupMax];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[8];
      vec8_to_float<T>(kr[u], kf);
#pragma unroll
      for (int g = 0; g < kGroupMax; ++g) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) a = fmaf(qf[g][i], kf[i], a);
        s[u][g] = a;
      }
    }
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int g = 0; g < kGroupMax; ++g) {
          s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], off);
        }
      }
    }

    float vf[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) vec8_to_float<T>(vr[u], vf[u]);

#pragma unroll
    for (int g = 0; g < kGroupMax; ++g) {
      {
        float mx = -INFINITY;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) mx = valid[u] ? fmaxf(mx, s[u][g]) : mx;
        const float m_new = fmaxf(m[g], mx);
        // a row group that has seen no token yet keeps m = -inf; use 0 as base so that
        // nothing becomes inf - inf
        const float base = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = fast_exp2(m[g] - base);
        float pu[kUnroll];
        float psum = 0.f;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          pu[u] = valid[u] ? fast_exp2(s[u][g] - base) : 0.f;
          psum += pu[u];
        }
        l[g] = l[g] * alpha + psum;
        m[g] = m_new;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float a = acc[g][i] * alpha;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) a = fmaf(pu[u], vf[u][i], a);
          acc[g][i] = a;
        }
      }
    }
  }

  // ---- merge the row groups of this CTA (the pipeline buffer is reused: drain it first)
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int g = 0; g < kGroupMax; ++g) {
    if (ln == 0) {
      sm_m[rg][g] = m[g];
      sm_l[rg][g] = l[g];
    }
    float4* dst = reinterpret_cast<float4*>(&sm_acc[rg][g][ln * 8]);
    dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
    dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
  }
  __syncthreads();

  for (int e = tid; e < kGroupMax * D; e += kDecodeThreads) {
    const int g = e / D;
    const int d = e % D;
    if (g >= gcount) break;  // g only grows with e
    float M = -INFINITY;
#pragma unroll
    for (int r = 0; r < kRows; ++r) M = fmaxf(M, sm_m[r][g]);
    float den = 0.f, num = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float w = fast_exp2(sm_m[r][g] - M);  // -inf -> 0
        den += w * sm_l[r][g];
        num += w * sm_acc[r][g][d];
      }
    }
    const int qh = qh0 + g;
    const float o = den > 0.f ? num / den : 0.f;
    if (partial) {
      const int64_t row = ((int64_t)b * p.num_q_heads + qh) * p.num_splits + split;
      p.part_o[row * D + d] = o;
      if (d == 0) p.part_lse[row] = den > 0.f ? M + __log2f(den) : -INFINITY;
    } else {
      T* out = static_cast<T*>(p.out);
      out[((int64_t)b * p.num_q_heads + qh) * D + d] = TypeTraits<T>::from_float(o);
    }
  }
}

// Combine the active splits of a request (decode_active_splits; requests with one wrote their
// output already): out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M). The split weights are
// computed once per row, in parallel, then every thread sums its dims over the splits.
// grid: batch * num_q_heads, block: kMergeThreads (>= kDecodeMaxSplits).
constexpr int kMergeThreads = 128;
static_assert(kMergeThreads >= kDecodeMaxSplits, "one thread per split weight");

template <typename T, int D>
__global__ void __launch_bounds__(kMergeThreads) decode_merge_kernel(const DecodeParams p) {
  __shared__ float w[kDecodeMaxSplits];
  __shared__ float red[kMergeThreads / 32];
  const int64_t row = blockIdx.x;  // b * num_q_heads + h
  const int b = (int)(row / p.num_q_heads);
  const int batch = (int)(gridDim.x / p.num_q_heads);
  const int kv_len = p.kv_indptr[b + 1] - p.kv_indptr[b];
  const int n = decode_active_splits(p, batch, kv_len).n;
  if (n <= 1) return;  // block-uniform: written by the decode kernel
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* lse = p.part_lse + row * p.num_splits;
  const float l = tid < n ? lse[tid] : -INFINITY;
  float M = l;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
  if (lane == 0) red[warp] = M;
  __syncthreads();
  M = red[0];
#pragma unroll
  for (int i = 1; i < kMergeThreads / 32; ++i) M = fmaxf(M, red[i]);
  const float wt = (tid < n && l != -INFINITY) ? fast_exp2(l - M) : 0.f;  // M = -inf: all 0
  if (tid < kDecodeMaxSplits) w[tid] = wt;
  float den = wt;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) den += __shfl_xor_sync(0xffffffffu, den, off);
  __syncthreads();  // red[] read above before it is reused
  if (lane == 0) red[warp] = den;
  __syncthreads();
  den = 0.f;
#pragma unroll
  for (int i = 0; i < kMergeThreads / 32; ++i) den += red[i];
  const float inv = den > 0.f ? 1.f / den : 0.f;
  const float* po = p.part_o + row * p.num_splits * D;
  T* out = static_cast<T*>(p.out) + row * D;
  for (int d = tid; d < D; d += kMergeThreads) {
    float num = 0.f;
#pragma unroll 8
    for (int s = 0; s < n; ++s) num = fmaf(w[s], po[(int64_t)s * D + d], num);
    out[d] = TypeTraits<T>::from_float(num * inv);
  }
}

}  // namespace attn
}  // namespace radixserve
