"""``python -m rope_dedup``: the ``rope-dedup`` command line."""

import sys

from rope_dedup.tools.cli import main

sys.exit(main())
