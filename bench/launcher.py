"""bench/launcher.py of a checkout: radixserve.bench.launcher, for the bench/ scripts that do
`from launcher import LaunchedServer, ...`."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc"))
from radixserve.bench.launcher import *  # noqa: E402,F401,F403
from radixserve.bench.launcher import (PYSRC, LaunchedServer, checkout_env, free_port,  # noqa: E402,F401
                                       radixserve_command, source_revision, stop_servers_on_sigterm)
