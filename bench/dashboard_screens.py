"""Screenshots of the cache dashboard under a serving load: a server of the default model (or
--model-path) with --enable-dashboard, a load of chat requests whose system prompts carry a
user name or a timestamp before a long shared text (what the advisor finds), and a headless
Chromium from the OS packages (bench/headless_chromium.py; Debian: apt-get install -y
chromium) showing /dashboard. Writes bench/results/dashboard-*.png (--out-dir):

    dashboard-early.png     the page a few seconds into the load
    dashboard-load.png      after --load-s seconds of it (charts, tree, advisor filled in)
    dashboard-no-text.png   with --privacy: a second server with --no-dashboard-show-text

    PYTHONPATH=pysrc python bench/dashboard_screens.py [--load-s 40] [--privacy]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dashboard_overhead  # noqa: E402
from headless_chromium import Chromium, find_chromium  # noqa: E402
from launcher import LaunchedServer, free_port, radixserve_command  # noqa: E402

KEY = "dashboard-screens"
HEADERS = {"Authorization": f"Bearer {KEY}"}


async def shots(url: str, out_dir: str, names, load_s: float, concurrency: int) -> None:
    stop = asyncio.Event()
    stats = {"requests": 0, "errors": 0}
    clients = [asyncio.ensure_future(dashboard_overhead.client_loop(url, HEADERS, k, stop, 32,
                                                                    stats))
               for k in range(concurrency)]
    try:
        async with Chromium() as browser:
            page = await browser.page(width=1400, height=1000)
            await page.set_headers(HEADERS)
            await asyncio.sleep(5)
            await page.navigate(url + "/dashboard")
            await page.wait_for("document.querySelectorAll('#tree-tokens tbody tr').length > 0",
                                60)
            for i, name in enumerate(names):
                if i:
                    await asyncio.sleep(load_s)
                    # the advisor's panel polls once a minute: ask it now, as its button does
                    await page.evaluate("document.getElementById('advice-refresh').click()")
                    await asyncio.sleep(3)
                if name is None:            # no shot at this point
                    continue
                path = os.path.join(out_dir, name)
                await page.screenshot(path)
                print(path, flush=True)
            if page.failed or page.console:
                print("page problems:", page.failed, page.console, file=sys.stderr)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    print(f"{stats['requests']} requests, {stats['errors']} errors", flush=True)


def serve(args, extra, names) -> None:
    port = free_port()
    cmd = radixserve_command(port, ["--enable-dashboard", "--api-key", KEY, *extra,
                                    *args.server_args])
    log = os.path.join(args.out_dir, "logs", "dashboard-screens-server.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with LaunchedServer(cmd, port, log, timeout=900) as server:
        asyncio.run(shots(server.base_url, args.out_dir, names, args.load_s, args.concurrency))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--load-s", type=float, default=40.0, help="seconds of load between shots")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--privacy", action="store_true",
                   help="also a shot of a server with --no-dashboard-show-text")
    p.add_argument("server_args", nargs="*", help="more `radixserve serve` flags (after --)")
    args = p.parse_args(argv)
    if find_chromium() is None:
        print("no chromium binary on PATH (Debian: apt-get update && apt-get install -y "
              "chromium)", file=sys.stderr)
        return 2
    serve(args, [], ["dashboard-early.png", "dashboard-load.png"])
    if args.privacy:
        serve(args, ["--no-dashboard-show-text"], [None, "dashboard-no-text.png"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
