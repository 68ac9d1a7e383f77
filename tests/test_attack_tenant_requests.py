"""Requests a hostile tenant may send, and what the agent does with them (issue 16, items 5, 10).

In-process against the in-memory source where the behaviour is the service's (glob matching
must not stall the event loop), and end to end over real tenant sockets where it is the edge's
(pins and long leases are node-only effects).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from agent._exceptions import NotFound
from agent._uri import parse_uri
from agent.pull.resolver import resolve
from agent.testing import MemorySource

# As many include globs as a request may carry, each near the 1,024-byte cap, written to
# cost the most to match: every "*" may stretch, and nothing ever matches.
HOSTILE_GLOBS = tuple(f"{n}*" + "a*" * 500 + "z" for n in range(256))


class LoopLag:
    """The longest an event-loop callback waited past its due time while this ran.

    A timer re-armed every ``interval`` seconds: when something holds the loop, the next
    tick runs late by as long as it held it. Any RPC (Status, say) would have waited as long.
    """

    def __init__(self, interval: float = 0.01) -> None:
        self._interval = interval
        self._loop = asyncio.get_running_loop()
        self._due = time.monotonic() + interval
        self._handle = self._loop.call_later(interval, self._tick)
        self.worst = 0.0

    def _tick(self) -> None:
        now = time.monotonic()
        self.worst = max(self.worst, now - self._due)
        self._due = now + self._interval
        self._handle = self._loop.call_later(self._interval, self._tick)

    def stop(self) -> float:
        """Stop, counting the tick that is overdue now (the loop may not have run it yet)."""
        self._handle.cancel()
        return max(self.worst, time.monotonic() - self._due)


@pytest.fixture
def big_listing() -> MemorySource:
    """20,000 objects under one prefix, as a tenant's own bucket might hold."""
    source = MemorySource()
    for number in range(20_000):
        source.put("models", f"big/dir{number % 50}/file-{number:06d}.safetensors", b"")
    return source


async def test_matching_hostile_globs_against_a_big_listing_never_holds_the_event_loop(
    big_listing: MemorySource,
) -> None:
    """256 globs of ~1 KiB against 20,000 objects take seconds of CPU; the event loop (which
    answers every other RPC, Status included) is never held for more than a fraction of that:
    the matching runs in a worker thread."""
    started = time.monotonic()
    lag = LoopLag()
    try:
        with pytest.raises(NotFound, match="none passes the include/exclude"):
            await resolve(big_listing, parse_uri("s3://models/big/"), HOSTILE_GLOBS, ())
    finally:
        worst = lag.stop()
    took = time.monotonic() - started
    assert took > 1.5, f"the matching took only {took:.2f} s: not hostile enough to show"
    assert worst < 0.75, f"the event loop was held for {worst:.2f} s of {took:.2f} s"
