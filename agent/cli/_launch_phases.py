"""Where an engine's start-up went, read from its own log lines as they pass through.

A relaunch that is ready in 54 s instead of 140 s still leaves an operator asking
where the 54 s go: loading weights, torch.compile (compiled or loaded from the
cache), the KV cache's profiling and the warm-up, or process start-up. The engine
says most of it itself; ``LaunchLog`` lets its stdout and stderr through to this
process's own, byte for byte, and keeps the few numbers it prints:

- vLLM 0.16: ``Loading weights took 1.21 seconds`` (``Model loading took … and
  X seconds`` where a loader prints no line of its own), ``torch.compile takes
  12.03 s in total`` (``Directly load the compiled graph`` when it came from the
  cache), ``init engine (profile, create kv cache, warmup model) took 28.1
  seconds`` (which holds the compile: the profiling run is the first forward).

The phases (agent._vocabulary.LAUNCH_PHASES) are ``ready`` (the child's start to
ready), ``weights``, ``compile``, ``kv_cache_and_warmup`` (init engine less the
compile) and ``start_and_rest`` (ready less model loading and init engine:
interpreter and import time, the API server). An engine that prints none of
these lines gets ``ready`` alone. The output is read in a thread per stream that
never stops reading (a closed terminal drops the output, never blocks the engine).
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO

__all__ = ["LaunchLog", "describe_phases"]

_NUMBER = r"(\d{1,7}(?:\.\d{1,9})?)"
_WEIGHTS = re.compile(rf"Loading weights took {_NUMBER} seconds")
_MODEL_LOAD = re.compile(rf"Model loading took [\d.]+ GiB(?: memory)? and {_NUMBER} seconds")
_COMPILE = re.compile(rf"torch\.compile takes {_NUMBER} s in total")
_COMPILE_LOADED = re.compile(r"Directly load the compiled graph")
_INIT_ENGINE = re.compile(
    rf"init engine \(profile, create kv cache, warmup model\) took {_NUMBER} seconds"
)
_MARKS: dict[str, re.Pattern[str]] = {
    "weights": _WEIGHTS,
    "model_load": _MODEL_LOAD,
    "compile": _COMPILE,
    "init_engine": _INIT_ENGINE,
}
# A line longer than this is cut before it is searched (the bytes still pass through).
_MAX_LINE = 4096
_READ_SIZE = 64 * 1024
# How long to wait for the output threads once the child is gone: a grandchild that
# keeps the pipe open must not hold this launcher.
_DRAIN_SECONDS = 2.0
_SHOWN = {
    "weights": "weights",
    "compile": "compile",
    "kv_cache_and_warmup": "KV cache and warm-up",
    "start_and_rest": "start-up and the rest",
}


class LaunchLog:
    """The child's output on its way to this process's stdout and stderr, read for phases."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self._marks: dict[str, float] = {}
        self.compile_loaded = False
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, child: subprocess.Popen[bytes]) -> None:
        """Start passing on the output of ``child`` (started with both streams piped), as
        it starts: its time counts from now."""
        self._started = self._clock()
        for stream, target in ((child.stdout, 1), (child.stderr, 2)):
            if stream is not None:
                thread = threading.Thread(
                    target=self._pass_on, args=(stream, target), name="prewarm output", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def drain(self) -> None:
        """Let the last of the output through, once the child has exited (bounded)."""
        deadline = time.monotonic() + _DRAIN_SECONDS
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def elapsed(self) -> float:
        """Seconds since the child started."""
        return self._clock() - self._started

    def phases(self, ready: float) -> dict[str, float]:
        """Where the ``ready`` seconds went, as far as the engine said (LAUNCH_PHASES)."""
        with self._lock:
            marks = dict(self._marks)
        phases = {"ready": ready}
        loading = marks.get("weights", marks.get("model_load"))
        if loading is not None:
            phases["weights"] = loading
        if "compile" in marks:
            phases["compile"] = marks["compile"]
        if "init_engine" in marks:
            phases["kv_cache_and_warmup"] = max(0.0, marks["init_engine"] - marks.get("compile", 0))
        if "init_engine" in marks and "model_load" in marks:
            phases["start_and_rest"] = max(0.0, ready - marks["model_load"] - marks["init_engine"])
        elif "init_engine" in marks and loading is not None:
            phases["start_and_rest"] = max(0.0, ready - loading - marks["init_engine"])
        return {name: round(seconds, 3) for name, seconds in phases.items()}

    def _pass_on(self, stream: IO[bytes], target: int) -> None:
        writable = True
        pending = b""
        fd = stream.fileno()
        while chunk := os.read(fd, _READ_SIZE):
            if writable:
                writable = _write_all(target, chunk)
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()[-_MAX_LINE:]
            for line in lines:
                self._read_line(line[:_MAX_LINE].decode("utf-8", "replace"))
        if pending:
            self._read_line(pending.decode("utf-8", "replace"))
        stream.close()

    def _read_line(self, line: str) -> None:
        if _COMPILE_LOADED.search(line):
            self.compile_loaded = True
        for name, pattern in _MARKS.items():
            found = pattern.search(line)
            if found:
                with self._lock:
                    self._marks.setdefault(name, float(found[1]))


def describe_phases(phases: dict[str, float], *, compile_loaded: bool = False) -> str:
    """``ready in 54.3 s: weights 1.2 s, compile 12.0 s (loaded from the cache), …``."""
    ready = f"ready in {phases['ready']:.1f} s"
    parts = []
    for name, shown in _SHOWN.items():
        if name in phases:
            cached = " (loaded from the cache)" if name == "compile" and compile_loaded else ""
            parts.append(f"{shown} {phases[name]:.1f} s{cached}")
    if not parts:
        return f"{ready} (the engine printed none of the start-up lines this launcher reads)"
    return f"{ready}: {', '.join(parts)}"


def _write_all(fd: int, data: bytes) -> bool:
    """Write ``data`` to ``fd``; False once that is impossible (a closed terminal, a pipe
    nobody reads), so the caller drops output from then on instead of failing."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        return False
    return True
