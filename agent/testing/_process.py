"""Starting, waiting for and stopping the helper servers of the tests and the benchmark.

``S3Server``, ``AgentProcess``, ``FaultProxy`` and the benchmark's s3rver all
start something, wait until it is ready, stop it gracefully or kill it, and
clean up after it. The steps they share live here once:

- ``Startable`` / ``Closeable``: the ``with`` protocol over ``start()`` and ``close()``.
- ``read_until``: readiness from a child's own output (a handshake line, a
  "listening on" message), waited for with a selector, never by sleeping; a
  child that exits first fails the wait at once.
- ``stop_process``: a signal, a bounded wait, then SIGKILL.
- ``purge_tree``: remove a directory the store may have made read-only.
- ``source_env``: the environment a child needs to import this checkout.
- ``read_log`` / ``log_tail``: a child's log file, shortened for an error message.
"""

from __future__ import annotations

import abc
import os
import re
import select
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

from agent._fs import remove_tree

__all__ = [
    "SOURCE_ROOT",
    "Closeable",
    "Startable",
    "StartupFailure",
    "log_tail",
    "purge_tree",
    "read_log",
    "read_until",
    "source_env",
    "stop_process",
]

# The directory that holds the ``agent`` package, so a child imports this
# checkout even when the parent runs from another working directory.
SOURCE_ROOT = Path(__file__).resolve().parents[2]


class Closeable(abc.ABC):
    """Something ready once constructed: ``with`` closes it on the way out."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything this object holds; safe to call twice."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Startable(Closeable):
    """A server that ``with`` starts on the way in and closes on the way out.

    A start that fails closes too, so what it made before failing (a
    directory, a log file) does not outlive the ``with`` that never ran.
    """

    @abc.abstractmethod
    def start(self) -> Self:
        """Start and return once ready to serve."""

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise


class StartupFailure(Exception):
    """A child did not print what ``read_until`` waited for.

    ``reason`` completes "The server ..." (it timed out, or exited with a
    code); ``output`` is everything read from it so far.
    """

    def __init__(self, reason: str, output: bytes) -> None:
        super().__init__(reason)
        self.reason = reason
        self.output = output


def read_until(
    proc: subprocess.Popen[bytes], pattern: re.Pattern[bytes], *, timeout: float
) -> re.Match[bytes]:
    """Read the child's stdout until ``pattern`` matches what it has printed.

    Bytes after the match are read too and dropped: call this for the
    handshake, then drain or close the pipe.
    """
    assert proc.stdout is not None, "read_until needs stdout=subprocess.PIPE"
    deadline = time.monotonic() + timeout
    output = b""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while (match := pattern.search(output)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(timeout=remaining):
                raise StartupFailure(f"was not ready within {timeout:.0f} s", output)
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise StartupFailure(f"exited with code {proc.wait()} before it was ready", output)
            output += chunk
    return match


def stop_process(
    proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGTERM, *, timeout: float
) -> bool:
    """Send ``sig`` and wait up to ``timeout`` s, then SIGKILL; reaps the child either way.

    True when it exited within the timeout (or had exited already), False when
    it had to be killed: for the callers to whom a clean exit is the point.
    """
    if proc.poll() is not None:
        return True
    proc.send_signal(sig)
    if not _exits_within(proc, timeout):
        proc.kill()
        proc.wait()
        return False
    proc.wait()
    return True


def _exits_within(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether the child exits within ``timeout`` s, woken by its pidfd the moment it does
    (``Popen.wait(timeout)`` polls, with sleeps growing to 50 ms)."""
    try:
        exited = os.pidfd_open(proc.pid)
    except ProcessLookupError:  # reaped meanwhile (by another thread's wait)
        return True
    try:
        readable, _, _ = select.select([exited], [], [], timeout)
    finally:
        os.close(exited)
    return bool(readable)


def purge_tree(path: Path) -> None:
    """Remove a directory tree, including the read-only directories the store publishes."""
    if not path.exists():
        return
    for directory, _, _ in os.walk(path):
        # Entries of a read-only directory cannot be unlinked.
        Path(directory).chmod(0o700)
    remove_tree(path)


def source_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with this checkout first on PYTHONPATH."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), env.get("PYTHONPATH")]))
    return env


def read_log(path: Path | None) -> str:
    """A child's log file as text; empty when there is none (yet, or any more)."""
    if path is None:
        return ""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def log_tail(text: str, *, heading: str, empty: str, limit: int) -> str:
    """The last ``limit`` characters of a log under ``heading``, or ``empty`` if blank."""
    if not text.strip():
        return empty
    return f"{heading}\n{text[-limit:]}"
