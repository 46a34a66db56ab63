"""The cost of sampling in a CPU decode step, as a share of a greedy decode step, in one process.

On the default model (SmolLM2-135M-Instruct, fp32, vocab 49,152), --batch-size (16) requests of
--prompt-len random token ids decode --steps timed steps (after --warmup) through the real
scheduler and step pipeline (Scheduler.step), once per sampling configuration:

  greedy          temperature 0 (ops.argmax_rows)
  t0.8            temperature 0.8, nothing else (plain sampling)
  t0.8_topk_topp  temperature 0.8, top_k 50, top_p 0.9
  t0.8_minp       temperature 0.8, min_p 0.05
  t0.8_penalties  temperature 0.8, frequency 0.5, presence 0.3, repetition 1.1
  t0.8_all        temperature 0.8, top_k 50, top_p 0.9, min_p 0.05 and the three penalties

every request with its own seed. Each configuration runs on the fast CPU path (`fast`:
sampling/cpu_sampling.py and the sparse penalty update) and, with --paths fast,reference, on the
torch reference (ops/reference.bitmask_sample, which also always computes the logprobs, and
the dense penalty update, PenaltyState.apply_dense), the way every CPU
step sampled before. Measured per step:

  step_ms    wall time of Scheduler.step() (the whole decode step: forward, sampling, host work)
  sample_ms  time inside sampler.sample (on the CPU everything in it runs synchronously)

--rounds (5) rounds run every (path, configuration) in turn, so that other load on the machine
weighs on all alike; reported: the median over rounds and the [min, max] spread of each, and
for each sampled configuration its extra cost as a share of the greedy step of the same round:
  sample_share = (sample_ms - greedy sample_ms) / greedy step_ms
  step_share   = (step_ms - greedy step_ms) / greedy step_ms     (noisier: whole steps)

    PYTHONPATH=pysrc python bench/cpu_sampling.py --paths fast,reference \\
        --output-file bench/results/cpu-sampling.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from typing import Dict, List
from unittest import mock

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
PYSRC = os.path.join(os.path.dirname(BENCH_DIR), "pysrc")
if PYSRC not in sys.path:
    sys.path.insert(0, PYSRC)

import radixserve  # noqa: E402,F401  (before torch: the process's OpenMP wait policy)
import torch  # noqa: E402

from radixserve.bench.launcher import source_revision  # noqa: E402

PENALTIES = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)
CONFIGS: Dict[str, Dict] = {
    "greedy": dict(temperature=0.0),
    "t0.8": dict(temperature=0.8),
    "t0.8_topk_topp": dict(temperature=0.8, top_k=50, top_p=0.9),
    "t0.8_minp": dict(temperature=0.8, min_p=0.05),
    "t0.8_penalties": dict(temperature=0.8, **PENALTIES),
    "t0.8_all": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, **PENALTIES),
}


@contextlib.contextmanager
def sampling_path(path: str):
    """`fast`: the code as it is; `reference`: CPU steps sample with reference.bitmask_sample and
    update penalties densely (what every CPU step did before cpu_sampling.py)."""
    if path == "fast":
        yield
        return
    from radixserve.ops import reference as ref
    from radixserve.sampling import cpu_sampling
    from radixserve.sampling.penalties import PenaltyState
    def reference_sample(*args, want_logprobs=True):
        return ref.bitmask_sample(*args)      # it always computes the logprobs

    with mock.patch.object(cpu_sampling, "bitmask_sample", reference_sample), \
            mock.patch.object(PenaltyState, "apply", PenaltyState.apply_dense):
        yield


class SampleTimer:
    """Wraps sampler.sample (the runner calls it through the module): seconds spent inside."""

    def __init__(self):
        from radixserve.sampling import sampler
        self.sampler, self.inner, self.seconds = sampler, sampler.sample, 0.0

    def __enter__(self):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return self.inner(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
        self.sampler.sample = timed
        return self

    def __exit__(self, *exc):
        self.sampler.sample = self.inner


def make_scheduler(model_path, config, model, args):
    from radixserve.config import ServerArgs
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.runner import ModelRunner

    sa = ServerArgs(model_path=model_path, device="cpu",
                    max_total_tokens=args.batch_size * (args.prompt_len + args.steps
                                                        + args.warmup + 8) + 1024,
                    max_running_requests=args.batch_size,
                    context_length=args.prompt_len + args.steps + args.warmup + 64)
    return Scheduler(sa, ModelRunner(sa, config, model_path, context_len=sa.context_length,
                                     model=model))


def measure(sched, params: Dict, args, round_index: int) -> Dict:
    """Prefill batch_size requests, run warmup decode steps, time `steps` decode steps."""
    from radixserve.engine.req import Req
    from radixserve.sampling.params import SamplingParams

    rng = random.Random(1000 + round_index)
    n_new = args.steps + args.warmup + 4
    reqs = []
    for i in range(args.batch_size):
        prompt = [rng.randrange(256, sched.vocab_size) for _ in range(args.prompt_len)]
        sp = SamplingParams(max_new_tokens=n_new, ignore_eos=True, seed=7919 * i + round_index,
                            **params)
        reqs.append(Req(f"r{round_index}-{i}", prompt, sp, n_new))
    for r in reqs:
        sched.add_request(r)
    while len(sched.running) < args.batch_size:
        sched.step()
    for _ in range(args.warmup):
        sched.step()
    steps0 = sched.counters["num_decode_steps"]
    with SampleTimer() as timer:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            sched.step()
        wall = time.perf_counter() - t0
    steps = sched.counters["num_decode_steps"] - steps0
    for r in reqs:
        sched.abort(r.rid)
    while sched.has_work():
        sched.step()
    return {"step_ms": 1e3 * wall / max(steps, 1),
            "sample_ms": 1e3 * timer.seconds / max(args.steps, 1), "decode_steps": steps}


def spread(values: List[float]) -> Dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--paths", default="fast", help="fast, reference or fast,reference")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = args.paths.split(",")
    configs = args.configs.split(",")
    if "greedy" not in configs:
        configs.insert(0, "greedy")

    from radixserve.config import ModelConfig
    from radixserve.model.default_model import default_model_path
    from radixserve.model.loader import load_model

    model_path = default_model_path()
    config = ModelConfig.from_path(model_path)
    model = load_model(model_path, config, "auto", torch.float32, torch.device("cpu"))
    scheds = {name: make_scheduler(model_path, config, model, args) for name in configs}
    raw: Dict[str, Dict[str, List[Dict]]] = {pa: {c: [] for c in configs} for pa in paths}
    load_before = os.getloadavg()
    for k in range(args.rounds):
        for pa in paths:
            with sampling_path(pa):
                for name in configs:
                    r = measure(scheds[name], CONFIGS[name], args, k)
                    raw[pa][name].append(r)
                    print(f"round {k + 1} {pa:9s} {name:15s} step {r['step_ms']:7.2f} ms  "
                          f"sample {r['sample_ms']:6.2f} ms", flush=True)
    results: Dict[str, Dict] = {}
    for pa in paths:
        greedy = raw[pa]["greedy"]
        res = {}
        for name in configs:
            rs = raw[pa][name]
            entry = {"step_ms": spread([r["step_ms"] for r in rs]),
                     "sample_ms": spread([r["sample_ms"] for r in rs])}
            if name != "greedy":
                entry["sample_share_of_greedy_step"] = spread(
                    [(r["sample_ms"] - g["sample_ms"]) / g["step_ms"] for r, g in zip(rs, greedy)])
                entry["step_share_of_greedy_step"] = spread(
                    [(r["step_ms"] - g["step_ms"]) / g["step_ms"] for r, g in zip(rs, greedy)])
            res[name] = entry
        results[pa] = res
    print(f"\n{'path':9s} {'config':15s} {'step ms':>18s} {'sample ms':>18s} "
          f"{'sample share':>20s} {'step share':>20s}")
    for pa, res in results.items():
        for name, e in res.items():
            def fmt(s, pct=False):
                f = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:.2f}")
                return f"{f(s['median'])} [{f(s['min'])}, {f(s['max'])}]"
            line = f"{pa:9s} {name:15s} {fmt(e['step_ms']):>18s} {fmt(e['sample_ms']):>18s}"
            if "sample_share_of_greedy_step" in e:
                line += (f" {fmt(e['sample_share_of_greedy_step'], True):>20s}"
                         f" {fmt(e['step_share_of_greedy_step'], True):>20s}")
            print(line)
    out = {
        "command": "python bench/cpu_sampling.py " + shlex.join(sys.argv[1:] if argv is None
                                                                 else argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "source": source_revision(),
        "machine": {"processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "model": model_path,
        "workload": {"batch_size": args.batch_size, "prompt_len": args.prompt_len,
                     "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                     "configs": {c: CONFIGS[c] for c in configs}},
        "results": results,
        "raw": raw,
        "loadavg_1_5_15min": {"before": load_before, "after": os.getloadavg()},
    }
    if args.output_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_file)), exist_ok=True)
        with open(args.output_file, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        print(f"wrote {args.output_file}")
    return out


if __name__ == "__main__":
    main()
