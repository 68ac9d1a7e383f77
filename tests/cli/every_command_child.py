"""Every ``prewarm`` command on one socket path, in this one process; the results as JSON.

argv: SOCKET_PATH. Runs as the user a test has made of it (``setpriv``: a user outside
the socket's group), so that one interpreter stands for every command instead of one
each. Prints ``{"ls": [STATUS, STDERR], "compile push": [...], ...}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for cli_helpers

from cli_helpers import run_every_command


def main() -> int:
    print(json.dumps(run_every_command(Path(sys.argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
