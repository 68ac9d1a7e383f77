"""Prometheus metrics of the agent: defined once here, updated where things happen.

Counters and histograms are updated as events happen (requests in the API's
interceptor, lookups and phases in the service, bytes in the puller, evictions
where they are decided). Gauges of state (tier bytes, budgets and free space,
pulls in flight, leases) are read when scraped, by ``StateCollector``, so they can
never drift from the store; the daemon registers one for its service. The
process's own gauges (``process_*``) come from prometheus-client's
ProcessCollector. ``REGISTRY`` is served over HTTP only when ``metrics.port`` is
set (see _metrics_server).
Every name is documented in docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent._version import __version__

__all__ = [
    "BYTES_PULLED",
    "CACHE_LOOKUPS",
    "COMPILE_CACHE_PHASE_SECONDS",
    "COMPILE_KEYS_REFUSED",
    "COMPILE_LAUNCHES",
    "COMPILE_SIGNATURES_REFUSED",
    "COMPILE_WATCH_LIMIT",
    "COMPILE_WATCH_POLLING",
    "ENGINE_LAUNCH_SECONDS",
    "EVICTIONS",
    "MANIFEST_ERRORS",
    "PHASE_SECONDS",
    "REGISTRY",
    "REQUESTS",
    "S3_GETS_IN_FLIGHT",
    "S3_GETS_LIMIT",
    "S3_THROTTLED",
    "StateCollector",
    "StateReading",
    "TierReading",
]

REGISTRY = CollectorRegistry(auto_describe=True)

# Seconds: from a hit (milliseconds) to a cold pull of a 200 GiB model (minutes).
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

REQUESTS = Counter(
    "prewarm_requests",
    "RPCs handled, by method and result (ok or the gRPC status code name).",
    ["method", "result"],
    registry=REGISTRY,
)
CACHE_LOOKUPS = Counter(
    "prewarm_cache_lookups",
    "EnsureModel outcomes: hit (cached), miss (pulled or joined a pull), offline (stale-served).",
    ["result"],
    registry=REGISTRY,
)
BYTES_PULLED = Counter(
    "prewarm_bytes_pulled",
    "Bytes fetched from S3 into the cache, by tier, counted as they are written "
    "(bytes a resumed pull found on disk are not counted again).",
    ["tier"],
    registry=REGISTRY,
)
PHASE_SECONDS = Histogram(
    "prewarm_phase_seconds",
    "Duration of each phase of an EnsureModel request (resolve, wait, download, verify, "
    "publish, total), by lookup result (hit, miss, offline); only misses have "
    "wait/download/verify/publish.",
    ["phase", "lookup"],
    buckets=_PHASE_BUCKETS,
    registry=REGISTRY,
)
COMPILE_CACHE_PHASE_SECONDS = Histogram(
    "prewarm_compile_cache_phase_seconds",
    "Duration of compile-cache restores and uploads.",
    ["phase"],
    buckets=_PHASE_BUCKETS,
    registry=REGISTRY,
)
ENGINE_LAUNCH_SECONDS = Histogram(
    "prewarm_engine_launch_seconds",
    "Where engine launches through prewarm exec spent their time, by engine and phase "
    "(ready: start to ready; weights, compile, kv_cache_and_warmup, start_and_rest: from "
    "the engine's own log lines, vLLM's today).",
    ["engine", "phase"],
    buckets=(1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1200),
    registry=REGISTRY,
)
COMPILE_LAUNCHES = Counter(
    "prewarm_compile_launches",
    "Engine launches that reported ready, by engine and verdict: hit (nothing compiled), "
    "partial_miss (a restored or warm key grew), miss (a cold key compiled).",
    ["engine", "verdict"],
    registry=REGISTRY,
)
COMPILE_KEYS_REFUSED = Counter(
    "prewarm_compile_keys_refused",
    "New compile-cache keys refused because their domain already held "
    "compile_cache.max_keys_per_domain keys, by domain.",
    ["domain"],
    registry=REGISTRY,
)
COMPILE_SIGNATURES_REFUSED = Counter(
    "prewarm_compile_signatures_refused",
    "Compile caches in S3 not restored because no trusted key signed them, by domain and "
    "reason: unsigned, unknown-key (signed by a key the domain does not trust), "
    "bad-signature (changed after signing, or moved from another key or domain).",
    ["domain", "reason"],
    registry=REGISTRY,
)
COMPILE_WATCH_LIMIT = Counter(
    "prewarm_compile_watch_limit",
    "Times the compile-cache watcher found the inotify watch limit reached (new directories "
    "unwatched) and fell back to polling.",
    registry=REGISTRY,
)
COMPILE_WATCH_POLLING = Gauge(
    "prewarm_compile_watch_polling",
    "1 while the compile-cache watcher polls (the inotify watch limit was reached), else 0.",
    registry=REGISTRY,
)
S3_GETS_LIMIT = Gauge(
    "prewarm_s3_gets_limit",
    "GETs the node may keep in flight now: the adaptive limit, found by measuring the link.",
    registry=REGISTRY,
)
S3_GETS_IN_FLIGHT = Gauge(
    "prewarm_s3_gets_in_flight",
    "Ranged GETs in the range workers' hands now, all pulls together.",
    registry=REGISTRY,
)
S3_THROTTLED = Counter(
    "prewarm_s3_throttled",
    "S3 answers asking for fewer requests (SlowDown, 503, 429) met by range workers.",
    registry=REGISTRY,
)
EVICTIONS = Counter(
    "prewarm_evictions",
    "Snapshots evicted, by tier and reason (pressure, watermark, gc, manual, verify).",
    ["tier", "reason"],
    registry=REGISTRY,
)
MANIFEST_ERRORS = Counter(
    "prewarm_manifest_errors",
    "Prefetch manifest problems: a file that could not be read or parsed (file), an entry "
    "whose prefetch failed (pull), a compile cache a manifest named that was not restored "
    "(compile).",
    ["kind"],
    registry=REGISTRY,
)


# process_* (CPU seconds, resident memory, open files, start time) of the agent itself, read
# from /proc at each scrape: what a DaemonSet's memory limit and a node's dashboards need.
ProcessCollector(registry=REGISTRY)


@dataclass(frozen=True, slots=True)
class TierReading:
    """One tier's figures for the state gauges."""

    tier: str
    # Published snapshots only; pulls in progress and resumable leftovers are staging.
    used_bytes: int
    staging_bytes: int
    budget_bytes: int
    model_count: int
    # The tier's filesystem as statvfs sees it (other users' files included).
    free_bytes: int
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class StateReading:
    """What the state gauges show, read at scrape time."""

    tiers: tuple[TierReading, ...]
    pulls_in_flight: int
    leases: int


class StateCollector(Collector):
    """Gauges read from the running agent at each scrape.

    ``read`` runs on the thread that serves the scrape; the daemon serves
    metrics from its event loop, the only thread that changes the store.
    """

    def __init__(self, read: Callable[[], StateReading]) -> None:
        """``read`` returns the agent's state; it is called once per scrape."""
        self._read = read

    def describe(self) -> Iterator[Metric]:
        """The gauge families, without values (what registering needs)."""
        # Names only: registering must not read state that is not set up yet.
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        """The gauges with the values ``read`` returns now."""
        reading = self._read()
        families = self._families()
        used, staging, budget, models, free, capacity, pulls, leases, info = families
        for tier in reading.tiers:
            used.add_metric([tier.tier], tier.used_bytes)
            staging.add_metric([tier.tier], tier.staging_bytes)
            budget.add_metric([tier.tier], tier.budget_bytes)
            models.add_metric([tier.tier], tier.model_count)
            free.add_metric([tier.tier], tier.free_bytes)
            capacity.add_metric([tier.tier], tier.capacity_bytes)
        pulls.add_metric([], reading.pulls_in_flight)
        leases.add_metric([], reading.leases)
        info.add_metric([__version__], 1)
        yield from families

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily(
                "prewarm_tier_used_bytes",
                "Bytes held by the published snapshots of each tier.",
                labels=["tier"],
            ),
            GaugeMetricFamily(
                "prewarm_tier_staging_bytes",
                "Bytes held by pulls in progress and resumable leftovers, by tier.",
                labels=["tier"],
            ),
            GaugeMetricFamily(
                "prewarm_tier_budget_bytes", "Most bytes each tier may hold.", labels=["tier"]
            ),
            GaugeMetricFamily(
                "prewarm_tier_models", "Published snapshots on each tier.", labels=["tier"]
            ),
            GaugeMetricFamily(
                "prewarm_tier_free_bytes",
                "Free bytes on each tier's filesystem (statvfs; other users' files count too).",
                labels=["tier"],
            ),
            GaugeMetricFamily(
                "prewarm_tier_capacity_bytes",
                "Size of each tier's filesystem (statvfs).",
                labels=["tier"],
            ),
            GaugeMetricFamily("prewarm_pulls_in_flight", "Pulls running now."),
            GaugeMetricFamily("prewarm_leases", "Live leases (held open or within their TTL)."),
            GaugeMetricFamily(
                "prewarm_build_info", "Always 1; the agent's version.", labels=["version"]
            ),
        )
