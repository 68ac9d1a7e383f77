"""Helpers of the source-level tests: the two object sources behind one fixture body, and
the process environment given back after a test that points clients through it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator

import pytest

from agent._config import S3Settings
from agent.source.interface import ObjectSource
from agent.source.s3 import S3Source
from agent.testing import MemorySource, S3Server

SOURCES = ["memory", "s3"]


async def object_source(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[ObjectSource, str]]:
    """``MemorySource`` with an empty bucket, or ``S3Source`` on the shared moto server.

    Only the S3 one asks for the server fixtures, so the in-memory runs need no server.
    """
    if request.param == "memory":
        memory = MemorySource()
        memory.objects["cache"] = {}
        yield memory, "cache"
        return
    s3_server: S3Server = request.getfixturevalue("s3_server")
    bucket: str = request.getfixturevalue("bucket")
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    settings = S3Settings(endpoint_url=s3_server.endpoint_url, addressing_style="path")
    async with S3Source(settings) as s3:
        yield s3, bucket


@contextlib.contextmanager
def restored_environment() -> Iterator[None]:
    """Give the process environment back as it was, whatever the block set or removed.

    For helpers that point clients (botocore, the range workers) at a server by writing
    ``os.environ`` directly, several variables at a time, outside ``monkeypatch``.
    """
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
