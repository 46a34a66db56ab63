"""Kernel benchmark: every radixserve kernel against a hardware limit AND a peer, both measured in
the same run, on the current CUDA device.

  limit: bytes the op must move / device-to-device copy bandwidth (bytes read + written) measured
         here; bitmask_sample is also compared with one read of its fp32 logits (logits.sum()).
  peer:  the torch reference (radixserve.ops.reference) or torch built-ins doing the same work.

Prints a table and writes bench/results/kernels-<device>.json (default kernels-h200.json), and
merges in what bench/attention_bench.py's run(results) adds when that module is present.

  PYTHONPATH=pysrc python3 bench/kernels.py [--out bench/results/kernels-h200.json] [--quick]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "pysrc"))

from radixserve.ops import reference as ref  # noqa: E402
from radixserve.ops._ext import kernels_available  # noqa: E402


def time_us(fn, reps=50, warmup=5, sets=1):
    """Median device time of fn(i) in microseconds: CUDA events around each call, all calls
    enqueued back to back and synchronised once at the end, so the GPU queue stays ahead of
    Python and a call's host dispatch is not counted as its device time. fn gets the repetition
    index so callers can rotate among input sets larger than L2."""
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for i, (a, b) in enumerate(events):
        a.record()
        fn(i % sets)
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in events)


def copy_bandwidth():
    """Bytes read + written per second by a large device-to-device copy (2 GiB each way)."""
    n = 1 << 29  # fp32 elements: 2 GiB
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    t = time_us(lambda i: dst.copy_(src), reps=20, warmup=3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 4 / (t * 1e-6)


def _mask(batch, vocab, keep=0.6):
    words = (vocab + 31) // 32
    bits = torch.randint(-2**31, 2**31 - 1, (batch, words), device="cuda", dtype=torch.int32)
    # about `keep` of the tokens allowed: AND/OR random words
    if keep > 0.5:
        bits |= torch.randint(-2**31, 2**31 - 1, (batch, words), device="cuda", dtype=torch.int32)
    return bits


def _torch_topk_sampler(logits, bits, temperature, top_k, top_p):
    """The peer: torch built-ins, vectorised over the batch (mask, temperature, topk, softmax,
    top-p over the top-k, multinomial)."""
    x = ref.apply_bitmask(logits.float(), bits) / temperature[:, None]
    vals, idx = torch.topk(x, int(top_k[0]), dim=-1)
    p = torch.softmax(vals, -1)
    cum = p.cumsum(-1) - p
    p = p.masked_fill(cum >= top_p[:, None], 0)
    choice = torch.multinomial(p, 1)
    return idx.gather(1, choice)[:, 0]


def _torch_full_sampler(logits, bits, temperature, top_k, top_p, min_p):
    probs = ref.filtered_probs(logits, bits, temperature, top_k, top_p, min_p)
    return torch.multinomial(probs, 1)[:, 0]


def _sample_params(batch, t, k, p, mp):
    """bitmask_sample's per-row tensors after the bitmask: temperature, top_k, top_p, min_p,
    seeds (0..batch-1), offsets (0)."""
    dev = "cuda"
    return (torch.full((batch,), t, device=dev), torch.full((batch,), k, device=dev, dtype=torch.int32),
            torch.full((batch,), p, device=dev), torch.full((batch,), mp, device=dev),
            torch.arange(batch, device=dev), torch.zeros(batch, device=dev, dtype=torch.int64))


def bench_sampling(results, copy_bw, rows):
    ops = torch.ops.radixserve
    batch, vocab = 256, 128256
    logits = torch.randn(batch, vocab, device="cuda") * 3
    bits = _mask(batch, vocab)
    read_us = time_us(lambda i: logits.sum(), reps=50)
    results["logits_read_us"] = read_us
    results["logits_read_bytes"] = logits.numel() * 4
    results["logits_read_bw_fraction"] = logits.numel() * 4 / (read_us * 1e-6) / copy_bw

    def params(t, k, p, mp):
        return _sample_params(batch, t, k, p, mp)

    configs = [
        ("bitmask_sample", 1.0, 50, 0.9, 0.0),           # the target configuration
        ("bitmask_sample_greedy", 0.0, 0, 1.0, 0.0),
        ("bitmask_sample_plain", 1.0, 0, 1.0, 0.0),
        ("bitmask_sample_topp_only", 1.0, 0, 0.9, 0.0),
        ("bitmask_sample_minp_only", 1.0, 0, 1.0, 0.05),
        ("bitmask_sample_topk256", 1.0, 256, 1.0, 0.0),
        ("bitmask_sample_topk1000_topp", 1.0, 1000, 0.9, 0.0),
        ("bitmask_sample_temp0.7", 0.7, 50, 0.9, 0.0),
    ]
    # Peaked rows, closer to a language model's: 32 tokens per row 20 logits up hold nearly all
    # the mass, so a top_p 0.9 nucleus has tens of tokens. The random normal rows (std 3)
    # spread top_p 0.9 over ~5000 tokens: the streaming threshold search's case.
    peaked = logits.clone()
    peaked[:, ::4001] += 20.0
    configs += [("bitmask_sample_topp_only_peaked", 1.0, 0, 0.9, 0.0, peaked),
                ("bitmask_sample_minp_only_peaked", 1.0, 0, 1.0, 0.05, peaked)]
    for name, t, k, p, mp, *lg in configs:
        prm = params(t, k, p, mp)
        x = lg[0] if lg else logits
        us = time_us(lambda i: ops.bitmask_sample(x, bits, *prm), reps=30)
        results[f"{name}_us"] = us
        results[f"{name}_vs_logits_read"] = us / read_us
        rows.append((name + " [256x128256 f32, mask]", us, read_us, "x logits read", us / read_us, None, None))
    del peaked
    for dtype_name, lg in [("bf16", logits.to(torch.bfloat16))]:
        prm = params(1.0, 50, 0.9, 0.0)
        us = time_us(lambda i: ops.bitmask_sample(lg, bits, *prm), reps=30)
        results[f"bitmask_sample_{dtype_name}_us"] = us
        results[f"bitmask_sample_{dtype_name}_vs_logits_read"] = us / read_us
        rows.append((f"bitmask_sample {dtype_name} logits", us, read_us, "x f32 logits read", us / read_us, None, None))
    prm = params(1.0, 50, 0.9, 0.0)
    peer = time_us(lambda i: _torch_topk_sampler(logits, bits, prm[0], prm[1], prm[2]), reps=10, warmup=2)
    full = time_us(lambda i: _torch_full_sampler(logits, bits, *prm[:4]), reps=5, warmup=1)
    results["bitmask_sample_peer_torch_topk_us"] = peer
    results["bitmask_sample_peer_reference_sort_us"] = full
    results["bitmask_sample_speedup_vs_torch_topk"] = peer / results["bitmask_sample_us"]
    results["bitmask_sample_speedup_vs_reference_sort"] = full / results["bitmask_sample_us"]
    rows.append(("  peer: torch mask+topk+softmax+multinomial", peer, None, "", None, None, None))
    rows.append(("  peer: reference filtered_probs (sort)+multinomial", full, None, "", None, None, None))
    del logits, bits
    torch.cuda.empty_cache()


def bench_elementwise(results, copy_bw, rows, quick):
    ops = torch.ops.radixserve
    dt = torch.bfloat16
    es = 2
    sets = 3

    def record(key, label, us, nbytes, peer_us):
        limit = nbytes / copy_bw * 1e6
        frac = limit / us
        results[f"{key}_us"] = us
        results[f"{key}_bw_fraction"] = frac
        results[f"{key}_peer_us"] = peer_us
        results[f"{key}_speedup_vs_peer"] = peer_us / us
        rows.append((label, us, limit, "copy-bw fraction", frac, peer_us, peer_us / us))

    # rms_norm / fused_add_rms_norm: [16384, 4096] bf16 (128 MiB per tensor; 3 sets > L2)
    T, H = (4096 if quick else 16384), 4096
    xs = [torch.randn(T, H, device="cuda", dtype=dt) for _ in range(sets)]
    rs = [torch.randn(T, H, device="cuda", dtype=dt) for _ in range(sets)]
    w = torch.rand(H, device="cuda", dtype=dt) + 0.5
    us = time_us(lambda i: ops.rms_norm(xs[i], w, 1e-6), sets=sets)
    peer = time_us(lambda i: ref.rms_norm(xs[i], w, 1e-6), sets=sets, reps=20)
    record("rms_norm", f"rms_norm [{T}x{H} bf16]", us, 2 * T * H * es, peer)
    us = time_us(lambda i: ops.fused_add_rms_norm(xs[i], rs[i], w, 1e-6), sets=sets)
    peer = time_us(lambda i: ref.fused_add_rms_norm(xs[i], rs[i], w, 1e-6), sets=sets, reps=20)
    record("fused_add_rms_norm", f"fused_add_rms_norm [{T}x{H} bf16]", us, 4 * T * H * es, peer)
    del xs, rs

    # silu_and_mul: [T, 2 * 14336] bf16
    I = 14336
    T2 = T // 4
    gs = [torch.randn(T2, 2 * I, device="cuda", dtype=dt) for _ in range(sets)]
    us = time_us(lambda i: ops.silu_and_mul(gs[i]), sets=sets)
    peer = time_us(lambda i: ref.silu_and_mul(gs[i]), sets=sets, reps=20)
    record("silu_and_mul", f"silu_and_mul [{T2}x{2 * I} bf16]", us, 3 * T2 * I * es, peer)
    del gs

    # rotary_embedding on views of a fused qkv buffer: 32 q heads, 8 kv heads, head_dim 128
    hq, hk, d = 32, 8, 128
    qkvs = [torch.randn(T, (hq + 2 * hk) * d, device="cuda", dtype=dt) for _ in range(sets)]
    cache = torch.randn(8192, d, device="cuda")
    pos = torch.randint(0, 8192, (T,), device="cuda")

    def qk(i):
        return (qkvs[i][:, :hq * d].view(T, hq, d), qkvs[i][:, hq * d:(hq + hk) * d].view(T, hk, d))

    us = time_us(lambda i: ops.rotary_embedding(pos, *qk(i), cache), sets=sets)
    peer = time_us(lambda i: ref.rotary_embedding(pos, *qk(i), cache), sets=sets, reps=20)
    record("rotary_embedding", f"rotary_embedding [{T} tok, {hq}/{hk}x{d} bf16]", us,
           2 * T * (hq + hk) * d * es + T * d * 4, peer)
    del qkvs

    # store_kv: T tokens x 8 heads x 128 into a 1M-slot pool
    slots_n = 1 << 20
    kc = torch.empty(slots_n, hk, d, device="cuda", dtype=dt)
    vc = torch.empty_like(kc)
    ks = [torch.randn(T, hk, d, device="cuda", dtype=dt) for _ in range(sets)]
    vs = [torch.randn(T, hk, d, device="cuda", dtype=dt) for _ in range(sets)]
    slots = torch.randperm(slots_n, device="cuda")[:T].to(torch.int32)
    us = time_us(lambda i: ops.store_kv(kc, vc, ks[i], vs[i], slots), sets=sets)
    peer = time_us(lambda i: ref.store_kv(kc, vc, ks[i], vs[i], slots), sets=sets, reps=20)
    record("store_kv", f"store_kv [{T} tok, {hk}x{d} bf16]", us, 4 * T * hk * d * es, peer)
    del kc, vc, ks, vs

    # build_kv_indices: 256 requests x ~4k tokens
    batch = 256
    r2t = torch.randint(0, 1 << 20, (batch + 8, 8192), device="cuda", dtype=torch.int32)
    rpi = torch.randperm(batch + 8, device="cuda")[:batch].to(torch.int32)
    lens = torch.randint(1, 8192, (batch,), device="cuda", dtype=torch.int32)
    total = int(lens.sum())
    indptr = torch.empty(batch + 1, device="cuda", dtype=torch.int32)
    indices = torch.empty(total, device="cuda", dtype=torch.int32)
    us = time_us(lambda i: ops.build_kv_indices(r2t, rpi, lens, indptr, indices))
    peer = time_us(lambda i: ref.build_kv_indices(r2t, rpi, lens, indptr, indices), reps=20)
    record("build_kv_indices", f"build_kv_indices [{batch} req, {total} tok]", us, 2 * total * 4, peer)


def bench_flashinfer(results, parts):
    """FlashInfer's kernels in this process (bench/flashinfer_peer.py), and for decode attention
    (the same shapes) the ratios of their times to ours (> 1: ours is faster). An import failure is recorded as
    results["flashinfer_error"]."""
    spec = importlib.util.spec_from_file_location("flashinfer_peer", os.path.join(HERE, "flashinfer_peer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ops = torch.ops.radixserve

    def ours(top_k, top_p):
        prm = {}   # per batch size, built once: only the kernel is timed

        def sample(logits):   # no bitmask, temperature 1, as the peer's calls
            b = logits.shape[0]
            if b not in prm:
                prm[b] = _sample_params(b, 1.0, top_k, top_p, 0.0)
            return ops.bitmask_sample(logits, None, *prm[b])
        return sample
    mod.run(results, time_us, parts, ours={"sampling_topp_only": ours(0, 0.9),
                                           "sampling_topk50_topp": ours(50, 0.9)})
    pairs = (("decode_attention_us", "flashinfer_decode_attention_us"),
             ("decode_attention_bs1_1k_32layers_us", "flashinfer_decode_attention_bs1_1k_us"))
    for ours, theirs in pairs:
        graph_timed = results.get(theirs[:-3] + "_timing") == "graph"   # as ours: device time
        if ours in results and theirs in results and graph_timed:
            scale = 32 if "32layers" in ours else 1      # the peer times one layer's call
            results[f"{ours[:-3]}_speedup_vs_flashinfer"] = results[theirs] * scale / results[ours]
    # extend: one request, causal, paged page-size-1 K/V on both sides (ours timed eagerly per
    # call, theirs under a graph of 10 calls: both are device-bound at these sizes)
    for n in ("1024", "2048", "4096", "8192", "prefix3k_new1k"):
        ours = "extend_attention_us" if n == "4096" else f"extend_attention_{n}_us"
        theirs = f"flashinfer_extend_attention_{n}_us"
        if ours in results and theirs in results:
            results[f"{ours[:-3]}_speedup_vs_flashinfer"] = results[theirs] / results[ours]
    # sampling: ours on the peer's own rows (bitmask_sample_on_flashinfer_rows_*, timed in its run)
    for what in ("sampling_topp_only", "sampling_topk50_topp"):
        ours, theirs = f"bitmask_sample_on_flashinfer_rows_{what}_us", f"flashinfer_{what}_us"
        if ours in results and theirs in results:
            results[f"bitmask_sample_{what}_speedup_vs_flashinfer"] = results[theirs] / results[ours]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kernels-h200.json"))
    ap.add_argument("--quick", action="store_true", help="smaller elementwise sizes")
    ap.add_argument("--parts", default="sampling,elementwise,attention",
                    help="comma-separated subset of sampling, elementwise, attention")
    ap.add_argument("--flashinfer-parts", default="decode,sampling",
                    help="FlashInfer as a same-process peer (bench/flashinfer_peer.py, when "
                    "flashinfer imports): comma-separated parts; '' for none")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not kernels_available():
        sys.exit("needs a CUDA device and the radixserve._C extension")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    results = {
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.argv),
        "device": props.name,
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__,
    }
    copy_bw = copy_bandwidth()
    results["copy_bw_bytes_per_s"] = copy_bw
    rows = []
    parts = set(args.parts.split(","))
    for name, part in (("sampling", lambda: bench_sampling(results, copy_bw, rows)),
                       ("elementwise", lambda: bench_elementwise(results, copy_bw, rows, args.quick))):
        if name not in parts:
            continue
        try:
            part()
        except Exception:  # keep the other measurements
            traceback.print_exc()
            results.setdefault("errors", []).append(traceback.format_exc(limit=3))
    attn = os.path.join(HERE, "attention_bench.py")
    if "attention" in parts and os.path.exists(attn):
        try:
            spec = importlib.util.spec_from_file_location("attention_bench", attn)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            mod.run(results)
        except Exception:
            traceback.print_exc()
            results.setdefault("errors", []).append("attention_bench: " + traceback.format_exc(limit=3))
    if args.flashinfer_parts:
        bench_flashinfer(results, tuple(args.flashinfer_parts.split(",")))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, sort_keys=True)
    print(f"\ncopy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s on {props.name}")
    print(f"{'kernel':58s} {'us':>9s} {'limit us':>9s} {'ratio':>7s}  {'peer us':>9s} {'x peer':>7s}")
    for name, us, limit, what, ratio, peer, speed in rows:
        lim = f"{limit:9.1f}" if limit is not None else " " * 9
        rat = f"{ratio:7.2f}" if ratio is not None else " " * 7
        pe = f"{peer:9.1f}" if peer is not None else " " * 9
        sp = f"{speed:7.1f}" if speed is not None else " " * 7
        print(f"{name:58s} {us:9.1f} {lim} {rat}  {pe} {sp}  {what}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
