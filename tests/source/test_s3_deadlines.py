"""An S3 that takes the connection and never answers fails a request within a known bound.

Before ``[s3] first_byte_timeout_seconds``, such an endpoint kept a cold
``prewarm pull`` waiting for botocore's 60 s read timeout on each of its
attempts (over six minutes), with nothing in the daemon's log. Each test here
puts a ``FaultProxy`` that swallows requests (``Fault.silent``) in front of moto
and gives the agent a bound of a few seconds: the only waiting in these tests is
that bound.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent._config import S3Settings, Settings
from agent._exceptions import SourceUnavailable
from agent._uri import parse_uri
from agent._vocabulary import DataPlaneName, PullOptions
from agent.leases.table import LeaseTable
from agent.pull.puller import Puller
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest
from agent.source.s3 import S3Source, SourceSilent
from agent.store.catalog import Store
from agent.testing import AgentProcess, Fault, FaultProxy, S3Server, SampleModel

# The bound these tests give the agent; each attempt waits a third of it, so a silent
# endpoint is tried three times within the bound.
BOUND = 3.0
# What a test's wall clock allows beyond the bound: interpreter start-up for the CLI,
# a loaded machine. The wait the agent itself reports is held to the bound exactly.
SLACK = 6.0
_WAITED = re.compile(r"sent no answer in (\d+\.\d) s")


def _waited(message: str) -> float:
    """The wait an error reports ("... sent no answer in 3.0 s ...")."""
    found = _WAITED.search(message)
    assert found, message
    return float(found[1])


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The shared server's credentials in this process's environment, for an S3Source here."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def silent_proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A proxy to moto that forwards nothing until a test adds its rules."""
    with FaultProxy(s3_server.endpoint_url) as proxy:
        yield proxy


def _settings(endpoint_url: str, **overrides: Any) -> S3Settings:
    values: dict[str, Any] = {
        "endpoint_url": endpoint_url,
        "addressing_style": "path",
        "first_byte_timeout_seconds": BOUND,
    }
    return S3Settings(**(values | overrides))


async def test_a_listing_that_gets_no_answer_fails_within_the_bound_naming_the_endpoint(
    s3_env: S3Server,
    small_model: SampleModel,
    silent_proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A silent listing is SourceSilent within the bound; each retry is logged with the endpoint."""
    silent_proxy.add(Fault.silent(times=None))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="agent.source.retries"):
        async with S3Source(_settings(silent_proxy.endpoint_url)) as source:
            with pytest.raises(SourceSilent) as caught:
                await source.list_objects(parse_uri(small_model.uri))
    waited = time.monotonic() - started
    assert waited < BOUND + SLACK, waited
    message = str(caught.value)
    assert f"S3 at {silent_proxy.endpoint_url} accepted the connection" in message
    assert _waited(message) <= BOUND + 0.2
    assert "first_byte_timeout_seconds" in message
    retries = [r for r in caught_records(caplog) if _is_listing_retry(r)]
    assert retries, caplog.text
    assert all(silent_proxy.endpoint_url in line for line in retries)
    assert "ReadTimeoutError" in retries[0]


def _is_listing_retry(line: str) -> bool:
    return "retrying ListObjectsV2" in line or (
        "ListObjectsV2 failed on its first try" in line and "trying again" in line
    )


async def test_a_head_and_a_get_that_get_no_answer_fail_within_the_bound(
    s3_env: S3Server, small_model: SampleModel, silent_proxy: FaultProxy
) -> None:
    """HEAD and a ranged GET swallowed by the endpoint are SourceSilent within the bound each."""
    key = sorted(small_model.keys)[0]
    silent_proxy.add(Fault.silent(method="HEAD", times=None), Fault.silent(times=None))
    async with S3Source(_settings(silent_proxy.endpoint_url)) as source:
        started = time.monotonic()
        with pytest.raises(SourceSilent, match="reading the metadata of"):
            await source.head_object(small_model.bucket, key)
        assert time.monotonic() - started < BOUND + SLACK
        started = time.monotonic()
        with pytest.raises(SourceSilent, match=r"reading s3://\S+ bytes 0-9"):
            async with source.open_range(small_model.bucket, key, etag='"x"', start=0, length=10):
                pass
        assert time.monotonic() - started < BOUND + SLACK


def test_a_cold_pull_from_a_silent_s3_fails_within_the_bound_and_says_what_to_check(
    s3_server: S3Server, small_model: SampleModel, silent_proxy: FaultProxy, tmp_path: Path
) -> None:
    """`prewarm pull` against a silent S3 exits 1 within the bound, naming the endpoint, the
    wait and what to check; the daemon logged each retry with the endpoint while it waited.
    """
    silent_proxy.add(Fault.silent(times=None))
    config = f"[s3]\nfirst_byte_timeout_seconds = {BOUND}\n"
    env = s3_server.env() | {"AWS_ENDPOINT_URL": silent_proxy.endpoint_url}
    with AgentProcess(env=env, config=config, parent=tmp_path) as agent:
        started = time.monotonic()
        done = _prewarm("pull", small_model.uri, socket=agent.socket_path)
        waited = time.monotonic() - started
        log = agent.log_text()
    assert done.returncode == 1, done.stderr
    assert waited < BOUND + SLACK, waited
    assert f"S3 at {silent_proxy.endpoint_url} accepted the connection" in done.stderr
    assert _waited(done.stderr) <= BOUND + 0.2
    assert "first_byte_timeout_seconds" in done.stderr
    # The first retry is logged as "failed on its first try ... trying again", later ones
    # as "retrying": on a loaded machine the bound can pass before a second attempt.
    retries = [line for line in log.splitlines() if _is_listing_retry(line)]
    assert retries, log
    assert silent_proxy.endpoint_url in retries[0]


@pytest.mark.parametrize(
    ("plane", "range_retries"),
    [("aiobotocore", 0), ("processes", 0), ("processes", 5)],
)
async def test_a_data_plane_get_that_gets_no_answer_fails_within_the_bound(
    plane: DataPlaneName,
    range_retries: int,
    *,
    s3_env: S3Server,
    small_model: SampleModel,
    silent_proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    """The ranged-GET planes keep the listing's bound: a swallowed GET fails the pull
    within the bound (range retries off; the processes plane counts the silence of a
    range's every retry against the bound, so with retries on too), UNAVAILABLE naming
    the endpoint, nothing published.
    """
    silent_proxy.add(Fault.silent(key=small_model.prefix, times=None))
    settings = Settings.model_validate(
        {
            "socket_path": tmp_path / "agent.sock",
            "tiers": {"shm_root": tmp_path / "shm", "disk_root": tmp_path / "disk"},
            "s3": _settings(silent_proxy.endpoint_url, retries=range_retries).model_dump(),
        }
    )
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    async with (
        S3Source(settings.s3) as source,
        Puller(store, source, settings.s3, settings.integrity) as puller,
    ):
        service = AgentService(store, puller, source, LeaseTable(60, 3600), settings=settings)
        started = time.monotonic()
        with pytest.raises(SourceUnavailable) as caught:
            async for _ in service.ensure(
                EnsureRequest(uri=parse_uri(small_model.uri), options=PullOptions(data_plane=plane))
            ):
                pass
        waited = time.monotonic() - started
    assert waited < BOUND + SLACK, waited
    assert f"S3 at {silent_proxy.endpoint_url} accepted the connection" in str(caught.value)
    assert _waited(str(caught.value)) <= BOUND + 0.2
    assert store.models() == []


def caught_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def _prewarm(*args: str, socket: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env["PREWARM_SOCKET_PATH"] = str(socket)
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
