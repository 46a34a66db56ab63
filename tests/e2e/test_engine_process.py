"""--engine-process (engine/process.py, engine/client.py): the server's routes behave as with
the engine in the same process. A bad request is refused before it crosses to the engine and
changes nothing; a grammar that does not compile is a 400 from the engine's compiler; a client
that leaves aborts its request there (the engine goes idle, its KV freed); /metrics reads the
engine's counters and the server process's CPU; SIGTERM to both stops both, exit 0. If the
engine process dies, the live request ends with finish reason abort and the server stops with
status 1, as when the engine's loop dies in one process (test_loop_death.py)."""
import json
import os
import signal
import threading
import time

import httpx
import pytest
from conftest import launched_server, metric, wait_idle

ARGS = ["--engine-process", "--max-total-tokens", "8192", "--context-length", "1024",
        "--debug-integrity"]


def _children(pid: int):
    """pids of the live processes whose parent is `pid` (Linux /proc)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(name))
    return out


def _engine_pid(server_pid: int) -> int:
    """The engine process among the server's children (spawn also starts a resource tracker)."""
    for pid in _children(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
        if b"resource_tracker" not in cmd:
            return pid
    raise AssertionError(f"no engine process among {_children(server_pid)}")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with launched_server(tmp_path_factory.mktemp("engine-process"), ARGS) as s:
        yield s


def test_bad_requests_are_refused_and_change_nothing(srv):
    before = metric(srv.url, "num_requests_total")
    for body, field in (({"input_ids": [1, 10 ** 9]}, "outside the vocabulary"),
                        ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
                        ({"input_ids": [5] * 2000}, "context")):
        r = httpx.post(srv.url + "/generate", json=body, timeout=60)
        assert r.status_code == 400 and field in r.text, r.text
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "model": srv.model, "prompt": "hi", "max_tokens": 4,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert r.status_code == 400, r.text             # the engine's compiler refused it
    assert metric(srv.url, "num_requests_total") == before
    ok = httpx.post(srv.url + "/generate", timeout=120, json={
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 5
    assert metric(srv.url, "num_requests_total") == before + 1
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_a_schema_constrains_the_output(srv):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
        "model": srv.model, "messages": [{"role": "user", "content": "a number as JSON"}],
        "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["n"], int)


def test_a_client_that_leaves_aborts_its_request(srv):
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    events = 0
    with httpx.stream("POST", srv.url + "/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break                               # the client goes away mid-stream
    wait_idle(srv.url)          # aborted in the engine (--debug-integrity: every KV slot is
    assert metric(srv.url, "generation_tokens_total") < 900      # free, cached or owned)
    r = httpx.post(srv.url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text


def test_metrics_are_the_engines_and_the_server_process_cpu(srv):
    assert metric(srv.url, "loop_thread_cpu_seconds_total") > 0       # the engine's loop
    assert metric(srv.url, "server_process_cpu_seconds_total") > 0
    assert metric(srv.url, "max_total_tokens") == 8192
    loads = httpx.get(srv.url + "/v1/loads", timeout=30).json()
    assert loads["loads"][0]["max_total_num_tokens"] == 8192


def test_sigterm_stops_both_processes(tmp_path):
    """SIGTERM to both (as a supervisor's signal to the process group arrives): the engine
    process ignores it and the server stops it after draining; exit 0, nothing left behind."""
    with launched_server(tmp_path, ARGS) as s:
        engine = _engine_pid(s.proc.pid)
        os.kill(engine, signal.SIGTERM)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{engine}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{engine}"), "the engine process outlived the server"


def test_a_dead_engine_process_ends_live_requests_and_stops_the_server(tmp_path):
    with launched_server(tmp_path, ARGS) as s:
        lines, started = [], threading.Event()

        def stream():
            body = {"text": "Once upon a time", "stream": True,
                    "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
            with httpx.stream("POST", s.url + "/generate", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(120)
        os.kill(_engine_pid(s.proc.pid), signal.SIGKILL)
        t.join(60)
        assert not t.is_alive()
        finals = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert finals[-1]["meta_info"]["finish_reason"]["type"] == "abort", finals[-1]
        assert "engine process exited" in finals[-1]["meta_info"]["finish_reason"]["message"]
        assert s.proc.wait(timeout=60) == 1


def test_a_load_error_in_the_engine_process_is_raised_in_the_server(tmp_path, default_model_path):
    """What only the engine's loader finds (an unsupported quantization_config) stops the
    start with the loader's own ValueError, as in one process, and leaves no process behind."""
    import shutil

    from radixserve.config import ServerArgs
    from radixserve.engine.client import EngineClient

    model = tmp_path / "awq"
    shutil.copytree(default_model_path, model)
    with open(model / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with open(model / "config.json", "w") as f:
        json.dump(config, f)
    before = set(_children(os.getpid()))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        EngineClient(ServerArgs(model_path=str(model), device="cpu", engine_process=True))
    deadline = time.monotonic() + 10
    while set(_children(os.getpid())) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    leftover = [p for p in set(_children(os.getpid())) - before
                if b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]
    assert not leftover, f"engine process left behind: {leftover}"
