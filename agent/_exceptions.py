"""The one error tree of prewarm.

Every error the agent raises on purpose derives from ``PrewarmError``; the API
layer maps each branch to a gRPC status code and the client maps the code back,
so a caller can catch the same class on either side of the socket::

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
     └── AgentUnavailable          (client side) no agent on the socket

Messages are full sentences that say what was wrong and what to do about it.
botocore and grpc errors are translated at the edge, with ``raise ... from exc``.
"""

from __future__ import annotations

__all__ = [
    "AccessDenied",
    "AgentUnavailable",
    "Conflict",
    "IntegrityError",
    "InvalidRequest",
    "NoSpace",
    "NotFound",
    "PrewarmError",
    "SourceChanged",
    "SourceUnavailable",
    "UnsafeObjectKey",
]


class PrewarmError(Exception):
    """Base class of every error prewarm raises on purpose."""


class InvalidRequest(PrewarmError):
    """The request itself is wrong (URI, glob, reference); retrying will not help."""


class UnsafeObjectKey(InvalidRequest):
    """An object key under the prefix would land outside the model directory."""


class NotFound(PrewarmError):
    """The bucket, the prefix or the cached model does not exist."""


class AccessDenied(PrewarmError):
    """S3 refused the agent's credentials for this bucket or prefix."""


class NoSpace(PrewarmError):
    """The chosen tier has no room for the model."""


class Conflict(PrewarmError):
    """The operation clashes with work in progress (e.g. a running pull)."""


class SourceChanged(PrewarmError):
    """An object changed while it was being pulled; the pull was abandoned."""


class SourceUnavailable(PrewarmError):
    """S3 could not be reached or kept failing after retries."""


class IntegrityError(PrewarmError):
    """A file failed an integrity check (size, safetensors header, checksum, hash).

    ``path`` names the file and ``check`` the check that failed, so an operator
    can tell a truncated object from a corrupt header from a flipped byte.
    """

    def __init__(self, message: str, *, path: str = "", check: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.check = check


class AgentUnavailable(PrewarmError):
    """The client could not reach a prewarm agent on its socket."""
