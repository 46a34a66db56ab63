"""radixserve.lang's run_batch against the same prompts as independent OpenAI chat calls.

The workload: --num-programs (64) programs that share one few-shot system prompt of about
--prefix-tokens (1,000) tokens (counted with the served model's tokenizer, chat template
included: many "Q: What is a plus b?" / "A: a plus b is c." pairs from a seeded generator) and
differ in a short question each:

    @sgl.function
    def few_shot_qa(s, question):
        s += sgl.system(FEWSHOT)
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=K, temperature=0, ignore_eos=True))

Two servers, one after the other (never both up), with the same flags (`--device cpu`, a KV
pool that holds every prompt of the batch at once even without sharing, plus --server-args):

  A  lang       the radix cache on (default); `few_shot_qa.run_batch([...], num_threads=N)`
                through `RuntimeEndpoint(url)`: run_batch prefills the shared prefix once
                (Program.precache), then runs the N programs concurrently.
  B  openai     `--disable-radix-cache`; the same prompts as N concurrent POST
                /v1/chat/completions (messages = [system FEWSHOT, user question], the same
                max_tokens, temperature 0, ignore_eos) from a pool of N threads.

Each server first answers one unrelated short request (warm-up), then /flush_cache. The wall
time of a side runs from the start of run_batch (or of the first chat call) until the last
answer is back. The prefix hit rate of A is the delta of radixserve:cached_tokens_total over
the delta of radixserve:prompt_tokens_total across run_batch (/metrics read before and after;
the precache request is included in both). Output tok/s = generated tokens (meta_info /
usage.completion_tokens, summed) / wall time.

Checks: the prompts of the two sides are the same text (the program traced with
radixserve.lang.program.trace_prefix vs Tokenizer.apply_chat_template(messages,
add_generation_prompt=True)) and the same token ids; every answer is a non-empty str; every
answer has exactly K tokens on both sides.

The mark (issue): hit rate >= 0.90 and speedup = time_B / time_A >= 3; `pass` also needs the
checks above. Exit code 0 on pass.

    PYTHONPATH=pysrc python bench/lang.py --output-file bench/results/lang-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import httpx

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from launcher import (LaunchedServer, free_port, radixserve_command,  # noqa: E402
                      source_revision, stop_servers_on_sigterm)

INSTRUCTION = ("You are a careful calculator. Answer every question the way the examples "
               "below do, in one short sentence.\n\n")
WARMUP = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
          "temperature": 0}


# --------------------------------------------------------------------------- the workload

def _pair(rng: random.Random):
    return rng.randint(10, 99), rng.randint(10, 99)


def _shot(a: int, b: int) -> str:
    return f"Q: What is {a} plus {b}?\nA: {a} plus {b} is {a + b}.\n\n"


def build_fewshot(tok, target_tokens: int, seed: int):
    """(FEWSHOT text, its token count, the (a, b) pairs used): INSTRUCTION + Q/A pairs, added
    until the system message alone, rendered by the chat template, has >= target_tokens
    tokens."""
    rng = random.Random(seed)
    shots, used = [], []

    def count(text: str) -> int:
        return len(tok.encode_chat([{"role": "system", "content": text}],
                                   add_generation_prompt=False))

    text = INSTRUCTION.rstrip()
    while count(text) < target_tokens:
        a, b = _pair(rng)
        if (a, b) in used:
            continue
        used.append((a, b))
        shots.append(_shot(a, b))
        text = (INSTRUCTION + "".join(shots)).rstrip()
    return text, count(text), used


def build_questions(n: int, seed: int, exclude) -> List[str]:
    """n distinct questions, none of them one of the few-shot pairs."""
    rng = random.Random(seed + 1)
    seen, out = set(exclude), []
    while len(out) < n:
        a, b = _pair(rng)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        out.append(f"Q: What is {a} plus {b}?")
    return out


def make_program(sgl, fewshot: str, max_tokens: int):
    @sgl.function
    def few_shot_qa(s, question):
        s += sgl.system(fewshot)
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0,
                                   ignore_eos=True))
    return few_shot_qa


def chat_messages(fewshot: str, question: str) -> List[Dict[str, str]]:
    return [{"role": "system", "content": fewshot}, {"role": "user", "content": question}]


# --------------------------------------------------------------------------- server helpers

def metric(text: str, name: str, prefix: str = "radixserve:") -> float:
    """The value of the series `prefix + name` (any labels) in a /metrics text; nan if absent."""
    m = re.search(rf'^{re.escape(prefix + name)}(?:\{{[^}}]*\}})? (\S+)$', text, re.M)
    return float(m.group(1)) if m else float("nan")


def read_metrics(url: str) -> str:
    r = httpx.get(url + "/metrics", timeout=60)
    r.raise_for_status()
    return r.text


def warm_up(url: str) -> None:
    """One short unrelated chat (first-call costs), then an empty prefix cache."""
    httpx.post(url + "/v1/chat/completions", json=WARMUP, timeout=600).raise_for_status()
    httpx.post(url + "/flush_cache", json={}, timeout=60).raise_for_status()


# --------------------------------------------------------------------------- the two sides

def side_lang(url: str, args, fewshot: str, questions: List[str], tok) -> dict:
    import radixserve.lang as sgl
    from radixserve.lang.program import trace_prefix

    backend = sgl.RuntimeEndpoint(url)
    prog = make_program(sgl, fewshot, args.max_tokens)
    batch = [{"question": q} for q in questions]

    # the prompts: the program's text (traced, as run_batch traces it) vs the chat route's
    traced = [trace_prefix(prog.func, kw, backend) for kw in batch]
    rendered = [tok.apply_chat_template(chat_messages(fewshot, q), add_generation_prompt=True)
                for q in questions]
    same_text = all(t is not None and t == r for t, r in zip(traced, rendered))
    # /generate tokenizes a text prompt with special tokens; the chat route encodes the
    # rendered template without (encode_chat)
    same_ids = same_text and all(
        tok.encode(t) == tok.encode_chat(chat_messages(fewshot, q))
        for t, q in zip(traced, questions))
    prompt_lens = [len(tok.encode_chat(chat_messages(fewshot, q))) for q in questions]
    mismatch = None
    if not same_text:
        i = next(i for i, (t, r) in enumerate(zip(traced, rendered)) if t != r)
        mismatch = {"index": i, "traced": traced[i], "chat_template": rendered[i]}

    warm_up(url)
    before = read_metrics(url)
    t0 = time.perf_counter()
    states = prog.run_batch(batch, backend=backend, num_threads=args.num_threads,
                            progress_bar=not args.no_progress_bar)
    wall = time.perf_counter() - t0
    after = read_metrics(url)

    answers, metas, errors = [], [], []
    for st in states:
        try:
            answers.append(st["answer"])
            metas.append(st.get_meta_info("answer") or {})
        except Exception as e:  # noqa: BLE001 - counted and reported
            answers.append(None)
            metas.append({})
            errors.append(f"{type(e).__name__}: {e}"[:300])
    out_tokens = [m.get("completion_tokens", 0) for m in metas]
    return {
        **side_summary(args, before, after, wall, out_tokens, answers, errors),
        "same_prompts": same_text, "same_prompt_ids": same_ids, "prompt_mismatch": mismatch,
        "prompt_tokens_each": {"min": min(prompt_lens), "max": max(prompt_lens),
                               "mean": round(sum(prompt_lens) / len(prompt_lens), 1)},
    }


def side_summary(args, before: str, after: str, wall: float, out_tokens: List[int],
                 answers: List[Optional[str]], errors: List[str]) -> dict:
    """One side's figures from /metrics before and after it and its answers."""
    prompt = metric(after, "prompt_tokens_total") - metric(before, "prompt_tokens_total")
    cached = metric(after, "cached_tokens_total") - metric(before, "cached_tokens_total")
    return {
        "wall_s": round(wall, 3),
        "output_tokens": sum(out_tokens),
        "output_tok_per_s": round(sum(out_tokens) / wall, 3),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "requests": metric(after, "num_requests_total") - metric(before, "num_requests_total"),
        "prefill_steps": (metric(after, "num_prefill_steps_total")
                          - metric(before, "num_prefill_steps_total")),
        "decode_steps": (metric(after, "num_decode_steps_total")
                         - metric(before, "num_decode_steps_total")),
        "answers_nonempty": all(isinstance(a, str) and a != "" for a in answers),
        "answers_all_max_tokens": all(n == args.max_tokens for n in out_tokens),
        "errors": errors,
        "answers": answers,
    }


def side_openai(url: str, args, fewshot: str, questions: List[str]) -> dict:
    warm_up(url)
    before = read_metrics(url)
    limits = httpx.Limits(max_connections=args.num_threads,
                          max_keepalive_connections=args.num_threads)
    with httpx.Client(base_url=url, timeout=3600, limits=limits) as client:
        def one(q: str) -> dict:
            r = client.post("/v1/chat/completions", json={
                "messages": chat_messages(fewshot, q), "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return r.json()

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.num_threads) as pool:
            futures = [pool.submit(one, q) for q in questions]
            results, errors = [], []
            for f in futures:
                try:
                    results.append(f.result())
                except Exception as e:  # noqa: BLE001 - counted and reported
                    results.append(None)
                    errors.append(f"{type(e).__name__}: {e}"[:300])
        wall = time.perf_counter() - t0
    after = read_metrics(url)
    answers = [r["choices"][0]["message"]["content"] if r else None for r in results]
    out_tokens = [r["usage"]["completion_tokens"] if r else 0 for r in results]
    return side_summary(args, before, after, wall, out_tokens, answers, errors)


# --------------------------------------------------------------------------- main

def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-programs", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=1000,
                   help="tokens of the few-shot system message, chat template included")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each answer generates")
    p.add_argument("--num-threads", type=int, default=None,
                   help="concurrency of both sides (default: --num-programs)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool of both servers (default: room for every prompt + answer of "
                        "the batch unshared, at least 16384)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="extra launch_server flags, both servers")
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--server-log-dir", default=None, help="default: a temporary directory")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    args.num_threads = args.num_threads or args.num_programs
    stop_servers_on_sigterm()

    from radixserve.model.loader import resolve_model_path
    from radixserve.tokenizer.tokenizer import Tokenizer

    extra = shlex.split(args.server_args)
    model = extra[extra.index("--model-path") + 1] if "--model-path" in extra else None
    tok = Tokenizer.from_path(resolve_model_path(model))
    fewshot, prefix_tokens, used = build_fewshot(tok, args.prefix_tokens, args.seed)
    questions = build_questions(args.num_programs, args.seed, used)
    longest = max(len(tok.encode_chat(chat_messages(fewshot, q))) for q in questions)
    pool = args.max_total_tokens or max(
        16384, -(-int(args.num_programs * (longest + args.max_tokens) * 1.05) // 1024) * 1024)
    common = ["--device", "cpu", "--max-total-tokens", str(pool)] + extra
    log_dir = args.server_log_dir or tempfile.mkdtemp(prefix="radixserve-lang-bench-")
    os.makedirs(log_dir, exist_ok=True)
    print(f"few-shot prefix: {prefix_tokens} tokens ({len(used)} examples); "
          f"{args.num_programs} programs x {args.max_tokens} tokens; pool {pool}; "
          f"server logs in {log_dir}", flush=True)

    source = source_revision()
    sides, commands = {}, {}
    for name, flags in (("lang_radix", []), ("openai_no_radix", ["--disable-radix-cache"])):
        port = free_port()
        cmd = radixserve_command(port, common + flags)
        commands[name] = cmd
        log_path = os.path.join(log_dir, f"{name}.log")
        print(f"[{name}] starting: {shlex.join(cmd)}", flush=True)
        with LaunchedServer(cmd, port, log_path, timeout=args.server_timeout) as server:
            if name == "lang_radix":
                sides[name] = side_lang(server.base_url, args, fewshot, questions, tok)
            else:
                sides[name] = side_openai(server.base_url, args, fewshot, questions)
        sides[name]["server_log"] = log_path
        s = sides[name]
        print(f"[{name}] {s['wall_s']:.1f} s, {s['output_tok_per_s']:.2f} output tok/s, hit rate "
              f"{s['hit_rate']:.4f}, errors {len(s['errors'])}", flush=True)

    a, b = sides["lang_radix"], sides["openai_no_radix"]
    prompt_check = {k: a.pop(k) for k in ("same_prompts", "same_prompt_ids", "prompt_mismatch",
                                          "prompt_tokens_each")}
    speedup = b["wall_s"] / a["wall_s"]
    same_answers = sum(x == y for x, y in zip(a["answers"], b["answers"]))
    checks = {
        "same_prompts": prompt_check["same_prompts"],
        "same_prompt_ids": prompt_check["same_prompt_ids"],
        "answers_nonempty": a["answers_nonempty"] and b["answers_nonempty"],
        "answers_all_max_tokens": a["answers_all_max_tokens"] and b["answers_all_max_tokens"],
        "no_errors": not a["errors"] and not b["errors"],
    }
    ok = a["hit_rate"] >= 0.90 and speedup >= 3.0 and all(checks.values())
    result = {
        "command": "python bench/lang.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "source": source,
        "host": platform.node(), "cpu_count": os.cpu_count(),
        "model_path": resolve_model_path(model),
        "num_programs": args.num_programs, "num_threads": args.num_threads,
        "prefix_tokens": prefix_tokens, "prefix_tokens_target": args.prefix_tokens,
        "fewshot_examples": len(used), "max_tokens": args.max_tokens,
        "prompt_tokens_each": prompt_check["prompt_tokens_each"],
        "max_total_tokens": pool,
        "server_commands": {k: shlex.join(v) for k, v in commands.items()},
        "lang_radix": a, "openai_no_radix": b,
        "hit_rate": a["hit_rate"],
        "time_lang_s": a["wall_s"], "time_openai_s": b["wall_s"],
        "speedup": round(speedup, 3),
        "answers_identical_across_sides": f"{same_answers}/{args.num_programs}",
        **checks, "prompt_mismatch": prompt_check["prompt_mismatch"],
        "pass": ok,
    }
    summary = {k: v for k, v in result.items() if k not in ("lang_radix", "openai_no_radix")}
    print(json.dumps(summary, indent=1))
    print(f"hit rate {a['hit_rate']:.4f} (mark >= 0.90), lang {a['wall_s']:.1f} s vs openai "
          f"no-radix {b['wall_s']:.1f} s: speedup {speedup:.2f}x (mark >= 3)")
    print("PASS" if ok else "FAIL")
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
