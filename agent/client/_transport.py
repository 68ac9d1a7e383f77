"""Reaching the agent: its socket, the channel options, failed calls, waiting for it to start.

On a new node a pod can start before the agent's DaemonSet pod (or unit) has
bound its socket. ``wait_for_agent`` returns as soon as the socket accepts a
connection, and gives up after a bounded time with a sentence saying what was
missing. The waiting itself is grpc's: a channel reconnecting with a short
backoff until it is ready, so the agent is found within about a second of
binding its socket, and nothing here sleeps or polls. What waiting cannot
change is not waited for: a socket this user may not open (group membership
does not change while a process runs), a path that names a directory or a
file (the agent refuses to bind over it), a path too long for a socket
address; each fails at once with the fix (``_unreachable``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

from ._exceptions import AgentUnavailable, translate_rpc_error
from ._unreachable import diagnose, too_long

__all__ = [
    "CHANNEL_OPTIONS",
    "DEFAULT_LEASE_SOCKET_PATH",
    "DEFAULT_SOCKET_PATH",
    "SOCKET_ENV",
    "cancelled_at_exit",
    "channel_target",
    "errors_translated",
    "resolve_socket_path",
    "wait_for_agent",
]

DEFAULT_SOCKET_PATH = Path("/run/prewarm/agent.sock")
DEFAULT_LEASE_SOCKET_PATH = Path("/run/prewarm/lease.sock")
SOCKET_ENV = "PREWARM_SOCKET_PATH"
# A model with many thousands of files lists them all in one answer, and
# ListModels answers for every model at once: 4 MiB (grpc's default) is too low.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", 256 * 1024**2),
    # A channel of its own connections: grpc shares connections between channels to the
    # same target by default, so a new client made after the agent came back would inherit
    # an earlier client's failed connection and its reconnect backoff (up to two minutes).
    ("grpc.use_local_subchannel_pool", 1),
)
# Reconnect quickly while waiting: grpc's default backoff grows to two minutes.
_WAITING_OPTIONS = (
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class _Cancellable(Protocol):
    def cancel(self) -> Any:
        """Stop the call (grpc's and grpc.aio's server streams both have it)."""
        ...


Stream = TypeVar("Stream", bound=_Cancellable)


def resolve_socket_path(socket_path: str | os.PathLike[str] | None) -> Path:
    """The explicit path, else $PREWARM_SOCKET_PATH, else the systemd unit's default."""
    if socket_path is not None and str(socket_path):
        return Path(socket_path)
    from_env = os.environ.get(SOCKET_ENV)
    return Path(from_env) if from_env else DEFAULT_SOCKET_PATH


def channel_target(socket_path: Path) -> str:
    """The grpc target that names a Unix socket; AgentUnavailable for a path no socket
    address can hold."""
    unreachable = too_long(socket_path)
    if unreachable is not None:
        raise unreachable.error()
    return f"unix:{socket_path}"


@contextlib.contextmanager
def errors_translated(socket_path: Path) -> Iterator[None]:
    """A failed call inside raises the prewarm error for it, from the grpc error."""
    try:
        yield
    except grpc.RpcError as exc:
        raise translate_rpc_error(exc, socket_path) from exc


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


def wait_for_agent(
    socket_path: str | os.PathLike[str] | None = None,
    timeout: float = 60.0,
    *,
    waiting: Callable[[str], None] | None = None,
) -> None:
    """Return once the agent accepts connections on its socket; wait at most ``timeout`` s.

    ``waiting`` is called once, with the reason (``the socket does not
    exist``), when the agent is not there at the first try and the wait begins.
    Raises ``AgentUnavailable`` when the time runs out (naming what was
    missing), at once when ``timeout`` is 0, and at once when waiting cannot
    change it (this user may not open the socket; the path is not a socket, or
    too long for one). Blocking; from asyncio, ``await asyncio.to_thread(...)``.
    """
    path = resolve_socket_path(socket_path)
    unreachable = diagnose(path)
    if unreachable is None:
        return
    if unreachable.lasting or timeout <= 0:
        raise unreachable.error()
    if waiting is not None:
        waiting(unreachable.cause)
    with grpc.insecure_channel(channel_target(path), options=_WAITING_OPTIONS) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            last = diagnose(path) or unreachable
            raise AgentUnavailable(
                f"no prewarm agent answered on {path} within {timeout:g} s ({last.cause}). "
                f"{last.fix}"
            ) from None
