"""Shared pieces of the gRPC edge: an error's status code, aborting a call."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from agent._exceptions import PrewarmError, printable

__all__ = ["DETAIL_BYTES", "abort", "status_code_for", "status_detail"]

# The most a status detail may take in the grpc-message header once encoded.
# gRPC refuses a response whose headers pass its metadata limit (8 KiB by
# default), and the client then sees RESOURCE_EXHAUSTED instead of our code.
DETAIL_BYTES = 4096


def status_code_for(error: PrewarmError) -> grpc.StatusCode:
    """The code the error tree names for this error (see agent._exceptions)."""
    return grpc.StatusCode[error.status]


def status_detail(error: PrewarmError) -> str:
    """The error's message, escaped and cut to fit DETAIL_BYTES once percent-encoded."""
    text = printable(str(error))
    used = 0
    for index, char in enumerate(text):
        # grpc-message percent-encodes every byte outside printable ASCII, and '%'.
        used += 1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode())
        if used > DETAIL_BYTES - 9:  # room for the ellipsis, itself encoded
            return text[:index] + "\u2026"
    return text


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: PrewarmError) -> NoReturn:
    await context.abort(status_code_for(error), status_detail(error))
    raise AssertionError("unreachable: abort raises")  # pragma: no cover
