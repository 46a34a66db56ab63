"""`radixserve bench SUBCOMMAND`: the benchmarks that ship with the package.

    radixserve bench serving ...   load generator for a running server (radixserve, SGLang, vLLM:
                                   any OpenAI-compatible one) or for radixserve servers it launches
    radixserve bench offline ...   radixserve.Engine output tokens/s against HF transformers
    radixserve bench presets ...   a model directory with a published model's shapes
    radixserve bench plots ...     redraw the PNG plots of a saved serving result

`radixserve bench --port 30000 ...` (no subcommand) is `radixserve bench serving --port 30000
...`. Importing this package is cheap: each subcommand's module (httpx, aiohttp, matplotlib,
torch) is imported when it runs. `python -m radixserve.bench` is the same dispatcher.
"""
from __future__ import annotations

import importlib
import sys
from typing import Dict, List, Optional, Tuple


class BenchError(Exception):
    """A benchmark that cannot run as asked (an unreachable server, a fact it cannot find);
    the message says what to change. `radixserve bench` prints it and exits 2."""


class RequestsFailed(Exception):
    """A benchmark that ran but had failed requests (`bench serving` without --allow-failures);
    .result is its result, already written. `radixserve bench` prints the message and exits 1."""

    def __init__(self, message: str, result: Optional[dict] = None):
        super().__init__(message)
        self.result = result


# name -> (module, one line of help)
SUBCOMMANDS: Dict[str, Tuple[str, str]] = {
    "serving": ("radixserve.bench.serving",
                "load generator for a running server (or ones it launches): TTFT, ITL, throughput"),
    "offline": ("radixserve.bench.offline",
                "radixserve.Engine output tokens/s vs HF transformers on the same prompts"),
    "presets": ("radixserve.bench.presets",
                "build a model directory with a published model's shapes (dummy weights)"),
    "plots": ("radixserve.bench.plots", "redraw the PNG plots of a saved serving result"),
}


def usage() -> str:
    lines = ["usage: radixserve bench {" + ",".join(SUBCOMMANDS) + "} [ARGS...]", "",
             "subcommands (`radixserve bench NAME --help` lists the flags of each):"]
    lines += [f"  {name:<9} {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    lines += ["", "`radixserve bench --port 30000 ...` (flags, no subcommand) means serving."]
    return "\n".join(lines)


def run(name: str, argv: List[str]) -> int:
    """Run subcommand name's main(argv); its exit status: 0; 1 (message on stderr) when
    requests failed (RequestsFailed); 2 (message on stderr) for a BenchError or a missing
    optional dependency; argparse's status for --help (0) or a bad flag (2); 143 after SIGTERM
    while it ran servers."""
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        module.main(list(argv))
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BenchError as e:
        print(f"radixserve bench {name}: error: {e}", file=sys.stderr)
        return 2
    except RequestsFailed as e:
        print(f"radixserve bench {name}: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:
        if e.name not in ("httpx", "aiohttp", "matplotlib", "transformers"):
            raise
        print(f"radixserve bench {name}: error: {e}; pip install 'radixserve[bench]' "
              f"(httpx, aiohttp, matplotlib)", file=sys.stderr)
        return 2
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Dispatch argv (sys.argv[1:] when None) to a subcommand; flags first means serving."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0].startswith("-"):
        return run("serving", argv)
    if argv[0] not in SUBCOMMANDS:
        print(f"{usage()}\nradixserve bench: error: unknown subcommand {argv[0]!r}; choose one "
              f"of {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    return run(argv[0], argv[1:])
