"""Shared pieces of the gRPC edge: an error's status code, its detail, aborting a call.

A detail may repeat what the caller sent (a URI, a ref) or what a bucket holds
(an object key), and either may be hostile. Messages are written all over the
agent, so the cut happens here, where every one of them leaves: each of the
request's own strings over ``ECHO_LIMIT`` characters, and any other run of
more than ``ECHO_LIMIT`` characters without a space, is cut to ``ECHO_LIMIT``
and marked with its length.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any, NoReturn

import grpc

from agent._exceptions import ECHO_LIMIT, PrewarmError, printable

__all__ = [
    "DETAIL_BYTES",
    "abort",
    "remember_request_values",
    "status_code_for",
    "status_detail",
]

# The most a status detail may take in the grpc-message header once encoded.
# gRPC refuses a response whose headers pass its metadata limit (8 KiB by
# default), and the client then sees RESOURCE_EXHAUSTED instead of our code.
DETAIL_BYTES = 4096

_ELLIPSIS = "\u2026"
# The strings of the request being answered that are too long to repeat whole.
_REQUEST_VALUES: ContextVar[tuple[str, ...]] = ContextVar("request_values", default=())
# A run a cut value no longer makes: the ellipsis ends it.
_LONG_RUN = re.compile(rf"[^\s{_ELLIPSIS}]{{{ECHO_LIMIT + 1},}}")


def remember_request_values(values: Iterable[str]) -> None:
    """Note the request's strings: any detail answering it repeats each one cut."""
    long_values = {printable(value) for value in values if len(value) > ECHO_LIMIT}
    # Longest first, so a value that holds another is cut whole.
    _REQUEST_VALUES.set(tuple(sorted(long_values, key=len, reverse=True)))


def status_code_for(error: PrewarmError) -> grpc.StatusCode:
    """The code the error tree names for this error (see agent._exceptions)."""
    return grpc.StatusCode[error.status]


def status_detail(error: PrewarmError) -> str:
    """The message, escaped, echoes cut, and cut to fit DETAIL_BYTES once percent-encoded."""
    text = _cut_echoes(printable(str(error)))
    used = 0
    for index, char in enumerate(text):
        # grpc-message percent-encodes every byte outside printable ASCII, and '%'.
        used += 1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode())
        if used > DETAIL_BYTES - 9:  # room for the ellipsis, itself encoded
            return text[:index] + "\u2026"
    return text


def _cut_echoes(text: str) -> str:
    for value in _REQUEST_VALUES.get():
        text = text.replace(value, _cut(value))
    return _LONG_RUN.sub(lambda match: _cut(match.group()), text)


def _cut(value: str) -> str:
    return f"{value[: ECHO_LIMIT - 1]}{_ELLIPSIS} ({len(value)} characters)"


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: PrewarmError) -> NoReturn:
    """End the call with the error's status code and its (escaped) message."""
    await context.abort(status_code_for(error), status_detail(error))
    raise AssertionError("unreachable: abort raises")  # pragma: no cover
