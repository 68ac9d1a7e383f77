"""A pull through a source of its own (the requester's credentials), in-process.

The flight reads every byte through the source it was started with, opens it when the pull
starts and closes it when the pull ends (done or failed), so no client outlives its pull.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent import InvalidRequest, PrewarmError
from agent._config import S3Settings
from agent._uri import parse_uri
from agent._vocabulary import PullOptions
from agent.pull.puller import Puller
from agent.pull.resolver import resolve
from agent.source.interface import ObjectSource
from agent.store.catalog import Store
from agent.testing import MemorySource

MiB = 1024 * 1024


@dataclass
class _Opened:
    """A source handed to the puller unopened; records when it was opened and closed."""

    source: MemorySource
    events: list[str] = field(default_factory=list)

    @contextlib.asynccontextmanager
    async def scoped(self) -> AsyncIterator[ObjectSource]:
        self.events.append("open")
        try:
            yield self.source
        finally:
            self.events.append("close")


def _memory(data: bytes) -> MemorySource:
    memory = MemorySource()
    memory.put("models", "m/a.bin", data)
    return memory


async def _store(tmp_path: Path) -> Store:
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    return store


async def test_a_flight_reads_through_its_own_source_and_closes_it(tmp_path: Path) -> None:
    """Every range comes from the flight's source, none from the agent's; the source is
    opened once and closed once the pull has published."""
    data = os.urandom(3 * MiB)
    node, requester = _memory(data), _Opened(_memory(data))
    settings = S3Settings(chunk_size=MiB, concurrency=2)
    async with Puller(await _store(tmp_path), node, settings) as puller:
        snapshot = await resolve(node, parse_uri("s3://models/m/"), (), ())
        flight, started = puller.join(snapshot, "disk", source=requester.scoped())
        model = await flight.result()
    assert started
    assert (model.path / "a.bin").read_bytes() == data
    assert node.reads == []
    assert sum(read.delivered for read in requester.source.reads) == len(data)
    assert requester.events == ["open", "close"]


async def test_a_failed_flight_closes_its_source_too(tmp_path: Path) -> None:
    """A pull that fails (the object is gone from the requester's view) still closes the
    source it opened, and reports the source's error."""
    node, requester = _memory(os.urandom(MiB)), _Opened(MemorySource())
    async with Puller(await _store(tmp_path), node, S3Settings(chunk_size=MiB)) as puller:
        snapshot = await resolve(node, parse_uri("s3://models/m/"), (), ())
        flight, _ = puller.join(snapshot, "disk", source=requester.scoped())
        with pytest.raises(PrewarmError):
            await flight.result()
    assert requester.events == ["open", "close"]


async def test_a_source_that_cannot_presign_has_no_processes_plane(tmp_path: Path) -> None:
    """Asking for the processes plane on a source that cannot presign (the in-memory one) is
    InvalidRequest naming the source and what to ask for; auto and aiobotocore are accepted."""
    node = _memory(b"x")
    async with Puller(await _store(tmp_path), node, S3Settings()) as puller:
        with pytest.raises(InvalidRequest, match=r"cannot presign.*auto or the aiobotocore"):
            puller.check(PullOptions(data_plane="processes"))
        puller.check(PullOptions(data_plane="auto"))
        puller.check(PullOptions(data_plane="aiobotocore"))
