"""`python -m radixserve ...` == the `radixserve` command."""
import sys

from radixserve.cli import main

sys.exit(main())
