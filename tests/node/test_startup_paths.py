"""prewarmd started by a user who may not create its paths: one clear error, nothing left behind.

With the defaults, a non-root user may create ``/dev/shm/prewarm`` but not
``/var/lib/prewarm`` or ``/run/prewarm``. A start that made the first and died
on the second left a root owned by that user, which the next start as root
refuses as another user's. The interpreter here lives under /root, where no
other uid may enter, so the daemon runs as uid 0 without CAP_DAC_OVERRIDE
(``setpriv``) in directories owned by nobody: the kernel refuses it there
exactly as it refuses a non-root user in /var/lib.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NOBODY = 65534


def test_a_start_that_cannot_create_a_root_names_it_and_creates_nothing(tmp_path: Path) -> None:
    """A disk root (and socket) this user may not create: exit 1 naming each path and the fix,
    no traceback, and the shm root it could have created is not created."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to drop the DAC capabilities")
    writable, locked = tmp_path / "writable", tmp_path / "locked"
    writable.mkdir()
    locked.mkdir(mode=0o755)
    os.chown(locked, NOBODY, NOBODY)  # like /var/lib and /run for a non-root user
    config = tmp_path / "agent.toml"
    config.write_text("")
    env = {
        "PATH": "/usr/bin:/bin",
        "PREWARM_CONFIG": str(config),
        "PREWARM_TIERS__SHM_ROOT": str(writable / "shm"),
        "PREWARM_TIERS__DISK_ROOT": str(locked / "disk"),
        "PREWARM_SOCKET_PATH": str(locked / "run" / "agent.sock"),
    }
    without_dac = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]
    result = subprocess.run(
        [*without_dac, sys.executable, "-m", "agent"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"the disk tier root {locked / 'disk'} ({locked} is not writable)" in result.stderr
    assert f"the API socket {locked / 'run' / 'agent.sock'} ({locked} is not writable)" in (
        result.stderr
    )
    assert "Run it as root" in result.stderr
    assert "Nothing was created." in result.stderr
    assert list(writable.iterdir()) == []
    assert list(locked.iterdir()) == []
