"""Compile caches count in the disk tier's budget and are evicted after every model."""

from __future__ import annotations

import os

from agent_helpers import AgentFactory

from agent.client import Client
from agent.testing import S3Server

MiB = 1024 * 1024
CONFIG = """
default_tier = "disk"
[tiers]
disk_budget = "20MiB"
disk_reserve = "0"
fallback = false
"""


def _blob_model(s3: S3Server, bucket: str, prefix: str, mib: int) -> str:
    s3.client().put_object(Bucket=bucket, Key=f"{prefix}/weights.bin", Body=os.urandom(mib * MiB))
    return f"s3://{bucket}/{prefix}/"


def test_compile_caches_count_in_the_budget_and_go_after_every_model(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str
) -> None:
    """Compile caches count in the disk budget and are evicted only after every evictable model."""
    one = _blob_model(s3_server, bucket, "one", 8)
    two = _blob_model(s3_server, bucket, "two", 8)
    big = _blob_model(s3_server, bucket, "big", 16)
    agent = start_agent(CONFIG)
    with Client(agent.socket_path) as client:
        cache = client.compile_cache(torch_version="2.13.0", model_key="m")
        (cache.path / "inductor" / "kernel.so").write_bytes(os.urandom(6 * MiB))
        assert [c.bytes for c in client.list_compile_caches()] == [6 * MiB]
        status = client.status()
        assert (status.compile_cache_count, status.compile_cache_bytes) == (1, 6 * MiB)

        client.ensure(one)
        client.ensure(two)  # 6 + 8 + 8 MiB > 20 MiB: the older model makes room
        assert {m.uri for m in client.list_models()} == {two}
        assert cache.path.is_dir()

        client.ensure(big)  # 6 + 8 + 16 MiB: the last model frees 8 of 10 MiB
        assert {m.uri for m in client.list_models()} == {big}
        assert not cache.path.exists()
        assert client.list_compile_caches() == []
        assert client.status().compile_cache_count == 0
