"""The cache lifecycle through the socket: budgets, eviction, leases, pins, resume, verify.

Logic is pinned in-process in test_store, test_eviction, test_lease_table."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from agent_helpers import AgentFactory, ProcessFactory, cache_entries, object_gets, tree_digest

from agent import Conflict, IntegrityError, NoSpace
from agent.client import Client, Progress
from agent.testing import AgentProcess, S3Server, make_safetensors_model, upload_model

MiB = 1024 * 1024


def _blob_model(s3: S3Server, bucket: str, prefix: str, mib: int) -> str:
    """A model of exactly ``mib`` MiB (one file), so budget arithmetic is exact."""
    s3.client().put_object(Bucket=bucket, Key=f"{prefix}/weights.bin", Body=os.urandom(mib * MiB))
    return f"s3://{bucket}/{prefix}/"


def _cached_uris(client: Client) -> set[str]:
    return {m.uri for m in client.list_models()}


BUDGET_10_MIB = """
[tiers]
shm_budget = "10MiB"
shm_reserve = "0"
high_watermark = 0.85
low_watermark = 0.6
fallback = false
"""


def test_pressure_evicts_the_least_recently_used_snapshot(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str
) -> None:
    """Above the high watermark the least recently used snapshot goes, down to the low one."""
    a, b, c, d = (_blob_model(s3_server, bucket, name, 3) for name in "abcd")
    agent = start_agent(BUDGET_10_MIB)
    with Client(agent.socket_path) as client:
        client.ensure(a)
        client.ensure(b)
        client.ensure(c)  # 9 MiB > 8.5 (high): evict down to 6 (low): a goes (LRU)
        assert _cached_uris(client) == {b, c}
        client.ensure(b)  # b is now the most recently used
        client.ensure(d)  # 9 MiB again: c is the least recently used
        assert _cached_uris(client) == {b, d}
        assert client.status().tiers[0].used_bytes == 6 * MiB


def test_a_pull_makes_room_by_evicting_before_it_starts(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str
) -> None:
    """A pull that would exceed the budget evicts the LRU snapshot before it starts."""
    a, b, c = (_blob_model(s3_server, bucket, name, 4) for name in "abc")
    config = BUDGET_10_MIB.replace("0.85", "1.0").replace("0.6", "1.0")
    agent = start_agent(config)
    with Client(agent.socket_path) as client:
        client.ensure(a)
        client.ensure(b)
        client.ensure(c)  # 12 MiB would exceed 10: a (LRU) is evicted first
        assert _cached_uris(client) == {b, c}


def test_a_leased_snapshot_survives_pressure_and_an_unleased_one_goes(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str
) -> None:
    """A leased snapshot survives pressure and refuses evict until its lease is released."""
    a, b, c = (_blob_model(s3_server, bucket, name, 3) for name in "abc")
    agent = start_agent(BUDGET_10_MIB)
    with Client(agent.socket_path) as client:
        leased = client.ensure(a, lease=True, lease_ttl=600, client_name="ns/pod-a")
        client.ensure(b)
        client.ensure(c)  # a is the LRU but leased: b goes instead
        assert _cached_uris(client) == {a, c}
        info = client.get(a)
        assert [lease.client_name for lease in info.leases] == ["ns/pod-a"]
        with pytest.raises(Conflict, match="leased by 1 client"):
            client.evict(a)
        assert leased.lease is not None
        client.release_lease(leased.lease.id)
        assert client.evict(a).bytes_freed == 3 * MiB


def test_a_pinned_snapshot_is_never_evicted_by_pressure(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str
) -> None:
    """A pinned snapshot survives pressure; evict refuses it unless forced."""
    a, b, c = (_blob_model(s3_server, bucket, name, 3) for name in "abc")
    agent = start_agent(BUDGET_10_MIB)
    with Client(agent.socket_path) as client:
        client.ensure(a, pin=True)
        client.ensure(b)
        client.ensure(c)
        assert _cached_uris(client) == {a, c}
        assert client.get(a).pinned
        with pytest.raises(Conflict, match="pinned"):
            client.evict(a)
        assert client.evict(a, force=True).bytes_freed == 3 * MiB


def test_a_held_lease_names_its_holder_process(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str
) -> None:
    """A lease held on the agent's lease socket reports the holder's pid and uid over the API.

    The agent holds it before answering the hello, so nothing is waited for; that it
    ends when the holder is killed is pinned in test_leases.py (the table is awaited).
    """
    uri = _blob_model(s3_server, bucket, "m", 1)
    agent = start_agent()
    script = textwrap.dedent(
        """
        import sys
        from agent.client import Client
        with Client(sys.argv[1]).leased(sys.argv[2], client_name="ns/holder") as handle:
            print(handle.key, flush=True)
            sys.stdin.read()  # hold until stdin closes
        """
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(agent.socket_path), uri],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert holder.stdin is not None
    assert holder.stdout is not None
    try:
        key = holder.stdout.readline().strip()
        with Client(agent.socket_path) as client:
            (lease,) = client.get(key).leases
            assert lease.held
            assert (lease.client_name, lease.pid, lease.uid) == (
                "ns/holder",
                holder.pid,
                os.getuid(),
            )
            with pytest.raises(Conflict, match=r"ns/holder \(pid"):
                client.evict(key)
    finally:
        holder.stdin.close()
        holder.stdout.close()
        assert holder.wait(timeout=30) == 0


@pytest.mark.slow
def test_sigkill_mid_pull_resumes_and_fetches_only_what_was_missing(
    start_agent_process: ProcessFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """After SIGKILL mid-pull, the next pull resumes from the journal and GETs only the rest."""
    source = tmp_path / "model"
    tensors = make_safetensors_model(source, total_bytes=48 * MiB, shards=4)
    model = upload_model(s3_server.client(), bucket, "m", source, tensors=tensors)
    agent = start_agent_process('[s3]\nchunk_size = "1MiB"\nconcurrency = 2\n')
    s3_server.clear_requests()
    halfway = threading.Event()

    def on_progress(progress: Progress) -> None:
        if progress.bytes_done > model.total_bytes // 2:
            halfway.set()

    def doomed_pull() -> None:
        try:
            Client(agent.socket_path).ensure(model.uri, progress=on_progress)
        except Exception:
            halfway.set()

    puller = threading.Thread(target=doomed_pull)
    puller.start()
    assert halfway.wait(timeout=120)
    agent.kill()
    puller.join()
    fetched_before = sum(g.bytes_sent for g in object_gets(s3_server.requests(bucket=bucket)))
    journaled = _journaled_bytes(agent)
    assert 0 < journaled < model.total_bytes

    s3_server.clear_requests()
    agent.start()
    with Client(agent.socket_path) as client:
        handle = client.ensure(model.uri)
    gets = object_gets(s3_server.requests(bucket=bucket))
    fetched_after = sum(g.bytes_sent for g in gets)
    print(f"\nresume: model {model.total_bytes} B, before kill {fetched_before} B, ", end="")
    print(f"journaled {journaled}, resumed {handle.resumed_bytes}, after restart {fetched_after}")
    assert handle.resumed_bytes == journaled
    assert fetched_after == model.total_bytes - handle.resumed_bytes
    assert fetched_after < model.total_bytes
    assert max(collections.Counter((g.key, g.range) for g in gets).values()) == 1
    assert tree_digest(handle.path) == tree_digest(model.source_dir)
    assert cache_entries(agent).get("shm/staging") is None


def _journaled_bytes(agent: AgentProcess) -> int:
    (staging,) = (agent.shm_root / "staging").iterdir()
    lines = (staging / "journal").read_bytes().splitlines()[1:]  # each: JSON, space, its MAC
    return sum(json.loads(line.rpartition(b" ")[0])["n"] for line in lines)


@pytest.mark.slow
def test_a_changed_object_after_a_crash_starts_clean(
    start_agent_process: ProcessFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """An object changed in S3 after a crash makes the next pull start clean, not resume."""
    source = tmp_path / "model"
    tensors = make_safetensors_model(source, total_bytes=24 * MiB, shards=3)
    model = upload_model(s3_server.client(), bucket, "m", source, tensors=tensors)
    agent = start_agent_process('[s3]\nchunk_size = "1MiB"\nconcurrency = 1\n')
    moving = threading.Event()

    def doomed_pull() -> None:
        try:
            Client(agent.socket_path).ensure(
                model.uri, progress=lambda p: moving.set() if p.bytes_done else None
            )
        except Exception:
            moving.set()

    puller = threading.Thread(target=doomed_pull)
    puller.start()
    assert moving.wait(timeout=60)
    agent.kill()
    puller.join()
    s3_server.client().put_object(Bucket=bucket, Key="m/config.json", Body=b'{"v": 2}')
    agent.start()
    with Client(agent.socket_path) as client:
        handle = client.ensure(model.uri)
    assert handle.resumed_bytes == 0
    assert (handle.path / "config.json").read_bytes() == b'{"v": 2}'
    assert [p.name for p in (agent.shm_root / "staging").iterdir()] == []


def test_a_corrupt_safetensors_header_is_refused_and_nothing_is_published(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A safetensors file whose header is not a JSON object is refused; nothing is published."""
    source = tmp_path / "model"
    make_safetensors_model(source, total_bytes=2 * MiB, shards=1)
    shard = next(source.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[8:9] = b"["  # the header's JSON object now opens as a list
    shard.write_bytes(bytes(data))
    model = upload_model(s3_server.client(), bucket, "m", source, tensors={})
    agent = start_agent()
    with Client(agent.socket_path) as client, pytest.raises(IntegrityError) as info:
        client.ensure(model.uri)
    assert shard.name in str(info.value)
    assert "JSON" in str(info.value)
    assert cache_entries(agent) == {}


def test_a_truncated_safetensors_object_is_refused(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A safetensors object shorter than its header says is refused as an IntegrityError."""
    source = tmp_path / "model"
    make_safetensors_model(source, total_bytes=2 * MiB, shards=1)
    shard = next(source.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-4096])  # the upload was cut short
    model = upload_model(s3_server.client(), bucket, "m", source, tensors={})
    agent = start_agent()
    with Client(agent.socket_path) as client, pytest.raises(IntegrityError) as info:
        client.ensure(model.uri)
    assert shard.name in str(info.value)
    assert "data section" in str(info.value) or "past the end" in str(info.value)
    assert cache_entries(agent) == {}


def test_verify_catches_a_flipped_byte_and_evicts_the_snapshot(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str
) -> None:
    """Verify reports a flipped byte as a hash problem and, unless report-only, evicts it."""
    uri = _blob_model(s3_server, bucket, "m", 2)
    agent = start_agent()
    with Client(agent.socket_path) as client:
        handle = client.ensure(uri)
        (clean,) = client.verify(handle.key)
        assert clean.ok
        weights = handle.path / "weights.bin"
        with weights.open("r+b") as fh:
            fh.seek(MiB + 7)
            byte = fh.read(1)
            fh.seek(MiB + 7)
            fh.write(bytes([byte[0] ^ 0x01]))
        (report,) = client.verify(handle.key, report_only=True)
        assert not report.ok
        assert [(p.path, p.check) for p in report.problems] == [("weights.bin", "hash")]
        assert not report.evicted
        (result,) = client.verify(all=True)
        assert result.evicted
        assert client.list_models() == []
        again = client.ensure(uri)  # pulled afresh
    assert not again.hit


def test_a_budget_smaller_than_the_model_is_resource_exhausted(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str
) -> None:
    """A model over a strict tier's budget is NoSpace counting what is pinned (the log names
    it, the refusal does not); nothing changes."""
    small = _blob_model(s3_server, bucket, "small", 1)
    big = _blob_model(s3_server, bucket, "big", 3)
    agent = start_agent('[tiers]\nshm_budget = "2MiB"\nshm_reserve = "0"\n')
    with Client(agent.socket_path) as client:
        kept = client.ensure(small, pin=True)
        before = cache_entries(agent)
        with pytest.raises(NoSpace) as info:
            client.ensure(big, tier="shm", strict_tier=True)
        assert "Tier shm: budget 0.00 GiB" in str(info.value)
        assert "leased or pinned (1 snapshots)" in str(info.value)
        assert kept.key[:12] not in str(info.value)
        assert cache_entries(agent) == before
        assert _cached_uris(client) == {small}


@pytest.mark.slow
def test_sigterm_mid_pull_keeps_the_pull_resumable(
    start_agent_process: ProcessFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A graceful stop with no grace period cancels a pull but keeps it resumable."""
    source = tmp_path / "model"
    tensors = make_safetensors_model(source, total_bytes=32 * MiB, shards=2)
    model = upload_model(s3_server.client(), bucket, "m", source, tensors=tensors)
    # No grace period: the stop cancels the pull instead of letting it finish.
    agent = start_agent_process(
        'shutdown_grace_seconds = 0\n[s3]\nchunk_size = "1MiB"\nconcurrency = 1\n'
    )
    moving = threading.Event()

    def interrupted_pull() -> None:
        try:
            Client(agent.socket_path).ensure(
                model.uri, progress=lambda p: moving.set() if p.bytes_done > 4 * MiB else None
            )
        except Exception:
            moving.set()

    puller = threading.Thread(target=interrupted_pull)
    puller.start()
    assert moving.wait(timeout=60)
    assert agent.stop() == 0  # graceful: the pull is cancelled, its journal kept
    puller.join()
    agent.start()
    with Client(agent.socket_path) as client:
        handle = client.ensure(model.uri)
    assert handle.resumed_bytes >= 4 * MiB
    assert tree_digest(handle.path) == tree_digest(model.source_dir)


def test_a_lease_that_is_not_renewed_expires(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str
) -> None:
    """A timed lease ends at the expiry the agent reported; a renewed one lives on."""
    uri = _blob_model(s3_server, bucket, "m", 1)
    agent = start_agent()
    with Client(agent.socket_path) as client:
        renewed = client.ensure(uri, lease=True, lease_ttl=0.5)
        short = client.ensure(uri, lease=True, lease_ttl=0.5)
        assert renewed.lease is not None
        assert short.lease is not None
        client.renew_lease(renewed.lease.id, ttl=600)
        assert short.lease.expires is not None
        # Only the clock ends a timed lease, so wait (once) until the instant the
        # agent said it would, plus a margin for the timestamp's rounding.
        time.sleep(max(0.0, short.lease.expires.timestamp() - time.time()) + 0.05)
        # Ids are never listed (capabilities): the renewed lease is known by its expiry.
        (left,) = client.get(uri).leases
        assert left.expires is not None
        assert left.expires.timestamp() > time.time() + 500


def test_reconcile_drops_manifests_whose_files_are_gone(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str
) -> None:
    """At start-up a snapshot whose files were deleted by hand is dropped, others kept."""
    kept, broken = (_blob_model(s3_server, bucket, name, 1) for name in ("kept", "broken"))
    agent = start_agent()
    with Client(agent.socket_path) as client:
        keep = client.ensure(kept)
        lose = client.ensure(broken)
    agent.stop()
    (lose.path / "weights.bin").unlink()  # e.g. someone cleaned the directory by hand
    agent.start()
    with Client(agent.socket_path) as client:
        assert [m.key for m in client.list_models()] == [keep.key]
    assert lose.path.name not in cache_entries(agent)["shm/snapshots"]
