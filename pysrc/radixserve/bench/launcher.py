"""Servers that a benchmark starts and stops itself: a command in a subprocess on a free loopback
port, its output in a log file, ready once an HTTP health URL answers 200.

    with LaunchedServer(radixserve_command(port, ["--load-format", "dummy"]), port, log) as s:
        ... s.base_url ...

Leaving the `with` block (normally, by an exception, or by SIGTERM once
`stop_servers_on_sigterm()` was called) terminates the process, then kills it after 20 s.

Works from an installed wheel as from a source checkout: a launched server imports the same
radixserve as this process, and source_revision() says "unknown" outside a git checkout.
"""
from __future__ import annotations

import os
import signal
import site
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

import httpx

import radixserve

# the directory radixserve is imported from: pysrc/ of a source checkout, or site-packages
PYSRC = os.path.dirname(os.path.dirname(os.path.abspath(radixserve.__file__)))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def radixserve_command(port: int, extra_args: List[str]) -> List[str]:
    """`python -m radixserve.launch_server` on 127.0.0.1:port with extra_args, this interpreter."""
    return [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1",
            "--port", str(port)] + list(extra_args)


def _installed(path: str) -> bool:
    """Whether path is one of the interpreter's own package directories (an installed wheel)."""
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    real = os.path.realpath(path)
    return any(real == os.path.realpath(d) for d in dirs)


def checkout_env() -> Dict[str, str]:
    """The environment for a launched server: with the directory radixserve was imported from
    first on PYTHONPATH (a source checkout's pysrc/), so the server runs the same code as the
    benchmark; unchanged for an installed wheel, which the server's interpreter finds itself."""
    env = dict(os.environ)
    if not _installed(PYSRC):
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
            if self._healthy():
                return self
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server not healthy after {self.timeout}s; see {self.log_path}")

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.base_url + self.health_path, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

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


def _git(root: str, *args: str) -> str:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def source_revision() -> Dict[str, object]:
    """What code produced a result, to record next to it: radixserve's version and, in a git
    checkout (radixserve imported from its pysrc/), the commit and whether pysrc/ or csrc/
    differ from it (uncommitted edits). From an installed wheel, or without git, the commit is
    None (unknown). Never raises."""
    out: Dict[str, object] = {"commit": None, "version": radixserve.__version__}
    root = os.path.dirname(PYSRC)
    if os.path.basename(PYSRC) != "pysrc" or not os.path.exists(os.path.join(root, ".git")):
        return out
    try:
        commit = _git(root, "rev-parse", "HEAD")
        status = _git(root, "status", "--porcelain", "--", "pysrc", "csrc")
    except (OSError, subprocess.CalledProcessError):
        return out
    out.update(commit=commit, uncommitted_changes=bool(status))
    return out
