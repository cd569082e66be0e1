"""``python -m kvtier``: the same command line as ``kvtier``."""

import sys

from kvtier.cli import main

sys.exit(main())
