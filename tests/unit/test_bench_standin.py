"""`radixserve bench serving` against a stand-in OpenAI-compatible server on loopback: a test
double (http.server, no model) that streams /v1/completions and /v1/chat/completions as SSE
with a final usage chunk (and SGLang's native /generate, cumulative ids and meta_info), lists
one model at /v1/models, answers 404 to everything else and records every route it was asked
for. It stands for a peer (SGLang, vLLM) that has none of radixserve's own routes; told to
(StandIn.faults), it fails requests the ways a server can. tests/e2e/test_bench_cli.py runs the
same command against radixserve."""
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from radixserve import cli

MODEL = "standin-model"
VOCAB = 1000
OPENAI_ROUTES = {("GET", "/v1/models"), ("POST", "/v1/completions"),
                 ("POST", "/v1/chat/completions")}
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")
# what a tiny workload asks for: 4 prompts x 8 input tokens x 4 output tokens (fixed lengths)
TINY = ["--dataset", "random", "--num-prompts", "4", "--random-input-len", "8",
        "--random-output-len", "4", "--random-range-ratio", "1.0", "--disable-tqdm"]
# how StandIn answers a generation request (StandIn.faults):
#   ok           every token asked, finish reason "length" (an empty chunk with it for 0 asked)
#   http500      HTTP 500 with an OpenAI error body
#   error_chunk  one token, then {"error": ...} and [DONE] (radixserve's in-band error)
#   abort        one token, then finish reason abort ("abort"; /generate: {"type": "abort"})
#   truncate     one token, then the connection closes: no finish reason, no [DONE]
#   short        half the tokens asked, then finish reason "stop" (counted in usage/meta_info)
FAULTS = ("ok", "http500", "error_chunk", "abort", "truncate", "short")


class StandIn:
    """The server: .url, .routes (every (method, path) asked, in order), .bodies (the JSON
    bodies of the POSTs), .card (the /v1/models entry: add root or vocab_size to it), .faults
    (how to answer the next generation requests, in the order they arrive: FAULTS; "ok" once
    it is empty)."""

    def __init__(self):
        self.routes, self.bodies, self.faults = [], [], []
        self.card = {"id": MODEL, "object": "model", "owned_by": "test"}
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def posts(self, path):
        return [b for (m, p), b in zip(self.routes, self.bodies) if (m, p) == ("POST", path)]


def _handler(standin: StandIn):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _record(self, body):
            with standin.lock:
                standin.routes.append((self.command, self.path))
                standin.bodies.append(body)

        def _json(self, status, obj):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._record(None)
            if self.path == "/v1/models":
                return self._json(200, {"object": "list", "data": [standin.card]})
            self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.loads(raw) if raw else None
            self._record(body)
            if self.path not in GENERATION_ROUTES:
                return self._json(404, {"error": {"message": f"no route {self.path}"}})
            with standin.lock:
                fault = standin.faults.pop(0) if standin.faults else "ok"
            if fault == "http500":
                return self._json(500, {"error": {"message": "stand-in: internal error",
                                                  "type": "InternalServerError", "code": 500}})
            if self.path == "/generate":
                return self._generate(body, fault)
            if self.path == "/v1/completions":
                return self._stream(body, fault, len(body["prompt"]), lambda t: {"text": t})
            words = len(body["messages"][0]["content"].split())
            self._stream(body, fault, words, lambda t: {"delta": {"content": t}})

        def _event(self, obj):
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        def _answer(self, asked, fault, chunk):
            """Send the SSE stream of `fault` (FAULTS); chunk(k, finish, new) is the event after
            k tokens (new: it carries the k-th). The number of tokens sent when the usage chunk
            and [DONE] are still to come, else None; the connection closes after (HTTP/1.0)."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = {"ok": asked, "short": asked // 2}.get(fault, min(asked, 1))
            for k in range(1, n + 1):
                last = k == n and fault in ("ok", "short")
                self._event(chunk(k, ("length" if fault == "ok" else "stop") if last else None,
                                  True))
            if fault == "truncate":
                return None
            if fault == "error_chunk":
                self._event({"error": {"message": "stand-in: the engine failed", "code": 500}})
                self.wfile.write(b"data: [DONE]\n\n")
                return None
            if fault == "abort":
                self._event(chunk(n, "abort", False))
            elif n == 0:
                self._event(chunk(0, "length", False))
            return n

        def _stream(self, body, fault, prompt_tokens, choice):
            """The OpenAI routes: max_tokens chunks of one token each (finish reason on the
            last), then the usage chunk (half the prompt reported as cached), then [DONE]."""
            def chunk(k, finish, new):
                return {"object": "chunk", "model": MODEL, "choices": [
                    {"index": 0, **choice(f" t{k - 1}" if new else ""), "finish_reason": finish}]}
            n = self._answer(body["max_tokens"], fault, chunk)
            if n is None:
                return
            if (body.get("stream_options") or {}).get("include_usage"):
                self._event({"object": "chunk", "model": MODEL, "choices": [], "usage": {
                    "prompt_tokens": prompt_tokens, "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                    "prompt_tokens_details": {"cached_tokens": prompt_tokens // 2}}})
            self.wfile.write(b"data: [DONE]\n\n")

        def _generate(self, body, fault):
            """SGLang's native stream: each chunk has the cumulative text and output ids and
            meta_info (counts; finish_reason null until the last), then [DONE]."""
            prompt = len(body["input_ids"])

            def chunk(k, finish, new):
                reason = finish and {"type": finish, "matched": None}
                if finish == "abort":
                    reason["message"] = "stand-in: aborted"
                return {"text": "".join(f" t{i}" for i in range(k)),
                        "output_ids": list(range(100, 100 + k)),
                        "meta_info": {"id": "r", "prompt_tokens": prompt, "completion_tokens": k,
                                      "cached_tokens": 0, "finish_reason": reason}}
            if self._answer(body["sampling_params"]["max_new_tokens"], fault, chunk) is not None:
                self.wfile.write(b"data: [DONE]\n\n")

    return Handler


@pytest.fixture
def standin():
    s = StandIn()
    s.thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def bench(*argv) -> int:
    """`radixserve bench serving ARGV` in this process; its exit status."""
    return cli.main(["bench", "serving", *argv])


def read_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# SGLang bench_serving's keys that every line carries (its arguments, then its results)
SGLANG_KEYS = {
    "backend", "dataset_name", "request_rate", "max_concurrency", "random_input_len",
    "random_output_len", "random_range_ratio", "duration", "completed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "input_throughput", "output_throughput",
    "total_throughput", "concurrency", "p95_itl_ms", "max_itl_ms",
} | {f"{stat}_{what}_ms" for stat in ("mean", "median", "std", "p90", "p99")
     for what in ("ttft", "tpot", "itl", "e2e_latency")}


def test_completions_run_asks_only_openai_routes_and_writes_sglang_keys(standin, tmp_path):
    out = str(tmp_path / "standin.jsonl")
    assert bench("--base-url", standin.url, "--backend", "completions", "--vocab-size",
                 str(VOCAB), *TINY, "--output-file", out, "--no-plots") == 0
    assert set(standin.routes) <= OPENAI_ROUTES
    assert ("GET", "/v1/models") in standin.routes
    sent = standin.posts("/v1/completions")
    assert len(sent) == 1 + 4                                   # one warm-up, then the run
    for body in sent:
        assert body["model"] == MODEL and body["stream"] is True and body["ignore_eos"] is True
        assert all(isinstance(t, int) and 100 <= t < VOCAB for t in body["prompt"])
    assert [len(b["prompt"]) for b in sent[1:]] == [8] * 4
    [line] = read_lines(out)
    assert SGLANG_KEYS <= set(line)
    assert line["backend"] == "completions" and line["dataset_name"] == "random"
    assert line["completed"] == 4 and line["failed"] == 0
    assert line["total_input_tokens"] == 32 and line["total_output_tokens"] == 16
    assert line["total_cached_tokens"] == 16 and line["cache_hit_rate"] == 0.5
    assert line["request_rate"] == "inf" and line["max_concurrency"] is None
    assert line["model"] == MODEL and line["num_requests"] == 4
    assert line["output_throughput"] == pytest.approx(16 / line["duration"])
    assert "per_request" not in line


def test_jsonl_appends_one_line_per_run_and_per_sweep_level(standin, tmp_path):
    out = str(tmp_path / "runs.jsonl")
    common = ["--base-url", standin.url, "--backend", "completions", "--vocab-size",
              str(VOCAB), *TINY, "--output-file", out, "--no-plots"]
    assert bench(*common) == 0
    assert bench(*common, "--sweep-concurrency", "1,2") == 0
    lines = read_lines(out)
    assert [line["max_concurrency"] for line in lines] == [None, 1, 2]
    assert all(set(line) == set(lines[0]) for line in lines)
    assert ("POST", "/flush_cache") not in standin.routes     # not asked for: never sent


def test_flush_cache_only_when_asked_and_a_server_without_it_is_an_error(standin, tmp_path,
                                                                           capsys):
    assert bench("--base-url", standin.url, "--backend", "completions", "--vocab-size",
                 str(VOCAB), *TINY, "--flush-cache") == 2
    assert ("POST", "/flush_cache") in standin.routes
    assert "--no-flush-cache" in capsys.readouterr().err


def test_without_a_vocabulary_size_it_says_what_to_pass(standin, capsys):
    assert bench("--base-url", standin.url, "--backend", "completions", *TINY) == 2
    err = capsys.readouterr().err
    assert "--vocab-size" in err and "--tokenizer" in err
    assert ("GET", "/get_model_info") not in standin.routes


def test_an_unreachable_server_is_an_error_not_a_traceback(capsys):
    from radixserve.bench.launcher import free_port
    url = f"http://127.0.0.1:{free_port()}"
    assert bench("--base-url", url, "--backend", "completions", "--vocab-size", "100") == 2
    assert "cannot reach" in capsys.readouterr().err


@pytest.fixture(scope="module")
def preset_dir(tmp_path_factory):
    from radixserve.bench.presets import build_preset
    return build_preset("smollm2-135m", str(tmp_path_factory.mktemp("preset")))


def test_chat_backend_sends_text_and_gives_the_same_keys(standin, tmp_path, preset_dir):
    completions, chat = str(tmp_path / "completions.jsonl"), str(tmp_path / "chat.jsonl")
    assert bench("--base-url", standin.url, "--backend", "completions", "--vocab-size",
                 str(VOCAB), *TINY, "--output-file", completions, "--no-plots") == 0
    assert bench("--base-url", standin.url, "--backend", "chat", "--tokenizer", preset_dir,
                 *TINY, "--output-file", chat, "--no-plots") == 0
    [a], [b] = read_lines(completions), read_lines(chat)
    assert set(a) == set(b)
    assert b["backend"] == "chat" and b["completed"] == 4 and b["total_output_tokens"] == 16
    for body in standin.posts("/v1/chat/completions"):
        [message] = body["messages"]
        assert message["role"] == "user" and isinstance(message["content"], str)
        assert message["content"].strip()
    assert set(standin.routes) <= OPENAI_ROUTES


def test_model_root_on_this_machine_gives_the_vocabulary_and_json_output(standin, tmp_path,
                                                                          preset_dir):
    standin.card["root"] = preset_dir
    out = str(tmp_path / "run.json")
    assert bench("--base-url", standin.url, "--backend", "completions", *TINY,
                 "--output-file", out) == 0
    with open(out) as f:
        result = json.load(f)
    assert result["server"]["vocab_size"] == 49152
    assert result["server"]["vocab_source"] == "/v1/models root"
    assert result["command"].startswith("radixserve bench serving ")
    assert SGLANG_KEYS - {"backend", "dataset_name", "request_rate", "max_concurrency",
                          "random_input_len", "random_output_len",
                          "random_range_ratio"} <= set(result["metrics"])
    assert len(result["metrics"]["per_request"]["ttft_ms"]) == 4
    # the latency CDFs next to the JSON (matplotlib is a test dependency)
    png = str(tmp_path / "run-latency-cdf.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert all(max(b["prompt"]) < 49152 for b in standin.posts("/v1/completions"))


def test_bench_dispatch_lists_subcommands_and_keeps_flags_first_as_serving(standin, capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("serving", "offline", "presets", "plots"))
    assert cli.main(["bench", "nonesuch"]) == 2
    assert cli.main(["bench", "--base-url", standin.url, "--backend", "completions",
                     "--vocab-size", str(VOCAB), *TINY]) == 0
    assert len(standin.posts("/v1/completions")) == 5
    assert cli.main(["bench", "serving", "--help"]) == 0
    assert "--backend" in capsys.readouterr().out


def test_importing_radixserve_does_not_import_the_benchmarks():
    import subprocess
    import sys
    code = ("import sys, radixserve, radixserve.cli, radixserve.bench; "
            "print(sorted(m for m in ('httpx', 'matplotlib', 'radixserve.bench.serving') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("backend", ["completions", "generate"])
def test_failed_requests_are_counted_per_reason_and_make_the_exit_status_1(standin, tmp_path,
                                                                           capsys, backend):
    """Six requests after the warm-up: one healthy, one per way of failing."""
    extra = ["--no-flush-cache"] if backend == "generate" else []    # it has no /flush_cache
    run = ["--base-url", standin.url, "--backend", backend, "--vocab-size", str(VOCAB), *extra,
           *TINY, "--num-prompts", "6", "--max-concurrency", "1", "--no-plots"]
    faults = ["ok", "http500", "error_chunk", "abort", "truncate", "short", "ok"]
    standin.faults = list(faults)
    out = str(tmp_path / "failed.json")
    assert bench(*run, "--output-file", out) == 1
    captured = capsys.readouterr()
    assert "5 request(s) failed" in captured.err and "--allow-failures" in captured.err
    with open(out) as f:                                   # written before the exit status
        m = json.load(f)["metrics"]
    assert m["completed"] == 1 and m["failed"] == 5
    assert m["failure_reasons"] == {"abort": 1, "error": 1, "http_status": 1,
                                    "short_output": 1, "truncated": 1}
    assert m["total_output_tokens"] == 4                  # the healthy request alone
    samples = dict(s.split(": ", 1) for s in m["error_samples"])
    assert set(samples) == set(m["failure_reasons"])
    assert samples["http_status"].startswith("HTTP 500") and "stand-in" in samples["http_status"]
    assert "the engine failed" in samples["error"] and "abort" in samples["abort"]
    assert samples["truncated"] == "the stream ended without a finish reason (closed before [DONE])"
    assert samples["short_output"].startswith("2 of the 4 output tokens asked")
    for reason in m["failure_reasons"]:
        assert f"Failed: {reason}" in captured.out and f"\n  {reason}: " in captured.out
    # the same run with --allow-failures: the same account, exit status 0
    standin.faults = list(faults)
    assert bench(*run, "--allow-failures") == 0
    assert "Failed: truncated" in capsys.readouterr().out
    # and a healthy run: nothing to report
    assert bench(*run) == 0
    assert "Failed:" not in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["completions", "generate"])
def test_outputs_of_length_zero_are_sent_as_sglang_sends_them_and_succeed(standin, tmp_path,
                                                                          capsys, backend):
    """SGLang's default range ratio 0.0 draws outputs from [0, len]: 0 goes out as
    max_tokens / max_new_tokens 0 and the request finishes, with its latency as TTFT."""
    extra = ["--no-flush-cache"] if backend == "generate" else []
    out = str(tmp_path / "zero.json")
    assert bench("--base-url", standin.url, "--backend", backend, "--vocab-size", str(VOCAB),
                 *extra, "--dataset", "random", "--num-prompts", "8", "--random-input-len", "8",
                 "--random-output-len", "1", "--disable-tqdm", "--no-plots",
                 "--output-file", out) == 0
    path = "/generate" if backend == "generate" else "/v1/completions"
    asked = [b["sampling_params"]["max_new_tokens"] if backend == "generate" else b["max_tokens"]
             for b in standin.posts(path)[1:]]
    assert sorted(set(asked)) == [0, 1]                   # seed 1 draws both
    with open(out) as f:
        result = json.load(f)
    m = result["metrics"]
    assert m["completed"] == 8 and m["failed"] == 0 and m["total_output_tokens"] == sum(asked)
    per = m["per_request"]
    zero = [i for i, n in enumerate(per["output_len"]) if n == 0]
    assert len(zero) == asked.count(0)
    assert all(per["ttft_ms"][i] == per["latency_ms"][i] for i in zero)
    w = result["workload"]
    assert w["dataset"] == "random" and w["num_requests"] == 8
    assert w["total_output_tokens"] == sum(asked) and w["random_range_ratio"] == 0.0
    out = capsys.readouterr().out                          # the totals, before the results
    assert out.index(f"workload: random, 8 requests, {w['total_input_tokens']} input / "
                     f"{sum(asked)} output tokens; lengths as SGLang's") < out.index("Successful")
