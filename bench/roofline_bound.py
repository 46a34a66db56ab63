"""Issue 33's and 35's arrival-bound serving bars against the hardware: for each `radixserve bench
serving` result (a --preset run of the random dataset), the duration of its arrival schedule on
the roofline of pysrc/radixserve/bench/roofline.py (every step costs max(weight + KV bytes /
bandwidth, FLOPs / peak), prefills ride the next step, nothing waits), beside the floor-bound
duration (each token at the batch-1 weight floor and nothing else) that issue 33's bar uses.

Per result it prints: floor-bound duration, roofline duration, the measured duration over each,
the roofline over the floor bound (the share of a floor-bound bar the hardware itself takes),
and the roofline with each prompt prefilled in a step of its own (the server's
--step-order alternate) instead of riding the decode step.
Inputs, all from the result: the workload (regenerated from its args as the client drew it:
lengths and arrival gaps from numpy RandomState(seed); the nominal schedule, so both bounds here
may differ by the client's send jitter from the run's own floor_bound_duration_s, which pairs
the actual send times with the outputs), the preset's config, the weight dtypes (FP8 linear weights for
`--quantization fp8` or an -fp8 preset, the LM head in bf16; FP8 KV for `--kv-cache-dtype
fp8*`), and the server's weight floor (server_steps.weight_floor_ms); the bandwidth is the
streamed weight bytes over that floor, so KV bytes cost what weight bytes cost in that run.
Peak: --peak-tflops (default H100 SXM dense: 989 bf16, 1979 FP8).

    python bench/roofline_bound.py bench/results/logs/engine-process-ab-h100-2026-12-08/*r0*.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc"))

from radixserve.bench.presets import PRESETS  # noqa: E402
from radixserve.bench.roofline import StepCost, llama_bytes, roofline_duration  # noqa: E402
from radixserve.bench.server_steps import floor_bound_duration  # noqa: E402
from radixserve.bench.workloads import random_lengths, set_gaps  # noqa: E402


def workload(args: dict):
    """(input lens, output lens, nominal arrivals) of a random-dataset run's args, drawn as the
    client drew them (bench/workloads.build_workload: random_lengths, then set_gaps; a
    request is sent its predecessor's gap after it)."""
    stream = np.random.RandomState(args["seed"])
    ins, outs = random_lengths(stream, args["num_prompts"], args["random_input_len"],
                               args["random_output_len"], args["random_range_ratio"])
    items = [SimpleNamespace(gap=0.0) for _ in range(args["num_prompts"])]
    set_gaps(items, stream, args["request_rate"])
    arrivals = list(itertools.accumulate((item.gap for item in items[:-1]), initial=0.0))
    return [int(x) for x in ins], [int(x) for x in outs], arrivals


def analyse(result: dict, peak_bf16: float, peak_fp8: float) -> dict:
    args, metrics = result["args"], result["metrics"]
    if args.get("dataset") != "random" or not args.get("preset"):
        raise ValueError("needs a --preset run of the random dataset")
    steps = metrics.get("server_steps") or {}
    if not steps.get("weight_floor_ms"):
        raise ValueError("the result has no server weight floor (server_steps.weight_floor_ms)")
    server_args = args.get("server_args") or ""
    fp8 = "--quantization fp8" in server_args or args["preset"].endswith("-fp8")
    fp8_kv = "--kv-cache-dtype fp8" in server_args
    mb = llama_bytes(PRESETS[args["preset"]].config, weight_bytes=1 if fp8 else 2,
                     kv_bytes=1 if fp8_kv else 2)
    floor_s = steps["weight_floor_ms"] / 1e3
    bandwidth = mb.streamed_weight_bytes / floor_s
    peak = (peak_fp8 if fp8 else peak_bf16) * 1e12
    cost = StepCost(weights_s=floor_s, kv_s_per_token=mb.kv_bytes_per_token / bandwidth,
                    flop_s_per_token=2 * mb.linear_params / peak)
    ins, outs, arrivals = workload(args)
    floor_bound = floor_bound_duration(arrivals, outs, floor_s)
    roof, nsteps = roofline_duration(arrivals, ins, outs, cost)
    apart, _ = roofline_duration(arrivals, ins, outs, cost, prefill_apart=True)
    duration = metrics["duration"]
    return {"floor_bound_s": floor_bound, "roofline_s": roof, "roofline_steps": nsteps,
            "roofline_prefill_apart_s": apart,
            "duration_s": duration, "duration_over_floor_bound": duration / floor_bound,
            "duration_over_roofline": duration / roof, "roofline_over_floor_bound": roof / floor_bound,
            "bandwidth_bytes_per_s": bandwidth, "peak_flops": peak, "fp8_weights": fp8,
            "fp8_kv": fp8_kv, "output_tokens": sum(outs),
            "run_floor_bound_s": steps.get("floor_bound_duration_s")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak")
    ap.add_argument("--peak-tflops-fp8", type=float, default=1979.0, help="FP8 dense peak")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = {}
    for path in args.results:
        with open(path) as f:
            result = json.load(f)
        try:
            r = analyse(result, args.peak_tflops, args.peak_tflops_fp8)
        except (ValueError, KeyError) as e:
            print(f"{path}: skipped ({e})")
            continue
        out[path] = r
        print(f"{os.path.basename(path)}: duration {r['duration_s']:.2f} s, floor-bound "
              f"{r['floor_bound_s']:.2f} s ({r['duration_over_floor_bound']:.3f}x), roofline "
              f"{r['roofline_s']:.2f} s ({r['duration_over_roofline']:.3f}x); roofline / "
              f"floor-bound {r['roofline_over_floor_bound']:.3f}; prefills in steps of "
              f"their own {r['roofline_prefill_apart_s']:.2f} s "
              f"(bandwidth {r['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
