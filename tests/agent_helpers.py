"""Helpers shared by the integration tests (real agent, real S3 server)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from agent.testing import AgentProcess, InProcessAgent, RecordedRequest

# An agent serving on its socket: in this process, or a daemon subprocess.
RunningAgent = InProcessAgent | AgentProcess
# start_agent(config_toml="", s3=None) -> a started agent (see conftest).
AgentFactory = Callable[..., RunningAgent]
# start_agent_process(config_toml="", s3=None) -> a started daemon subprocess.
ProcessFactory = Callable[..., AgentProcess]


def tree_digest(directory: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``directory``."""
    return {
        path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def cache_entries(agent: RunningAgent) -> dict[str, list[str]]:
    """What each tier holds in each of its areas (published, staging, manifests...)."""
    found: dict[str, list[str]] = {}
    for tier_root in (agent.shm_root, agent.disk_root):
        for area in ("snapshots", "manifests", "staging", "trash"):
            directory = tier_root / area
            if directory.is_dir():
                names = sorted(p.name for p in directory.iterdir())
                if names:
                    found[f"{tier_root.name}/{area}"] = names
    return found


def object_gets(requests: list[RecordedRequest]) -> list[RecordedRequest]:
    """The object GETs among ``requests`` (listings and HEADs left out)."""
    return [r for r in requests if r.method == "GET" and r.key is not None]
