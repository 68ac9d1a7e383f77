"""Placement and eviction in-process: a real store on tmp_path roots and a real lease table."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import MiB, key_of, open_store, publish, stage

from agent import Conflict, NoSpace
from agent._config import TierSettings
from agent._snapshot import Snapshot, SourceObject
from agent._uri import parse_uri
from agent.leases.table import LeaseTable, PeerCredentials
from agent.store.catalog import Store
from agent.store.eviction import Evictor


def _evictor(store: Store, leases: LeaseTable, *, fallback: bool = False) -> Evictor:
    # Each tier's budget is 10 MiB (open_store): above 8.5 MiB evict down to 6 MiB.
    settings = TierSettings(high_watermark=0.85, low_watermark=0.6, fallback=fallback)
    return Evictor(store, leases, settings)


def _leases() -> LeaseTable:
    return LeaseTable(default_ttl=60, max_ttl=600)


def _snapshot(number: int, mib: int) -> Snapshot:
    """A snapshot about to be pulled (not in the store yet)."""
    size = mib * MiB
    obj = SourceObject(key=f"new/{number}.bin", relative_path="w.bin", size=size, etag='"e"')
    return Snapshot(parse_uri(f"s3://bucket/new-{number}/"), (), (), (obj,), key_of(number))


async def _three(store: Store) -> list[str]:
    """Three 3 MiB snapshots on shm, least recently used first."""
    return [(await publish(store, n, 3)).key for n in (1, 2, 3)]


async def test_a_snapshot_that_fits_goes_to_the_hinted_tier_evicting_nothing(
    tmp_path: Path,
) -> None:
    """With room under the budget, place answers the hint and no victims."""
    store = await open_store(tmp_path)
    await publish(store, 1, 3)
    assert _evictor(store, _leases()).place(_snapshot(9, 4), "shm", strict=False) == ("shm", [])


async def test_room_is_made_by_evicting_the_least_recently_used_first(tmp_path: Path) -> None:
    """Victims are taken oldest use first, only as many as the shortfall needs."""
    store = await open_store(tmp_path)
    a, b, c = await _three(store)
    await store.record_use(a, hit=True)  # a is now the most recently used
    tier, victims = _evictor(store, _leases()).place(_snapshot(9, 3), "shm", strict=False)
    assert (tier, [v.key for v in victims]) == ("shm", [b])
    tier, victims = _evictor(store, _leases()).place(_snapshot(9, 5), "shm", strict=False)
    assert [v.key for v in victims] == [b, c]


async def test_leased_and_pinned_snapshots_are_never_victims(tmp_path: Path) -> None:
    """A live lease or a pin protects a snapshot from pressure whatever its age."""
    store = await open_store(tmp_path)
    a, b, c = await _three(store)
    leases = _leases()
    leases.grant(a, "ns/pod")
    await store.set_pinned(b, True)
    _, victims = _evictor(store, leases).place(_snapshot(9, 3), "shm", strict=False)
    assert [v.key for v in victims] == [c]


async def test_no_space_when_only_protected_snapshots_could_go(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NoSpace names the tier's budget and how much is leased, not whose snapshots (the
    refusal reaches whichever tenant asked): their keys go to the log; nothing is evicted."""
    store = await open_store(tmp_path)
    keys = await _three(store)
    leases = _leases()
    for key in keys:
        leases.grant(key)
    with pytest.raises(NoSpace, match=r"Tier shm: budget 0\.01 GiB") as info:
        _evictor(store, leases).place(_snapshot(9, 3), "shm", strict=False)
    assert "leased or pinned (3 snapshots)" in str(info.value)
    assert not [key for key in keys if key[:12] in str(info.value)]
    assert keys[0][:12] in caplog.text
    assert [m.key for m in store.models()] == keys


async def test_a_model_larger_than_the_budget_is_refused_even_with_an_empty_tier(
    tmp_path: Path,
) -> None:
    """A snapshot above the tier's ceiling is NoSpace at once, evicting nothing."""
    store = await open_store(tmp_path)
    await publish(store, 1, 3)
    with pytest.raises(NoSpace, match="No tier can hold"):
        _evictor(store, _leases()).place(_snapshot(9, 11), "shm", strict=False)
    assert len(store.models()) == 1


async def test_fallback_takes_the_other_tier_unless_the_request_is_strict(
    tmp_path: Path,
) -> None:
    """With fallback on, a full hinted tier sends the pull to the other one; strict refuses."""
    store = await open_store(tmp_path)
    leases = _leases()
    for key in await _three(store):
        leases.grant(key)
    evictor = _evictor(store, leases, fallback=True)
    assert evictor.place(_snapshot(9, 3), "shm", strict=False) == ("disk", [])
    with pytest.raises(NoSpace):
        evictor.place(_snapshot(9, 3), "shm", strict=True)


async def test_a_resumable_leftover_keeps_its_tier(tmp_path: Path) -> None:
    """A pull that left a leftover on disk resumes there, even when shm is the hint."""
    store = await open_store(tmp_path)
    staging, _ = stage(store, 9, 3, tier="disk")
    store.begin_staging("disk", key_of(9), 3 * MiB)
    store.end_staging(key_of(9), keep=True)
    assert staging.exists()
    assert _evictor(store, _leases()).place(_snapshot(9, 3), "shm", strict=False) == ("disk", [])


async def test_above_the_high_watermark_eviction_goes_down_to_the_low_one(
    tmp_path: Path,
) -> None:
    """9 MiB of a 10 MiB budget is over 85 %: the oldest unleased snapshots go until <= 60 %."""
    store = await open_store(tmp_path)
    a, b, c = await _three(store)
    leases = _leases()
    leases.grant(a)
    evicted = await _evictor(store, leases).enforce_watermarks()
    assert [m.key for m in evicted] == [b]
    assert [m.key for m in store.models()] == [a, c]
    assert await _evictor(store, leases).enforce_watermarks() == []  # 6 MiB: below the mark


async def test_garbage_collection_ignores_the_high_watermark(tmp_path: Path) -> None:
    """A pass by hand evicts down to the low watermark even when the high one is not reached."""
    store = await open_store(tmp_path)
    a, b = [(await publish(store, n, 3.5)).key for n in (1, 2)]
    evictor = _evictor(store, _leases())
    assert await evictor.enforce_watermarks() == []  # 7 MiB < 8.5 MiB
    assert [m.key for m in await evictor.collect_garbage()] == [a]
    assert [m.key for m in store.models()] == [b]


async def test_evicting_by_hand_refuses_leased_or_pinned_unless_forced(tmp_path: Path) -> None:
    """check_evictable names who holds a leased snapshot and refuses a pinned one; force wins."""
    store = await open_store(tmp_path)
    leased, pinned = await publish(store, 1), await publish(store, 2)
    leases = _leases()
    lease = leases.grant(leased.key, "ns/pod-a")
    leases.hold(lease.id, PeerCredentials(pid=4242, uid=0, gid=0))
    await store.set_pinned(pinned.key, True)
    evictor = _evictor(store, leases)
    with pytest.raises(Conflict, match=r"leased by 1 client\(s\): ns/pod-a \(pid 4242\)"):
        evictor.check_evictable([leased], force=False)
    with pytest.raises(Conflict, match="is pinned"):
        evictor.check_evictable([pinned], force=False)
    evictor.check_evictable([leased, pinned], force=True)
