"""`radixserve serve --dp-size N`: N replica servers behind SGLang's model gateway.

The supervisor (this process, `serve_replicas`) starts

  * N replicas: each a whole radixserve server (`server/app.serve`, one engine, its own prefix
    cache) in its own process, on a loopback port of its own, with `--dp-size 1`; on CUDA each
    gets its own `--tp-size` GPUs through CUDA_VISIBLE_DEVICES (of the GPUs this process sees),
    on the CPU `--cpu-threads` defaults to the cores divided by N;
  * the gateway: the Shepherd Model Gateway (`smg` on PyPI, `pip install 'radixserve[router]'`;
    SGLang's `sglang-router` before it), on `--host:--port`, with the replicas as its
    `--worker-urls` and `--router-policy` as its `--policy` (cache_aware by default).

The gateway reads the worker surface of server/native_api.py (`/health`, `/server_info`,
`/model_info`, `/v1/loads`); it health-checks every replica each second and routes around one
that fails 3 checks in a row (a dead one refuses connections at once: ~3 s; a check waits up to
10 s, so a replica slowed by a busy CPU is not dropped), takes it back after one passing check,
and retries a request refused by a dead replica on another. A replica that exits is restarted on its own
port, after 1 s, then 2, 4, ... up to 30 s while it keeps dying (the delay starts over once it
has served for a minute); every exit and restart is logged. One that exits before it ever
served (a bad flag, a model that does not load) stops the whole server with status 1. The
gateway exiting stops everything with status 1 too (a supervisor above restarts the lot).
SIGTERM / SIGINT stop the gateway and the replicas together: each replica drains for
`--shutdown-timeout` seconds as a single server does, the gateway lets its requests finish.

The door settings hold at the public port as follows (README "Deployment" says the same):

  * API keys: the gateway checks them, with the replicas behind it checking them again. The
    gateway takes `--admin-api-key` (else the first client key) as its own key (its admin
    routes, and what it sends the replicas when it probes them) and every client key as a
    tenant key; it forwards the caller's `Authorization` header to the replica, so each
    client's identity (stored responses, aborts, `--max-running-requests-per-client`) is the
    replica's as with one server. With only `--admin-api-key`, the gateway's own admin routes
    take that key (smg's control-plane keys) and its data routes are open, as a single
    server's are; its probes then carry no key, so /server_info and /v1/loads answer it 401 and
    it routes without load reports.
  * `--allowed-origins` becomes the gateway's `--cors-allowed-origins`, `--max-request-bytes`
    its `--max-payload-size`. The gateway has no Host check: `--allowed-hosts` and the
    DNS-rebinding defence of a loopback server do not hold at the public port.
  * Without client keys, a replica sees every request come from the gateway's address, so the
    per-client rules keyed on the peer address treat all clients as one.

Keys never appear on a command line: replicas and the gateway read their settings as JSON on
stdin (`python -m radixserve.replicas replica|gateway`).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from radixserve.config import ServerArgs

logger = logging.getLogger("radixserve.replicas")

GATEWAY_PACKAGE = "smg"
GATEWAY_EXTRA = "radixserve[router]"
LOOPBACK = "127.0.0.1"
POLL_S = 0.5                   # how often the supervisor looks at its children
FIRST_RESTART_S = 1.0          # a dead replica's first restart delay; doubles while it keeps dying
MAX_RESTART_S = 30.0
STABLE_S = 60.0                # a replica that served this long starts the delay over
HEALTH_CHECK_S = 1             # the gateway's health-check interval (smg's minimum)
HEALTH_FAILURES = 3            # failed checks in a row before the gateway routes around a replica
HEALTH_TIMEOUT_S = 10          # a check slower than this fails (a busy CPU replica can take s)
GATEWAY_START_S = 120.0        # the gateway must answer within this after it starts
STOP_GRACE_S = 10.0            # beyond --shutdown-timeout before leftovers are killed
REPLICA_LOG_FORMAT = "[%(asctime)s %(levelname)s replica {index} %(name)s] %(message)s"


def gateway_installed() -> bool:
    return importlib.util.find_spec(GATEWAY_PACKAGE) is not None


def missing_gateway_message(dp_size: int) -> str:
    return (f"--dp-size {dp_size} puts SGLang's model gateway in front of the replicas, and its "
            f"package `{GATEWAY_PACKAGE}` is not installed in this Python ({sys.executable}): "
            f"pip install '{GATEWAY_EXTRA}' (or pip install {GATEWAY_PACKAGE})")


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def visible_gpus() -> List[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch
    return [str(i) for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)]


def gpu_groups(args: ServerArgs) -> Optional[List[List[str]]]:
    """Each replica's GPUs (--tp-size of them, in order), or None on the CPU."""
    if not args.resolved_device().startswith("cuda"):
        return None
    gpus = visible_gpus()
    tp = args.tp_size
    if len(gpus) < args.dp_size * tp:
        raise ValueError(f"--dp-size {args.dp_size} x --tp-size {tp} needs "
                         f"{args.dp_size * tp} GPUs; {len(gpus)} are visible")
    return [gpus[i * tp:(i + 1) * tp] for i in range(args.dp_size)]


def replica_args(args: ServerArgs, port: int, index: int = 0) -> ServerArgs:
    """One replica's settings: the server's, on a loopback port, one replica, on the CPU the
    cores shared out (--cpu-threads) unless given, and its KV-event endpoints (if
    --kv-events-config names any) on their port + index, as SGLang offsets them per DP rank."""
    threads = args.cpu_threads
    if threads is None and not args.resolved_device().startswith("cuda"):
        threads = max(1, (os.cpu_count() or 1) // args.dp_size)
    events = getattr(args, "kv_events_config", None)
    changes: Dict[str, Any] = {}
    if events and index:
        try:
            cfg = json.loads(events)
        except ValueError:
            cfg = None
        if isinstance(cfg, dict):
            for key in ("endpoint", "replay_endpoint"):
                m = re.match(r"^(.*:)(\d+)$", str(cfg.get(key) or ""))
                if m:
                    cfg[key] = f"{m.group(1)}{int(m.group(2)) + index}"
            changes["kv_events_config"] = json.dumps(cfg)
    return dataclasses.replace(args, host=LOOPBACK, port=port, dp_size=1, cpu_threads=threads,
                               **changes)


def gateway_keys(args: ServerArgs) -> Dict[str, Any]:
    """How the gateway holds the keys (module docstring): {"api_key": its own key or None,
    "tenant_api_keys": [(tenant id, key)], "control_plane_api_keys": [(id, name, key, role)]}."""
    clients = args.resolved_api_keys()
    admin = args.resolved_admin_api_key()
    out: Dict[str, Any] = {"api_key": None, "tenant_api_keys": [], "control_plane_api_keys": []}
    if clients:
        out["api_key"] = admin if admin is not None else clients[0][0]
        seen = {out["api_key"]}
        for i, (key, name) in enumerate(clients):
            if key not in seen:
                seen.add(key)
                out["tenant_api_keys"].append((name or f"client-{i}", key))
    elif admin is not None:
        out["control_plane_api_keys"].append(("admin", "radixserve admin", admin, "admin"))
    return out


def gateway_argv(args: ServerArgs, worker_urls: Sequence[str], metrics_port: int) -> List[str]:
    """smg's `launch` flags (no keys: gateway_keys travel on stdin). Its own Prometheus
    listener (smg's default: 0.0.0.0:29000, without authentication) goes to a loopback port."""
    level = {"debug": "debug", "trace": "debug", "info": "warn", "warning": "warn"}.get(
        args.log_level, "error")
    argv = ["--host", args.host, "--port", str(args.port), "--worker-urls", *worker_urls,
            "--policy", args.router_policy, "--log-level", level,
            "--max-payload-size", str(args.max_request_bytes),
            "--health-check-interval-secs", str(HEALTH_CHECK_S),
            "--health-check-timeout-secs", str(HEALTH_TIMEOUT_S),
            "--health-failure-threshold", str(HEALTH_FAILURES), "--health-success-threshold", "1",
            "--worker-startup-check-interval", "1",
            "--shutdown-grace-period-secs", str(int(args.shutdown_timeout) + 5),
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port)]
    origins = [o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()]
    if origins:
        argv += ["--cors-allowed-origins", *origins]
    return argv


@dataclass
class Child:
    """One child process (a replica, or the gateway) and its restart state."""
    name: str
    port: int
    payload: Dict[str, Any]          # what it reads on stdin
    env: Dict[str, str]
    proc: Optional[subprocess.Popen] = None
    started_at: float = 0.0
    served: bool = False             # answered /health at least once
    failures: int = 0                # exits in a row without serving STABLE_S
    restart_at: Optional[float] = None
    down_since: Optional[float] = None
    restarts: int = 0


def _set_parent_death_signal() -> None:
    """In the child before exec: SIGTERM when the supervisor dies (Linux), so a killed
    supervisor leaves no replica behind."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the supervisor's own handlers still stop them
        pass


def _healthy(port: int, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/health", timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


class Supervisor:
    """Runs the replicas and the gateway (module docstring). `command(role)` is each child's
    command line (default: `python -m radixserve.replicas replica|gateway`); the child reads
    its Child.payload as JSON on stdin."""

    def __init__(self, args: ServerArgs, command: Optional[Any] = None):
        self.args = args
        self.command = command or (lambda role: [sys.executable, "-m", "radixserve.replicas",
                                                 role])
        self.stopping = False
        self.status = 0
        groups = gpu_groups(args)
        self.replicas: List[Child] = []
        for i in range(args.dp_size):
            port = free_port()
            env = dict(os.environ)
            if groups is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(groups[i])
            payload = {"index": i, "server_args": dataclasses.asdict(replica_args(args, port, i))}
            self.replicas.append(Child(f"replica {i}", port, payload, env))
        urls = [f"http://{LOOPBACK}:{r.port}" for r in self.replicas]
        self.gateway_metrics_port = free_port()
        self.gateway = Child("gateway", args.port,
                             {"argv": gateway_argv(args, urls, self.gateway_metrics_port),
                              **gateway_keys(args)}, dict(os.environ))

    # ------------------------------------------------------------------ children

    def _spawn(self, child: Child, role: str) -> None:
        proc = subprocess.Popen(self.command(role),
                                stdin=subprocess.PIPE, env=child.env, start_new_session=True,
                                preexec_fn=_set_parent_death_signal)
        try:
            proc.stdin.write(json.dumps(child.payload).encode())
            proc.stdin.close()
        except OSError:              # it died at once; the loop sees its exit
            pass
        child.proc, child.started_at, child.served, child.restart_at = proc, time.monotonic(), \
            False, None
        logger.info("%s started: pid %d, %s", child.name, proc.pid,
                    f"http://{LOOPBACK}:{child.port}" if role == "replica"
                    else f"http://{self.args.host}:{self.args.port}")

    def _check_replica(self, r: Child, now: float) -> None:
        if r.proc is None:
            if r.restart_at is not None and now >= r.restart_at and not self.stopping:
                r.restarts += 1
                self._spawn(r, "replica")
            return
        code = r.proc.poll()
        if code is None:
            if not r.served and _healthy(r.port, timeout=0.5):
                r.served = True
                if r.down_since is not None:
                    logger.warning("%s back in service after %.1f s (restart #%d)", r.name,
                                   now - r.down_since, r.restarts)
                    r.down_since = None
            elif r.served and now - r.started_at >= STABLE_S:
                r.failures = 0
            return
        r.proc = None
        if self.stopping:
            return
        if not r.served and r.restarts == 0:
            logger.error("%s exited with status %s before it ever served (see its log above); "
                         "stopping", r.name, code)
            self.status = 1
            self.stopping = True
            return
        r.failures += 1
        delay = min(MAX_RESTART_S, FIRST_RESTART_S * 2 ** (r.failures - 1))
        r.restart_at = now + delay
        r.down_since = r.down_since if r.down_since is not None else now
        logger.warning("%s (port %d) exited with status %s; restarting it in %.0f s (the "
                       "gateway routes around it meanwhile)", r.name, r.port, code, delay)

    def _wait_gateway(self) -> bool:
        """Until the gateway answers on the public port (True), or exits or time runs out."""
        host = LOOPBACK if self.args.host in ("0.0.0.0", "", "::") else self.args.host
        deadline = time.monotonic() + GATEWAY_START_S
        while time.monotonic() < deadline and not self.stopping:
            if self.gateway.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://{host}:{self.args.port}/readiness",
                                            timeout=1) as resp:
                    if resp.status == 200:
                        return True
            except (OSError, urllib.error.URLError):
                pass
            for r in self.replicas:
                self._check_replica(r, time.monotonic())
            time.sleep(POLL_S)
        return False

    # ------------------------------------------------------------------ run

    def _on_signal(self, signum, frame) -> None:
        if not self.stopping:
            logger.info("%s: stopping the gateway and the replicas (replicas drain for "
                        "--shutdown-timeout %.0f s)", signal.Signals(signum).name,
                        self.args.shutdown_timeout)
        self.stopping = True

    def run(self, handle_signals: bool = True) -> int:
        """Until SIGTERM / SIGINT (with handle_signals; else until `stopping` is set), the
        gateway exits, or a replica fails its first start. The exit status."""
        if handle_signals:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        try:
            for r in self.replicas:
                self._spawn(r, "replica")
            while not self.stopping and not all(r.served for r in self.replicas):
                for r in self.replicas:
                    self._check_replica(r, time.monotonic())
                time.sleep(POLL_S)
            if not self.stopping:
                self._spawn(self.gateway, "gateway")
                if self._wait_gateway():
                    logger.info("radixserve serving %d replicas behind the gateway (smg, policy "
                                "%s) on http://%s:%d (the gateway's own metrics: "
                                "http://%s:%d/metrics)", len(self.replicas),
                                self.args.router_policy, self.args.host, self.args.port,
                                LOOPBACK, self.gateway_metrics_port)
                elif not self.stopping:
                    logger.error("the gateway did not come up on %s:%d; stopping",
                                 self.args.host, self.args.port)
                    self.status, self.stopping = 1, True
            while not self.stopping:
                if self.gateway.proc.poll() is not None:
                    logger.error("the gateway exited with status %s; stopping",
                                 self.gateway.proc.returncode)
                    self.status, self.stopping = 1, True
                    break
                for r in self.replicas:
                    self._check_replica(r, time.monotonic())
                time.sleep(POLL_S)
        finally:
            self._stop_all()
        return self.status

    def _stop_all(self) -> None:
        live = [c.proc for c in (self.gateway, *self.replicas)
                if c.proc is not None and c.proc.poll() is None]
        for p in live:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.args.shutdown_timeout + STOP_GRACE_S
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("pid %d did not stop in time; killing it", p.pid)
                p.kill()
                p.wait()


def serve_replicas(args: ServerArgs) -> int:
    """`radixserve serve --dp-size N` (N > 1): the supervisor's exit status."""
    if not args.resolved_api_keys() and args.resolved_admin_api_key() is None and \
            args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("the gateway listens on %s without an API key: anyone who can reach this "
                       "port can use the model and the gateway's admin routes (/workers, "
                       "/flush_cache); set --api-key or RADIXSERVE_API_KEY", args.host)
    return Supervisor(args).run()


# --------------------------------------------------------------------------- children

def _run_replica(payload: Dict[str, Any]) -> int:
    index = payload["index"]
    args = ServerArgs(**payload["server_args"])
    level = "debug" if args.log_level == "trace" else args.log_level
    logging.basicConfig(level=level.upper(), format=REPLICA_LOG_FORMAT.format(index=index),
                        datefmt="%H:%M:%S", force=True)
    from radixserve.server.app import serve
    return serve(args)


def _run_gateway(payload: Dict[str, Any]) -> int:
    from smg.launch_router import launch_router, parse_router_args
    router_args = parse_router_args(payload["argv"])
    router_args.api_key = payload.get("api_key")
    router_args.tenant_api_keys = [tuple(t) for t in payload.get("tenant_api_keys") or []]
    router_args.control_plane_api_keys = [tuple(t) for t in
                                          payload.get("control_plane_api_keys") or []]
    launch_router(router_args)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m radixserve.replicas replica|gateway`, its settings as JSON on stdin."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] not in (["replica"], ["gateway"]):
        print("usage: python -m radixserve.replicas replica|gateway  (JSON settings on stdin; "
              "started by `radixserve serve --dp-size N`)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the supervisor stops us with SIGTERM
    payload = json.loads(sys.stdin.read())
    return _run_replica(payload) if argv[0] == "replica" else _run_gateway(payload)


if __name__ == "__main__":
    sys.exit(main())
