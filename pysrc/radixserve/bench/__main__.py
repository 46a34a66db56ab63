"""`python -m radixserve.bench SUBCOMMAND ...` is `radixserve bench SUBCOMMAND ...`."""
import sys

from radixserve.bench import main

sys.exit(main())
