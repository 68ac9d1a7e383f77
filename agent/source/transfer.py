"""The numbers one pull's transfer runs with, and how they reach each data plane.

``Tuning`` is what a data plane is handed; the pull layer (agent.pull.tuning)
decides its values from the config and the request. The rest maps settings onto
the S3 clients' own knobs: the shared aiobotocore client's connection pool and
the Run:ai Model Streamer's environment variables (docs/data-planes.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from agent._config import S3Settings

__all__ = [
    "STREAMER_BLOCK",
    "STREAMER_INFLIGHT_MIB",
    "STREAMER_MIN_BLOCK",
    "Tuning",
    "concurrency_ceiling",
    "connection_pool_size",
    "streamer_environment",
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
