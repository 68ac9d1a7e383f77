"""The node's limit of GETs in flight, driven by a simulated link: how it finds the knee.

The link is a model of S3 as it behaves: each GET carries at most ``per_get`` bytes/s and
all of them together at most ``link`` bytes/s. The limit is fed the bytes such a link
would deliver at each limit, on a clock the test moves; nothing here touches a network.
"""

from __future__ import annotations

import logging

import pytest

from agent.source.concurrency import HOLD_WINDOWS, AdaptiveConcurrency

MB = 10**6
TICK = 0.1


class Clock:
    """A clock only the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Link:
    """A link of ``link`` bytes/s in all and ``per_get`` bytes/s for each GET."""

    def __init__(self, limit: AdaptiveConcurrency, clock: Clock, *, per_get: float, link: float):
        self.limit = limit
        self.clock = clock
        self.per_get = per_get
        self.link = link

    def run(self, seconds: float, *, demand: int | None = None) -> list[int]:
        """Keep min(limit, demand) GETs in flight for ``seconds``; the limits seen, per tick."""
        seen = []
        for _ in range(round(seconds / TICK)):
            wanted = self.limit.limit if demand is None else min(demand, self.limit.limit)
            while self.limit.in_flight < wanted:
                self.limit.acquire()
            while self.limit.in_flight > wanted:
                self.limit.release()
            self.clock.now += TICK
            rate = min(self.link, self.limit.in_flight * self.per_get)
            self.limit.add_bytes(int(rate * TICK))
            seen.append(self.limit.limit)
        return seen


def _limit(initial: int, *, ceiling: int = 1024) -> tuple[AdaptiveConcurrency, Clock]:
    clock = Clock()
    return AdaptiveConcurrency(initial=initial, ceiling=ceiling, floor=4, clock=clock), clock


def test_the_limit_doubles_until_the_link_is_full_then_settles_at_the_knee() -> None:
    """3 MB/s per GET on a 300 MB/s link needs 100 GETs: from 16 the limit doubles to 128
    (the first limit that fills the link), finds 256 no better, and settles back at 128."""
    limit, clock = _limit(16)
    link = Link(limit, clock, per_get=3 * MB, link=300 * MB)
    link.run(12)
    assert limit.limit == 128
    assert limit.statistics().phase == "hold"


def test_a_start_above_the_knee_trims_to_fewer_gets_that_move_as_much() -> None:
    """20 MB/s per GET on a 300 MB/s link needs 15 GETs: starting at 63, doubling gains
    nothing, so the limit trims by quarters while the rate holds and stops above 15."""
    limit, clock = _limit(63)
    link = Link(limit, clock, per_get=20 * MB, link=300 * MB)
    link.run(15)
    assert 15 <= limit.limit < 63
    assert limit.limit * 20 * MB >= 0.95 * 300 * MB


def test_the_limit_never_passes_its_ceiling() -> None:
    """A link that always pays for more GETs still stops at the ceiling and holds there."""
    limit, clock = _limit(16, ceiling=100)
    Link(limit, clock, per_get=1 * MB, link=10_000 * MB).run(10)
    assert limit.limit == 100


def test_slowdown_halves_the_limit_once_per_burst_and_holds_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """S3's SlowDown halves the limit, logged as a back-off; the rest of the burst (answers to
    GETs already in flight) cuts nothing more; the limit holds, then probes upwards again."""
    limit, clock = _limit(64)
    link = Link(limit, clock, per_get=3 * MB, link=300 * MB)
    with caplog.at_level(logging.WARNING, logger="agent.source.concurrency"):
        limit.slow_down("SlowDown")
        limit.slow_down("SlowDown")
        limit.slow_down("503")
    assert limit.limit == 32
    assert limit.throttled == 3
    assert "S3 answered SlowDown: backing off, GETs in flight 64 -> 32" in caplog.text
    held = link.run((HOLD_WINDOWS - 1) * 1.0)
    assert set(held) == {32}
    link.run(6)
    assert limit.limit > 32  # the probe after the hold found the link pays again
    clock.now += 5  # a later burst is cut again
    before = limit.limit
    limit.slow_down("SlowDown")
    assert limit.limit == before // 2


def test_windows_where_the_pulls_do_not_keep_the_limit_busy_move_nothing() -> None:
    """A pull down to its last few ranges (demand under the limit) says nothing about the link:
    the limit stays where it was however long that lasts."""
    limit, clock = _limit(64)
    seen = Link(limit, clock, per_get=3 * MB, link=300 * MB).run(10, demand=10)
    assert set(seen) == {64}


def test_every_change_wakes_the_subscribed_pulls() -> None:
    """Each change of the limit calls every subscriber, so waiting pulls start more GETs;
    an unsubscribed one hears nothing more."""
    limit, clock = _limit(16)
    heard: list[int] = []
    unsubscribe = limit.subscribe(lambda: heard.append(limit.limit))
    link = Link(limit, clock, per_get=3 * MB, link=300 * MB)
    link.run(3)
    assert heard[:2] == [32, 64]
    unsubscribe()
    count = len(heard)
    limit.slow_down("SlowDown")
    assert len(heard) == count


def test_after_growth_the_limit_trims_to_fewer_gets_that_move_as_much() -> None:
    """A link full at 84 GETs of 3 MB/s (250 MB/s): doubling from 16 reaches 128, 256 moves
    no more, and trimming from 128 keeps 96 (as fast) but not 72 (slower): fewer GETs cost
    the node less CPU and memory for the same bytes."""
    limit, clock = _limit(16)
    link = Link(limit, clock, per_get=3 * MB, link=250 * MB)
    link.run(14)
    assert limit.limit == 96
    assert limit.statistics().phase == "hold"


def test_a_throttling_code_reaches_the_log_as_letters_and_digits_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """S3's error code is text from the wire: escapes, newlines and markup in it never reach
    the daemon's log line, and a code with nothing printable is logged as throttling."""
    limit, _clock = _limit(64)
    with caplog.at_level(logging.WARNING, logger="agent.source.concurrency"):
        limit.slow_down("Slow\x1b]8;;http://x\x07Down\n[/bold]")
    assert "S3 answered Slow8httpxDownbold: backing off" in caplog.text
    assert "\x1b" not in caplog.text
    assert "\n[" not in caplog.text
