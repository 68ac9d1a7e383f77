"""A listing stops at the first page that passes max_files or max_bytes.

Counting after the whole listing cost a 20,000-object prefix all its listing
requests (and their memory and time) before ``max_files = 10`` refused it. Now
the files and bytes that pass the filters are counted as each page arrives.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import AgentFactory, object_gets

from agent._config import S3Settings, Settings
from agent._exceptions import NoSpace
from agent._uri import parse_uri
from agent.client import Client
from agent.leases.table import LeaseTable
from agent.pull.puller import Puller
from agent.service import access
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest
from agent.service.results import EnsureResult
from agent.store.catalog import Store
from agent.testing import MemorySource, S3Server

PAGE = 1000


Ensure = Callable[..., Awaitable[EnsureResult]]


@asynccontextmanager
async def limited_service(
    tmp_path: Path, source: MemorySource, limits: dict[str, int]
) -> AsyncIterator[Ensure]:
    """Ensure over ``source`` as the node, whose [access.limits] are ``limits``."""
    settings = Settings.model_validate(
        {
            "socket_path": tmp_path / "agent.sock",
            "tiers": {"shm_root": tmp_path / "shm", "disk_root": tmp_path / "disk"},
            "access": {"limits": limits},
        }
    )
    node, _ = access.tenants_from_settings(settings)
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    async with Puller(store, source, S3Settings()) as puller:
        service = AgentService(store, puller, source, LeaseTable(60, 3600), settings=settings)

        async def ensure(uri: str, include: tuple[str, ...] = ()) -> EnsureResult:
            request = EnsureRequest(
                uri=parse_uri(uri), include=include, requester=access.Requester(node)
            )
            results = [event async for event in service.ensure(request)]
            assert isinstance(results[-1], EnsureResult)
            return results[-1]

        yield ensure


def _many_objects(count: int, size: int = 16) -> MemorySource:
    source = MemorySource()
    for number in range(count):
        source.put("models", f"big/shard-{number:05d}.bin", b"x" * size)
    return source


async def test_a_listing_over_max_files_stops_at_the_first_page(tmp_path: Path) -> None:
    """20,000 objects under max_files = 10: one page listed, RESOURCE_EXHAUSTED naming the limit."""
    source = _many_objects(20 * PAGE)
    async with limited_service(tmp_path, source, {"max_files": 10}) as ensure:
        with pytest.raises(NoSpace, match=r"more than 10 files; max_files of \[access.limits\]"):
            await ensure("s3://models/big/")
    assert source.listing_pages == 1
    assert source.reads == []


async def test_a_listing_over_max_bytes_stops_at_the_first_page_that_passes_it(
    tmp_path: Path,
) -> None:
    """3,000 objects of 1 KiB under max_bytes = 100 KiB: one page, refused naming max_bytes."""
    source = _many_objects(3 * PAGE, size=1024)
    async with limited_service(tmp_path, source, {"max_bytes": 100 * 1024}) as ensure:
        with pytest.raises(NoSpace, match="more than 102400 bytes; max_bytes"):
            await ensure("s3://models/big/")
    assert source.listing_pages == 1


async def test_files_the_filters_drop_do_not_count_against_max_files(tmp_path: Path) -> None:
    """Only what passes include/exclude counts: 3,000 objects, 5 included, max_files = 10 serves."""
    source = _many_objects(3 * PAGE)
    async with limited_service(tmp_path, source, {"max_files": 10}) as ensure:
        result = await ensure("s3://models/big/", include=("shard-0000[0-4].bin",))
    assert len(result.model.files) == 5
    assert source.listing_pages == 3


def test_the_daemon_stops_listing_a_prefix_over_max_files_after_one_request(
    start_agent: AgentFactory, s3_server: S3Server, s3_client: Any, bucket: str
) -> None:
    """Against moto: a 1,100-object prefix under max_files = 10 costs one ListObjectsV2, no GET."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda n: s3_client.put_object(Bucket=bucket, Key=f"big/{n:05d}.bin", Body=b"x"),
                range(PAGE + 100),
            )
        )
    agent = start_agent("[access.limits]\nmax_files = 10\n")
    s3_server.clear_requests()
    with Client(agent.socket_path) as client, pytest.raises(NoSpace, match="max_files"):
        client.ensure(f"s3://{bucket}/big/")
    requests = s3_server.requests(bucket=bucket)
    _empty(s3_client, bucket)
    assert [r.method for r in requests if r.key is None] == ["GET"]
    assert object_gets(requests) == []


def _empty(client: Any, bucket: str) -> None:
    """Delete every object (the bucket fixture's version listing stops at 1,000 on moto)."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        doomed = [{"Key": item["Key"]} for item in page.get("Contents", ())]
        if doomed:
            client.delete_objects(Bucket=bucket, Delete={"Objects": doomed, "Quiet": True})
