"""`radixserve serve --dp-size N` without a model (replicas.py): the gateway's flags and keys,
each replica's settings and GPUs, the message without smg, and the supervisor's restarts,
driven with stand-in children (a few lines of http.server answering /health or /readiness)."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time

import pytest

from radixserve import cli, replicas
from radixserve.config import ServerArgs

STAND_IN = r'''
import http.server, json, sys
payload = json.loads(sys.stdin.read())
role = sys.argv[1]
if role == "replica":
    if payload["server_args"].get("served_model_name") == "dies":
        sys.exit(3)
    port, path = payload["server_args"]["port"], "/health"
else:
    argv = payload["argv"]
    port, path = int(argv[argv.index("--port") + 1]), "/readiness"
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == path else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_gateway_keys_follow_the_door():
    both = ServerArgs(api_key=["alice", "bob"], admin_api_key="adm")
    assert replicas.gateway_keys(both) == {
        "api_key": "adm", "tenant_api_keys": [("client-0", "alice"), ("client-1", "bob")],
        "control_plane_api_keys": []}
    clients = ServerArgs(api_key=["alice", "bob"])
    assert replicas.gateway_keys(clients)["api_key"] == "alice"
    assert replicas.gateway_keys(clients)["tenant_api_keys"] == [("client-1", "bob")]
    admin_only = replicas.gateway_keys(ServerArgs(admin_api_key="adm"))
    assert admin_only["api_key"] is None
    assert admin_only["control_plane_api_keys"] == [("admin", "radixserve admin", "adm", "admin")]
    assert replicas.gateway_keys(ServerArgs()) == {"api_key": None, "tenant_api_keys": [],
                                                   "control_plane_api_keys": []}


def test_gateway_argv_carries_the_door_but_no_key():
    args = ServerArgs(host="0.0.0.0", port=8000, api_key="secret", router_policy="round_robin",
                      allowed_origins="https://a.example, https://b.example",
                      max_request_bytes=4096, shutdown_timeout=20)
    argv = replicas.gateway_argv(args, ["http://127.0.0.1:1", "http://127.0.0.1:2"], 9)
    joined = " ".join(argv)
    assert "secret" not in joined
    assert "--worker-urls http://127.0.0.1:1 http://127.0.0.1:2" in joined
    assert "--host 0.0.0.0 --port 8000" in joined and "--policy round_robin" in joined
    assert "--cors-allowed-origins https://a.example https://b.example" in joined
    assert "--max-payload-size 4096" in joined and "--shutdown-grace-period-secs 25" in joined
    assert "--prometheus-host 127.0.0.1 --prometheus-port 9" in joined
    launcher = pytest.importorskip("smg.launch_router", reason="smg is not installed")
    parsed = launcher.parse_router_args(argv)            # smg itself accepts every flag
    assert parsed.policy == "round_robin" and parsed.port == 8000 and parsed.api_key is None


def test_replica_settings_and_gpus(monkeypatch):
    args = ServerArgs(dp_size=4, device="cpu", port=8000, host="0.0.0.0")
    one = replicas.replica_args(args, 40001)
    assert (one.host, one.port, one.dp_size) == ("127.0.0.1", 40001, 1)
    assert one.cpu_threads == max(1, (os.cpu_count() or 1) // 4)
    assert replicas.gpu_groups(args) is None
    if any(f.name == "kv_events_config" for f in dataclasses.fields(ServerArgs)):
        events = dataclasses.replace(args, kv_events_config=json.dumps(
            {"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}))
        assert replicas.replica_args(events, 1, 0).kv_events_config == events.kv_events_config
        third = json.loads(replicas.replica_args(events, 1, 2).kv_events_config)
        assert third == {"publisher": "zmq", "endpoint": "tcp://*:5559", "topic": "kv"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    gpu = ServerArgs(dp_size=2, tp_size=2, device="cuda")
    assert replicas.gpu_groups(gpu) == [["3", "5"], ["6", "7"]]
    assert replicas.replica_args(gpu, 1).cpu_threads is None
    with pytest.raises(ValueError, match="needs 6 GPUs; 4 are visible"):
        replicas.gpu_groups(dataclasses.replace(gpu, dp_size=3))


def test_without_smg_dp_size_exits_2_naming_the_package(monkeypatch, capsys):
    monkeypatch.setattr(replicas, "gateway_installed", lambda: False)
    assert cli.main(["serve", "--dp-size", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'radixserve[router]'" in err and "`smg`" in err


def _supervisor(tmp_path, **kw):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    args = ServerArgs(dp_size=2, device="cpu", port=replicas.free_port(), api_key="k-secret",
                      shutdown_timeout=1, **kw)
    return replicas.Supervisor(args, command=lambda role: [sys.executable, str(script), role])


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_supervisor_restarts_a_dead_replica(tmp_path, caplog):
    sup = _supervisor(tmp_path)
    caplog.set_level("INFO", logger="radixserve.replicas")
    status = []
    t = threading.Thread(target=lambda: status.append(sup.run(handle_signals=False)))
    t.start()
    try:
        assert _wait(lambda: "behind the gateway" in caplog.text), caplog.text
        assert all(r.served for r in sup.replicas)
        assert all("k-secret" not in " ".join(c.proc.args)
                   for c in (sup.gateway, *sup.replicas))            # keys travel on stdin
        assert sup.gateway.payload["api_key"] == "k-secret"
        victim = sup.replicas[0]
        first_pid = victim.proc.pid
        os.kill(first_pid, signal.SIGKILL)
        assert _wait(lambda: victim.restarts == 1 and victim.served and
                     victim.down_since is None), caplog.text
        assert victim.proc.pid != first_pid and victim.port == sup.replicas[0].port
        assert "replica 0 (port %d) exited with status -9; restarting it in 1 s" % victim.port \
            in caplog.text and "replica 0 back in service after" in caplog.text
        assert sup.replicas[1].restarts == 0
    finally:
        sup.stopping = True
        t.join(timeout=30)
    assert status == [0]
    assert all(c.proc.poll() is not None for c in (sup.gateway, *sup.replicas))


def test_a_replica_that_never_serves_stops_everything(tmp_path, caplog):
    sup = _supervisor(tmp_path, served_model_name="dies")
    caplog.set_level("INFO", logger="radixserve.replicas")
    assert sup.run(handle_signals=False) == 1
    assert "exited with status 3 before it ever served" in caplog.text
    assert sup.gateway.proc is None


def test_the_offline_engine_refuses_dp_size():
    from radixserve import Engine

    with pytest.raises(ValueError, match="dp_size=2: data parallelism is a server of replicas"):
        Engine("unused-model-path", dp_size=2)
