"""`radixserve bench serving` against a stand-in OpenAI-compatible server on loopback: a test
double (http.server, no model) that streams /v1/completions and /v1/chat/completions as SSE
with a final usage chunk, lists one model at /v1/models, answers 404 to everything else and
records every route it was asked for. It stands for a peer (SGLang, vLLM) that has none of
radixserve's own routes. tests/e2e/test_bench_cli.py runs the same command against radixserve."""
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
# what a tiny workload asks for: 4 prompts x 8 input tokens x 4 output tokens
TINY = ["--dataset", "random", "--num-prompts", "4", "--random-input-len", "8",
        "--random-output-len", "4", "--disable-tqdm"]


class StandIn:
    """The server: .url, .routes (every (method, path) asked, in order), .bodies (the JSON
    bodies of the POSTs), .card (the /v1/models entry: add root or vocab_size to it)."""

    def __init__(self):
        self.routes, self.bodies = [], []
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
            if self.path == "/v1/completions":
                return self._stream(body, len(body["prompt"]), lambda t: {"text": t})
            if self.path == "/v1/chat/completions":
                words = len(body["messages"][0]["content"].split())
                return self._stream(body, words, lambda t: {"delta": {"content": t}})
            self._json(404, {"error": {"message": f"no route {self.path}"}})

        def _event(self, obj):
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        def _stream(self, body, prompt_tokens, choice):
            """max_tokens chunks of one token each, then the usage chunk (half the prompt
            reported as cached), then [DONE]; the connection closes (HTTP/1.0)."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["max_tokens"]
            for i in range(n):
                finish = "length" if i == n - 1 else None
                self._event({"object": "chunk", "model": MODEL, "choices": [
                    {"index": 0, **choice(f" t{i}"), "finish_reason": finish}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                self._event({"object": "chunk", "model": MODEL, "choices": [], "usage": {
                    "prompt_tokens": prompt_tokens, "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                    "prompt_tokens_details": {"cached_tokens": prompt_tokens // 2}}})
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
