"""What the service's operations answer, and the metrics each answered lookup adds to."""

from __future__ import annotations

from dataclasses import dataclass

from agent._vocabulary import TierName
from agent.check.hashes import FileProblemReport
from agent.leases.table import LeaseRecord
from agent.obs.metrics import CACHE_LOOKUPS, PHASE_SECONDS
from agent.pull.flight import Flight
from agent.store.records import CachedModel, TierUsage

__all__ = [
    "EnsureResult",
    "EvictReport",
    "PullCancellationReport",
    "RequestTimings",
    "StatusReport",
    "VerifyReport",
    "observe_lookup",
]


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Seconds a request spent resolving, waiting on another's pull, and in its pull's phases."""

    resolve: float = 0.0
    wait: float = 0.0
    download: float = 0.0
    verify: float = 0.0
    publish: float = 0.0
    total: float = 0.0


@dataclass(frozen=True, slots=True)
class EnsureResult:
    """The answer to EnsureModel: the snapshot handed out, how, and its lease if one was asked."""

    model: CachedModel
    hit: bool
    resolved_offline: bool
    timings: RequestTimings
    lease: LeaseRecord | None = None
    resumed_bytes: int = 0
    # The request joined a pull another had started: its timings' wait is its own, the
    # phases are that pull's.
    joined: bool = False


@dataclass(frozen=True, slots=True)
class EvictReport:
    """What an eviction removed and the bytes it freed."""

    evicted: tuple[CachedModel, ...]
    bytes_freed: int


@dataclass(frozen=True, slots=True)
class PullCancellationReport:
    """One pull a CancelPull named: whether it stopped, who still waits, what stays staged.

    ``kept_bytes`` are complete in its staging directory: a later pull of the
    snapshot resumes from them (0 while it is still running).
    """

    flight: Flight
    cancelled: bool
    other_waiters: int
    kept_bytes: int


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """One snapshot re-hashed: what differs, whether it was evicted, how long it took."""

    model: CachedModel
    problems: tuple[FileProblemReport, ...]
    evicted: bool
    seconds: float


@dataclass(frozen=True, slots=True)
class StatusReport:
    """The agent's state as a socket may see it (see AgentService.status)."""

    version: str
    tiers: tuple[TierUsage, ...]
    leased_per_tier: dict[TierName, int]
    pulls: tuple[Flight, ...]
    model_count: int
    lease_count: int
    uptime_seconds: float
    data_plane: str
    default_tier: TierName


def observe_lookup(timings: RequestTimings, lookup: str) -> None:
    """Count one answered lookup (hit, miss, offline) and its phases' seconds."""
    CACHE_LOOKUPS.labels(lookup).inc()
    phases = {"resolve": timings.resolve, "total": timings.total}
    if lookup == "miss":
        phases |= {
            "wait": timings.wait,
            "download": timings.download,
            "verify": timings.verify,
            "publish": timings.publish,
        }
    for phase, seconds in phases.items():
        PHASE_SECONDS.labels(phase, lookup).observe(seconds)
