"""``python -m benchmarks [--quick]``: every benchmark, one table (see ``benchmarks/run.py``)."""

import sys

from benchmarks.run import main

sys.exit(main())
