"""radixserve: an LLM serving runtime organised around KV reuse (see docs/ARCHITECTURE.md).

`radixserve.Engine` is the offline API (offline.py); it is imported lazily so that
`import radixserve` stays cheap for the CLI. The package root sits above every layer
(tests/unit/test_import_layers.py): modules below read the version from version.py.
"""
import os
from typing import Any

# The engine runs each forward on a worker thread while the event-loop thread issues its own small
# torch ops; with libgomp's default active waiting the two OpenMP thread teams spin against each
# other on a few cores (measured on 2 cores: decode steps ~30% slower). Passive waiting avoids
# that. It only takes effect when radixserve is imported before torch (the CLI, the server, the
# benches); an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from radixserve.version import __version__  # noqa: E402  (after the OpenMP policy)

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.offline import Engine
        return Engine
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
