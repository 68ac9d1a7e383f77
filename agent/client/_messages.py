"""Requests to protobuf and answers from it: everything both clients send and read.

Each request is built and checked here before any connection (a bad glob, an
unknown option or compile key part is refused with the sentence the agent
would answer), and each answer becomes the plain values of ``_models``, so no
protobuf leaks past the client. The readers take a server stream's events
(EnsureModel's progress and handle, CompileLock's wait and grant). Every
function is free of I/O but ``requester_credentials``, which reads the pod's
own AWS credentials when a call asks for them.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._vocabulary import CompileKeyParts, PullOptions, check_pull_options, check_tier
from agent._wire import (
    datetime_from_proto,
    parts_from_proto,
    parts_to_proto,
    phase_from_proto,
    pull_options_to_proto,
    tier_from_proto,
)
from agent._wire import tier_to_proto as _wire_tier_to_proto

from ._exceptions import IntegrityError, InvalidRequest, PrewarmError
from ._models import (
    AgentStatus,
    CompileCacheHandle,
    CompileCacheInfo,
    CompileCachePush,
    CompileCompaction,
    CompileEvictResult,
    CompileExplanation,
    CompileKeyChange,
    CompileLockGrant,
    CompileNearest,
    CompileReady,
    CompileVerdict,
    EnsureOptions,
    EvictResult,
    FileEntry,
    FileProblem,
    LeasedOptions,
    LeaseGrant,
    LeaseInfo,
    ModelHandle,
    ModelInfo,
    PhaseTimings,
    Progress,
    PullCancellation,
    PullStatus,
    TierName,
    TierStatus,
    Verification,
)
from ._transport import DEFAULT_LEASE_SOCKET_PATH

__all__ = [
    "KEY_FIELDS",
    "EnsureReader",
    "LockReader",
    "StreamReader",
    "cancel_request",
    "cancellations_from_proto",
    "compile_cache_from_proto",
    "compile_cache_request",
    "compile_caches_from_proto",
    "compile_compaction_from_proto",
    "compile_evict_from_proto",
    "compile_explanation_from_proto",
    "compile_lock_request",
    "compile_push_from_proto",
    "compile_ready_from_proto",
    "compile_ready_request",
    "default_client_name",
    "ensure_request",
    "evict_request",
    "evict_result_from_proto",
    "gc_request",
    "get_request",
    "key_parts",
    "lease_from_proto",
    "leased_options",
    "model_info_from_proto",
    "model_infos_from_proto",
    "pin_request",
    "regrant_options",
    "release_request",
    "renew_request",
    "requester_credentials",
    "status_from_proto",
    "verifications_from_proto",
    "verify_request",
]

T_co = TypeVar("T_co", covariant=True)

_SKEW_HINT = "The client and the agent may be different versions; upgrade the older one."
KEY_FIELDS = frozenset(f.name for f in dataclass_fields(CompileKeyParts))


class StreamReader(Protocol[T_co]):
    """Reads a server stream's events up to the client's value."""

    def feed(self, event: Any) -> bool:
        """Take one event; True when the value is complete and the rest is not needed."""
        ...

    def result(self, socket_path: Path) -> T_co:
        """The value once the stream has stopped; raises if the agent never sent it."""
        ...


# -- checks before a call ----------------------------------------------------------------------


def _refuse_unknown(options: Mapping[str, object], known: frozenset[str], function: str) -> None:
    # Options arrive as **kwargs: a misspelt one must fail as it would on a written-out
    # signature, not be dropped.
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")


def _patterns(patterns: Iterable[str], option: str) -> tuple[str, ...]:
    # A bare string is iterable too; taking it letter by letter would silently
    # turn "*.json" into four one-character globs.
    if isinstance(patterns, str):
        raise InvalidRequest(
            f"{option} takes a sequence of glob patterns, not the string {patterns!r}; "
            f"write {option}=[{patterns!r}]."
        )
    return tuple(patterns)


def _ttl_seconds(ttl: float | None) -> float:
    # 0 on the wire means "the agent's default"; the agent refuses negative TTLs.
    return 0.0 if ttl is None else float(ttl)


def _tier_to_proto(tier: str | None) -> pb.Tier.ValueType:
    """None means "the agent's default"; anything but shm/disk is refused here, before a call."""
    return _wire_tier_to_proto(None if tier is None else check_tier(tier))


def default_client_name() -> str:
    """This process as an operator looks for it in logs: in a pod, HOSTNAME is the pod's name."""
    return f"{os.environ.get('HOSTNAME') or platform.node()} (pid {os.getpid()})"


# -- models and leases -------------------------------------------------------------------------


def ensure_request(uri: str, options: EnsureOptions) -> pb.EnsureModelRequest:
    """EnsureModel's request, checked with the sentences the agent would answer."""
    _refuse_unknown(options, EnsureOptions.__optional_keys__, "ensure")
    lease = options.get("lease", False)
    lease_ttl = options.get("lease_ttl")
    if lease_ttl is not None and not lease:
        raise InvalidRequest("lease_ttl only applies to a lease; pass lease=True with it.")
    concurrency, chunk_size = options.get("concurrency"), options.get("chunk_size")
    # An empty data plane means the agent's, as it does on the wire.
    plane = check_pull_options(options.get("data_plane") or None, concurrency, chunk_size)
    pull = PullOptions(data_plane=plane, concurrency=concurrency, chunk_size=chunk_size)
    return pb.EnsureModelRequest(
        uri=str(uri),
        tier=_tier_to_proto(options.get("tier")),
        include=_patterns(options.get("include", ()), "include"),
        exclude=_patterns(options.get("exclude", ()), "exclude"),
        client_name=options.get("client_name", ""),
        lease=lease,
        lease_ttl_seconds=_ttl_seconds(lease_ttl),
        pin=options.get("pin", False),
        strict_tier=options.get("strict_tier", False),
        pull_options=pull_options_to_proto(pull),
        cached_only=options.get("cached_only", False),
        requester_credentials=requester_credentials() if options.get("as_requester") else None,
        waiter_token=_waiter_token(options.get("waiter_token", "")),
    )


# The longest waiter token the agent takes (agent.edge.request_limits).
_WAITER_TOKEN_LIMIT = 64


def _waiter_token(token: str) -> str:
    if len(token) > _WAITER_TOKEN_LIMIT or not token.isascii() or not token.isprintable():
        raise InvalidRequest(
            f"waiter_token must be at most {_WAITER_TOKEN_LIMIT} printable ASCII characters; "
            "use secrets.token_hex(16)."
        )
    return token


def leased_options(options: LeasedOptions) -> EnsureOptions:
    """``ensure``'s options for ``leased``: with a lease, and the globs read once.

    The globs may be a one-pass iterable; the regrant after an agent restart
    sends them again.
    """
    _refuse_unknown(options, LeasedOptions.__optional_keys__, "leased")
    return {
        **options,
        "lease": True,
        "include": _patterns(options.get("include", ()), "include"),
        "exclude": _patterns(options.get("exclude", ()), "exclude"),
    }


def regrant_options(first: EnsureOptions) -> EnsureOptions:
    """The first request again with cached_only (no S3 call, never a pull) and no pin.

    It asks for a new lease on the cached snapshot, for when the agent
    restarted without the lease a block holds.
    """
    return EnsureOptions(
        tier=first.get("tier"),
        include=first.get("include", ()),
        exclude=first.get("exclude", ()),
        client_name=first.get("client_name", ""),
        lease=True,
        lease_ttl=first.get("lease_ttl"),
        cached_only=True,
        as_requester=first.get("as_requester", False),
    )


def requester_credentials() -> pb.RequesterCredentials:
    """The pod's own AWS credentials, as botocore's default chain resolves them now.

    The agent checks with them that the pod may list and read the snapshot it
    asks for, so sharing the node's cache never widens what a pod can read.
    botocore's standard chain finds them inside the pod (a web-identity token,
    EKS Pod Identity, a profile, the environment). This is the client's only
    use of botocore, imported when asked, so the client needs it only then.
    """
    try:
        import botocore.session
    except ImportError:
        raise InvalidRequest(
            "as_requester=True reads the pod's AWS credentials with botocore, which is not "
            "installed here: pip install botocore."
        ) from None
    found = botocore.session.Session().get_credentials()
    if found is None:
        raise InvalidRequest(
            "as_requester=True found no AWS credentials in this pod (no web-identity token, "
            "Pod Identity, profile or AWS_* variables). Give the pod an identity first."
        )
    # Temporary credentials refresh themselves; frozen ones stay consistent for one request.
    frozen = found.get_frozen_credentials()
    return pb.RequesterCredentials(
        access_key_id=frozen.access_key,
        secret_access_key=frozen.secret_key,
        session_token=frozen.token or "",
    )


def get_request(ref: str) -> pb.GetModelRequest:
    """GetModel's request."""
    return pb.GetModelRequest(ref=str(ref))


def evict_request(ref: str, *, force: bool) -> pb.EvictModelRequest:
    """EvictModel's request."""
    return pb.EvictModelRequest(ref=str(ref), force=force)


def cancel_request(
    ref: str, *, only_if_unwatched: bool, waiter_token: str, as_requester: bool
) -> pb.CancelPullRequest:
    """CancelPull's request (the pod's own credentials read now when ``as_requester``)."""
    return pb.CancelPullRequest(
        ref=str(ref),
        only_if_unwatched=only_if_unwatched,
        waiter_token=_waiter_token(waiter_token),
        requester_credentials=requester_credentials() if as_requester else None,
    )


def renew_request(lease_id: str, ttl: float | None) -> pb.RenewLeaseRequest:
    """RenewLease's request; a None TTL is the agent's default."""
    return pb.RenewLeaseRequest(id=str(lease_id), ttl_seconds=_ttl_seconds(ttl))


def release_request(lease_id: str) -> pb.ReleaseLeaseRequest:
    """ReleaseLease's request."""
    return pb.ReleaseLeaseRequest(id=str(lease_id))


def pin_request(ref: str, pinned: bool) -> pb.PinModelRequest:
    """PinModel's request."""
    return pb.PinModelRequest(ref=str(ref), pinned=pinned)


def gc_request(tier: str | None) -> pb.CollectGarbageRequest:
    """CollectGarbage's request; a None tier is both."""
    return pb.CollectGarbageRequest(tier=_tier_to_proto(tier))


def verify_request(ref: str | None, *, all: bool, report_only: bool) -> pb.VerifyModelsRequest:
    """VerifyModels' request: one model or every one, never both or neither."""
    if all == bool(ref):
        raise InvalidRequest(
            "Verify either one model (a URI or a key) or every one (all=True), not "
            + ("both." if all else "neither.")
        )
    return pb.VerifyModelsRequest(ref=str(ref or ""), all=all, report_only=report_only)


def _tier_from_proto(value: int, what: str) -> TierName:
    tier = tier_from_proto(value)
    if tier is None:
        raise PrewarmError(f"The agent sent tier {value} for {what}. {_SKEW_HINT}")
    return tier


def _optional_timestamp(msg: pb.Lease | pb.LeaseInfo) -> datetime | None:
    # Unset (not the epoch) means the lease is held open and has no expiry.
    return datetime_from_proto(msg.expires) if msg.HasField("expires") else None


def lease_from_proto(msg: pb.Lease) -> LeaseGrant:
    """A lease the agent granted."""
    return LeaseGrant(
        id=msg.id,
        key=msg.key,
        expires=_optional_timestamp(msg),
        # An agent that names no path serves it at the conventional place.
        socket_path=Path(msg.socket_path) if msg.socket_path else DEFAULT_LEASE_SOCKET_PATH,
    )


def _lease_info_from_proto(msg: pb.LeaseInfo) -> LeaseInfo:
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


def _progress_from_proto(msg: pb.Progress) -> Progress:
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


def _timings_from_proto(t: pb.PhaseTimings) -> PhaseTimings:
    return PhaseTimings(
        resolve=t.resolve_seconds,
        wait=t.wait_seconds,
        download=t.download_seconds,
        verify=t.verify_seconds,
        publish=t.publish_seconds,
        total=t.total_seconds,
    )


def _handle_from_proto(msg: pb.ModelHandle) -> ModelHandle:
    return ModelHandle(
        uri=msg.uri,
        key=msg.key,
        path=Path(msg.path),
        tier=_tier_from_proto(msg.tier, msg.uri),
        hit=msg.hit,
        files=_files(msg.files),
        total_bytes=msg.total_bytes,
        timings=_timings_from_proto(msg.timings),
        resolved_offline=msg.resolved_offline,
        lease=lease_from_proto(msg.lease) if msg.HasField("lease") else None,
        resumed_bytes=msg.resumed_bytes,
        verified_by=msg.verified_by,
        joined=msg.joined,
    )


def model_info_from_proto(msg: pb.ModelInfo) -> ModelInfo:
    """A cached snapshot as the agent lists it."""
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
        leases=tuple(_lease_info_from_proto(lease) for lease in msg.leases),
        pinned=msg.pinned,
        verified_by=msg.verified_by,
    )


def model_infos_from_proto(msg: pb.ListModelsResponse) -> list[ModelInfo]:
    """Every snapshot ListModels answered."""
    return [model_info_from_proto(m) for m in msg.models]


def evict_result_from_proto(msg: pb.EvictModelResponse | pb.CollectGarbageResponse) -> EvictResult:
    """What EvictModel or CollectGarbage removed."""
    return EvictResult(
        evicted=tuple(model_info_from_proto(m) for m in msg.evicted),
        bytes_freed=msg.bytes_freed,
    )


def verifications_from_proto(msg: pb.VerifyModelsResponse) -> list[Verification]:
    """VerifyModels' results, failures included."""
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


def _tier_status_from_proto(t: pb.TierStatus) -> TierStatus:
    return TierStatus(
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
        resumable_count=t.resumable_count,
        resumable_bytes=t.resumable_bytes,
    )


def cancellations_from_proto(msg: pb.CancelPullResponse) -> list[PullCancellation]:
    """What CancelPull did to each pull it named."""
    return [
        PullCancellation(
            uri=p.uri,
            key=p.key,
            tier=_tier_from_proto(p.tier, f"the pull of {p.uri}"),
            cancelled=p.cancelled,
            other_waiters=p.other_waiters,
            kept_bytes=p.kept_bytes,
            total_bytes=p.total_bytes,
        )
        for p in msg.pulls
    ]


def _pull_status_from_proto(p: pb.PullStatus) -> PullStatus:
    return PullStatus(
        uri=p.uri,
        key=p.key,
        tier=_tier_from_proto(p.tier, f"the pull of {p.uri}"),
        progress=_progress_from_proto(p.progress),
        waiters=p.waiters,
        started=datetime_from_proto(p.started),
    )


def status_from_proto(msg: pb.StatusResponse) -> AgentStatus:
    """The agent's Status answer."""
    return AgentStatus(
        version=msg.version,
        tiers=tuple(_tier_status_from_proto(t) for t in msg.tiers),
        pulls=tuple(_pull_status_from_proto(p) for p in msg.pulls),
        model_count=msg.model_count,
        uptime_seconds=msg.uptime_seconds,
        socket_path=msg.socket_path,
        data_plane=msg.data_plane,
        default_tier=_tier_from_proto(msg.default_tier, "the default tier"),
        lease_count=msg.lease_count,
        compile_cache_count=msg.compile_cache_count,
        compile_cache_bytes=msg.compile_cache_bytes,
    )


def check_owner(handle: ModelHandle, owner: int) -> None:
    """IntegrityError unless the snapshot directory at ``handle.path``, as this process sees
    it, belongs to the agent (``owner``).

    A pod whose mount of the tier root was made before the agent claimed a root another
    user planted still sees the planter's directory at the handed path. The directory is
    enough to look at: one the agent owns is 0555 and holds only what the agent put there,
    so a hit costs one lstat, not one per file. A path this process cannot see at all is
    left to the caller.
    """
    directory = handle.path
    try:
        found = os.lstat(directory).st_uid
    except OSError:
        return  # not there, or not this process's to see: the engine's open will say
    if found != owner:
        raise IntegrityError(
            f"{directory} belongs to uid {found}, not to the prewarm agent (uid {owner}): this "
            "process does not see the agent's tier root (a directory another user made "
            "before the agent claimed it, mounted earlier?). Nothing of it was used; "
            "restart the pod so it mounts the agent's root.",
            path=str(directory),
            check="owner",
        )


class EnsureReader:
    """Reads EnsureModel's events: progress to the caller's callback, then the handle."""

    def __init__(self, uri: str, progress: Callable[[Progress], None] | None) -> None:
        self._uri = uri
        self._progress = progress
        self._handle: ModelHandle | None = None

    def feed(self, event: pb.EnsureModelEvent) -> bool:
        """Take one event; never done early (see below)."""
        kind = event.WhichOneof("event")
        if kind == "handle":
            self._handle = _handle_from_proto(event.handle)
            if event.handle.HasField("owner_uid"):
                check_owner(self._handle, event.handle.owner_uid)
        elif kind == "progress" and self._progress is not None:
            self._progress(_progress_from_proto(event.progress))
        # An empty event (a newer agent's kind this client does not know) is skipped.
        # Read to the end of the stream rather than stopping at the handle, so
        # an error status the agent sends after it is not lost.
        return False

    def result(self, socket_path: Path) -> ModelHandle:
        """The handle the stream carried."""
        if self._handle is None:
            raise PrewarmError(
                f"The prewarm agent on {socket_path} ended EnsureModel for {self._uri} without "
                "a model handle; the client and the agent may be different versions."
            )
        return self._handle


# -- compile caches ----------------------------------------------------------------------------


def key_parts(parts: CompileKeyParts | None = None, **fields: Any) -> CompileKeyParts:
    """``parts`` (or empty parts) with ``fields`` replaced; unknown names are refused."""
    unknown = set(fields) - KEY_FIELDS
    if unknown:
        raise InvalidRequest(
            f"Unknown compile key part(s) {', '.join(sorted(unknown))}; "
            f"the parts are {', '.join(sorted(KEY_FIELDS))}."
        )
    return replace(parts or CompileKeyParts(), **fields)


def compile_cache_request(
    parts: CompileKeyParts, *, skip_restore: bool, client_name: str, publish_on_ready: bool
) -> pb.EnsureCompileCacheRequest:
    """EnsureCompileCache's request; no name is this process's."""
    return pb.EnsureCompileCacheRequest(
        parts=parts_to_proto(parts),
        skip_restore=skip_restore,
        client_name=client_name or default_client_name(),
        publish_on_ready=publish_on_ready,
    )


def compile_ready_request(
    key: str, client_name: str, launch_phases: Mapping[str, float] | None = None
) -> pb.CompileReadyRequest:
    """CompileReady's request; no name is this process's."""
    return pb.CompileReadyRequest(
        key=key,
        client_name=client_name or default_client_name(),
        launch_phases=dict(launch_phases or {}),
    )


def compile_lock_request(parts: CompileKeyParts, client_name: str) -> pb.CompileLockRequest:
    """CompileLock's request; no name is this process's."""
    return pb.CompileLockRequest(
        parts=parts_to_proto(parts), client_name=client_name or default_client_name()
    )


def compile_cache_from_proto(msg: pb.CompileCacheHandle) -> CompileCacheHandle:
    """A compile-cache directory the agent handed out."""
    return CompileCacheHandle(
        key=msg.key,
        path=Path(msg.path),
        env=dict(msg.env),
        restored=msg.restored,
        restore_seconds=msg.restore_seconds,
        restore_note=msg.restore_note,
        parts=parts_from_proto(msg.parts),
        bytes=msg.bytes,
        file_count=msg.file_count,
    )


def _compile_info_from_proto(msg: pb.CompileCacheInfo) -> CompileCacheInfo:
    return CompileCacheInfo(
        key=msg.key,
        path=Path(msg.path),
        parts=parts_from_proto(msg.parts),
        bytes=msg.bytes,
        file_count=msg.file_count,
        created=datetime_from_proto(msg.created),
        last_used=datetime_from_proto(msg.last_used),
        uploaded_digest=msg.uploaded_digest,
        uploaded=datetime_from_proto(msg.uploaded) if msg.HasField("uploaded") else None,
        restored=msg.restored,
        last_verdict=_verdict_from_proto(msg.last_verdict)
        if msg.HasField("last_verdict")
        else None,
        publish_on_ready=msg.publish_on_ready,
        domain=msg.domain,
        signed_by=msg.signed_by,
    )


def _verdict_from_proto(msg: pb.CompileVerdict) -> CompileVerdict:
    return CompileVerdict(
        verdict=msg.verdict,
        grown={g.sub_cache: (g.files_added, g.bytes_added) for g in msg.grown},
        at=datetime_from_proto(msg.at) if msg.HasField("at") else None,
        client_name=msg.client_name,
    )


def compile_ready_from_proto(msg: pb.CompileReadyResponse) -> CompileReady:
    """A launch's verdict, the upload that followed it, and on a miss the nearest key."""
    verdict = _verdict_from_proto(msg.verdict)
    nearest = _nearest_from_proto(msg.nearest) if msg.HasField("nearest") else None
    return CompileReady(msg.key, verdict, compile_push_from_proto(msg.upload), nearest)


def _nearest_from_proto(msg: pb.CompileNearest) -> CompileNearest:
    changes = tuple(CompileKeyChange(c.part, c.cached, c.wanted) for c in msg.changes)
    return CompileNearest(msg.key, msg.location, changes, msg.summary, msg.signed_by)


def compile_explanation_from_proto(msg: pb.ExplainCompileCacheResponse) -> CompileExplanation:
    """Why a key misses, as ExplainCompileCache answered."""
    nearest = _nearest_from_proto(msg.nearest) if msg.HasField("nearest") else None
    return CompileExplanation(msg.key, nearest, msg.s3_note)


def compile_compaction_from_proto(msg: pb.CompactCompileCacheResponse) -> CompileCompaction:
    """What CompactCompileCache did."""
    return CompileCompaction(
        compacted=msg.compacted,
        uri=msg.uri,
        archives_before=msg.archives_before,
        retired_deleted=msg.retired_deleted,
        skipped_reason=msg.skipped_reason,
        archive_bytes=msg.archive_bytes,
    )


def compile_caches_from_proto(msg: pb.ListCompileCachesResponse) -> list[CompileCacheInfo]:
    """Every compile cache ListCompileCaches answered."""
    return [_compile_info_from_proto(c) for c in msg.caches]


def compile_evict_from_proto(msg: pb.EvictCompileCacheResponse) -> CompileEvictResult:
    """What EvictCompileCache removed."""
    evicted = tuple(_compile_info_from_proto(c) for c in msg.evicted)
    return CompileEvictResult(evicted, msg.bytes_freed)


def compile_push_from_proto(msg: pb.PushCompileCacheResponse) -> CompileCachePush:
    """What a push did: uploaded, or why not."""
    return CompileCachePush(msg.uploaded, msg.uri, msg.digest, msg.bytes, msg.skipped_reason)


class LockReader:
    """Reads the compile lock stream's events until the grant."""

    def __init__(self, on_wait: Callable[[str], None] | None) -> None:
        self._on_wait = on_wait
        self._waited_for = ""
        self._grant: CompileLockGrant | None = None

    def feed(self, event: pb.CompileLockEvent) -> bool:
        """Take one event; True at the grant."""
        if event.state == pb.CompileLockEvent.STATE_WAITING:
            self._waited_for = event.holder
            if self._on_wait is not None:
                self._on_wait(event.holder)
            return False
        if event.state == pb.CompileLockEvent.STATE_GRANTED:
            self._grant = CompileLockGrant(
                key=event.key,
                warm=event.warm,
                waited=bool(self._waited_for),
                exclusive=not event.holder,
                waited_for=self._waited_for,
            )
            return True
        raise PrewarmError(
            f"The agent sent compile-lock state {event.state}; the client and the agent may "
            "be different versions."
        )

    def result(self, socket_path: Path) -> CompileLockGrant:
        """The grant the stream carried."""
        if self._grant is None:
            raise PrewarmError(
                f"The prewarm agent on {socket_path} ended CompileLock without granting it; it "
                "may be stopping. Retry, or compile without the lock."
            )
        return self._grant
