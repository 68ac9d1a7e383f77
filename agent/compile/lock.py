"""One compile per key per node: a first-come, first-served lock held by an open stream.

The first caller for a key holds the lock at once; later callers queue. The
lock passes to the next caller in line when the holder lets go, which is when
its stream ends for any reason: the pod closed it, or the pod died and gRPC
cancelled the call. A queued caller is also let go early, without taking the
lock, once the key's directory has settled with artifacts in it
(``release_waiters``): it has a warm cache to use, so there is nothing left to
wait for; and once it has waited ``wait_limit`` seconds, so that a holder that
never lets go (a hung pod) keeps nobody waiting forever: it then compiles on
its own. Keys are the callers' (the facade's ``<domain>/<key>``), so one
tenant's pods never queue behind another's.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["CompileLocks", "LockEvent"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LockEvent:
    """One step of a compile-lock stream: waiting (behind whom, warm or not) or granted."""

    state: Literal["waiting", "granted"]
    key: str
    # The caller holding the lock ("" once this caller is granted and holds it itself).
    holder: str
    # True when the key's directory already holds artifacts.
    warm: bool


@dataclass(slots=True)
class _Waiter:
    name: str
    # Resolves True when the lock passes to this waiter, False when it is let go
    # early because the cache became warm.
    turn: asyncio.Future[bool]


class CompileLocks:
    """Per-key FIFO locks for the CompileLock RPC."""

    def __init__(self, wait_limit: float = math.inf) -> None:
        self._wait_limit = wait_limit
        self._holders: dict[str, str] = {}
        self._queues: dict[str, deque[_Waiter]] = {}
        self._closing = asyncio.Event()

    def holder(self, key: str) -> str | None:
        """Who holds ``key``'s lock now; None when nobody does."""
        return self._holders.get(key)

    def in_use(self, key: str) -> bool:
        """Whether anyone holds or waits for ``key``'s lock."""
        return key in self._holders or bool(self._queues.get(key))

    def busy_keys(self) -> set[str]:
        """Every key whose lock is held or awaited."""
        return set(self._holders) | {k for k, q in self._queues.items() if q}

    def close(self) -> None:
        """End every hold: the agent is stopping."""
        self._closing.set()

    def release_waiters(self, key: str) -> int:
        """Let every queued caller of ``key`` go (the cache is warm); returns how many."""
        queue = self._queues.pop(key, deque())
        for waiter in queue:
            if not waiter.turn.done():
                waiter.turn.set_result(False)
        return len(queue)

    async def hold(
        self, key: str, name: str, is_warm: Callable[[], bool]
    ) -> AsyncGenerator[LockEvent, None]:
        """WAITING (if someone holds it), then GRANTED; holds until the consumer stops.

        Run it with ``contextlib.aclosing`` so that the lock is released the
        moment the consumer stops iterating, even when it is cancelled.
        """
        owner = False
        waiter: _Waiter | None = None
        try:
            if key not in self._holders:
                self._holders[key] = name
                owner = True
            else:
                waiter = _Waiter(name, asyncio.get_running_loop().create_future())
                self._queues.setdefault(key, deque()).append(waiter)
                yield LockEvent("waiting", key, self._holders[key], is_warm())
                owner = await self._wait_turn(key, waiter)
            holder = "" if owner else self._holders.get(key, "")
            yield LockEvent("granted", key, holder, is_warm())
            await self._closing.wait()
        finally:
            if waiter is not None and not owner:
                # Cancelled while queued, or after the lock was handed over but
                # before this task resumed: either way nobody may be left waiting on us.
                turn = waiter.turn
                owner = turn.done() and not turn.cancelled() and turn.result()
                if not turn.done():
                    turn.cancel()
                queue = self._queues.get(key)
                if queue is not None and waiter in queue:
                    queue.remove(waiter)
            if owner:
                self._hand_over(key)

    async def _wait_turn(self, key: str, waiter: _Waiter) -> bool:
        """True when the lock passes to ``waiter``; False when it is let go without it."""
        try:
            async with asyncio.timeout(self._wait_limit if self._wait_limit < math.inf else None):
                return await waiter.turn
        except TimeoutError:
            turn = waiter.turn
            if turn.done() and not turn.cancelled():
                return turn.result()  # handed over just as the wait ran out
            log.warning(
                "compile lock %s: %s waited %g s for %s; let go without the lock",
                key,
                waiter.name,
                self._wait_limit,
                self._holders.get(key, "the holder"),
            )
            return False

    def _hand_over(self, key: str) -> None:
        queue = self._queues.get(key)
        while queue:
            waiter = queue.popleft()
            if not waiter.turn.done():
                self._holders[key] = waiter.name
                waiter.turn.set_result(True)
                break
        else:
            self._holders.pop(key, None)
        if queue is not None and not queue:
            self._queues.pop(key, None)
