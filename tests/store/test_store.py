"""The store in-process on tmp_path roots: publish, evict, staging bookkeeping, reconcile."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from store_helpers import MiB, key_of, open_store, publish, stage

from agent import InvalidRequest, NotFound
from agent._vocabulary import TierName
from agent.store.catalog import Store
from agent.store.journal import Journal, JournalHeader
from agent.store.roots import journal_key


def _entries(root: Path, sub: str) -> list[str]:
    return sorted(p.name for p in (root / sub).iterdir())


def _journal(store: Store, key: str, *, tier: TierName = "shm", named: str = "") -> Path:
    """A staging directory holding only a journal header, as a pull that just started."""
    staging = store.staging_path(tier, named or key)
    staging.mkdir(parents=True)
    header = JournalHeader(key, "s3://bucket/m/", MiB, (("weights.bin", 3 * MiB, '"e"'),))
    Journal.create(staging, header, journal_key(store.roots()[tier])).close()
    return staging


async def test_publish_moves_the_staged_files_into_place_and_writes_the_manifest(
    tmp_path: Path,
) -> None:
    """Publish renames staging/<key>/data to snapshots/<name> (its capability, not its key) and
    makes it exist via its manifest."""
    store = await open_store(tmp_path)
    staging, staged = stage(store, 1, 2)
    model = await store.publish(staging, staged)
    root = tmp_path / "shm"
    assert model.path.parent == root / "snapshots"
    assert model.path.name not in (model.key, "data")
    assert (model.path / "weights.bin").stat().st_size == 2 * MiB
    assert not (staging / "data").exists()
    manifest = json.loads((root / "manifests" / f"{model.key}.json").read_text())
    assert (manifest["key"], manifest["uri"]) == (model.key, model.uri)
    assert store.get(model.key) == model
    assert store.published_bytes("shm") == 2 * MiB
    assert _entries(root, "usage") == [f"{model.key}.json"]


async def test_publishing_a_key_that_is_already_published_keeps_the_first(
    tmp_path: Path,
) -> None:
    """A second publish of the same key (two pulls raced) returns the snapshot already there."""
    store = await open_store(tmp_path)
    first = await publish(store, 1)
    staging, again = stage(store, 1, tier="disk")
    assert await store.publish(staging, again) == first
    assert [m.key for m in store.models()] == [first.key]


async def test_evict_hides_the_snapshot_but_an_open_file_stays_readable(tmp_path: Path) -> None:
    """Evict removes manifest, usage and files; a reader holding a file keeps its bytes."""
    store = await open_store(tmp_path)
    model = await publish(store, 7)
    root = tmp_path / "shm"
    fd = os.open(model.path / "weights.bin", os.O_RDONLY)
    try:
        assert await store.evict(model.key) == model
        assert os.pread(fd, 4, 0) == b"\x07" * 4
    finally:
        os.close(fd)
    assert store.get(model.key) is None
    for sub in ("snapshots", "manifests", "usage", "trash"):
        assert _entries(root, sub) == []
    with pytest.raises(NotFound, match="is not cached"):
        await store.evict(model.key)


async def test_reopening_keeps_snapshots_with_their_use_and_pins(tmp_path: Path) -> None:
    """The index rebuilt at start-up has every intact snapshot, its hit count and its pin."""
    store = await open_store(tmp_path)
    model = await publish(store, 1)
    await store.record_use(model.key, hit=True)
    await store.record_use(model.key, hit=True)
    await store.set_pinned(model.key, True)
    reopened = await open_store(tmp_path)
    assert reopened.get(model.key) == model
    usage = reopened.usage(model.key)
    assert usage is not None
    assert (usage.hit_count, usage.pinned) == (2, True)


async def test_reconcile_drops_snapshots_whose_files_are_missing_or_resized(
    tmp_path: Path,
) -> None:
    """A manifest whose files are gone or have another size is dropped with its files."""
    store = await open_store(tmp_path)
    kept, resized, gone = [await publish(store, n) for n in (1, 2, 3)]
    with (resized.path / "weights.bin").open("r+b") as fh:
        fh.truncate(100)
    (gone.path / "weights.bin").unlink()
    reopened = await open_store(tmp_path)
    assert [m.key for m in reopened.models()] == [kept.key]
    root = tmp_path / "shm"
    assert _entries(root, "manifests") == [f"{kept.key}.json"]
    assert _entries(root, "snapshots") == [kept.path.name]
    assert _entries(root, "usage") == [f"{kept.key}.json"]


@pytest.mark.parametrize(
    "manifest",
    [
        "not json",
        json.dumps({"format": 99}),
        json.dumps({"format": 1, "key": key_of(8)}),  # names another key than its file
        json.dumps(  # a tampered path must not make the agent look outside the snapshot
            {
                "format": 1,
                "key": key_of(9),
                "uri": "s3://bucket/m/",
                "include": [],
                "exclude": [],
                "created": 0,
                "files": [{"path": "../../etc/passwd", "size": 1, "etag": "e"}],
            }
        ),
    ],
)
async def test_reconcile_drops_manifests_it_cannot_trust(tmp_path: Path, manifest: str) -> None:
    """An unreadable, foreign-format, misnamed or path-escaping manifest is deleted, not served."""
    await open_store(tmp_path)
    path = tmp_path / "shm" / "manifests" / f"{key_of(9)}.json"
    path.write_text(manifest)
    reopened = await open_store(tmp_path)
    assert reopened.models() == []
    assert not path.exists()


async def test_reconcile_removes_what_was_never_published(tmp_path: Path) -> None:
    """Snapshot directories without a manifest, orphan usage files and the trash are emptied."""
    store = await open_store(tmp_path)
    kept = await publish(store, 1)
    root = tmp_path / "shm"
    (root / "snapshots" / key_of(2) / "sub").mkdir(parents=True)  # renamed, manifest never written
    (root / "usage" / f"{key_of(3)}.json").write_text("{}")
    (root / "trash" / "evicted.1234").mkdir()
    await open_store(tmp_path)
    assert _entries(root, "snapshots") == [kept.path.name]
    assert _entries(root, "usage") == [f"{kept.key}.json"]
    assert _entries(root, "trash") == []


async def test_reconcile_keeps_resumable_pulls_and_removes_the_rest(tmp_path: Path) -> None:
    """A staging directory with its own journal is resumable; one without, or misnamed, goes."""
    store = await open_store(tmp_path)
    resumable = _journal(store, key_of(1))
    _journal(store, key_of(2), named=key_of(3))  # the header names another snapshot
    store.staging_path("shm", key_of(4)).mkdir()  # died before the journal was written
    reopened = await open_store(tmp_path)
    leftover = reopened.leftover(key_of(1))
    assert leftover is not None
    assert (leftover.path, leftover.total_bytes) == (resumable, 3 * MiB)
    assert _entries(tmp_path / "shm", "staging") == [key_of(1)]
    assert reopened.staging_bytes("shm") == 3 * MiB


async def test_a_pull_counts_its_bytes_until_it_ends_and_then_is_retired(tmp_path: Path) -> None:
    """begin_staging reserves bytes on the tier; end_staging (not kept) moves the tree to trash."""
    store = await open_store(tmp_path)
    key = key_of(1)
    assert store.begin_staging("shm", key, 5 * MiB) == []
    store.staging_path("shm", key).mkdir()
    assert store.staging_bytes("shm") == store.used_bytes("shm") == 5 * MiB
    (retired,) = store.end_staging(key, keep=False)
    assert retired.parent == tmp_path / "shm" / "trash"
    assert store.staging_bytes("shm") == 0
    assert not store.staging_path("shm", key).exists()
    await store.purge([retired])
    assert _entries(tmp_path / "shm", "trash") == []


async def test_an_interrupted_pull_stays_as_a_leftover_counted_once(tmp_path: Path) -> None:
    """end_staging(keep=True) leaves a resumable leftover whose bytes are not counted twice."""
    store = await open_store(tmp_path)
    key = key_of(1)
    store.begin_staging("shm", key, 4 * MiB)
    store.staging_path("shm", key).mkdir()
    assert store.end_staging(key, keep=True) == []
    assert store.leftover(key) is not None
    assert store.staging_bytes("shm") == 4 * MiB
    assert store.begin_staging("shm", key, 4 * MiB) == []  # resumed on the same tier
    assert store.staging_bytes("shm") == 4 * MiB


async def test_a_pull_on_the_other_tier_retires_the_leftover(tmp_path: Path) -> None:
    """A leftover on shm cannot be resumed by a pull on disk: it is retired into shm's trash."""
    store = await open_store(tmp_path)
    key = key_of(1)
    _journal(store, key)
    store = await open_store(tmp_path)
    (retired,) = store.begin_staging("disk", key, 3 * MiB)
    assert retired.parent == tmp_path / "shm" / "trash"
    assert store.leftover(key) is None
    assert store.staging_bytes("shm") == 0
    assert store.staging_bytes("disk") == 3 * MiB


async def test_find_by_uri_or_key_prefix_and_what_it_refuses(tmp_path: Path) -> None:
    """find takes a URI or an 8+ digit key prefix; malformed and ambiguous refs are refused."""
    store = await open_store(tmp_path)
    one, two = await publish(store, 1), await publish(store, 2)
    apart = await publish(store, 1 << 124)  # its key starts with 1, the others with 0
    assert store.find("s3://bucket/model-1") == [one]
    assert store.find(apart.key[:8].upper()) == [apart]
    assert store.find(two.key) == [two]
    with pytest.raises(InvalidRequest, match="matches 2 snapshots"):
        store.find(one.key[:8])
    for malformed in ("abc", "z" * 32):
        with pytest.raises(InvalidRequest, match="neither an s3:// URI nor a snapshot key"):
            store.find(malformed)
    with pytest.raises(NotFound, match="No cached snapshot of"):
        store.find("s3://bucket/other/")
    with pytest.raises(NotFound, match="starting with"):
        store.find("f" * 8)
