"""Offline throughput: radixserve.Engine vs HF transformers, in one run.

Both get the same prompts (random token ids, fixed seed, equal lengths), the same max_new_tokens,
greedy decoding, and EOS ignored so every sequence has the same length. HF runs either one
batched generate() with left padding (--hf-mode generate; EOS ignored through min_new_tokens) or
its continuous batching (--hf-mode generate_batch: `model.generate_batch` over paged attention
with sdpa; EOS disabled). Prints both output tokens/s and their ratio (engine / HF); --out
writes the numbers and the command as JSON. --preset NAME runs radixserve.bench.presets' real shapes
with random weights on both sides (each side its own: their greedy outputs are not compared).

    radixserve bench offline --num-prompts 16 --input-len 64 --output-len 64 --device cpu \
        --out bench/results/offline-cpu.json
    radixserve bench offline --device cuda --preset llama-3.1-8b --num-prompts 256 \
        --input-len 1024 --output-len 256 --hf-mode generate_batch --out offline-h200-8b.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shlex
import sys
import time

import radixserve  # noqa: F401  (before torch: sets the process's OpenMP wait policy, for both sides)
import torch

from radixserve.bench import server_steps


def make_prompts(num: int, length: int, vocab: int, seed: int):
    rng = random.Random(seed)
    # skip the lowest ids: special tokens live there in most vocabularies
    return [[rng.randrange(256, vocab) for _ in range(length)] for _ in range(num)]


def _step_totals(sched) -> dict:
    """The scheduler's running totals that say where the engine's time went (server_steps's
    keys: device seconds of decode and of extend (prefill) steps, the device's idle seconds
    just before each kind (CUDA), how many of each ran, tokens generated)."""
    return server_steps.engine_totals(sched.metrics())


def run_engine(args, prompts):
    """The engine's timed generate of every prompt (after a short warm-up) -> (seconds, output
    ids, model path, the steps' totals over the timed run: _step_totals and device_busy)."""
    total = args.num_prompts * (args.input_len + args.output_len) + 1024
    overrides = dict(device=args.device, load_format=args.load_format, max_total_tokens=total,
                     max_running_requests=max(args.num_prompts, 1))
    if args.cpu_threads:
        overrides["cpu_threads"] = args.cpu_threads
    if args.disable_cuda_graph:
        overrides["disable_cuda_graph"] = True
    overrides.update(args.engine_args)
    engine = radixserve.Engine(args.model_path, **overrides)
    if args.device == "cuda":
        torch.cuda.synchronize()
    try:
        sp = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=[p[:8] for p in prompts[:2]],
                        sampling_params={**sp, "max_new_tokens": 4})          # warm-up
        sched = engine.async_engine.scheduler
        sched.flush_cache()
        before = _step_totals(sched)
        prof = _LoopProfile(engine, args.profile_host)
        dev_prof = _DeviceProfile(args.profile_device)
        pauses = _GcPauses()
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        elapsed = time.perf_counter() - start
        pauses.stop()
        prof.finish()
        dev_prof.finish()
        steps = {k: round(v - before[k], 3) for k, v in _step_totals(sched).items()}
        steps["device_busy"] = round((steps["decode_device_s"] + steps["extend_device_s"])
                                     / elapsed, 4)
        steps["gc_pause_s"], steps["gc_full_collections"] = round(pauses.total, 4), pauses.full
        model_path = engine.async_engine.model_path
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()       # the HF side sizes its cache from free memory
    assert all(len(o["output_ids"]) == args.output_len for o in outs)
    return elapsed, [o["output_ids"] for o in outs], model_path, steps


class _GcPauses:
    """Seconds the process spent in garbage collections (any thread) from now until stop(),
    and how many of them were full (generation 2) collections."""

    def __init__(self):
        self.total, self.full, self._t0 = 0.0, 0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.total += time.perf_counter() - self._t0
            self.full += info.get("generation") == 2
            self._t0 = None

    def stop(self):
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class _LoopProfile:
    """--profile-host PATH: cProfile of the engine's event-loop thread (scheduling, results,
    streaming) over the timed run, its top functions written to PATH as text. The profiler is
    switched on and off from inside that thread (cProfile follows the thread that enables it).
    It slows the host side, so its run's throughput is not a result."""

    def __init__(self, engine, path):
        self.engine, self.path, self.prof = engine, path, None
        if path:
            import cProfile
            self.prof = cProfile.Profile()
            self._in_loop(self.prof.enable)

    def _in_loop(self, fn):
        async def call():
            fn()
        self.engine._submit(call()).result()

    def finish(self):
        if self.prof is None:
            return
        import io
        import pstats
        self._in_loop(self.prof.disable)
        buf = io.StringIO()
        stats = pstats.Stats(self.prof, stream=buf)
        stats.sort_stats("cumulative").print_stats(50)
        stats.sort_stats("tottime").print_stats(30)
        with open(self.path, "w") as f:
            f.write(buf.getvalue())


class _DeviceProfile:
    """--profile-device PATH: the torch profiler's device records over the timed run, summarised
    by radixserve.bench.timeline (busy time, the gaps between kernels and where they sit),
    for the whole run and split at the end of the last extend-attention kernel (with the
    engine's prefill-first order: the prefill phase, then the decode phase), as JSON at PATH.
    Not a throughput run (the profiler's callbacks slow the host)."""

    def __init__(self, path):
        self.path, self.prof = path, None
        if path:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()

    def finish(self):
        if self.prof is None:
            return
        from radixserve.bench import timeline
        torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        records = timeline.records_from_profile(self.prof)
        extend_ends = [r.end for r in records if "extend" in r.name]
        cut = max(extend_ends) if extend_ends else None
        out = {"whole": timeline.summarize_records(records)}
        if cut is not None:
            out["prefill_phase"] = timeline.summarize_records([r for r in records if r.end <= cut])
            out["decode_phase"] = timeline.summarize_records([r for r in records if r.start > cut])
        with open(self.path, "w") as f:
            json.dump(out, f, indent=1)


def _hf_model(args, model_path, device, dtype, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.load_format == "dummy":        # the preset's shapes, HF's own random init
        config = AutoConfig.from_pretrained(model_path)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, **kw).eval()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kw).to(device).eval()


def run_hf_generate_batch(args, prompts, model_path):
    """HF transformers' continuous batching (paged attention, sdpa), EOS disabled."""
    from transformers import GenerationConfig

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _hf_model(args, model_path, device, dtype, attn_implementation="sdpa")
    gen_cfg = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    with torch.no_grad():     # not inference_mode: HF's batching thread updates its tensors
        model.generate_batch(inputs=[p[:8] for p in prompts[:2]],
                             generation_config=GenerationConfig(max_new_tokens=4,
                                                                do_sample=False,
                                                                eos_token_id=None,
                                                                pad_token_id=0))
        start = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gen_cfg)
        elapsed = time.perf_counter() - start
    ids = [list(out[k].generated_tokens) for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    assert all(len(t) == args.output_len for t in ids), "HF stopped a sequence early"
    return elapsed, ids


def run_hf(args, prompts, model_path):
    device = torch.device(args.device)
    # the engine's dtype on each device: float32 on the CPU, bfloat16 on CUDA
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _hf_model(args, model_path, device, dtype)
    pad = 0
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kw = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
              pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids[:2, -8:], attention_mask=mask[:2, -8:], **{**kw,
                       "max_new_tokens": 4, "min_new_tokens": 4})          # warm-up
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=mask, **kw)
        elapsed = time.perf_counter() - start
    return elapsed, out[:, width:].tolist()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="radixserve bench offline",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-path", default=None, help="default: the embedded default model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disable-cuda-graph", action="store_true",
                    help="engine decode steps launched eagerly (CUDA graphs are on by default on "
                         "a GPU in bf16)")
    ap.add_argument("--preset", default=None,
                    help="the shapes of `radixserve bench presets` NAME, dummy weights")
    ap.add_argument("--hf-mode", default="generate", choices=["generate", "generate_batch", "none"],
                    help="none: radixserve only, no ratio (quick A/B runs of the engine)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="an engine setting (a `radixserve serve` flag's name with underscores: "
                         "enable_mixed_chunk=true, chunked_prefill_size=16384); repeatable, for "
                         "A/B runs of the engine's settings")
    ap.add_argument("--profile-host", default=None, metavar="PATH",
                    help="cProfile the engine's event-loop thread over the timed run; its top "
                         "functions go to PATH (slows the host side: not a throughput run)")
    ap.add_argument("--profile-device", default=None, metavar="PATH",
                    help="CUDA: the profiler's kernel timeline over the timed run, its busy "
                         "time and gaps as JSON at PATH (radixserve.bench.timeline; not a "
                         "throughput run)")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    if args.profile_device and args.device != "cuda":
        ap.error("--profile-device needs --device cuda")
    try:
        args.engine_args = dict(_engine_arg(a) for a in args.engine_arg)
    except ValueError as e:
        ap.error(str(e))
    return args


def _engine_arg(text: str):
    """'name=value' -> (name, value): true/false as bools, integers and floats as numbers, the
    rest as strings."""
    name, sep, raw = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--engine-arg {text!r}: expected NAME=VALUE")
    low = raw.strip().lower()
    if low in ("true", "false"):
        return name.strip(), low == "true"
    for cast in (int, float):
        try:
            return name.strip(), cast(raw)
        except ValueError:
            pass
    return name.strip(), raw


def _use_preset(args) -> None:
    """--preset NAME: build its directory (in the temp directory) and serve it with dummy weights."""
    import tempfile

    from radixserve.bench.presets import build_preset
    args.model_path = build_preset(args.preset, os.path.join(tempfile.gettempdir(),
                                                              f"preset-{args.preset}"))
    args.load_format = "dummy"


def write_result(args, argv, model_path: str, eng_s: float, hf_s, same, steps) -> None:
    """The numbers, the machine and the command as JSON at args.out (hf_s None: --hf-mode none,
    no HF numbers and no ratio)."""
    num_out = args.num_prompts * args.output_len
    eng_tps = num_out / eng_s
    hf_tps = num_out / hf_s if hf_s else None
    result = {
        "command": "radixserve bench offline " + shlex.join(argv if argv is not None
                                                           else sys.argv[1:]),
        "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "device": args.device,
        "model_path": os.path.basename(os.path.normpath(model_path)),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "radixserve_tok_per_s": round(eng_tps, 2),
        "hf_tok_per_s": round(hf_tps, 2) if hf_tps else None,
        "ratio": round(eng_tps / hf_tps, 3) if hf_tps else None, "radixserve_s": round(eng_s, 3),
        "hf_s": round(hf_s, 3) if hf_s else None, "identical_greedy_outputs": same,
        "hf_mode": args.hf_mode, "preset": args.preset, "engine_args": args.engine_args,
        "radixserve_steps": steps,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")


def main(argv=None) -> None:
    """`radixserve bench offline`: the engine, then HF, on the same prompts; prints the ratio."""
    args = parse_args(argv)
    if args.preset:
        _use_preset(args)
    if args.device == "cpu" and args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)

    from radixserve.config import ModelConfig
    from radixserve.model.loader import resolve_model_path

    model_path = resolve_model_path(args.model_path)
    vocab = ModelConfig.from_path(model_path).vocab_size
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    num_out = args.num_prompts * args.output_len

    eng_s, eng_ids, _, steps = run_engine(args, prompts)
    print(f"radixserve done: {num_out / eng_s:.1f} output tok/s ({eng_s:.2f} s); steps: {steps}",
          flush=True)
    if args.hf_mode == "none":
        if args.out:
            write_result(args, argv, model_path, eng_s, None, None, steps)
        return
    hf_run = run_hf_generate_batch if args.hf_mode == "generate_batch" else run_hf
    hf_s, hf_ids = hf_run(args, prompts, model_path)
    same = (None if args.load_format == "dummy"         # two different random models
            else sum(a == b for a, b in zip(eng_ids, hf_ids)))
    print(f"radixserve: {num_out / eng_s:.1f} output tok/s ({eng_s:.2f} s)")
    print(f"HF {args.hf_mode}: {num_out / hf_s:.1f} output tok/s ({hf_s:.2f} s)")
    print(f"ratio (radixserve / HF): {hf_s / eng_s:.2f}")
    print(f"identical greedy outputs: {same}/{args.num_prompts}")
    if args.out:
        write_result(args, argv, model_path, eng_s, hf_s, same, steps)
