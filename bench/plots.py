"""bench/plots.py of a checkout: radixserve.bench.plots (`radixserve bench plots`), run from here."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc"))
from radixserve.bench import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("plots", sys.argv[1:]))
