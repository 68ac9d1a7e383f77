"""A client call described once, without I/O, and turned into a method of either client.

A builder (``_model_calls``, ``_compile_calls``) takes a public method's
arguments and returns what the call needs: the RPC's name, the request, and
how the answer becomes the client's values. ``Client`` and ``AsyncClient``
each run these descriptions with one small invoker of their own (blocking or
asyncio), so each public method is a single line in either class::

    get = method(calls.get, _run)

The builder carries the method's signature and docstring; ``method`` copies
them onto the client's method, so ``help()`` and type checkers see the real
parameters.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeAlias, TypeVar

from google.protobuf.message import Message

from agent._exceptions import AgentUnavailable, Conflict, NotFound

from . import _convert as convert
from ._errors import granted_lease
from ._hold import AsyncLeaseHold, LeaseHold
from ._types import LeaseGrant, ModelHandle

__all__ = [
    "LEASE_ALREADY_ENDED",
    "Call",
    "Leased",
    "StreamReader",
    "Streamed",
    "Unary",
    "coroutine_method",
    "method",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
P = ParamSpec("P")
Owner = TypeVar("Owner")  # the client class a method is made for
Spec = TypeVar("Spec")
Result = TypeVar("Result")
Method = TypeVar("Method", bound=Callable[..., Any])
Hold = TypeVar("Hold", LeaseHold, AsyncLeaseHold)

# Failures of the release that follows a held lease which mean there is
# nothing left to end: the lease is gone already, or there is no agent to ask.
LEASE_ALREADY_ENDED: tuple[type[Exception], ...] = (NotFound, AgentUnavailable)
# How long the lease socket may take to answer when the client has no timeout.
_HOLD_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class Unary(Generic[T]):
    """One request, one response: ``answer`` turns the response into the client's value."""

    rpc: str
    request: Message
    answer: Callable[[Any], T]


class StreamReader(Protocol[T_co]):
    """Reads a server stream's events up to the client's value."""

    def feed(self, event: Any) -> bool:
        """Take one event; True when the value is complete and the rest is not needed."""
        ...

    def result(self, socket_path: Path) -> T_co:
        """The value once the stream has stopped; raises if the agent never sent it."""
        ...


@dataclass(frozen=True, slots=True)
class Streamed(Generic[T]):
    """A server-streaming call read by ``reader``; one use only (the reader keeps state).

    ``timed=False`` for calls that stay open as long as the caller's block
    (the compile lock): the client's timeout must not end them.
    """

    rpc: str
    request: Message
    reader: StreamReader[T]
    timed: bool = True


Call: TypeAlias = Unary[T] | Streamed[T]


@dataclass(frozen=True, slots=True)
class Leased:
    """``ensure(lease=True)``, then the lease held on the lease socket for a block."""

    ensure: Streamed[ModelHandle]
    client_name: str
    # The same request with cached_only (no S3 call, never a pull) and no pin: a new
    # lease on the cached snapshot, for when the agent restarted without this one.
    again: Callable[[], Streamed[ModelHandle]]

    def hold(
        self,
        holder: type[Hold],
        handle: ModelHandle,
        api_socket: Path,
        timeout: float | None,
        regrant: Callable[[], Any],
    ) -> Hold:
        """The (not yet open) hold of the lease that ``handle`` carries."""
        grant = granted_lease(handle, api_socket)
        return holder(
            grant,
            name=self.client_name,
            socket_path=convert.lease_socket_for(grant, api_socket),
            timeout=timeout or _HOLD_TIMEOUT,
            regrant=regrant,
        )

    @staticmethod
    def regranted(first: ModelHandle, again: ModelHandle, api_socket: Path) -> LeaseGrant:
        """The lease ``again`` carries, if it is on the snapshot the block uses; else Conflict.

        A different snapshot (the cache now holds a newer one) protects nothing
        the running block maps; its lease is left to expire.
        """
        grant = granted_lease(again, api_socket)
        if again.key != first.key:
            raise Conflict(
                f"the node's cached snapshot of {first.uri} is now {again.key}, not {first.key}, "
                "which this process uses; it cannot be leased again"
            )
        return grant


def method(
    build: Callable[P, Spec], run: Callable[[Owner, Spec], Result]
) -> Callable[Concatenate[Owner, P], Result]:
    """A client method: build the call from the arguments, then ``run`` it on the client."""

    def bound(self: Owner, /, *args: P.args, **kwargs: P.kwargs) -> Result:
        return run(self, build(*args, **kwargs))

    return _described_as(bound, build, run)


def coroutine_method(
    build: Callable[P, Spec], run: Callable[[Owner, Spec], Awaitable[Result]]
) -> Callable[Concatenate[Owner, P], Awaitable[Result]]:
    """``method`` for an asyncio client: a coroutine function, as ``async def`` would make."""

    async def bound(self: Owner, /, *args: P.args, **kwargs: P.kwargs) -> Result:
        return await run(self, build(*args, **kwargs))

    return _described_as(bound, build, run)


def _described_as(bound: Method, build: Callable[..., Any], run: Callable[..., Any]) -> Method:
    """``bound`` named and documented as the builder, with its parameters after ``self``."""
    owner = run.__qualname__.rpartition(".")[0]
    parameters = inspect.signature(build).parameters.values()
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    described = {
        "__module__": run.__module__,
        "__name__": build.__name__,
        "__qualname__": f"{owner}.{build.__name__}" if owner else build.__name__,
        "__doc__": build.__doc__,
        # No return annotation: the builder's is the description, not what the method returns.
        "__signature__": inspect.Signature([self_parameter, *parameters]),
    }
    for name, value in described.items():
        setattr(bound, name, value)
    return bound
