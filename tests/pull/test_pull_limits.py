"""The concurrent-pull limit of a tenant socket, end to end (issue 11, control 4).

A pull is held in flight by a FaultProxy stall on its objects' GETs; over the same tenant
socket, a pull of another model is RESOURCE_EXHAUSTED at once, a request for the stalled
snapshot joins its flight instead of counting as a pull, and the node's own socket is not
limited by the tenant's count. Real daemon, real moto server behind the proxy.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from agent._exceptions import NoSpace
from agent.client import Client, ModelHandle, Progress
from agent.testing import Fault, FaultProxy, InProcessAgent, S3Server, SampleModel, upload_model
from agent.testing._process import purge_tree

# A stalled GET is given up on after a second and retried; enough retries that the stall
# outlasts the test's requests, which then end once the stall is lifted.
_S3 = "[s3]\nlow_speed_seconds = 1\nretries = 20\n\n"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: Unix socket paths are limited to 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="pw-pl-", dir="/tmp"))
    yield directory
    purge_tree(directory)


def _joined_flight(started: threading.Event) -> Any:
    """A progress callback that sets ``started`` once the pull's own progress arrives (the
    edge's first resolve event carries no snapshot key yet)."""

    def seen(progress: Progress) -> None:
        if progress.key:
            started.set()

    return seen


def test_a_tenants_second_pull_is_refused_at_once_and_joining_is_not_a_pull(
    s3_server: S3Server,
    small_model: SampleModel,
    small_model_source: tuple[Path, MappingProxyType[str, Any]],
    short_dir: Path,
) -> None:
    """max_concurrent_pulls = 1 on a tenant socket, one pull stalled: another model over that
    socket is NoSpace (RESOURCE_EXHAUSTED) in well under a second; a second request for the
    stalled model joins its flight; the node's socket still pulls; all end once S3 answers."""
    directory, tensors = small_model_source
    other = upload_model(
        s3_server.client(), small_model.bucket, "models/other", directory, tensors=tensors
    )
    tenant_socket = short_dir / "a.sock"
    config = _S3 + (
        f'[[access.sockets]]\nname = "team-a"\npath = "{tenant_socket}"\n\n'
        "[access.sockets.limits]\nmax_concurrent_pulls = 1\n"
    )
    with FaultProxy(s3_server.endpoint_url) as proxy, ThreadPoolExecutor(2) as pool:
        proxy.add(Fault.stall(key=f"/{small_model.bucket}/{small_model.prefix}", times=None))
        env = s3_server.env() | {"AWS_ENDPOINT_URL": proxy.endpoint_url}
        with InProcessAgent(env=env, config=config) as agent:
            first_joined, second_joined = threading.Event(), threading.Event()

            def pull_stalled(joined: threading.Event) -> ModelHandle:
                with Client(tenant_socket) as client:
                    return client.ensure(small_model.uri, progress=_joined_flight(joined))

            stalled = pool.submit(pull_stalled, first_joined)
            proxy.wait_injected("stall")
            assert first_joined.wait(30)
            joiner = pool.submit(pull_stalled, second_joined)
            assert second_joined.wait(30), "a request for the same snapshot was not let in"
            with Client(tenant_socket) as tenant:
                asked = time.monotonic()
                with pytest.raises(NoSpace, match="max_concurrent_pulls"):
                    tenant.ensure(other.uri)
                assert time.monotonic() - asked < 5.0
            with Client(agent.socket_path) as node:
                assert Path(node.ensure(other.uri).path).is_dir()
            proxy.clear()
            handles = [stalled.result(timeout=120), joiner.result(timeout=120)]
    assert handles[0].path == handles[1].path
    assert not handles[0].hit
