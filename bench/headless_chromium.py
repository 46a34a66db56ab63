"""A headless Chromium driven over the DevTools protocol (a websocket, through aiohttp), for the
dashboard's browser test (tests/e2e/test_dashboard.py) and screenshots
(bench/dashboard_screens.py). Chromium comes from the OS packages (Debian: `apt-get install -y
chromium`); nothing is downloaded.

    async with Chromium() as browser:
        page = await browser.page(width=1400, height=1000)
        await page.set_headers({"Authorization": "Bearer k"})   # every request of the page
        await page.navigate("http://127.0.0.1:30000/dashboard")
        n = await page.evaluate("document.querySelectorAll('svg path').length")
        await page.screenshot("shot.png")

`find_chromium()` names the binary on PATH (chromium, chromium-browser, google-chrome), or
None.
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from typing import Any, Dict, Optional

import aiohttp

BINARIES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
START_TIMEOUT_S = 60.0
# no component updates, sync, metrics, field trials, ...: the browser reaches only the URLs
# the page asks for
QUIET_FLAGS = ("--headless=new", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
               "--disable-extensions", "--disable-background-networking", "--disable-sync",
               "--disable-component-update", "--disable-default-apps", "--metrics-recording-only",
               "--no-pings", "--disable-features=Translate,MediaRouter,OptimizationHints",
               "--disable-dev-shm-usage", "--mute-audio", "--hide-scrollbars")


def find_chromium() -> Optional[str]:
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


class DevToolsError(RuntimeError):
    pass


class Page:
    """One tab's DevTools session."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self._ids = itertools.count(1)
        self.console: list = []           # Runtime.consoleAPICalled / exceptionThrown texts
        self.failed: list = []            # Network.loadingFailed and 4xx/5xx responses
        self._pending: Dict[int, asyncio.Future] = {}
        self._loaded = asyncio.Event()    # Page.loadEventFired since the last navigate
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            elif data.get("method") == "Page.loadEventFired":
                self._loaded.set()
            elif data.get("method") == "Runtime.consoleAPICalled":
                args = data["params"].get("args", [])
                self.console.append(" ".join(str(a.get("value", a.get("description", "")))
                                             for a in args))
            elif data.get("method") == "Runtime.exceptionThrown":
                self.console.append(json.dumps(data["params"].get("exceptionDetails", {}))[:2000])
            elif data.get("method") == "Network.loadingFailed":
                self.failed.append(data["params"].get("errorText"))
            elif data.get("method") == "Network.responseReceived":
                r = data["params"]["response"]
                if r.get("status", 200) >= 400:
                    self.failed.append(f"{r.get('status')} {r.get('url')}")

    async def send(self, method: str, params: Optional[dict] = None, timeout: float = 60.0) -> dict:
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        await self.ws.send_str(json.dumps({"id": i, "method": method, "params": params or {}}))
        reply = await asyncio.wait_for(fut, timeout)
        if "error" in reply:
            raise DevToolsError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def set_headers(self, headers: Dict[str, str]) -> None:
        await self.send("Network.setExtraHTTPHeaders", {"headers": headers})

    async def navigate(self, url: str, timeout: float = 60.0) -> dict:
        """Open url and wait for its load event."""
        self._loaded.clear()
        reply = await self.send("Page.navigate", {"url": url})
        if reply.get("errorText"):
            raise DevToolsError(f"navigate {url}: {reply['errorText']}")
        await asyncio.wait_for(self._loaded.wait(), timeout)
        return reply

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page (awaited if a promise)."""
        r = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                 "awaitPromise": True})
        if "exceptionDetails" in r:
            raise DevToolsError(f"evaluate {expression[:80]!r}: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout: float = 30.0, every_s: float = 0.1) -> Any:
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{expression!r} stayed falsy for {timeout} s")
            await asyncio.sleep(every_s)

    async def dom(self) -> str:
        return await self.evaluate("document.documentElement.outerHTML")

    async def screenshot(self, path: str) -> None:
        """A PNG of the whole page (not only the viewport)."""
        size = await self.evaluate("[document.documentElement.scrollWidth, "
                                   "document.documentElement.scrollHeight]")
        r = await self.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}})
        with open(path, "wb") as f:
            f.write(base64.b64decode(r["data"]))

    async def close(self) -> None:
        self._reader.cancel()
        await self.ws.close()


class Chromium:
    """A headless Chromium process with its own empty profile; an async context manager."""

    def __init__(self, binary: Optional[str] = None):
        self.binary = binary or find_chromium()
        if self.binary is None:
            raise FileNotFoundError("no chromium binary on PATH (Debian: apt-get install -y "
                                    "chromium)")
        self.proc: Optional[subprocess.Popen] = None
        self.profile: Optional[tempfile.TemporaryDirectory] = None
        self.session: Optional[aiohttp.ClientSession] = None
        self.port = 0

    async def __aenter__(self) -> "Chromium":
        self.profile = tempfile.TemporaryDirectory(prefix="radixserve-chromium-")
        argv = [self.binary, *QUIET_FLAGS, "--remote-debugging-port=0",
                f"--user-data-dir={self.profile.name}", "about:blank"]
        if os.geteuid() == 0:
            argv.insert(1, "--no-sandbox")       # Chromium refuses to sandbox as root
        self.log = open(os.path.join(self.profile.name, "chromium.log"), "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        port_file = os.path.join(self.profile.name, "DevToolsActivePort")
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            if self.proc.poll() is not None or asyncio.get_running_loop().time() > deadline:
                await self.__aexit__(None, None, None)
                raise RuntimeError("chromium did not start its DevTools endpoint")
            await asyncio.sleep(0.1)
        self.port = int(open(port_file).read().split()[0])
        self.session = aiohttp.ClientSession()
        return self

    async def page(self, width: int = 1400, height: int = 1000) -> Page:
        """A new tab of width x height CSS pixels, with console, network and page events on."""
        async with self.session.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as r:
            target = await r.json(content_type=None)
        ws = await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        page = Page(ws)
        for method in ("Page.enable", "Runtime.enable", "Network.enable"):
            await page.send(method)
        await page.send("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        return page

    async def __aexit__(self, *exc) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        if getattr(self, "log", None) is not None:
            self.log.close()
        if self.profile is not None:
            self.profile.cleanup()
            self.profile = None
