"""The processes data plane against the real S3 server: its own behaviours.

The faults every plane shares (5xx, SlowDown, resets, short and stalled bodies)
are in test_data_planes.py, parametrized over this plane too; these are the
behaviours of its worker processes: either tier, a changed object, a full
tier, workers that die or stop answering mid-pull, a stop that leaves nothing
writing, workers that hold no credentials, and the environment it refuses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_data_planes import assert_identical, published, running_agent, sent_by, shards

from agent import NoSpace, SourceChanged
from agent._config import S3Settings
from agent._uri import parse_uri
from agent._vocabulary import PullOptions, TierName
from agent.pull.puller import Puller
from agent.pull.resolver import resolve
from agent.service.request import EnsureRequest
from agent.service.results import EnsureResult
from agent.source.process_plane import ProcessPlane, WorkerPool
from agent.source.s3 import S3Source
from agent.store.catalog import Store
from agent.testing import Fault, FaultProxy, S3Server, SampleModel

PROCESSES = PullOptions(data_plane="processes")


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the shared S3 server."""
    with FaultProxy(s3_server.endpoint_url) as running:
        yield running


async def _pool(puller: Puller) -> WorkerPool:
    """The puller's worker processes, started."""
    plane = puller.plane("processes")
    assert isinstance(plane, ProcessPlane)
    await plane.start()
    return plane.pool


def _environments(pids: list[int]) -> list[list[bytes]]:
    return [Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in pids]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("tier", ["shm", "disk"])
async def test_processes_plane_fills_either_tier_byte_for_byte(
    tier: TierName, tmp_path: Path, s3_server: S3Server, small_model: SampleModel
) -> None:
    """On /dev/shm and on disk alike, workers write the bodies into the tier and they publish
    intact, every ranged GET sent by a worker process."""
    s3_server.clear_requests()
    async with running_agent(tmp_path, s3_server, s3_server.endpoint_url) as agent:
        result = None
        async for event in agent.service.ensure(
            EnsureRequest(uri=parse_uri(small_model.uri), tier=tier, options=PROCESSES)
        ):
            if isinstance(event, EnsureResult):
                result = event
        assert result is not None
        [check] = await agent.service.verify(result.model.key, every=True, report_only=True)
    assert result.model.tier == tier
    assert_identical(result, small_model)
    assert check.problems == ()
    gets = [
        r for r in s3_server.requests(bucket=small_model.bucket) if r.method == "GET" and r.range
    ]
    assert gets
    assert {sent_by(r.user_agent) for r in gets} == {"processes"}


async def test_auto_pulls_through_the_processes_plane(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel
) -> None:
    """With data_plane = "auto" and no request option, every ranged GET is a worker's."""
    s3_server.clear_requests()
    async with running_agent(
        tmp_path, s3_server, s3_server.endpoint_url, concurrency="auto"
    ) as agent:
        assert agent.puller.data_plane == "processes"
        result = await agent.ensure(small_model.uri)
    assert_identical(result, small_model)
    requests = s3_server.requests(bucket=small_model.bucket)
    gets = [r.user_agent for r in requests if r.method == "GET" and r.range]
    assert gets
    assert {sent_by(agent) for agent in gets} == {"processes"}


async def test_an_object_replaced_mid_pull_fails_with_source_changed(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel, proxy: FaultProxy
) -> None:
    """A shard replaced while its GET stalls: the retry's signed If-Match fails the pull."""
    victim = shards(small_model)[0]
    proxy.add(Fault.stall(after_bytes=10_000, key=victim, times=1))
    async with running_agent(
        tmp_path, s3_server, proxy.endpoint_url, low_speed_seconds=0.5, concurrency=1
    ) as agent:
        pull = asyncio.create_task(agent.ensure(small_model.uri, PROCESSES))
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


async def test_a_full_tier_is_no_space_and_leaves_no_staging(
    tiny_tmpfs: Path,
    tmp_path: Path,
    s3_server: S3Server,
    small_model: SampleModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's write into a tier that fills up fails the pull with NoSpace."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    settings = S3Settings(
        endpoint_url=s3_server.endpoint_url,
        addressing_style="path",
        data_plane="processes",
        chunk_size=1024**2,
    )
    store = Store({"shm": tiny_tmpfs, "disk": tmp_path / "disk"})
    await store.open()
    async with S3Source(settings) as source, Puller(store, source, settings) as puller:
        snapshot = await resolve(source, parse_uri(small_model.uri), (), ())
        flight, _ = puller.join(snapshot, "shm")
        with pytest.raises(NoSpace, match="ran out of space"):
            await flight.result()
    assert list((tiny_tmpfs / "snapshots").iterdir()) == []
    assert list((tiny_tmpfs / "staging").iterdir()) == []


async def test_killed_workers_lose_only_their_ranges_and_are_replaced(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel, proxy: FaultProxy
) -> None:
    """Every worker SIGKILLed while a GET stalls: their ranges go to new workers within the
    range retries, the files come out identical, and the pool is whole again."""
    proxy.add(Fault.stall(after_bytes=10_000, key=small_model.prefix, times=1))
    async with running_agent(
        tmp_path, s3_server, proxy.endpoint_url, low_speed_seconds=60, worker_processes=2
    ) as agent:
        pool = await _pool(agent.puller)
        pull = asyncio.create_task(agent.ensure(small_model.uri, PROCESSES))
        await asyncio.to_thread(proxy.wait_injected, "stall")
        killed = pool.pids()
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        result = await pull
        replaced = pool.pids()
    assert_identical(result, small_model)
    assert len(replaced) == 2
    assert not set(killed) & set(replaced)


async def test_stopping_a_pull_cuts_its_reads_and_the_workers_exit_with_the_agent(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel, proxy: FaultProxy
) -> None:
    """Shutdown stops a pull whose GETs are all silent long before any timeout, keeps its
    staging for a resume, and leaves no worker process behind."""
    proxy.add(Fault.stall(after_bytes=10_000, key=small_model.prefix, times=None))
    async with running_agent(
        tmp_path,
        s3_server,
        proxy.endpoint_url,
        low_speed_seconds=60,
    ) as agent:
        pids = (await _pool(agent.puller)).pids()
        pull = asyncio.create_task(agent.ensure(small_model.uri, PROCESSES))
        await asyncio.to_thread(proxy.wait_injected, "stall")
        stopping = time.monotonic()
        # Leaving the block stops the puller, which cancels its pulls (a shutdown).
    stopped = time.monotonic() - stopping
    with pytest.raises(asyncio.CancelledError):
        await pull
    assert stopped < 10, stopped
    assert published(tmp_path) == []
    assert list((tmp_path / "disk" / "staging").iterdir())  # kept for a resume
    assert pids
    assert not [pid for pid in pids if _alive(pid)]


async def test_a_worker_that_does_not_answer_stop_is_killed_before_the_pull_returns(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel, proxy: FaultProxy
) -> None:
    """A frozen worker (SIGSTOP) cannot acknowledge a stop: shutdown kills it after the grace,
    so nothing of the stopped pull can write into its staging files afterwards."""
    proxy.add(Fault.stall(after_bytes=10_000, key=small_model.prefix, times=None))
    async with running_agent(
        tmp_path, s3_server, proxy.endpoint_url, low_speed_seconds=60, worker_processes=1
    ) as agent:
        pool = await _pool(agent.puller)
        pool.stop_grace = 1.0
        [frozen] = pool.pids()
        pull = asyncio.create_task(agent.ensure(small_model.uri, PROCESSES))
        await asyncio.to_thread(proxy.wait_injected, "stall")
        os.kill(frozen, signal.SIGSTOP)
        stopping = time.monotonic()
        # Leaving the block stops the puller, which cancels its pulls (a shutdown).
    stopped = time.monotonic() - stopping
    with pytest.raises(asyncio.CancelledError):
        await pull
    assert not _alive(frozen)
    assert 1.0 <= stopped < 10, stopped
    assert published(tmp_path) == []


async def test_a_frozen_worker_is_killed_and_its_ranges_finish_on_another(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel, proxy: FaultProxy
) -> None:
    """A worker SIGSTOPped with a range in hand stops saying it is alive: after the pool's
    stall bound it is killed and the pull (and whoever joined it) ends intact, rather than
    hanging until someone sends SIGCONT."""
    proxy.add(Fault.stall(after_bytes=10_000, key=small_model.prefix, times=1))
    async with running_agent(
        tmp_path, s3_server, proxy.endpoint_url, low_speed_seconds=60, worker_processes=1
    ) as agent:
        pool = await _pool(agent.puller)
        pool.stall_seconds = 2.0
        [frozen] = pool.pids()
        pull = asyncio.create_task(agent.ensure(small_model.uri, PROCESSES))
        await asyncio.to_thread(proxy.wait_injected, "stall")
        os.kill(frozen, signal.SIGSTOP)
        result = await asyncio.wait_for(pull, 30)
        replaced = pool.pids()
    assert_identical(result, small_model)
    assert not _alive(frozen)
    assert frozen not in replaced


async def test_a_requesters_pull_is_presigned_with_the_requesters_keys(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flight with a source of its own (a requester's keys) on the processes plane: every
    ranged GET the workers send is presigned (SigV4, If-Match signed, valid 15 minutes) with the
    requester's key id, none with the node's.

    (moto cannot enforce IAM on presigned GETs, so the signature's key id is the proof.)
    """
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    settings = S3Settings(
        endpoint_url=s3_server.endpoint_url, addressing_style="path", chunk_size=1024**2
    )
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    s3_server.clear_requests()
    async with S3Source(settings) as source, Puller(store, source, settings) as puller:
        snapshot = await resolve(source, parse_uri(small_model.uri), (), ())
        requester = source.with_credentials("AKIAREQUESTER", "requester-secret", "")
        flight, _ = puller.join(snapshot, "shm", PROCESSES, source=requester)
        await flight.result()
    requests = s3_server.requests(bucket=small_model.bucket)
    gets = [r for r in requests if r.method == "GET" and r.range]
    assert gets
    assert {sent_by(r.user_agent) for r in gets} == {"processes"}
    assert all("X-Amz-Credential=AKIAREQUESTER%2F" in r.query for r in gets), gets[0].query
    # SigV4 with If-Match signed in: the URL can only fetch this version of the object,
    # and only for 15 minutes should it leak.
    assert all("X-Amz-SignedHeaders=host%3Bif-match" in r.query for r in gets), gets[0].query
    assert all("X-Amz-Expires=900&" in r.query + "&" for r in gets), gets[0].query


async def test_workers_hold_no_credentials(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel
) -> None:
    """A worker's environment has no AWS or prewarm variable: it only ever sees presigned GETs."""
    async with running_agent(tmp_path, s3_server, s3_server.endpoint_url) as agent:
        await agent.ensure(small_model.uri, PROCESSES)
        pids = (await _pool(agent.puller)).pids()
        environments = await asyncio.to_thread(_environments, pids)
    assert pids
    for environment in environments:
        names = {entry.split(b"=", 1)[0] for entry in environment if entry}
        assert names <= {b"PATH", b"PYTHONPATH"}, names


async def test_a_module_planted_in_the_daemons_working_directory_never_runs_in_a_worker(
    tmp_path: Path,
    s3_server: S3Server,
    small_model: SampleModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon started from a directory another user can write: an ``argparse.py`` planted
    there is not imported by the range workers (they would run it as root), and they pull."""
    planted = tmp_path / "writable-by-anyone"
    planted.mkdir()
    marker = tmp_path / "planted-code-ran"
    (planted / "argparse.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(planted)
    async with running_agent(tmp_path, s3_server, s3_server.endpoint_url) as agent:
        result = await agent.ensure(small_model.uri, PROCESSES)
        pids = (await _pool(agent.puller)).pids()
    assert pids
    assert_identical(result, small_model)
    assert not marker.exists()


async def test_slowdown_met_by_a_worker_halves_the_nodes_gets_in_flight(
    tmp_path: Path,
    s3_server: S3Server,
    small_model: SampleModel,
    proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker that meets S3's SlowDown tells the daemon before it retries: the node's
    adaptive limit halves (logged as a back-off) and the pull still lands byte for byte."""
    proxy.add(Fault.slow_down(key=small_model.prefix, times=3))
    async with running_agent(
        tmp_path, s3_server, proxy.endpoint_url, concurrency="auto", max_concurrency=8
    ) as agent:
        plane = agent.puller.plane("processes")
        assert isinstance(plane, ProcessPlane)
        before = plane.limit.limit
        with caplog.at_level(logging.WARNING, logger="agent.source.concurrency"):
            result = await agent.ensure(small_model.uri, PROCESSES)
        after = plane.limit.statistics()
    assert proxy.injected("slow_down") == 3
    assert_identical(result, small_model)
    assert after.throttled >= 1
    assert after.limit <= before // 2
    assert f"backing off, GETs in flight {before} -> {before // 2}" in caplog.text
