"""The compile-cache watcher at the inotify watch limit (issue 16, item 7).

A pod that makes many directories in its compile cache uses up inotify watches (one per
directory). At the limit, the watcher used to stop watching new directories silently, and
a victim's artifacts were never uploaded. Run in a child process in a user namespace of
its own (``tests/compile/compile_watch_child.py``), whose watch limit is lowered for that
namespace only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("compile_watch_child.py")
REPO = str(Path(__file__).resolve().parents[2])
WATCH_LIMIT = 150


def _run_at_the_watch_limit(root: Path) -> dict[str, object]:
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    in_a_namespace = ["unshare", "--user", "--map-root-user"]
    done = subprocess.run(
        [*in_a_namespace, sys.executable, str(CHILD), str(root), str(WATCH_LIMIT)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=CHILD.parent,
        # The child imports the shared helpers in tests/, as pytest's pythonpath does.
        env=os.environ | {"PYTHONPATH": os.pathsep.join([str(CHILD.parents[1]), REPO])},
    )
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"cannot make a user namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.slow
def test_at_the_watch_limit_the_watcher_says_so_and_keys_are_still_uploaded(
    tmp_path: Path,
) -> None:
    """One pod's key directory fills the inotify watch limit; another pod's new key still gets
    its artifacts uploaded (the watcher falls back to polling), and the agent logs an error
    and counts it in prewarm_compile_watch_limit_total: never silent."""
    result = _run_at_the_watch_limit(tmp_path)
    assert result["victim_uploaded"] is True
    assert any("inotify" in str(line) for line in result["errors"])  # type: ignore[attr-defined]
    assert result["watch_limit_metric"] == 1.0
