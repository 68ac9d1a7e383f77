"""``python -m agent`` runs the daemon, like ``prewarmd``."""

from agent._daemon import exit_with, main

exit_with(main())
