"""Every bad input gets its status code and a message that says what to do,
and leaves nothing behind in the cache."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from agent_helpers import AgentFactory, RunningAgent, cache_entries, small_tmpfs

from agent._config import ConfigError
from agent._exceptions import Conflict, PrewarmError, error_type_for_status
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc
from agent.client import Client, Progress
from agent.client._exceptions import error_for_code
from agent.edge.server import ApiServer, ServerLimits, TenantSocket
from agent.edge.status import status_code_for
from agent.testing import AgentProcess, S3Server, make_safetensors_model, upload_model


@dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    details: str


def _refusal(error: grpc.RpcError) -> Refusal:
    assert isinstance(error, grpc.Call)
    return Refusal(error.code(), error.details() or "")


def _ensure_status(agent: RunningAgent, uri: str, **fields: Any) -> Refusal:
    with grpc.insecure_channel(agent.target) as channel:
        stub = pb_grpc.PrewarmStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            for _ in stub.EnsureModel(pb.EnsureModelRequest(uri=uri, **fields), timeout=60):
                pass
    return _refusal(info.value)


@pytest.mark.parametrize(
    ("uri", "fragment"),
    [
        ("https://example.com/model", "not an S3 URI"),
        ("s3://Upper_Case/model", "not a valid S3 bucket name"),
        ("s3://bucket/a/../b", "'..'"),
        ("", "empty"),
    ],
)
def test_bad_uri_is_invalid_argument(start_agent: AgentFactory, uri: str, fragment: str) -> None:
    """A malformed URI is INVALID_ARGUMENT naming the problem and the expected form; nothing is
    cached.
    """
    agent = start_agent()
    error = _ensure_status(agent, uri)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in error.details
    assert "s3://bucket/prefix" in error.details
    assert cache_entries(agent) == {}


def test_empty_include_glob_is_invalid_argument(start_agent: AgentFactory, bucket: str) -> None:
    """An empty include glob is INVALID_ARGUMENT that mentions the glob."""
    agent = start_agent()
    error = _ensure_status(agent, f"s3://{bucket}/m/", include=[""])
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "glob" in error.details


def test_missing_bucket_is_not_found(start_agent: AgentFactory) -> None:
    """A bucket that does not exist is NOT_FOUND naming the bucket; nothing is cached."""
    agent = start_agent()
    error = _ensure_status(agent, "s3://no-such-bucket-here/model/")
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert "'no-such-bucket-here' does not exist" in error.details
    assert cache_entries(agent) == {}


def test_empty_prefix_is_not_found(start_agent: AgentFactory, bucket: str) -> None:
    """A prefix with no objects under it is NOT_FOUND; nothing is cached."""
    agent = start_agent()
    error = _ensure_status(agent, f"s3://{bucket}/nothing-here/")
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert "No objects under" in error.details
    assert cache_entries(agent) == {}


def test_filters_that_match_nothing_are_not_found(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str
) -> None:
    """Filters that leave no object are NOT_FOUND with a hint to loosen them."""
    s3_server.client().put_object(Bucket=bucket, Key="m/config.json", Body=b"{}")
    agent = start_agent()
    error = _ensure_status(agent, f"s3://{bucket}/m/", include=["*.safetensors"])
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert "Loosen the filters" in error.details


@pytest.mark.parametrize("bad_key", ["m/../evil.bin", "m//etc/passwd", "m/./x"])
def test_object_key_that_escapes_the_model_dir_is_refused(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, bad_key: str
) -> None:
    """An object key with '..', '//' or '.' is INVALID_ARGUMENT and writes nothing outside the
    cache.
    """
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="m/good.bin", Body=b"fine")
    client.put_object(Bucket=bucket, Key=bad_key, Body=b"evil")
    agent = start_agent()
    error = _ensure_status(agent, f"s3://{bucket}/m/")
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert repr(bad_key) in error.details
    assert cache_entries(agent) == {}
    assert not (agent.root / "evil.bin").exists()


def test_file_and_directory_with_the_same_name_is_refused(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str
) -> None:
    """Keys making one path both a file and a directory: INVALID_ARGUMENT, nothing cached."""
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="m/a", Body=b"file")
    client.put_object(Bucket=bucket, Key="m/a/b", Body=b"nested")
    agent = start_agent()
    error = _ensure_status(agent, f"s3://{bucket}/m/")
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "both a file and the directory" in error.details
    assert cache_entries(agent) == {}


def test_denied_credentials_are_permission_denied(start_agent: AgentFactory) -> None:
    # moto checks credentials after its first N unauthenticated actions; ours are unknown to it.
    """Credentials S3 refuses are PERMISSION_DENIED naming the missing permission; nothing is
    cached.
    """
    with S3Server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "2"}) as strict:
        strict.client().create_bucket(Bucket="locked")
        strict.client().put_object(Bucket="locked", Key="m/a.bin", Body=b"secret")
        agent = start_agent(s3=strict)
        error = _ensure_status(agent, "s3://locked/m/")
    assert error.code == grpc.StatusCode.PERMISSION_DENIED
    assert "s3:GetObject" in error.details
    assert cache_entries(agent) == {}


@pytest.fixture
def tiny_shm_agent(s3_server: S3Server) -> Iterator[AgentProcess]:
    """An agent whose shm tier is a 1 MiB tmpfs (needs root to mount)."""
    agent = AgentProcess(env=s3_server.env())
    try:
        with small_tmpfs(agent.shm_root, "1m", mode="0700"):
            try:
                yield agent.start()
            finally:
                with contextlib.suppress(Exception):
                    agent.stop()
    finally:
        agent.close()


def test_model_larger_than_a_strict_tier_is_resource_exhausted(
    tiny_shm_agent: AgentProcess, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A model too big for a strict tier is RESOURCE_EXHAUSTED with a hint to evict; nothing is
    cached.
    """
    source = tmp_path / "big"
    tensors = make_safetensors_model(source, total_bytes=3 * 1024**2, shards=2)
    model = upload_model(s3_server.client(), bucket, "m", source, tensors=tensors)
    error = _ensure_status(tiny_shm_agent, model.uri, tier=pb.TIER_SHM, strict_tier=True)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Tier shm" in error.details
    assert "prewarm evict" in error.details
    assert cache_entries(tiny_shm_agent) == {}


def test_model_larger_than_the_hinted_tier_falls_back_to_the_other(
    tiny_shm_agent: AgentProcess, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Without strict_tier, a model too big for shm lands on the disk tier instead."""
    source = tmp_path / "big"
    tensors = make_safetensors_model(source, total_bytes=3 * 1024**2, shards=2)
    model = upload_model(s3_server.client(), bucket, "m", source, tensors=tensors)
    with Client(tiny_shm_agent.socket_path) as client:
        handle = client.ensure(model.uri, tier="shm")
    assert handle.tier == "disk"
    assert handle.path.parent == tiny_shm_agent.disk_root / "snapshots"


def test_evicting_a_model_while_it_is_pulled_is_refused(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Evicting a model mid-pull is a Conflict; the pull finishes and can be evicted afterwards."""
    source = tmp_path / "slow"
    tensors = make_safetensors_model(source, total_bytes=32 * 1024**2, shards=4)
    model = upload_model(s3_server.client(), bucket, "m", source, tensors=tensors)
    agent = start_agent('[s3]\nchunk_size = "1MiB"\nconcurrency = 1\n')
    moving = threading.Event()
    outcome: list[object] = []

    def on_progress(progress: Progress) -> None:
        if progress.bytes_done:
            moving.set()

    def pull() -> None:
        with Client(agent.socket_path) as client:
            outcome.append(client.ensure(model.uri, progress=on_progress))

    puller = threading.Thread(target=pull)
    puller.start()
    assert moving.wait(timeout=60)
    with Client(agent.socket_path) as client, pytest.raises(Conflict, match="being pulled"):
        client.evict(model.uri)
    puller.join()
    assert len(outcome) == 1
    with Client(agent.socket_path) as client:
        assert client.evict(model.uri).bytes_freed == model.total_bytes


@pytest.mark.parametrize(
    ("ref", "code"),
    [
        ("not-a-key!", grpc.StatusCode.INVALID_ARGUMENT),
        ("abc", grpc.StatusCode.INVALID_ARGUMENT),
        ("0123456789abcdef", grpc.StatusCode.NOT_FOUND),
        ("s3://bucket/never-pulled/", grpc.StatusCode.NOT_FOUND),
    ],
)
def test_get_and_evict_with_a_bad_ref(
    start_agent: AgentFactory, ref: str, code: grpc.StatusCode
) -> None:
    """GetModel and EvictModel answer a malformed ref INVALID_ARGUMENT and an unknown one NOT_FOUND,
    both pointing at `prewarm ls`.
    """
    agent = start_agent()
    with grpc.insecure_channel(agent.target) as channel:
        stub = pb_grpc.PrewarmStub(channel)
        for call in (
            lambda: stub.GetModel(pb.GetModelRequest(ref=ref), timeout=30),
            lambda: stub.EvictModel(pb.EvictModelRequest(ref=ref), timeout=30),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert _refusal(info.value).code == code
            assert "prewarm ls" in _refusal(info.value).details


@pytest.mark.parametrize("error_type", [PrewarmError, *PrewarmError.__subclasses__()])
def test_each_error_has_one_status_on_both_sockets_and_maps_back(
    error_type: type[PrewarmError],
) -> None:
    """The API's status code, the lease socket's status name and the client's class agree."""
    error = error_type("message")
    assert status_code_for(error).name == error.status
    returned = error_for_code(error.status, "message")
    assert type(returned) is error_type_for_status(error.status)
    assert isinstance(error, type(returned))
    assert str(returned) == "message"


def test_api_socket_refuses_what_the_lease_socket_refuses(tmp_path: Path) -> None:
    """A live socket or a non-socket path is a Conflict, an unknown group a ConfigError."""
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(live))
        listener.listen()
        with pytest.raises(Conflict, match="already serving the API"):
            ApiServer(TenantSocket(live, 0o660, "", None), ServerLimits(1.0)).claim()
    regular = tmp_path / "file.sock"
    regular.write_text("not a socket")
    with pytest.raises(Conflict, match="is not a socket"):
        ApiServer(TenantSocket(regular, 0o660, "", None), ServerLimits(1.0)).claim()
    assert regular.read_text() == "not a socket"
    with pytest.raises(ConfigError, match="does not exist"):
        ApiServer(
            TenantSocket(tmp_path / "api.sock", 0o660, "no-such-group-xyz", None), ServerLimits(1.0)
        ).claim()
