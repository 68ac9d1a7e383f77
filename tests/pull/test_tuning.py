"""Tuning arithmetic: concurrency from model size, precedence, and the streamer's variables;
pull options checked alike by the client and the agent, and their wire form."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent import InvalidRequest
from agent._config import S3Settings
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._vocabulary import PullOptions
from agent._wire import pull_options_from_proto, pull_options_to_proto
from agent.client import EnsureOptions
from agent.client._messages import ensure_request
from agent.source.tuning import (
    GETS_PER_STREAM,
    STREAMER_MIN_BLOCK,
    auto_concurrency,
    concurrency_ceiling,
    node_gbps,
    streamer_environment,
    tune,
    worker_processes,
)

MiB = 1024**2
GB = 10**9


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (0, 1),  # an empty model still gets a stream
        (1, 1),
        (4 * GB, 1),
        (4 * GB + 1, 2),
        (67 * GB, 17),
        (145 * GB, 37),  # the published example: 145 GB -> 37 streams
    ],
)
def test_auto_concurrency_is_one_stream_per_4_gb(size: int, expected: int) -> None:
    """Automatic concurrency is ceil(size / 4 GB) streams, at least one."""
    assert auto_concurrency(size, cpus=512, maximum=512) == expected


def test_auto_concurrency_is_capped_by_cpus_and_the_maximum() -> None:
    """Automatic concurrency never exceeds the CPU count or the configured maximum."""
    assert auto_concurrency(203 * GB, cpus=8, maximum=64) == 8
    assert auto_concurrency(203 * GB, cpus=192, maximum=32) == 32


def test_config_pins_concurrency_and_a_request_overrides_it() -> None:
    """A pinned config concurrency is used as is, and a request's option beats it."""
    settings = S3Settings(concurrency=6)
    assert tune(settings, 200 * GB, plane="streamer", cpus=192).concurrency == 6
    assert (
        tune(
            settings, 200 * GB, PullOptions(concurrency=3), plane="aiobotocore", cpus=192
        ).concurrency
        == 3
    )


def test_auto_concurrency_follows_the_model_size() -> None:
    """On the streamer plane automatic concurrency grows with the model size, within the CPUs."""
    settings = S3Settings(max_concurrency=64)
    assert tune(settings, 10 * GB, plane="streamer", cpus=192).concurrency == 3
    assert tune(settings, 10 * GB, plane="streamer", cpus=2).concurrency == 2


def test_aiobotocore_runs_several_gets_per_automatic_stream() -> None:
    """The aiobotocore plane runs GETS_PER_STREAM GETs per automatic stream, up to the maximum."""
    settings = S3Settings(max_concurrency=64)
    assert tune(settings, 10 * GB, plane="aiobotocore", cpus=192).concurrency == 3 * GETS_PER_STREAM
    assert tune(settings, 2 * GB, plane="aiobotocore", cpus=2).concurrency == GETS_PER_STREAM
    assert tune(settings, 900 * GB, plane="aiobotocore", cpus=192).concurrency == 64
    # A pinned value is GETs, as is.
    assert tune(S3Settings(concurrency=3), GB, plane="aiobotocore").concurrency == 3


def test_a_request_cannot_exceed_the_ceiling() -> None:
    """A requested concurrency is capped at the ceiling, which a higher pinned value raises."""
    assert (
        tune(
            S3Settings(max_concurrency=8), GB, PullOptions(concurrency=100), plane="streamer"
        ).concurrency
        == 8
    )
    pinned = S3Settings(concurrency=100, max_concurrency=8)
    assert concurrency_ceiling(pinned) == 100  # a pinned value above the maximum is kept
    assert tune(pinned, GB, PullOptions(concurrency=50), plane="streamer").concurrency == 50


def test_chunk_size_and_timeouts_come_from_config_unless_the_request_says() -> None:
    """Chunk size and timeouts come from the config; a request's chunk size overrides it."""
    settings = S3Settings(chunk_size=32 * MiB, request_timeout_ms=2500, low_speed_limit="2MiB")
    tuning = tune(settings, GB, plane="aiobotocore")
    assert tuning.chunk_size == 32 * MiB
    assert tuning.request_timeout == 2.5
    assert tuning.low_speed_limit == 2 * MiB
    assert (
        tune(settings, GB, PullOptions(chunk_size=8 * MiB), plane="aiobotocore").chunk_size
        == 8 * MiB
    )


def test_default_timeouts_follow_the_published_guidance() -> None:
    """Default timeouts are the published 3 s request timeout and 1 MiB/s low-speed limit."""
    tuning = tune(S3Settings(), GB, plane="streamer")
    assert tuning.request_timeout == 3.0
    assert tuning.low_speed_limit == MiB


BAD_OPTIONS = [
    {"data_plane": "fastest"},
    {"concurrency": 0},
    {"chunk_size": 1000},
    {"chunk_size": 8 * 1024**3},
]


@pytest.mark.parametrize("options", BAD_OPTIONS)
def test_bad_pull_options_are_invalid_requests(options: dict[str, object]) -> None:
    """PullOptions refuses an unknown plane, zero concurrency and chunks outside 1 MiB..4 GiB."""
    with pytest.raises(InvalidRequest):
        PullOptions(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize("options", BAD_OPTIONS)
def test_the_client_refuses_bad_pull_options_in_the_agents_words(
    options: dict[str, Any],
) -> None:
    """The client's check before a call says what the agent's PullOptions would say."""
    with pytest.raises(InvalidRequest) as agent_side:
        PullOptions(**options)
    with pytest.raises(InvalidRequest) as client_side:
        ensure_request(
            "s3://b/m/",
            EnsureOptions(
                data_plane=options.get("data_plane"),
                concurrency=options.get("concurrency"),
                chunk_size=options.get("chunk_size"),
            ),
        )
    assert str(client_side.value) == str(agent_side.value)


def test_pull_options_cross_the_wire_with_zero_meaning_the_agents_setting() -> None:
    """Unset options send no message, zeros read back as None, negatives are refused."""
    assert pull_options_to_proto(PullOptions()) is None
    sent = pull_options_to_proto(PullOptions(data_plane="streamer", chunk_size=2 * MiB))
    assert sent is not None
    assert pull_options_from_proto(sent) == PullOptions(data_plane="streamer", chunk_size=2 * MiB)
    with pytest.raises(InvalidRequest, match="must not be negative"):
        pull_options_from_proto(pb.PullOptions(concurrency=-1))


def test_streamer_block_is_at_least_its_minimum_and_ring_holds_two_ranges() -> None:
    """The streamer block is at least its 5 MiB minimum and its ring holds two ranges."""
    small = tune(S3Settings(chunk_size=MiB, concurrency=1), GB, plane="streamer")
    assert small.streamer_block == STREAMER_MIN_BLOCK
    assert small.streamer_memory == 2 * STREAMER_MIN_BLOCK
    big = tune(S3Settings(chunk_size=256 * MiB, concurrency=4), GB, plane="streamer")
    assert big.streamer_memory == 2 * 256 * MiB


def test_streamer_environment_maps_the_settings() -> None:
    """streamer_environment maps endpoint, region, addressing, timeouts and the pull's tuning to
    RUNAI_*/AWS_* variables.
    """
    settings = S3Settings(
        endpoint_url="http://127.0.0.1:9000",
        region="eu-west-1",
        addressing_style="path",
        request_timeout_ms=3000,
        low_speed_limit="1MiB",
    )
    tuning = tune(settings, 10 * GB, PullOptions(concurrency=5), plane="streamer")
    env = streamer_environment(settings, tuning)
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert env["AWS_REGION"] == "eu-west-1"
    assert env["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] == "0"
    assert env["RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS"] == "3000"
    assert env["RUNAI_STREAMER_S3_LOW_SPEED_LIMIT"] == str(MiB)
    assert env["RUNAI_STREAMER_CONCURRENCY"] == "5"
    assert int(env["RUNAI_STREAMER_CHUNK_BYTESIZE"]) >= STREAMER_MIN_BLOCK


def test_streamer_environment_without_a_custom_endpoint_keeps_virtual_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a custom endpoint no endpoint or addressing is forced, and per-pull values are left
    out.
    """
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    env = streamer_environment(S3Settings())
    assert "AWS_ENDPOINT_URL" not in env
    assert "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING" not in env
    assert "RUNAI_STREAMER_CONCURRENCY" not in env  # per pull, set when a pull starts


@pytest.mark.parametrize(
    ("product", "expected"),
    [("p5.48xlarge\n", 400.0), ("g5.48xlarge", 100.0), ("m5.large", 25.0), (None, 25.0)],
)
def test_the_nodes_bandwidth_comes_from_its_ec2_instance_type(
    tmp_path: Path, product: str | None, expected: float
) -> None:
    """target_gbps = auto reads the instance type from the DMI product name: a known GPU type
    gives its bandwidth to S3, anything else (or no DMI at all) the 25 Gbit/s default."""
    dmi = tmp_path / "product_name"
    if product is not None:
        dmi.write_text(product)
    assert node_gbps(S3Settings(), product=dmi) == expected
    assert node_gbps(S3Settings(target_gbps=50), product=dmi) == 50.0


def test_processes_concurrency_opens_enough_connections_for_the_node() -> None:
    """The processes plane keeps about target_gbps / 5 GETs in flight (5 Gbit/s a connection)
    when that is more than the model's size asks for, within max_concurrency."""
    settings = S3Settings()
    assert tune(settings, 2 * GB, plane="processes", cpus=2, gbps=25).concurrency == 16
    assert tune(settings, 2 * GB, plane="processes", cpus=192, gbps=400).concurrency == 80
    capped = S3Settings(max_concurrency=32)
    assert tune(capped, 2 * GB, plane="processes", cpus=192, gbps=400).concurrency == 32
    # The other planes keep sizing by the model alone.
    assert tune(settings, 2 * GB, plane="threads", cpus=192, gbps=400).concurrency == 16


def test_worker_processes_keep_each_interpreter_lock_under_half_busy() -> None:
    """Automatic worker count: enough that no worker's lock is over half busy at the node's
    rate (about 0.25 s of lock per GiB each), at least 2; a number in the config pins it."""
    assert worker_processes(S3Settings(), gbps=25) == 2
    assert worker_processes(S3Settings(), gbps=100) == 6
    assert worker_processes(S3Settings(), gbps=400) == 24
    assert worker_processes(S3Settings(), gbps=3200) == 32
    assert worker_processes(S3Settings(worker_processes=3), gbps=400) == 3
