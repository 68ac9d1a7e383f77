"""How hard one pull pushes: concurrency, chunk size, timeouts, from config and request.

The published EKS guidance for the Run:ai Model Streamer is about
``ceil(size_GB / 4)`` parallel streams (4 GB per stream), a request timeout of
3000 ms and a low-speed limit of 1 MiB/s, so one slow GET is abandoned and
retried instead of stalling a 200 GiB pull. This module turns that guidance,
the agent's config (``[s3]``) and a request's ``PullOptions`` into one frozen
``Tuning`` per pull; agent.source.transfer maps that onto each data plane's
knobs (see docs/data-planes.md for the table).

Precedence, per field: the request's option, else the config's pinned value,
else the automatic one. A request that joins a pull already in flight gets
that pull's tuning: there is one flight per snapshot.
"""

from __future__ import annotations

import math
import os

from agent._config import S3Settings
from agent._vocabulary import PullOptions
from agent.source.transfer import (
    Tuning,
    concurrency_ceiling,
)

__all__ = ["GB_PER_STREAM", "GETS_PER_STREAM", "THREADS_PER_STREAM", "auto_concurrency", "tune"]

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


def auto_concurrency(total_bytes: int, *, cpus: int, maximum: int) -> int:
    """ceil(size / 4 GB) streams, at most ``cpus`` and ``maximum``, at least 1."""
    wanted = math.ceil(total_bytes / GB_PER_STREAM)
    return max(1, min(wanted, cpus, maximum))


def tune(
    settings: S3Settings,
    total_bytes: int,
    options: PullOptions | None = None,
    *,
    plane: str,
    cpus: int | None = None,
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
        per_stream = {"streamer": 1, "threads": THREADS_PER_STREAM}.get(plane, GETS_PER_STREAM)
        concurrency = min(streams * per_stream, settings.max_concurrency)
    return Tuning(
        concurrency=concurrency,
        chunk_size=options.chunk_size or int(settings.chunk_size),
        io_block=int(settings.io_block),
        request_timeout=settings.request_timeout_ms / 1000,
        low_speed_limit=int(settings.low_speed_limit),
        range_retries=settings.range_retries,
    )
