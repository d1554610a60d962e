"""``python -m scalescope``: the same command line as the ``scalescope`` script."""

import sys

from .cli import main

sys.exit(main())
