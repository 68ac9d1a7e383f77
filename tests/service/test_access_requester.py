"""Requester-scoped access against moto with IAM enforced (issue 11, control 3).

User A may read bucket model-a only, user B model-b only; the agent (the
node's role) may list everything but not GET model-a's objects, so model-a
reaches the cache only when a miss is pulled with the pod's own credentials.
A requester-scoped socket checks each pod's own credentials (ListObjectsV2 +
HEAD of every file) on every request, hit or miss. Pods ask the way a pod
does: ``prewarm pull --as-requester`` in a process whose AWS chain is the
pod's user; the raw stub only where a test sends what no client would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import grpc
import pytest

from agent._exceptions import AccessDenied, InvalidRequest
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc
from agent.client import Client
from agent.client._messages import requester_credentials
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
            models[bucket] = upload_model(admin, bucket, "m", directory, tensors=tensors)
        node = _node_user_that_cannot_read(s3, "model-a")
        user_a, user_b = s3.create_user("a", ["model-a"]), s3.create_user("b", ["model-b"])
        s3.enforce_iam()
        tenant_socket = root / "pods.sock"
        # moto checks IAM only on signed headers, not on presigned URLs (it answers 500),
        # so these pulls run on the aiobotocore plane; the processes plane's presigning
        # with the requester's keys is pinned in tests/source/test_processes_plane.py.
        config = (
            '[s3]\ndata_plane = "aiobotocore"\n'
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


def _node_user_that_cannot_read(s3: S3Server, bucket: str) -> LoopbackEndpoint:
    """The agent's role: every S3 action anywhere, except GetObject (and so HEAD) in ``bucket``."""
    iam = s3._iam_client()
    statements = [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
        {"Effect": "Deny", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{bucket}/*"},
    ]
    policy = {"Version": "2012-10-17", "Statement": statements}
    iam.create_user(UserName="node")
    iam.put_user_policy(UserName="node", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="node")["AccessKey"]
    return LoopbackEndpoint(s3.endpoint_url, key["AccessKeyId"], key["SecretAccessKey"])


def _pod_pull(
    world: IamWorld, uri: str, user: LoopbackEndpoint, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`prewarm pull --json URI ARGS` on the tenant socket, in a pod whose AWS chain is ``user``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PREWARM_", "AWS_"))}
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "pull", "--json", uri, *args],
        env=clean | user.env() | {"PREWARM_SOCKET_PATH": str(world.tenant_socket)} | (env or {}),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


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


def test_a_pod_gets_its_own_model_pulled_with_its_own_credentials(iam_world: IamWorld) -> None:
    """`prewarm pull --as-requester` as user A: A may read model-a and the node's role may not
    GET it, so the path A gets proves the miss was pulled with A's credentials."""
    pulled = _pod_pull(iam_world, iam_world.uri_a, iam_world.user_a, "--as-requester")
    assert pulled.returncode == 0, pulled.stderr
    handle = json.loads(pulled.stdout)
    assert Path(handle["path"]).is_dir()
    assert "with the requester's credentials" in iam_world.agent.log_text()


def test_a_cached_model_is_not_handed_to_a_pod_that_cannot_read_it(iam_world: IamWorld) -> None:
    """After B cached model-b, A's pull of it is PERMISSION_DENIED (exit 1) and prints no path;
    B's next request is checked again and served as a hit (PREWARM_AS_REQUESTER=1 this time)."""
    cached = _pod_pull(iam_world, iam_world.uri_b, iam_world.user_b, "--as-requester")
    assert cached.returncode == 0, cached.stderr
    path = json.loads(cached.stdout)["path"]
    denied = _pod_pull(iam_world, iam_world.uri_b, iam_world.user_a, "--as-requester")
    assert denied.returncode == 1
    assert "error:" in denied.stderr
    assert denied.stdout == ""
    assert path not in denied.stderr
    again = _pod_pull(
        iam_world, iam_world.uri_b, iam_world.user_b, env={"PREWARM_AS_REQUESTER": "1"}
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["hit"] is True


def test_requester_scoped_socket_refuses_requests_without_credentials(
    iam_world: IamWorld,
) -> None:
    """A client that does not send its credentials on a requester-scoped socket: AccessDenied
    (PERMISSION_DENIED) saying to use as_requester=True."""
    with (
        Client(iam_world.tenant_socket) as client,
        pytest.raises(AccessDenied, match="as_requester=True"),
    ):
        client.ensure(iam_world.uri_a)


def test_cached_only_is_refused_where_access_is_checked(iam_world: IamWorld) -> None:
    """cached_only skips S3, so it cannot check the pod: refused on a requester-scoped socket
    (exit 1, naming cached_only), even with the pod's credentials."""
    denied = _pod_pull(
        iam_world, iam_world.uri_a, iam_world.user_a, "--as-requester", "--cached-only"
    )
    assert denied.returncode == 1
    assert "cached_only" in denied.stderr


def test_oversized_or_partial_credentials_are_invalid(iam_world: IamWorld) -> None:
    """Credential fields are capped, and a key id needs its secret: INVALID_ARGUMENT."""
    huge = pb.RequesterCredentials(access_key_id="A" * 1000, secret_access_key="s")
    assert _ensure(iam_world, iam_world.uri_a, huge).code() is grpc.StatusCode.INVALID_ARGUMENT
    partial = pb.RequesterCredentials(access_key_id="AKIA")
    assert _ensure(iam_world, iam_world.uri_a, partial).code() is grpc.StatusCode.INVALID_ARGUMENT


def test_credentials_never_reach_the_log(iam_world: IamWorld) -> None:
    """Neither secret key nor key id appears in the agent's log after the requests above."""
    _pod_pull(iam_world, iam_world.uri_a, iam_world.user_a, "--as-requester")
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
