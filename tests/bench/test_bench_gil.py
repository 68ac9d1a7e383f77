"""The bench's interpreter-lock columns: how py-spy's raw ``--gil`` output is read.

py-spy itself and the daemon are exercised by the benchmark run; these pin
whose lock each sample is and the arithmetic of the report.
"""

from __future__ import annotations

import pytest

from bench._gil import gil_report, gil_samples

GiB = 1024**3

# Two stacks of the daemon (pid 100), two of a range worker (pid 200) whose
# stacks start with its parent's process frame; the daemon's argv holds "; ".
_DAEMON = "process 100:\"python -c import runpy; runpy.run_module('agent')\""
_WORKER = 'process 200:"python -s -m agent.source.range_worker --control-fd 7"'
RAW = "\n".join(
    [
        f"{_DAEMON};_run_once (asyncio/base_events.py:1922) 30",
        f"{_DAEMON};presign (agent/source/s3.py:170) 10",
        f"{_DAEMON};{_WORKER};recv_into (ssl.py:1314) 70",
        f"{_DAEMON};{_WORKER};_get (agent/source/range_worker.py:320) 5",
    ]
)


def test_samples_go_to_the_last_process_frame_of_each_stack() -> None:
    """A worker's samples are its own, though its stacks start with the daemon's frame."""
    processes = gil_samples(RAW, root_pid=100)
    assert {pid: p.samples for pid, p in processes.items()} == {100: 40, 200: 75}
    assert "range_worker" in processes[200].argv


def test_stacks_without_process_frames_are_the_roots() -> None:
    """Raw output recorded without --subprocesses counts for the process attached to."""
    processes = gil_samples("main (x.py:1) 12\nother (x.py:2) 3\n", root_pid=7)
    assert processes[7].samples == 15


def test_report_names_the_busiest_process_and_the_bound_it_gives() -> None:
    """Samples / rate = seconds held; the busiest process's s/GiB bounds the daemon."""
    report = gil_report(gil_samples(RAW, root_pid=100), root_pid=100, nbytes=GiB // 2, rate=500)
    assert report["busiest_process"] == "child 200 (range_worker)"
    assert report["busiest_per_gib"] == pytest.approx(75 / 500 * 2)
    assert report["bound_gib_per_second"] == pytest.approx(1 / 0.3)
    assert report["daemon_per_gib"] == pytest.approx(40 / 500 * 2)


def test_a_daemon_that_never_held_its_lock_has_no_bound() -> None:
    """No sample at all: zero seconds held, and no bound rather than a division by zero."""
    report = gil_report({}, root_pid=1, nbytes=GiB)
    assert report["busiest_per_gib"] == 0.0
    assert report["bound_gib_per_second"] is None
