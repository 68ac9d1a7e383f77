"""Compaction: a key's many archives in S3 become one, and nothing a restore reads goes early.

Every upload of new files adds an archive, and a restore reads (GET and
unpack) every archive listed. Past ``COMPACT_AFTER_ARCHIVES`` the uploading
node packs their union into one archive and switches the manifest to it with
a conditional write; the replaced archives stay in S3, listed as retired,
until no restore that read the old manifest can still be reading them. In
process, with MemorySource as S3 (its ``reads`` record every ranged GET).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
from compile_helpers import BUCKET, shared_signing
from compile_helpers import compile_node as node

from agent._exceptions import Conflict
from agent._uri import parse_uri
from agent.compile.keys import CompileKeyParts, compile_key
from agent.compile.remote import RemoteCompileCaches
from agent.compile.transfer import COMPACT_AFTER_ARCHIVES
from agent.testing import MemorySource, unsealed

PARTS = CompileKeyParts(torch_version="2.13.0", model_key="compaction")
KEY = compile_key(PARTS)
PREFIX = f"cc/node/{KEY}/"


def _manifest(source: MemorySource) -> dict[str, Any]:
    document: dict[str, Any] = unsealed(source.objects[BUCKET][PREFIX + "manifest.json"])
    return document


async def _restore(root: Path, source: MemorySource) -> tuple[dict[str, bytes], int, float]:
    """A new node's restore: the files it got, the archives it read, the seconds it took."""
    reads_before = len(source.reads)
    started = time.monotonic()
    async with node(root, source) as fresh:
        restored = await fresh.ensure(PARTS)
    seconds = time.monotonic() - started
    files = {p.name: p.read_bytes() for p in (restored.info.path / "inductor").iterdir()}
    return files, len(source.reads) - reads_before, seconds


async def test_uploads_past_the_limit_leave_one_archive_holding_their_union(
    tmp_path: Path,
) -> None:
    """The upload that makes one archive too many compacts: one archive, every file, one GET."""
    source = MemorySource(objects={BUCKET: {}})
    written: dict[str, bytes] = {}
    async with node(tmp_path / "a", source) as first:
        path = (await first.ensure(PARTS)).info.path
        for number in range(COMPACT_AFTER_ARCHIVES + 1):
            if number == COMPACT_AFTER_ARCHIVES:
                before = _manifest(source)
                files, reads_before, seconds_before = await _restore(tmp_path / "b", source)
            written[f"kernel-{number}.so"] = os.urandom(20_000)
            (path / "inductor" / f"kernel-{number}.so").write_bytes(written[f"kernel-{number}.so"])
            assert (await first.push(KEY)).uploaded

    after = _manifest(source)
    assert len(before["archives"]) == COMPACT_AFTER_ARCHIVES
    assert files.keys() == {f"kernel-{n}.so" for n in range(COMPACT_AFTER_ARCHIVES)}
    (only,) = after["archives"]
    assert only["file_count"] == COMPACT_AFTER_ARCHIVES + 1
    assert after["digest"] == only["digest"]
    # The replaced archives are retired, not deleted: a restore may still be reading them.
    retired = [name for name, _ in after["retired"]]
    assert len(retired) == COMPACT_AFTER_ARCHIVES + 1
    assert all(PREFIX + name in source.objects[BUCKET] for name in retired)

    restored, reads_after, seconds_after = await _restore(tmp_path / "c", source)
    assert restored == written
    assert (reads_before, reads_after) == (COMPACT_AFTER_ARCHIVES, 1)
    print(
        f"\nrestore: {COMPACT_AFTER_ARCHIVES} archives {reads_before} GETs {seconds_before:.3f} s;"
        f" compacted: {reads_after} GET {seconds_after:.3f} s"
    )


async def test_retired_archives_are_deleted_only_once_their_grace_is_over(
    tmp_path: Path,
) -> None:
    """A sweep inside the grace deletes nothing; after it, the retirees and their listing go."""
    source = MemorySource(objects={BUCKET: {}})
    async with node(tmp_path / "a", source) as first:
        path = (await first.ensure(PARTS)).info.path
        for number in range(COMPACT_AFTER_ARCHIVES + 1):
            (path / "inductor" / f"kernel-{number}.so").write_bytes(os.urandom(1000))
            await first.push(KEY)
    remote = RemoteCompileCaches(
        source, parse_uri(f"s3://{BUCKET}/cc/node/"), signing=shared_signing()
    )
    manifest = await remote.read_manifest(KEY)
    assert manifest is not None
    retired = [name for name, _ in manifest.retired]

    assert await remote.sweep(KEY, manifest, time.time() - 3600) == 0
    assert await remote.sweep(KEY, manifest, time.time() + 1) == len(retired)
    assert not any(PREFIX + name in source.objects[BUCKET] for name in retired)
    swept = await remote.read_manifest(KEY)
    assert swept is not None
    assert (swept.retired, len(swept.archives)) == ((), 1)
    restored, _, _ = await _restore(tmp_path / "b", source)
    assert len(restored) == COMPACT_AFTER_ARCHIVES + 1


async def test_compact_on_request_makes_a_few_archives_one_and_says_why_it_would_not(
    tmp_path: Path,
) -> None:
    """`compact` below the automatic limit leaves one archive a restore reads in one GET; a
    second compact, a key never uploaded and a node without S3 each say why nothing changed."""
    source = MemorySource(objects={BUCKET: {}})
    written: dict[str, bytes] = {}
    async with node(tmp_path / "a", source) as first:
        path = (await first.ensure(PARTS)).info.path
        for number in range(3):
            written[f"kernel-{number}.so"] = os.urandom(5000)
            (path / "inductor" / f"kernel-{number}.so").write_bytes(written[f"kernel-{number}.so"])
            assert (await first.push(KEY)).uploaded
        assert len(_manifest(source)["archives"]) == 3

        done = await first.compact(KEY[:10])
        assert (done.compacted, done.archives_before, done.skipped_reason) == (True, 3, "")
        assert done.uri == f"s3://{BUCKET}/cc/node/{KEY}/"
        assert done.archive_bytes == _manifest(source)["archives"][0]["archive_bytes"]
        again = await first.compact(KEY)
        assert (again.compacted, again.skipped_reason) == (False, "it has one archive already")
        never = await first.compact("f" * 32)
        assert (never.compacted, never.skipped_reason) == (
            False,
            "nothing was uploaded for this key",
        )
    restored, reads, _ = await _restore(tmp_path / "b", source)
    assert (restored, reads) == (written, 1)

    async with node(tmp_path / "local", source, shared=False) as local_only:
        await local_only.ensure(PARTS)
        with pytest.raises(Conflict, match=r"compile_cache\.uri is not set"):
            await local_only.compact(KEY)


class _ManifestChangesDuringCompaction(MemorySource):
    """S3 in which another node changes the key's manifest while a compaction uploads its
    union (after the compaction read the manifest, before it switches it)."""

    armed = False

    async def put_object(self, bucket: str, key: str, body: bytes, **conditions: Any) -> str:
        """Before the union's PUT lands, rewrite the manifest as another writer would."""
        if self.armed and key.endswith(".tar.zst"):
            self.armed = False
            manifest = self.objects[bucket][PREFIX + "manifest.json"]
            self.objects[bucket][PREFIX + "manifest.json"] = manifest + b" "
        return await super().put_object(bucket, key, body, **conditions)


async def test_a_compaction_that_loses_the_manifest_race_deletes_its_union(
    tmp_path: Path,
) -> None:
    """Another writer changes the manifest mid-compaction: the switch is refused, the manifest
    keeps its archives, and the union archive uploaded for it is deleted, not orphaned."""
    source = _ManifestChangesDuringCompaction(objects={BUCKET: {}})
    async with node(tmp_path / "a", source) as first:
        path = (await first.ensure(PARTS)).info.path
        for number in range(3):
            (path / "inductor" / f"kernel-{number}.so").write_bytes(os.urandom(3000))
            assert (await first.push(KEY)).uploaded
        archives = {name for name in source.objects[BUCKET] if name.endswith(".tar.zst")}
        source.armed = True
        lost = await first.compact(KEY)
    assert (lost.compacted, lost.skipped_reason) == (
        False,
        "another node changed the manifest meanwhile",
    )
    assert len(_manifest(source)["archives"]) == 3
    assert {name for name in source.objects[BUCKET] if name.endswith(".tar.zst")} == archives


class _ManifestReadHeld(MemorySource):
    """S3 whose manifest reads wait while ``held`` is clear (once ``armed``)."""

    armed = False

    def __init__(self, **fields: Any) -> None:
        super().__init__(**fields)
        self.held = asyncio.Event()
        self.reading = asyncio.Event()

    async def get_object(self, bucket: str, key: str, *, max_bytes: int) -> Any:
        """Hold an armed manifest read until the test lets it go."""
        if self.armed and key.endswith("manifest.json"):
            self.reading.set()
            await self.held.wait()
        return await super().get_object(bucket, key, max_bytes=max_bytes)


async def test_a_second_compaction_of_a_key_on_one_node_is_refused_while_one_runs(
    tmp_path: Path,
) -> None:
    """While a compaction of a key runs on this node, another of the same key is a Conflict;
    once it ends, the key can be compacted again."""
    source = _ManifestReadHeld(objects={BUCKET: {}})
    async with node(tmp_path / "a", source) as first:
        path = (await first.ensure(PARTS)).info.path
        for number in range(2):
            (path / "inductor" / f"kernel-{number}.so").write_bytes(os.urandom(3000))
            assert (await first.push(KEY)).uploaded
        source.armed = True
        running = asyncio.ensure_future(first.compact(KEY))
        await source.reading.wait()
        with pytest.raises(Conflict, match="being compacted already"):
            await first.compact(KEY)
        source.held.set()
        assert (await running).compacted
        source.armed = False
        assert (await first.compact(KEY)).skipped_reason == "it has one archive already"
