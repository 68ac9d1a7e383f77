"""Tuning arithmetic: where adaptive concurrency starts and stops, part sizes, precedence,
worker processes and per-stream memory; pull options checked alike by the client and the
agent, and their wire form."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent import InvalidRequest
from agent._config import ConfigError, S3Settings, load_settings
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._vocabulary import PullOptions
from agent._wire import pull_options_from_proto, pull_options_to_proto
from agent.client import EnsureOptions
from agent.client._messages import ensure_request
from agent.source.process_plane import stream_step, worker_processes
from agent.source.tuning import (
    IN_LOOP_CONCURRENCY,
    concurrency_ceiling,
    node_gbps,
    node_streams,
    part_size,
    start_concurrency,
    tune,
)

MiB = 1024**2
GB = 10**9
GiB = 1024**3


def _config_file(directory: Path, text: str) -> Path:
    path = directory / "agent.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("gbps", "streams"), [(25, 63), (100, 250), (400, 1000)])
def test_a_node_plans_one_get_per_50_mb_per_second(gbps: float, streams: int) -> None:
    """Against S3 a GET carries about 50 MB/s: a 400 Gbit/s node plans 1,000 GETs in flight."""
    assert node_streams(gbps) == streams


def test_the_adaptive_limit_starts_at_the_planned_streams_and_stops_at_twice_them() -> None:
    """Auto concurrency starts at the planned streams (16 to 64) and may grow to twice them
    (256 to 4096); a pinned max_concurrency is the ceiling, a pinned concurrency raises it."""
    assert start_concurrency(S3Settings(), 25) == 63
    assert start_concurrency(S3Settings(), 1) == 16
    assert start_concurrency(S3Settings(), 400) == 64
    assert concurrency_ceiling(S3Settings(), 25) == 256
    assert concurrency_ceiling(S3Settings(), 400) == 2000
    assert concurrency_ceiling(S3Settings(), 3200) == 4096
    assert concurrency_ceiling(S3Settings(max_concurrency=32), 400) == 32
    assert start_concurrency(S3Settings(max_concurrency=8), 400) == 8
    assert concurrency_ceiling(S3Settings(concurrency=100, max_concurrency=8), 400) == 100


def test_auto_concurrency_on_the_processes_plane_adapts_and_a_pinned_one_does_not() -> None:
    """Only an automatic pull on the processes plane adapts; a number in the config or the
    request is taken as is (a request's beats the config's), capped at the ceiling."""
    auto = tune(S3Settings(), 2 * GB, plane="processes", gbps=25)
    assert auto.adaptive
    assert auto.concurrency == 63
    pinned = tune(S3Settings(concurrency=6), 2 * GB, plane="processes", gbps=25)
    assert (pinned.adaptive, pinned.concurrency) == (False, 6)
    asked = tune(
        S3Settings(concurrency=6), GB, PullOptions(concurrency=3), plane="processes", gbps=25
    )
    assert (asked.adaptive, asked.concurrency) == (False, 3)
    capped = tune(
        S3Settings(max_concurrency=8), GB, PullOptions(concurrency=100), plane="processes", gbps=25
    )
    assert capped.concurrency == 8
    in_loop = tune(S3Settings(), 2 * GB, plane="aiobotocore", gbps=400)
    assert (in_loop.adaptive, in_loop.concurrency) == (False, IN_LOOP_CONCURRENCY)


@pytest.mark.parametrize(
    ("total", "gbps", "part"),
    [
        (1 * GiB, 25, 8 * MiB),  # small model: the 8 MiB floor
        (4 * GiB, 25, 9 * MiB),  # eight parts per planned stream, whole MiB
        (100 * GiB, 25, 64 * MiB),  # big model: the 64 MiB ceiling
        (1 * GiB, 400, 48 * MiB),  # 50 GB/s in at most 1,000 GETs/s (the daemon's loop)
        (140 * GB, 400, 48 * MiB),
        (600 * GB, 400, 64 * MiB),  # the 64 MiB ceiling still holds
    ],
)
def test_parts_give_every_stream_several_and_keep_under_the_prefix_request_limit(
    total: int, gbps: float, part: int
) -> None:
    """Auto part size: eight parts per planned stream, 8 to 64 MiB, in whole MiB, and never
    so small that the node at full rate would ask S3 for over half its per-prefix GET rate
    or hand out over 1,000 GETs a second."""
    size = part_size(total, gbps)
    assert size == part
    assert size % MiB == 0
    assert gbps * 1e9 / 8 / size <= min(5500 * 0.5, 1000)


def test_chunk_size_and_timeouts_come_from_config_unless_the_request_says() -> None:
    """A pinned chunk size and the timeouts come from the config; a request's chunk size beats
    it; auto chunk size is the planned part size."""
    settings = S3Settings(chunk_size=32 * MiB, low_speed_seconds=2.5, low_speed_limit="2MiB")
    tuning = tune(settings, GB, plane="processes", gbps=25)
    assert tuning.chunk_size == 32 * MiB
    assert tuning.low_speed_seconds == 2.5
    assert tuning.low_speed_limit == 2 * MiB
    asked = tune(settings, GB, PullOptions(chunk_size=8 * MiB), plane="processes", gbps=25)
    assert asked.chunk_size == 8 * MiB
    assert tune(S3Settings(), 4 * GiB, plane="processes", gbps=25).chunk_size == part_size(
        4 * GiB, 25
    )


def test_default_timeouts_follow_the_published_guidance() -> None:
    """The default low-speed rule is the published guidance: 1 MiB/s over 3 s."""
    tuning = tune(S3Settings(), GB, plane="processes", gbps=25)
    assert tuning.low_speed_seconds == 3.0
    assert tuning.low_speed_limit == MiB


@pytest.mark.parametrize("removed", ["threads", "streamer"])
def test_a_removed_data_plane_in_the_config_names_what_to_use(removed: str, tmp_path: Path) -> None:
    """s3.data_plane = threads or streamer is a ConfigError saying the plane was removed and
    to use auto; in a request it is InvalidRequest in the same words."""
    with pytest.raises(ConfigError, match=f"{removed} data plane was removed.*use auto"):
        load_settings(_config_file(tmp_path, f'[s3]\ndata_plane = "{removed}"\n'))
    with pytest.raises(InvalidRequest, match=f"{removed} data plane was removed.*use auto"):
        PullOptions(data_plane=removed)  # type: ignore[arg-type]


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
    sent = pull_options_to_proto(PullOptions(data_plane="aiobotocore", chunk_size=2 * MiB))
    assert sent is not None
    assert pull_options_from_proto(sent) == PullOptions(
        data_plane="aiobotocore", chunk_size=2 * MiB
    )
    with pytest.raises(InvalidRequest, match="must not be negative"):
        pull_options_from_proto(pb.PullOptions(concurrency=-1))


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


def test_worker_processes_keep_each_lock_under_half_busy_and_gets_per_worker_bounded() -> None:
    """Automatic worker count: enough that no worker's lock is over half busy at the node's
    rate (about 0.25 s of lock per GiB each) and none holds over 128 GETs at the ceiling, at
    least 2, at most 32; a number in the config pins it."""
    assert worker_processes(S3Settings(), gbps=25) == 2
    assert worker_processes(S3Settings(), gbps=100) == 6
    assert worker_processes(S3Settings(), gbps=400) == 24
    assert worker_processes(S3Settings(max_concurrency=1024), gbps=25) == 8
    assert worker_processes(S3Settings(), gbps=3200) == 32
    assert worker_processes(S3Settings(worker_processes=3), gbps=400) == 3


def test_read_buffers_stay_within_the_nodes_stream_memory_at_its_ceiling() -> None:
    """Each GET's buffer is the low-speed step (512 KiB by default), smaller when the ceiling
    is high, so the node's buffers stay near 128 MiB however many GETs run, never under 64 KiB."""
    tuning = tune(S3Settings(), GB, plane="processes", gbps=25)
    assert stream_step(tuning, 256) == 512 * 1024
    assert stream_step(tuning, 1000) == 128 * 1024
    assert stream_step(tuning, 1000) * 1000 <= 128 * MiB
    assert stream_step(tuning, 2000) % 4096 == 0
    assert stream_step(tuning, 8192) == 64 * 1024
