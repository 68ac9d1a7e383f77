"""A pull in progress, as the requests waiting on it see it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, replace
from typing import Any

from agent._snapshot import Snapshot, SourceObject
from agent._vocabulary import PhaseName, TierName
from agent.obs.metrics import BYTES_PULLED
from agent.store.records import CachedModel

__all__ = ["Flight", "PullProgress", "PullTimings", "Waiter"]

# Longest a watcher waits to hear of new bytes.
NOTIFY_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class PullProgress:
    """Where a pull stands: its phase, bytes and files done of the total."""

    phase: PhaseName
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    key: str


@dataclass(frozen=True, slots=True)
class PullTimings:
    """Seconds a pull spent downloading, verifying and publishing."""

    download: float = 0.0
    verify: float = 0.0
    publish: float = 0.0


@dataclass(frozen=True, slots=True)
class Waiter:
    """A request waiting on a flight: the socket it came in on ("" in-process) and the token
    its client chose for it ("" for none), by which the client can later name its own wait."""

    socket: str = ""
    token: str = ""


class Flight:
    """One pull in progress; any number of requests may wait on it."""

    def __init__(self, snapshot: Snapshot, tier: TierName) -> None:
        self.snapshot = snapshot
        self.tier = tier
        self.started = time.time()
        self.timings = PullTimings()
        # Bytes a resumed pull found complete in the staging directory.
        self.resumed_bytes = 0
        # Bytes complete (journaled) in staging when the pull stopped; None until it
        # stops, or when it stopped before its staging directory was open.
        self.kept_bytes: int | None = None
        self._waiting: list[Waiter] = []
        # Everyone who has waited on it, still waiting or not: a client that gave up can
        # still name the pull it waited on.
        self._waited: set[Waiter] = set()
        # Why the pull was stopped on request (cancel): what its waiters are told.
        self._stopped_because: BaseException | None = None
        self.progress = PullProgress(
            phase="download",
            bytes_done=0,
            bytes_total=snapshot.total_bytes,
            files_done=0,
            files_total=len(snapshot.objects),
            key=snapshot.key,
        )
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # The pull's outcome lives in a future, not in the task, so that a
        # failed pull never propagates into (and tears down) the task group.
        self._outcome: asyncio.Future[CachedModel] = asyncio.get_running_loop().create_future()
        self._outcome.add_done_callback(_mark_retrieved)
        self._bytes_left = {obj.relative_path: obj.size for obj in snapshot.objects}
        self._wake_pending: asyncio.TimerHandle | None = None

    @property
    def key(self) -> str:
        """The snapshot key this flight pulls."""
        return self.snapshot.key

    @property
    def done(self) -> bool:
        """Whether the pull has settled (published, failed or abandoned)."""
        return self._outcome.done()

    async def result(self) -> CachedModel:
        """The published model; shielded so a departing watcher never cancels the pull."""
        return await asyncio.shield(self._outcome)

    @property
    def waiters(self) -> int:
        """Requests waiting on this pull now."""
        return len(self._waiting)

    @contextlib.contextmanager
    def waiting(self, waiter: Waiter) -> Iterator[None]:
        """Count ``waiter`` as waiting on this pull for the life of the block."""
        self._waiting.append(waiter)
        self._waited.add(waiter)
        try:
            yield
        finally:
            self._waiting.remove(waiter)

    def waited_on_by(self, waiter: Waiter) -> bool:
        """Whether ``waiter``'s request waits or has waited on this pull."""
        return waiter in self._waited

    def waiting_besides(self, caller: Waiter) -> list[Waiter]:
        """Who waits on this pull, ``caller``'s own request left out (once, if it waits yet).

        A caller without a token names no request of its own: everyone counts.
        """
        others = list(self._waiting)
        if caller.token and caller in others:
            others.remove(caller)
        return others

    def start(self, tasks: asyncio.TaskGroup, pull: Coroutine[Any, Any, None]) -> None:
        """Run ``pull`` as this flight's task in ``tasks``; ``cancel`` stops it."""
        self._task = tasks.create_task(pull, name=f"pull-{self.key}")

    def cancel(self, because: BaseException | None = None) -> None:
        """Stop the pull's task; the pull settles the flight as it unwinds.

        ``because``: the error its waiters get (a cancel asked for); without it
        (shutdown) they see the flight cancelled.
        """
        if because is not None and self._stopped_because is None:
            self._stopped_because = because
        if self._task is not None:
            self._task.cancel()

    async def ended(self) -> None:
        """Return once the pull's task has finished unwinding; never cancels it."""
        if self._task is not None:
            await asyncio.wait([self._task])

    def succeed(self, model: CachedModel) -> None:
        """The pull published ``model``: every watcher gets it."""
        if not self._outcome.done():
            self._outcome.set_result(model)
        self._notify()

    def fail(self, error: BaseException) -> None:
        """The pull failed with ``error``: every watcher gets it raised."""
        if not self._outcome.done():
            self._outcome.set_exception(error)
        self._notify()

    def abandon(self) -> None:
        """The pull was cancelled: watchers get the reason a cancel gave, else (shutdown) see
        the flight cancelled."""
        if self._stopped_because is not None:
            self.fail(self._stopped_because)
            return
        if not self._outcome.done():
            self._outcome.cancel()
        self._notify()

    async def watch(self, min_interval: float = 0.05) -> AsyncIterator[PullProgress]:
        """Yield progress until the pull ends, at most one event per ``min_interval``.

        Updates that arrive faster are coalesced, never dropped: the newest
        progress goes out once the interval has passed, even if no further
        update comes (a pull can stall on a slow range).
        """
        sent: PullProgress | None = None
        last_sent = -min_interval
        while True:
            changed = self._changed
            if self.done:
                yield self.progress
                return
            wait = last_sent + min_interval - time.monotonic()
            if self.progress != sent and wait <= 0:
                sent, last_sent = self.progress, time.monotonic()
                yield sent
                continue
            if self.progress == sent:
                await changed.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await changed.wait()

    def set_phase(self, phase: PhaseName) -> None:
        """The pull moved on to ``phase``: watchers hear of it at once."""
        self.progress = replace(self.progress, phase=phase)
        self._notify()

    def add_bytes(self, obj: SourceObject, count: int) -> None:
        """``count`` bytes of ``obj`` arrived from the source and were written."""
        BYTES_PULLED.labels(self.tier).inc(count)
        self._advance(obj, count)

    def add_resumed(self, obj: SourceObject, count: int) -> None:
        """``count`` bytes of ``obj`` were found complete in the staging directory."""
        self.resumed_bytes += count
        self._advance(obj, count)

    def _advance(self, obj: SourceObject, count: int) -> None:
        left = self._bytes_left[obj.relative_path] - count
        self._bytes_left[obj.relative_path] = left
        files_done = self.progress.files_done + (1 if left == 0 else 0)
        self.progress = replace(
            self.progress, bytes_done=self.progress.bytes_done + count, files_done=files_done
        )
        self._notify_soon()

    def _notify_soon(self) -> None:
        """Wake the watchers within NOTIFY_SECONDS: bytes arrive hundreds of times a second
        and watchers send at most one event per 50 ms, so a wake-up per arrival is wasted
        event-loop time."""
        if self._wake_pending is None:
            self._wake_pending = asyncio.get_running_loop().call_later(NOTIFY_SECONDS, self._notify)

    def _notify(self) -> None:
        # Wake everyone waiting on the current event and start a fresh one.
        if self._wake_pending is not None:
            self._wake_pending.cancel()
            self._wake_pending = None
        self._changed.set()
        self._changed = asyncio.Event()


def _mark_retrieved(outcome: asyncio.Future[CachedModel]) -> None:
    # A pull nobody waits for any more may fail; that is logged, not a leak warning.
    if not outcome.cancelled():
        outcome.exception()
