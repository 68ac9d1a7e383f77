"""Requester-scoped access against moto with IAM enforced (issue 11, control 3).

User A may read bucket model-a only, user B model-b only, the agent (the
node's role) everything. A requester-scoped socket checks each pod's own
credentials (ListObjectsV2 + HEAD of every file) on every request, hit or miss.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import grpc
import pytest

from agent._exceptions import InvalidRequest
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc
from agent.client._requester import requester_credentials
from agent.testing import InProcessAgent, S3Server, upload_model
from agent.testing._endpoint import LoopbackEndpoint
from agent.testing._process import purge_tree


@dataclass(frozen=True)
class IamWorld:
    agent: InProcessAgent
    tenant_socket: Path
    user_a: LoopbackEndpoint
    user_b: LoopbackEndpoint
    uri_a: str
    uri_b: str


@pytest.fixture(scope="module")
def iam_world(
    small_model_source: tuple[Path, MappingProxyType[str, Any]],
) -> Iterator[IamWorld]:
    """moto with IAM on, two models, users node/A/B, an agent with a requester-scoped socket."""
    directory, tensors = small_model_source
    root = Path(tempfile.mkdtemp(prefix="pw-iam-", dir="/tmp"))
    with S3Server(iam=True) as s3:
        admin = s3.client()
        models = {}
        for bucket in ("model-a", "model-b"):
            admin.create_bucket(Bucket=bucket)
            models[bucket] = upload_model(admin, bucket, "m", directory, tensors)
        node = s3.create_user("node", ["*"])
        user_a, user_b = s3.create_user("a", ["model-a"]), s3.create_user("b", ["model-b"])
        s3.enforce_iam()
        tenant_socket = root / "pods.sock"
        config = (
            f'[[access.sockets]]\nname = "pods"\npath = "{tenant_socket}"\n'
            "requester_scoped = true\n"
        )
        agent = InProcessAgent(env=node.env(), root=root, config=config)
        with agent:
            yield IamWorld(
                agent,
                tenant_socket,
                user_a,
                user_b,
                models["model-a"].uri,
                models["model-b"].uri,
            )
    purge_tree(root)


def _keys(user: LoopbackEndpoint) -> pb.RequesterCredentials:
    return pb.RequesterCredentials(access_key_id=user.access_key, secret_access_key=user.secret_key)


def _ensure(world: IamWorld, uri: str, creds: pb.RequesterCredentials | None, **fields: Any) -> Any:
    """EnsureModel on the tenant socket; the handle, or the grpc error."""
    request = pb.EnsureModelRequest(uri=uri, **fields)
    if creds is not None:
        request.requester_credentials.CopyFrom(creds)
    with grpc.insecure_channel(f"unix:{world.tenant_socket}") as channel:
        try:
            events = list(pb_grpc.PrewarmStub(channel).EnsureModel(request, timeout=60))
        except grpc.RpcError as exc:
            return exc
    return events[-1].handle


def test_a_pod_gets_its_own_model_with_its_own_credentials(iam_world: IamWorld) -> None:
    """User A's credentials may list and read model-a: the agent pulls it and answers a path."""
    handle = _ensure(iam_world, iam_world.uri_a, _keys(iam_world.user_a))
    assert isinstance(handle, pb.ModelHandle), handle
    assert Path(handle.path).is_dir()


def test_a_cached_model_is_not_handed_to_a_pod_that_cannot_read_it(iam_world: IamWorld) -> None:
    """After B cached model-b, A's request for it is PERMISSION_DENIED and carries no path."""
    cached = _ensure(iam_world, iam_world.uri_b, _keys(iam_world.user_b))
    assert isinstance(cached, pb.ModelHandle), cached
    denied = _ensure(iam_world, iam_world.uri_b, _keys(iam_world.user_a))
    assert isinstance(denied, grpc.RpcError)
    assert denied.code() is grpc.StatusCode.PERMISSION_DENIED
    assert cached.path not in (denied.details() or "")
    # B's hit is checked again, and still served.
    again = _ensure(iam_world, iam_world.uri_b, _keys(iam_world.user_b))
    assert isinstance(again, pb.ModelHandle)
    assert again.hit


def test_requester_scoped_socket_refuses_requests_without_credentials(
    iam_world: IamWorld,
) -> None:
    """No credentials on a requester-scoped socket: PERMISSION_DENIED saying what to send."""
    denied = _ensure(iam_world, iam_world.uri_a, None)
    assert denied.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "credentials" in denied.details()


def test_cached_only_is_refused_where_access_is_checked(iam_world: IamWorld) -> None:
    """cached_only skips S3, so it cannot check the pod: refused on a requester-scoped socket."""
    denied = _ensure(iam_world, iam_world.uri_a, _keys(iam_world.user_a), cached_only=True)
    assert denied.code() is grpc.StatusCode.PERMISSION_DENIED


def test_oversized_or_partial_credentials_are_invalid(iam_world: IamWorld) -> None:
    """Credential fields are capped, and a key id needs its secret: INVALID_ARGUMENT."""
    huge = pb.RequesterCredentials(access_key_id="A" * 1000, secret_access_key="s")
    assert _ensure(iam_world, iam_world.uri_a, huge).code() is grpc.StatusCode.INVALID_ARGUMENT
    partial = pb.RequesterCredentials(access_key_id="AKIA")
    assert _ensure(iam_world, iam_world.uri_a, partial).code() is grpc.StatusCode.INVALID_ARGUMENT


def test_credentials_never_reach_the_log(iam_world: IamWorld) -> None:
    """Neither secret key nor key id appears in the agent's log after the requests above."""
    _ensure(iam_world, iam_world.uri_a, _keys(iam_world.user_a))
    log = iam_world.agent.log_text()
    for user in (iam_world.user_a, iam_world.user_b):
        assert user.secret_key not in log
        assert user.access_key not in log


def test_client_reads_the_pods_credentials_with_botocores_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """requester_credentials() takes what the standard chain finds, session token included."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAPOD")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "pod-secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "pod-token")
    sent = requester_credentials()
    assert (sent.access_key_id, sent.secret_access_key, sent.session_token) == (
        "AKIAPOD",
        "pod-secret",
        "pod-token",
    )


def test_client_without_any_credentials_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No credentials anywhere in the chain: InvalidRequest naming the sources it tried."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(InvalidRequest, match="no AWS credentials"):
        requester_credentials()
