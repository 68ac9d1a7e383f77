"""prewarm itself: the real daemon (``agent.testing.AgentProcess``) against the bench server.

Every cold run starts a fresh daemon on a fresh root under /dev/shm, so its
cache is empty and its memory counters start from its own start-up; peak RSS
is reset (``clear_refs``) once it serves, so ``VmHWM`` after the pull is the
pull's peak.

The daemon is measured as a process tree: a data plane may move the bytes in
child processes (the ``processes`` plane's range workers), so its CPU is the
daemon's and every descendant's (``ThreadCpu``), and its memory is summed over
the tree (RSS, and PSS, which counts a page its processes share once). The
daemon's own CPU and ``VmHWM`` are kept beside the tree's.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.client import Client, ModelHandle
from agent.testing import AgentProcess

from ._contenders import Context, RunResult, run_child
from ._model import BenchModel
from ._system import (
    RssSampler,
    cpu_seconds,
    cpu_split,
    meminfo,
    reclaim_counters,
    reclaim_since,
    status_fields,
)
from ._threads import ThreadCpu

__all__ = [
    "agent_config",
    "cold_pull",
    "concurrent_cold_pulls",
    "reported_plane",
    "running_agent",
    "warm_launch",
]


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
    env = ctx.server.env() | dict(ctx.agent_env)
    argv = None
    if source is not None:
        code = (
            f"import runpy, sys; sys.path.insert(0, {str(source)!r}); "
            "runpy.run_module('agent', run_name='__main__', alter_sys=True)"
        )
        argv = [sys.executable, "-c", code]
    config = agent_config(ctx, plane, pinned=pinned)
    with AgentProcess(env=env, parent=ctx.scratch, config=config, argv=argv) as agent:
        yield agent


def reported_plane(agent: AgentProcess) -> str:
    """The data plane the running daemon says it uses."""
    with Client(agent.socket_path) as client:
        return client.status().data_plane


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
        baseline = status_fields(agent.pid).get("VmRSS", 0)
        reclaim = reclaim_counters()
        with RssSampler(agent.pid) as sampler, ThreadCpu(agent.pid) as threads:
            started = time.perf_counter()
            handle = client.ensure(model.uri, tier="shm")
            seconds = time.perf_counter() - started
        result = RunResult(
            seconds=seconds,
            nbytes=handle.total_bytes,
            client_cpu=threads.process_seconds(),
            server_cpu=ctx.server.cpu_seconds() - server_cpu,
            served=ctx.server.bytes_sent() - served,
            extra={
                # The daemon's process alone (its workers left out): user and system.
                "daemon_cpu": cpu_seconds(agent.pid) - agent_cpu,
                "agent_user_cpu": cpu_split(agent.pid)[0] - user,
                "agent_system_cpu": cpu_split(agent.pid)[1] - system,
                # Page reclaim during the pull, machine-wide: the tier, the server's
                # page cache and everything else share the RAM.
                "reclaim": reclaim_since(reclaim),
                "mem_available_after": meminfo("MemAvailable"),
                "plane": client.status().data_plane,
                "hit": handle.hit,
                "rss_before_pull": baseline,
                "cpu": threads.to_json(handle.total_bytes),
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
        own_cpu = time.process_time()
        with RssSampler(agent.pid) as sampler, ThreadCpu(agent.pid) as daemon_threads:
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
            client_cpu=daemon_threads.process_seconds(),
            server_cpu=ctx.server.cpu_seconds() - server_cpu,
            served=ctx.server.bytes_sent() - served,
            extra={
                "clients": clients,
                "distinct_paths": len(paths),
                "first_done": min(finished) - started,
                "hits": sum(h.hit for h in good),
                # The clients run in this process, on the same two cores.
                "clients_cpu": own_cpu,
                "cpu": daemon_threads.to_json(model.total_bytes),
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
