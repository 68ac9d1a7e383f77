"""What the client raises: prewarm's one error tree, and failed calls mapped onto it.

The tree is ``agent._exceptions``'s (drawn there), the same classes the agent
raises, so a pod catches ``NotFound`` whichever side found it. The client
adds one leaf::

    PrewarmError
     └── IntegrityError
          └── SafetensorsError     a file the loader maps is not valid safetensors

grpc errors become these at the client's edge (``translate_rpc_error``, raised
``from`` the grpc error); the lease socket's JSON replies name the same status
(``error_for_code``).
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc

from agent._exceptions import (
    AccessDenied,
    AgentUnavailable,
    Cancelled,
    Conflict,
    IntegrityError,
    InvalidRequest,
    NoSpace,
    NotFound,
    PrewarmError,
    SourceChanged,
    SourceUnavailable,
    UnsafeObjectKey,
    error_type_for_status,
)

from ._unreachable import diagnose

__all__ = [
    "AccessDenied",
    "AgentUnavailable",
    "Cancelled",
    "Conflict",
    "IntegrityError",
    "InvalidRequest",
    "NoSpace",
    "NotFound",
    "PrewarmError",
    "SafetensorsError",
    "SourceChanged",
    "SourceUnavailable",
    "UnsafeObjectKey",
    "agent_unavailable",
    "error_for_code",
    "translate_rpc_error",
]


class SafetensorsError(IntegrityError):
    """A file is not valid safetensors, or the files of one model clash.

    A subclass of ``IntegrityError``, so one ``except IntegrityError`` catches a
    corrupt file whether the agent found it before publishing or the loader did.
    """


# UNAVAILABLE means two different things: the agent itself could not be
# reached (grpc core says so, in these words, before any agent code ran), or
# the agent answered that S3 is unreachable (a sentence the agent wrote).
_TRANSPORT_FAILURE = re.compile(
    r"^(failed to connect to all addresses|Stream removed|Socket closed|Broken pipe"
    r"|GOAWAY received|Connection reset by peer)"
)
# What grpc itself says when a call is cancelled, here or by a server going away.
_GRPC_CANCEL_DETAILS = frozenset(
    {"", "Cancelled", "CANCELLED", "Locally cancelled by application!"}
)


def agent_unavailable(socket_path: Path, details: str) -> AgentUnavailable:
    """The error for an agent this process could not reach, saying what to do about it."""
    if details.startswith("failed to connect") or not socket_path.exists():
        unreachable = diagnose(socket_path)
        if unreachable is not None:
            return unreachable.error()
        return AgentUnavailable(
            f"the prewarm agent on {socket_path} did not take the connection ({details}), "
            "though it takes one now: it may have just started; retry."
        )
    return AgentUnavailable(
        f"lost the connection to the prewarm agent on {socket_path} mid-call ({details}); "
        "it may have stopped or restarted: check `systemctl status prewarmd` and retry."
    )


def translate_rpc_error(exc: grpc.RpcError, socket_path: Path) -> PrewarmError:
    """The prewarm error for a failed call; the caller raises it ``from exc``."""
    # Both the sync errors and grpc.aio.AioRpcError carry code() and details();
    # grpc.RpcError itself declares neither.
    code: grpc.StatusCode = exc.code()
    details: str = exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        if _TRANSPORT_FAILURE.match(details) or not socket_path.exists():
            return agent_unavailable(socket_path, details)
        return SourceUnavailable(details or "The agent reports that S3 is unavailable.")
    if code == grpc.StatusCode.CANCELLED and details in _GRPC_CANCEL_DETAILS:
        # grpc's own words: the call ended, not a pull (the agent says which pull it stopped).
        said = details or "no detail"
        return Cancelled(
            f"The call to the prewarm agent on {socket_path} was cancelled ({said}) before it "
            "was answered: this process cancelled it, or the agent is shutting down. Retry."
        )
    message = details or f"The prewarm agent answered {code.name} without a message."
    error_type = error_type_for_status(code.name)
    if error_type is not PrewarmError:
        return error_type(message)
    return _unmapped(code, details, message, socket_path)


def _unmapped(code: grpc.StatusCode, details: str, message: str, socket_path: Path) -> PrewarmError:
    """A status no branch of the tree names: what it most likely means for the caller."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return PrewarmError(
            f"The call to the prewarm agent on {socket_path} ran out of time ({details}); "
            "raise the client's timeout or pass none."
        )
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return PrewarmError(
            f"The prewarm agent on {socket_path} does not implement this call ({details}); "
            "the client and the agent may be different versions."
        )
    return PrewarmError(f"The prewarm agent failed ({code.name}): {message}")


def error_for_code(code_name: str, message: str) -> PrewarmError:
    """The error for a failure the agent reported by status name outside gRPC.

    The lease socket answers errors with the gRPC status name of the same
    failure (the error's ``status``), so it maps to the same class as over the API.
    """
    return error_type_for_status(code_name)(message)
