"""Shared pieces of the gRPC edge: an error's status code, aborting a call."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from agent._exceptions import PrewarmError

__all__ = ["abort", "status_code_for"]


def status_code_for(error: PrewarmError) -> grpc.StatusCode:
    """The code the error tree names for this error (see agent._exceptions)."""
    return grpc.StatusCode[error.status]


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: PrewarmError) -> NoReturn:
    await context.abort(status_code_for(error), str(error))
    raise AssertionError("unreachable: abort raises")  # pragma: no cover
