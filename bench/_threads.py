"""CPU per thread of a process and its descendants, from ``/proc/<pid>/task/*/stat``.

A cold pull's cost has two bounds: the CPU the whole process spends per GiB
(what it takes from a shared node) and the CPU its busiest thread spends per
GiB (one thread can never go faster than one core, so ``1 / that`` is the
GiB/s the design cannot pass however many cores the node has). The main
thread of the process watched is reported apart: in the daemon it runs the
asyncio event loop, which must stay off the byte path.

``ThreadCpu`` samples every thread at the start, every ``interval`` while the
measured work runs, and at the end: a thread that starts after the start counts
from zero, a thread that ends before the end counts up to its last sample.
What the samples cannot see (a thread's last few ms before it exited) is
reported as ``unattributed``: the process total (which the kernel keeps for
exited threads too, in 10 ms ticks) minus the sum over threads (each from
``schedstat``, in ns, where the kernel has it). A sampler watching its own
process (a ``bench._worker`` timing itself) leaves its own thread out and names
threads by their Python names too. Polling /proc is fine here: this is the
benchmark, not the agent.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

__all__ = ["ThreadCpu", "ThreadUse", "process_cpu", "read_tasks"]

GiB = 1024**3
_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ThreadUse:
    """CPU seconds one thread spent in the measured window."""

    pid: int
    tid: int
    comm: str
    seconds: float
    # The Python thread's name, when the sampler runs in the same process.
    name: str = ""
    # In a descendant of the process watched (a worker process), not in it.
    child: bool = False

    @property
    def is_main(self) -> bool:
        """The main thread of the process watched (in the daemon: its event loop)."""
        return self.tid == self.pid and not self.child

    @property
    def label(self) -> str:
        """The kernel's name for the thread (its comm), and the Python name or the tid.

        A worker process's threads say whose they are: every Python process
        has a "main thread", and only the watched one's runs the daemon's loop.
        """
        if self.child:
            where = "main thread" if self.tid == self.pid else (self.name or str(self.tid))
            return f"{self.comm} (child {self.pid}: {where})"
        if self.tid == self.pid:
            return f"{self.comm} (main thread)"
        return f"{self.comm} ({self.name or self.tid})"


def _stat_fields(path: Path) -> tuple[str, list[str]] | None:
    try:
        text = path.read_text()
    except OSError:
        return None  # the task exited between the listing and the read
    # comm sits between the first "(" and the last ")" and may hold spaces or ")".
    head, _, rest = text.rpartition(")")
    return head.partition("(")[2], rest.split()


def read_tasks(pid: int) -> dict[int, tuple[str, float]]:
    """Every live thread of ``pid``: tid -> (comm, CPU seconds on the CPU so far)."""
    tasks: dict[int, tuple[str, float]] = {}
    for tid in _listdir_ints(f"/proc/{pid}/task"):
        parsed = _stat_fields(Path(f"/proc/{pid}/task/{tid}/stat"))
        seconds = _thread_seconds(pid, tid)
        if parsed is not None and seconds is not None:
            tasks[tid] = (parsed[0], seconds)
    return tasks


def _thread_seconds(pid: int, tid: int) -> float | None:
    # schedstat's first field is the thread's time on a CPU in ns: exact, where
    # stat's utime + stime count 10 ms ticks, too coarse for short-lived threads.
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        pass  # a kernel without schedstats: fall back to the ticks
    parsed = _stat_fields(Path(f"/proc/{pid}/task/{tid}/stat"))
    return None if parsed is None else (int(parsed[1][11]) + int(parsed[1][12])) / _TICKS


def process_cpu(pid: int) -> float | None:
    """User + system seconds of a whole process, exited threads and reaped children included."""
    parsed = _stat_fields(Path(f"/proc/{pid}/stat"))
    if parsed is None:
        return None
    fields = parsed[1]
    # utime, stime, cutime, cstime: the 14th to 17th fields of the line.
    return sum(int(value) for value in fields[11:15]) / _TICKS


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    pending = [pid]
    while pending:
        current = pending.pop()
        for tid in _listdir_ints(f"/proc/{current}/task"):
            try:
                children = Path(f"/proc/{current}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            found += map(int, children)
            pending += map(int, children)
    return found


def _listdir_ints(path: str) -> list[int]:
    try:
        return [int(entry.name) for entry in Path(path).iterdir()]
    except OSError:
        return []


class ThreadCpu:
    """CPU per thread of ``pid`` (and its descendants) between ``__enter__`` and ``__exit__``.

    ``exclude``: thread ids left out (a sampler measuring its own process
    leaves itself out). ``follow_children=False`` watches ``pid`` alone.

    Each sample reads one file per thread watched, on the cores the work runs
    on: every 100 ms (a thread that exits between samples loses at most that
    much of its CPU), so watching a tree of a hundred threads stays cheap.
    """

    def __init__(
        self,
        pid: int,
        *,
        interval: float = 0.1,
        exclude: frozenset[int] = frozenset(),
        follow_children: bool = True,
    ) -> None:
        self._pid = pid
        self._interval = interval
        self._exclude = set(exclude)
        # When watching its own process, the sampler's CPU is its own, not the work's.
        self._own_seconds = 0.0
        self._follow_children = follow_children
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="thread-cpu", daemon=True)
        self._lock = threading.Lock()
        # (pid, tid) -> comm, CPU seconds at the start (0 for threads born later), latest
        self._first: dict[tuple[int, int], float] = {}
        self._last: dict[tuple[int, int], tuple[str, float]] = {}
        self._names: dict[int, str] = {}
        self._process_first: dict[int, float] = {}
        self._process_last: dict[int, float] = {}
        self._alive: set[int] = set()
        self._started = False

    def __enter__(self) -> Self:
        self._sample()
        with self._lock:
            self._first = {key: seconds for key, (_, seconds) in self._last.items()}
            self._process_first = dict(self._process_last)
            self._started = True
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        own_tid = threading.get_native_id()
        own_start = _thread_seconds(self._pid, own_tid)
        if own_start is not None:
            self._exclude.add(own_tid)
        while not self._stop.wait(self._interval):
            self._sample()
        own_end = _thread_seconds(self._pid, own_tid)
        if own_start is not None and own_end is not None:
            self._own_seconds = own_end - own_start

    def _pids(self) -> list[int]:
        return [self._pid, *(_descendants(self._pid) if self._follow_children else [])]

    def _sample(self) -> None:
        alive: set[int] = set()
        if self._pid == os.getpid():
            names = {t.native_id: t.name for t in threading.enumerate() if t.native_id}
            with self._lock:
                self._names.update(names)
        for pid in self._pids():
            tasks = read_tasks(pid)
            total = process_cpu(pid)
            with self._lock:
                for tid, (comm, seconds) in tasks.items():
                    if tid in self._exclude:
                        continue
                    self._last[(pid, tid)] = (comm, seconds)
                    if self._started:
                        self._first.setdefault((pid, tid), 0.0)
                if total is not None:
                    alive.add(pid)
                    self._process_last[pid] = total
                    if self._started:
                        self._process_first.setdefault(pid, 0.0)
        with self._lock:
            self._alive = alive

    def threads(self) -> list[ThreadUse]:
        """Every thread seen, busiest first."""
        with self._lock:
            uses = [
                ThreadUse(
                    pid,
                    tid,
                    comm,
                    max(0.0, seconds - self._first.get((pid, tid), 0.0)),
                    self._names.get(tid, "") if pid == os.getpid() else "",
                    child=pid != self._pid,
                )
                for (pid, tid), (comm, seconds) in self._last.items()
            ]
        return sorted(uses, key=lambda use: use.seconds, reverse=True)

    def process_seconds(self) -> float:
        """CPU of the processes watched over the window (the root's reaped children included).

        Only processes alive at the last sample count: a descendant that
        exited was reaped into a watched parent's ``cutime``, counted there.
        """
        with self._lock:
            total = sum(
                max(0.0, last - self._process_first.get(pid, 0.0))
                for pid, last in self._process_last.items()
                if pid in self._alive
            )
        return max(0.0, total - self._own_seconds)

    def to_json(self, nbytes: int, *, process_seconds: float | None = None, top: int = 5) -> Any:
        """The window's CPU: whole, per GiB, the busiest thread and the bound it sets.

        ``process_seconds``: the caller's exact figure for the whole (a child's
        rusage) when it has one; otherwise the sum of /proc's per-process totals.
        """
        return cpu_report(
            self.threads(),
            self.process_seconds() if process_seconds is None else process_seconds,
            nbytes,
            top=top,
        )


def cpu_report(
    threads: list[ThreadUse], process_seconds: float, nbytes: int, *, top: int = 5
) -> Any:
    """The JSON the report reads: CPU-s per GiB of the whole, the busiest and the main thread.

    "process" is the whole tree watched: the process and its descendants.
    """
    gib = nbytes / GiB if nbytes else 0.0
    busiest = threads[0] if threads else None
    main = next((t for t in threads if t.is_main), None)
    per_gib = process_seconds / gib if gib else None
    busiest_per_gib = busiest.seconds / gib if busiest is not None and gib else None
    return {
        "process_seconds": process_seconds,
        "process_per_gib": per_gib,
        "processes_seen": len({t.pid for t in threads}),
        "threads_seen": len(threads),
        # The daemon's main thread runs its asyncio loop: what must stay off the byte path.
        "main_thread_seconds": main.seconds if main is not None else None,
        "main_thread_per_gib": main.seconds / gib if main is not None and gib else None,
        "unattributed": process_seconds - sum(t.seconds for t in threads),
        "busiest_thread": busiest.label if busiest is not None else None,
        "busiest_seconds": busiest.seconds if busiest is not None else None,
        "busiest_per_gib": busiest_per_gib,
        # One thread runs on one core at most: it cannot move more than this.
        "busiest_bound_gib_per_second": 1.0 / busiest_per_gib if busiest_per_gib else None,
        "top_threads": [
            {"thread": t.label, "comm": t.comm, "tid": t.tid, "seconds": t.seconds}
            for t in threads[:top]
        ],
    }
