"""Attention kernel benchmarks, each as a ratio to a limit or a peer measured in the same run.

  decode: batch 32 x 4096 tokens, 32 q heads / 8 kv heads, head_dim 128, bf16. Bytes = K + V
          read once + q + out; achieved bytes/s over a device-to-device copy (bytes read +
          written, 2 GiB buffer). Device time per call from 20 calls replayed in one CUDA graph
          (how the decode step runs when served under graphs); the eager time (Python launching
          call after call) is reported too. Peer: torch "gather K/V by slot, then SDPA" on the
          same bytes, also under a graph.
  decode, batch 256: 1,152 tokens each (the offline run's decode phase), the tensor-core kernel
          and the CUDA-core one (the op's kernel="simt"), slots in order and shuffled.
  decode, batch 1: 32 calls (a Llama-3.1-8B step's layers) at 1,024 tokens, each layer its own
          K/V, in one CUDA graph: microseconds per step.
  extend: one request of 4096 tokens (and 1k, 2k, 8k; and 1k new after a 3k cached prefix), 32
          heads, head_dim 128, bf16, causal. TFLOP/s (4 * S * S * D * H / 2) against torch SDPA
          with the flash and cuDNN backends on contiguous [1, H, S, D].

  FP8 KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2, run_fp8): decode at batch 256 x 1,024
          tokens (issue 35's acceptance shape; Llama-3.1-8B heads, bf16 q) over FP8 pages, the
          tensor-core kernel and the CUDA-core one, slots in order and shuffled, bytes counted in
          FP8 (K + V one byte a value, + q + out) over the same copy bandwidth; the bf16 pool at
          the same shape beside it; batch 32 x 4,096 over FP8 pages; extend of 4,096 tokens over
          FP8 pages (the mma.sync kernel: FP8 pools never take the wgmma one).

`run(results)` adds keys to results (bench/kernels.py calls it); `python bench/attention_bench.py
[--json PATH] [--kv-cache-dtype fp8_e4m3]` prints the table (with an FP8 dtype: only the FP8
benchmarks and their bf16 baselines).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc"))

from radixserve import knobs, ops  # noqa: E402
from radixserve.ops._ext import kernels_available  # noqa: E402


def _time_ms(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median of per-call CUDA-event times, in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _graph_time_ms(fn, calls: int = 20, reps: int = 10) -> float:
    """Device time of one fn() with no host work in between: `calls` back-to-back calls captured
    in one CUDA graph (as the decode step runs when served under graphs), median replay / calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = _time_ms(graph.replay, reps=reps, warmup=2) / calls
    del graph
    return ms


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 2 << 30  # 2 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), reps=30)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


def bench_decode(results: dict, copy_bw: float) -> None:
    batch, kv_len, hq, hkv, d, dtype = 32, 4096, 32, 8, 128, torch.bfloat16
    nnz = batch * kv_len
    num_slots = nnz + 1  # slot 0 is the padding slot
    k_cache = torch.randn(num_slots, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn(num_slots, hkv, d, device="cuda", dtype=dtype)
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
    kv_indptr = torch.arange(0, nnz + 1, kv_len, dtype=torch.int32, device="cuda")
    kv_seq = torch.arange(1, nnz + 1, dtype=torch.int32, device="cuda")
    kv_shuf = (torch.randperm(nnz, device="cuda") + 1).to(torch.int32)
    scale = 1.0 / math.sqrt(d)
    nbytes = 2 * nnz * hkv * d * 2 + 2 * q.numel() * 2  # K + V + q + out

    def ours(idx):
        return lambda: ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, idx, scale)

    def torch_peer():
        k = k_cache[kv_seq.long()].view(batch, kv_len, hkv, d).transpose(1, 2)
        v = v_cache[kv_seq.long()].view(batch, kv_len, hkv, d).transpose(1, 2)
        return F.scaled_dot_product_attention(q.view(batch, hq, 1, d), k, v, scale=scale,
                                              enable_gqa=True)

    # device time under a CUDA graph (the decode step's serving mode): no host dispatch inside
    t_seq = _graph_time_ms(ours(kv_seq))
    t_shuf = _graph_time_ms(ours(kv_shuf))
    t_peer = _graph_time_ms(torch_peer, calls=5)
    # eager: one call after another from Python, host dispatch of each call included where the
    # queue runs dry
    t_eager = _time_ms(ours(kv_seq))
    results["decode_attention_us"] = t_seq * 1e3
    results["decode_attention_bytes_per_s"] = nbytes / (t_seq * 1e-3)
    results["decode_attention_bw_fraction"] = nbytes / (t_seq * 1e-3) / copy_bw
    results["decode_attention_shuffled_slots_bw_fraction"] = nbytes / (t_shuf * 1e-3) / copy_bw
    results["decode_attention_eager_us"] = t_eager * 1e3
    results["decode_attention_eager_bw_fraction"] = nbytes / (t_eager * 1e-3) / copy_bw
    results["decode_attention_torch_gather_sdpa_us"] = t_peer * 1e3
    results["decode_attention_torch_gather_sdpa_bw_fraction"] = nbytes / (t_peer * 1e-3) / copy_bw
    del k_cache, v_cache
    torch.cuda.empty_cache()


def bench_decode_large_batch(results: dict, copy_bw: float, batch: int = 256,
                             kv_len: int = 1152) -> None:
    """The offline run's decode attention: batch 256 x 1,152 tokens (its decode phase's mean
    length), Llama-3.1-8B heads, the tensor-core kernel beside the CUDA-core one
    (kernel="simt"), each under a CUDA graph, over slots in order and shuffled."""
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    nnz = batch * kv_len
    k_cache = torch.randn(nnz + 1, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn(nnz + 1, hkv, d, device="cuda", dtype=dtype)
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
    kv_indptr = torch.arange(0, nnz + 1, kv_len, dtype=torch.int32, device="cuda")
    orders = {"": torch.arange(1, nnz + 1, dtype=torch.int32, device="cuda"),
              "_shuffled": (torch.randperm(nnz, device="cuda") + 1).to(torch.int32)}
    nbytes = 2 * nnz * hkv * d * 2 + 2 * q.numel() * 2
    scale = 1.0 / math.sqrt(d)
    for kernel in ("tc", "simt"):
        choice = "simt" if kernel == "simt" else "auto"     # the op's kernel argument
        for suffix, idx in orders.items():
            ms = _graph_time_ms(lambda: ops.paged_decode_attention(
                q, k_cache, v_cache, kv_indptr, idx, scale, kernel=choice), calls=10)
            key = f"decode_attention_bs{batch}_{kernel}{suffix}"
            results[key + "_us"] = ms * 1e3
            results[key + "_bw_fraction"] = nbytes / (ms * 1e-3) / copy_bw
    results[f"decode_attention_bs{batch}_tc_over_simt_speedup"] = (
        results[f"decode_attention_bs{batch}_simt_us"] / results[f"decode_attention_bs{batch}_tc_us"])
    del k_cache, v_cache
    torch.cuda.empty_cache()


def bench_decode_bs1_layers(results: dict, layers: int = 32, kv_len: int = 1024) -> None:
    """Batch 1 decode attention of a 32-layer step at 1k context (Llama-3.1-8B heads): one CUDA
    graph of `layers` calls, each over its own layer's K/V (4 MiB per layer, 128 MiB in all, so
    the replay streams from HBM as a real step does, not from L2). Microseconds per step."""
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    caches = [(torch.randn(kv_len + 1, hkv, d, device="cuda", dtype=dtype),
               torch.randn(kv_len + 1, hkv, d, device="cuda", dtype=dtype)) for _ in range(layers)]
    q = torch.randn(1, hq, d, device="cuda", dtype=dtype)
    kv_indptr = torch.tensor([0, kv_len], dtype=torch.int32, device="cuda")
    kv_indices = torch.arange(1, kv_len + 1, dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(d)

    def step():
        for k_cache, v_cache in caches:
            ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, scale)

    results["decode_attention_bs1_1k_32layers_us"] = _graph_time_ms(step, calls=1, reps=20) * 1e3
    del caches
    torch.cuda.empty_cache()


def _causal_flops(new: int, prefix: int = 0, heads: int = 32, d: int = 128) -> float:
    """QK^T and PV of `new` causal queries after `prefix` cached tokens: 4 * d * heads * (the
    (query, key) pairs: prefix * new + new * (new + 1) / 2, taken as new^2 / 2 for prefix 0)."""
    pairs = prefix * new + (new * new / 2 if prefix == 0 else new * (new + 1) / 2)
    return 4 * d * heads * pairs


def _ours_extend(new: int, prefix: int, heads: int, d: int, dtype):
    """radixserve's paged extend on one request: `new` queries after `prefix` cached tokens, K/V
    in a page-size-1 cache (slots 1..prefix+new; slot 0 unused), causal over the new chunk."""
    kv = prefix + new
    q = torch.randn(new, heads, d, device="cuda", dtype=dtype)
    k_cache = torch.randn(kv + 1, heads, d, device="cuda", dtype=dtype)
    v_cache = torch.randn(kv + 1, heads, d, device="cuda", dtype=dtype)
    qo_indptr = torch.tensor([0, new], dtype=torch.int32, device="cuda")
    kv_indptr = torch.tensor([0, kv], dtype=torch.int32, device="cuda")
    kv_indices = torch.arange(1, kv + 1, dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(d)
    fn = lambda: ops.paged_extend_attention(q, k_cache, v_cache, qo_indptr, kv_indptr,  # noqa: E731
                                            kv_indices, scale)
    fn.q = q
    return fn


def bench_extend(results: dict) -> None:
    """Causal extend at 1k, 2k, 4k (the headline keys: extend_attention_tflops and its SDPA
    ratios), 8k tokens, and 1,024 new tokens over a 3,072-token cached prefix; SDPA (flash,
    cuDNN) on contiguous [1, H, S, D] for the square shapes."""
    heads, d, dtype = 32, 128, torch.bfloat16
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for seq in (1024, 2048, 4096, 8192):
        flops = _causal_flops(seq)
        ours = _ours_extend(seq, 0, heads, d, dtype)
        tag = "extend_attention" if seq == 4096 else f"extend_attention_{seq}"
        if seq == 4096:
            results["extend_attention_kernel"] = ops.extend_attention_kernel(ours.q)
        ms = _time_ms(ours)
        results[f"{tag}_us"] = ms * 1e3
        results[f"{tag}_tflops"] = flops / (ms * 1e-3) / 1e12
        if seq == 4096:
            # the portable mma.sync kernel (what an sm_80 build runs), same inputs
            with knobs.override("RADIXSERVE_EXTEND_KERNEL", "mma"):
                results["extend_attention_mma_sm80_tflops"] = flops / (_time_ms(ours) * 1e-3) / 1e12
        qs = torch.randn(1, heads, seq, d, device="cuda", dtype=dtype)
        ks = torch.randn(1, heads, seq, d, device="cuda", dtype=dtype)
        vs = torch.randn(1, heads, seq, d, device="cuda", dtype=dtype)
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    t = _time_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
            except RuntimeError as e:  # backend unavailable on this build
                print(f"sdpa {name}: unavailable ({e})", file=sys.stderr)
                continue
            tf = flops / (t * 1e-3) / 1e12
            results[f"{tag}_sdpa_{name}_tflops"] = tf
            results[f"{tag}_vs_sdpa_{name}"] = results[f"{tag}_tflops"] / tf
        del qs, ks, vs, ours
    ours = _ours_extend(1024, 3072, heads, d, dtype)
    ms = _time_ms(ours)
    results["extend_attention_prefix3k_new1k_us"] = ms * 1e3
    results["extend_attention_prefix3k_new1k_tflops"] = _causal_flops(1024, 3072) / (ms * 1e-3) / 1e12


FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _fp8_pages(n: int, hkv: int, d: int, kv_dtype, scale: float) -> torch.Tensor:
    """[n, hkv, d] FP8 pages holding N(0, 1) values stored at `scale` (what store_kv writes)."""
    from radixserve.ops.reference import quantize_fp8

    out = torch.empty(n, hkv, d, device="cuda", dtype=kv_dtype)
    for s in range(0, n, 1 << 16):         # in slices: no fp32 copy of the whole pool
        e = min(n, s + (1 << 16))
        out[s:e] = quantize_fp8(torch.randn(e - s, hkv, d, device="cuda"), kv_dtype, scale)
    return out


def bench_decode_fp8(results: dict, copy_bw: float, kv_name: str, batch: int = 256,
                     kv_len: int = 1024) -> None:
    """Decode over FP8 pages at batch x kv_len (Llama-3.1-8B heads, bf16 q, k_scale 0.5,
    v_scale 0.25), each kernel under a CUDA graph, slots in order and shuffled; bytes in FP8.
    The bf16 pool at the same shape for comparison (its bytes in bf16)."""
    kv_dtype = FP8_DTYPES[kv_name]
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    nnz = batch * kv_len
    scale = 1.0 / math.sqrt(d)
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
    kv_indptr = torch.arange(0, nnz + 1, kv_len, dtype=torch.int32, device="cuda")
    orders = {"": torch.arange(1, nnz + 1, dtype=torch.int32, device="cuda"),
              "_shuffled": (torch.randperm(nnz, device="cuda") + 1).to(torch.int32)}
    tag = f"decode_attention_{kv_name}_bs{batch}_{kv_len // 1024}k"
    base = f"decode_attention_bf16_bs{batch}_{kv_len // 1024}k"
    for name, pages, elem in ((tag, kv_dtype, 1), (base, dtype, 2)):
        if pages == dtype:
            k_cache = torch.randn(nnz + 1, hkv, d, device="cuda", dtype=dtype)
            v_cache = torch.randn(nnz + 1, hkv, d, device="cuda", dtype=dtype)
            ks = vs = 1.0
        else:
            k_cache = _fp8_pages(nnz + 1, hkv, d, kv_dtype, 0.5)
            v_cache = _fp8_pages(nnz + 1, hkv, d, kv_dtype, 0.25)
            ks, vs = 0.5, 0.25
        nbytes = 2 * nnz * hkv * d * elem + 2 * q.numel() * 2     # K + V + q + out
        results[name + "_bytes"] = nbytes
        for kernel in ("tc", "simt"):
            choice = "simt" if kernel == "simt" else "auto"     # the op's kernel argument
            for suffix, idx in orders.items():
                ms = _graph_time_ms(lambda: ops.paged_decode_attention(
                    q, k_cache, v_cache, kv_indptr, idx, scale, ks, vs, kernel=choice), calls=10)
                key = f"{name}_{kernel}{suffix}"
                results[key + "_us"] = ms * 1e3
                results[key + "_bw_fraction"] = nbytes / (ms * 1e-3) / copy_bw
        del k_cache, v_cache
        torch.cuda.empty_cache()
    # the acceptance figure: the tensor-core kernel over FP8 pages, in-order slots
    results[f"{tag}_bw_fraction"] = results[f"{tag}_tc_bw_fraction"]
    results[f"{tag}_speedup_over_bf16"] = results[f"{base}_tc_us"] / results[f"{tag}_tc_us"]


def bench_decode_fp8_long(results: dict, copy_bw: float, kv_name: str) -> None:
    """Batch 32 x 4,096 tokens over FP8 pages (the bf16 decode bench's shape): split requests,
    the CUDA-core kernel; bytes in FP8."""
    kv_dtype = FP8_DTYPES[kv_name]
    batch, kv_len, hq, hkv, d = 32, 4096, 32, 8, 128
    nnz = batch * kv_len
    k_cache = _fp8_pages(nnz + 1, hkv, d, kv_dtype, 0.5)
    v_cache = _fp8_pages(nnz + 1, hkv, d, kv_dtype, 0.25)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    kv_indptr = torch.arange(0, nnz + 1, kv_len, dtype=torch.int32, device="cuda")
    idx = torch.arange(1, nnz + 1, dtype=torch.int32, device="cuda")
    nbytes = 2 * nnz * hkv * d + 2 * q.numel() * 2
    ms = _graph_time_ms(lambda: ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, idx,
                                                           1.0 / math.sqrt(d), 0.5, 0.25))
    results[f"decode_attention_{kv_name}_bs32_4k_us"] = ms * 1e3
    results[f"decode_attention_{kv_name}_bs32_4k_bw_fraction"] = nbytes / (ms * 1e-3) / copy_bw
    del k_cache, v_cache
    torch.cuda.empty_cache()


def bench_extend_fp8(results: dict, kv_name: str, seq: int = 4096) -> None:
    """Causal extend of one 4,096-token request over FP8 pages (32 heads, d 128, bf16 q):
    TFLOP/s, beside the bf16 pool's mma.sync kernel on the same shape."""
    kv_dtype = FP8_DTYPES[kv_name]
    heads, d = 32, 128
    flops = _causal_flops(seq)
    q = torch.randn(seq, heads, d, device="cuda", dtype=torch.bfloat16)
    k_cache = _fp8_pages(seq + 1, heads, d, kv_dtype, 0.5)
    v_cache = _fp8_pages(seq + 1, heads, d, kv_dtype, 0.25)
    qo_indptr = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    kv_indices = torch.arange(1, seq + 1, dtype=torch.int32, device="cuda")
    ms = _time_ms(lambda: ops.paged_extend_attention(q, k_cache, v_cache, qo_indptr, qo_indptr,
                                                     kv_indices, 1.0 / math.sqrt(d), 0.5, 0.25))
    results[f"extend_attention_{kv_name}_{seq // 1024}k_us"] = ms * 1e3
    results[f"extend_attention_{kv_name}_{seq // 1024}k_tflops"] = flops / (ms * 1e-3) / 1e12
    ours = _ours_extend(seq, 0, heads, d, torch.bfloat16)
    with knobs.override("RADIXSERVE_EXTEND_KERNEL", "mma"):
        ms = _time_ms(ours)
    results[f"extend_attention_bf16_mma_sm80_{seq // 1024}k_tflops"] = flops / (ms * 1e-3) / 1e12


def run_fp8(results: dict, kv_name: str = "fp8_e4m3") -> None:
    """Adds the FP8-KV-cache keys (module doc) to results (needs CUDA and radixserve._C)."""
    if not (torch.cuda.is_available() and kernels_available()):
        raise RuntimeError("attention bench needs CUDA and the radixserve._C extension")
    results["device"] = torch.cuda.get_device_name()
    bw = results.get("copy_bandwidth_bytes_per_s") or copy_bandwidth()
    results["copy_bandwidth_bytes_per_s"] = bw
    bench_decode_fp8(results, bw, kv_name)
    bench_decode_fp8_long(results, bw, kv_name)
    bench_extend_fp8(results, kv_name)


def run(results: dict) -> None:
    """Adds the attention keys to results (needs CUDA and radixserve._C)."""
    if not (torch.cuda.is_available() and kernels_available()):
        raise RuntimeError("attention bench needs CUDA and the radixserve._C extension")
    results["device"] = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    results["copy_bandwidth_bytes_per_s"] = bw
    bench_decode(results, bw)
    bench_decode_large_batch(results, bw)
    bench_decode_bs1_layers(results)
    bench_extend(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *FP8_DTYPES],
                    help="auto: the bf16 benchmarks; an FP8 format: only the FP8-KV-cache ones")
    args = ap.parse_args()
    results: dict = {}
    if args.kv_cache_dtype == "auto":
        run(results)
    else:
        run_fp8(results, args.kv_cache_dtype)
    width = max(len(k) for k in results)
    for k, v in results.items():
        print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
