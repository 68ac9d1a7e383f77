"""``Client`` and ``AsyncClient``: one connection to the node's agent, one method per RPC.

Both classes are written out, method by method, in the same order and with
the same docstrings (``tests/client/test_client_methods.py`` holds them to it): each
method builds its request in ``_messages`` (checked before any connection),
calls the stub, and turns the answer into ``_models`` values, with grpc
errors raised as prewarm's (``_exceptions``). ``Client`` blocks;
``AsyncClient`` awaits, on a grpc.aio channel made inside the running loop.
The one-call shortcuts (``ensure``, ``aensure``, ``compile_cache``,
``acompile_cache``) open a client, make the call and close it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar, Unpack

import grpc

from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc

from . import _messages as messages
from ._exceptions import AgentUnavailable
from ._leases import (
    HOLD_TIMEOUT,
    LEASE_ALREADY_ENDED,
    AsyncLeaseHold,
    LeaseHold,
    granted_lease,
    lease_socket_for,
    regranted,
)
from ._models import (
    AgentStatus,
    CompileCacheHandle,
    CompileCacheInfo,
    CompileCachePush,
    CompileCompaction,
    CompileEvictResult,
    CompileExplanation,
    CompileKeyParts,
    CompileLockGrant,
    CompileReady,
    EnsureOptions,
    EvictResult,
    LeasedOptions,
    LeaseGrant,
    ModelHandle,
    ModelInfo,
    PullCancellation,
    TierName,
    Verification,
)
from ._transport import CHANNEL_OPTIONS, cancelled_at_exit, channel_target, errors_translated
from ._transport import resolve_socket_path as _resolve_socket_path

__all__ = ["AsyncClient", "Client", "acompile_cache", "aensure", "compile_cache", "ensure"]

T = TypeVar("T")


class _BaseClient:
    """What both clients hold: the agent's API socket and the timeout of every call."""

    def __init__(
        self, socket_path: str | os.PathLike[str] | None = None, *, timeout: float | None = None
    ) -> None:
        self._socket_path = _resolve_socket_path(socket_path)
        self._timeout = timeout

    @property
    def socket_path(self) -> Path:
        """The agent's API socket this client talks to."""
        return self._socket_path

    def __repr__(self) -> str:
        """The client's socket and timeout, e.g. for logs."""
        return (
            f"{type(self).__name__}(socket_path={str(self._socket_path)!r}, "
            f"timeout={self._timeout!r})"
        )

    def _errors(self) -> contextlib.AbstractContextManager[None]:
        return errors_translated(self._socket_path)


class Client(_BaseClient, contextlib.AbstractContextManager["Client"]):
    """A connection to the prewarm agent on this node.

    ``socket_path`` defaults to ``$PREWARM_SOCKET_PATH``, else
    ``/run/prewarm/agent.sock``. ``timeout`` (seconds) bounds every call,
    including the whole of ``ensure``; ``None`` waits as long as it takes.
    Nothing connects until the first call, so constructing a client never fails
    because the agent is down. ``with Client() as agent:`` closes it at the end.
    """

    def __init__(
        self, socket_path: str | os.PathLike[str] | None = None, *, timeout: float | None = None
    ) -> None:
        super().__init__(socket_path, timeout=timeout)
        self._channel: grpc.Channel | None = None
        self._live_stub: pb_grpc.PrewarmStub | None = None
        self._unreachable: AgentUnavailable | None = None
        try:
            target = channel_target(self._socket_path)
        except AgentUnavailable as exc:
            self._unreachable = exc  # said at the first call, as an agent that is down is
        else:
            self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
            self._live_stub = pb_grpc.PrewarmStub(self._channel)

    @property
    def _stub(self) -> pb_grpc.PrewarmStub:
        if self._live_stub is None:
            assert self._unreachable is not None
            raise self._unreachable
        return self._live_stub

    def __exit__(self, *exc_info: object) -> None:
        """Close the connection at the end of the ``with`` block."""
        self.close()

    def close(self) -> None:
        """Close the connection to the agent (``with`` does it at the end of the block)."""
        if self._channel is not None:
            self._channel.close()

    def _read(self, stream: Iterable[Any], reader: messages.StreamReader[T]) -> T:
        with self._errors():
            for event in stream:
                if reader.feed(event):
                    break
        return reader.result(self._socket_path)

    # -- models --------------------------------------------------------------------------------

    def ensure(self, uri: str, **options: Unpack[EnsureOptions]) -> ModelHandle:
        """Make sure ``uri`` is cached on this node, pulling it if needed, and return it.

        The options are keywords (``EnsureOptions``). ``progress`` is a plain
        function, called for every progress event of the pull: in the calling
        thread (``Client``) or in the event loop (``AsyncClient``).
        ``lease=True`` also grants a lease (``handle.lease``) for ``lease_ttl``
        seconds (None: the agent's default); hold it with ``LeaseHold`` or renew
        it, or use ``leased()``, which does both. ``pin=True`` pins the
        snapshot; ``strict_tier=True`` fails rather than use the other tier when
        ``tier`` is full. ``data_plane`` ("auto", "processes", "aiobotocore"),
        ``concurrency`` (GETs in flight, pinned) and ``chunk_size``
        (bytes) override the agent's settings for a pull this call starts (None:
        the agent's); a call that joins a pull in progress gets its settings.

        ``cached_only=True`` makes the agent answer from this node's cache with no
        S3 call at all: the newest cached snapshot of ``uri`` with the same
        include/exclude, even if S3 has changed since (``handle.resolved_offline``
        is then True), or ``NotFound`` when none is cached; nothing is pulled.

        ``as_requester=True`` sends this process's own AWS credentials (botocore's
        standard chain: web-identity token, Pod Identity, profile, environment;
        read now, in the calling thread): the agent checks that they may list and
        read the snapshot, hit or miss, and pulls a miss with them. A
        requester-scoped socket refuses requests without them.

        ``waiter_token`` (e.g. ``secrets.token_hex(16)``) names this call's wait
        on a pull: ``cancel_pull(uri, only_if_unwatched=True, waiter_token=...)``
        after giving up on it stops that pull unless another call waits on it. A
        pull stopped by ``cancel_pull`` fails this call with ``Cancelled``.
        ``handle.joined`` is True when this call joined a pull already running.
        """
        request = messages.ensure_request(uri, options)
        reader = messages.EnsureReader(uri, options.get("progress"))
        call = self._stub.EnsureModel(request, timeout=self._timeout)
        with cancelled_at_exit(call) as stream:
            return self._read(stream, reader)

    @contextlib.contextmanager
    def leased(self, uri: str, **options: Unpack[LeasedOptions]) -> Iterator[ModelHandle]:
        """``ensure(uri, lease=True)``, with the lease held for the life of the block::

            with client.leased("s3://models/llama-3-8b/") as handle:
                weights = load_safetensors(handle)

        (``async with`` on ``AsyncClient``.) The snapshot is not evicted while
        the block runs; the lease ends when it exits, or when this process dies,
        whichever comes first. The options are ``ensure``'s but ``lease``. When
        the agent restarts without the lease, the hold asks for a new one on
        the same cached snapshot (``cached_only``, never a pull).
        """
        first = messages.leased_options(options)
        handle = self.ensure(uri, **first)

        def regrant() -> LeaseGrant:
            again = self.ensure(uri, **messages.regrant_options(first))
            return regranted(handle, again, self._socket_path)

        grant = granted_lease(handle, self._socket_path)
        hold = LeaseHold(
            grant,
            name=first.get("client_name", ""),
            socket_path=lease_socket_for(grant, self._socket_path),
            timeout=self._timeout or HOLD_TIMEOUT,
            regrant=regrant,
        )
        try:
            with hold:
                yield handle
        finally:
            # A hold the agent saw closed has ended the lease: releasing it too
            # would be a NOT_FOUND on every exit. Release when the hold never
            # opened or the agent did not confirm the close in time.
            if not hold.ended:
                with contextlib.suppress(*LEASE_ALREADY_ENDED):
                    self.release_lease(hold.lease.id)

    def renew_lease(self, lease_id: str, ttl: float | None = None) -> LeaseGrant:
        """Extend a lease to ``ttl`` seconds from now (None: the agent's default).

        The agent clamps a TTL above its maximum. An expired lease is ``NotFound``:
        ask for a new one with ``ensure(..., lease=True)``.
        """
        request = messages.renew_request(lease_id, ttl)
        with self._errors():
            answer = self._stub.RenewLease(request, timeout=self._timeout)
        return messages.lease_from_proto(answer)

    def release_lease(self, lease_id: str) -> None:
        """End a lease now."""
        request = messages.release_request(lease_id)
        with self._errors():
            self._stub.ReleaseLease(request, timeout=self._timeout)

    def get(self, ref: str) -> ModelInfo:
        """One cached model, by URI (its newest snapshot), key, or unique key prefix."""
        request = messages.get_request(ref)
        with self._errors():
            answer = self._stub.GetModel(request, timeout=self._timeout)
        return messages.model_info_from_proto(answer)

    def list_models(self) -> list[ModelInfo]:
        """Every published snapshot on the node."""
        request = pb.ListModelsRequest()
        with self._errors():
            answer = self._stub.ListModels(request, timeout=self._timeout)
        return messages.model_infos_from_proto(answer)

    def evict(self, ref: str, *, force: bool = False) -> EvictResult:
        """Remove a snapshot (by key) or every snapshot of a URI from the cache.

        Leased or pinned snapshots are refused (``Conflict``) unless ``force``.
        """
        request = messages.evict_request(ref, force=force)
        with self._errors():
            answer = self._stub.EvictModel(request, timeout=self._timeout)
        return messages.evict_result_from_proto(answer)

    def cancel_pull(
        self,
        ref: str,
        *,
        only_if_unwatched: bool = False,
        waiter_token: str = "",
        as_requester: bool = False,
    ) -> list[PullCancellation]:
        """Stop the pulls ``ref`` names: every pull of a URI, or one by key (8+ hex digits).

        Every call waiting on a stopped pull fails with ``Cancelled``; the bytes
        it had written stay in the agent's staging (``kept_bytes``), and the next
        ``ensure`` of the snapshot resumes from them. ``waiter_token``, the one an
        ``ensure`` of this client passed, names only the pulls that call waited
        on, and does not count it as waiting; ``only_if_unwatched=True`` leaves a
        pull running while another call waits on it (``other_waiters``): how a
        client that gives up stops its pull only if nobody else wants it. A
        tenant's socket stops only pulls it may start and that no other socket
        waits on; ``as_requester`` as for ``ensure``. No pull of ``ref`` in
        progress is ``NotFound``; one publishing already is ``Conflict``.
        """
        request = messages.cancel_request(
            ref,
            only_if_unwatched=only_if_unwatched,
            waiter_token=waiter_token,
            as_requester=as_requester,
        )
        with self._errors():
            answer = self._stub.CancelPull(request, timeout=self._timeout)
        return messages.cancellations_from_proto(answer)

    def pin(self, ref: str, pinned: bool = True) -> ModelInfo:
        """Pin a snapshot (``pinned=False``: unpin it); pressure never evicts a pinned one."""
        request = messages.pin_request(ref, pinned)
        with self._errors():
            answer = self._stub.PinModel(request, timeout=self._timeout)
        return messages.model_info_from_proto(answer)

    def collect_garbage(self, tier: TierName | None = None) -> EvictResult:
        """Run an eviction pass now, on one tier or (None) both."""
        request = messages.gc_request(tier)
        with self._errors():
            answer = self._stub.CollectGarbage(request, timeout=self._timeout)
        return messages.evict_result_from_proto(answer)

    def verify(
        self, ref: str | None = None, *, all: bool = False, report_only: bool = False
    ) -> list[Verification]:
        """Re-hash one cached model (a URI or key) or, with ``all=True``, every one.

        Snapshots that fail are evicted unless ``report_only``. Failures are
        results (``ok=False``), not exceptions.
        """
        request = messages.verify_request(ref, all=all, report_only=report_only)
        with self._errors():
            answer = self._stub.VerifyModels(request, timeout=self._timeout)
        return messages.verifications_from_proto(answer)

    def status(self) -> AgentStatus:
        """Agent version, tiers, pulls in flight."""
        request = pb.StatusRequest()
        with self._errors():
            answer = self._stub.Status(request, timeout=self._timeout)
        return messages.status_from_proto(answer)

    # -- compile caches ------------------------------------------------------------------------

    def compile_cache(
        self,
        parts: CompileKeyParts | None = None,
        *,
        skip_restore: bool = False,
        client_name: str = "",
        publish_on_ready: bool = False,
        **fields: Any,
    ) -> CompileCacheHandle:
        """The node's compile-cache directory for these key parts, restored from S3 if needed.

        Give ``parts`` (see ``detect_key_parts``) and/or the parts as keyword
        arguments. ``skip_restore`` keeps a new key empty even if S3 has it.
        ``publish_on_ready``: this caller reports its engine ready with
        ``compile_ready``; the key is then uploaded only at that report, so a
        launch that crashes first uploads nothing.
        """
        request = messages.compile_cache_request(
            messages.key_parts(parts, **fields),
            skip_restore=skip_restore,
            client_name=client_name,
            publish_on_ready=publish_on_ready,
        )
        with self._errors():
            answer = self._stub.EnsureCompileCache(request, timeout=self._timeout)
        return messages.compile_cache_from_proto(answer)

    def list_compile_caches(self) -> list[CompileCacheInfo]:
        """Every compile cache on the node."""
        request = pb.ListCompileCachesRequest()
        with self._errors():
            answer = self._stub.ListCompileCaches(request, timeout=self._timeout)
        return messages.compile_caches_from_proto(answer)

    def evict_compile_cache(self, key: str) -> CompileEvictResult:
        """Remove a compile cache (a key or a unique prefix of 8+ hex digits)."""
        request = pb.EvictCompileCacheRequest(key=key)
        with self._errors():
            answer = self._stub.EvictCompileCache(request, timeout=self._timeout)
        return messages.compile_evict_from_proto(answer)

    def push_compile_cache(self, key: str) -> CompileCachePush:
        """Pack and upload a compile cache now (skipped when S3 has the same content)."""
        request = pb.PushCompileCacheRequest(key=key)
        with self._errors():
            answer = self._stub.PushCompileCache(request, timeout=self._timeout)
        return messages.compile_push_from_proto(answer)

    def pull_compile_cache(self, key: str) -> CompileCacheHandle:
        """Restore a compile cache from S3 now, replacing this node's copy."""
        request = pb.PullCompileCacheRequest(key=key)
        with self._errors():
            answer = self._stub.PullCompileCache(request, timeout=self._timeout)
        return messages.compile_cache_from_proto(answer)

    def compile_ready(
        self,
        key: str,
        *,
        client_name: str = "",
        launch_phases: Mapping[str, float] | None = None,
    ) -> CompileReady:
        """The engine using ``key`` is ready: its verdict, after the key was uploaded (merged).

        ``launch_phases``: where the launch's time went, in seconds (ready, weights,
        compile, kv_cache_and_warmup, start_and_rest), for prewarm_engine_launch_seconds.
        """
        request = messages.compile_ready_request(key, client_name, launch_phases)
        with self._errors():
            answer = self._stub.CompileReady(request, timeout=self._timeout)
        return messages.compile_ready_from_proto(answer)

    def explain_compile_cache(self, key: str) -> CompileExplanation:
        """Why a key on this node misses: the nearest other key of its model, on the node
        or in S3, and the parts that differ."""
        request = pb.ExplainCompileCacheRequest(key=key)
        with self._errors():
            answer = self._stub.ExplainCompileCache(request, timeout=self._timeout)
        return messages.compile_explanation_from_proto(answer)

    def compact_compile_cache(self, key: str) -> CompileCompaction:
        """Make a key's archives in S3 one archive now (restores then read one object)."""
        request = pb.CompactCompileCacheRequest(key=key)
        with self._errors():
            answer = self._stub.CompactCompileCache(request, timeout=self._timeout)
        return messages.compile_compaction_from_proto(answer)

    @contextlib.contextmanager
    def compile_lock(
        self,
        parts: CompileKeyParts | None = None,
        *,
        client_name: str = "",
        on_wait: Callable[[str], None] | None = None,
        **fields: Any,
    ) -> Iterator[CompileLockGrant]:
        """Hold the node's compile lock for a key for the life of the block.

        The first pod gets it at once; later ones wait (``on_wait`` is called
        with the holder's name) until it is their turn, or until the cache has
        become warm (``grant.exclusive`` is then False). The lock is released
        when the block exits or this process dies. Wrap the warm-up only, not
        the pod's whole life. The client's timeout does not apply.
        """
        request = messages.compile_lock_request(messages.key_parts(parts, **fields), client_name)
        reader = messages.LockReader(on_wait)
        # No timeout: the call stays open as long as the caller's block.
        with cancelled_at_exit(self._stub.CompileLock(request)) as stream:
            yield self._read(stream, reader)


class AsyncClient(_BaseClient, contextlib.AbstractAsyncContextManager["AsyncClient"]):
    """A connection to the prewarm agent on this node, for asyncio code.

    Arguments as for ``Client``. Use it with ``async with``, or ``await close()``.
    """

    # grpc.aio binds a channel to the running event loop, so it is made on
    # first use, inside the loop, not in __init__.
    _channel: grpc.aio.Channel | None = None
    _live_stub: pb_grpc.PrewarmAsyncStub | None = None

    async def __aexit__(self, *exc_info: object) -> None:
        """Close the connection at the end of the ``async with`` block."""
        await self.close()

    async def close(self) -> None:
        """Close the connection to the agent (``with`` does it at the end of the block)."""
        channel, self._channel, self._live_stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    def _stub(self) -> pb_grpc.PrewarmAsyncStub:
        if self._live_stub is None:
            self._channel = grpc.aio.insecure_channel(
                channel_target(self._socket_path), options=CHANNEL_OPTIONS
            )
            # PrewarmAsyncStub exists only in the type stubs: on an aio channel
            # the generated PrewarmStub is the async one.
            self._live_stub = pb_grpc.PrewarmStub(self._channel)
        return self._live_stub

    async def _read(self, stream: AsyncIterable[Any], reader: messages.StreamReader[T]) -> T:
        with self._errors():
            async for event in stream:
                if reader.feed(event):
                    break
        return reader.result(self._socket_path)

    # -- models --------------------------------------------------------------------------------

    async def ensure(self, uri: str, **options: Unpack[EnsureOptions]) -> ModelHandle:
        """Make sure ``uri`` is cached on this node, pulling it if needed, and return it.

        The options are keywords (``EnsureOptions``). ``progress`` is a plain
        function, called for every progress event of the pull: in the calling
        thread (``Client``) or in the event loop (``AsyncClient``).
        ``lease=True`` also grants a lease (``handle.lease``) for ``lease_ttl``
        seconds (None: the agent's default); hold it with ``LeaseHold`` or renew
        it, or use ``leased()``, which does both. ``pin=True`` pins the
        snapshot; ``strict_tier=True`` fails rather than use the other tier when
        ``tier`` is full. ``data_plane`` ("auto", "processes", "aiobotocore"),
        ``concurrency`` (GETs in flight, pinned) and ``chunk_size``
        (bytes) override the agent's settings for a pull this call starts (None:
        the agent's); a call that joins a pull in progress gets its settings.

        ``cached_only=True`` makes the agent answer from this node's cache with no
        S3 call at all: the newest cached snapshot of ``uri`` with the same
        include/exclude, even if S3 has changed since (``handle.resolved_offline``
        is then True), or ``NotFound`` when none is cached; nothing is pulled.

        ``as_requester=True`` sends this process's own AWS credentials (botocore's
        standard chain: web-identity token, Pod Identity, profile, environment;
        read now, in the calling thread): the agent checks that they may list and
        read the snapshot, hit or miss, and pulls a miss with them. A
        requester-scoped socket refuses requests without them.

        ``waiter_token`` (e.g. ``secrets.token_hex(16)``) names this call's wait
        on a pull: ``cancel_pull(uri, only_if_unwatched=True, waiter_token=...)``
        after giving up on it stops that pull unless another call waits on it. A
        pull stopped by ``cancel_pull`` fails this call with ``Cancelled``.
        ``handle.joined`` is True when this call joined a pull already running.
        """
        request = messages.ensure_request(uri, options)
        reader = messages.EnsureReader(uri, options.get("progress"))
        call = self._stub().EnsureModel(request, timeout=self._timeout)
        with cancelled_at_exit(call) as stream:
            return await self._read(stream, reader)

    @contextlib.asynccontextmanager
    async def leased(
        self, uri: str, **options: Unpack[LeasedOptions]
    ) -> AsyncIterator[ModelHandle]:
        """``ensure(uri, lease=True)``, with the lease held for the life of the block::

            with client.leased("s3://models/llama-3-8b/") as handle:
                weights = load_safetensors(handle)

        (``async with`` on ``AsyncClient``.) The snapshot is not evicted while
        the block runs; the lease ends when it exits, or when this process dies,
        whichever comes first. The options are ``ensure``'s but ``lease``. When
        the agent restarts without the lease, the hold asks for a new one on
        the same cached snapshot (``cached_only``, never a pull).
        """
        first = messages.leased_options(options)
        handle = await self.ensure(uri, **first)

        async def regrant() -> LeaseGrant:
            again = await self.ensure(uri, **messages.regrant_options(first))
            return regranted(handle, again, self._socket_path)

        grant = granted_lease(handle, self._socket_path)
        hold = AsyncLeaseHold(
            grant,
            name=first.get("client_name", ""),
            socket_path=lease_socket_for(grant, self._socket_path),
            timeout=self._timeout or HOLD_TIMEOUT,
            regrant=regrant,
        )
        try:
            async with hold:
                yield handle
        finally:
            # As in Client. On cancellation this release is cut short, but the
            # hold's connection is already closed, which ends the lease.
            if not hold.ended:
                with contextlib.suppress(*LEASE_ALREADY_ENDED):
                    await self.release_lease(hold.lease.id)

    async def renew_lease(self, lease_id: str, ttl: float | None = None) -> LeaseGrant:
        """Extend a lease to ``ttl`` seconds from now (None: the agent's default).

        The agent clamps a TTL above its maximum. An expired lease is ``NotFound``:
        ask for a new one with ``ensure(..., lease=True)``.
        """
        request = messages.renew_request(lease_id, ttl)
        with self._errors():
            answer = await self._stub().RenewLease(request, timeout=self._timeout)
        return messages.lease_from_proto(answer)

    async def release_lease(self, lease_id: str) -> None:
        """End a lease now."""
        request = messages.release_request(lease_id)
        with self._errors():
            await self._stub().ReleaseLease(request, timeout=self._timeout)

    async def get(self, ref: str) -> ModelInfo:
        """One cached model, by URI (its newest snapshot), key, or unique key prefix."""
        request = messages.get_request(ref)
        with self._errors():
            answer = await self._stub().GetModel(request, timeout=self._timeout)
        return messages.model_info_from_proto(answer)

    async def list_models(self) -> list[ModelInfo]:
        """Every published snapshot on the node."""
        request = pb.ListModelsRequest()
        with self._errors():
            answer = await self._stub().ListModels(request, timeout=self._timeout)
        return messages.model_infos_from_proto(answer)

    async def evict(self, ref: str, *, force: bool = False) -> EvictResult:
        """Remove a snapshot (by key) or every snapshot of a URI from the cache.

        Leased or pinned snapshots are refused (``Conflict``) unless ``force``.
        """
        request = messages.evict_request(ref, force=force)
        with self._errors():
            answer = await self._stub().EvictModel(request, timeout=self._timeout)
        return messages.evict_result_from_proto(answer)

    async def cancel_pull(
        self,
        ref: str,
        *,
        only_if_unwatched: bool = False,
        waiter_token: str = "",
        as_requester: bool = False,
    ) -> list[PullCancellation]:
        """Stop the pulls ``ref`` names: every pull of a URI, or one by key (8+ hex digits).

        Every call waiting on a stopped pull fails with ``Cancelled``; the bytes
        it had written stay in the agent's staging (``kept_bytes``), and the next
        ``ensure`` of the snapshot resumes from them. ``waiter_token``, the one an
        ``ensure`` of this client passed, names only the pulls that call waited
        on, and does not count it as waiting; ``only_if_unwatched=True`` leaves a
        pull running while another call waits on it (``other_waiters``): how a
        client that gives up stops its pull only if nobody else wants it. A
        tenant's socket stops only pulls it may start and that no other socket
        waits on; ``as_requester`` as for ``ensure``. No pull of ``ref`` in
        progress is ``NotFound``; one publishing already is ``Conflict``.
        """
        request = messages.cancel_request(
            ref,
            only_if_unwatched=only_if_unwatched,
            waiter_token=waiter_token,
            as_requester=as_requester,
        )
        with self._errors():
            answer = await self._stub().CancelPull(request, timeout=self._timeout)
        return messages.cancellations_from_proto(answer)

    async def pin(self, ref: str, pinned: bool = True) -> ModelInfo:
        """Pin a snapshot (``pinned=False``: unpin it); pressure never evicts a pinned one."""
        request = messages.pin_request(ref, pinned)
        with self._errors():
            answer = await self._stub().PinModel(request, timeout=self._timeout)
        return messages.model_info_from_proto(answer)

    async def collect_garbage(self, tier: TierName | None = None) -> EvictResult:
        """Run an eviction pass now, on one tier or (None) both."""
        request = messages.gc_request(tier)
        with self._errors():
            answer = await self._stub().CollectGarbage(request, timeout=self._timeout)
        return messages.evict_result_from_proto(answer)

    async def verify(
        self, ref: str | None = None, *, all: bool = False, report_only: bool = False
    ) -> list[Verification]:
        """Re-hash one cached model (a URI or key) or, with ``all=True``, every one.

        Snapshots that fail are evicted unless ``report_only``. Failures are
        results (``ok=False``), not exceptions.
        """
        request = messages.verify_request(ref, all=all, report_only=report_only)
        with self._errors():
            answer = await self._stub().VerifyModels(request, timeout=self._timeout)
        return messages.verifications_from_proto(answer)

    async def status(self) -> AgentStatus:
        """Agent version, tiers, pulls in flight."""
        request = pb.StatusRequest()
        with self._errors():
            answer = await self._stub().Status(request, timeout=self._timeout)
        return messages.status_from_proto(answer)

    # -- compile caches ------------------------------------------------------------------------

    async def compile_cache(
        self,
        parts: CompileKeyParts | None = None,
        *,
        skip_restore: bool = False,
        client_name: str = "",
        publish_on_ready: bool = False,
        **fields: Any,
    ) -> CompileCacheHandle:
        """The node's compile-cache directory for these key parts, restored from S3 if needed.

        Give ``parts`` (see ``detect_key_parts``) and/or the parts as keyword
        arguments. ``skip_restore`` keeps a new key empty even if S3 has it.
        ``publish_on_ready``: this caller reports its engine ready with
        ``compile_ready``; the key is then uploaded only at that report, so a
        launch that crashes first uploads nothing.
        """
        request = messages.compile_cache_request(
            messages.key_parts(parts, **fields),
            skip_restore=skip_restore,
            client_name=client_name,
            publish_on_ready=publish_on_ready,
        )
        with self._errors():
            answer = await self._stub().EnsureCompileCache(request, timeout=self._timeout)
        return messages.compile_cache_from_proto(answer)

    async def list_compile_caches(self) -> list[CompileCacheInfo]:
        """Every compile cache on the node."""
        request = pb.ListCompileCachesRequest()
        with self._errors():
            answer = await self._stub().ListCompileCaches(request, timeout=self._timeout)
        return messages.compile_caches_from_proto(answer)

    async def evict_compile_cache(self, key: str) -> CompileEvictResult:
        """Remove a compile cache (a key or a unique prefix of 8+ hex digits)."""
        request = pb.EvictCompileCacheRequest(key=key)
        with self._errors():
            answer = await self._stub().EvictCompileCache(request, timeout=self._timeout)
        return messages.compile_evict_from_proto(answer)

    async def push_compile_cache(self, key: str) -> CompileCachePush:
        """Pack and upload a compile cache now (skipped when S3 has the same content)."""
        request = pb.PushCompileCacheRequest(key=key)
        with self._errors():
            answer = await self._stub().PushCompileCache(request, timeout=self._timeout)
        return messages.compile_push_from_proto(answer)

    async def pull_compile_cache(self, key: str) -> CompileCacheHandle:
        """Restore a compile cache from S3 now, replacing this node's copy."""
        request = pb.PullCompileCacheRequest(key=key)
        with self._errors():
            answer = await self._stub().PullCompileCache(request, timeout=self._timeout)
        return messages.compile_cache_from_proto(answer)

    async def compile_ready(
        self,
        key: str,
        *,
        client_name: str = "",
        launch_phases: Mapping[str, float] | None = None,
    ) -> CompileReady:
        """The engine using ``key`` is ready: its verdict, after the key was uploaded (merged).

        ``launch_phases``: where the launch's time went, in seconds (ready, weights,
        compile, kv_cache_and_warmup, start_and_rest), for prewarm_engine_launch_seconds.
        """
        request = messages.compile_ready_request(key, client_name, launch_phases)
        with self._errors():
            answer = await self._stub().CompileReady(request, timeout=self._timeout)
        return messages.compile_ready_from_proto(answer)

    async def explain_compile_cache(self, key: str) -> CompileExplanation:
        """Why a key on this node misses: the nearest other key of its model, on the node
        or in S3, and the parts that differ."""
        request = pb.ExplainCompileCacheRequest(key=key)
        with self._errors():
            answer = await self._stub().ExplainCompileCache(request, timeout=self._timeout)
        return messages.compile_explanation_from_proto(answer)

    async def compact_compile_cache(self, key: str) -> CompileCompaction:
        """Make a key's archives in S3 one archive now (restores then read one object)."""
        request = pb.CompactCompileCacheRequest(key=key)
        with self._errors():
            answer = await self._stub().CompactCompileCache(request, timeout=self._timeout)
        return messages.compile_compaction_from_proto(answer)

    @contextlib.asynccontextmanager
    async def compile_lock(
        self,
        parts: CompileKeyParts | None = None,
        *,
        client_name: str = "",
        on_wait: Callable[[str], None] | None = None,
        **fields: Any,
    ) -> AsyncIterator[CompileLockGrant]:
        """Hold the node's compile lock for a key for the life of the block.

        The first pod gets it at once; later ones wait (``on_wait`` is called
        with the holder's name) until it is their turn, or until the cache has
        become warm (``grant.exclusive`` is then False). The lock is released
        when the block exits or this process dies. Wrap the warm-up only, not
        the pod's whole life. The client's timeout does not apply.
        """
        request = messages.compile_lock_request(messages.key_parts(parts, **fields), client_name)
        reader = messages.LockReader(on_wait)
        # No timeout: the call stays open as long as the caller's block.
        with cancelled_at_exit(self._stub().CompileLock(request)) as stream:
            yield await self._read(stream, reader)


# -- one call, one client ----------------------------------------------------------------------


def ensure(
    uri: str,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    **options: Unpack[EnsureOptions],
) -> ModelHandle:
    """Open a client, ensure ``uri`` is cached, close the client; see ``Client.ensure``."""
    with Client(socket_path, timeout=timeout) as client:
        return client.ensure(uri, **options)


async def aensure(
    uri: str,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    **options: Unpack[EnsureOptions],
) -> ModelHandle:
    """Open an async client, ensure ``uri`` is cached, close the client.

    To bound the wait, wrap the call in ``asyncio.timeout()``.
    """
    async with AsyncClient(socket_path) as client:
        return await client.ensure(uri, **options)


def compile_cache(
    parts: CompileKeyParts | None = None,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    skip_restore: bool = False,
    client_name: str = "",
    **fields: Any,
) -> CompileCacheHandle:
    """``Client(socket_path).compile_cache(parts, **fields)``; see ``Client.compile_cache``."""
    with Client(socket_path, timeout=timeout) as client:
        return client.compile_cache(
            parts, skip_restore=skip_restore, client_name=client_name, **fields
        )


async def acompile_cache(
    parts: CompileKeyParts | None = None,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    skip_restore: bool = False,
    client_name: str = "",
    **fields: Any,
) -> CompileCacheHandle:
    """The asyncio form of ``compile_cache``; bound it with ``asyncio.timeout()``."""
    async with AsyncClient(socket_path) as client:
        return await client.compile_cache(
            parts, skip_restore=skip_restore, client_name=client_name, **fields
        )
