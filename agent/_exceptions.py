"""The one error tree of prewarm.

Every error the agent raises on purpose derives from ``PrewarmError``. Each
branch names its gRPC status in ``status`` (a plain string: no grpc import
here); the edge answers with it on the API and the lease socket alike, and the
client maps it back through ``error_type_for_status``, so a caller can catch
the same class on either side of the socket::

    PrewarmError
     ├── InvalidRequest            bad URI, glob, reference       INVALID_ARGUMENT
     │    └── UnsafeObjectKey      object key escapes the model dir
     ├── NotFound                  bucket, prefix or cached model NOT_FOUND
     ├── AccessDenied              S3 refused the credentials     PERMISSION_DENIED
     ├── NoSpace                   the tier cannot hold the model RESOURCE_EXHAUSTED
     ├── Conflict                  e.g. evicting a model mid-pull FAILED_PRECONDITION
     ├── SourceChanged             object changed during a pull   ABORTED
     ├── SourceUnavailable         S3 unreachable or failing      UNAVAILABLE
     ├── IntegrityError            a file failed a check          DATA_LOSS
     ├── Cancelled                 a pull stopped by CancelPull   CANCELLED
     └── AgentUnavailable          (client side) no agent on the socket

Any other ``PrewarmError`` is INTERNAL.

Messages are full sentences that say what was wrong and what to do about it.
botocore and grpc errors are translated at the edge, with ``raise ... from exc``.

A message may quote what the caller sent, and the caller may be hostile: quote
it with ``quoted`` (escaped, at most ``ECHO_LIMIT`` characters), and a message
as a whole is cut at ``MESSAGE_LIMIT`` characters, so a 16 KiB URI can never
push a status detail past gRPC's metadata limit.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "ECHO_LIMIT",
    "MESSAGE_LIMIT",
    "AccessDenied",
    "AgentUnavailable",
    "Cancelled",
    "Conflict",
    "IntegrityError",
    "InvalidRequest",
    "NoSpace",
    "NotFound",
    "PrewarmError",
    "SourceChanged",
    "SourceUnavailable",
    "UnsafeObjectKey",
    "error_type_for_status",
    "printable",
    "quoted",
]

# How much of a caller's value a message repeats, and how long a message may be.
ECHO_LIMIT = 200
MESSAGE_LIMIT = 2000
# Line breaks and tabs are layout; anything else unprintable is escaped.
_LAYOUT = frozenset("\n\t")


def quoted(value: object, limit: int = ECHO_LIMIT) -> str:
    """``repr(value)`` for a message, escaped and cut to ``limit`` characters.

    repr escapes control characters, bidi overrides and every other unprintable
    character, so the quote cannot steer the terminal that shows the message.
    """
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 1]}… ({len(text)} characters)"


def printable(text: str) -> str:
    """``text`` with every unprintable character but newline and tab escaped (``\\x1b``)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch in _LAYOUT else repr(ch)[1:-1] for ch in text)


def _clip(message: str) -> str:
    if len(message) <= MESSAGE_LIMIT:
        return message
    return f"{message[: MESSAGE_LIMIT - 1]}…"


class PrewarmError(Exception):
    """Base class of every error prewarm raises on purpose."""

    # The gRPC status name (grpc.StatusCode member) this error is answered with.
    status: ClassVar[str] = "INTERNAL"

    def __str__(self) -> str:
        return _clip(super().__str__())


class InvalidRequest(PrewarmError):
    """The request itself is wrong (URI, glob, reference); retrying will not help."""

    status = "INVALID_ARGUMENT"


class UnsafeObjectKey(InvalidRequest):
    """An object key under the prefix would land outside the model directory."""


class NotFound(PrewarmError):
    """The bucket, the prefix or the cached model does not exist."""

    status = "NOT_FOUND"


class AccessDenied(PrewarmError):
    """S3 refused the agent's credentials for this bucket or prefix."""

    status = "PERMISSION_DENIED"


class NoSpace(PrewarmError):
    """The chosen tier has no room for the model."""

    status = "RESOURCE_EXHAUSTED"


class Conflict(PrewarmError):
    """The operation clashes with work in progress (e.g. a running pull)."""

    status = "FAILED_PRECONDITION"


class SourceChanged(PrewarmError):
    """An object changed while it was being pulled; the pull was abandoned."""

    status = "ABORTED"


class SourceUnavailable(PrewarmError):
    """S3 could not be reached or kept failing after retries."""

    status = "UNAVAILABLE"


class IntegrityError(PrewarmError):
    """A file failed an integrity check (size, safetensors header, checksum, hash).

    ``path`` names the file and ``check`` the check that failed, so an operator
    can tell a truncated object from a corrupt header from a flipped byte.
    """

    status = "DATA_LOSS"

    def __init__(self, message: str, *, path: str = "", check: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.check = check


class Cancelled(PrewarmError):
    """The work was stopped on purpose before it finished: a pull cancelled with CancelPull
    (``prewarm cancel``). Asking again starts it again, resuming from what it had written."""

    status = "CANCELLED"


class AgentUnavailable(PrewarmError):
    """The client could not reach a prewarm agent on its socket."""


# The branches a status name maps back to, most general first; a subclass
# (UnsafeObjectKey, ConfigError...) shares its branch's status and is not
# told apart on the wire.
_BRANCHES: tuple[type[PrewarmError], ...] = (
    InvalidRequest,
    NotFound,
    AccessDenied,
    NoSpace,
    Conflict,
    SourceChanged,
    SourceUnavailable,
    IntegrityError,
    Cancelled,
)


def error_type_for_status(status: str) -> type[PrewarmError]:
    """The error class an agent's status name stands for; PrewarmError when none does."""
    for branch in _BRANCHES:
        if branch.status == status:
            return branch
    return PrewarmError
