"""Speculative decoding (--speculative-algorithm ngram): speed on a copy-heavy workload, and the
cost of a verify step against a decode step, in one process.

    python bench/spec_decode.py --model-path MODEL.gguf --device cuda --out spec.json
    python bench/spec_decode.py --preset llama-3.1-8b --out spec-8b.json

--model-path (issue 39's copy workload, real weights): prompts built from real text shipped in
this repository (its own Python sources and docs): (a) "repeat this file with one name
changed", (b) "answer with the exact sentences of this document that mention X". Each prompt
runs greedy (temperature 0, the model's own end of text, at most --max-new-tokens) through the
offline Engine, one request at a time (concurrency 1) and four at a time (concurrency 4), with
speculation off and on, the same prompts in the same order. Reported per concurrency: output
tokens, seconds, output tok/s, on/off speed ratio, verify steps, draft tokens, accepted tokens,
mean accept length (tokens a request gains per verify step) and whether each output equals
the unspeculated one (they must on the CPU; on a GPU in bf16 a near-tie may flip one).

--preset NAME (a bench preset with dummy weights, e.g. llama-3.1-8b): the step cost. B requests
decode (random prompts of --prompt-len); with speculation off each step is a decode step of B
rows, with it on (and its acceptance gate held open, so every step verifies a full draft) each
step is a verify step of B x (k + 1) rows, k = --num-draft-tokens - 1. Each runs the serial
loop and the overlapped loop (where a verify step is scheduled while the one before it runs).
Reported: ms per step of each, and cost = verify / decode, overlapped (and serial). With a
measured accept length a (from the copy workload), the speedup a verify step gives is
(1 + a) / cost at that batch size.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "pysrc"))


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def copy_workload() -> List[List[Dict[str, str]]]:
    """Chat conversations whose answers copy from the prompt (real text of this repository)."""
    convs = []
    files = [("pysrc/radixserve/engine/spec/ngram.py", "propose", "suggest"),
             ("pysrc/radixserve/model/staging.py", "add", "append"),
             ("pysrc/radixserve/sampling/params.py", "number_problem", "bad_number"),
             ("pysrc/radixserve/engine/scheduler/fairness.py", "share", "quota")]
    for path, old, new in files:
        code = _read(path)
        code = code[:2400]                      # a screenful: the answer fits --max-new-tokens
        convs.append([{"role": "user", "content":
                       f"Here is a Python file:\n```python\n{code}\n```\nRewrite the file "
                       f"exactly, with every `{old}` renamed to `{new}`. Output only the code."}])
    doc = _read("docs/ARCHITECTURE.md")
    paras = [p for p in doc.split("\n\n") if len(p) > 300][:12]
    for i, topic in enumerate(("KV", "graph", "request", "sampling")):
        text = "\n\n".join(paras[i * 3:i * 3 + 3])
        convs.append([{"role": "user", "content":
                       f"Document:\n{text}\n\nQuote, word for word, every sentence of the "
                       f"document that mentions {topic}. Output only the quoted sentences."}])
    return convs


def run_copy(args) -> Dict[str, Any]:
    from radixserve.offline import Engine

    convs = copy_workload()
    out: Dict[str, Any] = {"workload": "copy: 4 rename-a-name code files + 4 quote-the-"
                           "document prompts (this repository's own text), greedy",
                           "max_new_tokens": args.max_new_tokens, "runs": {}}
    texts = {}
    for spec in (False, True):
        kw = dict(device=args.device, disable_radix_cache=True)
        if args.dtype:
            kw["dtype"] = args.dtype
        if spec:
            kw.update(speculative_algorithm="ngram",
                      speculative_num_draft_tokens=args.num_draft_tokens)
        eng = Engine(None if args.model_path == "default" else args.model_path, **kw)
        try:
            ids = [eng.tokenizer.encode(eng.tokenizer.apply_chat_template(
                c, add_generation_prompt=True)) for c in convs]
            sp = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
            eng.generate(input_ids=ids[0], sampling_params=dict(sp, max_new_tokens=8))  # warm
            for conc in (1, 4):
                before = dict(eng.async_engine.scheduler.counters)
                t0 = time.perf_counter()
                res = []
                for i in range(0, len(ids), conc):
                    part = ids[i:i + conc]
                    got = eng.generate(input_ids=part, sampling_params=sp)
                    res += got if isinstance(got, list) else [got]
                dt = time.perf_counter() - t0
                c = eng.async_engine.scheduler.counters
                d = {k: c[k] - before.get(k, 0) for k in c if k.startswith("spec_")}
                toks = sum(len(r["output_ids"]) for r in res)
                row = {"output_tokens": toks, "seconds": dt, "tok_per_s": toks / dt, **d}
                if d.get("spec_verify_reqs"):
                    row["accept_length"] = (d["spec_accepted_tokens"] + d["spec_verify_reqs"]) \
                        / d["spec_verify_reqs"]
                out["runs"][f"{'on' if spec else 'off'}_c{conc}"] = row
                texts[(spec, conc)] = [r["output_ids"] for r in res]
                print(f"spec {'on ' if spec else 'off'} concurrency {conc}: {toks} tokens "
                      f"{dt:.2f} s {toks / dt:.1f} tok/s"
                      + (f", accept length {row['accept_length']:.2f}"
                         if "accept_length" in row else ""), flush=True)
        finally:
            eng.shutdown()
    for conc in (1, 4):
        on, off = out["runs"][f"on_c{conc}"], out["runs"][f"off_c{conc}"]
        on["speedup_vs_off"] = on["tok_per_s"] / off["tok_per_s"]
        on["outputs_equal_off"] = sum(a == b for a, b in zip(texts[(True, conc)],
                                                             texts[(False, conc)]))
        print(f"concurrency {conc}: on/off {on['speedup_vs_off']:.2f}x, "
              f"{on['outputs_equal_off']}/{len(convs)} outputs equal", flush=True)
    # the control: speculation off at concurrency 1 vs 4 (the same greedy requests, batched
    # differently); where these differ too, the on/off differences are the dtype's near-ties
    # under a different batch shape, not speculation
    out["off_c1_equal_off_c4"] = sum(a == b for a, b in zip(texts[(False, 1)],
                                                           texts[(False, 4)]))
    print(f"control: off concurrency 1 vs 4, {out['off_c1_equal_off_c4']}/{len(convs)} outputs "
          f"equal", flush=True)
    return out


def run_cost(args) -> Dict[str, Any]:
    import torch

    from radixserve.bench.presets import build_preset
    from radixserve.config import ModelConfig, ServerArgs
    from radixserve.engine.req import Req
    from radixserve.engine.scheduler import Scheduler
    from radixserve.engine.scheduler import spec as spec_mod
    from radixserve.model.runner import ModelRunner
    from radixserve.sampling.params import SamplingParams

    path = build_preset(args.preset, os.path.join("/tmp", "spec-preset-" + args.preset))
    config = ModelConfig.from_path(path)
    # every step verifies a full draft of k tokens (dummy weights' outputs repeat nothing, so
    # the n-gram index would find none, and accept nothing): the drafter proposes k copies of
    # the last token, the gates are held open. The step's cost does not depend on acceptance.
    spec_mod.MIN_ACCEPT = -1.0
    spec_mod.RateGate.allow = lambda self, *args: True
    spec_mod.SpecDecoder.draft = \
        lambda self, req, extra=(), unknown=False, miss_cooldown=0: [req.fill_ids[-1]] * k
    k = args.num_draft_tokens - 1
    out: Dict[str, Any] = {"preset": args.preset, "k": k, "rows": {}}
    model = None
    for bs in args.batch_sizes:
        row: Dict[str, float] = {}
        for name, kw in (("decode_serial", dict(disable_overlap_schedule=True)),
                         ("decode_overlap", {}),
                         ("verify_serial", dict(
                             speculative_algorithm="ngram",
                             speculative_num_draft_tokens=args.num_draft_tokens)),
                         ("verify", dict(speculative_algorithm="ngram",
                                         speculative_num_draft_tokens=args.num_draft_tokens))):
            # the verify rows: serial (no step in flight) and overlapped, forced either way
            if name.startswith("verify"):
                kw = dict(kw, debug_spec_overlap="on" if name == "verify" else "off")
            sargs = ServerArgs(model_path=path, load_format="dummy", device="cuda",
                               max_running_requests=max(64, bs), context_length=4096, **kw)
            runner = ModelRunner(sargs, config, path, context_len=4096, model=model)
            model = runner.model
            sched = Scheduler(sargs, runner)
            rng = random.Random(bs)
            unit = [rng.randrange(100, config.vocab_size) for _ in range(16)]
            n = args.warmup + args.steps + 8
            for i in range(bs):
                prompt = (unit * (args.prompt_len // 16 + 1))[:args.prompt_len]
                sched.add_request(Req(f"c{i}", prompt, SamplingParams(
                    max_new_tokens=n * (k + 1), temperature=0.0, ignore_eos=True), n * (k + 1)))
            while any(r.status.name != "RUNNING" for r in sched.reqs.values()):
                sched.step()
            for _ in range(args.warmup):
                sched.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            v0 = sched.counters.get("spec_verify_steps", 0)
            for _ in range(args.steps):
                sched.step()
            torch.cuda.synchronize()
            row[name + "_ms"] = (time.perf_counter() - t0) / args.steps * 1e3
            if name.startswith("verify"):
                row[name + "_steps"] = sched.counters["spec_verify_steps"] - v0
            for r in list(sched.reqs):
                sched.abort(r)
            while sched.has_work():
                sched.step()
            del sched, runner
        row["cost_verify_over_decode"] = row["verify_ms"] / row["decode_overlap_ms"]
        row["cost_verify_over_decode_serial"] = row["verify_serial_ms"] / row["decode_serial_ms"]
        out["rows"][str(bs)] = row
        print(f"batch {bs}: decode {row['decode_serial_ms']:.2f} ms serial, "
              f"{row['decode_overlap_ms']:.2f} ms overlap; verify of {k + 1} rows each "
              f"{row['verify_serial_ms']:.2f} ms serial, {row['verify_ms']:.2f} ms overlap "
              f"({row['verify_steps']}/{args.steps} verify steps); cost "
              f"{row['cost_verify_over_decode']:.3f} overlapped, "
              f"{row['cost_verify_over_decode_serial']:.3f} serial", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None,
                    help="the copy workload's model (`default`: the embedded default model)")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-new-tokens", type=int, default=400)
    ap.add_argument("--dtype", default=None,
                    help="the copy workload's model dtype (e.g. float32: no near-ties)")
    ap.add_argument("--num-draft-tokens", type=int, default=5)
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 4])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if (args.model_path is None) == (args.preset is None):
        ap.error("give exactly one of --model-path (copy workload) or --preset (step cost)")
    result = run_copy(args) if args.model_path else run_cost(args)
    import torch

    result["command"] = "python " + " ".join(sys.argv)
    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
