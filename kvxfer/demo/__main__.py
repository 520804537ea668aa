"""``python -m kvxfer.demo``: the ``kvxfer demo`` command on its own."""

import sys

from kvxfer.demo.command import main

sys.exit(main())
