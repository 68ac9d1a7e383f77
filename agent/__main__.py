"""``python -m agent`` runs the daemon, like ``prewarmd``."""

import sys

from ._daemon import main

sys.exit(main())
