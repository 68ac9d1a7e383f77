"""The threads data plane against the real S3 server: both tiers, a changed object, stopping.

The faults every plane shares (5xx, SlowDown, resets, short and stalled bodies)
are in test_data_planes.py, parametrized over the threads plane too; these are
the behaviours of its own: bodies read into the pages of either tier, If-Match
on every GET, and a stop that cuts the sockets its worker threads read from.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_data_planes import assert_identical, published, running_agent, shards

from agent import SourceChanged
from agent._vocabulary import PullOptions, TierName
from agent.service.operations import EnsureResult
from agent.testing import Fault, FaultProxy, S3Server, SampleModel

THREADS = PullOptions(data_plane="threads")


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the shared S3 server."""
    with FaultProxy(s3_server.endpoint_url) as running:
        yield running


@pytest.mark.parametrize("tier", ["shm", "disk"])
async def test_threads_plane_fills_either_tier_byte_for_byte(
    tier: TierName, tmp_path: Path, s3_server: S3Server, small_model: SampleModel
) -> None:
    """On /dev/shm and on disk alike, the bodies land in the tier's pages and publish intact."""
    async with running_agent(tmp_path, s3_server, s3_server.endpoint_url) as agent:
        result = None
        async for event in agent.service.ensure(
            small_model.uri, tier=tier, include=(), options=THREADS
        ):
            if isinstance(event, EnsureResult):
                result = event
        assert result is not None
        [check] = await agent.service.verify(result.model.key, every=True, report_only=True)
    assert result.model.tier == tier
    assert_identical(result, small_model)
    assert check.problems == ()


async def test_an_object_replaced_mid_pull_fails_with_source_changed(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel, proxy: FaultProxy
) -> None:
    """A shard replaced while its GET stalls: the retry's If-Match fails the pull, nothing mixed."""
    victim = shards(small_model)[0]
    proxy.add(Fault.stall(after_bytes=10_000, key=victim, times=1))
    async with running_agent(
        tmp_path, s3_server, proxy.endpoint_url, request_timeout_ms=500, concurrency=1
    ) as agent:
        pull = asyncio.create_task(agent.ensure(small_model.uri, THREADS))
        await asyncio.to_thread(proxy.wait_injected, "stall")
        await asyncio.to_thread(
            s3_server.client().put_object,
            Bucket=small_model.bucket,
            Key=victim,
            Body=b"replaced while the agent was reading it",
        )
        with pytest.raises(SourceChanged, match="changed"):
            await pull
    assert published(tmp_path) == []


async def test_stopping_a_threads_pull_cuts_its_reads_at_once(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel, proxy: FaultProxy
) -> None:
    """Shutdown cuts every body a worker is blocked on, long before any timeout; staging stays."""
    proxy.add(Fault.stall(after_bytes=10_000, key=small_model.prefix, times=None))
    # Neither the low-speed window nor the read timeout would end these reads soon.
    async with running_agent(
        tmp_path,
        s3_server,
        proxy.endpoint_url,
        request_timeout_ms=60_000,
        read_timeout_seconds=60,
    ) as agent:
        pull = asyncio.create_task(agent.ensure(small_model.uri, THREADS))
        await asyncio.to_thread(proxy.wait_injected, "stall")
        stopping = time.monotonic()
        # Leaving the block stops the puller, which cancels its pulls (a shutdown).
    stopped = time.monotonic() - stopping
    with pytest.raises(asyncio.CancelledError):
        await pull
    assert stopped < 10, stopped
    assert published(tmp_path) == []
    assert list((tmp_path / "disk" / "staging").iterdir())  # kept for a resume
    # Every worker whose body was cut ends promptly, none left blocked on a socket.
    for worker in [t for t in threading.enumerate() if t.name.startswith("prewarm-get")]:
        worker.join(timeout=10)
        assert not worker.is_alive(), worker.name
