"""``python -m opmux.cli``: the ``opmux`` command."""

import sys

from opmux.cli import main

sys.exit(main())
