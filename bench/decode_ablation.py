"""What each small op of a decode step costs inside the real step, by taking it out: a
diagnostic for issues 33 (batch-1 step <= 1.10x its weight floor) and 35 (FP8 batch-1 step
<= 0.60x bf16), which both need the time between the weight streams cut.

The profiler cannot say it: our kernels launch with programmatic dependent launch, so a
kernel's measured duration includes the time it waits for the one before it, and the sum of
kernel durations exceeds the step (bench/results/decode-profile-h200-bs1.json: 5.04 ms of
kernels in a 4.2 ms step). Here each variant replaces some ops by no-ops (their outputs are
then wrong; the timing of the rest is not data-dependent), rebuilds the runner so its CUDA
graphs are captured without them, and measures the decode step of the real pipeline exactly
as bench/decode_steps.py does. What a variant saves is an upper bound on what fusing those
ops away can win:

  base      the step as it is
  no-norm   rms_norm / fused_add_rms_norm skipped (the 2 norms per layer and the final one)
  no-rope   rotary_embedding_store_kv skipped (rope on q, k and the KV store)
  no-attn   paged_decode_attention returns q (the attention kernel skipped)
  no-small  all three: what is left is the GEMMs (and the embedding, sampling, staging)

For each configuration (bf16; fp8 = --quantization fp8, weight-only skinny GEMVs at small
batch) one set of dummy weights serves all its variants; the weight floor is measured once.

    python bench/decode_ablation.py --preset llama-3.1-8b --configs bf16,fp8 \
        --out bench/results/decode-ablation-<card>.json
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc"))

from radixserve.model.weight_floor import copy_bandwidth, streamed_weight_bytes  # noqa: E402

CONFIGS = {"bf16": {}, "fp8": {"quantization": "fp8"}}


def _no_norm(x, weight, eps):
    return x


def _no_add_norm(x, residual, weight, eps):
    return None


def _no_rope(*args, **kwargs):
    return None


def _no_attn(q, *args, **kwargs):
    return q


# variant -> {ops attribute: replacement}
VARIANTS = {
    "base": {},
    "no-norm": {"rms_norm": _no_norm, "fused_add_rms_norm": _no_add_norm},
    "no-rope": {"rotary_embedding_store_kv": _no_rope},
    "no-attn": {"paged_decode_attention": _no_attn},
}
VARIANTS["no-small"] = {**VARIANTS["no-norm"], **VARIANTS["no-rope"], **VARIANTS["no-attn"]}


@contextlib.contextmanager
def patched_ops(replacements):
    """radixserve.ops attributes replaced for the duration (the model calls ops.<name> at call
    time, so the runner built and captured inside sees the replacements)."""
    from radixserve import ops
    saved = {name: getattr(ops, name) for name in replacements}
    try:
        for name, fn in replacements.items():
            setattr(ops, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--configs", default="bf16,fp8", help=f"comma-separated: {', '.join(CONFIGS)}")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.prefill_len = args.prompt_len            # what fp8_speed.make_scheduler sizes for
    configs, variants = args.configs.split(","), args.variants.split(",")
    for c in configs:
        if c not in CONFIGS:
            p.error(f"unknown config {c!r}; one of {', '.join(CONFIGS)}")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; one of {', '.join(VARIANTS)}")

    from decode_steps import measure
    from fp8_speed import make_scheduler
    from presets import build_preset

    model_dir = build_preset(args.preset, os.path.join(tempfile.gettempdir(),
                                                       f"preset-{args.preset}"))
    bw = copy_bandwidth(torch.device("cuda"))
    results, floors = {}, {}
    for c in configs:
        model = None
        results[c] = {}
        for v in variants:
            with patched_ops(VARIANTS[v]):
                sched = make_scheduler(model_dir, args, CONFIGS[c], model=model)
                model = sched.runner.model
                results[c][v] = {str(b): measure(sched, b, args, seed=b)
                                 for b in args.batch_sizes}
            for b in args.batch_sizes:
                r = results[c][v][str(b)]
                print(f"{c:5s} {v:9s} bs {b:4d}: {r['step_ms']:7.3f} ms/step, GPU busy "
                      f"{100 * r['gpu_busy']:5.1f}%", flush=True)
            del sched
            gc.collect()
        floors[c] = 1e3 * streamed_weight_bytes(model) / bw
        del model
        gc.collect()
        torch.cuda.empty_cache()

    summary = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9}
    for c in configs:
        summary[f"{c}_floor_ms"] = floors[c]
        base = results[c].get("base")
        for b in args.batch_sizes:
            for v, r in results[c].items():
                ms = r[str(b)]["step_ms"]
                summary[f"{c}_bs{b}_{v}_over_floor"] = ms / floors[c]
                if base is not None and v != "base":
                    summary[f"{c}_bs{b}_{v}_saves_ms"] = base[str(b)]["step_ms"] - ms
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])),
                       "summary": summary, "results": results}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
