"""EnsureModel end to end: the real agent on a Unix socket, moto's S3 server on loopback."""

from __future__ import annotations

import collections
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from agent_helpers import AgentFactory, cache_entries, object_gets, tree_digest

from agent.client import Client, ModelHandle, Progress
from agent.testing import AgentProcess, S3Server, SampleModel, make_safetensors_model, upload_model


def _model(
    s3: S3Server, bucket: str, tmp_path: Path, *, mib: int, shards: int, prefix: str = "models/m"
) -> SampleModel:
    source = tmp_path / prefix.replace("/", "_")
    tensors = make_safetensors_model(source, total_bytes=mib * 1024**2, shards=shards)
    return upload_model(s3.client(), bucket, prefix, source, tensors=tensors)


def test_pulled_files_equal_the_source(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A cold pull lands in the shm tier byte for byte as uploaded.

    The handle lists every file with its size, progress reaches the last byte,
    and the download time is part of the total.
    """
    model = _model(s3_server, bucket, tmp_path, mib=6, shards=3)
    agent = start_agent()
    events: list[Progress] = []
    with Client(agent.socket_path) as client:
        handle = client.ensure(model.uri, progress=events.append)
    assert not handle.hit
    assert handle.path.parent == agent.shm_root / "snapshots"
    assert tree_digest(handle.path) == tree_digest(model.source_dir)
    assert {f.path: f.size for f in handle.files} == {
        p: (model.source_dir / p).stat().st_size for p in tree_digest(model.source_dir)
    }
    assert handle.total_bytes == model.total_bytes
    assert events[-1].bytes_done == model.total_bytes
    assert handle.timings.download > 0
    assert handle.timings.total >= handle.timings.download


def test_disk_tier_hint_places_the_model_on_disk(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """tier="disk" publishes the snapshot under the disk tier's root."""
    model = _model(s3_server, bucket, tmp_path, mib=1, shards=1)
    agent = start_agent()
    with Client(agent.socket_path) as client:
        handle = client.ensure(model.uri, tier="disk")
    assert handle.tier == "disk"
    assert handle.path.parent == agent.disk_root / "snapshots"


def test_second_ensure_is_a_hit_that_fetches_no_object(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A second ensure of an unchanged model is a hit on the same path and GETs no object."""
    model = _model(s3_server, bucket, tmp_path, mib=2, shards=2)
    agent = start_agent()
    with Client(agent.socket_path) as client:
        cold = client.ensure(model.uri)
        s3_server.clear_requests()
        warm = client.ensure(model.uri)
        info = client.get(warm.key)
    assert warm.hit
    assert (warm.key, warm.path) == (cold.key, cold.path)
    assert object_gets(s3_server.requests(bucket=bucket)) == []
    assert info.hit_count == 1


def test_hit_works_with_the_s3_server_stopped(
    start_agent: AgentFactory, stoppable_s3: S3Server, tmp_path: Path
) -> None:
    """With S3 down, a cached model is served from the cache, marked resolved_offline."""
    stoppable_s3.client().create_bucket(Bucket="offline")
    model = _model(stoppable_s3, "offline", tmp_path, mib=2, shards=2)
    agent = start_agent(s3=stoppable_s3)
    with Client(agent.socket_path) as client:
        cold = client.ensure(model.uri)
        stoppable_s3.stop()
        warm = client.ensure(model.uri)
    assert warm.hit
    assert warm.resolved_offline
    assert warm.path == cold.path
    assert tree_digest(warm.path) == tree_digest(model.source_dir)


def test_uncached_model_with_s3_stopped_is_unavailable(
    start_agent: AgentFactory, stoppable_s3: S3Server
) -> None:
    """With S3 down, a model never pulled is SourceUnavailable and leaves nothing in the cache."""
    agent = start_agent("[s3]\nretries = 2\n", s3=stoppable_s3)
    stoppable_s3.stop()
    from agent import SourceUnavailable

    with Client(agent.socket_path) as client, pytest.raises(SourceUnavailable, match="reach"):
        client.ensure("s3://offline/models/never-pulled/")
    assert cache_entries(agent) == {}


def test_concurrent_ensures_fetch_each_byte_range_once(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Eight clients asking at once share one pull: each byte range is fetched exactly once."""
    model = _model(s3_server, bucket, tmp_path, mib=12, shards=3)
    agent = start_agent('[s3]\nchunk_size = "1MiB"\nconcurrency = 4\n')
    s3_server.clear_requests()
    barrier = threading.Barrier(8)
    handles: list[ModelHandle] = []

    def ask() -> None:
        with Client(agent.socket_path) as client:
            barrier.wait()
            handles.append(client.ensure(model.uri))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(handles) == 8
    assert len({(h.key, h.path) for h in handles}) == 1
    gets = object_gets(s3_server.requests(bucket=bucket))
    per_range = collections.Counter((g.key, g.range) for g in gets)
    assert per_range
    assert max(per_range.values()) == 1, per_range.most_common(3)
    assert sum(g.bytes_sent for g in gets) == model.total_bytes
    assert tree_digest(handles[0].path) == tree_digest(model.source_dir)


def test_changed_object_gives_a_new_snapshot(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """An object changed in S3 gives a new snapshot beside the old one, which keeps its bytes."""
    model = _model(s3_server, bucket, tmp_path, mib=1, shards=1)
    agent = start_agent()
    with Client(agent.socket_path) as client:
        first = client.ensure(model.uri)
        s3_server.client().put_object(
            Bucket=bucket, Key=f"{model.prefix}config.json", Body=b'{"changed": true}'
        )
        second = client.ensure(model.uri)
        listed = client.list_models()
    assert not second.hit
    assert second.key != first.key
    assert (second.path / "config.json").read_bytes() == b'{"changed": true}'
    assert (first.path / "config.json").read_bytes() != b'{"changed": true}'
    assert {m.key for m in listed} == {first.key, second.key}


def test_include_and_exclude_select_files(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """include/exclude globs decide which files the snapshot holds."""
    model = _model(s3_server, bucket, tmp_path, mib=1, shards=2)
    agent = start_agent()
    with Client(agent.socket_path) as client:
        handle = client.ensure(model.uri, include=["*.json"], exclude=["tokenizer*"])
    assert sorted(f.path for f in handle.files) == sorted(
        p for p in tree_digest(model.source_dir) if p.endswith(".json") and "tokenizer" not in p
    )


def test_socket_is_created_with_mode_0660(start_agent: AgentFactory) -> None:
    """The API socket is a socket with mode 0660."""
    agent = start_agent()
    mode = agent.socket_path.stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o660


def test_sigterm_stops_the_agent_cleanly_and_removes_the_socket(
    agent_process: AgentProcess,
) -> None:
    """SIGTERM makes the daemon exit 0 and remove its socket."""
    assert agent_process.stop() == 0
    assert not agent_process.socket_path.exists()


def test_published_models_survive_a_restart(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """After a restart a published model is a hit again; stray staging and unpublished trees go."""
    model = _model(s3_server, bucket, tmp_path, mib=1, shards=1)
    agent = start_agent()
    with Client(agent.socket_path) as client:
        cold = client.ensure(model.uri)
    leftover = agent.shm_root / "staging" / "deadbeef.0000"
    leftover.mkdir()
    (agent.shm_root / "snapshots" / "unpublished").mkdir()
    agent.restart()
    with Client(agent.socket_path) as client:
        warm = client.ensure(model.uri)
    assert warm.hit
    assert warm.path == cold.path
    assert cache_entries(agent) == {
        "shm/snapshots": [cold.path.name],
        "shm/manifests": [f"{cold.key}.json"],
    }


def test_client_killed_mid_pull_does_not_break_the_pull_for_others(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A client killed mid-pull does not cancel the pull another client shares.

    The survivor gets every byte, and no range is fetched twice.
    """
    model = _model(s3_server, bucket, tmp_path, mib=48, shards=4)
    agent = start_agent('[s3]\nchunk_size = "1MiB"\nconcurrency = 2\n')
    script = textwrap.dedent(
        """
        import sys
        from agent.client import Client
        def show(p):
            if p.bytes_done:
                print(p.bytes_done, flush=True)
        Client(sys.argv[1]).ensure(sys.argv[2], progress=show)
        """
    )
    doomed = subprocess.Popen(
        [sys.executable, "-c", script, str(agent.socket_path), model.uri],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert doomed.stdout is not None
    first_progress = doomed.stdout.readline()  # blocks until bytes are moving
    assert int(first_progress) > 0
    survivor: list[ModelHandle] = []
    thread = threading.Thread(
        target=lambda: survivor.append(Client(agent.socket_path).ensure(model.uri))
    )
    thread.start()
    doomed.kill()
    doomed.wait()
    doomed.stdout.close()
    thread.join()

    assert not survivor[0].hit
    assert tree_digest(survivor[0].path) == tree_digest(model.source_dir)
    per_range = collections.Counter(
        (g.key, g.range) for g in object_gets(s3_server.requests(bucket=bucket))
    )
    assert max(per_range.values()) == 1
