"""How every data plane retries a range and judges a GET too slow.

The rules a range transfer lives by, whichever plane runs it: full-jitter
backoff between attempts, which S3 answers are worth another attempt, and the
low-speed rule (a body that moves fewer than ``low_speed_limit`` bytes over a
window is cut and retried). Standard library only: the processes data plane's
worker processes (agent.source.range_worker) import it without the daemon's
libraries.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading

__all__ = [
    "BACKOFF_BASE_SECONDS",
    "BACKOFF_CAP_SECONDS",
    "THROTTLE_RETRIES_PER_RETRY",
    "Attempts",
    "Body",
    "Stopped",
    "WriteGate",
    "backoff_delay",
    "is_throttling",
    "is_transient_answer",
    "read_step",
    "slow_body_reason",
]

BACKOFF_BASE_SECONDS = 0.2
BACKOFF_CAP_SECONDS = 5.0
# Attempts a range may spend on S3's throttling answers (SlowDown, 503, 429) for each of
# its range_retries, counted apart from them (20 by default): the GETs already in flight
# when S3 starts to throttle keep meeting it until the node's limit of GETs in flight has
# come down, and none of them is broken.
THROTTLE_RETRIES_PER_RETRY = 4

# Error codes S3 sends with an answer that a later attempt may not get.
_TRANSIENT_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable"})


def backoff_delay(failures: int) -> float:
    """Full jitter: uniform in [0, min(cap, base x 2^(failures-1))]."""
    ceiling = min(BACKOFF_CAP_SECONDS, BACKOFF_BASE_SECONDS * 2 ** (failures - 1))
    return random.uniform(0, ceiling)


class Attempts:
    """One range's failed attempts, and how long to wait before the next one.

    Both planes run a range the same way: an attempt, and after a transient
    failure another one from the byte after the last good one, at most
    ``retries`` extra times, each after a full-jitter backoff.
    """

    def __init__(self, retries: int) -> None:
        self.retries = retries
        self.failures = 0

    def next_delay(self) -> float | None:
        """Count a failure: the wait before another attempt, or None once retries are spent."""
        self.failures += 1
        if self.failures > self.retries:
            return None
        return backoff_delay(self.failures)


def is_throttling(status: int, code: str) -> bool:
    """Whether S3's answer asks for fewer requests (SlowDown, 503, 429)."""
    return code == "SlowDown" or status in (429, 503)


def is_transient_answer(status: int, code: str) -> bool:
    """Whether S3's error answer (HTTP status, error code) is worth another attempt."""
    return status >= 500 or status == 429 or code in _TRANSIENT_CODES


# A read is never under 64 KiB (per-call overhead) nor over 512 KiB: the buffer is per
# GET, and read steps of 64 KiB to 4 MiB cost the same CPU per GiB (docs/benchmarks.md).
_MIN_STEP = 64 * 1024
_MAX_STEP = 512 * 1024


def read_step(low_speed_limit: int, window: float, io_block: int) -> int:
    """Bytes per read of a body: at most half a low-speed window's worth, and 512 KiB.

    A watchdog sees only finished reads, so with steps of half the bytes a
    window needs it never cuts a GET that keeps the pace.
    """
    needed = max(1, int(low_speed_limit * window))
    return max(_MIN_STEP, min(io_block, _MAX_STEP, needed // 2))


class Body:
    """One response body being read: what a low-speed watchdog needs to judge and cut it."""

    def __init__(self, sock: socket.socket | None, now: float) -> None:
        self.sock = sock
        self.received = 0  # written by the reader only
        self.mark_time = now  # the watchdog's window, written by the watchdog only
        self.mark_bytes = 0
        self.cut_reason: str | None = None


def slow_body_reason(body: Body, now: float, *, window: float, limit: int) -> str | None:
    """Why ``body`` must be cut (it moved under ``limit`` bytes/s over ``window``), or None.

    A window still open says nothing; a window that closed with enough bytes
    starts the next one.
    """
    if now - body.mark_time < window:
        return None
    moved = body.received - body.mark_bytes
    if moved < max(1, int(limit * window)):
        return (
            f"sent {moved} bytes in {now - body.mark_time:.1f} s, under the low-speed "
            f"limit of {limit} bytes/s."
        )
    body.mark_time, body.mark_bytes = now, body.received
    return None


class Stopped(Exception):
    """The pull stopped (cancelled, or failed elsewhere): the reader leaves without writing."""


class WriteGate:
    """Who may still write into one pull's files, and the bodies they are reading.

    ``stop`` shuts the gate and cuts every body being read; ``wait_idle`` then
    returns once no reader is inside, so nothing writes after the pull gave up.
    Shared by the threads plane and the processes plane's workers.
    """

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._bodies: set[Body] = set()
        self._writers = 0

    def enter(self, body: Body) -> None:
        """Enter the section that writes into the pull's files, or raise Stopped."""
        with self._lock:
            if self.stopped.is_set():
                raise Stopped
            self._writers += 1
            self._bodies.add(body)

    def leave(self, body: Body) -> None:
        """A reader is done with ``body`` and out of the writing section."""
        with self._lock:
            self._bodies.discard(body)
            self._writers -= 1
            self._idle.notify_all()

    def bodies(self) -> list[Body]:
        """The bodies being read now."""
        with self._lock:
            return list(self._bodies)

    def cut(self, body: Body, reason: str) -> None:
        """Make a blocked read of ``body`` return at once; it then fails with ``reason``."""
        with self._lock:
            if body not in self._bodies or body.cut_reason is not None:
                return
            body.cut_reason = reason
            if body.sock is not None:
                # The base class's shutdown: an SSLSocket's own would tear down its TLS
                # state under the reading thread.
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(body.sock, socket.SHUT_RDWR)

    def stop(self, reason: str) -> None:
        """No new writer; cut every body being read."""
        self.stopped.set()
        for body in self.bodies():
            self.cut(body, reason)

    def wait_idle(self) -> None:
        """Block until no reader is in the writing section (called after ``stop``)."""
        with self._idle:
            self._idle.wait_for(lambda: self._writers == 0)
