"""The server's host cost per generated token, on any machine (a CPU is enough).

The event-loop thread does everything per token that is not the model: results (stop checks,
detokenizing, emitting), scheduling, and HTTP (rendering, SSE, socket writes). Its CPU seconds
per generated token bound a fast device's throughput: at ~95 us a token (H100, the 8B shape at
~110 rows a step, bench/results/h100-2026-12-07-late.md) the loop needs ~10.5 ms a step, more
than the FP8 + FP8 KV server's 9.7 ms of kernels, so the step waits on the host.

This launches `python -m radixserve.launch_server` on the CPU with the smollm2-135m preset's
tokenizer and vocabulary but one layer of width 64 (dummy weights: its steps take a few
milliseconds, so the loop is measured at realistic batch sizes), sends --concurrency requests
of --output-len tokens (ignore_eos) to /generate (--route completions: /v1/completions),
streamed (one SSE event a token) and not
(one answer a request: the engine's share alone), --repeats times each, and reports the loop
thread's CPU microseconds per generated token from /metrics (radixserve.bench.server_steps'
loop_cpu_us_per_token: the counters' deltas over each run).

    PYTHONPATH=pysrc python bench/host_cost.py --output-file host-cost.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launcher import LaunchedServer, free_port, radixserve_command, source_revision  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc"))
from radixserve.bench import server_steps  # noqa: E402
from radixserve.bench.presets import build_preset  # noqa: E402

# the one-layer, width-64 shape (the preset's vocabulary and tokenizer stay)
TINY = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32)


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, args,
                      stream: bool) -> None:
    ids = [rng.randrange(1000, 40000) for _ in range(args.input_len)]
    if args.route == "generate":
        path = "/generate"
        body = {"input_ids": ids, "stream": stream,
                "sampling_params": {"max_new_tokens": args.output_len, "ignore_eos": True,
                                    "temperature": 0.0}}
    else:                                  # OpenAI's completions, the prompt as token ids
        path = "/v1/completions"
        body = {"model": args.served_model, "prompt": ids, "max_tokens": args.output_len,
                "ignore_eos": True, "temperature": 0.0, "stream": stream}
    if stream:
        async with client.stream("POST", url + path, json=body) as r:
            r.raise_for_status()
            async for _ in r.aiter_lines():
                pass
    else:
        (await client.post(url + path, json=body)).raise_for_status()


async def one_run(url: str, args, stream: bool, seed: int) -> dict:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        before = await server_steps.scrape(url)
        t0 = time.perf_counter()
        await asyncio.gather(*[one_request(client, url, rng, args, stream)
                               for _ in range(args.concurrency)])
        wall = time.perf_counter() - t0
        steps = server_steps.over_run(before, await server_steps.scrape(url), wall)
    if steps is None or "loop_cpu_us_per_token" not in steps:
        raise RuntimeError("the server's /metrics has no loop_thread_cpu_seconds counter")
    return {"stream": stream, "tokens": steps["generation_tokens"], "wall_s": round(wall, 3),
            "loop_cpu_s": round(steps["loop_cpu_s"], 4),
            "loop_cpu_us_per_token": round(steps["loop_cpu_us_per_token"], 2),
            # --engine-process: the server process's CPU apart from the engine's loop thread
            **({"server_cpu_us_per_token": round(steps["server_cpu_us_per_token"], 2)}
               if "server_cpu_us_per_token" in steps else {})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=384)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--route", choices=("generate", "completions"), default="generate",
                   help="SGLang's /generate (bench serving's sglang backend) or OpenAI's "
                        "/v1/completions")
    p.add_argument("--server-args", default="", help="extra launch_server flags")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)

    work = tempfile.mkdtemp(prefix="radixserve-host-cost-")
    model = build_preset("smollm2-135m", os.path.join(work, "model"))
    cfg_path = os.path.join(model, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(TINY)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    args.served_model = os.path.basename(model)     # the server's default served name
    port = free_port()
    cmd = radixserve_command(port, ["--model-path", model, "--load-format", "dummy",
                                    "--device", "cpu", *args.server_args.split()])
    runs = []
    with LaunchedServer(cmd, port, os.path.join(work, "server.log"), 300) as server:
        asyncio.run(one_run(server.base_url, args, True, 0))           # warm-up
        for r in range(args.repeats):
            for stream in (False, True):
                runs.append(asyncio.run(one_run(server.base_url, args, stream, r + 1)))
                print(json.dumps(runs[-1]))
    summary = {s: statistics.median(r["loop_cpu_us_per_token"] for r in runs
                                    if r["stream"] == (s == "stream"))
               for s in ("no_stream", "stream")}
    print(f"loop CPU per token (us, median of {args.repeats}): not streamed "
          f"{summary['no_stream']:.1f}, streamed {summary['stream']:.1f}")
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "source": source_revision(),
                       "args": vars(args), "runs": runs,
                       "loop_cpu_us_per_token_median": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
