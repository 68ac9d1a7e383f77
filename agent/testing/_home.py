"""Where a test agent lives: one short directory with its socket, tiers, config and log.

``AgentProcess`` (the daemon in a subprocess) and an agent run inside the test
process lay out the same directory and hand the daemon the same ``PREWARM_*``
paths; ``AgentHome`` is that layout, once.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ._process import Startable, purge_tree, read_log
from ._signing import shared_keys

__all__ = ["AgentHome", "compile_cache_env"]


class AgentHome(Startable):
    """The directory layout of one test agent, for a subclass to start and stop.

    ``root`` is made with a short name in ``parent`` (/tmp unless given),
    because an AF_UNIX path holds at most 107 bytes; a ``root`` given instead
    is the caller's, and ``remove_home()`` keeps it. Under it: ``agent.sock``,
    the ``shm`` and ``disk`` tier roots (left for the daemon to create),
    ``agent.toml`` and ``agent.log``.
    """

    def __init__(self, *, root: Path | None = None, parent: Path | None = None) -> None:
        self._owns_root = root is None
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="pw-", dir=parent or "/tmp"))
        self.root = root
        self.socket_path = root / "agent.sock"
        self.shm_root = root / "shm"
        self.disk_root = root / "disk"
        self.config_path = root / "agent.toml"
        self.log_path = root / "agent.log"

    @property
    def target(self) -> str:
        """The gRPC target of the agent's socket."""
        return f"unix:{self.socket_path}"

    def home_env(self) -> dict[str, str]:
        """The ``PREWARM_*`` variables that point the daemon at this layout."""
        return {
            "PREWARM_SOCKET_PATH": str(self.socket_path),
            "PREWARM_TIERS__SHM_ROOT": str(self.shm_root),
            "PREWARM_TIERS__DISK_ROOT": str(self.disk_root),
            "PREWARM_CONFIG": str(self.config_path),
        } | compile_cache_env()

    def log_text(self) -> str:
        """Everything in ``agent.log``, across restarts."""
        return read_log(self.log_path)

    def remove_home(self) -> None:
        """Remove the root if this object made it (read-only snapshots included)."""
        if self._owns_root:
            purge_tree(self.root)


def compile_cache_env() -> dict[str, str]:
    """The compile-cache settings every test agent has: the shared key signs and is trusted
    (agent.testing._signing), so two test agents restore each other's caches; uploads are not
    paced, since tests push again and again on purpose (the pacing has tests of its own)."""
    keys = shared_keys()
    return {
        "PREWARM_COMPILE_CACHE__SIGNING_KEY": str(keys.private),
        "PREWARM_COMPILE_CACHE__TRUSTED_KEYS": json.dumps([str(keys.trusted)]),
        "PREWARM_COMPILE_CACHE__MIN_UPLOAD_INTERVAL_SECONDS": "0",
    }
