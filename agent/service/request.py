"""One EnsureModel request, built once where it comes in and passed down whole.

The edge (agent.edge.servicer) and the daemon's own caller (the models.d
manifests) build an ``EnsureRequest``: the URI in its parsed form, the filters
checked and in canonical order, and who asks. The service reads
every field from it; nothing is re-parsed below the edge, and no field comes
from the request's context.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent._snapshot import check_globs
from agent._uri import ModelUri
from agent._vocabulary import PullOptions, TierName
from agent.service.access import Requester

__all__ = ["EnsureRequest", "LeaseAsk"]


@dataclass(frozen=True, slots=True)
class LeaseAsk:
    """A lease asked for with the request: ``ttl`` seconds, or the agent's default (None)."""

    ttl: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EnsureRequest:
    """Make one snapshot of ``uri`` (as the filters select it) local, and hand it out.

    ``tier`` is where a pull places it (None: the agent's default), and with
    ``strict_tier`` nowhere else. ``lease`` asks for a lease on it, ``pin``
    keeps it past every eviction. ``options`` tune a pull this request
    starts. ``cached_only`` answers from the cache without any S3 call.
    ``requester`` is who asks (None: in-process callers, not restricted); a
    lease belongs to its socket, which alone may renew or release it.
    ``client_name`` names the caller in logs and leases. ``waiter_token``
    (the client's choice, "" for none) names this request's wait on a pull, so
    its client can later cancel that pull unless others wait on it. The filters
    are checked (InvalidRequest) and put in canonical order when it is built.
    """

    uri: ModelUri
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    tier: TierName | None = None
    strict_tier: bool = False
    lease: LeaseAsk | None = None
    pin: bool = False
    options: PullOptions | None = None
    cached_only: bool = False
    requester: Requester | None = None
    client_name: str = ""
    waiter_token: str = ""

    def __post_init__(self) -> None:
        """Check the filters and put them in canonical order (the snapshot key is made of them).

        Done however the request was built, so no caller can skip it.
        """
        object.__setattr__(self, "include", check_globs(self.include, what="Include"))
        object.__setattr__(self, "exclude", check_globs(self.exclude, what="Exclude"))

    @property
    def grantee(self) -> str:
        """The socket a lease this request takes belongs to ("" for in-process callers)."""
        return self.requester.name if self.requester is not None else ""
