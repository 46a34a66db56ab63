"""Decode-step time against the weight-streaming floor, overlap on vs off, in one process.

For each batch size B (default 1, 8, 64, 128, 256) the scheduler gets B requests of
--prompt-len tokens, prefills them, then runs --steps decode turns of the real step pipeline
(engine/pipeline.py, driven synchronously: a turn launches step N, then waits for step N-1 and
processes it). Measured per configuration (overlap, serial):
  step_ms     wall time per decode step (mean over the timed turns)
  gpu_busy    device time of the steps (CUDA events) / wall time; idle = 1 - gpu_busy
  turn_ms_median  the median wall time of one turn (a turn is one step at steady state; unlike
              step_ms, a mean, one stalled turn does not move it)
and once per process:
  floor_ms    streamed weight bytes (every parameter but the embedding table, read once per
              step) / the device-to-device copy bandwidth measured here (bytes read + written)
Ratios printed and written to --out: step_ms(B=1) / floor_ms, step_ms(B=8) / step_ms(B=1), and
the idle fraction at B=64, overlap on and off. Both configurations share one set of weights.

    python bench/decode_steps.py --preset llama-3.1-8b --out bench/results/decode-steps-h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc"))

from radixserve.model.weight_floor import copy_bandwidth, streamed_weight_bytes  # noqa: E402,F401


def make_scheduler(model_dir, args, serial, model=None):
    from radixserve.config import ModelConfig, ServerArgs
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.runner import ModelRunner

    max_bs = max(args.batch_sizes)
    sa = ServerArgs(model_path=model_dir, load_format="dummy", device="cuda", dtype="bfloat16",
                    max_total_tokens=max_bs * (args.prompt_len + args.steps + 64) + 1024,
                    max_running_requests=max_bs, context_length=args.prompt_len + 4096,
                    disable_overlap_schedule=serial, tp_size=getattr(args, "tp_size", 1),
                    chunked_prefill_size=getattr(args, "chunked_prefill_size", 8192),
                    max_prefill_tokens=getattr(args, "max_prefill_tokens", 16384),
                    **getattr(args, "server_extra", {}))
    runner = ModelRunner(sa, ModelConfig.from_path(model_dir), model_dir,
                         context_len=sa.context_length, model=model)
    return Scheduler(sa, runner)


def measure(sched, batch_size, args, seed):
    import random

    from radixserve.engine.req import Req
    from radixserve.sampling.params import SamplingParams

    rng = random.Random(seed)
    vocab = sched.vocab_size
    n_new = args.steps + args.warmup + 4
    reqs = [Req(f"b{batch_size}-{seed}-{i}", [rng.randrange(1000, vocab - 1000)
                                             for _ in range(args.prompt_len)],
                SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True), n_new)
            for i in range(batch_size)]
    for r in reqs:
        sched.add_request(r)
    while len(sched.running) < batch_size:             # prefill everything
        sched.step()
    for _ in range(args.warmup):
        sched.step()
    torch.cuda.synchronize()
    dev0 = sched.total_device_time
    steps0 = sched.counters["num_decode_steps"]
    t0 = time.perf_counter()
    turns = []                                         # wall time of each turn (its median is
    t_prev = t0                                        # blind to a one-off host stall)
    for _ in range(args.steps):
        sched.step()
        t = time.perf_counter()
        turns.append(t - t_prev)
        t_prev = t
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps = sched.counters["num_decode_steps"] - steps0
    busy = (sched.total_device_time - dev0) / wall
    for r in reqs:
        sched.abort(r.rid)
    while sched.has_work():
        sched.step()
    return {"step_ms": 1e3 * wall / max(steps, 1), "gpu_busy": busy, "steps": steps,
            "turn_ms_median": 1e3 * statistics.median(turns) if turns else None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--batch-sizes", default="1,8,64,128,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--modes", default="overlap,no-overlap",
                   help="comma-separated: overlap (the default loop), no-overlap (serial), "
                        "eager (overlap with CUDA graphs off)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks (GPUs 0..N-1; decode replays one CUDA graph per GPU)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]

    from presets import build_preset

    model_dir = build_preset(args.preset, os.path.join(tempfile.gettempdir(),
                                                       f"preset-{args.preset}"))
    bw = copy_bandwidth(torch.device("cuda"))
    results = {}
    first = None
    for name in args.modes.split(","):
        serial = name == "no-overlap"
        sched = make_scheduler(model_dir, args, serial, model=first)
        if name == "eager":
            sched.runner.graph_runner = None
        first = sched.runner.model if first is None else first
        results[name] = {str(b): measure(sched, b, args, seed=b) for b in args.batch_sizes}
        for b in args.batch_sizes:
            r = results[name][str(b)]
            print(f"{name:10s} bs {b:4d}: {r['step_ms']:7.2f} ms/step, GPU busy "
                  f"{100 * r['gpu_busy']:5.1f}%", flush=True)
        del sched
    weight_bytes = streamed_weight_bytes(first)
    floor_ms = 1e3 * weight_bytes / bw
    summary = {"copy_bandwidth_GBps": bw / 1e9, "streamed_weight_GB": weight_bytes / 1e9,
               "floor_ms": floor_ms}
    for name, res in results.items():
        b1 = res.get("1", {}).get("step_ms")
        b8 = res.get("8", {}).get("step_ms")
        b64 = res.get("64")
        if b1:
            summary[f"{name}_bs1_over_floor"] = b1 / floor_ms
        if b1 and b8:
            summary[f"{name}_bs8_over_bs1"] = b8 / b1
        if b64:
            summary[f"{name}_bs64_gpu_idle"] = 1 - b64["gpu_busy"]
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])),
                       "device": torch.cuda.get_device_name(), "summary": summary,
                       "results": results}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
