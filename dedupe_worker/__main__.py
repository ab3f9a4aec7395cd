"""``python -m dedupe_worker`` is the ``dedupe-worker`` command."""

import sys

from .cli import main

sys.exit(main())
