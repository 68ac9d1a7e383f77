"""The daemon gives back the memory of many concurrent pulls once they end.

The bytes move in the range workers (their buffers are the bench's concern:
docs/benchmarks.md), but each pull still costs the daemon a flight, a journal,
presigned URLs and progress, and its threads allocate from malloc arenas that
glibc's default dynamic mmap threshold let keep what they took: three rounds of
64 concurrent cold pulls once left the daemon at 340 MB instead of about
110 MB (agent._daemon.return_large_buffers).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import ProcessFactory

from agent.client import Client
from agent.testing import SampleModel, make_safetensors_model, upload_model

MiB = 1024 * 1024
PULLS = 16
# What the pulls may leave behind: caches, a few arenas' bookkeeping (5 MiB measured).
# Without the fix two rounds of these pulls left about 50 MiB.
ALLOWED_GROWTH_MIB = 25


def _rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def _pull_all_at_once(socket: Path, models: list[SampleModel]) -> None:
    barrier = threading.Barrier(len(models))
    failures: list[BaseException] = []

    def pull(model: SampleModel) -> None:
        try:
            with Client(socket) as client:
                barrier.wait()
                client.ensure(model.uri)
        except BaseException as exc:  # reported below, on the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=pull, args=(model,)) for model in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


@pytest.mark.slow
def test_the_memory_of_concurrent_pulls_goes_back_when_they_end(
    start_agent_process: ProcessFactory, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    """16 concurrent cold pulls sharing the node's GETs, twice: the daemon's RSS ends within
    25 MiB of where it started (it grew by about 50 MiB before agent._daemon.return_large_buffers).
    """
    tensors = make_safetensors_model(tmp_path, total_bytes=16 * MiB, shards=2, seed=3)
    models = [
        upload_model(s3_client, bucket, f"m{n}", tmp_path, tensors=tensors) for n in range(PULLS)
    ]
    agent = start_agent_process('[s3]\nchunk_size = "1MiB"\n')
    assert agent.pid is not None
    before = _rss_mib(agent.pid)
    for _ in range(2):
        with Client(agent.socket_path) as client:
            for cached in client.list_models():
                client.evict(cached.key, force=True)
        _pull_all_at_once(agent.socket_path, models)
    after = _rss_mib(agent.pid)
    assert after - before <= ALLOWED_GROWTH_MIB, (before, after)
