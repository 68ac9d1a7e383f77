"""The bench's CPU and memory accounting of a process tree, its --scaling sizes and hit targets.

The benchmark itself is run by hand; these pin the arithmetic and the /proc
reading it rests on, with real threads and a real child process.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading

import pytest

from bench._hits import NO_S3, REFUSED
from bench._scaling import parse_sizes
from bench._system import RssSampler
from bench._targets import RunOutline, judge_targets
from bench._threads import ThreadCpu, ThreadUse, cpu_report

GiB = 1024**3
# A run over HTTPS alone, without cold pulls: what the hit targets are judged in.
HTTPS_ONLY = RunOutline(
    schemes=["https"],
    preferred="https",
    planes=[],
    default_plane="aiobotocore",
    concurrent=None,
    model_bytes=GiB,
)
MiB = 1024**2


def _burn(rounds: int = 200) -> None:
    block = b"x" * (1 << 20)
    for _ in range(rounds):
        hashlib.sha256(block).digest()


def test_busy_thread_that_came_and_went_is_the_busiest_and_named() -> None:
    """A thread born and ended inside the window is counted, by its Python name."""
    with ThreadCpu(os.getpid()) as threads:
        worker = threading.Thread(target=_burn, args=(400,), name="hasher")
        worker.start()
        worker.join()
    busiest = threads.threads()[0]
    assert busiest.label == f"{busiest.comm} (hasher)"
    assert busiest.seconds > 0.05
    report = threads.to_json(GiB)
    assert report["busiest_thread"] == busiest.label
    # The whole process spent at least what its busiest thread did (ticks: 10 ms).
    assert report["process_seconds"] >= busiest.seconds - 0.02


def test_sampler_leaves_its_own_thread_out() -> None:
    """Watching its own process, the sampler's thread is not among the threads reported."""
    with ThreadCpu(os.getpid(), interval=0.001) as threads:
        _burn(50)
    names = {use.name for use in threads.threads()}
    assert "thread-cpu" not in names


def test_children_are_followed() -> None:
    """A busy child process's threads count for the parent being watched."""
    code = "import hashlib\nfor _ in range(300): hashlib.sha256(b'x' * (1 << 20)).digest()"
    with ThreadCpu(os.getpid()) as threads:
        child = subprocess.run([sys.executable, "-c", code], check=True)
    assert child.returncode == 0
    in_child = [use for use in threads.threads() if use.pid != os.getpid()]
    assert in_child
    assert max(use.seconds for use in in_child) > 0.05


def test_cpu_report_bound_is_one_over_busiest_per_gib() -> None:
    """CPU-s per GiB of the whole and of the busiest thread; the bound is 1 / the latter."""
    uses = [ThreadUse(10, 10, "loop", 0.5), ThreadUse(10, 11, "worker", 0.25)]
    report = cpu_report(uses, 1.0, 2 * GiB)
    assert report["process_per_gib"] == pytest.approx(0.5)
    assert report["busiest_per_gib"] == pytest.approx(0.25)
    assert report["busiest_bound_gib_per_second"] == pytest.approx(4.0)
    assert report["busiest_thread"] == "loop (main thread)"
    assert report["unattributed"] == pytest.approx(0.25)


def test_cpu_report_main_thread_is_the_watched_process_s_own() -> None:
    """The main thread is the watched process's (the daemon's loop), not a worker's main thread."""
    uses = [
        ThreadUse(20, 20, "python", 0.75, child=True),
        ThreadUse(10, 10, "python", 0.25),
        ThreadUse(10, 11, "python", 0.5),
    ]
    report = cpu_report(uses, 1.5, GiB)
    assert report["busiest_thread"] == "python (child 20: main thread)"
    assert report["main_thread_per_gib"] == pytest.approx(0.25)
    assert report["processes_seen"] == 2


def test_cpu_report_with_no_bytes_has_no_rates() -> None:
    """Nothing moved: no per-GiB figure and no bound, rather than a division by zero."""
    report = cpu_report([], 0.5, 0)
    assert report["process_per_gib"] is None
    assert report["busiest_bound_gib_per_second"] is None


def test_scaling_sizes_parse_sorted_and_unique() -> None:
    """--scaling takes byte sizes in any order, each once, smallest first."""
    assert parse_sizes("2GiB, 1GiB,2GiB,512MiB") == [512 * 1024**2, GiB, 2 * GiB]


@pytest.mark.parametrize(
    ("text", "message"), [("1GiB,lots", "'lots' is not a size"), (" , ", "no sizes given")]
)
def test_scaling_sizes_say_what_is_wrong(text: str, message: str) -> None:
    """A bad --scaling value names the bad item and the form sizes take."""
    with pytest.raises(ValueError, match=message):
        parse_sizes(text)


def _hit_mode(agent_median: float, served: float) -> dict[str, float]:
    return {
        "calls": 5,
        "agent_median": agent_median,
        "agent_best": agent_median,
        "agent_first": agent_median,
        "client_median": agent_median * 2,
        "served_per_call": served,
    }


def _hit_targets(modes: dict[str, object]) -> dict[str, bool | None]:
    targets = judge_targets(
        {},
        HTTPS_ONLY,
        scaling={},
        hits={"modes": modes},
    )
    return {t.name: t.met for t in targets if t.name in (REFUSED, NO_S3)}


def test_no_s3_hit_that_still_reads_s3_misses_its_target() -> None:
    """A fast "no S3 call" hit that still read from S3 misses; a refused hit is judged on time."""
    verdicts = _hit_targets({REFUSED: _hit_mode(0.01, 0), NO_S3: _hit_mode(0.001, 2000)})
    assert verdicts == {REFUSED: True, NO_S3: False}
    verdicts = _hit_targets({REFUSED: _hit_mode(2.0, 0), NO_S3: _hit_mode(0.001, 0)})
    assert verdicts == {REFUSED: False, NO_S3: True}


def test_hit_modes_not_measured_are_not_judged() -> None:
    """A skipped mode (a build without the option) is n/a, with the reason kept."""
    targets = judge_targets(
        {},
        HTTPS_ONLY,
        scaling={},
        hits={"modes": {NO_S3: {"skipped": "no cached_only option"}}},
    )
    no_s3 = next(t for t in targets if t.name == NO_S3)
    assert no_s3.met is None
    assert no_s3.note == "no cached_only option"


def test_memory_sampler_reports_pss_summed_over_the_tree() -> None:
    """PSS is sampled too, and is no more than RSS over the same processes."""
    with RssSampler(os.getpid(), pss_every=1) as sampler:
        _ = bytearray(8 * MiB)
    report = sampler.to_json()
    assert 0 < report["sampled_peak_pss"] <= report["sampled_peak_rss"]
