"""torch.compile caches: a directory per key on the disk tier, shared across nodes via S3.

``CompileCaches`` is what the daemon and the gRPC edge use. It serialises the
work on each key (restore, upload, evict) and decides when to do it; the
records and directories on disk are ``agent.compile.index``'s, the moves to
and from S3 ``agent.compile.transfer``'s.

Compile caches count towards the disk tier's budget and are evicted after
every evictable model (see ``extra_candidates``). Pods fill the directories;
``SettleWatcher`` reports a key once it has been quiet, and the facade then
uploads it when its content differs from what this node last uploaded or
restored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from agent._config import Settings
from agent._exceptions import Conflict, IntegrityError, InvalidRequest, NotFound, PrewarmError
from agent._uri import parse_uri
from agent.compile.index import CacheIndex, CacheRecord, CompileCacheInfo, has_artifacts
from agent.compile.keys import KEY_LENGTH, CompileKeyParts, compile_key, engine_env, normalise_parts
from agent.compile.lock import CompileLocks, LockEvent
from agent.compile.remote import RemoteCompileCaches
from agent.compile.transfer import CompileCacheTransfer, Fetched, PushOutcome, parts_of
from agent.compile.verdict import Verdict, judge
from agent.compile.watch import SettleWatcher
from agent.obs.metrics import COMPILE_CACHE_PHASE_SECONDS, COMPILE_LAUNCHES
from agent.source.interface import ObjectSource
from agent.store.budget import Candidate
from agent.store.store import Store

__all__ = ["CompileCacheInfo", "CompileCaches", "EnsuredCompileCache", "LaunchReady", "PushOutcome"]

log = logging.getLogger(__name__)

_MIN_KEY_PREFIX = 8
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class EnsuredCompileCache:
    info: CompileCacheInfo
    env: dict[str, str]
    restored: bool
    restore_seconds: float
    restore_note: str


@dataclass(frozen=True, slots=True)
class LaunchReady:
    """A launch's verdict, and what publishing its artifacts came to (None: not tried)."""

    key: str
    verdict: Verdict
    push: PushOutcome | None


class CompileCaches:
    """Every compile cache on the node; an async context manager that owns its watcher."""

    def __init__(self, settings: Settings, store: Store, source: ObjectSource) -> None:
        self._settings = settings.compile_cache
        self._store = store
        self._index = CacheIndex(settings.tiers.disk_root / "compile")
        uri = self._settings.uri
        self._transfer = (
            CompileCacheTransfer(
                RemoteCompileCaches(source, parse_uri(uri)),
                self._index,
                room=self._room,
                restore_timeout=self._settings.restore_timeout_seconds,
            )
            if uri
            else None
        )
        # One operation per key at a time: restore, upload, evict.
        self._key_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.locks = CompileLocks()
        self._watcher = SettleWatcher(self._index.root, self._settings.quiet_seconds, self._settled)

    # -- lifetime ----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self._index.load()
        self._store.attach_extra("disk", self)
        await self._watcher.__aenter__()
        # Whatever pods wrote while the agent was down is checked once.
        for key in self._index:
            self._watcher.touch(key)
        log.info(
            "compile caches ready",
            extra={"compile_caches": len(self._index), "remote": self._settings.uri or ""},
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.locks.close()
        await self._watcher.__aexit__(exc_type, exc, tb)

    # -- queries -------------------------------------------------------------------------------

    def statistics(self) -> tuple[int, int]:
        """(number of compile caches, their bytes as last measured)."""
        return len(self._index), self._index.total_bytes()

    async def caches(self) -> list[CompileCacheInfo]:
        """Every compile cache, with sizes measured now."""
        for key, record in self._index.items():
            await self._index.measure(key, record)
        infos = (self._index.info(key, record) for key, record in self._index.items())
        return sorted(infos, key=lambda info: (-info.last_used, info.key))

    def find(self, ref: str) -> str:
        """The key a full key or a unique prefix (8+ hex digits) names."""
        prefix = ref.strip().lower()
        if not (_MIN_KEY_PREFIX <= len(prefix) <= KEY_LENGTH) or not set(prefix) <= _HEX:
            raise InvalidRequest(
                f"{ref!r} is not a compile-cache key (8 to {KEY_LENGTH} hex digits). "
                "Copy one from `prewarm compile ls`."
            )
        matches = [key for key in self._index if key.startswith(prefix)]
        if not matches:
            raise NotFound(
                f"No compile cache has a key starting with {prefix}. See `prewarm compile ls`."
            )
        if len(matches) > 1:
            raise InvalidRequest(
                f"Key prefix {prefix} matches {len(matches)} compile caches; give more digits."
            )
        return matches[0]

    # -- the pod's request -----------------------------------------------------------------------

    async def ensure(
        self,
        parts: CompileKeyParts,
        *,
        skip_restore: bool = False,
        client_name: str = "",
        publish_on_ready: bool = False,
    ) -> EnsuredCompileCache:
        """The directory for ``parts``: as it is, restored from S3, or new and empty.

        ``publish_on_ready``: the caller will report its engine ready (``ready``);
        from then on the key is uploaded only at a ready report, never when quiet.
        """
        canonical = normalise_parts(parts)
        key = compile_key(canonical)
        directory = self._index.directory(key)
        # A key on the node is answered without its lock: an upload of it may
        # hold the lock for a while, and the pod has no reason to wait for that.
        record = self._index.get(key)
        if record is not None and directory.is_dir():
            return await self._hit(key, record, publish_on_ready)
        async with self._key_locks[key]:
            record = self._index.get(key)
            if record is not None and directory.is_dir():
                return await self._hit(key, record, publish_on_ready)
            fetched: Fetched | None = None
            seconds = 0.0
            if skip_restore:
                note = "restore skipped on request"
            elif self._transfer is None:
                note = "compile_cache.uri is not set: local only"
            else:
                restore = await self._transfer.restore_for_pod(key)
                fetched, seconds, note = restore.fetched, restore.seconds, restore.note
            record = await self._publish(key, canonical, fetched, publish_on_ready)
        log.info(
            "compile cache %s for %s: %s",
            key,
            client_name or "anonymous",
            f"restored in {seconds:.2f} s" if fetched else f"new ({note})",
            extra={"key": key, "client": client_name, "restored": fetched is not None},
        )
        return await self._ensured(
            key, record, restored=fetched is not None, seconds=seconds, note=note
        )

    async def _hit(
        self, key: str, record: CacheRecord, publish_on_ready: bool
    ) -> EnsuredCompileCache:
        record.last_used = time.time()
        record.publish_on_ready |= publish_on_ready
        await self._index.save(key, record, strict=False)
        return await self._ensured(key, record, restored=False, seconds=0.0, note="")

    async def pull(self, ref: str) -> EnsuredCompileCache:
        """Restore a key from S3 now, replacing the local directory; errors are raised."""
        key = self._key_or_full(ref)
        if self._transfer is None:
            raise Conflict("compile_cache.uri is not set; there is nothing to pull from.")
        async with self._key_locks[key]:
            if self.locks.in_use(key):
                raise Conflict(
                    f"Compile cache {key} is in use (a pod holds its compile lock); pull it "
                    "after the pod lets go."
                )
            started = time.monotonic()
            fetched = await self._transfer.fetch(key)
            if fetched is None:
                raise NotFound(
                    f"Nothing was uploaded for compile cache {key} at {self._transfer.uri_of(key)}."
                )
            known = self._index.get(key)
            try:
                parts = known.parts if known is not None else parts_of(fetched.manifest)
            except IntegrityError:
                await self._index.discard(fetched.staging)
                raise
            if known is not None:
                await self._index.remove(key)
            seconds = time.monotonic() - started
            COMPILE_CACHE_PHASE_SECONDS.labels("restore").observe(seconds)
            record = await self._publish(key, parts, fetched)
        return await self._ensured(key, record, restored=True, seconds=seconds, note="")

    async def ready(self, ref: str, client_name: str = "") -> LaunchReady:
        """A launch on ``ref``'s key is ready: judge what it compiled, then publish it."""
        key = self.find(ref)
        async with self._key_locks[key]:
            record = self._index.get(key)
            if record is None:
                raise NotFound(f"Compile cache {key} is not on this node.")
            now = await self._index.sub_caches(key)
            verdict = judge(record.baseline, now, client=client_name)
            record.baseline, record.last_verdict = now, verdict
            await self._index.save(key, record, strict=False)
            engine, said = record.parts.engine, verdict.describe()
            COMPILE_LAUNCHES.labels(engine, verdict.verdict.replace(" ", "_")).inc()
            who = client_name or "anonymous"
            log.info("compile cache %s (%s) for %s: %s", key, engine, who, said, extra={"key": key})
            push: PushOutcome | None = None
            if self._transfer is not None and self._settings.upload:
                await self._index.measure(key, record)
                try:
                    push = await self._transfer.upload(key, record)
                except PrewarmError as exc:
                    push = PushOutcome(False, self._transfer.uri_of(key), "", 0, str(exc))
        return LaunchReady(key, verdict, push)

    async def push(self, ref: str) -> PushOutcome:
        """Pack and upload a key now (skipped when S3 already has the same content)."""
        key = self.find(ref)
        if self._transfer is None:
            return PushOutcome(False, "", "", 0, "compile_cache.uri is not set")
        async with self._key_locks[key]:
            record = self._index.get(key)
            if record is None:
                raise NotFound(f"Compile cache {key} is not on this node.")
            return await self._transfer.upload(key, record)

    async def evict(self, ref: str) -> list[CompileCacheInfo]:
        """Remove a key from this node now, unless a pod holds its compile lock."""
        key = self.find(ref)
        if self.locks.in_use(key):
            raise Conflict(
                f"Compile cache {key} is in use: {self.locks.holder(key) or 'a pod'} holds its "
                "compile lock. Evict it after the pod lets go."
            )
        async with self._key_locks[key]:
            record = self._index.get(key)
            if record is None:
                raise NotFound(f"Compile cache {key} is not on this node.")
            await self._index.measure(key, record)
            info = self._index.info(key, record)
            await self._drop(key, "manual")
        return [info]

    def hold_lock(
        self, parts: CompileKeyParts, client_name: str
    ) -> AsyncGenerator[LockEvent, None]:
        """The node's compile lock for ``parts``' key (see CompileLocks.hold)."""
        key = compile_key(parts)
        directory = self._index.directory(key)
        return self.locks.hold(key, client_name or "anonymous", lambda: has_artifacts(directory))

    # -- the store's extra usage (counted in the disk budget, evicted last) ------------------------

    def extra_bytes(self) -> int:
        return self.statistics()[1]

    def extra_candidates(self) -> list[Candidate]:
        busy = self.locks.busy_keys()
        return [
            Candidate(
                key=key,
                size=record.bytes,
                last_used=record.last_used,
                protected=key in busy or self._key_locks[key].locked(),
            )
            for key, record in self._index.items()
        ]

    async def evict_extra(self, keys: Sequence[str], reason: str) -> int:
        freed = 0
        for key in keys:
            record = self._index.get(key)
            if record is None or self.locks.in_use(key) or self._key_locks[key].locked():
                continue
            async with self._key_locks[key]:
                freed += record.bytes
                await self._drop(key, reason)
        return freed

    # -- internals -------------------------------------------------------------------------------

    def _key_or_full(self, ref: str) -> str:
        try:
            return self.find(ref)
        except NotFound:
            key = ref.strip().lower()
            if len(key) == KEY_LENGTH and set(key) <= _HEX:
                return key  # not on this node yet; pull may bring it
            raise

    async def _ensured(
        self, key: str, record: CacheRecord, *, restored: bool, seconds: float, note: str
    ) -> EnsuredCompileCache:
        env = engine_env(record.parts.engine, self._index.directory(key), key)
        env = await self._index.checked_env(key, env)
        info = self._index.info(key, record)
        return EnsuredCompileCache(info, env, restored, seconds, note)

    async def _publish(
        self, key: str, parts: CompileKeyParts, fetched: Fetched | None, on_ready: bool = False
    ) -> CacheRecord:
        """Record the key, then move its directory (restored or new) into place."""
        if fetched is None:
            record, staging = CacheRecord.new(parts), self._index.scratch(key)
        else:
            record, staging = fetched.record(parts), fetched.staging
        record.publish_on_ready = on_ready
        await self._index.publish(key, record, staging)
        return record

    async def _settled(self, key: str) -> None:
        """The watcher's report: ``key`` changed and has been quiet since."""
        if key not in self._index:
            return
        async with self._key_locks[key]:
            record = self._index.get(key)
            if record is None or not self._index.directory(key).is_dir():
                return
            await self._index.measure(key, record)
            if await self._index.has_artifacts(key):
                released = self.locks.release_waiters(key)
                if released:
                    log.info("compile cache %s is warm: let %d waiting pod(s) go", key, released)
            if self._transfer is None or not self._settings.upload:
                return
            if record.publish_on_ready:
                log.debug("compile cache %s waits for a launch to report ready", key)
                return
            try:
                outcome = await self._transfer.upload(key, record)
            except PrewarmError as exc:
                log.warning(
                    "upload of compile cache %s failed (%s); it is retried after the next "
                    "change, or with `prewarm compile push`",
                    key,
                    exc,
                    extra={"key": key},
                )
                return
        if outcome.uploaded:
            log.info("uploaded compile cache %s to %s", key, outcome.uri, extra={"key": key})
        else:
            log.debug("compile cache %s not uploaded: %s", key, outcome.skipped_reason)

    async def _drop(self, key: str, reason: str) -> None:
        await self._index.remove(key)
        log.info("evicted compile cache %s: %s", key, reason, extra={"key": key})

    def _room(self) -> int:
        """Bytes a restore may add: within both the disk budget and the free space."""
        limits = self._store.limits("disk")
        within_budget = limits.budget_bytes - self._store.used_bytes("disk")
        return max(0, min(limits.fs_free_bytes - limits.reserve_bytes, within_budget))
