"""Per-request bookkeeping at the gRPC edge: admission, the request counter, the log context.

One server interceptor wraps every unary-request method on the socket. Before
the method runs it admits the request: bytes that are not a protobuf message
of the method's type are INVALID_ARGUMENT (and a warning in the log at most
once a minute, with a count, so a client sending garbage cannot flood the
journal with tracebacks), and every field must be within the limits of
agent.edge.request_limits. For the prewarm service it also binds the method,
the peer and the request's identifying fields to the request's log context
(see _logging), and counts each call by method and result, the result being
``ok`` or the name of the status code it ended with (``CANCELLED`` when the
client went away).

It is also the one place a refusal becomes a status: every ``PrewarmError``
a method (or an interceptor inside this one, such as the tenant's) raises ends
the call with its status code and escaped message (agent.edge.status), so the
servicers only convert, call and convert back.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from agent._exceptions import ECHO_LIMIT, InvalidRequest, PrewarmError, printable
from agent.edge.request_limits import check_request
from agent.edge.status import abort, remember_request_values
from agent.obs.logs import bind_request
from agent.obs.metrics import REQUESTS

__all__ = ["UNDECODABLE_REPORT_SECONDS", "RequestObserver"]

log = logging.getLogger(__name__)

# Request fields worth a place on every log line, and the name they are logged under.
_LOGGED_FIELDS = (("uri", "uri"), ("ref", "ref"), ("key", "key"), ("client_name", "client"))
# At most one warning per this many seconds about requests that do not decode.
UNDECODABLE_REPORT_SECONDS = 60.0

if TYPE_CHECKING:  # generic only in the type stubs
    Context = grpc.aio.ServicerContext[Any, Any]
    Handler = grpc.RpcMethodHandler[Any, Any]


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """Stands in for a request whose bytes did not decode, so the method can refuse it."""

    error: str


class _UndecodableReports:
    """One warning per interval about undecodable requests, counting those it held back."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._last = -math.inf
        self._held_back = 0

    def report(self, method: str, peer: str, error: str) -> None:
        now = time.monotonic()
        if now - self._last < self._interval:
            self._held_back += 1
            return
        log.warning(
            "a request to %s from %s is not a protobuf message of its type (%s); refused "
            "with INVALID_ARGUMENT (%d more since the last report, reported at most every %.0f s)",
            method,
            peer,
            error,
            self._held_back,
            self._interval,
            extra={"method": method, "peer": peer, "held_back": self._held_back},
        )
        self._last, self._held_back = now, 0


class RequestObserver(grpc.aio.ServerInterceptor):
    """Admits every unary-request call; counts and labels those of one service (by full name)."""

    def __init__(self, service: str) -> None:
        self._prefix = f"/{service}/"
        self._undecodable = _UndecodableReports(UNDECODABLE_REPORT_SECONDS)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        """The method's handler, wrapped to admit, count and label each call."""
        handler = await continuation(handler_call_details)
        full_name: str = handler_call_details.method
        if handler is None:
            return handler
        counted = full_name.startswith(self._prefix)
        method = full_name.removeprefix(self._prefix) if counted else full_name
        deserializer = _tolerant(handler.request_deserializer)
        if inspect.iscoroutinefunction(handler.unary_unary):
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, counted, handler.unary_unary),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                self._unary_stream(method, counted, handler.unary_stream),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _admit(self, method: str, request: Any, context: Context) -> None:
        if isinstance(request, _Undecodable):
            self._undecodable.report(method, context.peer() or "unknown", request.error)
            raise InvalidRequest(
                f"The request to {method} is not a protobuf message of its type "
                f"({request.error}). Use the prewarm client, or stubs generated from "
                "proto/prewarm/v1/prewarm.proto."
            )
        remember_request_values(_strings(request))
        check_request(request)

    def _unary(
        self, method: str, counted: bool, behaviour: Callable[[Any, Context], Awaitable[Any]]
    ) -> Callable[[Any, Context], Awaitable[Any]]:
        async def observed(request: Any, context: Context) -> Any:
            if counted:
                _bind(method, request, context)
            try:
                async with _refusals_answered(context):
                    self._admit(method, request, context)
                    response = await behaviour(request, context)
            except BaseException as exc:
                if counted:
                    REQUESTS.labels(method, _result(context, exc)).inc()
                raise
            if counted:
                REQUESTS.labels(method, _result(context, None)).inc()
            return response

        return observed

    def _unary_stream(
        self, method: str, counted: bool, behaviour: Callable[[Any, Context], AsyncIterator[Any]]
    ) -> Callable[[Any, Context], AsyncIterator[Any]]:
        async def observed(request: Any, context: Context) -> AsyncIterator[Any]:
            if counted:
                _bind(method, request, context)
            try:
                async with _refusals_answered(context):
                    self._admit(method, request, context)
                    async for response in behaviour(request, context):
                        yield response
            except BaseException as exc:
                if counted:
                    REQUESTS.labels(method, _result(context, exc)).inc()
                raise
            if counted:
                REQUESTS.labels(method, _result(context, None)).inc()

        return observed


@contextlib.asynccontextmanager
async def _refusals_answered(context: Context) -> AsyncIterator[None]:
    """The one place a ``PrewarmError`` becomes the call's status code and message."""
    try:
        yield
    except PrewarmError as exc:
        await abort(context, exc)


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    # grpc logs a failed deserialisation as an error with a traceback and
    # answers UNKNOWN; handing the method a stand-in lets it answer
    # INVALID_ARGUMENT and lets _UndecodableReports decide what to log.
    if deserialize is None:
        return None

    def tolerant(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or anything else a parser may raise
            return _Undecodable(str(exc)[:ECHO_LIMIT])

    return tolerant


def _strings(request: Message) -> Iterator[str]:
    """The request's own string fields (repeated ones too), as the caller sent them."""
    for field, value in request.ListFields():
        if field.type == FieldDescriptor.TYPE_STRING:
            yield from (value if field.is_repeated else (value,))


def _bind(method: str, request: Any, context: Context) -> None:
    # On a Unix socket grpc reports the peer as just "unix:"; the client's own
    # name (client_name) is what tells callers apart there. Logged values are
    # cut and escaped: they are the caller's, and not yet checked.
    fields = {"method": method, "peer": context.peer() or "unknown"}
    names = () if isinstance(request, _Undecodable) else request.DESCRIPTOR.fields_by_name
    for field, logged_as in _LOGGED_FIELDS:
        if field in names:
            fields[logged_as] = printable(str(getattr(request, field))[:ECHO_LIMIT])
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
