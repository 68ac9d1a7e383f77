"""prewarm: a node-level model prewarming agent.

The package root stays light on purpose: pods import ``agent.client``, which
must not drag in the daemon's dependencies.
"""

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
)
from agent._version import __version__

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
    "SourceChanged",
    "SourceUnavailable",
    "UnsafeObjectKey",
    "__version__",
]
