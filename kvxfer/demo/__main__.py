"""``python -m kvxfer.demo``: the ``kvxfer demo`` command on its own."""

import sys

from kvxfer.demo._cli import main

sys.exit(main())
