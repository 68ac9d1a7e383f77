"""``python -m agent`` runs the daemon, like ``prewarmd``."""

import sys

from agent._daemon import main

sys.exit(main())
