"""How hard one pull pushes, and how that reaches each data plane.

``Tuning`` is the frozen set of numbers one pull runs with (concurrency, chunk
size, timeouts); ``tune`` decides them from the agent's config (``[s3]``) and a
request's ``PullOptions``. The published EKS guidance for the Run:ai Model
Streamer is about ``ceil(size_GB / 4)`` parallel streams (4 GB per stream), a
request timeout of 3000 ms and a low-speed limit of 1 MiB/s, so one slow GET is
abandoned and retried instead of stalling a 200 GiB pull.

Precedence, per field: the request's option, else the config's pinned value,
else the automatic one. A request that joins a pull already in flight gets
that pull's tuning: there is one flight per snapshot.

The rest maps settings onto the S3 clients' own knobs: the shared aiobotocore
client's connection pool, the processes plane's worker count and the Run:ai
Model Streamer's environment variables (docs/data-planes.md has the table).
It lives in the source because the data planes are handed a ``Tuning``, and
the source may not import the pull layer.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from agent._config import S3Settings
from agent._vocabulary import PullOptions

__all__ = [
    "DEFAULT_TARGET_GBPS",
    "GBPS_PER_CONNECTION",
    "GB_PER_STREAM",
    "GETS_PER_STREAM",
    "STREAMER_BLOCK",
    "STREAMER_INFLIGHT_MIB",
    "STREAMER_MIN_BLOCK",
    "THREADS_PER_STREAM",
    "Tuning",
    "auto_concurrency",
    "concurrency_ceiling",
    "connection_pool_size",
    "node_gbps",
    "streamer_environment",
    "tune",
    "worker_processes",
]

# The streamer refuses object-storage reads in blocks under 5 MiB.
STREAMER_MIN_BLOCK = 5 * 1024**2
STREAMER_BLOCK = 8 * 1024**2
# Bytes each of the streamer's S3 clients may have in flight (its CRT buffers).
STREAMER_INFLIGHT_MIB = 64


@dataclass(frozen=True, slots=True)
class Tuning:
    """Everything a data plane needs to know about how to run one pull."""

    concurrency: int
    # Bytes per range: one GET on the aiobotocore plane, one delivered chunk on the
    # streamer's, one journal line either way.
    chunk_size: int
    # aiobotocore: bytes gathered from a body before one positional write; threads:
    # the most bytes one read takes, and how often progress goes to the loop.
    io_block: int
    # A GET under low_speed_limit bytes/s for this long is abandoned and retried.
    request_timeout: float
    low_speed_limit: int
    # Extra attempts per range after a transient failure.
    range_retries: int

    @property
    def streamer_block(self) -> int:
        """RUNAI_STREAMER_CHUNK_BYTESIZE: each streamer thread's GET (its CRT part size).

        8 MiB, the streamer's own default, measured faster here than 64 MiB
        blocks (docs/data-planes.md); the streamer refuses less than 5 MiB.
        """
        return max(STREAMER_MIN_BLOCK, min(self.chunk_size, STREAMER_BLOCK))

    @property
    def streamer_memory(self) -> int:
        """Bytes of the streamer's ring: two ranges, and two blocks per stream, so
        every stream has work while a finished range is being written out."""
        return max(2 * self.chunk_size, 2 * self.concurrency * self.streamer_block)


def concurrency_ceiling(settings: S3Settings) -> int:
    """The most streams any pull may use: the config maximum, or a higher pinned value."""
    pinned = settings.concurrency if isinstance(settings.concurrency, int) else 0
    return max(settings.max_concurrency, pinned)


def connection_pool_size(settings: S3Settings) -> int:
    """HTTP connections the shared aiobotocore client may keep: room for every stream."""
    return max(10, 2 * concurrency_ceiling(settings))


def streamer_environment(settings: S3Settings, tuning: Tuning | None = None) -> dict[str, str]:
    """The RUNAI_STREAMER_* / AWS_* variables that give the streamer these settings.

    Without ``tuning``: only what holds for every pull (endpoint, addressing,
    timeouts). With it: also this pull's concurrency and block size, which the
    streamer reads when it starts.
    """
    env: dict[str, str] = {
        "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": str(settings.request_timeout_ms),
        # 0 would mean "the SDK's default" (1 byte/s) to the streamer; 1 is as lax.
        "RUNAI_STREAMER_S3_LOW_SPEED_LIMIT": str(max(1, int(settings.low_speed_limit))),
        # We retry failed ranges ourselves, per range (see agent.source.streamer_plane).
        "RUNAI_STREAMER_S3_TIMEOUT": "0",
    }
    if settings.endpoint_url:
        env["AWS_ENDPOINT_URL"] = settings.endpoint_url
    if settings.region:
        env["AWS_REGION"] = settings.region
    virtual = {"path": "0", "virtual": "1"}.get(settings.addressing_style)
    if virtual is None and (settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")):
        virtual = "0"  # "auto" with a custom endpoint: S3-compatible servers want paths
    if virtual is not None:
        env["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = virtual
    if tuning is not None:
        env["RUNAI_STREAMER_CONCURRENCY"] = str(tuning.concurrency)
        env["RUNAI_STREAMER_CHUNK_BYTESIZE"] = str(tuning.streamer_block)
        env["RUNAI_STREAMER_S3_MAX_INFLIGHT_MIB"] = str(
            max(STREAMER_INFLIGHT_MIB, 2 * tuning.streamer_block // 1024**2)
        )
    return env


# Decimal gigabytes, as in the guidance (145 GB -> 37 streams).
GB_PER_STREAM = 4 * 10**9
# Ranged GETs the aiobotocore plane runs per automatic stream. A streamer stream is a
# CRT client with several parts in flight; a GET is one connection read in order.
# Measured here (docs/data-planes.md): 2 or 4 GETs per stream beat 1 by about 30 %.
GETS_PER_STREAM = 4
# Worker threads the threads plane runs per automatic stream. A worker spends its
# time blocked in recv with the GIL released, and the pull's CPU spreads over the
# workers: at about 1 CPU-s per GiB in all, 16 of them keep the busiest thread
# near 0.06 CPU-s per GiB (under the 0.1 target) where 4 leave it near 0.27, and
# 16 were also the fastest on the wall clock here (docs/data-planes.md). Each
# costs a connection and one io_block window of mapped pages.
THREADS_PER_STREAM = 16
# What one connection to S3 carries (AWS's figure for a single S3 connection): a node
# that should reach target_gbps needs about target_gbps / 5 GETs in flight.
GBPS_PER_CONNECTION = 5.0
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
# Interpreter-lock seconds one worker process holds per GiB it moves over HTTPS
# (py-spy --gil, 2 GiB, 2 workers, this 2-core VM: 0.26-0.29; over HTTP 0.10-0.11;
# docs/data-planes.md), and the share of its lock a worker may keep busy at the node's
# target: the processes plane runs enough workers that none is the bottleneck.
GIL_SECONDS_PER_GIB = 0.25
GIL_SHARE = 0.5
MIN_WORKER_PROCESSES = 2
MAX_WORKER_PROCESSES = 32


def auto_concurrency(total_bytes: int, *, cpus: int, maximum: int) -> int:
    """ceil(size / 4 GB) streams, at most ``cpus`` and ``maximum``, at least 1."""
    wanted = math.ceil(total_bytes / GB_PER_STREAM)
    return max(1, min(wanted, cpus, maximum))


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


def worker_processes(settings: S3Settings, *, gbps: float | None = None) -> int:
    """Worker processes of the processes plane: pinned, or enough for the node's bandwidth.

    Each worker may spend at most GIL_SHARE of its interpreter lock at the
    node's full rate: ``rate (GiB/s) x GIL_SECONDS_PER_GIB / GIL_SHARE``.
    """
    if isinstance(settings.worker_processes, int):
        return settings.worker_processes
    rate = (gbps if gbps is not None else node_gbps(settings)) / 8 * 10**9 / 1024**3
    wanted = math.ceil(rate * GIL_SECONDS_PER_GIB / GIL_SHARE)
    return max(MIN_WORKER_PROCESSES, min(wanted, MAX_WORKER_PROCESSES))


def tune(
    settings: S3Settings,
    total_bytes: int,
    options: PullOptions | None = None,
    *,
    plane: str,
    cpus: int | None = None,
    gbps: float | None = None,
) -> Tuning:
    """The tuning of a pull of ``total_bytes`` on ``plane``: request > pinned config > auto.

    A pinned or requested concurrency is taken as is: streamer threads (one CRT
    client each) or parallel ranged GETs. The automatic one is counted in
    streams: the aiobotocore plane runs GETS_PER_STREAM GETs per stream and the
    threads plane THREADS_PER_STREAM worker threads.
    """
    options = options or PullOptions()
    ceiling = concurrency_ceiling(settings)
    if options.concurrency is not None:
        concurrency = min(options.concurrency, ceiling)
    elif isinstance(settings.concurrency, int):
        concurrency = settings.concurrency
    else:
        streams = auto_concurrency(
            total_bytes, cpus=cpus or os.cpu_count() or 1, maximum=settings.max_concurrency
        )
        per_stream = {"streamer": 1, "threads": THREADS_PER_STREAM, "processes": THREADS_PER_STREAM}
        concurrency = streams * per_stream.get(plane, GETS_PER_STREAM)
        if plane == "processes":
            # Enough GETs in flight for the node's bandwidth, not only the model's size.
            rate = gbps if gbps is not None else node_gbps(settings)
            concurrency = max(concurrency, math.ceil(rate / GBPS_PER_CONNECTION))
        concurrency = min(concurrency, settings.max_concurrency)
    return Tuning(
        concurrency=concurrency,
        chunk_size=options.chunk_size or int(settings.chunk_size),
        io_block=int(settings.io_block),
        request_timeout=settings.request_timeout_ms / 1000,
        low_speed_limit=int(settings.low_speed_limit),
        range_retries=settings.range_retries,
    )
