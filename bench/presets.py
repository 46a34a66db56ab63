"""bench/presets.py of a checkout: radixserve.bench.presets (`radixserve bench presets`), run or
imported (`from presets import build_preset`) from here."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc"))
from radixserve.bench.presets import *  # noqa: E402,F401,F403
from radixserve.bench.presets import PRESETS, build_preset, ordinary_vocab_end  # noqa: E402,F401

if __name__ == "__main__":
    from radixserve.bench import run
    sys.exit(run("presets", sys.argv[1:]))
