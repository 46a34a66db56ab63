"""radixserve: an LLM serving runtime organised around KV reuse (see DESIGN.md).

`radixserve.Engine` is the offline API (engine/engine.py); it is imported lazily so that
`import radixserve` stays cheap for the CLI.
"""
from typing import Any

__version__ = "0.1.0"
__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.engine.engine import Engine
        return Engine
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
