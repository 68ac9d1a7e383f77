"""prewarm: a node-level model prewarming agent.

The package root stays light on purpose: pods import ``agent.client``, which
must not drag in the daemon's dependencies. ``__version__`` is read from the
installed metadata when first asked for, not at import: importlib.metadata costs
about 0.1 s, paid otherwise by every range worker the daemon starts and by every
pod that imports the client.
"""

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
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


def __getattr__(name: str) -> str:
    """``agent.__version__``, read on first use (PEP 562)."""
    if name == "__version__":
        from agent._version import __version__

        return __version__
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
