"""CancelPull in-process: the service, the puller and a store against the in-memory source.

A pull is held mid-transfer by the source's gate; the tests stop it and check what its
waiters are told, what stays in staging, who may stop it, and that the next pull resumes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest

from agent._config import AccessLimits, S3Settings, Settings
from agent._exceptions import AccessDenied, Cancelled, Conflict, InvalidRequest, NotFound
from agent._uri import parse_uri
from agent.leases.table import LeaseTable
from agent.pull.flight import PullProgress
from agent.pull.puller import Puller
from agent.service.access import PullGate, Requester, Tenant
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest
from agent.service.results import EnsureResult
from agent.store.catalog import Store
from agent.testing import MemorySource

MiB = 1024 * 1024
URI = "s3://models/m"
A_BIN = 3 * MiB + 17
B_BIN = MiB // 2


class _Turnstile(asyncio.Event):
    """A gate that says when a read first stops at it (``reached``)."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = asyncio.Event()

    async def wait(self) -> Literal[True]:
        """Note that a read is held here, then hold it until the gate opens."""
        self.reached.set()
        return await super().wait()


@pytest.fixture
def source() -> MemorySource:
    """A model of three files: a.bin (four 1 MiB chunks), sub/b.bin (half a chunk), empty."""
    memory = MemorySource()
    memory.put("models", "m/a.bin", os.urandom(A_BIN))
    memory.put("models", "m/sub/b.bin", os.urandom(B_BIN))
    memory.put("models", "m/empty", b"")
    return memory


@pytest.fixture
async def store(tmp_path: Path) -> Store:
    """An open store with both tiers under tmp_path."""
    opened = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await opened.open()
    return opened


@pytest.fixture
async def puller(store: Store, source: MemorySource) -> AsyncIterator[Puller]:
    """One worker, 1 MiB chunks: ranges go in path order, a.bin's before sub/b.bin's."""
    settings = S3Settings.model_validate({"chunk_size": MiB, "concurrency": 1})
    async with Puller(store, source, settings) as running:
        yield running


@pytest.fixture
def service(tmp_path: Path, source: MemorySource, puller: Puller, store: Store) -> AgentService:
    """The agent's operations over the store, the puller and the source."""
    settings = Settings.model_validate(
        {
            "default_tier": "disk",
            "socket_path": tmp_path / "agent.sock",
            "tiers": {"shm_root": tmp_path / "shm", "disk_root": tmp_path / "disk"},
        }
    )
    return AgentService(store, puller, source, LeaseTable(60, 3600), settings=settings)


def _tenant(name: str, sources: tuple[str, ...] = ()) -> Requester:
    limits = AccessLimits()
    return Requester(Tenant(name, sources, (), limits, limits, PullGate(0)))


def _request(requester: Requester | None = None, token: str = "") -> EnsureRequest:
    return EnsureRequest(uri=parse_uri(URI), requester=requester, waiter_token=token)


async def _wait_on_pull(
    service: AgentService, request: EnsureRequest, waiting: asyncio.Event
) -> EnsureResult:
    """Ensure, setting ``waiting`` at the first progress of the pull (it is counted by then)."""
    result = None
    async for event in service.ensure(request):
        if isinstance(event, PullProgress):
            waiting.set()
        else:
            result = event
    assert result is not None
    return result


async def _held_pull(
    service: AgentService, source: MemorySource, request: EnsureRequest
) -> asyncio.Task[EnsureResult]:
    """A request whose pull is held at the source's gate, once it waits on that pull."""
    source.gate = source.gate or asyncio.Event()
    waiting = asyncio.Event()
    task = asyncio.create_task(_wait_on_pull(service, request, waiting))
    await waiting.wait()
    return task


async def test_a_cancel_fails_every_waiter_with_cancelled_and_publishes_nothing(
    service: AgentService, source: MemorySource, puller: Puller, store: Store, tmp_path: Path
) -> None:
    """The node's cancel stops a pull two requests wait on: both get Cancelled saying that
    asking again resumes; nothing is published, nothing is in flight, the staging stays."""
    first = await _held_pull(service, source, _request())
    second = await _held_pull(service, source, _request())
    [report] = await service.cancel_pull(URI)
    assert report.cancelled
    assert report.other_waiters == 0
    for waiter in (first, second):
        with pytest.raises(Cancelled, match=r"was cancelled .*ask again and the pull resumes"):
            await waiter
    assert puller.flights() == []
    assert store.models() == []
    assert list((tmp_path / "disk" / "snapshots").iterdir()) == []
    assert store.leftover(report.flight.key) is not None


async def test_a_cancelled_pull_keeps_its_journaled_bytes_and_the_next_pull_resumes(
    service: AgentService, source: MemorySource, store: Store
) -> None:
    """Stopped while sub/b.bin is held, the pull keeps a.bin's journaled chunks: the answer
    and the tier's status count them, and the next pull fetches only sub/b.bin, whole."""
    turnstile = _Turnstile()
    source.gate, source.gate_keys = turnstile, frozenset({"m/sub/b.bin"})
    pulling = asyncio.create_task(_wait_on_pull(service, _request(), asyncio.Event()))
    await turnstile.reached.wait()  # one worker: every a.bin chunk is journaled by now
    [report] = await service.cancel_pull(URI)
    with pytest.raises(Cancelled):
        await pulling
    assert report.kept_bytes == A_BIN
    disk = store.tier_usage("disk")
    assert (disk.resumable_count, disk.resumable_bytes) == (1, A_BIN)
    turnstile.set()
    delivered_before = sum(read.delivered for read in source.reads)
    resumed = await _wait_on_pull(service, _request(), asyncio.Event())
    assert resumed.resumed_bytes == A_BIN
    assert sum(read.delivered for read in source.reads) - delivered_before == B_BIN
    for name in ("a.bin", "sub/b.bin", "empty"):
        assert (resumed.model.path / name).read_bytes() == source.objects["models"][f"m/{name}"]
    assert store.tier_usage("disk").resumable_count == 0


async def test_only_if_unwatched_leaves_a_pull_another_request_waits_on(
    service: AgentService, source: MemorySource, puller: Puller
) -> None:
    """A cancel asked only if nobody else waits, from the request that started the pull (its
    token), leaves it running while another request waits; both get the model."""
    mine = await _held_pull(service, source, _request(token="t-mine"))
    other = await _held_pull(service, source, _request())
    [report] = await service.cancel_pull(URI, only_if_unwatched=True, waiter_token="t-mine")
    assert not report.cancelled
    assert (report.other_waiters, report.kept_bytes) == (1, 0)
    assert len(puller.flights()) == 1
    assert source.gate is not None
    source.gate.set()
    assert (await mine).model.key == (await other).model.key


async def test_only_if_unwatched_does_not_count_the_callers_own_request(
    service: AgentService, source: MemorySource
) -> None:
    """The caller's own request, still counted as waiting when its cancel arrives, does not
    keep the pull alive: it is stopped, and that request gets Cancelled."""
    mine = await _held_pull(service, source, _request(token="t-mine"))
    [report] = await service.cancel_pull(URI, only_if_unwatched=True, waiter_token="t-mine")
    assert report.cancelled
    with pytest.raises(Cancelled):
        await mine


async def test_a_waiter_token_names_only_the_pulls_its_own_request_waited_on(
    service: AgentService, source: MemorySource, puller: Puller
) -> None:
    """With a waiter token, a cancel names only pulls that token's request (on the same
    socket) waited on: a token never sent, or sent on another socket, finds nothing to
    cancel, and the pull goes on."""
    theirs = await _held_pull(service, source, _request(_tenant("team-a"), token="t-1"))
    for socket, token in (("team-a", "t-never-sent"), ("team-b", "t-1")):
        with pytest.raises(NotFound, match="nothing to cancel"):
            await service.cancel_pull(
                URI, _tenant(socket), only_if_unwatched=True, waiter_token=token
            )
    assert len(puller.flights()) == 1
    assert source.gate is not None
    source.gate.set()
    await theirs


async def test_a_request_that_gave_up_still_names_the_pull_it_waited_on(
    service: AgentService, source: MemorySource, puller: Puller, store: Store
) -> None:
    """A request that has already gone away (its client interrupted) still names, by its
    token, the pull it waited on: nobody waits now, so it is stopped, its bytes kept."""
    mine = await _held_pull(service, source, _request(token="t-gone"))
    mine.cancel()
    with pytest.raises(asyncio.CancelledError):
        await mine
    assert puller.flights()[0].waiters == 0
    [report] = await service.cancel_pull(URI, only_if_unwatched=True, waiter_token="t-gone")
    assert report.cancelled
    assert puller.flights() == []
    assert store.leftover(report.flight.key) is not None


async def test_a_tenant_stops_its_own_pull_but_not_one_another_socket_waits_on(
    service: AgentService, source: MemorySource
) -> None:
    """A tenant allowed the source stops a pull only its own requests wait on; with another
    socket's request waiting too, its cancel is Conflict and the pull goes on."""
    team_a = _tenant("team-a", ("s3://models/*",))
    mine = await _held_pull(service, source, _request(team_a))
    theirs = await _held_pull(service, source, _request(_tenant("team-b")))
    with pytest.raises(Conflict, match="another socket wait on the pull"):
        await service.cancel_pull(URI, team_a)
    [report] = await service.cancel_pull(URI)  # the node's own socket stops anything
    assert report.cancelled
    for waiter in (mine, theirs):
        with pytest.raises(Cancelled):
            await waiter


async def test_a_tenant_may_not_cancel_what_it_may_not_pull(
    service: AgentService, source: MemorySource, puller: Puller
) -> None:
    """A URI outside the tenant's sources is AccessDenied; by key its pull is not even found
    (another source's pull is not the tenant's to see); the pull goes on."""
    running = await _held_pull(service, source, _request())
    elsewhere = _tenant("team-a", ("s3://other-bucket/*",))
    with pytest.raises(AccessDenied, match="not among the sources"):
        await service.cancel_pull(URI, elsewhere)
    key = puller.flights()[0].key
    with pytest.raises(NotFound, match="nothing to cancel"):
        await service.cancel_pull(key, elsewhere)
    assert len(puller.flights()) == 1
    assert source.gate is not None
    source.gate.set()
    await running


async def test_cancelling_what_nothing_pulls_is_not_found_and_a_bad_ref_is_invalid(
    service: AgentService,
) -> None:
    """No pull of the URI (or key) is NotFound saying where pulls are listed; a ref that is
    neither a URI nor a key is InvalidRequest."""
    with pytest.raises(NotFound, match="`prewarm status` lists the pulls"):
        await service.cancel_pull(URI)
    with pytest.raises(NotFound, match="nothing to cancel"):
        await service.cancel_pull("0123456789abcdef")
    with pytest.raises(InvalidRequest, match="neither an s3:// URI nor a snapshot key"):
        await service.cancel_pull("llama")


async def test_evict_of_a_model_being_pulled_points_at_cancel(
    service: AgentService, source: MemorySource
) -> None:
    """Evicting a snapshot that is being pulled, even with force, is Conflict naming
    `prewarm cancel` as the way to stop the pull."""
    running = await _held_pull(service, source, _request())
    with pytest.raises(Conflict, match=r"even with --force .*`prewarm cancel [0-9a-f]{32}`"):
        await service.evict(URI, force=True)
    assert source.gate is not None
    source.gate.set()
    await running


async def test_a_joiner_answer_says_it_joined_and_waited_only_its_own_time(
    service: AgentService, source: MemorySource
) -> None:
    """The request that started a pull is not marked joined and waited 0 s; one that joined
    it later is marked joined, its wait no longer than its own request, the download the
    pull's."""
    starter = await _held_pull(service, source, _request())
    joiner = await _held_pull(service, source, _request())
    assert source.gate is not None
    source.gate.set()
    started, joined = await starter, await joiner
    assert (started.joined, started.timings.wait) == (False, 0.0)
    assert joined.joined
    assert 0 < joined.timings.wait <= joined.timings.total
    assert joined.timings.download == started.timings.download
