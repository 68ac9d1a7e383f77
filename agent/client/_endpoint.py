"""What both clients hold and do alike: the socket, the timeout, failed calls as prewarm errors."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

from . import _convert as convert
from ._errors import translate_rpc_error
from ._spec import Streamed, Unary

__all__ = ["Endpoint", "cancelled_at_exit"]


class _Cancellable(Protocol):
    def cancel(self) -> Any: ...


Stream = TypeVar("Stream", bound=_Cancellable)


class Endpoint:
    """The agent's API socket as a client sees it; ``Client`` and ``AsyncClient`` add a channel."""

    def __init__(
        self, socket_path: str | os.PathLike[str] | None = None, *, timeout: float | None = None
    ) -> None:
        self._socket_path = convert.resolve_socket_path(socket_path)
        self._timeout = timeout

    @property
    def socket_path(self) -> Path:
        return self._socket_path

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(socket_path={str(self._socket_path)!r}, "
            f"timeout={self._timeout!r})"
        )

    def _timeout_for(self, call: Unary[Any] | Streamed[Any]) -> float | None:
        # A stream held open for a block (the compile lock) lasts as long as the block.
        return self._timeout if not isinstance(call, Streamed) or call.timed else None

    @contextlib.contextmanager
    def _errors_translated(self) -> Iterator[None]:
        """A failed call inside raises the prewarm error for it, from the grpc error."""
        try:
            yield
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, self._socket_path) from exc


@contextlib.contextmanager
def cancelled_at_exit(stream: Stream) -> Iterator[Stream]:
    """Cancel a server stream when the block exits: a no-op once it has ended.

    Otherwise it stops the call when a callback raised, the block ended early,
    the user pressed Ctrl-C or the task was cancelled; the agent carries on
    for its other callers.
    """
    try:
        yield stream
    finally:
        stream.cancel()
