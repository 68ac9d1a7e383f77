"""Held leases that outlive a restart of the agent, for as long as their holders do.

A lease held on the lease socket ends when its connection closes, and a
restarting agent closes them all: an engine started by ``prewarm exec`` kept
running on a snapshot that showed no lease and could be evicted. ``LeaseKeeper``
keeps the table's held leases in a file (``agent.leases.held_file``) and, when
the agent starts, takes back each one whose holder is still the same live
process (pid, uid and start time): as an *orphaned* lease that protects its
snapshot until that process comes back to the lease socket with the lease's id
(``LeaseTable.hold``) or exits, which a pidfd watched on the event loop tells at
once. Holders that died meanwhile, or snapshots that are gone, are dropped.

Order in the daemon: enter the keeper (restore) before the lease socket serves,
and ``saving()`` after it, so that a stopping agent writes its last state before
the lease socket closes the connections (which ends every lease in memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import Self

from agent.leases.held_file import HeldLease, load_held_leases, save_held_leases
from agent.leases.holders import (
    boot_id,
    effective_uid,
    open_pidfd,
    pidfd_exited,
    process_start_time,
)
from agent.leases.table import LeaseTable

__all__ = ["LeaseKeeper"]

log = logging.getLogger("agent.leases")


class LeaseKeeper:
    """Restores held leases at start, ends them when their holders exit, saves them on change.

    ``snapshot_exists(key)`` says whether the store still has a snapshot: a lease
    on one that is gone is not restored.
    """

    def __init__(
        self, table: LeaseTable, path: Path, snapshot_exists: Callable[[str], bool]
    ) -> None:
        """``path`` holds the held leases across restarts; ``snapshot_exists`` asks the store."""
        self._table = table
        self._path = path
        self._snapshot_exists = snapshot_exists
        self._boot = boot_id()
        # pidfd of each restored lease's holder, by the lease's restored id.
        self._watches: dict[str, int] = {}
        # The held leases last written: most changes (grants, renewals) leave them be.
        self._written: frozenset[str] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def path(self) -> Path:
        """The file the held leases are kept in."""
        return self._path

    async def __aenter__(self) -> Self:
        """Restore the held leases whose holders still run, and watch those holders."""
        self._loop = asyncio.get_running_loop()
        leases = await asyncio.to_thread(load_held_leases, self._path, self._boot)
        restored = sum(self._restore(lease) for lease in leases)
        if leases:
            log.info(
                "restored %d of %d held leases whose holders still run",
                restored,
                len(leases),
                extra={"restored": restored, "found": len(leases)},
            )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop watching the holders (the leases stay in the file)."""
        for lease_id in list(self._watches):
            self._unwatch(lease_id)

    @contextlib.asynccontextmanager
    async def saving(self) -> AsyncIterator[None]:
        """Rewrite the file after each change of the table while the block runs, and at its end.

        Leave it before the lease socket closes its connections: what is in the
        file then is what the next start restores.
        """
        saver = asyncio.create_task(self._save_on_change(), name="prewarm-lease-saver")
        try:
            yield
        finally:
            saver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await saver
            await self._save()

    def _restore(self, lease: HeldLease) -> bool:
        """Adopt ``lease`` if its snapshot is there and its holder is the same live process."""
        holder = lease.holder
        if not self._snapshot_exists(lease.key):
            return False
        pidfd = open_pidfd(holder.pid)
        if pidfd is None:
            return False
        alive = (
            process_start_time(holder.pid) == holder.start_time
            and effective_uid(holder.pid) == holder.uid
            and not pidfd_exited(pidfd)
        )
        if not alive:
            os.close(pidfd)
            return False
        self._table.adopt(lease.orphan())
        self._watches[lease.id] = pidfd
        assert self._loop is not None
        self._loop.add_reader(pidfd, self._holder_exited, lease.id)
        return True

    def _holder_exited(self, lease_id: str) -> None:
        """A restored lease's holder exited before it came back: the lease ends now."""
        self._unwatch(lease_id)
        ended = self._table.unhold(lease_id)
        if ended is not None and ended.holder is not None:
            log.info(
                "lease ended: its holder exited before coming back after the restart",
                extra={"key": ended.key, "client": ended.client_name, "pid": ended.holder.pid},
            )

    def _unwatch(self, lease_id: str) -> None:
        pidfd = self._watches.pop(lease_id, None)
        if pidfd is not None:
            if self._loop is not None:
                self._loop.remove_reader(pidfd)
            os.close(pidfd)

    async def _save_on_change(self) -> None:
        while True:
            changed = self._table.changes()
            await self._save()
            await changed.wait()

    async def _save(self) -> None:
        """Write the held leases if they changed; a failure is logged and the agent goes on."""
        records = self._table.active()
        live = {record.id for record in records}
        # A restored lease taken back by its holder is watched by its connection now.
        for lease_id in [i for i in self._watches if i not in live]:
            self._unwatch(lease_id)
        held = frozenset(record.id for record in records if record.held)
        if held == self._written:
            return
        try:
            await asyncio.to_thread(save_held_leases, self._path, records, self._boot)
            self._written = held
        except OSError as exc:
            log.warning(
                "cannot save the held leases to %s (%s): a restart now would drop them",
                self._path,
                exc,
            )
