"""`python -m radixserve.launch_server [flags]`: the same as `radixserve serve [flags]`."""
from __future__ import annotations

import sys
from typing import List, Optional

from radixserve.cli import parse_args, run_serve, serve_parser


def main(argv: Optional[List[str]] = None) -> int:
    ns, status = parse_args(serve_parser("python -m radixserve.launch_server"), argv)
    return status if ns is None else run_serve(ns)


if __name__ == "__main__":
    sys.exit(main())
