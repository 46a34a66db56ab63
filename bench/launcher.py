"""Servers that a benchmark starts and stops itself: a command in a subprocess on a free loopback
port, its output in a log file, ready once an HTTP health URL answers 200.

    with LaunchedServer(radixserve_command(port, ["--load-format", "dummy"]), port, log) as s:
        ... s.base_url ...

Leaving the `with` block (normally, by an exception, or by SIGTERM once
`stop_servers_on_sigterm()` was called) terminates the process, then kills it after 20 s.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

import httpx

PYSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def radixserve_command(port: int, extra_args: List[str]) -> List[str]:
    """`python -m radixserve.launch_server` on 127.0.0.1:port with extra_args, this interpreter."""
    return [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1",
            "--port", str(port)] + list(extra_args)


def checkout_env() -> Dict[str, str]:
    """The environment with this checkout's pysrc/ first on PYTHONPATH, so a launched server
    imports radixserve from here unless it is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PYSRC, env.get("PYTHONPATH")) if p)
    return env


def stop_servers_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so `with LaunchedServer` blocks still stop their servers."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


class LaunchedServer:
    """cmd in a subprocess (stdout and stderr to log_path) until the context exits.

    __enter__ returns once GET base_url + health_path answers 200; it raises RuntimeError (and
    stops the process) when the process exits first or timeout seconds pass.
    """

    def __init__(self, cmd: List[str], port: int, log_path: str, timeout: float,
                 health_path: str = "/health", env: Optional[Dict[str, str]] = None):
        self.cmd = list(cmd)
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.timeout = timeout
        self.health_path = health_path
        self.env = env if env is not None else checkout_env()
        self.proc: Optional[subprocess.Popen] = None
        self.log = None

    def __enter__(self) -> "LaunchedServer":
        self.log = open(self.log_path, "w")
        self.log.write("$ " + " ".join(self.cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env)
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + self.health_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server not healthy after {self.timeout}s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log and not self.log.closed:
            self.log.close()


def source_revision() -> Dict[str, object]:
    """The checkout's commit and whether pysrc/ or csrc/ differ from it (uncommitted edits), for
    recording next to a result; {"commit": None} outside a git checkout."""
    root = os.path.dirname(PYSRC)
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "pysrc", "csrc"],
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None}
    return {"commit": commit, "uncommitted_changes": bool(status.strip())}
