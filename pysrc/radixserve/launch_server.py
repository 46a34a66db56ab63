"""`python -m radixserve.launch_server [flags]`: the same as `radixserve serve [flags]`."""
from __future__ import annotations

import sys
from typing import List, Optional

from radixserve.cli import run_serve, serve_parser


def main(argv: Optional[List[str]] = None) -> int:
    return run_serve(serve_parser("python -m radixserve.launch_server").parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
