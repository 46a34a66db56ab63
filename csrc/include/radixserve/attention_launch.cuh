// Host-side launchers of the attention kernels, torch-free: the split heuristic and grids of
// decode, the choice between the wgmma (sm_90a) and mma.sync extend kernels, and the launches.
// csrc/ops/attention.cu (the torch op) and csrc/harness/test_attention.cu (the ctest harness)
// both launch through these, so the harness runs exactly what the extension runs.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "radixserve/decode_attention.cuh"
#include "radixserve/decode_attention_mma.cuh"
#include "radixserve/decode_attention_mma_fp8.cuh"
#include "radixserve/extend_attention.cuh"
#include "radixserve/extend_attention_sm90.cuh"
#include "radixserve/launch_utils.cuh"

namespace radixserve {
namespace attn {

// q heads per decode CTA: exact for groups 1-4 (3 is the default model's), padded up to 8 above
inline int decode_group_max(int group) { return group <= 4 ? group : 8; }

// The grid's splits per (request, kv head): decode_plan_splits at the batch's average length
// (nnz = kv_indices.numel(); an upper bound under CUDA graphs, so a captured graph replays
// with the same grid). Each request's own plan, at its real length, is made on the device and
// never uses more splits than this.
inline int decode_num_splits(int64_t batch, int hkv, int num_sub, int64_t nnz, int sms,
                             int no_split_tokens = 0) {
  const int64_t avg_len = std::max<int64_t>(1, nnz / std::max<int64_t>(1, batch));
  return decode_plan_splits(batch * hkv * num_sub, avg_len, sms, kDecodeMaxSplits,
                            no_split_tokens);
}

// Decode runs on tensor cores (decode_attention_mma.cuh) where the batch fills the device
// without splitting requests (num_splits == 1), the GQA subgroups have 4 or 8 q heads and D is a
// multiple of 64; elsewhere, and always when tensor_cores is false, the CUDA-core kernel. A
// shape property only (no device read): a captured graph replays the kernel it captured.
inline bool decode_uses_tensor_cores(int group, int num_splits, int d, bool tensor_cores) {
  return tensor_cores && num_splits == 1 && decode_group_max(group) >= 4 && d % 64 == 0;
}

// Launches decode: one kernel, which also merges the splits when p.num_splits > 1 (the last CTA
// of each (request, kv head, q-head subgroup) to finish; decode_attention.cuh). Then p.part_o
// [batch, num_q_heads, num_splits, D] and p.part_lse [batch, num_q_heads, num_splits] (float)
// and p.split_counters [batch * num_kv_heads * num_sub] (int32, zero; left zero) must be set.
// Grid: (num_splits * num_sub, num_kv_heads, batch). tensor_cores: allow the tensor-core kernel
// where decode_uses_tensor_cores says it serves (false: the CUDA-core kernel, for comparisons).
// KV: the pools' element type, T or __nv_fp8_e4m3 / __nv_fp8_e5m2 (then the tensor-core kernel
// is paged_decode_mma_fp8_kernel, the CUDA-core one reads 8-byte pieces; p.scale_log2 carries
// k_scale and p.v_scale the v_scale).
template <typename T, int D, typename KV = T>
cudaError_t launch_paged_decode(const DecodeParams& p, int batch, cudaStream_t stream,
                                bool tensor_cores = true) {
  if (p.num_splits > 1 &&
      (p.part_o == nullptr || p.part_lse == nullptr || p.split_counters == nullptr))
    return cudaErrorInvalidValue;
  const dim3 grid((unsigned)(p.num_splits * p.num_sub), (unsigned)p.num_kv_heads, (unsigned)batch);
  const bool mma = decode_uses_tensor_cores(p.group, p.num_splits, D, tensor_cores);
  auto launch = [&](auto gm) -> cudaError_t {
    constexpr int G = decltype(gm)::value;
    constexpr int smem = kDecodeSmemBytes;
    cudaError_t err;
    if constexpr ((G == 4 || G == 8) && D % 64 == 0) {
      if (mma) {
        if constexpr (fp8::is_fp8<KV>()) {
          constexpr int mma_smem = decode_mma_fp8_smem_bytes<D>();
          if (decode_mma_fp8_heads(p.num_kv_heads, batch, p.num_sub, p.num_sms) == 2) {
            constexpr auto kernel = paged_decode_mma_fp8_kernel<T, KV, D, G, 2>;
            err = set_max_dynamic_smem<kernel>(mma_smem);
            if (err != cudaSuccess) return err;
            const dim3 pairs(grid.x, grid.y / 2, grid.z);
            kernel<<<pairs, kDecodeMmaThreads, mma_smem, stream>>>(p);
          } else {
            constexpr auto kernel = paged_decode_mma_fp8_kernel<T, KV, D, G, 1>;
            err = set_max_dynamic_smem<kernel>(mma_smem);
            if (err != cudaSuccess) return err;
            kernel<<<grid, kDecodeMmaThreads, mma_smem, stream>>>(p);
          }
        } else {
          constexpr auto kernel = paged_decode_mma_kernel<T, D, G>;
          constexpr int mma_smem = decode_mma_smem_bytes<D>();
          err = set_max_dynamic_smem<kernel>(mma_smem);
          if (err != cudaSuccess) return err;
          kernel<<<grid, kDecodeMmaThreads, mma_smem, stream>>>(p);
        }
        return cudaGetLastError();
      }
    }
    if (p.num_splits > 1) {
      constexpr auto kernel = paged_decode_kernel<T, D, G, true, KV>;
      err = set_max_dynamic_smem<kernel>(smem);
      if (err != cudaSuccess) return err;
      kernel<<<grid, kDecodeThreads, smem, stream>>>(p);
    } else {
      constexpr auto kernel = paged_decode_kernel<T, D, G, false, KV>;
      err = set_max_dynamic_smem<kernel>(smem);
      if (err != cudaSuccess) return err;
      kernel<<<grid, kDecodeThreads, smem, stream>>>(p);
    }
    return cudaGetLastError();
  };
  switch (decode_group_max(p.group)) {
    case 1: return launch(std::integral_constant<int, 1>{});
    case 2: return launch(std::integral_constant<int, 2>{});
    case 3: return launch(std::integral_constant<int, 3>{});
    case 4: return launch(std::integral_constant<int, 4>{});
    default: return launch(std::integral_constant<int, 8>{});
  }
}

// The wgmma extend kernel can run: the current device is a Hopper (9.0) and this binary carries
// an sm_90a image of it (an sm_80-only build or another GPU gets the mma.sync kernel). Asked
// once per kernel and device: the answer sits on every extend launch's host path.
template <typename T, int D>
bool extend_wgmma_available() {
  static std::atomic<uint64_t> known{0}, yes{0};  // bit d: device d asked / answered yes
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (bit && (known.load(std::memory_order_acquire) & bit))
    return (yes.load(std::memory_order_relaxed) & bit) != 0;
  int major = 0, minor = 0;
  bool ok = false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
      major == 9 && minor == 0) {
    cudaFuncAttributes attr;
    ok = cudaFuncGetAttributes(&attr, sm90::paged_extend_kernel<T, D>) == cudaSuccess &&
         attr.binaryVersion == 90;
  }
  (void)cudaGetLastError();  // a device without an image for the kernel: clear, fall back
  if (bit) {
    if (ok) yes.fetch_or(bit, std::memory_order_relaxed);
    known.fetch_or(bit, std::memory_order_release);   // after yes: readers see both
  }
  return ok;
}

// cuTensorMapEncodeTiled, reached through the runtime's driver entry point (no link against
// libcuda); null where the driver has none.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiledFn encode_tiled_fn() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// The TMA map of one K or V pool ([num_slots, num_kv_heads, d], 2-byte elements, strides in
// elements) that sm90::KvMaps describes; false where it cannot be made (no driver entry point,
// strides the TMA cannot take).
inline bool encode_kv_map(CUtensorMap* map, const void* base, int64_t num_slots, int hkv, int d,
                          int64_t stride_slot, int64_t stride_h) {
  const EncodeTiledFn fn = encode_tiled_fn();
  if (fn == nullptr || num_slots <= 0 || (reinterpret_cast<uintptr_t>(base) & 15) ||
      (stride_slot * 2) % 16 || (stride_h * 2) % 16)
    return false;
  const cuuint64_t dims[3] = {(cuuint64_t)d, (cuuint64_t)hkv, (cuuint64_t)num_slots};
  const cuuint64_t strides[2] = {(cuuint64_t)stride_h * 2, (cuuint64_t)stride_slot * 2};
  const cuuint32_t box[3] = {64, 1, (cuuint32_t)sm90::kBN};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(base), dims, strides, box,
            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Launches extend with the wgmma kernel (wgmma = true; only where extend_wgmma_available) or the
// mma.sync kernel. Both take tiles = an upper bound of sum_b ceil(qo_len_b / tile tokens) from
// host-known shapes (ceil(num_q_tokens / tile tokens) + batch); spare tiles are skipped.
// mma.sync: tiles of 128 tokens of one q head, grid (tiles, num_q_heads). wgmma: tiles of
// 128 / pack tokens of pack q heads (sm90::extend_pack_log2), items = tiles x num_q_heads / pack;
// persistent, one CTA per multiprocessor (p.num_sms; at most one per item), which needs
// p.work_counters (2 int32, zero; left zero); its whole, consecutive-slot K/V tiles load by TMA
// when p.num_slots is set and the pools' strides allow (sm90::KvMaps), the rest by cp.async.
// KV: the pools' element type, T or an FP8 type; FP8 pools run the mma.sync kernel only (wgmma
// must be false: its tiles are 16-bit, loaded by TMA), and so does a sliding window (p.window).
template <typename T, int D, typename KV = T>
cudaError_t launch_paged_extend(const ExtendParams& p, int64_t num_q_tokens, bool wgmma,
                                cudaStream_t stream) {
  if (p.num_q_heads > 65535) return cudaErrorInvalidValue;
  if (fp8::is_fp8<KV>() && wgmma) return cudaErrorInvalidValue;
  if (p.window > 0 && wgmma) return cudaErrorInvalidValue;   // the wgmma kernel takes no window
  cudaError_t err;
  if constexpr (!fp8::is_fp8<KV>()) {  // no wgmma instantiation for FP8 pools
    if (wgmma) {
      if (p.work_counters == nullptr || p.num_sms < 1) return cudaErrorInvalidValue;
      const int pack_log2 = sm90::extend_pack_log2(p.group);
      const int tile_tokens = sm90::kBM >> pack_log2;
      const int64_t tiles = (num_q_tokens + tile_tokens - 1) / tile_tokens + p.batch;
      const int64_t items = tiles * (p.num_q_heads >> pack_log2);
      if (items >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
      constexpr int smem = sm90::extend_smem_bytes<D>();
      constexpr auto kernel = sm90::paged_extend_kernel<T, D>;
      err = set_max_dynamic_smem<kernel>(smem);
      if (err != cudaSuccess) return err;
      const int64_t ctas = sm90::kPersistent ? std::min<int64_t>(items, p.num_sms) : items;
      sm90::KvMaps maps{};
      const int hkv = p.num_q_heads / p.group;
      maps.use =
          encode_kv_map(&maps.k, p.k, p.num_slots, hkv, D, p.kv_stride_slot, p.kv_stride_h) &&
          encode_kv_map(&maps.v, p.v, p.num_slots, hkv, D, p.kv_stride_slot, p.kv_stride_h);
      kernel<<<(unsigned)ctas, sm90::kThreads, smem, stream>>>(p, (int)tiles, maps);
      return cudaGetLastError();
    }
  }
  const int64_t tiles = (num_q_tokens + kExtendBlockM - 1) / kExtendBlockM + p.batch;
  if (tiles * p.num_q_heads >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
  const dim3 grid((unsigned)tiles, (unsigned)p.num_q_heads);
  constexpr int smem = extend_smem_bytes<D>();
  constexpr auto kernel = paged_extend_kernel<T, D, KV>;
  err = set_max_dynamic_smem<kernel>(smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, kExtendThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attn
}  // namespace radixserve
