"""Per-request bookkeeping at the gRPC edge: the request counter and the log context.

One server interceptor wraps every method of the prewarm service (health and
reflection are left alone): it binds the method, the peer and the request's
identifying fields to the request's log context (see _logging), and counts
each call by method and result, the result being ``ok`` or the name of the
status code it ended with (``CANCELLED`` when the client went away).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from agent.obs.logs import bind_request
from agent.obs.metrics import REQUESTS

__all__ = ["RequestObserver"]

# Request fields worth a place on every log line, and the name they are logged under.
_LOGGED_FIELDS = (("uri", "uri"), ("ref", "ref"), ("key", "key"), ("client_name", "client"))

if TYPE_CHECKING:  # generic only in the type stubs
    Context = grpc.aio.ServicerContext[Any, Any]
    Handler = grpc.RpcMethodHandler[Any, Any]


class RequestObserver(grpc.aio.ServerInterceptor):
    """Counts and labels the RPCs of one service (by its full name)."""

    def __init__(self, service: str) -> None:
        self._prefix = f"/{service}/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        full_name: str = handler_call_details.method
        if handler is None or not full_name.startswith(self._prefix):
            return handler
        method = full_name.removeprefix(self._prefix)
        if inspect.iscoroutinefunction(handler.unary_unary):
            return grpc.unary_unary_rpc_method_handler(
                _unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                _unary_stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _unary(
    method: str, behaviour: Callable[[Any, Context], Awaitable[Any]]
) -> Callable[[Any, Context], Awaitable[Any]]:
    async def observed(request: Any, context: Context) -> Any:
        _bind(method, request, context)
        try:
            response = await behaviour(request, context)
        except BaseException as exc:
            REQUESTS.labels(method, _result(context, exc)).inc()
            raise
        REQUESTS.labels(method, _result(context, None)).inc()
        return response

    return observed


def _unary_stream(
    method: str, behaviour: Callable[[Any, Context], AsyncIterator[Any]]
) -> Callable[[Any, Context], AsyncIterator[Any]]:
    async def observed(request: Any, context: Context) -> AsyncIterator[Any]:
        _bind(method, request, context)
        try:
            async for response in behaviour(request, context):
                yield response
        except BaseException as exc:
            REQUESTS.labels(method, _result(context, exc)).inc()
            raise
        REQUESTS.labels(method, _result(context, None)).inc()

    return observed


def _bind(method: str, request: Any, context: Context) -> None:
    # On a Unix socket grpc reports the peer as just "unix:"; the client's own
    # name (client_name) is what tells callers apart there.
    fields = {"method": method, "peer": context.peer() or "unknown"}
    names = request.DESCRIPTOR.fields_by_name
    for field, logged_as in _LOGGED_FIELDS:
        if field in names:
            fields[logged_as] = str(getattr(request, field))
    bind_request(**fields)


def _result(context: Context, error: BaseException | None) -> str:
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return "ok" if code is grpc.StatusCode.OK else code.name
    if isinstance(code, int):  # some grpc versions keep the raw number
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return "ok" if status is grpc.StatusCode.OK else status.name
    return "ok" if error is None else "UNKNOWN"
