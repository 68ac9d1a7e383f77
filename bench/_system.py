"""What /proc says about the benchmark's processes and the machine they run on.

CPU seconds and bytes written per process, memory peaks of a process and its
children, page reclaim, and the machine's description for the report.
Polling /proc is fine here: this is the benchmark, not the agent.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = [
    "RssSampler",
    "cpu_seconds",
    "cpu_split",
    "descendants",
    "machine",
    "meminfo",
    "proc_io",
    "pss",
    "reclaim_counters",
    "reclaim_since",
    "status_fields",
]

KiB = 1024
GiB = 1024**3


class RssSampler:
    """Peak memory of a process and its children, read from /proc every few ms.

    Polling is fine here: this is the benchmark, not the agent. ``VmHWM`` (the
    kernel's own peak) is read too; it is exact but covers one process only.

    RSS summed over a tree counts a page shared by several processes (the
    interpreter and libraries a worker inherits, a mapping of the same file)
    once per process; PSS (``smaps_rollup``) splits each shared page between
    its sharers, so the sum over the tree is what the tree really holds. The
    kernel walks every mapping to answer ``smaps_rollup``, so it is read every
    ``pss_every``-th sample only.

    Every sample reads a file per thread of the tree (to find its children) on
    the same cores as the pull it measures: every 25 ms, not 5, or a daemon with
    a hundred threads pays the observer several times what s5cmd does.
    """

    def __init__(self, pid: int, interval: float = 0.025, pss_every: int = 20) -> None:
        self._pid = pid
        self._interval = interval
        self._pss_every = pss_every
        self._samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.peak_total = 0
        self.peak_anon = 0
        self.peak_shmem = 0
        self.peak_children = 0
        self.peak_pss = 0

    def __enter__(self) -> RssSampler:
        # Reset the kernel's peak so VmHWM covers only what follows.
        with contextlib.suppress(OSError):
            Path(f"/proc/{self._pid}/clear_refs").write_text("5")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def vm_hwm(self) -> int:
        return status_fields(self._pid).get("VmHWM", 0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def _sample(self) -> None:
        pids = [self._pid, *descendants(self._pid)]
        if self._samples % self._pss_every == 0:
            self.peak_pss = max(self.peak_pss, sum(pss(pid) for pid in pids))
        self._samples += 1
        total = anon = shmem = children = 0
        for pid in pids:
            fields = status_fields(pid)
            total += fields.get("VmRSS", 0)
            anon += fields.get("RssAnon", 0)
            shmem += fields.get("RssShmem", 0)
            if pid != self._pid:
                children += fields.get("VmRSS", 0)
        self.peak_total = max(self.peak_total, total)
        self.peak_anon = max(self.peak_anon, anon)
        self.peak_shmem = max(self.peak_shmem, shmem)
        self.peak_children = max(self.peak_children, children)

    def to_json(self) -> dict[str, int]:
        return {
            "vm_hwm": self.vm_hwm,
            # Summed over the process and its descendants.
            "sampled_peak_rss": self.peak_total,
            "sampled_peak_pss": self.peak_pss,
            "sampled_peak_anon": self.peak_anon,
            "sampled_peak_shmem": self.peak_shmem,
            "sampled_peak_children": self.peak_children,
        }


def pss(pid: int) -> int:
    """The process's proportional set size in bytes (0 if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * KiB
    return 0


def status_fields(pid: int) -> dict[str, int]:
    """The memory lines of /proc/<pid>/status in bytes (empty if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[name] = int(parts[0]) * KiB
    return fields


_RECLAIM_COUNTERS = (
    "allocstall_normal",
    "allocstall_movable",
    "pgscan_direct",
    "pgsteal_direct",
    "pgscan_kswapd",
    "pgsteal_kswapd",
    "compact_stall",
)


def reclaim_counters() -> dict[str, int]:
    """The kernel's page-reclaim and compaction counters (/proc/vmstat), machine-wide."""
    counters: dict[str, int] = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if name in _RECLAIM_COUNTERS:
            counters[name] = int(value)
    return counters


def reclaim_since(before: dict[str, int]) -> dict[str, int]:
    """How much each reclaim counter grew since ``before``."""
    after = reclaim_counters()
    return {name: after[name] - before.get(name, 0) for name in after}


def meminfo(field: str) -> int:
    """One /proc/meminfo field in bytes (0 if absent)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * KiB
    return 0


def descendants(pid: int) -> list[int]:
    """Every live descendant pid of ``pid`` (children, their children, ...)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            tasks = list(Path(f"/proc/{current}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in children:
                found.append(int(child))
                pending.append(int(child))
    return found


def proc_io(pid: int) -> dict[str, int]:
    """The I/O counters of /proc/<pid>/io (rchar, wchar, ...)."""
    text = Path(f"/proc/{pid}/io").read_text()
    return {name: int(value) for name, value in (line.split(": ") for line in text.splitlines())}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used."""
    user, system = cpu_split(pid)
    return user + system


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds a live process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # fields[11], fields[12]: utime, stime (the 14th and 15th of the whole line).
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def machine() -> dict[str, Any]:
    """The machine the run is on, for the report: CPU, memory, /dev/shm, tool versions."""
    meminfo = Path("/proc/meminfo").read_text().split()
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    shm = shutil.disk_usage("/dev/shm")
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model,
        "memory_gib": round(int(meminfo[meminfo.index("MemTotal:") + 1]) / 1024**2, 1),
        "dev_shm_gib": round(shm.total / GiB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "node": _version(["node", "--version"]),
        "curl": _version(["curl", "--version"]).split(" (")[0],
        "s5cmd": _version([str(Path(sys.executable).parent / "s5cmd"), "version"]),
    }


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    except OSError:
        return "missing"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "?"
