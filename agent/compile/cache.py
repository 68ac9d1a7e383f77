"""torch.compile caches: a directory per key on the disk tier, shared across nodes via S3.

``CompileCaches`` is what the daemon and the gRPC edge use. Every cache is a
key within a compile domain (``agent.compile.domains``): each call names the
caller's ``Scope``, which keys it may make and see, so one tenant never
reaches another's caches, locks or uploads. It serialises the work on each
key (restore, upload, evict) and decides when to do it; the records and
directories on disk are ``agent.compile.index``'s (one index per domain), the
moves to and from S3 ``agent.compile.transfer``'s.

Compile caches count towards the disk tier's budget and are evicted after
every evictable model (see ``extra_candidates``). Pods fill the directories;
``SettleWatcher`` reports a key once it has been quiet, and the facade then
uploads it when its content differs from what this node last uploaded or
restored.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from prometheus_client import Counter

from agent._config import CompileCacheSettings, Settings
from agent._exceptions import (
    Conflict,
    IntegrityError,
    InvalidRequest,
    NoSpace,
    NotFound,
    PrewarmError,
    quoted,
)
from agent._uri import parse_uri
from agent._vocabulary import check_launch_phases
from agent.compile.archive import is_ignored
from agent.compile.domains import (
    NODE_SCOPE,
    CacheRef,
    DomainSpec,
    Scope,
    domain_signing,
    domain_specs,
    prepare_compile_root,
)
from agent.compile.index import CacheIndex, CacheRecord, CompileCacheReport, has_artifacts
from agent.compile.keys import KEY_LENGTH, CompileKeyParts, compile_key, engine_env, normalise_parts
from agent.compile.lock import CompileLocks, LockEvent
from agent.compile.remote import RemoteCompileCaches
from agent.compile.signing import Signing
from agent.compile.transfer import (
    CompactOutcome,
    CompileCacheTransfer,
    Fetched,
    PushOutcome,
    parts_of,
)
from agent.compile.verdict import MISS, PARTIAL_MISS, Verdict, judge
from agent.compile.watch import SettleWatcher
from agent.compile.why import Nearest, closer, nearest_key
from agent.obs.metrics import (
    COMPILE_CACHE_PHASE_SECONDS,
    COMPILE_KEYS_REFUSED,
    COMPILE_LAUNCHES,
    ENGINE_LAUNCH_SECONDS,
    REGISTRY,
)
from agent.source.interface import ObjectSource
from agent.store.budget import Candidate
from agent.store.catalog import Store

__all__ = [
    "NODE_SCOPE",
    "CacheRef",
    "CompactOutcome",
    "CompileCacheReport",
    "CompileCaches",
    "EnsuredCompileCache",
    "Explanation",
    "LaunchReady",
    "PushOutcome",
    "Scope",
]

log = logging.getLogger(__name__)

# Misses by the key part that differs from the nearest cached key of the same model.
COMPILE_MISS_PARTS = Counter(
    "prewarm_compile_miss_parts",
    "Launches that missed (or partly missed) their compile cache, by engine and by each key "
    "part that differs from the nearest cached key of the same model (extras by name).",
    ["engine", "part"],
    registry=REGISTRY,
)
# Extras are named by pods: each name is cut short, and past this many distinct names
# (the fixed parts and the usual extras fit well within it) a new one counts as "other".
_MAX_PART_LENGTH = 64
_MAX_PART_LABELS = 128
_part_labels: set[str] = set()


def _metric_part(name: str) -> str:
    """A key part's name as a label value: printable, bounded in length and in number."""
    label = "".join(c if c.isalnum() or c in "._-" else "_" for c in name[:_MAX_PART_LENGTH])
    if label not in _part_labels and len(_part_labels) >= _MAX_PART_LABELS:
        return "other"
    _part_labels.add(label)
    return label


_MIN_KEY_PREFIX = 8
_HEX = frozenset("0123456789abcdef")
_KEY = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class EnsuredCompileCache:
    """A key's compile cache as handed to a pod: its record, env and how it was made."""

    info: CompileCacheReport
    env: dict[str, str]
    restored: bool
    restore_seconds: float
    restore_note: str


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why a key misses: the nearest other key of its model (on the node or in S3), if any."""

    key: str
    nearest: Nearest | None
    # Why S3 was not searched, or could not be ("" when it was).
    s3_note: str


@dataclass(frozen=True, slots=True)
class LaunchReady:
    """A launch's verdict, and what publishing its artifacts came to (None: not tried)."""

    key: str
    verdict: Verdict
    push: PushOutcome | None
    # On a miss or partial miss: the nearest other key of the model, on the node or in S3.
    nearest: Nearest | None = None


class _Domain:
    """One compile domain's index, S3 prefix and per-key operation locks."""

    def __init__(
        self,
        spec: DomainSpec,
        root: Path,
        source: ObjectSource,
        settings: CompileCacheSettings,
        *,
        signing: Signing,
        room: Callable[[], int],
    ) -> None:
        self.name = spec.name
        self.index = CacheIndex(root / spec.name, spec.gid)
        uri = settings.uri
        self.transfer = (
            CompileCacheTransfer(
                RemoteCompileCaches(
                    source,
                    parse_uri(f"{parse_uri(uri)}{spec.name}/"),
                    why_timeout=settings.why_timeout_seconds,
                    signing=signing,
                ),
                self.index,
                room=room,
                restore_timeout=settings.restore_timeout_seconds,
                min_upload_interval=settings.min_upload_interval_seconds,
            )
            if uri
            else None
        )
        # One operation per key at a time: restore, upload, evict.
        self.key_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # Keys being compacted in S3 now (by request; an upload's compaction holds its lock).
        self.compacting: set[str] = set()
        # New keys being restored or made now, not yet in the index: they count
        # against the domain's key cap too.
        self.creating = 0


class CompileCaches:
    """Every compile cache on the node; an async context manager that owns its watcher."""

    def __init__(self, settings: Settings, store: Store, source: ObjectSource) -> None:
        self._settings = settings.compile_cache
        self._store = store
        self._root = settings.tiers.disk_root / "compile"
        # Uploads put off until their key may go up again (min_upload_interval_seconds):
        # one timer per key, whatever the number of changes meanwhile.
        self._later: dict[str, asyncio.TimerHandle] = {}
        signing = domain_signing(settings)
        self._domains = {
            name: _Domain(
                spec, self._root, source, self._settings, signing=signing[name], room=self._room
            )
            for name, spec in domain_specs(settings).items()
        }
        self.locks = CompileLocks(self._settings.lock_wait_seconds)
        self._watcher = SettleWatcher(
            self._root,
            self._settings.quiet_seconds,
            self._settled,
            key_of=self._watched_key,
            keys=lambda: [str(ref) for ref, _ in self._records()],
        )

    # -- lifetime ----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        removed = await asyncio.to_thread(prepare_compile_root, self._root, list(self._domains))
        if removed:
            log.warning(
                "removed %d entries of %s that belong to no compile domain (caches laid out "
                "before per-tenant domains, or of tenants no longer configured): %s",
                len(removed),
                self._root,
                ", ".join(removed[:8]) + (", ..." if len(removed) > 8 else ""),
            )
        for domain in self._domains.values():
            await domain.index.load()
        self._store.attach_extra("disk", self)
        await self._watcher.__aenter__()
        # Whatever pods wrote while the agent was down is checked once.
        for ref, _ in self._records():
            self._watcher.touch(str(ref))
        log.info(
            "compile caches ready",
            extra={
                "compile_caches": self.statistics()[0],
                "domains": sorted(self._domains),
                "remote": self._settings.uri or "",
            },
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.locks.close()
        for timer in self._later.values():
            timer.cancel()
        self._later.clear()
        await self._watcher.__aexit__(exc_type, exc, tb)

    # -- queries -------------------------------------------------------------------------------

    def statistics(self, scope: Scope = NODE_SCOPE) -> tuple[int, int]:
        """(number of compile caches ``scope`` sees, their bytes as last measured)."""
        indexes = [d.index for d in self._domains.values() if scope.sees(d.name)]
        return sum(len(i) for i in indexes), sum(i.total_bytes() for i in indexes)

    async def caches(self, scope: Scope = NODE_SCOPE) -> list[CompileCacheReport]:
        """Every compile cache ``scope`` sees, with sizes measured now."""
        infos = []
        for ref, record in self._records(scope):
            index = self._domains[ref.domain].index
            await index.measure(ref.key, record)
            infos.append(index.info(ref.key, record))
        return sorted(infos, key=lambda info: (-info.last_used, info.domain, info.key))

    def find(self, ref: str, scope: Scope = NODE_SCOPE) -> CacheRef:
        """The cache a key or a unique key prefix (8+ hex digits) names, among those
        ``scope`` sees; ``<domain>/<key>`` names one domain's."""
        domains, prefix = self._parse_ref(ref, scope)
        matches = [
            CacheRef(domain, key)
            for domain in domains
            for key in self._domains[domain].index
            if key.startswith(prefix)
        ]
        if not matches:
            raise NotFound(
                f"No compile cache has a key starting with {prefix}. See `prewarm compile ls`."
            )
        if len(matches) > 1:
            raise InvalidRequest(
                f"Key prefix {prefix} matches {len(matches)} compile caches; give more digits, "
                "or <domain>/<key>."
            )
        return matches[0]

    def _parse_ref(self, ref: str, scope: Scope) -> tuple[list[str], str]:
        """The domains ``ref`` may name a key of (those ``scope`` sees), and its key prefix."""
        domain, slash, prefix = ref.strip().rpartition("/")
        prefix = prefix.lower()
        if not (_MIN_KEY_PREFIX <= len(prefix) <= KEY_LENGTH) or not set(prefix) <= _HEX:
            raise InvalidRequest(
                f"{quoted(ref)} is not a compile-cache key (8 to {KEY_LENGTH} hex digits, or "
                "<domain>/<key>). Copy one from `prewarm compile ls`."
            )
        if not slash:
            return [d for d in self._domains if scope.sees(d)], prefix
        # Another domain's name answers as an unknown key does: its keys are not the caller's.
        return ([domain] if domain in self._domains and scope.sees(domain) else []), prefix

    # -- the pod's request -----------------------------------------------------------------------

    async def ensure(
        self,
        parts: CompileKeyParts,
        *,
        scope: Scope = NODE_SCOPE,
        skip_restore: bool = False,
        client_name: str = "",
        publish_on_ready: bool = False,
    ) -> EnsuredCompileCache:
        """The directory for ``parts`` in ``scope``'s domain: as it is, restored, or new.

        ``publish_on_ready``: the caller will report its engine ready (``ready``);
        from then on the key is uploaded only at a ready report, never when quiet.
        A new key past the domain's ``max_keys_per_domain`` is NoSpace.
        """
        canonical = normalise_parts(parts)
        domain = self._domain(scope.domain)
        ref = CacheRef(domain.name, compile_key(canonical))
        key, index = ref.key, domain.index
        # A key on the node is answered without its lock: an upload of it may
        # hold the lock for a while, and the pod has no reason to wait for that.
        record = index.get(key)
        if record is not None and index.directory(key).is_dir():
            return await self._hit(ref, record, publish_on_ready)
        async with domain.key_locks[key]:
            record = index.get(key)
            if record is not None and index.directory(key).is_dir():
                return await self._hit(ref, record, publish_on_ready)
            self._admit_new_key(domain)
            domain.creating += 1
            try:
                fetched: Fetched | None = None
                seconds = 0.0
                if skip_restore:
                    note = "restore skipped on request"
                elif domain.transfer is None:
                    note = "compile_cache.uri is not set: local only"
                else:
                    restore = await domain.transfer.restore_for_pod(key)
                    fetched, seconds, note = restore.fetched, restore.seconds, restore.note
                record = await self._publish(ref, canonical, fetched, publish_on_ready)
            finally:
                domain.creating -= 1
        log.info(
            "compile cache %s for %s: %s",
            ref,
            client_name or "anonymous",
            f"restored in {seconds:.2f} s" if fetched else f"new ({note})",
            extra={"key": key, "client": client_name, "restored": fetched is not None},
        )
        return await self._ensured(
            ref, record, restored=fetched is not None, seconds=seconds, note=note
        )

    def _admit_new_key(self, domain: _Domain) -> None:
        """NoSpace when ``domain`` holds (or is making) as many keys as it may."""
        limit = self._settings.max_keys_per_domain
        held = len(domain.index) + domain.creating
        if held >= limit:
            COMPILE_KEYS_REFUSED.labels(domain.name).inc()
            raise NoSpace(
                f"Compile domain {domain.name!r} holds {held} compile caches on this node, the "
                f"most compile_cache.max_keys_per_domain allows ({limit}). Reuse a key (the "
                "same engine, versions, model and parallelism), or ask the node's admin to "
                "evict unused ones (prewarm compile evict) or raise the limit; this launch "
                "compiles without a cache."
            )

    async def _hit(
        self, ref: CacheRef, record: CacheRecord, publish_on_ready: bool
    ) -> EnsuredCompileCache:
        record.last_used = time.time()
        record.publish_on_ready |= publish_on_ready
        await self._domains[ref.domain].index.save(ref.key, record, strict=False)
        return await self._ensured(ref, record, restored=False, seconds=0.0, note="")

    async def pull(self, ref: str, scope: Scope = NODE_SCOPE) -> EnsuredCompileCache:
        """Restore a key from S3 now, replacing the local directory; errors are raised."""
        found = self._key_or_full(ref, scope)
        domain, key = self._domains[found.domain], found.key
        if domain.transfer is None:
            raise Conflict("compile_cache.uri is not set; there is nothing to pull from.")
        async with domain.key_locks[key]:
            if self.locks.in_use(str(found)):
                raise Conflict(
                    f"Compile cache {key} is in use (a pod holds its compile lock); pull it "
                    "after the pod lets go."
                )
            known = domain.index.get(key)
            if known is None:
                self._admit_new_key(domain)
            domain.creating += known is None
            try:
                started = time.monotonic()
                record = await self._replace_from_s3(found, known)
            finally:
                domain.creating -= known is None
            seconds = time.monotonic() - started
            COMPILE_CACHE_PHASE_SECONDS.labels("restore").observe(seconds)
        return await self._ensured(found, record, restored=True, seconds=seconds, note="")

    async def _replace_from_s3(self, ref: CacheRef, known: CacheRecord | None) -> CacheRecord:
        """Fetch ``ref`` from S3 and put it in place of the local copy (the key's lock held)."""
        domain = self._domains[ref.domain]
        assert domain.transfer is not None
        fetched = await domain.transfer.fetch(ref.key)
        if fetched is None:
            raise NotFound(
                f"Nothing was uploaded for compile cache {ref.key} at "
                f"{domain.transfer.uri_of(ref.key)}."
            )
        try:
            parts = known.parts if known is not None else parts_of(fetched.manifest)
        except IntegrityError:
            await domain.index.discard(fetched.staging)
            raise
        if known is not None:
            await domain.index.remove(ref.key)
        return await self._publish(ref, parts, fetched)

    async def ready(
        self,
        ref: str,
        client_name: str = "",
        scope: Scope = NODE_SCOPE,
        launch_phases: Mapping[str, float] | None = None,
    ) -> LaunchReady:
        """A launch on ``ref``'s key is ready: judge what it compiled, then publish it.

        A miss or partial miss also names the nearest other key of the model
        (on the node or in S3), in the answer, the log line and the metric. Where the
        launch's time went (``launch_phases``, checked) is counted by engine and phase.
        """
        phases = check_launch_phases(launch_phases or {})
        found = self.find(ref, scope)
        domain, key = self._domains[found.domain], found.key
        async with domain.key_locks[key]:
            record = domain.index.get(key)
            if record is None:
                raise NotFound(f"Compile cache {key} is not on this node.")
            now = await domain.index.sub_caches(key)
            verdict = judge(record.baseline, now, client=client_name)
            record.baseline, record.last_verdict = now, verdict
            await domain.index.save(key, record, strict=False)
            push = await self._publish_ready(domain, key, record)
        # Outside the key's lock: listing S3 may be slow, and the verdict is kept already.
        nearest: Nearest | None = None
        try:
            if verdict.verdict in (MISS, PARTIAL_MISS):
                nearest = (await self._explain(domain, key, record.parts)).nearest
        finally:
            # Logged and counted even when the caller went away during the lookup.
            self._report_verdict(
                found, record.parts.engine, verdict, nearest=nearest, client=client_name
            )
            for phase, seconds in phases.items():
                ENGINE_LAUNCH_SECONDS.labels(record.parts.engine, phase).observe(seconds)
        return LaunchReady(key, verdict, push, nearest)

    async def _publish_ready(
        self, domain: _Domain, key: str, record: CacheRecord
    ) -> PushOutcome | None:
        """Upload a key a launch reported ready (the key's lock held); None when uploads are off."""
        if domain.transfer is None or not self._settings.upload:
            return None
        await domain.index.measure(key, record)
        try:
            return await domain.transfer.upload(key, record)
        except PrewarmError as exc:
            return PushOutcome(False, domain.transfer.uri_of(key), "", 0, str(exc))

    @staticmethod
    def _report_verdict(
        ref: CacheRef, engine: str, verdict: Verdict, *, nearest: Nearest | None, client: str
    ) -> None:
        """The verdict's log line and metrics; each part that differs from the nearest counts."""
        COMPILE_LAUNCHES.labels(engine, verdict.verdict.replace(" ", "_")).inc()
        for change in nearest.changes if nearest else ():
            COMPILE_MISS_PARTS.labels(engine, _metric_part(change.name)).inc()
        said = verdict.describe() + (f"; {nearest.describe()}" if nearest else "")
        who = client or "anonymous"
        log.info("compile cache %s (%s) for %s: %s", ref, engine, who, said, extra={"key": ref.key})

    async def explain(self, ref: str, scope: Scope = NODE_SCOPE) -> Explanation:
        """Why ``ref``'s key (on this node) misses: the nearest other key of its model."""
        found = self.find(ref, scope)
        domain = self._domains[found.domain]
        record = domain.index.get(found.key)
        if record is None:
            raise NotFound(f"Compile cache {found.key} is not on this node.")
        return await self._explain(domain, found.key, record.parts)

    async def _explain(self, domain: _Domain, key: str, parts: CompileKeyParts) -> Explanation:
        """The nearest key of ``parts``' model in ``domain``: the node's first, then S3's."""
        cached = ((other, record.parts) for other, record in domain.index.items())
        on_node = nearest_key(parts, cached, own_key=key)
        in_s3, note = await self._nearest_in_s3(domain, key, parts)
        return Explanation(key, closer(on_node, in_s3), note)

    async def _nearest_in_s3(
        self, domain: _Domain, key: str, parts: CompileKeyParts
    ) -> tuple[Nearest | None, str]:
        """The nearest key of the model that only S3 holds, and what S3 could not tell."""
        only_node = "only this node's keys were compared"
        if domain.transfer is None:
            return None, f"compile_cache.uri is not set: {only_node}"
        found = await domain.transfer.keys_like(parts)
        uploaded = ((other, p) for other, p in found.keys if other not in domain.index)
        nearest = nearest_key(parts, uploaded, own_key=key, location="s3", signers=found.signers)
        note = found.note + (f": {only_node}" if found.note and not found.keys else "")
        return nearest, note

    async def compact(self, ref: str, scope: Scope = NODE_SCOPE) -> CompactOutcome:
        """Make a key's archives in S3 one archive now (a key on this node, or a full key).

        Not under the key's lock: compaction changes only S3, where its conditional
        manifest write already orders it against uploads (this node's and others'),
        and a pod's restore of the key must not wait for a whole key's download.
        """
        found = self._key_or_full(ref, scope)
        domain = self._domains[found.domain]
        if domain.transfer is None:
            raise Conflict("compile_cache.uri is not set; there is nothing in S3 to compact.")
        if found.key in domain.compacting:
            raise Conflict(f"Compile cache {found.key} is being compacted already.")
        domain.compacting.add(found.key)
        try:
            return await domain.transfer.compact(found.key)
        finally:
            domain.compacting.discard(found.key)

    async def push(self, ref: str, scope: Scope = NODE_SCOPE) -> PushOutcome:
        """Pack and upload a key now (skipped when S3 already has the same content);
        Conflict without compile_cache.uri."""
        found = self.find(ref, scope)
        domain, key = self._domains[found.domain], found.key
        if domain.transfer is None:
            # Nothing to push to is a setting to fix, as for pull and compact, not a skip.
            raise Conflict("compile_cache.uri is not set; there is nowhere to push to.")
        async with domain.key_locks[key]:
            record = domain.index.get(key)
            if record is None:
                raise NotFound(f"Compile cache {key} is not on this node.")
            return await domain.transfer.upload(key, record)

    async def evict(self, ref: str, scope: Scope = NODE_SCOPE) -> list[CompileCacheReport]:
        """Remove a key from this node now, unless a pod holds its compile lock."""
        found = self.find(ref, scope)
        domain, key = self._domains[found.domain], found.key
        if self.locks.in_use(str(found)):
            raise Conflict(
                f"Compile cache {key} is in use: {self.locks.holder(str(found)) or 'a pod'} "
                "holds its compile lock. Evict it after the pod lets go."
            )
        async with domain.key_locks[key]:
            record = domain.index.get(key)
            if record is None:
                raise NotFound(f"Compile cache {key} is not on this node.")
            await domain.index.measure(key, record)
            info = domain.index.info(key, record)
            await self._drop(found, "manual")
        return [info]

    def hold_lock(
        self, parts: CompileKeyParts, client_name: str, scope: Scope = NODE_SCOPE
    ) -> AsyncGenerator[LockEvent, None]:
        """The node's compile lock for ``parts``' key in ``scope``'s domain (CompileLocks.hold)."""
        domain = self._domain(scope.domain)
        ref = CacheRef(domain.name, compile_key(parts))
        directory, group = domain.index.directory(ref.key), domain.index.gid
        return self.locks.hold(
            str(ref), client_name or "anonymous", lambda: has_artifacts(directory, group)
        )

    # -- the store's extra usage (counted in the disk budget, evicted last) ------------------------

    def extra_bytes(self) -> int:
        """Bytes of every compile cache, counted in the disk tier's budget."""
        return self.statistics()[1]

    def extra_candidates(self) -> list[Candidate]:
        """Every key as an eviction candidate; keys locked, restoring or uploading are protected."""
        busy = self.locks.busy_keys()
        return [
            Candidate(
                key=str(ref),
                size=record.bytes,
                last_used=record.last_used,
                protected=str(ref) in busy or self._domains[ref.domain].key_locks[ref.key].locked(),
            )
            for ref, record in self._records()
        ]

    async def evict_extra(self, keys: Sequence[str], reason: str) -> int:
        """Evict ``keys`` (``<domain>/<key>``) for pressure, skipping any in use; bytes freed."""
        freed = 0
        for text in keys:
            ref = CacheRef.parse(text)
            domain = self._domains.get(ref.domain)
            record = domain.index.get(ref.key) if domain is not None else None
            if domain is None or record is None:
                continue
            if self.locks.in_use(text) or domain.key_locks[ref.key].locked():
                continue
            async with domain.key_locks[ref.key]:
                freed += record.bytes
                await self._drop(ref, reason)
        return freed

    # -- internals -------------------------------------------------------------------------------

    def _domain(self, name: str) -> _Domain:
        domain = self._domains.get(name)
        if domain is None:
            raise Conflict(f"This agent has no compile domain {name!r}; check [[access.sockets]].")
        return domain

    def _records(self, scope: Scope = NODE_SCOPE) -> list[tuple[CacheRef, CacheRecord]]:
        """Every cache ``scope`` sees, as it is now."""
        return [
            (CacheRef(domain.name, key), record)
            for domain in self._domains.values()
            if scope.sees(domain.name)
            for key, record in domain.index.items()
        ]

    def _watched_key(self, relative: str) -> str | None:
        """The cache a changed path under the compile root belongs to (``<domain>/<key>``)."""
        domain, _, rest = relative.partition("/")
        key, _, inside = rest.partition("/")
        if domain not in self._domains or not _KEY.fullmatch(key):
            return None  # the root itself, a domain's bookkeeping, or no domain's
        if inside and is_ignored(inside):
            return None
        return f"{domain}/{key}"

    def _key_or_full(self, ref: str, scope: Scope) -> CacheRef:
        """The cache ``ref`` names, or, for a full key not on this node yet, where it would be
        (pull may bring it): the named domain, else the caller's own."""
        try:
            return self.find(ref, scope)
        except NotFound:
            domains, key = self._parse_ref(ref, scope)
            if len(key) != KEY_LENGTH:
                raise
            if "/" not in ref:
                return CacheRef(scope.domain, key)
            if domains:
                return CacheRef(domains[0], key)
            raise

    async def _ensured(
        self, ref: CacheRef, record: CacheRecord, *, restored: bool, seconds: float, note: str
    ) -> EnsuredCompileCache:
        index = self._domains[ref.domain].index
        env = engine_env(record.parts.engine, index.directory(ref.key), ref.key)
        env = await index.checked_env(ref.key, env)
        info = index.info(ref.key, record)
        return EnsuredCompileCache(info, env, restored, seconds, note)

    async def _publish(
        self, ref: CacheRef, parts: CompileKeyParts, fetched: Fetched | None, on_ready: bool = False
    ) -> CacheRecord:
        """Record the key, then move its directory (restored or new) into place."""
        index = self._domains[ref.domain].index
        if fetched is None:
            record, staging = CacheRecord.new(parts), index.scratch(ref.key)
        else:
            record, staging = fetched.record(parts), fetched.staging
        record.publish_on_ready = on_ready
        await index.publish(ref.key, record, staging)
        return record

    async def _settled(self, text: str) -> None:
        """The watcher's report: the cache ``<domain>/<key>`` changed and has been quiet since."""
        ref = CacheRef.parse(text)
        domain, key = self._domains[ref.domain], ref.key
        if key not in domain.index:
            return
        async with domain.key_locks[key]:
            record = domain.index.get(key)
            if record is None or not domain.index.directory(key).is_dir():
                return
            await domain.index.measure(key, record)
            if await domain.index.has_artifacts(key):
                released = self.locks.release_waiters(text)
                if released:
                    log.info("compile cache %s is warm: let %d waiting pod(s) go", ref, released)
            if domain.transfer is None or not self._settings.upload:
                return
            if record.publish_on_ready:
                log.debug("compile cache %s waits for a launch to report ready", ref)
                return
            try:
                outcome = await domain.transfer.upload(key, record)
            except PrewarmError as exc:
                log.warning(
                    "upload of compile cache %s failed (%s); it is retried after the next "
                    "change, or with `prewarm compile push`",
                    ref,
                    exc,
                    extra={"key": key},
                )
                return
        if outcome.uploaded:
            log.info("uploaded compile cache %s to %s", ref, outcome.uri, extra={"key": key})
            return
        log.debug("compile cache %s not uploaded: %s", ref, outcome.skipped_reason)
        if (wait := domain.transfer.upload_wait(key)) and text not in self._later:
            # Too soon after the last upload: the watcher reports the key again then.
            self._later[text] = asyncio.get_running_loop().call_later(
                wait, self._report_again, text
            )

    def _report_again(self, text: str) -> None:
        """A put-off upload's time has come: the watcher reports its key again."""
        self._later.pop(text, None)
        self._watcher.touch(text)

    async def _drop(self, ref: CacheRef, reason: str) -> None:
        await self._domains[ref.domain].index.remove(ref.key)
        log.info("evicted compile cache %s: %s", ref, reason, extra={"key": ref.key})

    def _room(self) -> int:
        """Bytes a restore may add: within both the disk budget and the free space."""
        limits = self._store.limits("disk")
        within_budget = limits.budget_bytes - self._store.used_bytes("disk")
        return max(0, min(limits.fs_free_bytes - limits.reserve_bytes, within_budget))
