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
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from test_data_planes import assert_identical, published, running_agent, shards

from agent import AccessDenied, NoSpace, SourceChanged
from agent._config import S3Settings
from agent._uri import parse_uri
from agent._vocabulary import PullOptions, TierName
from agent.pull.puller import Puller
from agent.pull.resolver import resolve
from agent.service.request import EnsureRequest
from agent.service.results import EnsureResult
from agent.source.interface import RangeReadError
from agent.source.pacing import read_step
from agent.source.s3 import S3Source, SourceUnreachable
from agent.source.sync_s3 import translate
from agent.source.threads_plane import ThreadsPlane
from agent.source.tuning import THREADS_PER_STREAM, tune
from agent.store.catalog import Store
from agent.testing import Fault, FaultProxy, S3Server, SampleModel

THREADS = PullOptions(data_plane="threads")
GB = 10**9


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
            EnsureRequest(uri=parse_uri(small_model.uri), tier=tier, options=THREADS)
        ):
            if isinstance(event, EnsureResult):
                result = event
        assert result is not None
        [check] = await agent.service.verify(result.model.key, every=True, report_only=True)
    assert result.model.tier == tier
    assert_identical(result, small_model)
    assert check.problems == ()


async def test_a_full_tier_is_no_space_and_leaves_no_staging(
    tiny_tmpfs: Path,
    tmp_path: Path,
    s3_server: S3Server,
    small_model: SampleModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers writing into a tier that fills up fail the pull with NoSpace (no SIGBUS)."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    settings = S3Settings(
        endpoint_url=s3_server.endpoint_url,
        addressing_style="path",
        data_plane="threads",
        chunk_size=1024**2,
    )
    store = Store({"shm": tiny_tmpfs, "disk": tmp_path / "disk"})
    await store.open()
    async with S3Source(settings) as source, Puller(store, source, settings) as puller:
        # Straight to the puller, past the budget check: the filesystem itself says no.
        snapshot = await resolve(source, parse_uri(small_model.uri), (), ())
        flight, _ = puller.join(snapshot, "shm")
        with pytest.raises(NoSpace, match="ran out of space"):
            await flight.result()
    assert list((tiny_tmpfs / "snapshots").iterdir()) == []
    assert list((tiny_tmpfs / "staging").iterdir()) == []


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


def test_auto_concurrency_runs_threads_per_stream_up_to_the_maximum() -> None:
    """Automatic tuning gives the threads plane THREADS_PER_STREAM workers per stream, capped."""
    settings = S3Settings()
    assert THREADS_PER_STREAM == 16
    assert tune(settings, 2 * GB, plane="threads", cpus=2).concurrency == 16
    assert tune(settings, 9 * GB, plane="threads", cpus=192).concurrency == 48
    assert tune(settings, 900 * GB, plane="threads", cpus=192).concurrency == 128
    assert tune(S3Settings(concurrency=3), GB, plane="threads").concurrency == 3


@pytest.mark.parametrize(
    ("timeout_ms", "limit"), [(3000, 1024**2), (500, 100_000), (60_000, 1024**2), (100, 10)]
)
def test_a_read_never_outlasts_half_a_low_speed_window(timeout_ms: int, limit: int) -> None:
    """Reads take at most half a window's bytes (so the watchdog never cuts a GET keeping
    the pace), at most 512 KiB per worker, and never less than 64 KiB."""
    settings = S3Settings(request_timeout_ms=timeout_ms, low_speed_limit=limit)
    tuning = tune(settings, GB, plane="threads")
    step = read_step(tuning.low_speed_limit, tuning.request_timeout, tuning.io_block)
    needed = limit * timeout_ms / 1000
    assert 64 * 1024 <= step <= 512 * 1024
    assert step <= needed / 2 or step == 64 * 1024


def _client_error(code: str, status: int) -> ClientError:
    answer: Any = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(answer, "GetObject")


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (_client_error("InvalidToken", 400), AccessDenied),
        (_client_error("AllAccessDisabled", 400), AccessDenied),
        (_client_error("PreconditionFailed", 412), SourceChanged),
        (_client_error("SlowDown", 503), RangeReadError),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), SourceUnreachable),
        (ConnectionResetError("reset by peer"), RangeReadError),
    ],
)
async def test_both_clients_read_an_s3_answer_alike(
    error: Exception, expected: type[Exception]
) -> None:
    """The threads plane's translation of a failure is the aiobotocore source's, same class."""
    async with S3Source(S3Settings(endpoint_url="http://127.0.0.1:9")) as source:
        from_source = source._translate(error, "reading s3://b/k")
    from_threads = translate(error, "reading s3://b/k", "http://127.0.0.1:9")
    assert type(from_threads) is type(from_source) is expected
    assert str(from_threads) == str(from_source)


def test_a_closed_threads_plane_builds_no_client() -> None:
    """Closing the plane while it builds its client ahead of the first pull leaves no client."""
    plane = ThreadsPlane(S3Settings(endpoint_url="http://127.0.0.1:9", data_plane="threads"))
    plane.close()
    for builder in [t for t in threading.enumerate() if t.name == "prewarm-threads-client"]:
        builder.join(timeout=10)
    assert plane._client is None
    with pytest.raises(RuntimeError, match="closed"):
        plane._s3()
