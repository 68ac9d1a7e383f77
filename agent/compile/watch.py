"""Watch the compile-cache root; report each key directory once it has settled.

A key has settled when something under its directory changed and then
nothing did for ``quiet_seconds``. Which key a changed path belongs to, if any,
is the caller's ``key_of`` (changes to ignored paths, locks and temporary
files, see ``agent.compile.archive.is_ignored``, and to the agent's own
bookkeeping do not count). Quietness is awaited per key with a timeout on an
event, never by polling; the filesystem events come from ``watchfiles``
(inotify on Linux).

inotify needs a watch per directory, and pods make directories: at the
user's watch limit, watches for new directories are silently not made, and
their files would never be seen. After every batch of changes that added
anything, the watcher asks the kernel for one more watch; when it is refused
(or watchfiles fails to start for the limit), the agent logs an error, counts
it in ``prewarm_compile_watch_limit_total``, drops its inotify watches (they
are the node's too) and watches by polling the tree every few seconds until
it restarts, after touching every key so that nothing missed stays unsent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Self

from watchfiles import Change, awatch

from agent.compile.inotify_limit import watch_limit_reached, watch_limit_text
from agent.obs.metrics import COMPILE_WATCH_LIMIT, COMPILE_WATCH_POLLING

__all__ = ["SettleWatcher"]

log = logging.getLogger(__name__)

# watchfiles' words for a watch refused at the limit when it starts.
_LIMIT_ERROR = "watch limit"


class SettleWatcher:
    """Owns the watch task and one settle timer per changed key."""

    def __init__(
        self,
        root: Path,
        quiet_seconds: float,
        on_settled: Callable[[str], Awaitable[None]],
        *,
        key_of: Callable[[str], str | None],
        keys: Callable[[], Iterable[str]],
    ) -> None:
        """``key_of`` names the key a path relative to ``root`` belongs to (None: none);
        ``keys`` lists every key there is (touched when events may have been missed)."""
        self._root = root
        self._quiet = quiet_seconds
        self._on_settled = on_settled
        self._relative_key = key_of
        self._keys = keys
        self._polling = False
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
        return self._relative_key(relative)

    def _filter(self, change: Change, path: str) -> bool:
        return self._key_of(path) is not None

    async def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                if not await self._watch_until_full():
                    return
            except Exception as exc:
                if _LIMIT_ERROR not in str(exc) or self._polling:
                    log.error(
                        "cannot watch %s for new compile artifacts (%s); they are uploaded "
                        "only at a ready report or by `prewarm compile push` until the agent "
                        "restarts",
                        self._root,
                        exc,
                    )
                    return
            self._fall_back_to_polling()

    async def _watch_until_full(self) -> bool:
        """Report changes until stopped (False) or until the watch limit is reached (True)."""
        debounce = int(min(1600, max(50, self._quiet * 500)))
        # A poll walks the whole tree: often enough to see changes well within the
        # quiet period, rarely enough to cost little.
        poll_ms = int(min(5000, max(200, self._quiet * 1000 / 6)))
        changes_seen = awatch(
            self._root,
            watch_filter=self._filter,
            stop_event=self._stop,
            debounce=debounce,
            step=50,
            recursive=True,
            force_polling=self._polling,
            poll_delay_ms=poll_ms,
        )
        async with contextlib.aclosing(changes_seen):
            async for changes in changes_seen:
                added = False
                for change, path in changes:
                    added = added or change == Change.added
                    key = self._key_of(path)
                    if key is not None:
                        self.touch(key)
                if added and not self._polling and watch_limit_reached(self._root):
                    return True  # leaving the block closes the watcher and its watches
        return False

    def _fall_back_to_polling(self) -> None:
        self._polling = True
        COMPILE_WATCH_LIMIT.inc()
        COMPILE_WATCH_POLLING.set(1)
        log.error(
            "the inotify watch limit is reached (%s; one watch per directory, shared by every "
            "process of this user): new directories under %s were not being watched. The "
            "compile-cache watcher now polls the tree instead until the agent restarts, and "
            "every key is checked again. Raise fs.inotify.max_user_watches, and look for a "
            "pod filling its compile cache with directories (prewarm compile ls).",
            watch_limit_text(),
            self._root,
        )
        for key in self._keys():
            self.touch(key)

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
