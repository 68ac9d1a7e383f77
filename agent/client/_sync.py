"""The blocking client: one channel to the agent's socket, one method per RPC."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import grpc

from agent._exceptions import AgentUnavailable, NotFound
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc

from . import _convert as convert
from ._compile import CompileMixin
from ._errors import granted_lease, missing_handle, translate_rpc_error
from ._hold import LeaseHold
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

__all__ = ["Client", "ensure"]


class Client(CompileMixin):
    """A connection to the prewarm agent on this node.

    ``socket_path`` defaults to ``$PREWARM_SOCKET_PATH``, else
    ``/run/prewarm/agent.sock``. ``timeout`` (seconds) bounds every call,
    including the whole of ``ensure``; ``None`` waits as long as it takes.
    Nothing connects until the first call, so constructing a client never fails
    because the agent is down.
    """

    def __init__(
        self, socket_path: str | os.PathLike[str] | None = None, *, timeout: float | None = None
    ) -> None:
        self._socket_path = convert.resolve_socket_path(socket_path)
        self._timeout = timeout
        self._channel = grpc.insecure_channel(
            convert.channel_target(self._socket_path), options=convert.CHANNEL_OPTIONS
        )
        self._stub = pb_grpc.PrewarmStub(self._channel)

    @property
    def socket_path(self) -> Path:
        return self._socket_path

    def __repr__(self) -> str:
        return f"Client(socket_path={str(self._socket_path)!r}, timeout={self._timeout!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def ensure(
        self,
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
    ) -> ModelHandle:
        """Make sure ``uri`` is cached on this node, pulling it if needed, and return it.

        ``progress`` is called (in this thread) for every progress event of the pull.
        ``lease=True`` also grants a lease (``handle.lease``) for ``lease_ttl``
        seconds (None: the agent's default); hold it with ``LeaseHold`` or renew
        it, or use ``leased()``, which does both. ``pin=True`` pins the snapshot;
        ``strict_tier=True`` fails rather than use the other tier when ``tier`` is full.
        ``data_plane`` ("auto", "streamer", "aiobotocore"), ``concurrency`` (streams)
        and ``chunk_size`` (bytes) override the agent's settings for a pull this call
        starts (None: the agent's); a call that joins a pull in progress gets its settings.
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
        )
        call = self._stub.EnsureModel(request, timeout=self._timeout)
        handle: ModelHandle | None = None
        try:
            # Read to the end of the stream rather than stopping at the handle,
            # so an error status the agent sends after it is not lost.
            for event in call:
                got = convert.on_ensure_event(event, progress)
                if got is not None:
                    handle = got
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, self._socket_path) from exc
        finally:
            # A no-op once the stream has ended; stops it when the progress
            # callback raised or the user pressed Ctrl-C. The agent keeps
            # pulling for any other caller.
            call.cancel()
        if handle is None:
            raise missing_handle(uri, self._socket_path)
        return handle

    @contextlib.contextmanager
    def leased(
        self,
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
    ) -> Iterator[ModelHandle]:
        """``ensure(uri, lease=True)``, with the lease held for the life of the block::

            with client.leased("s3://models/llama-3-8b/") as handle:
                weights = load_safetensors(handle)

        The snapshot is not evicted while the block runs; the lease ends when it
        exits, or when this process dies, whichever comes first.
        """
        handle = self.ensure(
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
        )
        grant = granted_lease(handle, self._socket_path)
        try:
            with LeaseHold(
                grant,
                name=client_name,
                socket_path=convert.lease_socket_for(grant, self._socket_path),
                timeout=self._timeout or 5.0,
            ):
                yield handle
        finally:
            # Closing the hold already ended the lease; releasing as well makes
            # that true by the time the block has exited (the agent may not
            # have seen the close yet), and ends it when the hold never opened.
            # Gone already (NotFound) or no agent to ask: nothing left to end.
            with contextlib.suppress(NotFound, AgentUnavailable):
                self.release_lease(grant.id)

    def renew_lease(self, lease_id: str, ttl: float | None = None) -> LeaseGrant:
        """Extend a lease to ``ttl`` seconds from now (None: the agent's default).

        The agent clamps a TTL above its maximum. An expired lease is ``NotFound``:
        ask for a new one with ``ensure(..., lease=True)``.
        """
        return convert.lease_from_proto(
            self._unary(self._stub.RenewLease, convert.renew_request(lease_id, ttl))
        )

    def release_lease(self, lease_id: str) -> None:
        """End a lease now."""
        self._unary(self._stub.ReleaseLease, convert.release_request(lease_id))

    def get(self, ref: str) -> ModelInfo:
        """One cached model, by URI (its newest snapshot), key, or unique key prefix."""
        return convert.model_info_from_proto(
            self._unary(self._stub.GetModel, convert.get_request(ref))
        )

    def list_models(self) -> list[ModelInfo]:
        """Every published snapshot on the node."""
        response = self._unary(self._stub.ListModels, pb.ListModelsRequest())
        return [convert.model_info_from_proto(m) for m in response.models]

    def evict(self, ref: str, *, force: bool = False) -> EvictResult:
        """Remove a snapshot (by key) or every snapshot of a URI from the cache.

        Leased or pinned snapshots are refused (``Conflict``) unless ``force``.
        """
        return convert.evict_result_from_proto(
            self._unary(self._stub.EvictModel, convert.evict_request(ref, force=force))
        )

    def pin(self, ref: str, pinned: bool = True) -> ModelInfo:
        """Pin a snapshot (``pinned=False``: unpin it); pressure never evicts a pinned one."""
        return convert.model_info_from_proto(
            self._unary(self._stub.PinModel, convert.pin_request(ref, pinned))
        )

    def collect_garbage(self, tier: TierName | None = None) -> EvictResult:
        """Run an eviction pass now, on one tier or (None) both."""
        return convert.gc_result_from_proto(
            self._unary(self._stub.CollectGarbage, convert.gc_request(tier))
        )

    def verify(
        self, ref: str | None = None, *, all: bool = False, report_only: bool = False
    ) -> list[Verification]:
        """Re-hash one cached model (a URI or key) or, with ``all=True``, every one.

        Snapshots that fail are evicted unless ``report_only``. Failures are
        results (``ok=False``), not exceptions.
        """
        request = convert.verify_request(ref, all=all, report_only=report_only)
        return convert.verifications_from_proto(self._unary(self._stub.VerifyModels, request))

    def status(self) -> AgentStatus:
        """Agent version, tiers, pulls in flight."""
        return convert.status_from_proto(self._unary(self._stub.Status, pb.StatusRequest()))

    def _unary(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self._timeout)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, self._socket_path) from exc


def ensure(
    uri: str,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    tier: TierName | None = None,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    client_name: str = "",
    progress: Callable[[Progress], None] | None = None,
) -> ModelHandle:
    """Open a client, ensure ``uri`` is cached, close the client; see ``Client.ensure``."""
    with Client(socket_path, timeout=timeout) as client:
        return client.ensure(
            uri,
            tier=tier,
            include=include,
            exclude=exclude,
            client_name=client_name,
            progress=progress,
        )
