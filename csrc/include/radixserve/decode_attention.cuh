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
// real length and the batch's CTA count call for, computed on the device from kv_indptr by every
// CTA alike. A request with one active split writes its output directly; with more, every active
// split writes a normalised partial output and its log2-sum-exp, and the last of them to finish
// combines them all (below). Inactive splits exit.
// Merge of the splits, in the kernel ("last CTA merges", the CUDA programming guide's
// threadFenceReduction pattern): after writing its partials a CTA fences and bumps an arrival
// counter of its (request, kv head, q-head subgroup) in p.split_counters; the CTA that sees all
// the others arrived reads every active split's partials (L2 loads: they were written during this
// kernel), combines them and writes the output, then resets the counter to zero, so every launch
// (and every CUDA-graph replay) finds the counters zero without a memset. This replaced a second
// kernel (decode_merge_kernel, one CTA per (request, q head)): its launch cost ~2.6-3 us per layer
// at batch 1 on the H200 (2.0 us of kernel time per layer in
// bench/results/decode-profile-h200-bs1.json, plus the launch gap), 32 launches per decode step.
// The combine is the one that kernel did, with the same summation order, so outputs are unchanged.
// No CTA waits for another: a CTA that is not the last exits, so nothing depends on which CTAs
// are resident together.
// FP8 pools (KV = __nv_fp8_e4m3 / __nv_fp8_e5m2): a thread's piece of a row is 8 values = 8 bytes
// (cp.async of 8 bytes into the same 16-byte pipeline slots), converted to fp32 exactly
// (fp8_kv.cuh); k_scale is part of scale_log2 and v_scale multiplies the normalised output.
#pragma once

#include <cstdint>

#include "radixserve/attention_common.cuh"
#include "radixserve/fp8_kv.cuh"
#include "radixserve/pdl.cuh"

namespace radixserve {
namespace attn {

struct DecodeParams {
  const void* q;      // [batch, num_q_heads, D], last dim contiguous
  const void* k;      // [num_slots, num_kv_heads, D]
  const void* v;      // [num_slots, num_kv_heads, D]
  void* out;          // [batch, num_q_heads, D] contiguous
  float* part_o;      // [batch, num_q_heads, num_splits, D] (num_splits > 1 only), 16-byte aligned
  float* part_lse;    // [batch, num_q_heads, num_splits], log2 domain
  // [batch * num_kv_heads * num_sub] (num_splits > 1 only): arrival counters of the last-CTA
  // merge. Zero before the first launch; every launch leaves it zero. Launches sharing it must
  // not run concurrently (one stream, or otherwise ordered).
  int* split_counters;
  const int32_t* kv_indptr;   // [batch + 1]
  const int32_t* kv_indices;  // [nnz]
  int64_t q_stride_b, q_stride_h;      // elements
  int64_t kv_stride_slot, kv_stride_h; // elements
  int num_q_heads, num_kv_heads, group, num_sub, num_splits;
  int num_sms;       // of the device: the split plan's CTA target
  float scale_log2;  // sm_scale * log2(e)
  // a request of at most this many KV tokens is never split (decode_plan_splits); 0: no such rule
  int no_split_tokens;
  // multiplies every normalised output (and split partial): an FP8 pool's v_scale, else 1 (the
  // FP8 pool's k_scale is folded into scale_log2 by the host)
  float v_scale = 1.f;
  // a sliding window: > 0 attends only each request's last `window` KV tokens (the query's own
  // and the window - 1 before it); 0 the whole KV (decode_kv_range)
  int window = 0;
};

// The KV tokens request b attends: kv_indices[start, start + len). With a window, the last
// `window` of its kv_indptr range (the slots before it are never read); every kernel and the
// split plan work on this range alone, so a windowed request is planned, split and merged as
// a request of len tokens.
struct KvRange {
  int start, len;
};
__device__ __forceinline__ KvRange decode_kv_range(const DecodeParams& p, int b) {
  const int start = p.kv_indptr[b], len = p.kv_indptr[b + 1] - start;
  const int skip = p.window > 0 && len > p.window ? len - p.window : 0;
  return {start + skip, len - skip};
}

constexpr int kDecodeThreads = 128;
constexpr int kDecodeUnroll = 4;   // tokens per row group per step
constexpr int kDecodeStages = 3;   // cp.async pipeline depth (48 KiB: 4 CTAs per SM)
constexpr int kDecodeMinSplitTokens = 64;    // a split is never shorter than this (but the last)
constexpr int kDecodeCtasPerSm = 2;          // splits stop adding CTAs beyond about this many
constexpr int kDecodeMaxSplits = 64;
// Requests this short are not split at all (the op's default for DecodeParams::no_split_tokens).
// The split-plan sweep (bench/results/logs/decode-sweep-h200.txt) at 128 tokens: batch 1 took
// 188.4 us per 32 layers in one split against 239.1 in two, batch 8 215.2 against 285.0; the
// last-CTA merge costs more than the parallelism gains there. At 512 tokens splits still win
// (8 splits 261.6 against 4 splits 317.8).
constexpr int kDecodeNoSplitTokens = 256;

// Splits of one request of kv_len tokens: enough CTAs for kDecodeCtasPerSm per SM over the whole
// batch (base_ctas = batch * kv heads * q-head subgroups), no split shorter than
// kDecodeMinSplitTokens, at most cap. Measured on the H200 (bench/variants/decode_sweep.cu,
// Llama-3.1-8B heads): a CTA has a fixed cost of a few microseconds (index and q loads, the
// pipeline's ramp, the row-group combine), so past about one wave more splits cost more than the
// parallelism they add, and at batch 1 a 64-token split on ~128 CTAs beats both fewer, longer
// splits and more, shorter ones.
__host__ __device__ __forceinline__ int decode_plan_splits(int64_t base_ctas, int64_t kv_len,
                                                           int num_sms, int cap,
                                                           int no_split_tokens = 0) {
  if (kv_len <= no_split_tokens) return 1;
  const int64_t target = (int64_t)kDecodeCtasPerSm * num_sms;
  int64_t splits = (target + base_ctas - 1) / (base_ctas > 0 ? base_ctas : 1);
  const int64_t by_len = (kv_len + kDecodeMinSplitTokens - 1) / kDecodeMinSplitTokens;
  splits = splits < by_len ? splits : by_len;
  splits = splits < cap ? splits : cap;
  return splits > 1 ? (int)splits : 1;
}

// The active splits of a request on the device: chunk tokens each (the last may be shorter);
// n = ceil(kv_len / chunk) <= p.num_splits. Every CTA of a request derives the same plan from
// kv_len: the last-CTA merge counts arrivals up to n.
struct SplitPlan {
  int n, chunk;
};
__device__ __forceinline__ SplitPlan decode_active_splits(const DecodeParams& p, int batch,
                                                          int kv_len) {
  const int64_t base = (int64_t)batch * p.num_kv_heads * p.num_sub;
  const int s = decode_plan_splits(base, kv_len, p.num_sms, p.num_splits, p.no_split_tokens);
  const int chunk = max((kv_len + s - 1) / s, 1);
  return {kv_len > 0 ? (kv_len + chunk - 1) / chunk : 0, chunk};
}
// dynamic shared memory of paged_decode_kernel: [stages][unroll][k|v][threads] 16-byte vectors
constexpr int kDecodeSmemBytes = kDecodeStages * kDecodeUnroll * 2 * kDecodeThreads * 16;

// Combine the n > 1 active splits (decode_active_splits) of q heads qh0 .. qh0 + gcount - 1 of
// request b, run by the last CTA to arrive (paged_decode_kernel): out = sum_s 2^(lse_s - M) o_s /
// sum_s 2^(lse_s - M), M = max_s lse_s. A warp per q head computes the split weights, lane l
// taking splits l, l + 32, ...: each group of 32 is summed by a butterfly and the groups in order,
// then every thread sums 4 dims over the splits in split order (one fma chain per dim). This is
// the order of the former decode_merge_kernel (a CTA per row, thread s holding split s's weight,
// warp butterflies summed in warp order), so the outputs are bit for bit what it wrote.
// The partials were written by other CTAs during this launch: they are read through L2 (__ldcg),
// never the non-coherent path. smem: >= kGroupMax * (kDecodeMaxSplits + 1) floats, free to use
// (a barrier separates the caller's last use of it from this).
template <typename T, int D, int kGroupMax>
__device__ __forceinline__ void decode_merge_splits(const DecodeParams& p, int b, int qh0,
                                                    int gcount, int n, unsigned char* smem) {
  constexpr int kWarps = kDecodeThreads / 32;
  constexpr int kPerLane = kDecodeMaxSplits / 32;        // splits per lane
  constexpr int kHeadsPerWarp = (kGroupMax + kWarps - 1) / kWarps;
  constexpr int kVecs = D / 4;                            // float4 per row
  constexpr int kBatch = 16;                              // part_o loads in flight per thread
  static_assert(kDecodeMaxSplits % 32 == 0, "whole warps of split weights");
  static_assert(kGroupMax * (kDecodeMaxSplits + 1) * 4 <= kDecodeSmemBytes, "merge smem");
  auto w = reinterpret_cast<float (*)[kDecodeMaxSplits]>(smem);  // [kGroupMax][kDecodeMaxSplits]
  float* inv = reinterpret_cast<float*>(smem) + kGroupMax * kDecodeMaxSplits;  // [kGroupMax]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row0 = (int64_t)b * p.num_q_heads + qh0;  // row of head g: row0 + g

  // split weights w[g][s] = 2^(lse_s - M) (0 past n and for lse_s = -inf), inv[g] = 1 / their sum
  float l[kHeadsPerWarp][kPerLane];
#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; ++i) {
    const int g = warp + i * kWarps;
    const float* lse = p.part_lse + (row0 + g) * p.num_splits;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int s = j * 32 + lane;
      l[i][j] = g < gcount && s < n ? __ldcg(lse + s) : -INFINITY;
    }
  }
#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; ++i) {
    const int g = warp + i * kWarps;
    if (g >= gcount) break;  // warp-uniform; g only grows with i
    float M = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) M = fmaxf(M, l[i][j]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float den = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int s = j * 32 + lane;
      // M = -inf: all 0
      const float wt = (s < n && l[i][j] != -INFINITY) ? fast_exp2(l[i][j] - M) : 0.f;
      w[g][s] = wt;
      float r = wt;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) r += __shfl_xor_sync(0xffffffffu, r, off);
      den += r;
    }
    if (lane == 0) inv[g] = den > 0.f ? 1.f / den : 0.f;
  }
  __syncthreads();

  T* out = static_cast<T*>(p.out);
  for (int e = tid; e < gcount * kVecs; e += kDecodeThreads) {
    const int g = e / kVecs;
    const int d = (e % kVecs) * 4;
    const float4* po =
        reinterpret_cast<const float4*>(p.part_o + (row0 + g) * p.num_splits * D + d);
    float num[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s0 = 0; s0 < n; s0 += kBatch) {
      float4 o[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i)
        o[i] = s0 + i < n ? __ldcg(po + (int64_t)(s0 + i) * kVecs)
                          : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (s0 + i < n) {
          const float ws = w[g][s0 + i];
          num[0] = fmaf(ws, o[i].x, num[0]);
          num[1] = fmaf(ws, o[i].y, num[1]);
          num[2] = fmaf(ws, o[i].z, num[2]);
          num[3] = fmaf(ws, o[i].w, num[3]);
        }
      }
    }
    T* dst = out + (row0 + g) * D + d;
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = TypeTraits<T>::from_float(num[i] * inv[g]);
  }
}

// Combine a CTA's kParts partial softmax states of q heads qh0 .. qh0 + gcount - 1 of request
// b (part r: running max sm_m[r][g] in the log2 domain, sum sm_l[r][g], unnormalised output
// sm_acc[r][g][:]; a part that saw no token has max -inf) and store the result: the output row
// (bf16/fp16), or with partial set the split's normalised partial output and log2-sum-exp in
// p.part_o / p.part_lse. Every thread of a CTA of kDecodeThreads calls it after a barrier that
// makes the parts visible. kAccRow: the length of an sm_acc row, D, or D + D / 8 for rows with
// 4 floats of padding after every 32 (decode_acc_index), which a kernel that writes its
// accumulators 16 bytes a lane at lane strides of 32 floats uses to spread them over the banks.
template <int D, int kAccRow>
__device__ __forceinline__ int decode_acc_index(int d) {
  static_assert(kAccRow == D || (kAccRow == D + D / 8 && D % 32 == 0), "plain or padded rows");
  return kAccRow == D ? d : d + (d / 32) * 4;
}

template <typename T, int D, int kGroupMax, int kParts, int kAccRow = D>
__device__ __forceinline__ void decode_combine_parts(const DecodeParams& p, int b, int qh0,
                                                     int gcount, int split, bool partial,
                                                     const float (*sm_m)[kGroupMax],
                                                     const float (*sm_l)[kGroupMax],
                                                     const float (*sm_acc)[kGroupMax][kAccRow]) {
  for (int e = threadIdx.x; e < kGroupMax * D; e += kDecodeThreads) {
    const int g = e / D;
    const int d = e % D;
    if (g >= gcount) break;  // g only grows with e
    float M = -INFINITY;
#pragma unroll
    for (int r = 0; r < kParts; ++r) M = fmaxf(M, sm_m[r][g]);
    float den = 0.f, num = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int r = 0; r < kParts; ++r) {
        const float w = fast_exp2(sm_m[r][g] - M);  // -inf -> 0
        den += w * sm_l[r][g];
        num += w * sm_acc[r][g][decode_acc_index<D, kAccRow>(d)];
      }
    }
    const int qh = qh0 + g;
    const float o = den > 0.f ? num / den * p.v_scale : 0.f;
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

// KV: the pools' element type, T or an FP8 type (8-byte pieces, see the header comment)
template <typename T, int D, int kGroupMax, bool kSplit, typename KV = T>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode_kernel(const DecodeParams p) {
  constexpr bool kFp8 = fp8::is_fp8<KV>();
  using KvElem = typename std::conditional<kFp8, uint8_t, T>::type;
  pdl_launch_dependents();  // the o projection after attention may start streaming its weights
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

  const KvRange range = decode_kv_range(p, b);  // the whole KV, or its window
  const int kv_start = range.start;
  const int kv_len = range.len;
  // The split plan comes from the real length, on the device (a CUDA graph's grid is fixed at
  // capture, sized for the longest requests): splits past the request's plan exit here, and a
  // request planned as one split writes its output directly, as the unsplit kernel does.
  int lo = 0, hi = kv_len;
  int n_active = 1;  // active splits of the request
  bool partial = false;
  if constexpr (kSplit) {
    const SplitPlan plan = decode_active_splits(p, gridDim.z, kv_len);
    // uniform over the CTA: no barrier is left waiting. An empty request (n = 0) keeps split 0,
    // which writes zeros, as the unsplit kernel does.
    if (split >= max(plan.n, 1)) return;
    lo = split * plan.chunk;
    hi = min(kv_len, lo + plan.chunk);
    n_active = plan.n;
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
  const KvElem* kbase = static_cast<const KvElem*>(p.k) + head_off;
  const KvElem* vbase = static_cast<const KvElem*>(p.v) + head_off;

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
        if constexpr (kFp8) {
          cp_async_8(smem_u32(pipe_at(stage, u, 0)), kbase + off, ok);
          cp_async_8(smem_u32(pipe_at(stage, u, 1)), vbase + off, ok);
        } else {
          cp_async_16(smem_u32(pipe_at(stage, u, 0)), kbase + off, ok);
          cp_async_16(smem_u32(pipe_at(stage, u, 1)), vbase + off, ok);
        }
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
      if constexpr (kFp8) fp8::to_float8<KV>(make_uint2(kr[u].x, kr[u].y), kf);
      else vec8_to_float<T>(kr[u], kf);
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
    for (int u = 0; u < kUnroll; ++u) {
      if constexpr (kFp8) fp8::to_float8<KV>(make_uint2(vr[u].x, vr[u].y), vf[u]);
      else vec8_to_float<T>(vr[u], vf[u]);
    }

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

  decode_combine_parts<T, D, kGroupMax, kRows>(p, b, qh0, gcount, split, partial, sm_m, sm_l,
                                               sm_acc);

  // ---- arrival: the last of the active splits of (b, kvh, sg) to get here merges them all
  if constexpr (kSplit) {
    if (!partial) return;  // uniform over the CTA
    // every thread's partial writes (and sm_acc reads) before thread 0's release fence and the
    // arrival; then thread 0's acquire fence and the barrier order the last CTA's reads of the
    // other splits' partials after their writes (as in the threadFenceReduction sample)
    __syncthreads();
    bool last = false;
    if (tid == 0) {
      int* counter = p.split_counters + ((int64_t)b * p.num_kv_heads + kvh) * p.num_sub + sg;
      __threadfence();
      last = atomicAdd(counter, 1) == n_active - 1;
      if (last) {
        *counter = 0;  // all n_active arrived: no CTA of this launch touches it again
        __threadfence();
      }
    }
    if (!__syncthreads_or(last)) return;  // uniform: broadcasts thread 0's answer
    decode_merge_splits<T, D, kGroupMax>(p, b, qh0, gcount, n_active, decode_smem);
  }
}

}  // namespace attn
}  // namespace radixserve
