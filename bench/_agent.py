"""prewarm itself: the real daemon (``agent.testing.AgentProcess``) against the bench server.

Every cold run starts a fresh daemon on a fresh root under /dev/shm, so its
cache is empty and its memory counters start from its own start-up; peak RSS
is reset (``clear_refs``) once it serves, so ``VmHWM`` after the pull is the
pull's peak. A sampler also follows the daemon and any child processes it
starts, in case a data plane works in a child.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.client import Client, ModelHandle
from agent.testing import AgentProcess

from ._contenders import Context, RunResult, run_child
from ._model import BenchModel
from ._s3rver import cpu_seconds, cpu_split

__all__ = [
    "RssSampler",
    "agent_config",
    "cold_pull",
    "concurrent_cold_pulls",
    "fallocate_seconds",
    "hit_latency",
    "profile_cold_pull",
    "running_agent",
    "warm_launch",
]

KiB = 1024


def agent_config(ctx: Context, plane: str | None, *, pinned: bool = True) -> str:
    """The daemon's config for a run: the run's concurrency and chunk size, and a plane.

    ``pinned=False`` leaves both to the agent's own tuning (its defaults).
    """
    lines = ["[s3]"]
    if pinned:
        lines += [f"concurrency = {ctx.concurrency}", f"chunk_size = {ctx.chunk}"]
    if plane is not None:
        lines.append(f'data_plane = "{plane}"')
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def running_agent(
    ctx: Context, plane: str | None, *, pinned: bool = True, source: Path | None = None
) -> Iterator[AgentProcess]:
    """A fresh daemon on a fresh root (its shm tier on /dev/shm), removed afterwards.

    ``source``: run the ``agent`` package of another checkout instead (an A/B of
    two versions of the agent in one run).
    """
    root = Path(tempfile.mkdtemp(prefix="pw-", dir=ctx.scratch))
    env = ctx.server.env() | dict(ctx.agent_env)
    argv = None
    if source is not None:
        code = (
            f"import runpy, sys; sys.path.insert(0, {str(source)!r}); "
            "runpy.run_module('agent', run_name='__main__', alter_sys=True)"
        )
        argv = [sys.executable, "-c", code]
    agent = AgentProcess(
        env=env, root=root, config=agent_config(ctx, plane, pinned=pinned), argv=argv
    )
    try:
        agent.start()
        yield agent
    finally:
        try:
            agent.close()
        finally:
            _remove_tree(root)


def reported_plane(agent: AgentProcess) -> str:
    with Client(agent.socket_path) as client:
        return client.status().data_plane


class RssSampler:
    """Peak memory of a process and its children, read from /proc every few ms.

    Polling is fine here: this is the benchmark, not the agent. ``VmHWM`` (the
    kernel's own peak) is read too; it is exact but covers one process only.
    """

    def __init__(self, pid: int, interval: float = 0.005) -> None:
        self._pid = pid
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.peak_total = 0
        self.peak_anon = 0
        self.peak_shmem = 0
        self.peak_children = 0

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
        return _status_fields(self._pid).get("VmHWM", 0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def _sample(self) -> None:
        total = anon = shmem = children = 0
        for pid in [self._pid, *_descendants(self._pid)]:
            fields = _status_fields(pid)
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
            "sampled_peak_rss": self.peak_total,
            "sampled_peak_anon": self.peak_anon,
            "sampled_peak_shmem": self.peak_shmem,
            "sampled_peak_children": self.peak_children,
        }


def cold_pull(
    ctx: Context,
    model: BenchModel,
    plane: str | None,
    *,
    pinned: bool = True,
    source: Path | None = None,
) -> RunResult:
    """One cold pull of ``model`` by one client into the shm tier of a fresh daemon."""
    with (
        running_agent(ctx, plane, pinned=pinned, source=source) as agent,
        Client(agent.socket_path) as client,
    ):
        assert agent.pid is not None
        served = ctx.server.bytes_sent()
        server_cpu = ctx.server.cpu_seconds()
        agent_cpu = cpu_seconds(agent.pid)
        user, system = cpu_split(agent.pid)
        baseline = _status_fields(agent.pid).get("VmRSS", 0)
        vmstat = _vmstat()
        with RssSampler(agent.pid) as sampler:
            started = time.perf_counter()
            handle = client.ensure(model.uri, tier="shm")
            seconds = time.perf_counter() - started
        result = RunResult(
            seconds=seconds,
            nbytes=handle.total_bytes,
            client_cpu=cpu_seconds(agent.pid) - agent_cpu,
            server_cpu=ctx.server.cpu_seconds() - server_cpu,
            served=ctx.server.bytes_sent() - served,
            extra={
                "agent_user_cpu": cpu_split(agent.pid)[0] - user,
                "agent_system_cpu": cpu_split(agent.pid)[1] - system,
                # Page reclaim during the pull, machine-wide: the tier, the server's
                # page cache and everything else share the RAM.
                "reclaim": _vmstat_delta(vmstat),
                "mem_available_after": _meminfo("MemAvailable"),
                "plane": client.status().data_plane,
                "hit": handle.hit,
                "rss_before_pull": baseline,
                **sampler.to_json(),
                **_timings(handle),
            },
        )
    if handle.hit:
        raise RuntimeError(f"the cold pull of {model.uri} was a cache hit")
    return result


def concurrent_cold_pulls(
    ctx: Context, model: BenchModel, plane: str | None, clients: int
) -> RunResult:
    """``clients`` clients ask a fresh daemon for the same cold model at the same moment."""
    with running_agent(ctx, plane) as agent:
        assert agent.pid is not None
        barrier = threading.Barrier(clients + 1)
        handles: list[ModelHandle | BaseException] = []
        finished: list[float] = []
        lock = threading.Lock()

        def one() -> None:
            with Client(agent.socket_path) as client:
                barrier.wait()
                try:
                    handle: ModelHandle | BaseException = client.ensure(model.uri, tier="shm")
                except Exception as exc:
                    handle = exc
                with lock:
                    handles.append(handle)
                    finished.append(time.perf_counter())

        threads = [threading.Thread(target=one, name=f"client-{i}") for i in range(clients)]
        for thread in threads:
            thread.start()
        served = ctx.server.bytes_sent()
        server_cpu = ctx.server.cpu_seconds()
        agent_cpu = cpu_seconds(agent.pid)
        own_cpu = time.process_time()
        with RssSampler(agent.pid) as sampler:
            barrier.wait()
            started = time.perf_counter()
            for thread in threads:
                thread.join()
        own_cpu = time.process_time() - own_cpu
        errors = [h for h in handles if isinstance(h, BaseException)]
        if errors:
            raise RuntimeError(f"{len(errors)} of {clients} clients failed: {errors[0]!r}")
        good = [h for h in handles if isinstance(h, ModelHandle)]
        paths = {h.path for h in good}
        return RunResult(
            seconds=max(finished) - started,
            nbytes=model.total_bytes,
            client_cpu=cpu_seconds(agent.pid) - agent_cpu,
            server_cpu=ctx.server.cpu_seconds() - server_cpu,
            served=ctx.server.bytes_sent() - served,
            extra={
                "clients": clients,
                "distinct_paths": len(paths),
                "first_done": min(finished) - started,
                "hits": sum(h.hit for h in good),
                # The clients run in this process, on the same two cores.
                "clients_cpu": own_cpu,
                **sampler.to_json(),
            },
        )


def warm_launch(ctx: Context, agent: AgentProcess, model: BenchModel) -> RunResult:
    """A new process: EnsureModel (a hit), load_safetensors, and a read of every page."""
    argv = [sys.executable, "-m", "bench._worker", "warm"]
    argv += ["--socket", str(agent.socket_path), model.uri]
    child = run_child(ctx, argv, ctx.child_env())
    import json

    report: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    if not report["hit"]:
        raise RuntimeError(f"the warm launch of {model.uri} was not a cache hit")
    return RunResult(
        seconds=float(report["seconds"]),
        nbytes=int(report["bytes"]),
        client_cpu=child.cpu,
        served=child.served,
        extra={k: v for k, v in report.items() if k not in ("seconds", "bytes")},
    )


@dataclass(frozen=True)
class HitCost:
    ensure_best: float
    ensure_median: float
    served_per_call: float


def hit_latency(ctx: Context, agent: AgentProcess, model: BenchModel, calls: int) -> HitCost:
    """EnsureModel on a cached model, ``calls`` times from one client."""
    times: list[float] = []
    with Client(agent.socket_path) as client:
        client.ensure(model.uri)  # pulled before, or pulled now
        served = ctx.server.bytes_sent()
        for _ in range(calls):
            started = time.perf_counter()
            handle = client.ensure(model.uri)
            times.append(time.perf_counter() - started)
            if not handle.hit:
                raise RuntimeError(f"EnsureModel({model.uri}) on a cached model was not a hit")
        served_per_call = (ctx.server.bytes_sent() - served) / calls
    times.sort()
    return HitCost(times[0], times[len(times) // 2], served_per_call)


def profile_cold_pull(
    ctx: Context, model: BenchModel, plane: str | None, py_spy: Path, output: Path
) -> dict[str, Any]:
    """A cold pull with py-spy sampling the daemon; returns where its CPU went."""
    with running_agent(ctx, plane) as agent, Client(agent.socket_path) as client:
        assert agent.pid is not None
        argv = [str(py_spy), "record", "--pid", str(agent.pid), "--rate", "250"]
        argv += ["--format", "raw", "--output", str(output), "--nonblocking", "--subprocesses"]
        spy = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            # py-spy attaches within a few ms; give it the moment it needs to
            # read the interpreter's state before the bytes start to move.
            time.sleep(1.0)
            started = time.perf_counter()
            client.ensure(model.uri, tier="shm")
            seconds = time.perf_counter() - started
        finally:
            spy.send_signal(signal.SIGINT)
            out, _ = spy.communicate(timeout=60)
    if not output.exists():
        raise RuntimeError(f"py-spy wrote no profile: {out.decode(errors='replace')[-2000:]}")
    return {"seconds": seconds, **summarize_profile(output)}


def fallocate_seconds(scratch: Path, model: BenchModel) -> float:
    """What reserving the model's files with posix_fallocate costs on this tmpfs, alone.

    The staging code reserves every file's blocks before the first GET; on
    tmpfs that allocates and zero-fills every page, which the pull then
    overwrites.
    """
    directory = Path(tempfile.mkdtemp(prefix="fallocate-", dir=scratch))
    try:
        started = time.perf_counter()
        for index, (_, size) in enumerate(model.objects):
            fd = os.open(directory / str(index), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if size:
                    os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        return time.perf_counter() - started
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def summarize_profile(path: Path, top: int = 15) -> dict[str, Any]:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks."""
    self_counts: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    threads: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        threads[frames[0]] = threads.get(frames[0], 0) + count
        leaf = _function(frames[-1])
        self_counts[leaf] = self_counts.get(leaf, 0) + count
        for name in {_function(frame) for frame in frames[1:]}:
            inclusive[name] = inclusive.get(name, 0) + count

    def shares(counts: dict[str, int]) -> list[tuple[str, float]]:
        ranked = sorted(counts.items(), key=lambda item: item[1], reverse=True)[:top]
        return [(name, count / total) for name, count in ranked]

    return {
        "samples": total,
        "self": shares(self_counts),
        "inclusive": shares(inclusive),
        "threads": shares(threads),
    }


def install_py_spy(cache: Path) -> Path:
    """py-spy from PyPI into a bench-local directory, once."""
    target = cache / "py-spy"
    binary = target / "bin" / "py-spy"
    if binary.exists():
        return binary
    argv = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target), "py-spy"]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not binary.exists():
        raise RuntimeError(f"pip install py-spy failed:\n{result.stderr[-2000:]}")
    return binary


def _function(frame: str) -> str:
    # py-spy raw frames look like "read (aiohttp/streams.py:123)"; drop the line.
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    filename = where.rsplit(":", 1)[0]
    short = "/".join(filename.split("/")[-2:])
    return f"{name} ({short})" if short else name


def _timings(handle: ModelHandle) -> dict[str, float]:
    t = handle.timings
    return {
        "resolve": t.resolve,
        "wait": t.wait,
        "download": t.download,
        "verify": t.verify,
        "publish": t.publish,
        "agent_total": t.total,
        # In no phase: setting up the staging files (posix_fallocate of every
        # file) between the resolve and the first GET.
        "outside_phases": t.total - (t.resolve + t.wait + t.download + t.verify + t.publish),
    }


def _status_fields(pid: int) -> dict[str, int]:
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


def _vmstat() -> dict[str, int]:
    counters: dict[str, int] = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if name in _RECLAIM_COUNTERS:
            counters[name] = int(value)
    return counters


def _vmstat_delta(before: dict[str, int]) -> dict[str, int]:
    after = _vmstat()
    return {name: after[name] - before.get(name, 0) for name in after}


def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * KiB
    return 0


def _descendants(pid: int) -> list[int]:
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


def _remove_tree(path: Path) -> None:
    if not path.exists():
        return
    for directory, _, _ in os.walk(path):
        with contextlib.suppress(OSError):
            Path(directory).chmod(0o700)
    shutil.rmtree(path, ignore_errors=True)
