"""`radixserve serve | convert | bench`: the command line.

    radixserve serve [--model-path DIR] [every ServerArgs flag]   (no model: the default model)
    radixserve convert --gguf FILE --out DIR                       (GGUF -> HF-style directory)
    radixserve bench [ARGS...]      (bench/serving.py of a source checkout: the load generator)

`python -m radixserve` is this CLI; `python -m radixserve.launch_server [flags]` is `serve`.
"""
from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys
from typing import List, Optional

from radixserve.config import ServerArgs

LOG_FORMAT = "[%(asctime)s %(levelname)s %(name)s] %(message)s"


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, datefmt="%H:%M:%S", force=True)


def serve_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Serve a model over HTTP "
                                     "(OpenAI-compatible and native routes).")
    ServerArgs.add_cli_args(parser)
    return parser


def run_serve(ns: argparse.Namespace) -> int:
    """Build ServerArgs from parsed flags, check them (exit 2 with the message), serve."""
    args = ServerArgs.from_cli_args(ns)
    if args.log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
        print(f"radixserve: error: --log-level must be one of critical, error, warning, info, "
              f"debug; got {args.log_level!r}", file=sys.stderr)
        return 2
    args.log_level = args.log_level.lower()
    try:
        args.check()
    except ValueError as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2
    setup_logging("debug" if args.log_level == "trace" else args.log_level)
    from radixserve.server.app import serve
    return serve(args)


def run_convert(ns: argparse.Namespace) -> int:
    setup_logging("info")
    from radixserve.model.gguf_convert import convert_gguf
    out = convert_gguf(ns.gguf, ns.out)
    print(out if out is not None else ns.out)
    return 0


def bench_script() -> Optional[str]:
    """bench/serving.py next to pysrc/ in a source checkout (or editable install); else None."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "bench", "serving.py")
    return path if os.path.isfile(path) else None


def run_bench(argv: List[str]) -> int:
    script = bench_script()
    if script is None:
        print("radixserve: error: bench needs a source checkout (bench/serving.py was not found "
              "next to the package); run it from the repository", file=sys.stderr)
        return 2
    sys.argv = [script] + list(argv)
    runpy.run_path(script, run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP",
                           description="Serve a model over HTTP (OpenAI-compatible and native routes).")
    ServerArgs.add_cli_args(serve)
    convert = sub.add_parser("convert", help="convert a GGUF file into an HF-style model directory")
    convert.add_argument("--gguf", required=True, help="path of the .gguf file")
    convert.add_argument("--out", required=True, help="output directory")
    sub.add_parser("bench", help="run the serving load generator (bench/serving.py; --help for "
                   "its flags)", add_help=False)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return run_bench(argv[1:])
    ns = build_parser().parse_args(argv)
    if ns.command == "serve":
        return run_serve(ns)
    return run_convert(ns)


if __name__ == "__main__":
    sys.exit(main())
