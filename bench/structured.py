"""Structured output: jump-forward on vs off, and the grammar's share of a decode step.

One radixserve.Engine (in process), a flat JSON schema of --num-fields fields (integers,
short strings, booleans under fixed keys: most of the output is decided by the schema):
  1. per request, one at a time, greedy, --num-requests each way: forward passes (the engine's
     prefill + decode steps) and latency, jump-forward on vs off (the scheduler's switch,
     flipped between runs in the same process); every output is validated against the schema;
  2. decode step time at --batch-size concurrent requests, all constrained by the schema (jump
     off, so every step is a decode) vs all free (same prompts, EOS ignored): the median interval
     between consecutive decode results at full batch. The grammar's share of a step is
     (constrained - free) / constrained; the host time filling the masks is reported beside it
     (it runs while the device computes the forward);
  3. compile time and cache hits of the repeated schema.
Marks (issue 11): >= 2x fewer forward passes and >= 1.8x lower latency with jump-forward; the
grammar's share of a decode step at batch 64 on the H200 <= 5%.

    python bench/structured.py --out bench/results/structured-cpu.json
    python bench/structured.py --device cuda --preset llama-3.1-8b --batch-size 64 \
        --out bench/results/structured-h200-8b.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import radixserve  # noqa: F401


def flat_schema(num_fields: int) -> dict:
    kinds = [{"type": "integer", "minimum": 0, "maximum": 999},
             {"type": "string", "maxLength": 8}, {"type": "boolean"}]
    props = {f"field_{i:02d}": kinds[i % 3] for i in range(num_fields)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


class StepClock:
    """Wraps the scheduler's result processing and mask filling to time them (loop thread)."""

    def __init__(self, sched):
        self.sched = sched
        self.results = []         # (perf_counter, mode name, batch size)
        self.fill_s = []
        process, fill = sched.process_batch_result, sched.grammar_bitmask

        def timed_process(batch, out):
            self.results.append((time.perf_counter(), batch.mode.name, batch.batch_size))
            return process(batch, out)

        def timed_fill(batch):
            t0 = time.perf_counter()
            mask = fill(batch)
            self.fill_s.append(time.perf_counter() - t0)
            return mask
        sched.process_batch_result, sched.grammar_bitmask = timed_process, timed_fill

    def reset(self):
        self.results, self.fill_s = [], []

    def decode_period(self, batch_size: int) -> float:
        """Median interval between consecutive decode results at batch_size."""
        gaps = [b[0] - a[0] for a, b in zip(self.results, self.results[1:])
                if a[1] == b[1] == "DECODE" and a[2] == b[2] == batch_size]
        return statistics.median(gaps) if gaps else float("nan")


def per_request(engine, clock, prompt_ids, schema, jump: bool, n: int, max_new: int):
    import jsonschema

    sched = engine.async_engine.scheduler
    sched.jump_forward = jump
    sp = {"json_schema": json.dumps(schema), "max_new_tokens": max_new, "temperature": 0}
    rows = []
    for _ in range(n):
        before = dict(sched.counters)
        t0 = time.perf_counter()
        out = engine.generate(input_ids=prompt_ids, sampling_params=sp)
        latency = time.perf_counter() - t0
        steps = (sched.counters["num_prefill_steps"] - before["num_prefill_steps"]
                 + sched.counters["num_decode_steps"] - before["num_decode_steps"])
        # strict=False: xgrammar's JSON strings admit control characters such as a raw tab
        jsonschema.validate(json.loads(out["text"], strict=False), schema)
        rows.append({"latency_s": latency, "forward_passes": steps,
                     "output_tokens": out["meta_info"]["completion_tokens"]})
    return {"latency_s": statistics.median(r["latency_s"] for r in rows),
            "forward_passes": statistics.median(r["forward_passes"] for r in rows),
            "output_tokens": statistics.median(r["output_tokens"] for r in rows), "runs": rows}


def batch_step(engine, clock, prompt_ids, schema, batch_size: int, max_new: int, constrained: bool):
    sched = engine.async_engine.scheduler
    sched.jump_forward = False
    sp = {"max_new_tokens": max_new, "temperature": 0}
    if constrained:
        sp["json_schema"] = json.dumps(schema)
    else:
        sp["ignore_eos"] = True
    clock.reset()
    engine.generate(input_ids=[prompt_ids] * batch_size, sampling_params=sp)
    fills = clock.fill_s
    return {"step_s": clock.decode_period(batch_size),
            "mask_fill_s": statistics.median(fills) if fills else 0.0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-path", default=None, help="default: the embedded default model")
    ap.add_argument("--preset", default=None, help="bench/presets.py shapes, dummy weights")
    ap.add_argument("--num-fields", type=int, default=40)
    ap.add_argument("--num-requests", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batch-new-tokens", type=int, default=96,
                    help="tokens per request in the batch-step part")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    overrides = {"device": args.device, "max_running_requests": max(args.batch_size, 8)}
    model_path = args.model_path
    if args.preset:
        import tempfile

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from presets import build_preset

        model_path = build_preset(args.preset, tempfile.mkdtemp(prefix="radixserve-preset-"))
        overrides["load_format"] = "dummy"
    overrides["max_total_tokens"] = args.batch_size * (256 + args.batch_new_tokens) + 4 * 2048
    engine = radixserve.Engine(model_path, **overrides)
    try:
        clock = StepClock(engine.async_engine.scheduler)
        schema = flat_schema(args.num_fields)
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content":
                                                "Fill in the record as JSON."}]) \
            if engine.tokenizer.has_chat_template else engine.tokenizer.encode("JSON record:")
        grammars = engine.async_engine.grammars
        t0 = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params={"json_schema": json.dumps(schema),
                                                           "max_new_tokens": 4})   # compiles
        first_s = time.perf_counter() - t0
        on = per_request(engine, clock, prompt, schema, True, args.num_requests, args.max_new_tokens)
        off = per_request(engine, clock, prompt, schema, False, args.num_requests,
                          args.max_new_tokens)
        free = batch_step(engine, clock, prompt, schema, args.batch_size, args.batch_new_tokens, False)
        cons = batch_step(engine, clock, prompt, schema, args.batch_size, args.batch_new_tokens, True)
        result = {
            "jump_on": on, "jump_off": off,
            "forward_pass_ratio": off["forward_passes"] / on["forward_passes"],
            "latency_ratio": off["latency_s"] / on["latency_s"],
            "batch_size": args.batch_size,
            "free_step_s": free["step_s"], "constrained_step_s": cons["step_s"],
            "grammar_share_of_step": (cons["step_s"] - free["step_s"]) / cons["step_s"],
            "mask_fill_s_per_step": cons["mask_fill_s"],
            "first_request_with_compile_s": first_s,
            "grammar_stats": dict(grammars.stats),
        }
    finally:
        engine.shutdown()
    out = {"command": "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
           "device": args.device, "preset": args.preset, "num_fields": args.num_fields,
           "host": platform.node(), "result": result}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
