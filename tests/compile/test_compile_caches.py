"""CompileCaches in process: a real store and real directories, S3 played by MemorySource.

Everything here is the compile cache's own logic (the index on disk, restore,
upload, pull, eviction), so no daemon and no socket: two "nodes" are two
CompileCaches on separate roots sharing one in-memory source. The end-to-end
path through the real S3 server and torch.compile is in test_compile_cache.py.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from compile_helpers import BUCKET
from compile_helpers import compile_node as node

from agent._exceptions import Conflict, IntegrityError, InvalidRequest, NotFound
from agent.compile.archive import content_digest
from agent.compile.cache import CacheRef
from agent.compile.keys import CompileKeyParts, compile_key, sub_cache_dirs
from agent.testing import MemorySource, sealed_with_shared_key, unsealed

PARTS = CompileKeyParts(torch_version="2.13.0", model_key="in-process")
KEY = compile_key(PARTS)


@pytest.fixture
def source() -> MemorySource:
    """The object store every node of a test shares, with the bucket made."""
    return MemorySource(objects={BUCKET: {}})


def _fill(directory: Path, seed: int = 1) -> None:
    """Write a few kernels the way inductor lays them out."""
    for index in range(3):
        kernel = directory / "inductor" / f"k{index}" / f"kernel{seed}.so"
        kernel.parent.mkdir(parents=True, exist_ok=True)
        kernel.write_bytes(os.urandom(16 * 1024))


def _manifest(source: MemorySource) -> dict[str, Any]:
    document: dict[str, Any] = unsealed(source.objects[BUCKET][f"cc/node/{KEY}/manifest.json"])
    return document


def _archive_name(source: MemorySource) -> str:
    return f"cc/node/{KEY}/{_manifest(source)['archives'][0]['name']}"


async def test_a_new_key_gets_an_empty_directory_laid_out_for_its_engine(
    tmp_path: Path, source: MemorySource
) -> None:
    """A first ensure creates the key's directory and record; the next one is a local hit."""
    async with node(tmp_path, source, shared=False) as caches:
        first = await caches.ensure(PARTS, client_name="pod-1")
        again = await caches.ensure(PARTS, client_name="pod-2")
    root = tmp_path / "disk" / "compile" / "node"
    assert first.info.path == root / KEY
    assert sorted(p.name for p in first.info.path.iterdir()) == list(sub_cache_dirs("torch"))
    assert {"inductor", "triton", "flashinfer", "deep_gemm", "cuda"} <= set(sub_cache_dirs("torch"))
    assert (root / ".meta" / f"{KEY}.json").is_file()
    assert (first.restored, first.restore_note) == (
        False,
        "compile_cache.uri is not set: local only",
    )
    assert (again.restored, again.restore_note, again.info.path) == (False, "", first.info.path)
    assert again.info.last_used >= first.info.last_used
    assert first.env["TORCHINDUCTOR_CACHE_DIR"] == str(root / KEY / "inductor")


async def test_a_key_nobody_uploaded_starts_empty_and_says_so(
    tmp_path: Path, source: MemorySource
) -> None:
    """With a shared prefix but no pointer yet, the pod gets an empty directory and a note."""
    async with node(tmp_path, source) as caches:
        ensured = await caches.ensure(PARTS)
    assert not ensured.restored
    assert ensured.restore_note == f"nothing uploaded yet at s3://{BUCKET}/cc/node/{KEY}/"
    assert content_digest(ensured.info.path).file_count == 0


async def test_a_pushed_cache_is_restored_whole_on_another_node(
    tmp_path: Path, source: MemorySource
) -> None:
    """Push uploads once (then skips unchanged content); another node restores the same bytes."""
    async with node(tmp_path / "a", source) as first:
        made = await first.ensure(PARTS)
        _fill(made.info.path)
        pushed = await first.push(KEY[:8])
        repeated = await first.push(KEY)
    assert (pushed.uploaded, pushed.uri) == (True, f"s3://{BUCKET}/cc/node/{KEY}/")
    assert pushed.bytes > 0
    assert pushed.digest == content_digest(made.info.path).digest == _manifest(source)["digest"]
    assert (repeated.uploaded, repeated.skipped_reason) == (
        False,
        "unchanged since the last upload or restore",
    )

    async with node(tmp_path / "b", source) as second:
        restored = await second.ensure(PARTS)
        unchanged = await second.push(KEY)
    assert restored.restored, restored.restore_note
    assert content_digest(restored.info.path).digest == pushed.digest
    assert (restored.info.uploaded_digest, restored.info.restored) == (pushed.digest, True)
    assert unchanged.skipped_reason == "unchanged since the last upload or restore"
    assert not list((tmp_path / "b" / "disk" / "compile" / "node" / ".tmp").iterdir())


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
async def test_a_damaged_archive_is_refused_and_the_pod_starts_empty(
    tmp_path: Path, source: MemorySource, damage: str
) -> None:
    """A cut-short or altered archive is refused; the pod gets an empty, writable directory."""
    async with node(tmp_path / "a", source) as first:
        _fill((await first.ensure(PARTS)).info.path)
        assert (await first.push(KEY)).uploaded
    name = _archive_name(source)
    data = source.objects[BUCKET][name]
    middle = len(data) // 2
    if damage == "truncated":  # its size no longer matches the manifest's
        source.objects[BUCKET][name] = data[:middle]
    else:  # same size, flipped bytes: the archive or its digest no longer checks out
        flipped = bytes(b ^ 0xFF for b in data[middle : middle + 64])
        source.objects[BUCKET][name] = data[:middle] + flipped + data[middle + 64 :]

    async with node(tmp_path / "b", source) as second:
        refused = await second.ensure(PARTS)
    assert not refused.restored
    assert refused.restore_note.startswith("refused the archive in S3")
    assert content_digest(refused.info.path).file_count == 0
    (refused.info.path / "inductor" / "written").write_text("ok")
    assert not list((tmp_path / "b" / "disk" / "compile" / "node" / ".tmp").iterdir())


async def test_pull_replaces_the_local_directory_with_what_s3_holds(
    tmp_path: Path, source: MemorySource
) -> None:
    """Pull swaps local changes for the uploaded content; it refuses when there is nothing."""
    async with node(tmp_path, source) as caches:
        with pytest.raises(NotFound, match="Nothing was uploaded"):
            await caches.pull(KEY)
        path = (await caches.ensure(PARTS)).info.path
        _fill(path, seed=1)
        pushed = await caches.push(KEY)
        _fill(path, seed=2)  # local changes after the upload
        pulled = await caches.pull(KEY[:12])
    assert pulled.restored
    assert pulled.info.path == path
    assert content_digest(path).digest == pushed.digest
    assert pulled.info.uploaded_digest == pushed.digest


async def test_pull_refuses_a_manifest_whose_parts_hash_to_another_key(
    tmp_path: Path, source: MemorySource
) -> None:
    """A node without the key trusts the manifest's parts only if they hash to that key."""
    async with node(tmp_path / "a", source) as first:
        _fill((await first.ensure(PARTS)).info.path)
        await first.push(KEY)
    manifest = _manifest(source)
    manifest["parts"] = {**manifest["parts"], "model_key": "another"}
    source.objects[BUCKET][f"cc/node/{KEY}/manifest.json"] = sealed_with_shared_key(
        f"node/{KEY}/manifest.json", json.dumps(manifest).encode()
    )

    async with node(tmp_path / "b", source) as second:
        with pytest.raises(IntegrityError, match="unusable key parts"):
            await second.pull(KEY)
        assert await second.caches() == []
    assert not list((tmp_path / "b" / "disk" / "compile" / "node" / ".tmp").iterdir())


async def test_pull_push_and_compact_without_a_shared_prefix_are_conflicts(
    tmp_path: Path, source: MemorySource
) -> None:
    """Pull, push and compact need compile_cache.uri: without it each is a Conflict naming it
    (a setting to fix, never a skip that looks like success)."""
    async with node(tmp_path, source, shared=False) as caches:
        await caches.ensure(PARTS)
        for operation in (caches.pull, caches.push, caches.compact):
            with pytest.raises(Conflict, match=r"compile_cache\.uri is not set"):
                await operation(KEY)


async def test_keys_are_named_by_a_unique_hex_prefix(tmp_path: Path, source: MemorySource) -> None:
    """find takes 8+ hex digits of a key on the node and says what is wrong otherwise."""
    async with node(tmp_path, source, shared=False) as caches:
        await caches.ensure(PARTS)
        assert caches.find(KEY[:8].upper()) == CacheRef("node", KEY)
        assert caches.find(f"node/{KEY[:8]}") == CacheRef("node", KEY)
        with pytest.raises(InvalidRequest, match="not a compile-cache key"):
            caches.find(KEY[:7])
        with pytest.raises(InvalidRequest, match="not a compile-cache key"):
            caches.find("z" * 8)
        other = "0" * 8 if not KEY.startswith("0" * 8) else "f" * 8
        with pytest.raises(NotFound, match=f"starting with {other}"):
            caches.find(other)


async def test_evict_removes_the_directory_and_its_record_unless_a_pod_holds_the_lock(
    tmp_path: Path, source: MemorySource
) -> None:
    """Evict deletes a key's directory and record, but not while its compile lock is held."""
    root = tmp_path / "disk" / "compile" / "node"
    async with node(tmp_path, source, shared=False) as caches:
        path = (await caches.ensure(PARTS)).info.path
        _fill(path)
        async with contextlib.aclosing(caches.hold_lock(PARTS, "pod-1")) as hold:
            assert (await anext(hold)).state == "granted"
            with pytest.raises(Conflict, match="pod-1 holds its compile lock"):
                await caches.evict(KEY[:8])
        (evicted,) = await caches.evict(KEY[:8])
        assert caches.statistics() == (0, 0)
    assert (evicted.key, evicted.file_count) == (KEY, 3)
    assert not path.exists()
    assert not (root / ".meta" / f"{KEY}.json").exists()
    assert not list((root / ".trash").iterdir())


async def test_the_disk_budget_sees_compile_caches_and_may_evict_them(
    tmp_path: Path, source: MemorySource
) -> None:
    """Compile caches report their bytes as eviction candidates; a held lock protects one."""
    async with node(tmp_path, source, shared=False) as caches:
        path = (await caches.ensure(PARTS)).info.path
        _fill(path)
        await caches.caches()  # measures the directory now
        (candidate,) = caches.extra_candidates()
        assert (candidate.key, candidate.size, candidate.protected) == (
            f"node/{KEY}",
            3 * 16 * 1024,
            False,
        )
        async with contextlib.aclosing(caches.hold_lock(PARTS, "pod-1")) as hold:
            await anext(hold)
            assert caches.extra_candidates()[0].protected
            assert await caches.evict_extra([f"node/{KEY}"], "budget") == 0
        assert await caches.evict_extra([f"node/{KEY}"], "budget") == 3 * 16 * 1024
    assert not path.exists()


async def test_a_restart_keeps_recorded_keys_and_clears_what_was_left_half_done(
    tmp_path: Path, source: MemorySource
) -> None:
    """Reopening rebuilds the index: records with directories stay, every orphan goes."""
    root = tmp_path / "disk" / "compile" / "node"
    async with node(tmp_path, source, shared=False) as caches:
        _fill((await caches.ensure(PARTS)).info.path)
    orphan_directory = root / ("a" * 32)  # a directory nobody recorded
    _fill(orphan_directory)
    (root / ".meta" / f"{'b' * 32}.json").write_text("{}")  # a record without a directory
    (root / ".meta" / f"{'c' * 32}.json").write_text("not json")
    (root / "not-a-key").mkdir()  # no record either: removed too
    (root / ".tmp" / f"{KEY}.1234").mkdir()  # a restore cut off by the stop
    (root / ".trash" / f"{KEY}.5678").write_text("half deleted")

    async with node(tmp_path, source, shared=False) as caches:
        (kept,) = await caches.caches()
    assert (kept.key, kept.file_count) == (KEY, 3)
    assert sorted(p.name for p in root.iterdir()) == [".meta", ".tmp", ".trash", KEY]
    assert [p.name for p in (root / ".meta").iterdir()] == [f"{KEY}.json"]
    assert not list((root / ".tmp").iterdir())
    assert not list((root / ".trash").iterdir())
