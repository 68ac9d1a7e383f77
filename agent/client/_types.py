"""Plain, frozen values the client hands back; no protobuf leaks past the client."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from agent._vocabulary import DataPlaneName, PhaseName, TierName

__all__ = [
    "AgentStatus",
    "DataPlaneName",
    "EvictResult",
    "FileEntry",
    "FileProblem",
    "LeaseGrant",
    "LeaseInfo",
    "ModelHandle",
    "ModelInfo",
    "PhaseName",
    "PhaseTimings",
    "Progress",
    "PullStatus",
    "TierName",
    "TierStatus",
    "Verification",
]

# TierName, DataPlaneName and PhaseName are the agent's own words (agent._vocabulary),
# re-exported here so a pod finds them next to the values that carry them.


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a snapshot, relative to the model directory."""

    path: str
    size: int
    # ETag (or version id) of the S3 object the file came from.
    etag: str


@dataclass(frozen=True, slots=True)
class PhaseTimings:
    """Where the time of one EnsureModel call went, in seconds."""

    resolve: float
    # Time spent waiting for a pull that another request had started.
    wait: float
    download: float
    verify: float
    publish: float
    total: float


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A lease the agent granted: the snapshot is not evicted while it lives.

    Hold it open with ``LeaseHold`` (or use ``Client.leased``), or renew it
    with ``Client.renew_lease`` before ``expires``.
    """

    id: str
    key: str
    # When the lease ends unless renewed or held open; None while a
    # connection holds it open (it then ends when that connection closes).
    expires: datetime | None
    # The agent's lease socket, as a path on the node.
    socket_path: Path


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """A live lease on a cached snapshot, as the agent lists it."""

    id: str
    client_name: str
    # The process holding the lease connection (SO_PEERCRED); None while
    # nobody holds it open. uid 0 is root, not "unknown".
    pid: int | None
    uid: int | None
    gid: int | None
    acquired: datetime
    # None while the lease is held open by a connection.
    expires: datetime | None
    held: bool


@dataclass(frozen=True, slots=True)
class ModelHandle:
    """A complete, published snapshot on this node, ready to be mapped."""

    uri: str
    key: str
    path: Path
    tier: TierName
    # True when the snapshot was already cached and no byte moved.
    hit: bool
    files: tuple[FileEntry, ...]
    total_bytes: int
    timings: PhaseTimings
    # True when the newest cached snapshot was served without checking that it
    # is still current: S3 was unreachable, or the call asked for cached_only.
    resolved_offline: bool
    # Set when ensure() asked for a lease.
    lease: LeaseGrant | None = None
    # Bytes that a resumed pull did not have to fetch again.
    resumed_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Progress:
    """One progress event of a pull."""

    phase: PhaseName
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    # Snapshot key; empty until the URI is resolved.
    key: str


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A cached snapshot as the agent's store sees it."""

    uri: str
    key: str
    path: Path
    tier: TierName
    total_bytes: int
    file_count: int
    created: datetime
    last_used: datetime
    hit_count: int
    files: tuple[FileEntry, ...]
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    leases: tuple[LeaseInfo, ...] = ()
    # Pinned snapshots are never evicted by pressure.
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class EvictResult:
    """What an eviction (or a garbage collection) removed."""

    evicted: tuple[ModelInfo, ...]
    bytes_freed: int


@dataclass(frozen=True, slots=True)
class TierStatus:
    """One cache tier and the filesystem under it."""

    tier: TierName
    root: Path
    # Size of the filesystem the tier lives on.
    capacity_bytes: int
    # Bytes held by published snapshots of this tier.
    used_bytes: int
    # Free bytes on the filesystem.
    free_bytes: int
    model_count: int
    # Most bytes the cache may hold on this tier.
    budget_bytes: int = 0
    # Free space always left on the filesystem.
    reserve_bytes: int = 0
    # Bytes held by pulls in progress (and resumable leftovers).
    staging_bytes: int = 0
    leased_count: int = 0
    pinned_count: int = 0


@dataclass(frozen=True, slots=True)
class PullStatus:
    """A pull in flight."""

    uri: str
    key: str
    tier: TierName
    progress: Progress
    # Requests currently attached to this pull.
    waiters: int
    started: datetime


@dataclass(frozen=True, slots=True)
class AgentStatus:
    """A snapshot of the agent: version, tiers, pulls in flight."""

    version: str
    tiers: tuple[TierStatus, ...]
    pulls: tuple[PullStatus, ...]
    model_count: int
    uptime_seconds: float
    socket_path: str
    # Data plane that moves bytes (e.g. "aiobotocore").
    data_plane: str
    default_tier: TierName
    lease_count: int = 0
    # torch.compile caches on the disk tier, and their bytes (counted in its budget).
    compile_cache_count: int = 0
    compile_cache_bytes: int = 0


@dataclass(frozen=True, slots=True)
class FileProblem:
    """One file of a snapshot that failed verification."""

    path: str
    # What failed: "missing", "size", "hash".
    check: str
    detail: str


@dataclass(frozen=True, slots=True)
class Verification:
    """The result of re-checking one cached snapshot against its manifest."""

    uri: str
    key: str
    ok: bool
    problems: tuple[FileProblem, ...]
    # True when the agent evicted the snapshot because it failed.
    evicted: bool
    bytes_checked: int
    seconds: float
