"""If the engine's scheduling loop itself dies, the server says why, stops serving, and serve()
returns a non-zero status (what `radixserve serve` exits with), so a supervisor restarts it
instead of a live process answering 503 forever. The fault is injected: Scheduler.schedule
raises once a request is live (nothing a client sends can do that: that is what the rest of
the suite shows)."""
import socket
import threading
import time

import httpx


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_loop_stops_the_server_with_status_1(monkeypatch, default_model_path, caplog):
    from radixserve.config import ServerArgs
    from radixserve.engine.scheduler.core import Scheduler
    from radixserve.server.app import serve

    real = Scheduler.schedule

    def failing(self, **kw):
        if self.reqs:
            raise RuntimeError("injected scheduler fault")
        return real(self, **kw)

    monkeypatch.setattr(Scheduler, "schedule", failing)
    port = _free_port()
    args = ServerArgs(model_path=default_model_path, device="cpu", port=port,
                      max_total_tokens=4096, context_length=1024, log_level="warning")
    status = {}
    thread = threading.Thread(target=lambda: status.setdefault("rc", serve(args)), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                   timeout=60)
    assert "injected scheduler fault" in r.text      # the request ends with the reason
    thread.join(60)
    assert not thread.is_alive(), "the server kept running with a dead engine loop"
    assert status["rc"] == 1
    assert any("loop died" in rec.getMessage() for rec in caplog.records)
