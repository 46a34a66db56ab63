"""Where a decode step's device time goes: the kernels of --steps decode steps at one batch
size, from the torch profiler (CUDA graphs off, so every kernel is its own record; --cuda-graph
keeps them: the kernels replayed inside the graphs, as CUPTI reports them), grouped by
what they do, each group's time per step and, for the weight GEMMs, the bandwidth they reach
against the device-to-device copy bandwidth measured in the same process.

    python bench/decode_profile.py --preset llama-3.1-8b --batch-size 1 --out prof.json

With --phase prefill it profiles the prefill of the --batch-size prompts instead (the steps
that bring them all into the running batch, chunked as the engine chunks them) and reports the
groups per prefill token and the GEMMs' achieved TFLOP/s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_steps import copy_bandwidth, make_scheduler, streamed_weight_bytes  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc"))
from radixserve.bench import timeline  # noqa: E402

GROUPS = [("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "splitk", "cublas")),
          ("attention", ("decode_attention", "paged_decode", "extend", "attn", "flash")),
          ("norm", ("rms_norm", "rmsnorm")), ("rope", ("rotary", "rope")),
          ("kv_store", ("store_kv",)), ("activation", ("silu",)),
          ("sampling", ("sample", "argmax", "softmax", "topk")),
          ("copy/index", ("copy", "index", "gather", "scatter", "elementwise", "fill", "cat"))]


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def _time_us(fn, iters=50) -> float:
    for _ in range(5):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return 1e3 * a.elapsed_time(b) / iters


def linear_bandwidth(model, bw, batch_sizes=(1, 2, 4, 8)):
    """For each distinct weight shape of the model at M = batch rows, alone: cuBLAS (F.linear)
    and, where it serves M, our skinny GEMM (ops.skinny_linear), in microseconds and as the
    fraction of the copy bandwidth their weight read reaches (the floor's definition). Each
    timed call reads a different copy of the weight (enough copies to span 256 MB), so no
    matrix is served from the H200's 50 MB L2 across repeats. For the gate|up shape the skinny
    time is the fused projection + activation (ops.skinny_gated_linear) and cuBLAS's includes
    its silu_and_mul, as in the model."""
    import torch.nn.functional as F

    from radixserve import ops

    gate_up_shape = tuple(model.model.layers[0].mlp.gate_up_proj.weight.shape)
    shapes = sorted({tuple(p.shape) for n, p in model.named_parameters()
                     if p.dim() == 2 and "embed_tokens" not in n}, key=lambda s: -s[0] * s[1])
    rows = []
    for n_out, k in shapes:
        nbytes = n_out * k * 2
        copies = max(1, -(-256 * 2**20 // nbytes))
        ws = [torch.empty(n_out, k, device="cuda", dtype=torch.bfloat16).normal_()
              for _ in range(copies)]
        gated = (n_out, k) == gate_up_shape
        for m in batch_sizes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            it = iter(range(10**9))

            def cublas():
                y = F.linear(x, ws[next(it) % copies])
                return ops.silu_and_mul(y) if gated else y

            def skinny():
                w = ws[next(it) % copies]
                return ops.skinny_gated_linear(x, w) if gated else ops.skinny_linear(x, w)

            row = {"n": n_out, "k": k, "m": m, "gated": gated}
            kernels = [("cublas", cublas)]
            if ops.skinny_linear_fits(x, ws[0]):
                kernels.append(("skinny", skinny))
            for name, fn in kernels:
                us = _time_us(fn, iters=max(50, 2 * copies))
                row[f"{name}_us"] = us
                row[f"{name}_bw_fraction"] = (nbytes / (us / 1e6)) / bw
            rows.append(row)
        del ws
    return rows


def kernel_times(prof):
    """The profiler's CUDA records -> (us by group, us by kernel name, calls by kernel name)."""
    by_group, by_kernel, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        by_group[group_of(ev.name)] += us
        by_kernel[ev.name] += us
        count[ev.name] += 1
    return by_group, by_kernel, count


def top_kernels(by_kernel, count, per):
    return [{"name": k[:120], "us_per_step": v / per, "calls_per_step": count[k] / per}
            for k, v in sorted(by_kernel.items(), key=lambda x: -x[1])[:25]]


def matmul_params(model) -> int:
    """Weights a prompt token multiplies in the decoder layers (embedding and LM head excluded:
    a prefill computes logits for one token per request)."""
    return sum(p.numel() for n, p in model.named_parameters()
               if p.dim() == 2 and "embed_tokens" not in n and "lm_head" not in n)


def add_prompts(sched, args, n_new, salt=0):
    """--batch-size prompts of --prompt-len tokens; another salt shares no prefix (no cache hit)."""
    from radixserve.engine.req import Req
    from radixserve.sampling.params import SamplingParams

    for i in range(args.batch_size):
        sched.add_request(Req(f"p{salt}-{i}",
                              [1000 + (7 * i + j + 3 * salt) % 50000 for j in range(args.prompt_len)],
                              SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True),
                              n_new))


def profile_prefill(sched, args):
    """The steps that prefill --batch-size prompts (requests that then stay running, so the
    count of running requests says when every prompt is in), after a warm-up batch of the same
    shape that runs to completion (kernels' first launches, allocator growth)."""
    add_prompts(sched, args, 2)
    while sched.has_work():
        sched.step()
    add_prompts(sched, args, 64, salt=1)
    torch.cuda.synchronize()
    steps, decodes0 = 0, sched.counters["num_decode_steps"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        while len(sched.running) < args.batch_size and steps < 1000:
            sched.step()
            steps += 1
        torch.cuda.synchronize()
    decodes = sched.counters["num_decode_steps"] - decodes0   # steps that were not prefills
    by_group, by_kernel, count = kernel_times(prof)
    tokens = args.batch_size * args.prompt_len
    flops = 2.0 * matmul_params(sched.runner.model) * tokens
    gemm_s = by_group["gemm"] / 1e6
    return {"phase": "prefill", "device": torch.cuda.get_device_name(),
            "batch_size": args.batch_size, "prompt_len": args.prompt_len, "steps": steps, "decode_steps_among_them": decodes,
            "kernel_us_per_step": sum(by_group.values()) / steps,
            "kernel_us_per_1k_tokens": 1e3 * sum(by_group.values()) / tokens,
            "gemm_tflops": flops / gemm_s / 1e12 if gemm_s else None,
            "groups_us_per_step": {g: v / steps for g, v in sorted(by_group.items(), key=lambda x: -x[1])},
            "top_kernels": top_kernels(by_kernel, count, steps),
            "timeline": timeline.summarize_profile(prof)}


def profile_decode(sched, args, bw):
    # decode steps run between the prefill chunks too: the first requests must not finish
    # before the last one is in (the loop below waits for all of them)
    prefill_steps = -(-args.batch_size * args.prompt_len // args.chunked_prefill_size) + 2
    n_new = args.steps + args.warmup + 8 + prefill_steps
    add_prompts(sched, args, n_new)
    while len(sched.running) < args.batch_size:
        sched.step()
    for _ in range(args.warmup):
        sched.step()
    torch.cuda.synchronize()
    d0 = sched.counters["num_decode_steps"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            sched.step()
        torch.cuda.synchronize()
    steps = sched.counters["num_decode_steps"] - d0
    by_group, by_kernel, count = kernel_times(prof)
    weight_bytes = streamed_weight_bytes(sched.runner.model)
    floor_us = 1e6 * weight_bytes / bw
    total = sum(by_group.values()) / steps
    gemm = by_group["gemm"] / steps
    out = {"device": torch.cuda.get_device_name(), "batch_size": args.batch_size,
           "prompt_len": args.prompt_len, "steps": steps, "copy_bandwidth_GBps": bw / 1e9,
           "floor_us": floor_us, "kernel_us_per_step": total,
           "kernel_over_floor": total / floor_us,
           "gemm_us_per_step": gemm, "gemm_bandwidth_fraction": floor_us / gemm if gemm else None,
           "groups_us_per_step": {g: v / steps for g, v in sorted(by_group.items(), key=lambda x: -x[1])}}
    if args.linear_bandwidth:
        out["linear_bandwidth"] = linear_bandwidth(sched.runner.model, bw)
    out["top_kernels"] = top_kernels(by_kernel, count, steps)
    out["timeline"] = timeline.summarize_profile(prof)    # the gaps between kernels
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--no-linear-bandwidth", dest="linear_bandwidth", action="store_false",
                   help="decode: skip the per-shape cuBLAS / skinny GEMM timings")
    p.add_argument("--cuda-graph", action="store_true",
                   help="decode: profile the steps as the engine runs them, as CUDA graph replays")
    p.add_argument("--server-config", default="bf16", choices=("bf16", "fp8", "fp8-kv"),
                   help="bf16, or fp8_speed's FP8 configurations: --quantization fp8 (and "
                        "--kv-cache-dtype fp8_e4m3)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.batch_sizes = [args.batch_size]
    from fp8_speed import CONFIGS
    args.server_extra = dict(CONFIGS[args.server_config])

    from radixserve.bench.presets import build_preset

    model_dir = build_preset(args.preset, os.path.join(tempfile.gettempdir(), f"preset-{args.preset}"))
    bw = copy_bandwidth(torch.device("cuda"))
    sched = make_scheduler(model_dir, args, serial=True)
    if not args.cuda_graph:
        sched.runner.graph_runner = None    # eager: one profiler record per kernel
    out = profile_prefill(sched, args) if args.phase == "prefill" else profile_decode(sched, args, bw)
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(out, command="python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:]))), f, indent=1)
    return out


if __name__ == "__main__":
    main()
