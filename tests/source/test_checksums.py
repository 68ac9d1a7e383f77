"""S3 full-object checksums are compared before a snapshot is published."""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import pytest
from agent_helpers import AgentFactory, tree_digest

from agent import IntegrityError
from agent._config import S3Settings, Settings
from agent._uri import parse_uri
from agent.client import Client
from agent.leases.table import LeaseTable
from agent.pull.puller import Puller
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest
from agent.service.results import EnsureResult
from agent.source.checksums import S3Checksum
from agent.store.catalog import Store
from agent.testing import MemorySource, S3Server


def test_objects_with_s3_checksums_are_checked_and_published(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Objects with an S3 checksum are HEADed and checked before publish; others are not HEADed."""
    # Only when asked: botocore otherwise adds a CRC32 to every upload by default.
    client = s3_server.client(request_checksum_calculation="when_required")
    source = tmp_path / "src"
    source.mkdir()
    for name, algorithm in (("a.bin", "SHA256"), ("b.bin", "CRC32"), ("c.bin", "")):
        data = os.urandom(300_000)
        (source / name).write_bytes(data)
        extra = {"ChecksumAlgorithm": algorithm} if algorithm else {}
        client.put_object(Bucket=bucket, Key=f"m/{name}", Body=data, **extra)
    agent = start_agent()
    s3_server.clear_requests()
    with Client(agent.socket_path) as prewarm:
        handle = prewarm.ensure(f"s3://{bucket}/m/")
    heads = sorted(r.key or "" for r in s3_server.requests(bucket=bucket) if r.method == "HEAD")
    assert heads == ["m/a.bin", "m/b.bin"]  # only objects that have a checksum
    assert tree_digest(handle.path) == tree_digest(source)


async def _drain(service: AgentService) -> None:
    async for event in service.ensure(EnsureRequest(uri=parse_uri("s3://models/m"))):
        assert not isinstance(event, EnsureResult)


async def test_a_checksum_mismatch_is_refused_and_nothing_is_published(tmp_path: Path) -> None:
    """A file that differs from S3's checksum fails as IntegrityError and publishes nothing."""
    memory = MemorySource()
    memory.put("models", "m/a.bin", b"what landed on disk")
    wrong = base64.b64encode(hashlib.sha256(b"what S3 holds").digest()).decode()
    memory.checksums["m/a.bin"] = S3Checksum("SHA256", wrong, composite=False)
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    settings = Settings.model_validate(
        {
            "socket_path": tmp_path / "agent.sock",
            "tiers": {"shm_root": tmp_path / "shm", "disk_root": tmp_path / "disk"},
        }
    )
    async with Puller(store, memory, S3Settings()) as puller:
        service = AgentService(store, puller, memory, LeaseTable(60, 3600), settings=settings)
        with pytest.raises(IntegrityError) as info:
            await _drain(service)
    assert info.value.check == "s3-sha256"
    assert "a.bin" in str(info.value)
    assert store.models() == []
    assert list((tmp_path / "shm" / "staging").iterdir()) == []
