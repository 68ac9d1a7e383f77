"""Prometheus metrics of the agent: defined once here, updated where things happen.

Served over HTTP only when ``metrics.port`` is set (see _daemon); the names are
documented in docs/observability.md.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = [
    "BYTES_PULLED",
    "CACHE_LOOKUPS",
    "COMPILE_CACHE_PHASE_SECONDS",
    "EVICTIONS",
    "LEASES",
    "PHASE_SECONDS",
    "PULLS_IN_FLIGHT",
    "REGISTRY",
    "REQUESTS",
    "TIER_BUDGET_BYTES",
    "TIER_USED_BYTES",
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
    "Bytes fetched from S3 into the cache, by tier.",
    ["tier"],
    registry=REGISTRY,
)
PHASE_SECONDS = Histogram(
    "prewarm_phase_seconds",
    "Duration of each phase of EnsureModel: resolve, wait, download, verify, publish, total.",
    ["phase"],
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
TIER_USED_BYTES = Gauge(
    "prewarm_tier_used_bytes", "Bytes held by each tier.", ["tier"], registry=REGISTRY
)
TIER_BUDGET_BYTES = Gauge(
    "prewarm_tier_budget_bytes", "Budget of each tier.", ["tier"], registry=REGISTRY
)
EVICTIONS = Counter(
    "prewarm_evictions",
    "Snapshots evicted, by tier and reason (pressure, watermark, manual, verify).",
    ["tier", "reason"],
    registry=REGISTRY,
)
PULLS_IN_FLIGHT = Gauge("prewarm_pulls_in_flight", "Pulls running now.", registry=REGISTRY)
LEASES = Gauge("prewarm_leases", "Live leases.", registry=REGISTRY)
