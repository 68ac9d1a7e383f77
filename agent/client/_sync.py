"""The blocking client: one channel to the agent's socket, one method per RPC.

Every method is a call described once in ``_model_calls`` or
``_compile_calls`` (see ``_spec``) and run here: ``_run`` blocks on it,
``_streaming`` holds a stream open for a block, ``_holding_lease`` holds a
lease. ``AsyncClient`` runs the same calls.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import grpc

from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc

from . import _compile_calls as compile_calls
from . import _convert as convert
from . import _model_calls as calls
from ._closing import ClosedOnExit
from ._endpoint import Endpoint, cancelled_at_exit
from ._hold import LeaseHold
from ._spec import LEASE_ALREADY_ENDED, Call, Leased, Streamed, StreamReader, method
from ._types import LeaseGrant, ModelHandle

__all__ = ["Client"]

T = TypeVar("T")


class Client(Endpoint, ClosedOnExit):
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
        super().__init__(socket_path, timeout=timeout)
        self._channel = grpc.insecure_channel(
            convert.channel_target(self._socket_path), options=convert.CHANNEL_OPTIONS
        )
        self._stub = pb_grpc.PrewarmStub(self._channel)

    def close(self) -> None:
        """Close the connection to the agent (``with`` does it at the end of the block)."""
        self._channel.close()

    def _run(self, call: Call[T]) -> T:
        if isinstance(call, Streamed):
            with self._streaming(call) as answer:
                return answer
        with self._errors_translated():
            response = self._start(call)
        return call.answer(response)

    def _start(self, call: Call[Any]) -> Any:
        return getattr(self._stub, call.rpc)(call.request, timeout=self._timeout_for(call))

    def _read(self, stream: Iterable[Any], reader: StreamReader[T]) -> T:
        with self._errors_translated():
            for event in stream:
                if reader.feed(event):
                    break
        return reader.result(self._socket_path)

    @contextlib.contextmanager
    def _streaming(self, call: Streamed[T]) -> Iterator[T]:
        """The stream's answer for the block, with the call open until the block exits."""
        with cancelled_at_exit(self._start(call)) as stream:
            yield self._read(stream, call.reader)

    @contextlib.contextmanager
    def _holding_lease(self, call: Leased) -> Iterator[ModelHandle]:
        handle = self._run(call.ensure)

        def regrant() -> LeaseGrant:
            return call.regranted(handle, self._run(call.again()), self._socket_path)

        hold = call.hold(LeaseHold, handle, self._socket_path, self._timeout, regrant)
        try:
            with hold:
                yield handle
        finally:
            # A hold the agent saw closed has ended the lease: releasing it too
            # would be a NOT_FOUND on every exit. Release when the hold never
            # opened or the agent did not confirm the close in time.
            if not hold.ended:
                with contextlib.suppress(*LEASE_ALREADY_ENDED):
                    self._run(calls.release_lease(hold.lease.id))

    ensure = method(calls.ensure, _run)
    leased = method(calls.leased, _holding_lease)
    renew_lease = method(calls.renew_lease, _run)
    release_lease = method(calls.release_lease, _run)
    get = method(calls.get, _run)
    list_models = method(calls.list_models, _run)
    evict = method(calls.evict, _run)
    pin = method(calls.pin, _run)
    collect_garbage = method(calls.collect_garbage, _run)
    verify = method(calls.verify, _run)
    status = method(calls.status, _run)

    compile_cache = method(compile_calls.compile_cache, _run)
    list_compile_caches = method(compile_calls.list_compile_caches, _run)
    evict_compile_cache = method(compile_calls.evict_compile_cache, _run)
    push_compile_cache = method(compile_calls.push_compile_cache, _run)
    pull_compile_cache = method(compile_calls.pull_compile_cache, _run)
    compile_ready = method(compile_calls.compile_ready, _run)
    compile_lock = method(compile_calls.compile_lock, _streaming)
