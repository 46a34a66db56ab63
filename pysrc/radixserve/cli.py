"""`radixserve serve | convert | bench | env`: the command line.

    radixserve serve [--model-path DIR] [every ServerArgs flag]   (no model: the default model;
                                           --dp-size N: N replicas behind smg, replicas.py)
    radixserve convert --gguf FILE --out DIR                       (GGUF -> HF-style directory)
    radixserve bench serving|offline|presets|plots [ARGS...]   (the benchmarks: radixserve.bench)
    radixserve env                  (versions, GPU, CUDA kernels' state, cache path: bug reports)
    radixserve advise --url URL [--api-key KEY]    (the prefix-cache advisor's report of a
                                           server started with --enable-dashboard)

`python -m radixserve` is this CLI; `python -m radixserve.launch_server [flags]` is `serve`.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

from radixserve.config import HelpFormatter, ServerArgs, serve_epilog
from radixserve.version import __version__

LOG_FORMAT = "[%(asctime)s %(levelname)s %(name)s] %(message)s"
SERVE_DESCRIPTION = "Serve a model over HTTP (OpenAI-compatible and native routes)."


class Parser(argparse.ArgumentParser):
    """Every parser of the CLI (subparsers too: add_subparsers makes them of this class): flags
    are never abbreviated (`--tp 1` is an error, not --tp-size), and an unrecognized flag that
    starts some flag's name says which."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def flag_names(self) -> List[str]:
        """The documented flags of this parser and of its subcommands."""
        names: List[str] = []
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    names += sub.flag_names() if isinstance(sub, Parser) else []
            elif action.help is not argparse.SUPPRESS and not getattr(action, "hidden", False):
                names += action.option_strings
        return names

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            names = sorted(set(self.flag_names()))
            for arg in message.split(":", 1)[1].split():
                flag = arg.split("=", 1)[0]
                longer = [n for n in names if flag.startswith("--") and n.startswith(flag)]
                if longer:
                    message += (f" (flags are not abbreviated: did you mean "
                                f"{' or '.join(longer[:4])}?)")
        super().error(message)


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}",
                        help="print `radixserve <version>` and exit")


def _serve_parser_kwargs() -> dict:
    return dict(description=SERVE_DESCRIPTION, epilog=serve_epilog(),
                formatter_class=HelpFormatter,
                usage="%(prog)s [--model-path PATH] [flags: --help lists them]")


def parse_args(parser: argparse.ArgumentParser, argv: Optional[List[str]]):
    """(namespace, None), or (None, exit status) where argparse exits: --help and --version
    (0), a bad or refused flag (2, its message on stderr)."""
    try:
        return parser.parse_args(argv), None
    except SystemExit as e:
        return None, e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, datefmt="%H:%M:%S", force=True)


def serve_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser of `python -m radixserve.launch_server` (the flags of `radixserve serve`)."""
    parser = Parser(prog=prog, **_serve_parser_kwargs())
    add_version_flag(parser)
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
    if args.dp_size > 1:            # N replicas behind SGLang's model gateway (replicas.py)
        from radixserve import replicas
        if not replicas.gateway_installed():
            print(f"radixserve: error: {replicas.missing_gateway_message(args.dp_size)}",
                  file=sys.stderr)
            return 2
        setup_logging("debug" if args.log_level == "trace" else args.log_level)
        return replicas.serve_replicas(args)
    setup_logging("debug" if args.log_level == "trace" else args.log_level)
    from radixserve.server.app import serve
    return serve(args)


def run_convert(ns: argparse.Namespace) -> int:
    setup_logging("info")
    from radixserve.model.gguf_convert import convert_gguf
    out = convert_gguf(ns.gguf, ns.out)
    print(out if out is not None else ns.out)
    return 0


def run_bench(argv: List[str]) -> int:
    """`radixserve bench SUBCOMMAND ...` (radixserve.bench.main: serving, offline, presets,
    plots; flags first means serving). Its exit status (radixserve.bench.run)."""
    from radixserve.bench import main as bench_main
    return bench_main(argv)


def run_advise(ns: argparse.Namespace) -> int:
    """GET <url>/dashboard/advice and print it (cache/advisor.format_report, or the JSON).
    0, or 1 with the reason on stderr when the server cannot be reached or refuses."""
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    from radixserve import knobs
    from radixserve.cache.advisor import format_report

    query = {k: v for k, v in (("last", ns.last), ("min_members", ns.min_members),
                               ("min_tail", ns.min_tail)) if v is not None}
    url = ns.url.rstrip("/") + "/dashboard/advice"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    key = ns.api_key if ns.api_key is not None else knobs.value("RADIXSERVE_API_KEY")
    headers = {"Accept": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=ns.timeout) as r:
            report = json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        hint = (" (is the server started with --enable-dashboard?)" if e.code == 404 else
                " (pass --api-key, or set RADIXSERVE_API_KEY)" if e.code == 401 else "")
        print(f"radixserve advise: error: {url}: {e.code} {message}{hint}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"radixserve advise: error: cannot read {url}: {getattr(e, 'reason', e)}",
              file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2, ensure_ascii=False) if ns.json else format_report(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="radixserve", description=__doc__.splitlines()[0])
    add_version_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)   # subparsers: Parser too
    serve = sub.add_parser("serve", help="serve a model over HTTP (--help lists every flag)",
                           **_serve_parser_kwargs())
    add_version_flag(serve)
    ServerArgs.add_cli_args(serve)
    convert = sub.add_parser("convert", help="convert a GGUF file into an HF-style model directory")
    convert.add_argument("--gguf", required=True, help="path of the .gguf file")
    convert.add_argument("--out", required=True, help="output directory")
    sub.add_parser("bench", help="the benchmarks: bench serving|offline|presets|plots "
                   "(`radixserve bench --help` lists them)", add_help=False)
    sub.add_parser("env", help="print versions, GPUs, the CUDA kernels' state and the default "
                   "model's cache path (for bug reports)")
    advise = sub.add_parser(
        "advise", help="the prefix-cache advisor's report of a running server (one started "
        "with --enable-dashboard): families of recent prompts that share a start, diverge in a "
        "short span and share a long text again, ranked by the prompt tokens moving that span "
        "after the shared text would save", formatter_class=HelpFormatter)
    advise.add_argument("--url", required=True, default=argparse.SUPPRESS,
                        help="the server's base URL, e.g. http://127.0.0.1:30000")
    advise.add_argument("--api-key", default=None, metavar="KEY",
                        help="Bearer key (the admin key when the server has one); default: "
                        "$RADIXSERVE_API_KEY, else none")
    advise.add_argument("--last", type=int, default=None, metavar="N",
                        help="only the last N recent prompts (the server keeps 256); default: all")
    advise.add_argument("--min-members", type=int, default=None, metavar="N",
                        help="prompts a family needs; default: the server's (3)")
    advise.add_argument("--min-tail", type=int, default=None, metavar="TOKENS",
                        help="tokens the shared text after the span needs; default: the "
                        "server's (16)")
    advise.add_argument("--json", action="store_true", help="print the report as JSON")
    advise.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="seconds to wait for the server")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return run_bench(argv[1:])
    ns, status = parse_args(build_parser(), argv)
    if ns is None:
        return status
    if ns.command == "serve":
        return run_serve(ns)
    if ns.command == "env":
        from radixserve.env_report import main as run_env
        return run_env()
    if ns.command == "advise":
        return run_advise(ns)
    return run_convert(ns)


if __name__ == "__main__":
    sys.exit(main())
