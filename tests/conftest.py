"""Shared fixtures: a real S3 server on loopback, buckets, a sample model, the agent.

Tests never patch boto3 or aiobotocore: they talk to moto's server over HTTP
(``agent.testing.S3Server``). The agent is the real ``serve()`` on its own Unix
socket: on a thread of the test process (``agent_daemon``, ``start_agent``)
when the test is about what the agent answers, or as a ``python -m agent``
subprocess (``agent_process``, ``start_agent_process``) when it is about the
process: signals, SIGKILL and restart, exit codes, stderr, process-wide metrics.
"""

from __future__ import annotations

import os
import re
import tomllib
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from agent_helpers import AgentFactory, ProcessFactory, RunningAgent, small_tmpfs
from store_helpers import close_open_stores

from agent._config import ENV_PREFIX, NESTED_DELIMITER
from agent.testing import (
    AgentProcess,
    InProcessAgent,
    S3Server,
    SampleModel,
    make_safetensors_model,
    upload_model,
)

MiB = 1024 * 1024


# pyproject's timeout (60 s) is for ordinary tests; one marked slow (an install into
# a fresh prefix, a pull through injected faults) gets this much unless it names its own.
SLOW_TEST_TIMEOUT = 300

# The soak and the fuzzer assert the same things at any length: `make test` runs them this
# short; `make soak` and `make fuzz`, run before a release, pass the long lengths.
SHORT_SOAK_SECONDS = 10.0
SHORT_FUZZ_EXAMPLES = 600


def pytest_addoption(parser: pytest.Parser) -> None:
    """--soak-seconds and --fuzz-examples: how long the soak and the fuzzer run."""
    group = parser.getgroup("prewarm", "prewarm's long runs")
    group.addoption(
        "--soak-seconds",
        type=float,
        default=SHORT_SOAK_SECONDS,
        help=f"how long tests/node/test_soak.py's clients run (default {SHORT_SOAK_SECONDS:g}; "
        "make soak: 60)",
    )
    group.addoption(
        "--fuzz-examples",
        type=int,
        default=SHORT_FUZZ_EXAMPLES,
        help=f"requests tests/edge/test_fuzz_rpcs.py generates (default {SHORT_FUZZ_EXAMPLES}; "
        "make fuzz: 6000)",
    )


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker more than the CPUs, since a worker spends part of each test
    waiting on its agents, S3 server and children. Measured on 2 cores, a whole pytest
    run: 2 workers 370 s, 3 workers 309 s, 4 workers 331 s (CPU saturated)."""
    return (os.cpu_count() or 1) + 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give tests marked slow the longer timeout; run the files that hold them first."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT))
    _longest_files_first(items)


def _longest_files_first(items: list[pytest.Item]) -> None:
    # xdist's loadfile hands whole files to the workers in this order
    # (pyproject's addopts turn its own reordering, by test count, off). A long
    # file handed out last (the soak run: one test, a minute) left one worker
    # busy alone at the end; handed out first, the short files fill in around
    # it. Slow-marked tests stand in for measured cost, so a new or renamed
    # file needs no table; the sort is stable, so each file keeps its order.
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    tests = Counter(item.path for item in items)
    items.sort(key=lambda item: (-slow[item.path], -tests[item.path], str(item.path)))


@pytest.fixture(autouse=True)
def _stores_let_go() -> Iterator[None]:
    """Every store a test opened with ``open_store`` lets go of its roots when the test ends."""
    yield
    close_open_stores()


@pytest.fixture(scope="session")
def soak_seconds(pytestconfig: pytest.Config) -> float:
    """How long the soak's clients run: --soak-seconds (short in make test, 60 s in make soak)."""
    seconds: float = pytestconfig.getoption("soak_seconds")
    return seconds


@pytest.fixture(scope="session")
def fuzz_examples(pytestconfig: pytest.Config) -> int:
    """How many requests the fuzzer sends: --fuzz-examples (600 in make test, 6,000 in make
    fuzz)."""
    examples: int = pytestconfig.getoption("fuzz_examples")
    return examples


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One S3 server for the whole session; isolate tests by bucket, not by server."""
    with S3Server() as server:
        yield server


@pytest.fixture
def stoppable_s3() -> Iterator[S3Server]:
    """A server of the test's own, which it may stop, kill or restart."""
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_client(s3_server: S3Server) -> Iterator[Any]:
    """A boto3 S3 client for the shared server."""
    client = s3_server.client()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def bucket(request: pytest.FixtureRequest, s3_client: Any) -> Iterator[str]:
    """A fresh bucket on the shared server, named after the test; emptied and deleted after."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{slug}-{uuid.uuid4().hex[:8]}"
    s3_client.create_bucket(Bucket=name)
    yield name
    _delete_bucket(s3_client, name)


def _delete_bucket(client: Any, name: str) -> None:
    # moto keeps every object in memory for the whole session, so give it back.
    try:
        pages = client.get_paginator("list_object_versions").paginate(Bucket=name)
        for page in pages:
            doomed = [
                {"Key": item["Key"], "VersionId": item["VersionId"]}
                for item in page.get("Versions", []) + page.get("DeleteMarkers", [])
            ]
            if doomed:
                client.delete_objects(Bucket=name, Delete={"Objects": doomed, "Quiet": True})
        client.delete_bucket(Bucket=name)
    except client.exceptions.NoSuchBucket:
        pass  # the test deleted it itself


@pytest.fixture(scope="session")
def small_model_source(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, MappingProxyType[str, Any]]:
    """A ~8 MiB, 3-shard model on local disk, generated once per session."""
    directory = tmp_path_factory.mktemp("small-model")
    tensors = make_safetensors_model(directory, total_bytes=8 * MiB, shards=3, seed=1)
    for array in tensors.values():
        array.flags.writeable = False  # shared by every test that uses it
    return directory, MappingProxyType(tensors)


@pytest.fixture
def small_model(
    s3_client: Any, bucket: str, small_model_source: tuple[Path, MappingProxyType[str, Any]]
) -> SampleModel:
    """The small model uploaded to ``s3://<bucket>/models/small/``."""
    directory, tensors = small_model_source
    return upload_model(s3_client, bucket, "models/small", directory, tensors=tensors)


@pytest.fixture
def start_agent(s3_server: S3Server) -> Iterator[AgentFactory]:
    """Start agents against the shared S3 server (or ``s3=``); each is stopped at teardown.

    The first runs in this process; one started while it runs is a subprocess,
    because the metrics registry, logging and os.environ are per process.
    """
    started: list[RunningAgent] = []

    def start(config: str = "", s3: S3Server | None = None) -> RunningAgent:
        env = (s3 or s3_server).env() | _one_range_worker(config)
        agent: RunningAgent
        if InProcessAgent.active() is None:
            agent = InProcessAgent(env=env, config=config)
        else:
            agent = AgentProcess(env=env, config=config)
        started.append(agent)
        return agent.start()

    yield start
    _close_all(started)


@pytest.fixture
def agent_daemon(start_agent: AgentFactory) -> RunningAgent:
    """The real agent, in this process, pointed at the shared S3 server, ready to serve."""
    return start_agent()


@pytest.fixture
def start_agent_process(s3_server: S3Server) -> Iterator[ProcessFactory]:
    """Start real daemon subprocesses (``python -m agent``, ``env`` added to theirs); each is
    stopped at teardown."""
    started: list[AgentProcess] = []

    def start(
        config: str = "", s3: S3Server | None = None, env: Mapping[str, str] | None = None
    ) -> AgentProcess:
        extra = _one_range_worker(config) | dict(env or {})
        agent = AgentProcess(env=(s3 or s3_server).env() | extra, config=config)
        started.append(agent)
        return agent.start()

    yield start
    _close_all(started)


@pytest.fixture
def agent_process(start_agent_process: ProcessFactory) -> AgentProcess:
    """The real daemon subprocess pointed at the shared S3 server, ready to serve."""
    return start_agent_process()


def _one_range_worker(config: str) -> dict[str, str]:
    # "auto" starts two range-worker processes with each test agent: about 600
    # interpreters and 90 s of CPU over the suite for nothing a test looks at. A config
    # that names its own number keeps it; the pool's dispatch over several workers and
    # their replacement are pinned in tests/source/test_processes_plane.py.
    if "worker_processes" in tomllib.loads(config).get("s3", {}):
        return {}
    return {f"{ENV_PREFIX}S3{NESTED_DELIMITER}WORKER_PROCESSES": "1"}


def _close_all(agents: Sequence[RunningAgent]) -> None:
    # Newest first: a later agent may lean on an earlier one's S3 server or files.
    errors: list[BaseException] = []
    for agent in reversed(agents):
        try:
            agent.close()
        except Exception as exc:  # close the others before reporting it
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (needs root to mount)."""
    with small_tmpfs(tmp_path / "tiny", "2m") as mount_point:
        yield mount_point
