"""What one pull of the threads data plane shares between its workers and its event loop.

``PullState`` hands out ranges, gates the section in which a worker may write
into the staging files (so a pull can stop, cut every body being read, and wait
until nobody writes any more), and carries completions to the loop.
``watch_speed`` is the low-speed watchdog: it runs on the loop and cuts a GET by
shutting its socket down, which makes the worker's blocked read return.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from agent.source.pacing import WriteGate, slow_body_reason
from agent.source.plane import ByteRange, ProgressSink, RangeSink
from agent.source.tuning import Tuning

__all__ = ["PullState", "watch_speed"]


class PullState(WriteGate):
    """State shared by one pull's workers, its watchdog and its event loop."""

    def __init__(
        self,
        ranges: Sequence[ByteRange],
        tuning: Tuning,
        *,
        client: Any,
        flight: ProgressSink,
        staging: RangeSink,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.tuning = tuning
        self.client = client
        self.flight = flight
        self.staging = staging
        self.endpoint = str(client.meta.endpoint_url)
        super().__init__()
        self._ranges = iter(ranges)
        self.closed = False  # read and written on the loop only
        self.failure: BaseException | None = None  # loop only

    def next_range(self) -> ByteRange | None:
        """The next range to fetch; None once the pull stopped or the plan is done."""
        with self._lock:
            return None if self.stopped.is_set() else next(self._ranges, None)

    def on_loop(self, function: Callable[..., None], *args: Any) -> None:
        """Run ``function`` on the event loop unless the pull has ended by then."""

        def run() -> None:
            if self.closed:
                return
            try:
                function(*args)
            except Exception as exc:  # the journal could not be written: fail the pull
                if self.failure is None:
                    self.failure = exc
                self.stop("the pull failed")

        with contextlib.suppress(RuntimeError):  # the loop is gone: the pull ended long ago
            self.loop.call_soon_threadsafe(run)


async def watch_speed(pull: PullState) -> None:
    """Cut every GET that moved fewer than the low-speed limit's bytes over a window."""
    window = pull.tuning.request_timeout
    while True:
        await asyncio.sleep(max(0.05, window / 4))
        now = time.monotonic()
        for body in pull.bodies():
            reason = slow_body_reason(body, now, window=window, limit=pull.tuning.low_speed_limit)
            if reason is not None:
                pull.cut(body, reason)
