"""``python -m mixprec ...``: the ``mixprec`` command (see :mod:`mixprec.cli`)."""

import sys

from mixprec.cli import main

sys.exit(main())
