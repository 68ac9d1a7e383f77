"""A connection S3 resets is a failing answer, retried; only a connection never made is not.

The docs (operations.md, "When S3 is down or slow") promise that a reset is
retried with botocore's schedule, while a refused connection is reported at once.
aiohttp reports both as a ``ClientOSError`` that aiobotocore wraps in botocore's
``EndpointConnectionError``, so telling them apart needs the cause inside.
"""

from __future__ import annotations

import pytest

from agent._config import S3Settings
from agent._uri import parse_uri
from agent.source.s3 import S3Source
from agent.testing import Fault, FaultProxy, S3Server, SampleModel


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The shared server's credentials in this process's environment, for an S3Source here."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


def _settings(endpoint_url: str) -> S3Settings:
    return S3Settings(endpoint_url=endpoint_url, addressing_style="path", retries=5)


async def test_a_listing_whose_connection_is_reset_is_retried(
    s3_env: S3Server, small_model: SampleModel
) -> None:
    """Two resets of the listing, then an answer: the listing succeeds, it does not fail at once."""
    with FaultProxy(s3_env.endpoint_url) as proxy:
        proxy.add(Fault.reset(key=f"/{small_model.bucket}", times=2))
        async with S3Source(_settings(proxy.endpoint_url)) as source:
            listed = await source.list_objects(parse_uri(small_model.uri))
        assert proxy.injected("reset") == 2
    assert {o.key for o in listed} == set(small_model.keys)


async def test_a_head_whose_connection_is_reset_is_retried(
    s3_env: S3Server, small_model: SampleModel
) -> None:
    """A HEAD reset twice is retried by botocore and answers the object's size and ETag."""
    key = small_model.keys[0]
    with FaultProxy(s3_env.endpoint_url) as proxy:
        proxy.add(Fault.reset(key=key, method="HEAD", times=2))
        async with S3Source(_settings(proxy.endpoint_url)) as source:
            head = await source.head_object(small_model.bucket, key)
        assert proxy.injected("reset") == 2
    assert head is not None
    assert head.size == (small_model.source_dir / key[len(small_model.prefix) :]).stat().st_size
