"""How hard one pull pushes: concurrency, chunk size, timeouts, from config and request.

The published EKS guidance for the Run:ai Model Streamer is about
``ceil(size_GB / 4)`` parallel streams (4 GB per stream), a request timeout of
3000 ms and a low-speed limit of 1 MiB/s, so one slow GET is abandoned and
retried instead of stalling a 200 GiB pull. This module turns that guidance,
the agent's config (``[s3]``) and a request's ``PullOptions`` into one frozen
``Tuning`` per pull, and maps it onto each data plane's knobs (see
docs/data-planes.md for the table).

Precedence, per field: the request's option, else the config's pinned value,
else the automatic one. A request that joins a pull already in flight gets
that pull's tuning: there is one flight per snapshot.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from agent._config import S3Settings
from agent._exceptions import InvalidRequest

__all__ = [
    "DATA_PLANE_CHOICES",
    "GB_PER_STREAM",
    "GETS_PER_STREAM",
    "STREAMER_BLOCK",
    "STREAMER_INFLIGHT_MIB",
    "STREAMER_MIN_BLOCK",
    "DataPlaneChoice",
    "PullOptions",
    "Tuning",
    "auto_concurrency",
    "concurrency_ceiling",
    "connection_pool_size",
    "streamer_environment",
    "tune",
]

DataPlaneChoice = Literal["auto", "streamer", "aiobotocore"]
DATA_PLANE_CHOICES: tuple[DataPlaneChoice, ...] = ("auto", "streamer", "aiobotocore")

# Decimal gigabytes, as in the guidance (145 GB -> 37 streams).
GB_PER_STREAM = 4 * 10**9
# Ranged GETs the aiobotocore plane runs per automatic stream. A streamer stream is a
# CRT client with several parts in flight; a GET is one connection read in order.
# Measured here (docs/data-planes.md): 2 or 4 GETs per stream beat 1 by about 30 %.
GETS_PER_STREAM = 4
# The streamer refuses object-storage reads in blocks under 5 MiB.
STREAMER_MIN_BLOCK = 5 * 1024**2
STREAMER_BLOCK = 8 * 1024**2
# Bytes each of the streamer's S3 clients may have in flight (its CRT buffers).
STREAMER_INFLIGHT_MIB = 64
_MIN_CHUNK = 1024**2
_MAX_CHUNK = 4 * 1024**3


@dataclass(frozen=True, slots=True)
class PullOptions:
    """A request's overrides of the config; None (or 0 on the wire) keeps the config's."""

    data_plane: DataPlaneChoice | None = None
    concurrency: int | None = None
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.data_plane is not None and self.data_plane not in DATA_PLANE_CHOICES:
            choices = ", ".join(DATA_PLANE_CHOICES)
            raise InvalidRequest(f"Unknown data plane {self.data_plane!r}; use one of {choices}.")
        if self.concurrency is not None and self.concurrency < 1:
            raise InvalidRequest(f"concurrency must be at least 1, not {self.concurrency}.")
        if self.chunk_size is not None and not _MIN_CHUNK <= self.chunk_size <= _MAX_CHUNK:
            raise InvalidRequest(
                f"chunk_size must be between 1 MiB and 4 GiB, not {self.chunk_size} bytes."
            )


@dataclass(frozen=True, slots=True)
class Tuning:
    """Everything a data plane needs to know about how to run one pull."""

    concurrency: int
    # Bytes per range: one GET on the aiobotocore plane, one delivered chunk on the
    # streamer's, one journal line either way.
    chunk_size: int
    # aiobotocore: bytes gathered from a body before one positional write.
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
    streams, and the aiobotocore plane runs GETS_PER_STREAM GETs per stream.
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
        concurrency = (
            streams
            if plane == "streamer"
            else min(streams * GETS_PER_STREAM, settings.max_concurrency)
        )
    return Tuning(
        concurrency=concurrency,
        chunk_size=options.chunk_size or int(settings.chunk_size),
        io_block=int(settings.io_block),
        request_timeout=settings.request_timeout_ms / 1000,
        low_speed_limit=int(settings.low_speed_limit),
        range_retries=settings.range_retries,
    )


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
        # We retry failed ranges ourselves, per range (see _plane_streamer).
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
