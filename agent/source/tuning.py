"""How hard one pull pushes: the numbers a data plane is handed, and where they come from.

``Tuning`` is the frozen set of numbers one pull runs with; ``tune`` decides
them from the agent's config (``[s3]``) and a request's ``PullOptions``.
Precedence, per field: the request's option, else the config's pinned value,
else the automatic one. A request that joins a pull already in flight gets
that pull's tuning: there is one flight per snapshot.

The automatic numbers follow from how S3 behaves, not from loopback: one GET
gets about ``S3_BYTES_PER_GET`` (50 MB/s; the AWS CRT plans 4 Gbit/s per S3
address over 10 connections), so a node needs its bandwidth / 50 MB/s GETs in
flight: ~62 at 25 Gbit/s, ~1,000 on a 400 Gbit/s p5. That figure only plans
part sizes, worker processes and memory; how many GETs actually run is found
by measuring the link (agent.source.concurrency), between a floor and
``max_concurrency``. Parts are small enough that every stream gets several
(so the tail of a pull stays short) and big enough that the node's GETs per
second stay under half of S3's per-prefix request limit at full rate.

The plane-specific parts (the processes plane's worker count and per-stream
buffer) live with it in agent.source.process_plane.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from agent._config import S3Settings
from agent._vocabulary import PullOptions

__all__ = [
    "DEFAULT_TARGET_GBPS",
    "IN_LOOP_CONCURRENCY",
    "S3_BYTES_PER_GET",
    "S3_GETS_PER_PREFIX",
    "Tuning",
    "concurrency_ceiling",
    "connection_pool_size",
    "node_gbps",
    "node_streams",
    "part_size",
    "start_concurrency",
    "tune",
]

MiB = 1024**2
# What one GET to S3 carries, in bytes/s: the AWS CRT's planning figure (4 Gbit/s per
# S3 address with 10 connections), the low end of the 50-90 MB/s measured per GET.
S3_BYTES_PER_GET = 50 * 10**6
# S3's request limit per partitioned prefix (GET/HEAD per second), and the share of it
# a node's pull may use at its full rate: the rest is for other readers of the prefix.
S3_GETS_PER_PREFIX = 5500
PREFIX_SHARE = 0.5
# GETs per second the daemon hands out at most at the node's full rate: each costs its
# event loop about 0.6 ms (presign lookup, the job message, the journal line: measured
# on this 2-core VM), so 1,000/s keeps the loop under about 60 % busy.
DAEMON_GETS_PER_SECOND = 1000
# Parts per planned stream: each stream reads several, so the last wave is short.
PARTS_PER_STREAM = 8
MIN_PART = 8 * MiB
MAX_PART = 64 * MiB
# The adaptive ceiling when max_concurrency is auto: twice the planned streams (S3's
# per-GET rate varies by region, object and hour), within these bounds.
MIN_CEILING = 256
MAX_CEILING = 4096
# Where the adaptive limit starts: the planned streams, within these bounds.
MIN_START = 16
MAX_START = 64
# GETs in flight for the aiobotocore plane (the event loop's reads) when not pinned.
IN_LOOP_CONCURRENCY = 16
# The instance's bandwidth to S3 when it is not one of NODE_GBPS and target_gbps is auto.
DEFAULT_TARGET_GBPS = 25.0
# Bandwidth to S3 of the GPU instance types this agent is for, in Gbit/s (the AWS CRT's
# platform figures: what the node's CPUs reach over ENA, not the EFA fabric).
NODE_GBPS: dict[str, float] = {
    "p4d.24xlarge": 400.0,
    "p4de.24xlarge": 400.0,
    "p5.48xlarge": 400.0,
    "p5e.48xlarge": 400.0,
    "p5en.48xlarge": 400.0,
    "g5.48xlarge": 100.0,
    "g6.48xlarge": 100.0,
    "g6e.48xlarge": 400.0,
}
# EC2 (Nitro) names the instance type in the DMI product name: no metadata call needed.
_DMI_PRODUCT = Path("/sys/devices/virtual/dmi/id/product_name")


@dataclass(frozen=True, slots=True)
class Tuning:
    """Everything a data plane needs to know about how to run one pull."""

    # GETs in flight: where an adaptive pull starts (the node's limit decides after
    # that), or the pinned number.
    concurrency: int
    # Whether the plane may move concurrency with the measured link (not pinned).
    adaptive: bool
    # Bytes per range: one GET, one journal line.
    chunk_size: int
    # A GET under low_speed_limit bytes/s for low_speed_seconds is cut and resumed.
    low_speed_seconds: float
    low_speed_limit: int
    # Extra attempts per range after a transient failure.
    range_retries: int
    # Bytes gathered from a body before one positional write (a fixed step: 64 KiB to
    # 4 MiB made no measured difference; tests shrink it to cut bodies mid-block).
    io_block: int = 4 * 1024**2


def node_gbps(settings: S3Settings, *, product: Path = _DMI_PRODUCT) -> float:
    """The node's bandwidth to S3 that automatic sizing aims at, in Gbit/s.

    ``target_gbps`` when set; else the EC2 instance type's (NODE_GBPS), read
    from the DMI product name; else DEFAULT_TARGET_GBPS.
    """
    if isinstance(settings.target_gbps, float | int):
        return float(settings.target_gbps)
    try:
        instance_type = product.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return DEFAULT_TARGET_GBPS
    return NODE_GBPS.get(instance_type, DEFAULT_TARGET_GBPS)


def node_streams(gbps: float) -> int:
    """GETs in flight a node of ``gbps`` needs against S3: its rate / S3_BYTES_PER_GET."""
    return max(1, math.ceil(gbps * 1e9 / 8 / S3_BYTES_PER_GET))


def concurrency_ceiling(settings: S3Settings, gbps: float) -> int:
    """The most GETs the node may have in flight: max_concurrency, or twice the planned
    streams when it is auto; never under a pinned concurrency."""
    if isinstance(settings.max_concurrency, int):
        ceiling = settings.max_concurrency
    else:
        ceiling = min(MAX_CEILING, max(MIN_CEILING, 2 * node_streams(gbps)))
    pinned = settings.concurrency if isinstance(settings.concurrency, int) else 0
    return max(ceiling, pinned)


def start_concurrency(settings: S3Settings, gbps: float) -> int:
    """Where the node's adaptive limit starts: the planned streams, 16 to 64."""
    start = min(MAX_START, max(MIN_START, node_streams(gbps)))
    return min(start, concurrency_ceiling(settings, gbps))


def connection_pool_size(settings: S3Settings) -> int:
    """HTTP connections the shared aiobotocore client may keep: listings, HEADs, and the
    aiobotocore plane's GETs when a request asks for it."""
    pinned = settings.concurrency if isinstance(settings.concurrency, int) else 0
    return max(10, 2 * max(IN_LOOP_CONCURRENCY, min(pinned, 256)))


def part_size(total_bytes: int, gbps: float) -> int:
    """Bytes per GET (and journal range) for a pull of ``total_bytes`` on a node of ``gbps``.

    PARTS_PER_STREAM parts for each planned stream, 8 to 64 MiB, and never so small that
    the node at full rate would send more than PREFIX_SHARE of S3's per-prefix GET rate,
    or more GETs per second than the daemon's loop hands out comfortably. Whole MiB, so
    O_DIRECT's alignment holds at every range's start.
    """
    streams = node_streams(gbps)
    wanted = min(MAX_PART, max(MIN_PART, total_bytes // (PARTS_PER_STREAM * streams)))
    gets_per_second = min(S3_GETS_PER_PREFIX * PREFIX_SHARE, DAEMON_GETS_PER_SECOND)
    by_request_rate = gbps * 1e9 / 8 / gets_per_second
    return math.ceil(max(wanted, by_request_rate) / MiB) * MiB


def tune(
    settings: S3Settings,
    total_bytes: int,
    options: PullOptions | None = None,
    *,
    plane: str,
    gbps: float,
) -> Tuning:
    """The tuning of a pull of ``total_bytes`` on ``plane``: request > pinned config > auto.

    A pinned or requested concurrency is taken as is (up to the ceiling) and not
    adapted. Automatic concurrency on the processes plane adapts to the link from
    where the node's limit stands; the aiobotocore plane runs IN_LOOP_CONCURRENCY.
    """
    options = options or PullOptions()
    ceiling = concurrency_ceiling(settings, gbps)
    pinned = options.concurrency or (
        settings.concurrency if isinstance(settings.concurrency, int) else None
    )
    adaptive = pinned is None and plane == "processes"
    if pinned is not None:
        concurrency = min(pinned, ceiling)
    elif adaptive:
        concurrency = start_concurrency(settings, gbps)
    else:
        concurrency = min(IN_LOOP_CONCURRENCY, ceiling)
    if options.chunk_size:
        chunk = options.chunk_size
    elif isinstance(settings.chunk_size, int):
        chunk = int(settings.chunk_size)
    else:
        chunk = part_size(total_bytes, gbps)
    return Tuning(
        concurrency=concurrency,
        adaptive=adaptive,
        chunk_size=chunk,
        low_speed_seconds=settings.low_speed_seconds,
        low_speed_limit=int(settings.low_speed_limit),
        range_retries=settings.retries,
    )
