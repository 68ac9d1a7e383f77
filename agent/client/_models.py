"""Every value the client hands back, and the options ``ensure`` takes: plain and frozen.

No protobuf leaks past the client: ``_messages`` turns each answer into these.
They are the one client-side type per concept; the CLI prints them and its
``--json`` is their fields.

Where the daemon keeps its own type for the same concept, it differs on purpose:

==========================  ==================================  =============================
client (here)               daemon                              why they differ
==========================  ==================================  =============================
``ModelHandle``,            ``service.results.EnsureResult``,   the daemon's hold its store
``ModelInfo``               ``store.CachedModel``               records (manifest, journal);
                                                                a pod gets only what it may see
``LeaseGrant``,             ``leases.table.LeaseRecord``        the record carries the holder's
``LeaseInfo``                                                   credentials and the grantee
                                                                socket, which stay on the node
``CompileCacheInfo``,       ``compile.index.CompileCacheInfo``, times are ``float`` seconds on
``CompileVerdict``          ``compile.verdict.Verdict``         the daemon (its clock, written
                                                                to JSON files); the wire carries
                                                                Timestamps and a client gets
                                                                aware UTC ``datetime`` values
``PhaseTimings``            ``service.results.RequestTimings``  same fields; the daemon's is
                                                                built step by step, this one
                                                                only read
``AgentStatus``,            ``service.results.AgentStatus``,    the daemon's holds live objects
``TierStatus``,             ``store.TierUsage``, ``Flight``     (flights, usage); the client a
``PullStatus``                                                  snapshot of their numbers
``PullCancellation``        ``service.results.                  the daemon's holds the live
                            PullCancellationReport``            ``Flight`` it stopped
``CompileNearest``,         ``compile.why.Nearest``,            the daemon formats the
``CompileKeyChange``        ``compile.why.PartChange``          summary (one wording for logs,
                                                                CLI and pods); a pod reads it
``CompileCompaction``       ``compile.transfer.CompactOutcome`` same fields; read-only here
``FileProblem``             ``check.hashes.FileProblem``        the check's ``check`` is a
                                                                ``Literal``; here a plain
                                                                ``str``, so a newer agent's
                                                                kind does not break the client
==========================  ==================================  =============================

Shared as one type on both sides: ``CompileKeyParts`` (``agent._vocabulary``)
and the vocabulary ``TierName``, ``DataPlaneName``, ``PhaseName``
(``agent._vocabulary``), re-exported here so a pod finds them next to the
values that carry them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TypedDict

from agent._vocabulary import CompileKeyParts, DataPlaneName, PhaseName, TierName, describe_verdict

__all__ = [
    "AgentStatus",
    "CompileCacheHandle",
    "CompileCacheInfo",
    "CompileCachePush",
    "CompileCompaction",
    "CompileEvictResult",
    "CompileExplanation",
    "CompileKeyChange",
    "CompileKeyParts",
    "CompileLockGrant",
    "CompileNearest",
    "CompileReady",
    "CompileVerdict",
    "DataPlaneName",
    "EnsureOptions",
    "EvictResult",
    "FileEntry",
    "FileProblem",
    "LeaseGrant",
    "LeaseInfo",
    "LeasedOptions",
    "ModelHandle",
    "ModelInfo",
    "PhaseName",
    "PhaseTimings",
    "Progress",
    "PullCancellation",
    "PullStatus",
    "TierName",
    "TierStatus",
    "Verification",
]


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
    # This call's own wait on a pull another request had started (``ModelHandle.joined``).
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
    # What verified the model's signature before it was published ("": none was asked for).
    verified_by: str = ""
    # True when this call joined a pull another request had started: ``timings.wait`` is
    # this call's own wait; download, verify and publish are that pull's, begun before it.
    joined: bool = False


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
    # What verified the model's signature before it was published ("": none was asked for).
    verified_by: str = ""


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
    # Stopped pulls (cancelled, S3 failing, agent stopped) whose staging a later pull of the
    # same snapshot resumes, and the bytes complete there (counted in staging_bytes at their
    # pulls' full size: that room stays reserved).
    resumable_count: int = 0
    resumable_bytes: int = 0


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
class PullCancellation:
    """One pull ``cancel_pull`` named, and what became of it."""

    uri: str
    key: str
    tier: TierName
    # False when only_if_unwatched left it running: other requests wait on it.
    cancelled: bool
    # Requests still waiting on it, the caller's own not counted (0 once cancelled).
    other_waiters: int
    # Bytes complete in its staging directory: a later pull of the snapshot resumes from them.
    kept_bytes: int
    total_bytes: int


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


@dataclass(frozen=True, slots=True)
class CompileCacheHandle:
    """A compile-cache directory on this node and the env vars that point an engine at it.

    Apply ``env`` before the engine imports torch (``handle.apply()`` sets it in
    ``os.environ``), or pass it to the engine's process.
    """

    key: str
    path: Path
    env: dict[str, str]
    # True when this request restored the directory from S3, and how long that took.
    restored: bool
    restore_seconds: float
    # Why a restore was not used (nothing uploaded yet, a refused archive...).
    restore_note: str
    parts: CompileKeyParts
    bytes: int
    file_count: int

    def apply(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Set ``env`` in ``environ`` (default ``os.environ``)."""
        (os.environ if environ is None else environ).update(self.env)


@dataclass(frozen=True, slots=True)
class CompileVerdict:
    """Whether a launch reused its compile cache: ``hit``, ``uncompiled`` (nothing compiled,
    nothing to reuse), ``partial miss`` or ``miss``."""

    verdict: str
    # Sub-cache (inductor, triton, vllm...) -> (files added, bytes added); only those that grew.
    grown: dict[str, tuple[int, int]]
    at: datetime | None
    client_name: str

    def describe(self) -> str:
        """One line, e.g. ``partial miss: inductor +3 files (120.0 KiB)``."""
        return describe_verdict(self.verdict, self.grown)


@dataclass(frozen=True, slots=True)
class CompileCacheInfo:
    """A compile cache on the node, as ``prewarm compile ls`` lists it."""

    key: str
    path: Path
    parts: CompileKeyParts
    bytes: int
    file_count: int
    created: datetime
    last_used: datetime
    # Content digest of the last upload or restore ("" if none), and when.
    uploaded_digest: str
    uploaded: datetime | None
    restored: bool
    # The last launch that reported ready (None before any did).
    last_verdict: CompileVerdict | None = None
    # Uploaded only when a launch reports ready, never when quiet.
    publish_on_ready: bool = False
    # The compile domain it belongs to (a tenant's, or "node").
    domain: str = ""
    # The trusted key that signed what was last restored or uploaded ("": unsigned or none).
    signed_by: str = ""


@dataclass(frozen=True, slots=True)
class CompileEvictResult:
    """What evicting a compile cache removed."""

    evicted: tuple[CompileCacheInfo, ...]
    bytes_freed: int


@dataclass(frozen=True, slots=True)
class CompileCachePush:
    """What a push did: uploaded, or why not."""

    uploaded: bool
    uri: str
    digest: str
    # Bytes of the archive uploaded (0 when skipped).
    bytes: int
    skipped_reason: str = ""


@dataclass(frozen=True, slots=True)
class CompileKeyChange:
    """One key part that differs: its value in the nearest key, and in the key that missed."""

    part: str
    cached: str
    wanted: str


@dataclass(frozen=True, slots=True)
class CompileNearest:
    """The key of the same model and engine closest to one that missed."""

    key: str
    # "node" (cached on this node) or "s3" (uploaded by another node only).
    location: str
    changes: tuple[CompileKeyChange, ...]
    # One clause for a verdict line, as the agent logs it.
    summary: str
    # For a key in S3: the trusted key that signed its index entry ("" if unsigned).
    signed_by: str = ""


@dataclass(frozen=True, slots=True)
class CompileExplanation:
    """Why a key misses: the nearest other key of its model (None when there is none)."""

    key: str
    nearest: CompileNearest | None
    # Why S3 was not searched, or could not be ("" when it was).
    s3_note: str


@dataclass(frozen=True, slots=True)
class CompileCompaction:
    """What compacting a key's archives in S3 did: compacted, or why not."""

    compacted: bool
    uri: str
    archives_before: int
    # Archives an earlier compaction replaced, deleted now that no restore can read them.
    retired_deleted: int
    skipped_reason: str
    # Bytes of the one archive left (0 when nothing was compacted).
    archive_bytes: int


@dataclass(frozen=True, slots=True)
class CompileReady:
    """A launch's verdict, the upload that followed it, and on a miss the nearest key."""

    key: str
    verdict: CompileVerdict
    upload: CompileCachePush
    nearest: CompileNearest | None = None


@dataclass(frozen=True, slots=True)
class CompileLockGrant:
    """The node's compile lock for a key, as granted to this caller."""

    key: str
    # True when the directory already held artifacts when the lock was granted:
    # the compile will mostly hit the cache.
    warm: bool
    # True when another pod held the lock first and this caller waited.
    waited: bool
    # False when this caller was let go without the lock because the cache
    # became warm while it waited (the holder may still be compiling more).
    exclusive: bool = True
    # Who held the lock while this caller waited ("" if it did not wait).
    waited_for: str = ""


# -- what ensure and leased take ----------------------------------------------------------------


class LeasedOptions(TypedDict, total=False):
    """The keyword options of ``leased``: those of ``ensure`` but ``lease``, which it sets.

    Every key is optional; a missing one means the default given here.
    """

    # Where to place the snapshot if it is pulled (default: the agent's).
    tier: TierName | None
    # Glob patterns: only the paths that match / skip the paths that match.
    include: Iterable[str]
    exclude: Iterable[str]
    # Who asks, for the agent's logs and lease listings.
    client_name: str
    # Called for every progress event of the pull.
    progress: Callable[[Progress], None] | None
    # Seconds the lease lives unless renewed or held (None: the agent's default).
    lease_ttl: float | None
    pin: bool
    # Fail rather than use the other tier when ``tier`` is full.
    strict_tier: bool
    # Overrides for a pull this call starts (None: the agent's settings).
    data_plane: DataPlaneName | None
    concurrency: int | None
    chunk_size: int | None
    cached_only: bool
    as_requester: bool
    # Names this call's wait on a pull (up to 64 characters, e.g. secrets.token_hex(16)), for
    # cancel_pull(uri, only_if_unwatched=True, waiter_token=...) after giving up on it.
    waiter_token: str


class EnsureOptions(LeasedOptions, total=False):
    """The keyword options of ``ensure`` (see ``Client.ensure`` for what each does)."""

    lease: bool
