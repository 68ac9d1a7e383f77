"""The puller against an in-memory source: retries resume, failures leave nothing behind."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agent import NoSpace, SourceChanged, SourceUnavailable
from agent._config import S3Settings, Settings
from agent._uri import parse_uri
from agent.leases.table import LeaseTable
from agent.pull.flight import PullProgress
from agent.pull.puller import Puller
from agent.pull.resolver import resolve
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest
from agent.service.results import EnsureResult
from agent.store.catalog import Store
from agent.testing import MemorySource

MiB = 1024 * 1024


def _settings(**overrides: object) -> S3Settings:
    base: dict[str, object] = {"chunk_size": MiB, "concurrency": 3}
    base.update(overrides)
    return S3Settings.model_validate(base)


async def _ensure(service: AgentService, uri: str) -> EnsureResult:
    result = None
    async for event in service.ensure(EnsureRequest(uri=parse_uri(uri))):
        if isinstance(event, EnsureResult):
            result = event
    assert result is not None
    return result


def _service(tmp_path: Path, source: MemorySource, puller: Puller, store: Store) -> AgentService:
    settings = Settings.model_validate(
        {
            "default_tier": "disk",
            "socket_path": tmp_path / "agent.sock",
            "tiers": {"shm_root": tmp_path / "shm", "disk_root": tmp_path / "disk"},
        }
    )
    return AgentService(store, puller, source, LeaseTable(60, 3600), settings=settings)


@pytest.fixture
def source() -> MemorySource:
    memory = MemorySource()
    memory.put("models", "m/a.bin", os.urandom(3 * MiB + 17))
    memory.put("models", "m/sub/b.bin", os.urandom(MiB // 2))
    memory.put("models", "m/empty", b"")
    return memory


async def test_broken_transfers_resume_where_they_stopped(
    tmp_path: Path, source: MemorySource
) -> None:
    """A range broken mid-body is retried from its last good byte: no byte is fetched twice."""
    # Two failures on a.bin: after 100 KiB of one range and after 700 KiB of another.
    source.break_after["m/a.bin"] = [100 * 1024, 700 * 1024]
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    async with Puller(store, source, _settings()) as puller:
        result = await _ensure(_service(tmp_path, source, puller, store), "s3://models/m")
    path = result.model.path
    assert (path / "a.bin").read_bytes() == source.objects["models"]["m/a.bin"]
    assert (path / "sub" / "b.bin").read_bytes() == source.objects["models"]["m/sub/b.bin"]
    assert (path / "empty").read_bytes() == b""
    # Each retry asked only for what was missing: no byte was delivered twice...
    assert sum(read.delivered for read in source.reads) == 3 * MiB + 17 + MiB // 2
    # ...and the two failures cost exactly two extra requests (4 ranges of a.bin + 2).
    assert len([read for read in source.reads if read.key == "m/a.bin"]) == 6


async def test_persistent_failure_names_the_object_and_keeps_the_pull_resumable(
    tmp_path: Path, source: MemorySource
) -> None:
    """A range that keeps failing names the object; its staging stays and the next pull resumes."""
    # One worker, files in path order: a.bin completes, then sub/b.bin keeps breaking.
    source.break_after["m/sub/b.bin"] = [10] * 50
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    async with Puller(store, source, _settings(retries=2, concurrency=1)) as puller:
        service = _service(tmp_path, source, puller, store)
        with pytest.raises(SourceUnavailable, match=r"m/sub/b\.bin after 3 attempts"):
            await _ensure(service, "s3://models/m")
        assert store.models() == []
        assert [p.name for p in (tmp_path / "disk" / "staging").iterdir()] != []
        # S3 recovers: the next request resumes and fetches only what is missing.
        source.break_after.clear()
        before = sum(read.delivered for read in source.reads)
        result = await _ensure(service, "s3://models/m")
    after = sum(read.delivered for read in source.reads) - before
    total = 3 * MiB + 17 + MiB // 2
    assert result.resumed_bytes == 3 * MiB + 17
    assert after == total - result.resumed_bytes
    assert (result.model.path / "a.bin").read_bytes() == source.objects["models"]["m/a.bin"]
    assert list((tmp_path / "disk" / "staging").iterdir()) == []


async def test_object_replaced_mid_pull_aborts_without_publishing(
    tmp_path: Path, source: MemorySource
) -> None:
    """An object replaced during the pull (new ETag) is SourceChanged; nothing is published."""
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    source.replace_on_read["m/sub/b.bin"] = b"new content"
    async with Puller(store, source, _settings()) as puller:
        with pytest.raises(SourceChanged):
            await _ensure(_service(tmp_path, source, puller, store), "s3://models/m")
    assert store.models() == []
    assert list((tmp_path / "disk" / "snapshots").iterdir()) == []


async def test_a_watcher_leaving_does_not_cancel_the_pull(
    tmp_path: Path, source: MemorySource
) -> None:
    """A request that stops watching leaves the pull running; a later request joins it."""
    source.gate = asyncio.Event()  # hold the pull after its first piece
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    async with Puller(store, source, _settings(concurrency=1)) as puller:
        service = _service(tmp_path, source, puller, store)
        moving = asyncio.Event()

        async def leave_after_first_bytes() -> None:
            async for event in service.ensure(EnsureRequest(uri=parse_uri("s3://models/m"))):
                if isinstance(event, PullProgress) and event.bytes_done:
                    moving.set()

        first = asyncio.create_task(leave_after_first_bytes())
        await moving.wait()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert len(puller.flights()) == 1  # still pulling for nobody
        source.gate.set()
        second = await _ensure(service, "s3://models/m")
    assert (second.model.path / "a.bin").read_bytes() == source.objects["models"]["m/a.bin"]
    # One pull: a.bin was read once, in ranges, however the two requests overlapped.
    assert sum(r.delivered for r in source.reads if r.key == "m/a.bin") == 3 * MiB + 17


async def test_disk_full_mid_pull_is_no_space_and_leaves_other_models_intact(
    tiny_tmpfs: Path, tmp_path: Path
) -> None:
    """ENOSPC while writing is NoSpace, cleans its staging and leaves published models intact."""
    source = MemorySource()
    source.put("models", "small/a.bin", os.urandom(MiB // 2))
    source.put("models", "big/a.bin", os.urandom(3 * MiB))
    store = Store({"shm": tiny_tmpfs, "disk": tmp_path / "disk"})
    await store.open()
    async with Puller(store, source, _settings()) as puller:
        service = _service(tmp_path, source, puller, store)
        small = await _ensure(service, "s3://models/small")
        before = sorted(p.name for p in (tiny_tmpfs / "snapshots").iterdir())
        # Straight to the puller, past the budget check: the filesystem itself says no.
        snapshot = await resolve(source, parse_uri("s3://models/big"), (), ())
        flight, _ = puller.join(snapshot, "shm")
        with pytest.raises(NoSpace, match="ran out of space"):
            await flight.result()
    assert sorted(p.name for p in (tiny_tmpfs / "snapshots").iterdir()) == before
    assert list((tiny_tmpfs / "staging").iterdir()) == []
    assert (small.model.path / "a.bin").read_bytes() == source.objects["models"]["small/a.bin"]
