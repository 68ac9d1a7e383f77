"""How many GETs the node keeps in flight: found by measuring the link, not assumed.

S3 gives one GET roughly 50-90 MB/s, so a node's rate is streams x per-stream
rate, and the number of streams a link needs depends on what each one gets,
which no setting knows in advance: 15 streams fill a 300 MB/s link at 20 MB/s
each, 100 at 3 MB/s, ~1,000 a 400 Gbit/s node against real S3.

``AdaptiveConcurrency`` is one limit for the whole node, shared by every pull
of the processes plane. It measures the bytes all pulls move per window while
they keep the limit busy, and:

- doubles the limit while the aggregate rate grows by more than ``GAIN``;
- when doubling stops paying, steps back to the limit that gave the best rate,
  then tries smaller limits, a quarter less each window, while the rate holds
  within ``KEEP`` of the best: fewer streams cost less CPU and memory for the
  same bytes, and where the client's CPU is the limit (TLS on a small node) they
  move more;
- holds for ``HOLD_WINDOWS`` windows, then probes upwards again, so a link that
  got faster (or a second pull with its own prefix) is found;
- halves the limit when S3 answers SlowDown (or 503/429), and holds: S3 limits
  requests per prefix, and fewer GETs in flight means fewer per second.

Windows only count while the pulls keep the limit busy: a pull down to its
last few ranges says nothing about the link. The decisions are pure functions
of the bytes and the clock handed in, so they are tested without a network.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from agent.obs.metrics import S3_GETS_IN_FLIGHT, S3_GETS_LIMIT, S3_THROTTLED

__all__ = ["GAIN", "HOLD_WINDOWS", "KEEP", "AdaptiveConcurrency", "ConcurrencyStatistics"]

log = logging.getLogger(__name__)

# A doubling must raise the rate by this share to count as growth.
GAIN = 0.10
# A smaller limit is kept while its rate stays within this share of the best.
KEEP = 0.03
# Windows to hold a settled limit (or one just cut by SlowDown) before probing again.
HOLD_WINDOWS = 10
# A window is judged once it is this long; the first SETTLE_SECONDS after a change are
# not measured (new connections still in their handshakes and slow start).
WINDOW_SECONDS = 1.0
SETTLE_SECONDS = 0.25
# The limit is busy while at least this share of it is in flight.
BUSY_SHARE = 0.9

Phase = Literal["grow", "trim", "hold"]
MiB = 1024**2


@dataclass(frozen=True, slots=True)
class ConcurrencyStatistics:
    """A snapshot for status and metrics."""

    limit: int
    in_flight: int
    phase: Phase
    best_rate: float  # bytes/s of the best window since the last probe, 0 if none
    throttled: int  # SlowDown answers seen since start


class AdaptiveConcurrency:
    """The node-wide limit of GETs in flight, moved by the rate the pulls measure."""

    def __init__(
        self,
        *,
        initial: int,
        ceiling: int,
        floor: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ceiling = max(1, ceiling)
        self.floor = max(1, min(floor, self.ceiling))
        self.limit = max(self.floor, min(initial, self.ceiling))
        self.in_flight = 0
        self.throttled = 0
        self._start = self.limit
        self._clock = clock
        self._phase: Phase = "grow"
        self._best: tuple[float, int] | None = None  # (bytes/s, limit)
        self._probing = False
        self._hold_left = 0
        self._window_start: float | None = None
        self._window_bytes = 0
        self._changed_at = clock()
        self._last_cut: float | None = None
        self._listeners: list[Callable[[], None]] = []
        S3_GETS_LIMIT.set(self.limit)

    # -- what the plane tells it -----------------------------------------------------------

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake`` whenever the limit changes; returns the unsubscribe function."""
        self._listeners.append(wake)
        return lambda: self._listeners.remove(wake)

    def acquire(self) -> None:
        """One more GET in flight."""
        self.in_flight += 1
        S3_GETS_IN_FLIGHT.set(self.in_flight)

    def release(self) -> None:
        """One GET fewer in flight; a window where the limit was not kept busy is void."""
        self.in_flight = max(0, self.in_flight - 1)
        S3_GETS_IN_FLIGHT.set(self.in_flight)

    def add_bytes(self, count: int) -> None:
        """``count`` bytes arrived; judge the window once it is long enough."""
        now = self._clock()
        if not self._busy() or now - self._changed_at < SETTLE_SECONDS:
            self._window_start = None  # idle or settling: this stretch says nothing
            return
        if self._window_start is None:
            self._window_start, self._window_bytes = now, 0
            return  # bytes before the window's start belong to nothing
        self._window_bytes += count
        elapsed = now - self._window_start
        if elapsed >= WINDOW_SECONDS:
            self._judge(self._window_bytes / elapsed)

    def slow_down(self, reason: str) -> None:
        """S3 asked for fewer requests: halve the limit and hold it.

        ``reason`` is S3's error code (or status): text from the wire, so only its
        letters and digits reach the log.
        """
        reason = "".join(c for c in reason[:64] if c.isascii() and c.isalnum()) or "throttling"
        self.throttled += 1
        S3_THROTTLED.inc()
        now = self._clock()
        if self._last_cut is not None and now - self._last_cut < WINDOW_SECONDS:
            return  # one cut per burst: the GETs already in flight are answered alike
        self._last_cut = now
        before = self.limit
        self._best = None
        self._hold(HOLD_WINDOWS)
        self._set(max(self.floor, before // 2))
        log.warning(
            "S3 answered %s: backing off, GETs in flight %d -> %d for the node",
            reason,
            before,
            self.limit,
        )

    def statistics(self) -> ConcurrencyStatistics:
        """Where the limit stands now."""
        best = self._best[0] if self._best else 0.0
        return ConcurrencyStatistics(self.limit, self.in_flight, self._phase, best, self.throttled)

    # -- deciding --------------------------------------------------------------------------

    def _busy(self) -> bool:
        return self.in_flight >= math.ceil(BUSY_SHARE * self.limit)

    def _judge(self, rate: float) -> None:
        """One measured window at the current limit: move the limit, or not."""
        self._window_start = None
        if self._phase == "hold":
            self._hold_left -= 1
            if self._hold_left <= 0 and self.limit < self.ceiling:
                # A probe: grows from here, or settles back without trimming.
                self._phase, self._best, self._probing = "grow", (rate, self.limit), True
                self._set(min(self.ceiling, max(self.limit + 1, self.limit * 3 // 2)))
            return
        if self._phase == "grow":
            self._judge_growth(rate)
        else:
            self._judge_trim(rate)

    def _judge_growth(self, rate: float) -> None:
        best = self._best
        if best is None or rate > best[0] * (1 + GAIN):
            self._best, self._probing = (rate, self.limit), False
            if self.limit >= self.ceiling:
                self._settle(self.limit, rate, "the ceiling")
                return
            self._set(min(self.ceiling, self.limit * 2))
            return
        if self._probing or best[1] <= self.floor:
            self._settle(best[1], best[0], "no more growth")
            return
        # Doubling stopped paying: from the best limit, try fewer GETs that move as much.
        self._phase = "trim"
        self._set(max(self.floor, best[1] * 3 // 4))

    def _judge_trim(self, rate: float) -> None:
        assert self._best is not None
        best_rate, best_limit = self._best
        if rate >= best_rate * (1 - KEEP):
            self._best = (max(rate, best_rate), self.limit)
            if self.limit > self.floor:
                self._set(max(self.floor, self.limit * 3 // 4))
                return
            self._settle(self.limit, rate, "the floor")
            return
        self._settle(best_limit, best_rate, "fewer streams moved less")

    def _settle(self, limit: int, rate: float, why: str) -> None:
        log.info(
            "GETs in flight settled at %d for the node (%s; %.0f MiB/s)", limit, why, rate / MiB
        )
        self._hold(HOLD_WINDOWS)
        self._set(limit)

    def _hold(self, windows: int) -> None:
        self._phase, self._hold_left = "hold", windows

    def _set(self, limit: int) -> None:
        self._changed_at = self._clock()
        self._window_start = None
        if limit == self.limit:
            return
        log.debug("GETs in flight for the node: %d -> %d (%s)", self.limit, limit, self._phase)
        self.limit = limit
        S3_GETS_LIMIT.set(limit)
        for wake in list(self._listeners):
            wake()
