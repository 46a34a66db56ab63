"""End-to-end fixtures: ONE real server per test session (`python -m radixserve.launch_server`
with the default model on a free loopback port, its output in a log file), shared by every e2e
test, stopped at teardown."""
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


@contextlib.contextmanager
def launched_server(log_dir, args, env=None, headers=None):
    """`python -m radixserve.launch_server` on a free loopback port with args (this checkout's
    pysrc first on PYTHONPATH; env: environment variables to set, None: to unset), its output in
    log_dir/server.log; yields SimpleNamespace(url, port, model (served name, read with
    headers), log, proc) once /health answers 200, and stops it (SIGTERM, then kill) after."""
    port = _free_port()
    log_path = str(log_dir / "server.log")
    overrides, env = env or {}, dict(os.environ)
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "pysrc")] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1",
           "--port", str(port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{_tail(log_path)}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not become healthy in {STARTUP_TIMEOUT_S} s:\n{_tail(log_path)}")
            time.sleep(0.3)
        model = httpx.get(url + "/v1/models", headers=headers or {},
                          timeout=10).json()["data"][0]["id"]
        yield SimpleNamespace(url=url, port=port, model=model, log=log_path, proc=proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The running server: .url, .model (served name), .log (path of its output),
    .metric(name) (a value from /metrics), .wait_idle() (nothing running or queued)."""
    with launched_server(tmp_path_factory.mktemp("server"), ["--debug-integrity"]) as srv:
        url = srv.url
        srv.metric = lambda name: metric(url, name)
        srv.wait_idle = lambda timeout_s=60.0: wait_idle(url, timeout_s)
        yield srv


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


@pytest.fixture(scope="session")
def oai(server):
    """The official openai client pointed at the server."""
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def metric(url: str, name: str) -> float:
    """A value from /metrics (the sample `radixserve:<name>{...}`)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf"^radixserve:{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"metric {name} missing from /metrics"
    return float(m.group(1))


def wait_idle(url: str, timeout_s: float = 60.0) -> None:
    """Wait until the engine runs and queues nothing (aborts take effect at the next step)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metric(url, "num_running_reqs") == 0 and metric(url, "num_waiting_reqs") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the server did not become idle")
