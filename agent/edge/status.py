"""Shared pieces of the gRPC edge: error to status code, aborting, timestamps."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from agent._exceptions import (
    AccessDenied,
    Conflict,
    IntegrityError,
    InvalidRequest,
    NoSpace,
    NotFound,
    PrewarmError,
    SourceChanged,
    SourceUnavailable,
)

__all__ = ["abort", "status_code_for", "timestamp"]

_STATUS_BY_ERROR: tuple[tuple[type[PrewarmError], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AccessDenied, grpc.StatusCode.PERMISSION_DENIED),
    (NoSpace, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
    (SourceChanged, grpc.StatusCode.ABORTED),
    (SourceUnavailable, grpc.StatusCode.UNAVAILABLE),
    (IntegrityError, grpc.StatusCode.DATA_LOSS),
)


def status_code_for(error: PrewarmError) -> grpc.StatusCode:
    for error_type, code in _STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return code
    return grpc.StatusCode.INTERNAL


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: PrewarmError) -> NoReturn:
    await context.abort(status_code_for(error), str(error))
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


def timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp
