"""The model, lease and status calls, each described once for both clients.

Each function takes a public method's arguments (its signature and docstring
are the method's) and returns the call to run; ``Client`` blocks on it,
``AsyncClient`` awaits it. See ``_spec``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from agent._proto.prewarm.v1 import prewarm_pb2 as pb

from . import _convert as convert
from ._errors import missing_handle
from ._requester import requester_credentials
from ._spec import Leased, Streamed, Unary
from ._types import (
    AgentStatus,
    DataPlaneName,
    EvictResult,
    LeaseGrant,
    ModelHandle,
    ModelInfo,
    Progress,
    TierName,
    Verification,
)

__all__ = [
    "collect_garbage",
    "ensure",
    "evict",
    "get",
    "leased",
    "list_models",
    "pin",
    "release_lease",
    "renew_lease",
    "status",
    "verify",
]


class _EnsureReader:
    """Reads EnsureModel's events: progress to the caller's callback, then the handle."""

    def __init__(self, uri: str, progress: Callable[[Progress], None] | None) -> None:
        self._uri = uri
        self._progress = progress
        self._handle: ModelHandle | None = None

    def feed(self, event: pb.EnsureModelEvent) -> bool:
        handle = convert.on_ensure_event(event, self._progress)
        if handle is not None:
            self._handle = handle
        # Read to the end of the stream rather than stopping at the handle, so
        # an error status the agent sends after it is not lost.
        return False

    def result(self, socket_path: Path) -> ModelHandle:
        if self._handle is None:
            raise missing_handle(self._uri, socket_path)
        return self._handle


def ensure(
    uri: str,
    *,
    tier: TierName | None = None,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    client_name: str = "",
    progress: Callable[[Progress], None] | None = None,
    lease: bool = False,
    lease_ttl: float | None = None,
    pin: bool = False,
    strict_tier: bool = False,
    data_plane: DataPlaneName | None = None,
    concurrency: int | None = None,
    chunk_size: int | None = None,
    cached_only: bool = False,
    as_requester: bool = False,
) -> Streamed[ModelHandle]:
    """Make sure ``uri`` is cached on this node, pulling it if needed, and return it.

    ``progress`` is a plain function, called for every progress event of the
    pull: in the calling thread (``Client``) or in the event loop
    (``AsyncClient``). ``lease=True`` also grants a lease (``handle.lease``)
    for ``lease_ttl`` seconds (None: the agent's default); hold it with
    ``LeaseHold`` or renew it, or use ``leased()``, which does both.
    ``pin=True`` pins the snapshot; ``strict_tier=True`` fails rather than use
    the other tier when ``tier`` is full. ``data_plane`` ("auto", "streamer",
    "aiobotocore"), ``concurrency`` (streams) and ``chunk_size`` (bytes)
    override the agent's settings for a pull this call starts (None: the
    agent's); a call that joins a pull in progress gets its settings.

    ``cached_only=True`` makes the agent answer from this node's cache with no
    S3 call at all: the newest cached snapshot of ``uri`` with the same
    include/exclude, even if S3 has changed since (``handle.resolved_offline``
    is then True), or ``NotFound`` when none is cached; nothing is pulled.

    ``as_requester=True`` sends this process's own AWS credentials (botocore's
    standard chain: web-identity token, Pod Identity, profile, environment;
    read now, in the calling thread): the agent checks that they may list and
    read the snapshot, hit or miss, and pulls a miss with them. A
    requester-scoped socket refuses requests without them.
    """
    request = convert.ensure_request(
        uri,
        tier=tier,
        include=include,
        exclude=exclude,
        client_name=client_name,
        lease=lease,
        lease_ttl=lease_ttl,
        pin=pin,
        strict_tier=strict_tier,
        data_plane=data_plane,
        concurrency=concurrency,
        chunk_size=chunk_size,
        cached_only=cached_only,
        requester=requester_credentials() if as_requester else None,
    )
    return Streamed("EnsureModel", request, _EnsureReader(uri, progress))


def leased(
    uri: str,
    *,
    tier: TierName | None = None,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    client_name: str = "",
    progress: Callable[[Progress], None] | None = None,
    lease_ttl: float | None = None,
    pin: bool = False,
    strict_tier: bool = False,
    cached_only: bool = False,
    as_requester: bool = False,
) -> Leased:
    """``ensure(uri, lease=True)``, with the lease held for the life of the block::

        with client.leased("s3://models/llama-3-8b/") as handle:
            weights = load_safetensors(handle)

    (``async with`` on ``AsyncClient``.) The snapshot is not evicted while
    the block runs; the lease ends when it exits, or when this process dies,
    whichever comes first. ``cached_only`` and ``as_requester`` are ``ensure``'s.
    """
    include, exclude = tuple(include), tuple(exclude)
    call = ensure(
        uri,
        tier=tier,
        include=include,
        exclude=exclude,
        client_name=client_name,
        progress=progress,
        lease=True,
        lease_ttl=lease_ttl,
        pin=pin,
        strict_tier=strict_tier,
        cached_only=cached_only,
        as_requester=as_requester,
    )

    def again() -> Streamed[ModelHandle]:
        return ensure(
            uri,
            tier=tier,
            include=include,
            exclude=exclude,
            client_name=client_name,
            lease=True,
            lease_ttl=lease_ttl,
            cached_only=True,
            as_requester=as_requester,
        )

    return Leased(call, client_name, again)


def renew_lease(lease_id: str, ttl: float | None = None) -> Unary[LeaseGrant]:
    """Extend a lease to ``ttl`` seconds from now (None: the agent's default).

    The agent clamps a TTL above its maximum. An expired lease is ``NotFound``:
    ask for a new one with ``ensure(..., lease=True)``.
    """
    return Unary("RenewLease", convert.renew_request(lease_id, ttl), convert.lease_from_proto)


def release_lease(lease_id: str) -> Unary[None]:
    """End a lease now."""
    return Unary("ReleaseLease", convert.release_request(lease_id), _nothing)


def get(ref: str) -> Unary[ModelInfo]:
    """One cached model, by URI (its newest snapshot), key, or unique key prefix."""
    return Unary("GetModel", convert.get_request(ref), convert.model_info_from_proto)


def list_models() -> Unary[list[ModelInfo]]:
    """Every published snapshot on the node."""
    return Unary("ListModels", pb.ListModelsRequest(), _model_infos)


def evict(ref: str, *, force: bool = False) -> Unary[EvictResult]:
    """Remove a snapshot (by key) or every snapshot of a URI from the cache.

    Leased or pinned snapshots are refused (``Conflict``) unless ``force``.
    """
    request = convert.evict_request(ref, force=force)
    return Unary("EvictModel", request, convert.evict_result_from_proto)


def pin(ref: str, pinned: bool = True) -> Unary[ModelInfo]:
    """Pin a snapshot (``pinned=False``: unpin it); pressure never evicts a pinned one."""
    return Unary("PinModel", convert.pin_request(ref, pinned), convert.model_info_from_proto)


def collect_garbage(tier: TierName | None = None) -> Unary[EvictResult]:
    """Run an eviction pass now, on one tier or (None) both."""
    return Unary("CollectGarbage", convert.gc_request(tier), convert.gc_result_from_proto)


def verify(
    ref: str | None = None, *, all: bool = False, report_only: bool = False
) -> Unary[list[Verification]]:
    """Re-hash one cached model (a URI or key) or, with ``all=True``, every one.

    Snapshots that fail are evicted unless ``report_only``. Failures are
    results (``ok=False``), not exceptions.
    """
    request = convert.verify_request(ref, all=all, report_only=report_only)
    return Unary("VerifyModels", request, convert.verifications_from_proto)


def status() -> Unary[AgentStatus]:
    """Agent version, tiers, pulls in flight."""
    return Unary("Status", pb.StatusRequest(), convert.status_from_proto)


def _nothing(response: object) -> None:
    return None


def _model_infos(response: pb.ListModelsResponse) -> list[ModelInfo]:
    return [convert.model_info_from_proto(m) for m in response.models]
