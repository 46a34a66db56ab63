"""`radixserve bench serving`: a serving load generator in the manner of SGLang's bench_serving.
It streams requests at a running server, radixserve or any other with SGLang's /generate or
OpenAI's /v1/completions and /v1/chat/completions (SGLang, vLLM: nothing it does needs a
radixserve route unless asked), and reports TTFT / TPOT / ITL / end-to-end latency statistics,
request and token throughput and the cache hit rate, under SGLang's key names (metrics.py).

Prompts are token ids (decoded once to text for --backend chat), so lengths are exact.

Backends (backends.py): generate (POST /generate, the default), completions (POST
/v1/completions, token-id prompts), chat (POST /v1/chat/completions, text prompts; needs a
tokenizer). The model name, vocabulary and tokenizer come from /v1/models, --vocab-size or
--tokenizer (discovery.py).

Datasets
  random                   --random-input-len, --random-output-len, --random-range-ratio: the
                           lengths SGLang's bench_serving draws for the same --seed (default
                           range ratio 0.0: inputs uniform in [1, len], outputs in [0, len];
                           1.0: fixed lengths); workloads.py says how
  generated-shared-prefix  --gsp-num-groups groups of --gsp-prompts-per-group prompts; each prompt is
                           its group's system prompt (--gsp-system-prompt-len) + a question
                           (--gsp-question-len); --gsp-output-len new tokens; --gsp-order
  multi-turn               --num-prompts conversations of --mt-turns turns; turn k's prompt is turn
                           k-1's prompt + its answer + a new message, sent when turn k-1 returns

Arrivals: --request-rate (Poisson, requests/s; inf = all at once; the gaps SGLang's client
draws for the same --seed) and/or --max-concurrency. The workload's token totals are printed
before the run and kept under "workload" in the result.
Before the run, --warmup-requests (1) short unrelated requests go through the same route; then
POST /flush_cache empties the server's prefix cache when --flush-cache, which is the default only
for servers this command launched and for --backend generate (SGLang's native API has the
route); --no-flush-cache turns it off.

--compare NAME launches radixserve itself (`python -m radixserve.launch_server` on a free port,
one configuration after another), runs the same workload against each, and reports throughput and
mean TTFT / ITL ratios from that one run. NAME radix (the default): radix cache + fcfs,
--disable-radix-cache, radix cache + lpm; NAME overlap: overlap scheduling,
--disable-overlap-schedule; NAME schedule: the server's step order (one prefill step, one
decode step), --enable-mixed-chunk (decodes ride in the prefill's forward), --step-order
prefill-first (SGLang's order); NAME engine-process: --engine-process (the engine in a process
of its own) against one process. --launch does the same for one server; --preset NAME serves
the model directory of `radixserve bench presets NAME` with --load-format dummy.
--sweep-concurrency 1,2,4,... runs the workload at each max-concurrency.

--output-file X.jsonl appends one JSON line per run (per configuration and concurrency level), as
SGLang's bench_serving does; any other name (X.json) gets the whole result as one JSON document
(with per-request TTFT and ITL lists). Either way the PNG plots of plots.py go next to it.
Against radixserve each run also records "server_steps", the server's own step counters over
the run (device busy fraction, decode steps and their mean device time, idle before decode
steps; server_steps.py), which say whether a run was bound by the kernels or by the host loop,
and issue 33's latency ratios: the median ITL over the decode step a token waited for, and the
duration over the floor-bound duration of the run's own arrival schedule (each request's send
time + its output tokens x the server's measured batch-1 weight floor; GPU servers only), and
over its memory-bound duration (the same schedule on an ideal server whose every step also reads
the running requests' KV cache: roofline.py, from the server's weight and KV bytes).

Failed requests (an HTTP error, an error chunk, an abort, a stream without a finish reason, fewer
tokens than asked under ignore_eos: backends.py) are counted per reason in the summary
("failure_reasons", "error_samples"); any failure makes the command exit 1 (after the result is
written) unless --allow-failures.

Examples (see bench/README.md):
  radixserve bench serving --port 30000 --dataset random --num-prompts 64 --request-rate 8
  radixserve bench serving --port 8000 --backend completions --tokenizer MODEL_DIR \\
      --dataset random --output-file peer.jsonl          # a vLLM or SGLang server
  radixserve bench serving --compare --dataset generated-shared-prefix --output-file out.json
  radixserve bench serving --preset llama-3.1-8b --compare overlap --dataset random \\
      --sweep-concurrency 1,2,4,8,16,32,64,128,256 --output-file out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
from typing import Dict, List, NamedTuple, Optional, Tuple

import httpx
from tqdm.asyncio import tqdm

from radixserve.bench import BenchError, RequestsFailed, server_steps
from radixserve.bench.backends import BACKENDS, RequestResult, auth_headers, send, session
from radixserve.bench.discovery import ServerFacts, discover
from radixserve.bench.launcher import (LaunchedServer, free_port, radixserve_command,
                                       source_revision, stop_servers_on_sigterm)
from radixserve.bench.metrics import (finite, pair_ratios, print_metrics, ratio, summarize,
                                      to_json)
from radixserve.bench.workloads import (BenchRequest, Conversation, Workload, add_text,
                                        build_workload, describe, describe_line, head, size,
                                        token_range)

try:                                   # the client's loop: uvloop (backends.session says why)
    from uvloop import run as run_async
except ImportError:                    # an older uvloop: the stdlib loop
    run_async = asyncio.run

__all__ = ["BenchRequest", "Conversation", "RequestResult", "Runner", "summarize", "ratio",
           "pair_ratios", "to_json", "parse_args", "main"]


# ----------------------------------------------------------------------------- the run

class Runner:
    """Sends a workload with the configured arrival process and concurrency limit."""

    def __init__(self, args, base_url: str, model: str, max_concurrency: Optional[int] = None):
        """max_concurrency: requests in flight at most (default: --max-concurrency; None: no cap)."""
        self.args = args
        self.base_url = base_url
        self.model = model
        limit = max_concurrency or args.max_concurrency
        self.sem = asyncio.Semaphore(limit) if limit else None

    async def send(self, client, req: BenchRequest) -> RequestResult:
        """req through client (self.client()), within the concurrency limit."""
        call = send(client, self.base_url, self.args.backend, req, self.model,
                    not self.args.disable_ignore_eos)
        if self.sem is None:
            return await call
        async with self.sem:
            return await call

    @staticmethod
    async def _arrivals(items):
        """Each item, then a wait of its gap (the order of SGLang's get_request), except after
        the last one."""
        for i, item in enumerate(items):
            yield item
            if item.gap and i + 1 < len(items):
                await asyncio.sleep(item.gap)

    def client(self):
        """The streaming session (backends.session) of one run."""
        return session(self.args.request_timeout)

    async def run(self, workload: Workload) -> Dict:
        """Send workload once (a tqdm bar unless --disable-tqdm); its metrics (summarize)."""
        requests, conversations = workload
        results: List[RequestResult] = []
        total = len(requests) if requests is not None else len(conversations) * self.args.mt_turns
        pbar = None if self.args.disable_tqdm else tqdm(total=total)
        async with self.client() as client:

            async def one(req: BenchRequest):
                results.append(await self.send(client, req))
                if pbar:
                    pbar.update(1)

            async def conversation(conv: Conversation):
                history: List[int] = []
                for message in conv.messages:
                    prompt = history + message
                    r = await self.send(client, BenchRequest(prompt, conv.output_len))
                    results.append(r)
                    if pbar:
                        pbar.update(1)
                    if not r.success:
                        return
                    history = prompt + r.output_ids

            start = time.perf_counter()
            tasks = []
            items = requests if requests is not None else conversations
            work = one if requests is not None else conversation
            async for item in self._arrivals(items):
                tasks.append(asyncio.create_task(work(item)))
            await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
        if pbar:
            pbar.close()
        return summarize(results, duration, start)


async def benchmark_once(args, base_url: str, workload: Workload, facts: ServerFacts,
                         max_concurrency: Optional[int] = None) -> Dict:
    """Run workload once against base_url; its metrics (summarize), with "server_steps": the
    server's own step counters over the run (server_steps.py) when it is radixserve, else
    None."""
    ours = (facts.info.get("model_card") or {}).get("owned_by") == "radixserve"
    before = await server_steps.scrape(base_url) if ours else None
    metrics = await Runner(args, base_url, facts.model, max_concurrency).run(workload)
    after = await server_steps.scrape(base_url) if before is not None else None
    steps = server_steps.over_run(before, after, metrics["duration"])
    if steps is not None:
        steps.update(server_steps.latency_ratios(metrics, steps))
    metrics["server_steps"] = steps
    return metrics


async def warm_up(args, base_url: str, facts: ServerFacts, flush: bool) -> None:
    """--warmup-requests short unrelated requests (first-call overheads) through the benchmark's
    own route, then, when flush, an empty cache. BenchError when every warm-up request fails."""
    lo, hi = token_range(args, facts.vocab_size)
    req = BenchRequest([random.Random(-1).randrange(lo, hi) for _ in range(32)], 4)
    if args.backend == "chat":
        add_text([req], facts.tokenizer)
    runner = Runner(args, base_url, facts.model)
    async with runner.client() as client:
        results = [await runner.send(client, req) for _ in range(args.warmup_requests)]
    if results and not any(r.success for r in results):
        raise BenchError(f"the warm-up request failed ({results[0].error}); check --backend, "
                         f"--model and the server")
    if flush:
        await flush_cache(base_url)


async def flush_cache(base_url: str) -> None:
    """POST /flush_cache (the server must be idle), so no run reuses an earlier run's KV."""
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(base_url + "/flush_cache", headers=auth_headers())
        if r.status_code != 200:
            raise BenchError(f"POST {base_url}/flush_cache answered {r.status_code}: "
                             f"{r.text[:200]}; pass --no-flush-cache for a server without it")


def wants_flush(args, launched: bool) -> bool:
    """--flush-cache / --no-flush-cache, else on for launched servers and --backend generate."""
    if args.flush_cache is not None:
        return args.flush_cache
    return launched or args.backend == "generate"


def run_sweep(args, base_url: str, workload: Workload, facts: ServerFacts,
              flush: bool) -> List[Dict]:
    """The workload at each --sweep-concurrency level (the cache flushed before each when
    flush); one point (max_concurrency, num_requests and the metrics) per level. With
    --sweep-prompts-per-concurrency K, level c sends the first c * K requests of the workload."""
    points = []
    total = size(workload)
    print(f"{'concurrency':>11} {'requests':>9} {'out tok/s':>11} {'mean TTFT ms':>13} "
          f"{'mean ITL ms':>12} {'failed':>7}")
    for c in args.sweep_concurrency:
        n = min(total, c * args.sweep_prompts_per_concurrency) \
            if args.sweep_prompts_per_concurrency else total
        if flush:
            run_async(flush_cache(base_url))
        m = run_async(benchmark_once(args, base_url, head(workload, n), facts,
                                     max_concurrency=c))
        points.append({"max_concurrency": c, "num_requests": n, **m})
        print(f"{c:>11} {n:>9} {m['output_throughput']:>11.1f} "
              f"{m['mean_ttft_ms']:>13.1f} {m['mean_itl_ms']:>12.2f} {m['failed']:>7}")
    return points


def _workload(args, facts: ServerFacts, token_limit: Optional[int] = None) -> Workload:
    """build_workload for the server's vocabulary (below token_limit); its totals printed."""
    vocab = facts.vocab_size if token_limit is None else min(token_limit, facts.vocab_size)
    try:
        workload = build_workload(args, vocab, facts.tokenizer)
    except ValueError as e:
        raise BenchError(str(e)) from e
    print(describe_line(describe(args, workload)), flush=True)
    return workload


def run_running(args) -> Dict:
    """Against the server at --base-url (or --host/--port): {"server", "workload" (describe),
    "metrics" | "sweep"}."""
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    facts = run_async(discover(base_url, args))
    workload = _workload(args, facts)
    flush = wants_flush(args, launched=False)
    run_async(warm_up(args, base_url, facts, flush))
    out: Dict = {"server": facts.record(), "workload": describe(args, workload)}
    if args.sweep_concurrency:
        out["sweep"] = {"default": run_sweep(args, base_url, workload, facts, flush)}
    else:
        out["metrics"] = run_async(benchmark_once(args, base_url, workload, facts))
        print_metrics(args.dataset, out["metrics"])
    return out


# ----------------------------------------------------------------------------- launched servers

# --compare NAME: the server configurations run in turn (extra launch_server flags each) ...
COMPARE_SETS: Dict[str, List[Tuple[str, List[str]]]] = {
    "radix": [("radix-fcfs", []),
              ("no-radix-fcfs", ["--disable-radix-cache"]),
              ("radix-lpm", ["--schedule-policy", "lpm"])],
    "overlap": [("overlap", []),
                ("no-overlap", ["--disable-overlap-schedule"])],
    "schedule": [("alternate", []),
                 ("mixed-chunk", ["--enable-mixed-chunk"]),
                 ("prefill-first", ["--step-order", "prefill-first"])],
    # issue 35: FP8 weights quantized at load (W8A8 prefill/large batches, FP8-weight skinny
    # GEMMs at small ones), then with the FP8 KV cache too, against bf16
    "fp8": [("bf16", []),
            ("fp8", ["--quantization", "fp8"]),
            ("fp8-kv", ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"])],
    # the engine's thread switch interval (engine/async_engine.SWITCH_INTERVAL_US) against
    # CPython's own 5 ms
    "switch": [("switch-200us", []),
               ("switch-5ms", ["--debug-switch-interval-us", "5000"])],
    # the engine in a process of its own (--engine-process) against one process
    "engine-process": [("engine-process", ["--engine-process"]),
                       ("one-process", ["--no-engine-process"])],
    # issue 39: n-gram speculation on a workload it cannot help (its gates must keep it off)
    "spec": [("spec-off", []),
             ("spec-ngram", ["--speculative-algorithm", "ngram"])],
}
# ... and the ratios reported: (name, this configuration, its peer)
COMPARE_PAIRS: Dict[str, List[Tuple[str, str, str]]] = {
    "radix": [("radix_over_no_radix", "radix-fcfs", "no-radix-fcfs"),
              ("lpm_over_fcfs", "radix-lpm", "radix-fcfs")],
    "overlap": [("overlap_over_no_overlap", "overlap", "no-overlap")],
    "schedule": [("mixed_chunk_over_alternate", "mixed-chunk", "alternate"),
                 ("prefill_first_over_alternate", "prefill-first", "alternate")],
    "fp8": [("fp8_over_bf16", "fp8", "bf16"), ("fp8_kv_over_bf16", "fp8-kv", "bf16")],
    "spec": [("spec_over_off", "spec-ngram", "spec-off")],
    "switch": [("switch_200us_over_5ms", "switch-200us", "switch-5ms")],
    "engine-process": [("engine_process_over_one_process", "engine-process", "one-process")],
}
# kept for callers of the old module-level name
COMPARE_CONFIGS = COMPARE_SETS["radix"]


def _prepare_model(args, work_dir: str) -> Tuple[List[str], Optional[int]]:
    """launch_server flags naming the model (--preset: a built directory, dummy weights) and the
    highest prompt token id to use (the preset's ordinary vocabulary; None: the server's)."""
    if not args.preset:
        return [], None
    from radixserve.bench.presets import PRESETS, build_preset, ordinary_vocab_end

    out = args.preset_dir or os.path.join(work_dir, f"preset-{args.preset}")
    build_preset(args.preset, out)
    print(f"--- preset {args.preset} ({PRESETS[args.preset].hf_name} shapes) built in {out}")
    return (["--model-path", out, "--load-format", "dummy"],
            ordinary_vocab_end(PRESETS[args.preset]))


class ConfigRun(NamedTuple):
    facts: ServerFacts
    workload: Workload                  # built on the first server, reused by the others
    got: object                         # the metrics (a plain run) or the sweep's points


def _run_config(args, server: LaunchedServer, workload: Optional[Workload],
                token_limit: Optional[int], server_args: List[str]) -> ConfigRun:
    """One launched server: warm-up, then the run or the sweep."""
    facts = run_async(discover(server.base_url, args))
    workload = workload if workload is not None else _workload(args, facts, token_limit)
    flush = wants_flush(args, launched=True)
    run_async(warm_up(args, server.base_url, facts, flush))
    if args.sweep_concurrency:
        points = run_sweep(args, server.base_url, workload, facts, flush)
        for point in points:
            point["server_args"] = server_args
        return ConfigRun(facts, workload, points)
    metrics = run_async(benchmark_once(args, server.base_url, workload, facts))
    metrics["server_args"] = server_args
    return ConfigRun(facts, workload, metrics)


def run_launched(args) -> Dict:
    """Launch `python -m radixserve.launch_server` per configuration (--compare NAME: each of
    COMPARE_SETS[NAME]; else one), warm each up, run the identical workload (or the sweep), stop
    it. Returns {"runs" | "sweep", "ratios" (with --compare), "server_logs", "server",
    "workload" (describe)}."""
    stop_servers_on_sigterm()   # the `with` blocks below then stop the server on SIGTERM too
    log_dir = args.server_log_dir or tempfile.mkdtemp(prefix="radixserve-bench-")
    os.makedirs(log_dir, exist_ok=True)
    model_args, token_limit = _prepare_model(args, log_dir)
    base_args = model_args + shlex.split(args.server_args)
    configs = COMPARE_SETS[args.compare] if args.compare else [("default", [])]
    runs: Dict[str, Dict] = {}
    sweep: Dict[str, List[Dict]] = {}
    facts, workload = None, None
    for name, extra in configs:
        log_path = os.path.join(log_dir, f"{name}.log")
        port = free_port()
        cmd = radixserve_command(port, base_args + extra)
        print(f"\n--- {name}: launching server ({' '.join(base_args + extra)}); log {log_path}")
        with LaunchedServer(cmd, port, log_path, args.server_timeout) as server:
            facts, workload, got = _run_config(args, server, workload, token_limit,
                                               base_args + extra)
        if args.sweep_concurrency:
            sweep[name] = got
        else:
            runs[name] = got
            print_metrics(name, got)
    out: Dict = {"server_logs": log_dir, "server": facts.record() if facts else {},
                 "workload": describe(args, workload) if workload is not None else None}
    if args.sweep_concurrency:
        out["sweep"] = sweep
    else:
        out["runs"] = runs
    if args.compare:
        out["ratios"] = compare_ratios(args.compare, runs, sweep)
    return out


def compare_ratios(compare: str, runs: Dict[str, Dict], sweep: Dict[str, List[Dict]]) -> Dict:
    """COMPARE_PAIRS[compare] as ratios: of the runs, or per concurrency level of the sweep."""
    ratios: Dict = {}
    print("\n============ ratios (one run each) ============")
    for pair, this, peer in COMPARE_PAIRS[compare]:
        if runs:
            ratios[pair] = pair_ratios(runs[this], runs[peer])
            print(pair + ": " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios[pair].items()))
        else:
            ratios[pair] = [{"max_concurrency": a["max_concurrency"], **pair_ratios(a, b)}
                            for a, b in zip(sweep[this], sweep[peer])]
            print(pair + " by concurrency:")
            for r in ratios[pair]:
                print(f"  {r['max_concurrency']:>4}: output tok/s {r['output_throughput']:.2f}x, "
                      f"mean TTFT {r['mean_ttft_speedup']:.2f}x, mean ITL {r['mean_itl_speedup']:.2f}x")
    return ratios


# kept for callers of the old name
run_compare = run_launched


# ----------------------------------------------------------------------------- output

# per-run fields of a JSONL line that come from the arguments, named as SGLang names them
ARG_FIELDS = (("backend", "backend"), ("dataset_name", "dataset"), ("request_rate", "request_rate"),
              ("random_input_len", "random_input_len"), ("random_output_len", "random_output_len"),
              ("random_range_ratio", "random_range_ratio"))
# keys of a metrics dict that a JSONL line leaves out or sets itself
NOT_IN_LINE = ("per_request", "server_args", "max_concurrency", "num_requests")


def run_line(result: Dict, config: str, metrics: Dict, max_concurrency: Optional[int],
             ratios: Optional[Dict] = None) -> Dict:
    """One run as a JSONL line: SGLang's argument and result keys, then ours (config, model,
    server_args, num_requests, the workload's description, the command, its time and source
    revision; ratios for the first configuration of a --compare pair)."""
    args = result["args"]
    line: Dict = {key: args[name] for key, name in ARG_FIELDS}
    line["max_concurrency"] = max_concurrency
    line.update({k: v for k, v in metrics.items() if k not in NOT_IN_LINE})
    line.update(config=config, model=(result.get("server") or {}).get("model"),
                server_args=metrics.get("server_args"),
                num_requests=metrics["completed"] + metrics["failed"],
                workload=result.get("workload"), command=result["command"], time=result["time"], source=result["source"])
    if ratios:
        line["ratios"] = ratios
    return finite(line)


def _ratios_of(result: Dict, config: str, level: Optional[int] = None) -> Dict:
    """The ratios whose first configuration is config (at sweep level `level`)."""
    pairs = COMPARE_PAIRS.get(result["args"].get("compare") or "", [])
    out = {}
    for pair, this, _ in pairs:
        got = (result.get("ratios") or {}).get(pair)
        if this != config or got is None:
            continue
        out[pair] = got if level is None else next(
            (r for r in got if r["max_concurrency"] == level), None)
    return out


def run_lines(result: Dict) -> List[Dict]:
    """Every run of result (a plain run, each --compare configuration, each sweep level) as a
    JSONL line (run_line)."""
    max_c = result["args"]["max_concurrency"]
    if "metrics" in result:
        return [run_line(result, "default", result["metrics"], max_c)]
    if "runs" in result:
        return [run_line(result, name, m, max_c, _ratios_of(result, name))
                for name, m in result["runs"].items()]
    return [run_line(result, name, p, p["max_concurrency"],
                     _ratios_of(result, name, p["max_concurrency"]))
            for name, points in result["sweep"].items() for p in points]


def write_output(result: Dict, output_file: str, plots: bool) -> None:
    """X.jsonl: append run_lines(result); else the whole result as JSON. Then the plots."""
    os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
    if output_file.endswith(".jsonl"):
        with open(output_file, "a") as f:
            for line in run_lines(result):
                f.write(json.dumps(line) + "\n")
        print(f"\nappended to {output_file}")
    else:
        with open(output_file, "w") as f:
            f.write(to_json(finite(result)) + "\n")
        print(f"\nwrote {output_file}")
    if plots:
        write_plots(result, output_file)


def write_plots(result: Dict, output_file: str) -> List[str]:
    """plots.py's PNGs next to output_file; a missing matplotlib is reported, not fatal."""
    try:
        from radixserve.bench import plots
        paths = plots.write_plots(result, output_file)
    except ImportError as e:
        print(f"no plots ({e}); pip install matplotlib, or pass --no-plots")
        return []
    for path in paths:
        print(f"wrote {path}")
    return paths


# ----------------------------------------------------------------------------- CLI

def _int_list(text: str) -> List[int]:
    """'1,2,4' -> [1, 2, 4]; every value >= 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="generate",
                   help="generate: SGLang's native /generate; completions: /v1/completions "
                        "(token-id prompts); chat: /v1/chat/completions (text prompts)")
    p.add_argument("--model", default=None,
                   help="model name the OpenAI routes are sent (default: GET /v1/models' first)")
    p.add_argument("--tokenizer", default=None,
                   help="model directory (or transformers name) whose tokenizer gives the "
                        "vocabulary size and, for --backend chat, decodes the prompts")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids stay below this (default: from the server, see "
                        "--tokenizer)")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", "--dataset-name", dest="dataset",
                   choices=["random", "generated-shared-prefix", "multi-turn"],
                   default="generated-shared-prefix")
    p.add_argument("--num-prompts", type=int, default=64,
                   help="requests (random) or conversations (multi-turn)")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * ratio, len] as SGLang's bench_serving draws "
                        "them (its default 0.0: inputs from 1, outputs from 0); 1.0: fixed")
    p.add_argument("--gsp-num-groups", type=int, default=2)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=16)
    p.add_argument("--gsp-output-len", type=int, default=4)
    p.add_argument("--gsp-order", choices=["interleaved", "grouped", "shuffled"], default="interleaved")
    p.add_argument("--mt-turns", type=int, default=4)
    p.add_argument("--mt-first-len", type=int, default=256)
    p.add_argument("--mt-message-len", type=int, default=32)
    p.add_argument("--mt-output-len", type=int, default=16)
    p.add_argument("--token-id-low", type=int, default=100, help="prompt token ids are drawn from "
                   "[low, high); the low ids hold most special tokens")
    p.add_argument("--token-id-high", type=int, default=None, help="default: the vocab size")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (conversation starts for multi-turn); inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--disable-ignore-eos", action="store_true",
                   help="let requests stop at EOS (default: exactly the requested output length)")
    p.add_argument("--warmup-requests", type=int, default=1,
                   help="short requests sent (one at a time) before the run")
    p.add_argument("--flush-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="POST /flush_cache after the warm-up and before each sweep level "
                        "(default: on for launched servers and --backend generate)")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--output-file", default=None,
                   help="X.jsonl: append one JSON line per run; else write the result as JSON")
    p.add_argument("--no-plots", action="store_true",
                   help="do not write PNG plots next to --output-file")
    p.add_argument("--allow-failures", action="store_true",
                   help="exit 0 even when requests failed (default: exit 1 after the result is "
                        "written)")


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launching the server (--launch, --preset, --compare)")
    g.add_argument("--launch", action="store_true",
                   help="launch `python -m radixserve.launch_server` on a free port for the run "
                        "and stop it afterwards (implied by --preset and --compare)")
    g.add_argument("--preset", default=None, metavar="NAME",
                   help="serve the real shapes of NAME (radixserve bench presets: llama-3.1-8b, "
                        "llama-3.2-1b, qwen2.5-7b, qwen3-8b, smollm2-135m) with dummy weights; "
                        "implies --launch")
    g.add_argument("--preset-dir", default=None,
                   help="build the preset here (default: inside the server log directory)")
    g.add_argument("--compare", nargs="?", const="radix", default=None, choices=sorted(COMPARE_SETS),
                   help="launch one server per configuration and report ratios: radix (the default "
                        "when given alone): radix/fcfs vs --disable-radix-cache vs radix/lpm; "
                        "overlap: overlap scheduling vs --disable-overlap-schedule")
    g.add_argument("--server-args", default="", help="extra launch_server flags for every server")
    g.add_argument("--server-timeout", type=float, default=900.0)
    g.add_argument("--server-log-dir", default=None)
    g = p.add_argument_group("concurrency sweep")
    g.add_argument("--sweep-concurrency", type=_int_list, default=None, metavar="1,2,4,...",
                   help="run the workload at each max-concurrency (cache flushed between levels "
                        "when --flush-cache) and record the throughput per level")
    g.add_argument("--sweep-prompts-per-concurrency", type=int, default=None, metavar="K",
                   help="level c sends the first c*K requests of the workload (default: all)")


def _check_args(p: argparse.ArgumentParser, args) -> None:
    if args.preset:
        from radixserve.bench.presets import PRESETS
        if args.preset not in PRESETS:
            p.error(f"--preset must be one of {', '.join(PRESETS)}")
    if args.sweep_prompts_per_concurrency is not None and args.sweep_prompts_per_concurrency < 1:
        p.error("--sweep-prompts-per-concurrency must be >= 1")
    for name in ("num_prompts", "random_input_len", "random_output_len", "gsp_num_groups",
                 "gsp_prompts_per_group", "gsp_question_len", "gsp_output_len", "mt_turns",
                 "mt_first_len", "mt_message_len", "mt_output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.random_range_ratio <= 1:
        p.error("--random-range-ratio must be in [0, 1]")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (inf = all at once)")
    if args.warmup_requests < 0:
        p.error("--warmup-requests must be >= 0")
    if args.vocab_size is not None and args.vocab_size < 1:
        p.error("--vocab-size must be >= 1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="radixserve bench serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_target_args(p)
    _add_workload_args(p)
    _add_run_args(p)
    _add_launch_args(p)
    args = p.parse_args(argv)
    _check_args(p, args)
    args.launch = bool(args.launch or args.preset or args.compare)
    return args


def failures(result: Dict) -> Dict[str, int]:
    """The failure reasons of every run in result (a plain run, each configuration, each sweep
    level) added up: {reason: count}."""
    runs = [result["metrics"]] if "metrics" in result else list((result.get("runs") or {}).values())
    runs += [p for points in (result.get("sweep") or {}).values() for p in points]
    total: Dict[str, int] = {}
    for m in runs:
        for reason, n in (m.get("failure_reasons") or {}).items():
            total[reason] = total.get(reason, 0) + n
    return dict(sorted(total.items()))


def main(argv=None) -> Dict:
    """Run the benchmark of argv (sys.argv[1:] when None); the result dict (and --output-file).
    BenchError for a server that cannot be benchmarked as asked; RequestsFailed (after the
    result is written) when any request failed, unless --allow-failures."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result: Dict = {"command": "radixserve bench serving " + shlex.join(argv),
                    "args": finite(vars(args)),
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "source": source_revision()}
    if args.launch:
        result.update(run_launched(args))
        if not args.compare and "runs" in result:      # one launched server: as against a running one
            result["metrics"] = result.pop("runs")["default"]
    else:
        result.update(run_running(args))
    if args.output_file:
        write_output(result, args.output_file, plots=not args.no_plots)
    failed = failures(result)
    if failed and not args.allow_failures:
        raise RequestsFailed(
            f"{sum(failed.values())} request(s) failed ("
            + ", ".join(f"{reason} {n}" for reason, n in failed.items())
            + "); pass --allow-failures to exit 0 anyway", result)
    return result
