"""How many bytes each tier may hold, and which snapshots to evict to make room."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agent._config import parse_size_or_percent
from agent._vocabulary import TierName

__all__ = ["Candidate", "TierLimits", "measure_limits", "physical_memory", "pick_victims"]


@dataclass(frozen=True, slots=True)
class TierLimits:
    """A tier's limits right now: the budget, the reserve, and its filesystem."""

    budget_bytes: int
    reserve_bytes: int
    fs_total_bytes: int
    fs_free_bytes: int

    def shortfall(self, needed: int, used: int) -> int:
        """Bytes to free before ``needed`` more fit (<= 0: it fits as is).

        Two limits apply: the cache's budget, and the free space that must be
        left on the filesystem (the reserve). Evicting a snapshot lowers both.
        """
        over_budget = used + needed - self.budget_bytes
        over_reserve = needed - (self.fs_free_bytes - self.reserve_bytes)
        return max(over_budget, over_reserve)

    def ceiling(self) -> int:
        """The largest model the tier could ever hold, with everything evicted."""
        return max(0, min(self.budget_bytes, self.fs_total_bytes - self.reserve_bytes))


@dataclass(frozen=True, slots=True)
class Candidate:
    """A snapshot eviction could remove, and what choosing it would free."""

    key: str
    size: int
    last_used: float
    protected: bool  # leased, pinned or in use: never evicted by pressure


def physical_memory() -> int:
    """Bytes of RAM on this host (what a percentage shm budget is of)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measure_limits(tier: TierName, root: Path, budget: str, reserve: str) -> TierLimits:
    """A tier's budget, reserve and filesystem figures in bytes, measured now."""
    stats = os.statvfs(root)
    fs_total = stats.f_blocks * stats.f_frsize
    fs_free = stats.f_bavail * stats.f_frsize
    # A percentage budget is of RAM for shm (tmpfs pages are RAM) and of the
    # filesystem for disk; either way the filesystem itself is a hard cap.
    fraction, absolute = parse_size_or_percent(budget)
    basis = physical_memory() if tier == "shm" else fs_total
    budget_bytes = min(absolute or int(fraction * basis), fs_total)
    fraction, absolute = parse_size_or_percent(reserve)
    reserve_bytes = absolute or int(fraction * fs_total)
    return TierLimits(budget_bytes, reserve_bytes, fs_total, fs_free)


def pick_victims(candidates: Iterable[Candidate], to_free: int) -> list[Candidate] | None:
    """Least recently used unprotected snapshots that free at least ``to_free`` bytes.

    None when even evicting every unprotected snapshot would not be enough, so
    the caller can fail without evicting anything.
    """
    if to_free <= 0:
        return []
    victims: list[Candidate] = []
    freed = 0
    for candidate in sorted(
        (c for c in candidates if not c.protected), key=lambda c: (c.last_used, c.key)
    ):
        victims.append(candidate)
        freed += candidate.size
        if freed >= to_free:
            return victims
    return None
