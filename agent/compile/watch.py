"""Watch the compile-cache root; report each key directory once it has settled.

A key has settled when something under ``<root>/<key>/`` changed and then
nothing did for ``quiet_seconds``. Changes to ignored paths (locks, temporary
files, see ``agent.compile.archive.is_ignored``) and to the agent's own bookkeeping
directories (``.meta``, ``.tmp``, ``.trash``) do not count. Quietness is
awaited per key with a timeout on an event, never by polling; the filesystem
events come from ``watchfiles`` (inotify on Linux).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Self

from watchfiles import Change, awatch

from agent.compile.archive import is_ignored

__all__ = ["SettleWatcher"]

log = logging.getLogger(__name__)

_KEY = re.compile(r"^[0-9a-f]{32}$")


class SettleWatcher:
    """Owns the watch task and one settle timer per changed key."""

    def __init__(
        self,
        root: Path,
        quiet_seconds: float,
        on_settled: Callable[[str], Awaitable[None]],
    ) -> None:
        self._root = root
        self._quiet = quiet_seconds
        self._on_settled = on_settled
        self._stop = asyncio.Event()
        self._changed: dict[str, asyncio.Event] = {}
        self._group = asyncio.TaskGroup()
        self._timers: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        # watchfiles logs every batch of changes at info level; our own lines say more.
        logging.getLogger("watchfiles").setLevel(logging.WARNING)
        await self._group.__aenter__()
        self._group.create_task(self._watch(), name="compile-cache watcher")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The watch thread checks the stop event every step. A timer is waiting
        # or uploading; cancelling an upload leaves at most an unreferenced
        # archive in S3, never a broken pointer (see agent.compile.remote).
        self._stop.set()
        for timer in self._timers:
            timer.cancel()
        await self._group.__aexit__(exc_type, exc, tb)

    def touch(self, key: str) -> None:
        """Something under ``key`` changed: (re)start its quiet period."""
        if self._stop.is_set():
            return
        event = self._changed.get(key)
        if event is not None:
            event.set()
            return
        event = asyncio.Event()
        self._changed[key] = event
        timer = self._group.create_task(
            self._settle(key, event), name=f"compile-cache settle {key}"
        )
        self._timers.add(timer)
        timer.add_done_callback(self._timers.discard)

    def _key_of(self, path: str) -> str | None:
        try:
            relative = Path(path).relative_to(self._root).as_posix()
        except ValueError:
            return None
        key, _, rest = relative.partition("/")
        if not _KEY.match(key) or (rest and is_ignored(rest)):
            return None
        return key

    def _filter(self, change: Change, path: str) -> bool:
        return self._key_of(path) is not None

    async def _watch(self) -> None:
        debounce = int(min(1600, max(50, self._quiet * 500)))
        try:
            async for changes in awatch(
                self._root,
                watch_filter=self._filter,
                stop_event=self._stop,
                debounce=debounce,
                step=50,
                recursive=True,
            ):
                for _, path in changes:
                    key = self._key_of(path)
                    if key is not None:
                        self.touch(key)
        except Exception as exc:  # e.g. out of inotify watches: uploads go on by hand
            log.error(
                "cannot watch %s for new compile artifacts (%s); they are uploaded only by "
                "`prewarm compile push` until the agent restarts",
                self._root,
                exc,
            )

    async def _settle(self, key: str, changed: asyncio.Event) -> None:
        try:
            while not self._stop.is_set():
                try:
                    async with asyncio.timeout(self._quiet):
                        await changed.wait()
                except TimeoutError:
                    break
                changed.clear()
        finally:
            self._changed.pop(key, None)
        if self._stop.is_set():
            return
        try:
            await self._on_settled(key)
        except Exception:
            log.exception("handling the settled compile cache %s failed", key)
