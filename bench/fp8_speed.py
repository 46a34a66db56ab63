"""Issue 35's FP8 speed points, bf16 and FP8 in one process on one card: batch-1 (and larger)
decode steps and a 4k-token prefill, each against the same model shape in bf16.

For each configuration (default: bf16, fp8 = `--quantization fp8` quantizing the dummy bf16
weights at load, per-output-channel e4m3; fp8-kv = the same plus `--kv-cache-dtype fp8_e4m3`;
fp8-mma / fp8-cc = fp8 with the skinny GEMM's tensor-core / CUDA-core kernel forced;
fp8-mm-fast / -swap / -swap-fast = fp8 with the W8A8 GEMM's torch._scaled_mm called so,
RADIXSERVE_FP8_SCALED_MM),
in turn, one model at a time on the device:
  decode   step_ms of the real step pipeline (the overlap loop, CUDA graphs on) at each batch
           size of --batch-sizes, prompts of --prompt-len random tokens (decode_steps.measure)
  prefill  --prefill-len random tokens as one request (max_new_tokens 1): tokens / wall time of
           the steps that prefill it, median of --prefill-reps (after one warm-up request)
and once per configuration its weight floor (streamed weight bytes / the copy bandwidth
measured here). Ratios printed and written to --out, against the first configuration:
  <cfg>_bs1_step_over_bf16   issue 35's bar: <= 0.60 for fp8
  <cfg>_prefill_over_bf16    tokens/s ratio; bar >= 1.4 for fp8
and each configuration's bs1 step over its own floor.

    python bench/fp8_speed.py --preset llama-3.1-8b --out bench/results/fp8-speed-h100.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc"))

from radixserve.model.weight_floor import copy_bandwidth, streamed_weight_bytes  # noqa: E402

CONFIGS = {
    "bf16": {},
    "fp8": {"quantization": "fp8"},
    "fp8-kv": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
    # the FP8 skinny GEMM's two kernels forced (ops.FP8_CUDA_CORE_ROWS): tensor cores at every
    # batch, or CUDA cores up to 4 rows; "fp8" runs the op's default
    "fp8-mma": {"quantization": "fp8", "fp8_cuda_core_rows": 0},
    "fp8-cc": {"quantization": "fp8", "fp8_cuda_core_rows": 4},
    # the W8A8 GEMM's call of torch._scaled_mm (knob RADIXSERVE_FP8_SCALED_MM, ops.
    # scaled_mm_rowwise): fast accumulation, the weight as the first operand, both
    "fp8-mm-fast": {"quantization": "fp8", "debug_fp8_scaled_mm": "fast"},
    "fp8-mm-swap": {"quantization": "fp8", "debug_fp8_scaled_mm": "swap"},
    "fp8-mm-swap-fast": {"quantization": "fp8", "debug_fp8_scaled_mm": "swap-fast"},
}


def make_scheduler(model_dir, args, extra, model=None):
    from radixserve.config import ModelConfig, ServerArgs
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.runner import ModelRunner

    max_bs = max(args.batch_sizes)
    tokens = max(max_bs * (args.prompt_len + args.steps + args.warmup + 64),
                 2 * args.prefill_len) + 1024
    sa = ServerArgs(model_path=model_dir, load_format="dummy", device="cuda", dtype="bfloat16",
                    max_total_tokens=tokens, max_running_requests=max_bs,
                    context_length=max(args.prompt_len, args.prefill_len) + 4096,
                    chunked_prefill_size=max(8192, args.prefill_len),
                    max_prefill_tokens=max(16384, args.prefill_len), **extra)
    runner = ModelRunner(sa, ModelConfig.from_path(model_dir), model_dir,
                         context_len=sa.context_length, model=model)
    return Scheduler(sa, runner)


def measure_prefill(sched, args, seed):
    """Median tokens/s of prefilling one --prefill-len prompt (fresh random ids each time, so
    the radix cache never hits)."""
    from radixserve.engine.req import Req
    from radixserve.sampling.params import SamplingParams

    rng = random.Random(seed)
    vocab = sched.vocab_size
    rates = []
    for i in range(args.prefill_reps + 1):
        ids = [rng.randrange(1000, vocab - 1000) for _ in range(args.prefill_len)]
        req = Req(f"p{seed}-{i}", ids, SamplingParams(max_new_tokens=1, temperature=0.0,
                                                      ignore_eos=True), 1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sched.add_request(req)
        while sched.has_work():
            sched.step()
        torch.cuda.synchronize()
        if i:                                   # the first is the warm-up
            rates.append(args.prefill_len / (time.perf_counter() - t0))
    return {"tokens_per_s": statistics.median(rates), "all": rates}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--configs", default="bf16,fp8,fp8-kv",
                   help=f"comma-separated, the first is the baseline: {', '.join(CONFIGS)}")
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--prefill-reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    names = args.configs.split(",")
    for n in names:
        if n not in CONFIGS:
            p.error(f"unknown config {n!r}; one of {', '.join(CONFIGS)}")

    from decode_steps import measure
    from presets import build_preset

    model_dir = build_preset(args.preset, os.path.join(tempfile.gettempdir(),
                                                       f"preset-{args.preset}"))
    bw = copy_bandwidth(torch.device("cuda"))
    results = {}
    from radixserve import ops

    for name in names:
        extra = dict(CONFIGS[name])
        ops.FP8_CUDA_CORE_ROWS = extra.pop("fp8_cuda_core_rows", -1)
        sched = make_scheduler(model_dir, args, extra)
        floor_ms = 1e3 * streamed_weight_bytes(sched.runner.model) / bw
        decode = {str(b): measure(sched, b, args, seed=b) for b in args.batch_sizes}
        prefill = measure_prefill(sched, args, seed=7)
        results[name] = {"floor_ms": floor_ms, "decode": decode, "prefill": prefill,
                         "kv_pool_tokens": sched.runner.max_total_tokens}
        for b in args.batch_sizes:
            d = decode[str(b)]
            med = d["turn_ms_median"]
            print(f"{name:7s} bs {b:4d}: {d['step_ms']:7.2f} ms/step (median turn "
                  f"{'-' if med is None else f'{med:.2f}'}, GPU busy {d['gpu_busy']:.4f})",
                  flush=True)
        print(f"{name:7s} floor {floor_ms:.2f} ms; prefill {args.prefill_len}: "
              f"{prefill['tokens_per_s']:,.0f} tok/s", flush=True)
        del sched
        gc.collect()
        torch.cuda.empty_cache()
    base = names[0]
    b = results[base]
    summary = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9}
    for name, r in results.items():
        summary[f"{name}_bs1_over_floor"] = r["decode"]["1"]["step_ms"] / r["floor_ms"] \
            if "1" in r["decode"] else None
        if name == base:
            continue
        for bs in r["decode"]:
            summary[f"{name}_bs{bs}_step_over_{base}"] = (r["decode"][bs]["step_ms"]
                                                          / b["decode"][bs]["step_ms"])
        summary[f"{name}_prefill_over_{base}"] = (r["prefill"]["tokens_per_s"]
                                                  / b["prefill"]["tokens_per_s"])
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])),
                       "device": torch.cuda.get_device_name(), "summary": summary,
                       "results": results}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
