"""Access controls: the source allowlist, tenant sockets, limits (issue 11, controls 1, 2, 4).

End to end against the real daemon and moto; the pull-slot accounting in-process.
"""

from __future__ import annotations

import json
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from agent_helpers import AgentFactory, object_gets

from agent._config import AccessLimits, ConfigError, Settings, load_settings, render_toml
from agent._exceptions import AccessDenied, NoSpace
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc
from agent.client import Client
from agent.pull.snapshot_limits import LimitExceeded
from agent.service.access import PullGate, Tenant
from agent.testing import AgentStartupError, InProcessAgent, S3Server, SampleModel
from agent.testing._process import purge_tree


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: Unix socket paths are limited to 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="pw-acc-", dir="/tmp"))
    yield directory
    purge_tree(directory)


def _stub(socket: Path) -> Any:
    return pb_grpc.PrewarmStub(grpc.insecure_channel(f"unix:{socket}"))


def _tenant_config(socket: Path, sources: list[str], extra: str = "") -> str:
    return (
        f'[[access.sockets]]\nname = "team-a"\npath = "{socket}"\nmode = "0600"\n'
        f"sources = {json.dumps(sources)}\n{extra}"
    )


def test_source_outside_the_allowlist_is_denied_before_any_s3_call(
    start_agent: AgentFactory, s3_server: S3Server, small_model: SampleModel
) -> None:
    """A URI no [access] sources pattern matches gets PERMISSION_DENIED and S3 sees nothing."""
    agent = start_agent(f'[access]\nsources = ["s3://{small_model.bucket}/other/*"]\n')
    s3_server.clear_requests()
    with Client(agent.socket_path) as client, pytest.raises(AccessDenied, match="sources"):
        client.ensure(small_model.uri)
    with Client(agent.socket_path) as client, pytest.raises(AccessDenied):
        client.ensure(small_model.uri, cached_only=True)
    assert s3_server.requests(bucket=small_model.bucket) == []


def test_allowed_source_is_served_and_a_plain_prefix_covers_what_is_below(
    start_agent: AgentFactory, small_model: SampleModel
) -> None:
    """A pattern without wildcards names a directory: the model under it is pulled."""
    agent = start_agent(f'[access]\nsources = ["s3://{small_model.bucket}/models"]\n')
    with Client(agent.socket_path) as client:
        handle = client.ensure(small_model.uri)
    assert Path(handle.path).is_dir()


def test_an_empty_allowlist_allows_any_source_and_warns_at_start(
    start_agent: AgentFactory, small_model: SampleModel
) -> None:
    """No [access] sources: the old behaviour (anything goes), with a warning in the log."""
    agent = start_agent()
    with Client(agent.socket_path) as client:
        client.ensure(small_model.uri)
    assert "[access] sources is empty" in agent.log_text()


def test_tenant_socket_serves_its_sources_only_and_logs_its_name(
    start_agent: AgentFactory, small_model: SampleModel, short_dir: Path
) -> None:
    """A tenant socket has its own mode, allowlist and log field; node-only RPCs are refused."""
    tenant_socket = short_dir / "a.sock"
    agent = start_agent(_tenant_config(tenant_socket, [f"s3://{small_model.bucket}/other/*"]))
    assert stat.S_IMODE(tenant_socket.stat().st_mode) == 0o600
    with Client(tenant_socket) as tenant, pytest.raises(AccessDenied, match="team-a"):
        tenant.ensure(small_model.uri)
    with Client(tenant_socket) as tenant, pytest.raises(AccessDenied, match="ListModels"):
        tenant.list_models()
    # The node's own socket keeps serving everything (its allowlist is empty).
    with Client(agent.socket_path) as node:
        node.ensure(small_model.uri)
        assert node.list_models()
    logged = [json.loads(line) for line in agent.log_text().splitlines() if line.startswith("{")]
    assert any(line.get("tenant") == "team-a" for line in logged)


def test_tenant_socket_within_the_node_allowlist_gets_its_model(
    start_agent: AgentFactory, small_model: SampleModel, short_dir: Path
) -> None:
    """A source must pass both the node's and the tenant's patterns; then it is served."""
    tenant_socket = short_dir / "a.sock"
    bucket = small_model.bucket
    config = f'[access]\nsources = ["s3://{bucket}/*"]\n\n' + _tenant_config(
        tenant_socket, [f"s3://{bucket}/models/*"]
    )
    agent = start_agent(config)
    with Client(tenant_socket) as tenant:
        assert Path(tenant.ensure(small_model.uri).path).is_dir()
    assert agent.running


def test_snapshot_over_the_file_limit_is_refused_before_any_get(
    start_agent: AgentFactory, s3_server: S3Server, small_model: SampleModel
) -> None:
    """max_files is checked after the listing: RESOURCE_EXHAUSTED naming it, no byte fetched."""
    agent = start_agent("[access.limits]\nmax_files = 2\n")
    s3_server.clear_requests()
    with Client(agent.socket_path) as client, pytest.raises(NoSpace, match="max_files"):
        client.ensure(small_model.uri)
    assert object_gets(s3_server.requests(bucket=small_model.bucket)) == []


def test_snapshot_over_a_tenant_byte_limit_is_refused(
    start_agent: AgentFactory, small_model: SampleModel, short_dir: Path
) -> None:
    """A tenant's own max_bytes applies on its socket, naming the tenant."""
    tenant_socket = short_dir / "a.sock"
    limits = "\n[access.sockets.limits]\nmax_bytes = 1024\n"
    start_agent(_tenant_config(tenant_socket, [], limits))
    with Client(tenant_socket) as tenant, pytest.raises(NoSpace, match="team-a"):
        tenant.ensure(small_model.uri)


def test_a_request_over_max_request_bytes_is_refused(
    start_agent: AgentFactory, small_model: SampleModel
) -> None:
    """The socket refuses messages over [access] max_request_bytes (RESOURCE_EXHAUSTED)."""
    agent = start_agent("[access]\nmax_request_bytes = 4096\n")
    request = pb.EnsureModelRequest(uri=small_model.uri, include=["x" * 100] * 100)
    with pytest.raises(grpc.RpcError) as caught:
        list(_stub(agent.socket_path).EnsureModel(request, timeout=10))
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_tenant_socket_on_the_api_socket_path_refuses_to_start(short_dir: Path) -> None:
    """A tenant socket that would take over the agent's own socket is a config error."""
    agent = InProcessAgent(root=short_dir, config=_tenant_config(short_dir / "agent.sock", []))
    with pytest.raises(AgentStartupError, match="agent's own"):
        agent.start()


def test_access_settings_round_trip_through_print_config(tmp_path: Path) -> None:
    """render_toml writes [access], its limits and [[access.sockets]] so they load back."""
    config = tmp_path / "agent.toml"
    config.write_text(
        '[access]\nsources = ["s3://models-prod/*"]\n'
        + _tenant_config(Path("/run/prewarm/a.sock"), ["s3://models-prod/a/*"])
        + "requester_scoped = true\n[access.sockets.limits]\nmax_concurrent_pulls = 2\n"
    )
    settings = load_settings(config)
    config.write_text(render_toml(settings))
    assert load_settings(config) == settings
    assert settings.access.sockets[0].limits.max_concurrent_pulls == 2


@pytest.mark.parametrize(
    "bad",
    [
        '[access]\nsources = ["models-prod/*"]\n',
        '[[access.sockets]]\nname = "a b"\npath = "/run/a.sock"\n',
        '[[access.sockets]]\nname = "a"\npath = "/run/a.sock"\n'
        '[[access.sockets]]\nname = "a"\npath = "/run/b.sock"\n',
    ],
)
def test_bad_access_settings_name_the_problem(tmp_path: Path, bad: str) -> None:
    """Non-S3 patterns, bad tenant names and duplicate tenants are config errors."""
    config = tmp_path / "agent.toml"
    config.write_text(bad)
    with pytest.raises(ConfigError, match="access"):
        load_settings(config)


def _tenants(node_limit: int, tenant_limit: int) -> tuple[Tenant, Tenant]:
    gate = PullGate(node_limit)
    limits, node_limits = AccessLimits(max_concurrent_pulls=tenant_limit), AccessLimits()
    a = Tenant("a", (), (), limits, node_limits, gate)
    b = Tenant("b", (), (), limits, node_limits, gate)
    return a, b


def test_pull_gate_counts_each_tenant_and_the_node_and_frees_ended_pulls() -> None:
    """Per-socket and node-wide pull limits refuse at once; an ended pull frees its slot."""
    a, b = _tenants(node_limit=3, tenant_limit=2)
    a.gate.admit(a, "k1", [])
    a.gate.admit(a, "k2", ["k1"])
    with pytest.raises(LimitExceeded, match="Socket 'a'"):
        a.gate.admit(a, "k3", ["k1", "k2"])
    b.gate.admit(b, "k3", ["k1", "k2"])
    with pytest.raises(LimitExceeded, match="on this node"):
        b.gate.admit(b, "k4", ["k1", "k2", "k3"])
    a.gate.admit(a, "k4", ["k2", "k3"])  # k1 ended: a has one slot again


def test_settings_default_to_no_limits_and_a_bounded_request_size() -> None:
    """Defaults: no allowlist, no sockets, no limits, 256 KiB requests."""
    access = Settings().access
    assert (access.sources, access.sockets) == ([], [])
    assert access.limits == AccessLimits()
    assert int(access.max_request_bytes) == 256 * 1024
