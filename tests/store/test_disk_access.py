"""The disk grants what the API grants (issue 16, hole 1), tried as a real unprivileged user.

Tier roots were world-readable: any local user listed ``manifests/`` (every cached URI) and
read every snapshot. Now a root and its ``snapshots/`` are traverse-only, the agent's own
state (manifests, usage, staging, trash, keys, pins) is its alone, and each published
snapshot lives under an unguessable name (an HMAC of its key under the root's secret), so
only a process the API handed the path can open it. With ``tiers.group`` set, only that
group may even traverse the roots.

The tests run as root; the other user is uid 65534 with no groups (or one named group), in a
subprocess of the system's own Python (the project's venv is not readable by that user).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from agent_helpers import AgentFactory
from store_helpers import key_of, open_store, publish

from agent._vocabulary import TierName
from agent.client import Client, ModelHandle
from agent.testing import InProcessAgent, SampleModel, upload_model

NOBODY = 65534
# A group that exists on any Debian-like system, standing in for the pods' group.
GROUP, GROUP_ID = "users", 100
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")

# Tries each (action, path) as the user it runs as; prints what happened to each.
PROBE = r"""
import errno, json, os, sys
def attempt(action, path):
    try:
        if action == "list":
            os.listdir(path)
        else:
            with open(path, "rb") as handle:
                handle.read(1)
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps({f"{a} {p}": attempt(a, p) for a, p in json.loads(sys.argv[1])}))
"""

pytestmark = pytest.mark.skipif(
    SYSTEM_PYTHON is None or os.geteuid() != 0, reason="needs root and /usr/bin/python3"
)


def _as_nobody(attempts: list[tuple[str, Path]], groups: tuple[int, ...] = ()) -> dict[str, str]:
    """Each attempt's outcome ("ok" or the errno name) for uid/gid 65534 with ``groups``."""
    assert SYSTEM_PYTHON is not None
    result = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", PROBE, json.dumps([(a, str(p)) for a, p in attempts])],
        user=NOBODY,
        group=NOBODY,
        extra_groups=list(groups),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd="/",
    )
    outcome: dict[str, str] = json.loads(result.stdout)
    return outcome


def _reachable(agent: InProcessAgent) -> None:
    """Let others walk to the tier roots, as they can walk to /dev/shm and /var/lib."""
    agent.root.chmod(0o755)


@pytest.fixture
def second_model(
    s3_client: Any,
    bucket: str,
    small_model_source: tuple[Path, MappingProxyType[str, Any]],
) -> SampleModel:
    """The small model again under another prefix: a second snapshot beside the first."""
    directory, tensors = small_model_source
    return upload_model(s3_client, bucket, "models/other", directory, tensors=tensors)


def _what_a_local_user_knows(
    tier_root: Path, handle: ModelHandle, key: str
) -> list[tuple[str, Path]]:
    """Everything worth trying on a root for the snapshot ``key`` (its key and URI can be
    worked out by anyone who may list its bucket), without the path the API hands out."""
    return [
        ("list", tier_root),
        ("list", tier_root / "snapshots"),
        ("list", tier_root / "manifests"),
        ("read", tier_root / "manifests" / f"{key}.json"),
        ("read", tier_root / "usage" / f"{key}.json"),
        ("list", tier_root / "staging"),
        ("list", tier_root / "trash"),
        ("read", tier_root / "journal.key"),
        ("list", tier_root / "snapshots" / key),
        ("read", tier_root / "snapshots" / key / handle.files[0].path),
    ]


@pytest.mark.parametrize("tier", ["shm", "disk"])
def test_a_local_user_reads_only_the_snapshot_it_was_handed(
    agent_daemon: InProcessAgent,
    small_model: SampleModel,
    second_model: SampleModel,
    tier: TierName,
) -> None:
    """Two snapshots cached on a tier; an unprivileged user handed the path of the first can
    list and read it, and cannot list the root, snapshots/ or manifests/, read a manifest,
    usage record or the root's key, or open the second snapshot by its key."""
    _reachable(agent_daemon)
    with Client(agent_daemon.socket_path) as client:
        handed = client.ensure(small_model.uri, tier=tier)
        other = client.ensure(second_model.uri, tier=tier)
    tier_root = agent_daemon.shm_root if tier == "shm" else agent_daemon.disk_root
    assert other.path.parent == tier_root / "snapshots"
    probes = _what_a_local_user_knows(tier_root, other, other.key)
    probes += [("list", handed.path)]
    probes += [("read", handed.path / file.path) for file in handed.files]
    outcome = _as_nobody(probes)
    allowed = {f"list {handed.path}"} | {f"read {handed.path / f.path}" for f in handed.files}
    assert {probe for probe, result in outcome.items() if result == "ok"} == allowed, outcome


def test_with_a_traverse_group_a_handed_path_is_useless_outside_the_group(
    start_agent: AgentFactory, small_model: SampleModel
) -> None:
    """`tiers.group` set: a member of that group reads the snapshot at the path it was handed;
    a user outside it, holding the same path, cannot even enter the root."""
    agent = start_agent(f'[tiers]\ngroup = "{GROUP}"\n')
    assert isinstance(agent, InProcessAgent)
    _reachable(agent)
    with Client(agent.socket_path) as client:
        handed = client.ensure(small_model.uri)
    probes = [("read", handed.path / file.path) for file in handed.files]
    member = _as_nobody(probes, groups=(GROUP_ID,))
    outsider = _as_nobody(probes)
    assert set(member.values()) == {"ok"}, member
    assert set(outsider.values()) == {"EACCES"}, outsider
    info = agent.shm_root.stat()
    assert (info.st_gid, stat.S_IMODE(info.st_mode)) == (GROUP_ID, 0o710)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


async def test_pods_may_only_traverse_to_snapshots_and_the_rest_is_the_agents_alone(
    tmp_path: Path,
) -> None:
    """The layout's modes: root and snapshots/ 0711, a snapshot 0555 with 0444 files under a
    name that is not its key, every other directory 0700 and every file of the agent's 0600."""
    store = await open_store(tmp_path)
    model = await publish(store, 1)
    root = tmp_path / "shm"
    assert model.path.parent == root / "snapshots"
    assert model.path.name != model.key
    assert len(model.path.name) == 32
    assert (_mode(root), _mode(root / "snapshots")) == (0o711, 0o711)
    assert (_mode(model.path), _mode(model.path / "weights.bin")) == (0o555, 0o444)
    for private in ("manifests", "usage", "staging", "trash"):
        assert _mode(root / private) == 0o700, private
    for record in (root / "manifests" / f"{model.key}.json", root / "journal.key"):
        assert _mode(record) == 0o600, record


async def test_a_snapshot_under_the_old_world_readable_layout_is_rehomed_at_start(
    tmp_path: Path,
) -> None:
    """A root as the agent left it before: 0755 everywhere, manifests 0644, the snapshot under
    its key. At start the snapshot moves under its unguessable name (no byte copied), is still
    served, every directory gets its new mode and every file at the top is made 0600."""
    store = await open_store(tmp_path)
    model = await publish(store, 1)
    root = tmp_path / "shm"
    legacy = root / "snapshots" / model.key
    model.path.rename(legacy)
    inode = legacy.stat().st_ino
    for directory in (root, *(p for p in root.iterdir() if p.is_dir())):
        directory.chmod(0o755)
    (root / "manifests" / f"{model.key}.json").chmod(0o644)
    (root / "prefetch-pins.json").write_text("{}")
    (root / "prefetch-pins.json").chmod(0o644)
    reopened = await open_store(tmp_path)
    served = reopened.get(model.key)
    assert served is not None
    assert served.path == model.path
    assert not legacy.exists()
    assert served.path.stat().st_ino == inode
    assert (_mode(root), _mode(root / "snapshots"), _mode(root / "manifests")) == (
        0o711,
        0o711,
        0o700,
    )
    assert _mode(root / "prefetch-pins.json") == 0o600


async def test_an_old_layout_directory_without_a_manifest_is_removed_not_served(
    tmp_path: Path,
) -> None:
    """A directory named by a key in snapshots/ with no manifest (renamed, never published)
    and no journal to resume it is removed at start, as before."""
    await open_store(tmp_path)
    stray = tmp_path / "shm" / "snapshots" / key_of(5)
    (stray / "sub").mkdir(parents=True)
    reopened = await open_store(tmp_path)
    assert reopened.get(key_of(5)) is None
    assert not stray.exists()
