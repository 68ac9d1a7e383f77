"""The asyncio client: the same calls as ``Client``, over a grpc.aio channel.

The calls are described once in ``_model_calls`` and ``_compile_calls``
(see ``_spec``); this module only awaits them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any, TypeVar

import grpc

from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc

from . import _compile_calls as compile_calls
from . import _convert as convert
from . import _model_calls as calls
from ._closing import ClosedOnAsyncExit
from ._endpoint import Endpoint, cancelled_at_exit
from ._hold import AsyncLeaseHold
from ._spec import (
    LEASE_ALREADY_ENDED,
    Call,
    Leased,
    Streamed,
    StreamReader,
    coroutine_method,
    method,
)
from ._types import LeaseGrant, ModelHandle

__all__ = ["AsyncClient"]

T = TypeVar("T")


class AsyncClient(Endpoint, ClosedOnAsyncExit):
    """A connection to the prewarm agent on this node, for asyncio code.

    Arguments as for ``Client``. Use it with ``async with``, or ``await close()``.
    """

    # grpc.aio binds a channel to the running event loop, so it is made on
    # first use, inside the loop, not in __init__.
    _channel: grpc.aio.Channel | None = None
    _stub: Any = None

    async def close(self) -> None:
        """Close the connection to the agent (``with`` does it at the end of the block)."""
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    async def _run(self, call: Call[T]) -> T:
        if isinstance(call, Streamed):
            async with self._streaming(call) as answer:
                return answer
        with self._errors_translated():
            response = await self._start(call)
        return call.answer(response)

    def _start(self, call: Call[Any]) -> Any:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(
                convert.channel_target(self._socket_path), options=convert.CHANNEL_OPTIONS
            )
            self._stub = pb_grpc.PrewarmStub(self._channel)
        return getattr(self._stub, call.rpc)(call.request, timeout=self._timeout_for(call))

    async def _read(self, stream: AsyncIterable[Any], reader: StreamReader[T]) -> T:
        with self._errors_translated():
            async for event in stream:
                if reader.feed(event):
                    break
        return reader.result(self._socket_path)

    @contextlib.asynccontextmanager
    async def _streaming(self, call: Streamed[T]) -> AsyncIterator[T]:
        """The stream's answer for the block, with the call open until the block exits."""
        with cancelled_at_exit(self._start(call)) as stream:
            yield await self._read(stream, call.reader)

    @contextlib.asynccontextmanager
    async def _holding_lease(self, call: Leased) -> AsyncIterator[ModelHandle]:
        handle = await self._run(call.ensure)

        async def regrant() -> LeaseGrant:
            return call.regranted(handle, await self._run(call.again()), self._socket_path)

        hold = call.hold(AsyncLeaseHold, handle, self._socket_path, self._timeout, regrant)
        try:
            async with hold:
                yield handle
        finally:
            # As in Client. On cancellation this release is cut short, but the
            # hold's connection is already closed, which ends the lease.
            if not hold.ended:
                with contextlib.suppress(*LEASE_ALREADY_ENDED):
                    await self._run(calls.release_lease(hold.lease.id))

    ensure = coroutine_method(calls.ensure, _run)
    leased = method(calls.leased, _holding_lease)
    renew_lease = coroutine_method(calls.renew_lease, _run)
    release_lease = coroutine_method(calls.release_lease, _run)
    get = coroutine_method(calls.get, _run)
    list_models = coroutine_method(calls.list_models, _run)
    evict = coroutine_method(calls.evict, _run)
    pin = coroutine_method(calls.pin, _run)
    collect_garbage = coroutine_method(calls.collect_garbage, _run)
    verify = coroutine_method(calls.verify, _run)
    status = coroutine_method(calls.status, _run)

    compile_cache = coroutine_method(compile_calls.compile_cache, _run)
    list_compile_caches = coroutine_method(compile_calls.list_compile_caches, _run)
    evict_compile_cache = coroutine_method(compile_calls.evict_compile_cache, _run)
    push_compile_cache = coroutine_method(compile_calls.push_compile_cache, _run)
    pull_compile_cache = coroutine_method(compile_calls.pull_compile_cache, _run)
    compile_ready = coroutine_method(compile_calls.compile_ready, _run)
    compile_lock = method(compile_calls.compile_lock, _streaming)
