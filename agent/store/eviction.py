"""Placement and eviction: which tier a pull goes to, and what leaves to make room.

Snapshots are evicted least recently used first. Never evicted by pressure:
snapshots with a live lease or a request's claim, pinned snapshots, and pulls
in progress (which are not published yet, so they are never candidates).
Victims are chosen from a snapshot of the table, and removing one awaits, so
protection is checked again right before each victim leaves: a lease granted
meanwhile (a hit on a victim) keeps its snapshot, and ``make_room`` chooses
again for the bytes it did not free. The store's extras
(compile caches on the disk tier) go last: only when evicting every evictable
snapshot would not free enough, least recently used first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence

from agent._config import TierSettings
from agent._exceptions import Conflict, NoSpace
from agent._snapshot import Snapshot
from agent._vocabulary import TIER_NAMES, TierName
from agent.leases.table import LeaseRecord, LeaseTable
from agent.obs.metrics import EVICTIONS
from agent.store.budget import Candidate, TierLimits, pick_victims
from agent.store.catalog import Store
from agent.store.records import CachedModel

__all__ = ["Evictor"]

log = logging.getLogger(__name__)

# Rounds of choosing victims for one placement; each round after the first
# happens only when a victim became protected while the previous one ran.
_PLACEMENT_ROUNDS = 4


class Evictor:
    """Chooses the tier of each new pull and evicts what must go to make room."""

    def __init__(self, store: Store, leases: LeaseTable, settings: TierSettings) -> None:
        """``leases`` protect snapshots; ``settings`` give budgets, watermarks and fallback."""
        self._store = store
        self._leases = leases
        self._settings = settings
        # Placement and eviction decisions are made one at a time, so two pulls
        # starting together cannot both count the same free bytes.
        self.lock = asyncio.Lock()

    def protected_keys(self) -> set[str]:
        """Keys no eviction may take: leased, or claimed by a request in progress."""
        return self._leases.protected_keys()

    def place(
        self, snapshot: Snapshot, hint: TierName, *, strict: bool
    ) -> tuple[TierName, list[Candidate]]:
        """The tier for a new pull, and the snapshots to evict first to make room.

        Order: the hinted tier as it is; the hinted tier after eviction; then,
        if fallback is on and the request is not strict, the other tier the
        same way. Raises NoSpace, evicting nothing, when no tier can hold it.
        """
        leftover = self._store.leftover(snapshot.key)
        if leftover is not None and (leftover.tier == hint or not strict):
            return leftover.tier, []  # its blocks are already reserved there
        needed = snapshot.total_bytes
        order = [hint]
        if self._settings.fallback and not strict:
            order.append(_other(hint))
        for tier in order:
            limits = self._store.limits(tier)
            shortfall = limits.shortfall(needed, self._store.used_bytes(tier))
            if shortfall <= 0:
                return tier, []
            victims = self._pick(tier, shortfall)
            if victims is not None and needed <= limits.ceiling():
                return tier, victims
        raise NoSpace(self._no_space_message(snapshot, order))

    async def make_room(self, snapshot: Snapshot, hint: TierName, *, strict: bool) -> TierName:
        """``place`` the snapshot and evict its victims; the caller holds ``lock``.

        A victim that became protected while earlier ones were removed is
        kept, and the room is measured and chosen again.
        """
        for _ in range(_PLACEMENT_ROUNDS):
            tier, victims = self.place(snapshot, hint, strict=strict)
            await self.evict(victims, f"making room for {snapshot.uri}")
            if all(self._store.get(v.key) is None for v in victims):
                return tier
        # Still short after several rounds: the pull goes ahead, and the watermark
        # pass after it evicts what has become evictable by then.
        return tier

    async def evict(
        self, victims: Iterable[Candidate], reason: str, *, cause: str = "pressure"
    ) -> list[CachedModel]:
        """Evict the ``victims`` still unprotected; ``reason`` is logged, ``cause`` labels."""
        evicted: list[CachedModel] = []
        extras: list[str] = []
        for victim in victims:
            if self._store.get(victim.key) is None:
                extras.append(victim.key)  # a compile cache (or a snapshot gone meanwhile)
                continue
            if self._now_protected(victim.key):
                log.info("kept %s: leased or pinned since it was chosen", victim.key)
                continue
            # No await between this check and the store dropping the key from
            # its index, so no grant can slip in between.
            model = await self._store.evict(victim.key)
            log.info(
                "evicted %s (%s, %d bytes): %s",
                model.uri,
                model.key,
                model.total_bytes,
                reason,
                extra={"key": model.key, "uri": model.uri, "reason": reason},
            )
            EVICTIONS.labels(model.tier, cause).inc()
            evicted.append(model)
        attached = [e for t in TIER_NAMES if (e := self._store.extra(t)) is not None]
        for extra in dict.fromkeys(attached) if extras else ():
            await extra.evict_extra(extras, reason)
        return evicted

    async def enforce_watermarks(self, tiers: Sequence[TierName] = TIER_NAMES) -> list[CachedModel]:
        """Above the high watermark, evict down to the low one (what can be evicted)."""
        evicted: list[CachedModel] = []
        for tier in tiers:
            limits = self._store.limits(tier)
            used = self._store.used_bytes(tier)
            if used <= self._settings.high_watermark * limits.budget_bytes:
                continue
            evicted += await self._evict_down_to(
                tier, limits, used, "high watermark", cause="watermark"
            )
        return evicted

    async def collect_garbage(self, tiers: Sequence[TierName] = TIER_NAMES) -> list[CachedModel]:
        """A pass by hand: evict down to the low watermark, whatever the high one says."""
        evicted: list[CachedModel] = []
        for tier in tiers:
            limits = self._store.limits(tier)
            evicted += await self._evict_down_to(
                tier, limits, self._store.used_bytes(tier), "garbage collection", cause="gc"
            )
        return evicted

    def check_evictable(self, models: Sequence[CachedModel], *, force: bool) -> None:
        """Refuse to evict leased or pinned snapshots unless forced."""
        if force:
            return
        for model in models:
            leases = self._leases.for_key(model.key)
            usage = self._store.usage(model.key)
            if leases:
                holders = ", ".join(_describe(lease) for lease in leases[:3])
                raise Conflict(
                    f"{model.uri} ({model.key}) is leased by {len(leases)} client(s): {holders}. "
                    "Evicting it would make them pull again; use --force to evict anyway."
                )
            if usage is not None and usage.pinned:
                raise Conflict(
                    f"{model.uri} ({model.key}) is pinned. Unpin it (`prewarm unpin`) or use "
                    "--force."
                )

    async def _evict_down_to(
        self, tier: TierName, limits: TierLimits, used: int, reason: str, *, cause: str
    ) -> list[CachedModel]:
        target = int(self._settings.low_watermark * limits.budget_bytes)
        if used <= target:
            return []
        victims = self._pick(tier, used - target)
        if victims is None:  # not enough to reach the target: evict what may go
            victims = self._evictable(tier)
        return await self.evict(victims, reason, cause=cause)

    def _now_protected(self, key: str) -> bool:
        usage = self._store.usage(key)
        return self._leases.is_protected(key) or (usage is not None and usage.pinned)

    def _candidates(self, tier: TierName) -> list[Candidate]:
        return self._store.candidates(tier, self.protected_keys())

    def _pick(self, tier: TierName, to_free: int) -> list[Candidate] | None:
        """LRU snapshots; the tier's extras too, after all of them, only if they are not enough."""
        snapshots = self._candidates(tier)
        victims = pick_victims(snapshots, to_free)
        extra = self._store.extra(tier)
        if victims is not None or extra is None:
            return victims
        every = _lru(snapshots)
        rest = pick_victims(extra.extra_candidates(), to_free - sum(c.size for c in every))
        return None if rest is None else every + rest

    def _evictable(self, tier: TierName) -> list[Candidate]:
        extra = self._store.extra(tier)
        return _lru(self._candidates(tier)) + _lru(extra.extra_candidates() if extra else [])

    def _no_space_message(self, snapshot: Snapshot, tiers: Sequence[TierName]) -> str:
        parts = [f"No tier can hold {snapshot.uri} ({_gib(snapshot.total_bytes)})."]
        for tier in tiers:
            limits = self._store.limits(tier)
            protected = [c for c in self._candidates(tier) if c.protected]
            # Which snapshots are held goes to the admin's log only: the refusal reaches
            # whichever tenant asked, and the keys are other tenants' business.
            log.warning(
                "no room on %s for %s: leased or pinned there: %s",
                tier,
                snapshot.key,
                ", ".join(c.key[:12] for c in protected) or "none",
            )
            parts.append(
                f"Tier {tier}: budget {_gib(limits.budget_bytes)}, "
                f"{_gib(self._store.used_bytes(tier))} used, {_gib(limits.fs_free_bytes)} free "
                f"with {_gib(limits.reserve_bytes)} kept in reserve; "
                f"{_gib(sum(c.size for c in protected))} leased or pinned "
                f"({len(protected)} snapshots)."
            )
        parts.append(
            "Free space (`prewarm ls`, `prewarm evict --force`), raise the tier's budget, "
            "or request another tier."
        )
        return " ".join(parts)


def _lru(candidates: Iterable[Candidate]) -> list[Candidate]:
    return sorted((c for c in candidates if not c.protected), key=lambda c: (c.last_used, c.key))


def _other(tier: TierName) -> TierName:
    return "disk" if tier == "shm" else "shm"


def _gib(count: int) -> str:
    return f"{count / 1024**3:.2f} GiB"


def _describe(lease: LeaseRecord) -> str:
    name = lease.client_name or "unnamed"
    return f"{name} (pid {lease.holder.pid})" if lease.holder is not None else name
