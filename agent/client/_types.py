"""Plain, frozen values the client hands back; no protobuf leaks past the client."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

__all__ = [
    "AgentStatus",
    "EvictResult",
    "FileEntry",
    "ModelHandle",
    "ModelInfo",
    "PhaseName",
    "PhaseTimings",
    "Progress",
    "PullStatus",
    "TierName",
    "TierStatus",
]

TierName = Literal["shm", "disk"]
PhaseName = Literal["resolve", "download", "verify", "publish", "done"]


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
    # True when S3 was unreachable and the newest cached snapshot was served
    # without checking that it is still current.
    resolved_offline: bool


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


@dataclass(frozen=True, slots=True)
class EvictResult:
    """What an eviction removed."""

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
