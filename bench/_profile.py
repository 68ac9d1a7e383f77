"""Where the daemon's CPU goes during a cold pull: py-spy, and the cost of fallocate alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agent.client import Client
from agent.testing._process import purge_tree

from ._agent import running_agent
from ._contenders import Context
from ._model import BenchModel

__all__ = ["fallocate_seconds", "install_py_spy", "profile_cold_pull", "summarize_profile"]


def profile_cold_pull(
    ctx: Context, model: BenchModel, plane: str | None, *, py_spy: Path, output: Path
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
    """py-spy: the one beside this interpreter (the dev virtualenv's), else from PyPI, once."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.exists():
        return beside
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
        purge_tree(directory)
