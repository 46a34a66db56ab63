"""SIGTERM is a graceful stop: admission closes (a new request gets 503 with Retry-After), the
live requests run for --shutdown-timeout seconds, then every stream still running ends with
finish reason "abort", the reason, and [DONE] instead of being cut mid-body; the process
exits 0. Its own server (the shared one must outlive this test)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from conftest import REPO, _free_port, _tail


def _events(lines):
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def test_sigterm_drains_then_ends_streams_with_abort(tmp_path):
    port = _free_port()
    log_path = str(tmp_path / "server.log")
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "pysrc"))
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1",
           "--port", str(port), "--shutdown-timeout", "2", "--max-total-tokens", "8192"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, _tail(log_path)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, _tail(log_path)
            time.sleep(0.3)
        lines, started = [], threading.Event()

        def stream():
            body = {"text": "Once upon a time", "stream": True,
                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
            with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(120), _tail(log_path)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(url + "/generate", json={"text": "hi"}, timeout=30)
        assert refused.status_code == 503 and refused.headers.get("retry-after")
        t.join(120)
        assert not t.is_alive()
        events = _events(lines)
        assert events[-1] == "[DONE]", lines[-5:]
        last = json.loads(events[-2])
        reason = last["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "shutting down" in reason["message"]
        assert proc.wait(60) == 0, _tail(log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
