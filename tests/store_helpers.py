"""A real store on tmp_path roots, and snapshots staged and published into it.

For in-process tests of the store and eviction: the same files and renames a
pull makes, without a daemon, a source or a socket.
"""

from __future__ import annotations

from pathlib import Path

from agent._vocabulary import TierName
from agent.store.catalog import Store
from agent.store.journal import DATA_DIR
from agent.store.records import CachedFile, CachedModel, TierBudget

MiB = 1024 * 1024


def key_of(number: int) -> str:
    """A snapshot key (32 hex digits) that sorts by ``number``."""
    return f"{number:032x}"


# The store last opened on each tmp_path: opening another there is a restart, so the
# earlier one lets go of the roots' locks first, as a process that ended would.
_OPEN_STORES: dict[Path, Store] = {}


async def open_store(tmp_path: Path, budget: str = "10MiB") -> Store:
    """A store with both tiers under ``tmp_path``, each with ``budget`` and no reserve; the
    store opened there before (an earlier "process") is closed first."""
    earlier = _OPEN_STORES.pop(tmp_path, None)
    if earlier is not None:
        earlier.close()
    roots: dict[TierName, Path] = {"shm": tmp_path / "shm", "disk": tmp_path / "disk"}
    store = Store(roots, {tier: TierBudget(budget=budget, reserve="0") for tier in roots})
    await store.open()
    _OPEN_STORES[tmp_path] = store
    return store


def stage(
    store: Store, number: int, mib: float = 1, *, tier: TierName = "shm"
) -> tuple[Path, CachedModel]:
    """Write a one-file snapshot into ``staging/<key>/data`` as a finished pull leaves it."""
    key = key_of(number)
    staging = store.staging_path(tier, key)
    (staging / DATA_DIR).mkdir(parents=True)
    size = int(mib * MiB)
    (staging / DATA_DIR / "weights.bin").write_bytes(bytes([number % 256]) * size)
    model = CachedModel(
        key=key,
        uri=f"s3://bucket/model-{number}/",
        tier=tier,
        path=staging,
        files=(CachedFile(path="weights.bin", size=size, etag=f'"etag-{number}"'),),
        include=(),
        exclude=(),
        created=0.0,
    )
    return staging, model


async def publish(
    store: Store, number: int, mib: float = 1, *, tier: TierName = "shm"
) -> CachedModel:
    """Stage and publish snapshot ``number``; later numbers are more recently used."""
    staging, model = stage(store, number, mib, tier=tier)
    return await store.publish(staging, model)


def close_open_stores() -> None:
    """Close every store ``open_store`` opened (a test's end: its roots are let go)."""
    while _OPEN_STORES:
        _OPEN_STORES.popitem()[1].close()
