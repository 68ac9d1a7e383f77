"""Manifest files over 1 MiB are refused before they are read: memory stays flat, and the
refusal is logged with the file's name while the other manifests are still acted on."""

from __future__ import annotations

import logging
import os
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent._config import ManifestSettings, S3Settings, Settings
from agent.leases.table import LeaseTable
from agent.prefetch.manifests import ManifestWatcher
from agent.prefetch.schema import MAX_MANIFEST_BYTES, ManifestError, read_manifest
from agent.pull.puller import Puller
from agent.service.operations import AgentService
from agent.store.catalog import Store
from agent.testing import MemorySource

MODEL_URI = "s3://models/tiny/"


def _sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that takes no disk space (a hole, read back as zeros)."""
    with path.open("wb") as file:
        file.truncate(size)
    return path


def test_a_file_one_byte_over_the_cap_is_refused_naming_the_limit(tmp_path: Path) -> None:
    """1 MiB + 1 byte is refused with the file, its size and the limit; 1 MiB of TOML is read."""
    exactly = tmp_path / "exactly.toml"
    exactly.write_bytes(f'[[model]]\nuri = "{MODEL_URI}"\n'.encode().ljust(MAX_MANIFEST_BYTES))
    assert [entry.uri for entry in read_manifest(exactly)] == [MODEL_URI]
    over = _sparse(tmp_path / "over.toml", MAX_MANIFEST_BYTES + 1)
    with pytest.raises(ManifestError) as caught:
        read_manifest(over)
    assert caught.value.path == over
    assert f"is {MAX_MANIFEST_BYTES + 1} bytes, over the limit of 1048576 bytes" in str(
        caught.value
    )


def test_a_300_mb_manifest_costs_no_memory(tmp_path: Path) -> None:
    """Refusing a 300 MB manifest allocates well under 1 MiB: the file is never read."""
    huge = _sparse(tmp_path / "huge.toml", 300 * 1024 * 1024)
    tracemalloc.start()
    try:
        with pytest.raises(ManifestError):
            read_manifest(huge)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


def test_a_fifo_in_place_of_a_manifest_is_refused_without_hanging(tmp_path: Path) -> None:
    """A FIFO named like a manifest is refused as not a regular file; opening it never blocks."""
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(ManifestError) as caught:
        read_manifest(fifo)
    assert "not a regular file" in str(caught.value)


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[AgentService]:
    """The agent's operations over an in-memory bucket holding one tiny model."""
    source = MemorySource()
    source.put("models", "tiny/config.json", b"{}")
    settings = Settings.model_validate(
        {
            "default_tier": "disk",
            "socket_path": tmp_path / "agent.sock",
            "tiers": {"shm_root": tmp_path / "shm", "disk_root": tmp_path / "disk"},
        }
    )
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    async with Puller(store, source, S3Settings()) as puller:
        yield AgentService(store, puller, source, LeaseTable(60, 3600), settings=settings)


async def test_the_watcher_logs_the_refusal_with_the_file_name_and_reads_the_rest(
    service: AgentService, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An oversized file in models.d is logged as an error naming it; a good file beside it is
    still read.
    """
    directory = tmp_path / "models.d"
    directory.mkdir()
    huge = _sparse(directory / "huge.toml", 300 * 1024 * 1024)
    (directory / "good.toml").write_text(f'[[model]]\nuri = "{MODEL_URI}"\n')
    settings = ManifestSettings(directory=directory)
    caplog.set_level(logging.INFO, logger="agent")
    async with ManifestWatcher(service, settings, tmp_path / "pins.json") as watcher:
        assert [entry.uri for entry in watcher.entries] == [MODEL_URI]
    [refusal] = [r for r in caplog.records if "over the limit of 1048576 bytes" in r.message]
    assert refusal.levelno == logging.ERROR
    assert str(huge) in refusal.getMessage()
    assert getattr(refusal, "file") == str(huge)  # noqa: B009
