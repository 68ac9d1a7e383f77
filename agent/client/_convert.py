"""Requests to protobuf and responses from it, shared by the sync and async clients."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path

from agent._exceptions import InvalidRequest, PrewarmError
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._vocabulary import PullOptions, check_pull_options, check_tier
from agent._wire import (
    datetime_from_proto,
    phase_from_proto,
    pull_options_to_proto,
    tier_from_proto,
)
from agent._wire import tier_to_proto as _wire_tier_to_proto

from ._types import (
    AgentStatus,
    EvictResult,
    FileEntry,
    FileProblem,
    LeaseGrant,
    LeaseInfo,
    ModelHandle,
    ModelInfo,
    PhaseTimings,
    Progress,
    PullStatus,
    TierName,
    TierStatus,
    Verification,
)

__all__ = [
    "CHANNEL_OPTIONS",
    "DEFAULT_LEASE_SOCKET_PATH",
    "DEFAULT_SOCKET_PATH",
    "SOCKET_ENV",
    "channel_target",
    "ensure_request",
    "evict_request",
    "evict_result_from_proto",
    "gc_request",
    "gc_result_from_proto",
    "get_request",
    "handle_from_proto",
    "lease_from_proto",
    "lease_info_from_proto",
    "lease_socket_for",
    "model_info_from_proto",
    "on_ensure_event",
    "pin_request",
    "progress_from_proto",
    "release_request",
    "renew_request",
    "resolve_socket_path",
    "status_from_proto",
    "tier_to_proto",
    "verifications_from_proto",
    "verify_request",
]

DEFAULT_SOCKET_PATH = Path("/run/prewarm/agent.sock")
DEFAULT_LEASE_SOCKET_PATH = Path("/run/prewarm/lease.sock")
SOCKET_ENV = "PREWARM_SOCKET_PATH"
# A model with many thousands of files lists them all in one answer, and
# ListModels answers for every model at once: 4 MiB (grpc's default) is too low.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.max_receive_message_length", 256 * 1024**2),)

_SKEW_HINT = "The client and the agent may be different versions; upgrade the older one."


def resolve_socket_path(socket_path: str | os.PathLike[str] | None) -> Path:
    """The explicit path, else $PREWARM_SOCKET_PATH, else the systemd unit's default."""
    if socket_path is not None and str(socket_path):
        return Path(socket_path)
    from_env = os.environ.get(SOCKET_ENV)
    return Path(from_env) if from_env else DEFAULT_SOCKET_PATH


def channel_target(socket_path: Path) -> str:
    return f"unix:{socket_path}"


def tier_to_proto(tier: str | None) -> pb.Tier.ValueType:
    """None means "the agent's default"; anything but shm/disk is refused here, before a call."""
    return _wire_tier_to_proto(None if tier is None else check_tier(tier))


def _tier_from_proto(value: int, what: str) -> TierName:
    tier = tier_from_proto(value)
    if tier is None:
        raise PrewarmError(f"The agent sent tier {value} for {what}. {_SKEW_HINT}")
    return tier


def _patterns(patterns: Iterable[str], option: str) -> list[str]:
    # A bare string is iterable too; taking it letter by letter would silently
    # turn "*.json" into four one-character globs.
    if isinstance(patterns, str):
        raise InvalidRequest(
            f"{option} takes a sequence of glob patterns, not the string {patterns!r}; "
            f"write {option}=[{patterns!r}]."
        )
    return list(patterns)


def _ttl_seconds(ttl: float | None) -> float:
    # 0 on the wire means "the agent's default"; the agent refuses negative TTLs.
    return 0.0 if ttl is None else float(ttl)


def ensure_request(
    uri: str,
    *,
    tier: str | None,
    include: Iterable[str],
    exclude: Iterable[str],
    client_name: str,
    lease: bool = False,
    lease_ttl: float | None = None,
    pin: bool = False,
    strict_tier: bool = False,
    data_plane: str | None = None,
    concurrency: int | None = None,
    chunk_size: int | None = None,
    cached_only: bool = False,
    requester: pb.RequesterCredentials | None = None,
) -> pb.EnsureModelRequest:
    if lease_ttl is not None and not lease:
        raise InvalidRequest("lease_ttl only applies to a lease; pass lease=True with it.")
    # Checked here, before a call, with the same sentences the agent would answer;
    # an empty data plane means the agent's, as it does on the wire.
    plane = check_pull_options(data_plane or None, concurrency, chunk_size)
    options = PullOptions(data_plane=plane, concurrency=concurrency, chunk_size=chunk_size)
    return pb.EnsureModelRequest(
        uri=str(uri),
        tier=tier_to_proto(tier),
        include=_patterns(include, "include"),
        exclude=_patterns(exclude, "exclude"),
        client_name=client_name,
        lease=lease,
        lease_ttl_seconds=_ttl_seconds(lease_ttl),
        pin=pin,
        strict_tier=strict_tier,
        pull_options=pull_options_to_proto(options),
        cached_only=cached_only,
        requester_credentials=requester,
    )


def get_request(ref: str) -> pb.GetModelRequest:
    return pb.GetModelRequest(ref=str(ref))


def evict_request(ref: str, *, force: bool = False) -> pb.EvictModelRequest:
    return pb.EvictModelRequest(ref=str(ref), force=force)


def renew_request(lease_id: str, ttl: float | None) -> pb.RenewLeaseRequest:
    return pb.RenewLeaseRequest(id=str(lease_id), ttl_seconds=_ttl_seconds(ttl))


def release_request(lease_id: str) -> pb.ReleaseLeaseRequest:
    return pb.ReleaseLeaseRequest(id=str(lease_id))


def pin_request(ref: str, pinned: bool) -> pb.PinModelRequest:
    return pb.PinModelRequest(ref=str(ref), pinned=pinned)


def gc_request(tier: str | None) -> pb.CollectGarbageRequest:
    return pb.CollectGarbageRequest(tier=tier_to_proto(tier))


def verify_request(ref: str | None, *, all: bool, report_only: bool) -> pb.VerifyModelsRequest:
    if all == bool(ref):
        raise InvalidRequest(
            "Verify either one model (a URI or a key) or every one (all=True), not "
            + ("both." if all else "neither.")
        )
    return pb.VerifyModelsRequest(ref=str(ref or ""), all=all, report_only=report_only)


def lease_socket_for(grant: LeaseGrant, api_socket: Path) -> Path:
    """Where this process reaches the agent's lease socket.

    The agent names the path as it is on the node; a pod that mounts the
    agent's directory elsewhere reaches the API socket (and the lease socket
    next to it) under another path. So the lease socket next to the API
    socket this client uses wins when it exists, else the agent's path.
    """
    sibling = api_socket.parent / grant.socket_path.name
    return sibling if sibling.exists() else grant.socket_path


def _optional_timestamp(msg: pb.Lease | pb.LeaseInfo) -> datetime | None:
    # Unset (not the epoch) means the lease is held open and has no expiry.
    return datetime_from_proto(msg.expires) if msg.HasField("expires") else None


def lease_from_proto(msg: pb.Lease) -> LeaseGrant:
    return LeaseGrant(
        id=msg.id,
        key=msg.key,
        expires=_optional_timestamp(msg),
        # An agent that names no path serves it at the conventional place.
        socket_path=Path(msg.socket_path) if msg.socket_path else DEFAULT_LEASE_SOCKET_PATH,
    )


def lease_info_from_proto(msg: pb.LeaseInfo) -> LeaseInfo:
    # pid/uid/gid are 0 on the wire when nobody holds the lease, and uid 0 is
    # root: only a held lease has credentials.
    return LeaseInfo(
        id=msg.id,
        client_name=msg.client_name,
        pid=msg.pid if msg.held else None,
        uid=msg.uid if msg.held else None,
        gid=msg.gid if msg.held else None,
        acquired=datetime_from_proto(msg.acquired),
        expires=_optional_timestamp(msg),
        held=msg.held,
    )


def _files(entries: Iterable[pb.FileEntry]) -> tuple[FileEntry, ...]:
    return tuple(FileEntry(path=e.path, size=e.size, etag=e.etag) for e in entries)


def progress_from_proto(msg: pb.Progress) -> Progress:
    phase = phase_from_proto(msg.phase)
    if phase is None:
        raise PrewarmError(f"The agent sent an unknown pull phase {msg.phase}. {_SKEW_HINT}")
    return Progress(
        phase=phase,
        bytes_done=msg.bytes_done,
        bytes_total=msg.bytes_total,
        files_done=msg.files_done,
        files_total=msg.files_total,
        key=msg.key,
    )


def handle_from_proto(msg: pb.ModelHandle) -> ModelHandle:
    t = msg.timings
    return ModelHandle(
        uri=msg.uri,
        key=msg.key,
        path=Path(msg.path),
        tier=_tier_from_proto(msg.tier, msg.uri),
        hit=msg.hit,
        files=_files(msg.files),
        total_bytes=msg.total_bytes,
        timings=PhaseTimings(
            resolve=t.resolve_seconds,
            wait=t.wait_seconds,
            download=t.download_seconds,
            verify=t.verify_seconds,
            publish=t.publish_seconds,
            total=t.total_seconds,
        ),
        resolved_offline=msg.resolved_offline,
        lease=lease_from_proto(msg.lease) if msg.HasField("lease") else None,
        resumed_bytes=msg.resumed_bytes,
    )


def model_info_from_proto(msg: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        uri=msg.uri,
        key=msg.key,
        path=Path(msg.path),
        tier=_tier_from_proto(msg.tier, msg.uri),
        total_bytes=msg.total_bytes,
        file_count=msg.file_count,
        created=datetime_from_proto(msg.created),
        last_used=datetime_from_proto(msg.last_used),
        hit_count=msg.hit_count,
        files=_files(msg.files),
        include=tuple(msg.include),
        exclude=tuple(msg.exclude),
        leases=tuple(lease_info_from_proto(lease) for lease in msg.leases),
        pinned=msg.pinned,
    )


def evict_result_from_proto(msg: pb.EvictModelResponse) -> EvictResult:
    return EvictResult(
        evicted=tuple(model_info_from_proto(m) for m in msg.evicted),
        bytes_freed=msg.bytes_freed,
    )


def gc_result_from_proto(msg: pb.CollectGarbageResponse) -> EvictResult:
    return EvictResult(
        evicted=tuple(model_info_from_proto(m) for m in msg.evicted),
        bytes_freed=msg.bytes_freed,
    )


def verifications_from_proto(msg: pb.VerifyModelsResponse) -> list[Verification]:
    return [
        Verification(
            uri=r.uri,
            key=r.key,
            ok=r.ok,
            problems=tuple(
                FileProblem(path=p.path, check=p.check, detail=p.detail) for p in r.problems
            ),
            evicted=r.evicted,
            bytes_checked=r.bytes_checked,
            seconds=r.seconds,
        )
        for r in msg.results
    ]


def status_from_proto(msg: pb.StatusResponse) -> AgentStatus:
    return AgentStatus(
        version=msg.version,
        tiers=tuple(
            TierStatus(
                tier=_tier_from_proto(t.tier, f"tier root {t.root}"),
                root=Path(t.root),
                capacity_bytes=t.capacity_bytes,
                used_bytes=t.used_bytes,
                free_bytes=t.free_bytes,
                model_count=t.model_count,
                budget_bytes=t.budget_bytes,
                reserve_bytes=t.reserve_bytes,
                staging_bytes=t.staging_bytes,
                leased_count=t.leased_count,
                pinned_count=t.pinned_count,
            )
            for t in msg.tiers
        ),
        pulls=tuple(
            PullStatus(
                uri=p.uri,
                key=p.key,
                tier=_tier_from_proto(p.tier, f"the pull of {p.uri}"),
                progress=progress_from_proto(p.progress),
                waiters=p.waiters,
                started=datetime_from_proto(p.started),
            )
            for p in msg.pulls
        ),
        model_count=msg.model_count,
        uptime_seconds=msg.uptime_seconds,
        socket_path=msg.socket_path,
        data_plane=msg.data_plane,
        default_tier=_tier_from_proto(msg.default_tier, "the default tier"),
        lease_count=msg.lease_count,
        compile_cache_count=msg.compile_cache_count,
        compile_cache_bytes=msg.compile_cache_bytes,
    )


def on_ensure_event(
    event: pb.EnsureModelEvent, progress: Callable[[Progress], None] | None
) -> ModelHandle | None:
    """Feed one stream event to the caller; return the handle if this event carries it."""
    kind = event.WhichOneof("event")
    if kind == "handle":
        return handle_from_proto(event.handle)
    if kind == "progress" and progress is not None:
        progress(progress_from_proto(event.progress))
    # An empty event (a newer agent's kind this client does not know) is skipped.
    return None
