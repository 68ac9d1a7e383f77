"""Seconds the interpreter lock is held per GiB, per process of the daemon (py-spy ``--gil``).

Threads of one Python process share one lock: however many cores a node has,
a process that holds its lock ``g`` seconds per GiB moves at most ``1 / g``
GiB/s. So each cold row gets one extra cold pull, not timed with the others,
with ``py-spy record --gil --subprocesses --nonblocking`` attached to the
daemon. In that mode py-spy keeps a sample only when some thread of the
process holds the lock, so a process's samples / the rate = seconds it held
its lock. With ``--subprocesses`` every stack starts with ``process PID:"argv"``
frames, the parents' first and its own last; the last one says whose lock it is.

``--nonblocking`` reads the daemon's memory without stopping it: at 500 Hz,
stopping every process would slow the pull it measures.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.client import Client
from agent.testing._process import read_until

from ._agent import running_agent
from ._contenders import Context
from ._model import BenchModel
from ._profile import install_py_spy
from ._rows import ColdRow
from ._sections import RESULTS, say
from ._stats import Sample

__all__ = [
    "GIL_RATE",
    "ProcessGil",
    "gil_cold_pull",
    "gil_report",
    "gil_samples",
    "measure_gil",
]

GiB = 1024**3
GIL_RATE = 500  # samples per second: 2 ms per sample
_PROCESS_FRAME = re.compile(r'process (\d+):"(.*?)";')
_READY = re.compile(rb"Sampling process")
_TOTALS = re.compile(r"Samples: (\d+) Errors: (\d+)")
_BEHIND = re.compile(r"behind in sampling")


@dataclass(frozen=True)
class ProcessGil:
    """One process's samples holding its interpreter lock."""

    pid: int
    argv: str
    samples: int


def gil_samples(raw: str, root_pid: int) -> dict[int, ProcessGil]:
    """Samples per process from py-spy's raw output (``stack count`` per line).

    A stack with no process frame (py-spy run without ``--subprocesses``) is
    the root's.
    """
    counts: Counter[int] = Counter()
    argvs: dict[int, str] = {root_pid: ""}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        pid = root_pid
        # Process frames lead the stack; the last of them is the sampled process.
        position = 0
        while match := _PROCESS_FRAME.match(stack, position):
            pid, argvs[pid] = int(match.group(1)), match.group(2)
            position = match.end()
        counts[pid] += int(count)
    return {pid: ProcessGil(pid, argvs.get(pid, ""), samples) for pid, samples in counts.items()}


def _label(process: ProcessGil, root_pid: int) -> str:
    if process.pid == root_pid:
        return f"daemon ({process.pid})"
    words = process.argv.split()
    if not words:
        return f"child {process.pid}"
    # "python -s -m agent.source.range_worker ..." -> "range_worker".
    module = words[words.index("-m") + 1] if "-m" in words[:-1] else Path(words[0]).name
    return f"child {process.pid} ({module.rsplit('.', 1)[-1]})"


def gil_report(
    processes: dict[int, ProcessGil], *, root_pid: int, nbytes: int, rate: int = GIL_RATE
) -> dict[str, Any]:
    """Seconds held per GiB for each process, the busiest one, its bound, and the daemon's own."""
    gib = nbytes / GiB
    ranked = sorted(processes.values(), key=lambda p: p.samples, reverse=True)
    rows: list[dict[str, Any]] = [
        {
            "process": _label(p, root_pid),
            "pid": p.pid,
            "samples": p.samples,
            "seconds": p.samples / rate,
            "per_gib": p.samples / rate / gib,
        }
        for p in ranked
    ]
    busiest = rows[0] if rows else None
    daemon = next((row for row in rows if row["pid"] == root_pid), None)
    busiest_per_gib = busiest["per_gib"] if busiest is not None else 0.0
    return {
        "rate": rate,
        "processes": rows,
        "busiest_process": busiest["process"] if busiest is not None else None,
        "busiest_per_gib": busiest_per_gib,
        # One lock, one holder at a time: its process cannot move bytes faster than this.
        "bound_gib_per_second": 1.0 / busiest_per_gib if busiest_per_gib else None,
        "daemon_per_gib": daemon["per_gib"] if daemon is not None else 0.0,
    }


def gil_cold_pull(
    ctx: Context, model: BenchModel, cold_row: ColdRow, *, py_spy: Path, output: Path
) -> dict[str, Any]:
    """One cold pull of ``cold_row`` with py-spy counting who holds which lock (JSON)."""
    with (
        running_agent(ctx, cold_row.plane, pinned=cold_row.pinned, source=cold_row.source) as agent,
        Client(agent.socket_path) as client,
    ):
        assert agent.pid is not None
        with _recording(py_spy, agent.pid, output) as notes:
            started = time.perf_counter()
            handle = client.ensure(model.uri, tier="shm")
            seconds = time.perf_counter() - started
        if handle.hit:
            raise RuntimeError(f"the cold pull of {model.uri} was a cache hit")
        processes = gil_samples(output.read_text(), agent.pid)
    report = gil_report(processes, root_pid=agent.pid, nbytes=handle.total_bytes)
    return report | {"pull_seconds": seconds, "bytes": handle.total_bytes} | notes


@contextlib.contextmanager
def _recording(py_spy: Path, pid: int, output: Path) -> Iterator[dict[str, Any]]:
    """py-spy ``--gil`` on ``pid`` and its descendants while the block runs; then its notes."""
    argv = [str(py_spy), "record", "--pid", str(pid), "--gil", "--subprocesses"]
    argv += ["--rate", str(GIL_RATE), "--nonblocking", "--format", "raw", "--output", str(output)]
    spy = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    notes: dict[str, Any] = {"raw": str(output)}
    started = time.perf_counter()
    try:
        # py-spy says so once it has found the interpreter and is sampling.
        read_until(spy, _READY, timeout=30.0)
        started = time.perf_counter()
        yield notes
    finally:
        # The idle moments around the pull add next to nothing: an idle daemon
        # waits in epoll, without its lock.
        notes["recording_seconds"] = time.perf_counter() - started
        spy.send_signal(signal.SIGINT)
        said = spy.communicate(timeout=60)[0].decode(errors="replace")
    if not output.exists():
        raise RuntimeError(f"py-spy wrote no profile: {said[-2000:]}")
    totals = _TOTALS.search(said)
    notes |= {
        # py-spy's own totals: the samples it wrote (what the counts sum to) and
        # failed reads (each a lost sample); a "behind" warning means it fell
        # more than a second behind its rate, so the seconds held are low.
        "py_spy_samples": int(totals.group(1)) if totals else None,
        "py_spy_errors": int(totals.group(2)) if totals else None,
        "py_spy_behind_warnings": len(_BEHIND.findall(said)),
    }


def measure_gil(
    cold_rows: Sequence[ColdRow],
    contexts: Mapping[str, Context],
    samples: Mapping[str, Sample],
    model: BenchModel,
) -> None:
    """An extra cold pull per measured cold row, under py-spy; its report goes in ``extra["gil"]``.

    A row whose timed runs failed is skipped; a py-spy failure is recorded in
    the row (``{"error": ...}``) and the next row still runs.
    """
    measured = [c for c in cold_rows if (s := samples.get(c.name)) is not None and s.ok]
    if not measured:
        return
    try:
        py_spy = install_py_spy(RESULTS.parent / ".cache")
    except Exception as exc:
        for cold_row in measured:
            samples[cold_row.name].extra["gil"] = {"error": f"{type(exc).__name__}: {exc}"}
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    for cold_row in measured:
        say(f"interpreter locks (py-spy --gil) during one more cold pull: {cold_row.name}")
        stamp = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
        slug = re.sub(r"[^a-z0-9]+", "-", cold_row.name.lower()).strip("-")
        output = RESULTS / f"gil-{slug}-{stamp}.txt"
        try:
            report = gil_cold_pull(
                contexts[cold_row.scheme], model, cold_row, py_spy=py_spy, output=output
            )
        except Exception as exc:
            report = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        samples[cold_row.name].extra["gil"] = report
