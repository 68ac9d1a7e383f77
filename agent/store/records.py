"""What the store knows about a snapshot, a tier and a resumable pull, as plain values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent._vocabulary import TierName
from agent.store.budget import Candidate

__all__ = [
    "CachedFile",
    "CachedModel",
    "ExtraUsage",
    "Leftover",
    "TierBudget",
    "TierUsage",
    "Usage",
]


@dataclass(frozen=True, slots=True)
class CachedFile:
    """One file of a published snapshot, as its manifest records it."""

    path: str
    size: int
    etag: str
    # Content digest computed while writing (see agent.check); "" if unknown.
    digest: str = ""


@dataclass(frozen=True, slots=True)
class CachedModel:
    """A published snapshot, as its manifest describes it."""

    key: str
    uri: str
    tier: TierName
    path: Path
    files: tuple[CachedFile, ...]
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    created: float
    # Bytes per hashed chunk of each file's digest (0: files carry no digest).
    hash_chunk_size: int = 0
    # What verified the model's signature before it was published ("": none was asked for).
    verified_by: str = ""

    @property
    def total_bytes(self) -> int:
        """Bytes of every file of the snapshot."""
        return sum(f.size for f in self.files)


@dataclass(slots=True)
class Usage:
    """How a published snapshot has been used: last use, hits, pin."""

    last_used: float
    hit_count: int = 0
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class Leftover:
    """A staging directory an interrupted pull left behind; a later pull may resume it."""

    key: str
    tier: TierName
    path: Path
    total_bytes: int
    # Bytes complete (journaled) in it: what a pull resuming it does not fetch again.
    kept_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TierUsage:
    """One tier's figures for status and metrics, measured when asked."""

    tier: TierName
    root: Path
    capacity_bytes: int
    free_bytes: int
    used_bytes: int
    model_count: int
    budget_bytes: int
    reserve_bytes: int
    staging_bytes: int
    pinned_count: int
    # Stopped pulls whose staging directories wait to be resumed, and their complete bytes.
    resumable_count: int = 0
    resumable_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TierBudget:
    """A tier's budget and reserve as configured: sizes or percentages."""

    budget: str = "100%"
    reserve: str = "0"


class ExtraUsage(Protocol):
    """Bytes on a tier that are not snapshots (compile caches): counted in its budget,
    and evicted only when evicting every evictable snapshot would not be enough."""

    def extra_bytes(self) -> int:
        """Bytes the extra usage holds on the tier."""

    def extra_candidates(self) -> list[Candidate]:
        """The extra usage's entries as eviction candidates (protection marked)."""

    async def evict_extra(self, keys: Sequence[str], reason: str) -> int:
        """Evict these keys (skipping any in use by now); returns the bytes freed."""
        ...
