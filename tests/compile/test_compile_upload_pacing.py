"""Uploads and compactions are paced per key, so tiny pushes cannot make S3 traffic explode.

Issue 25, finding 8: 38 bytes changed over 24 pushes cost 27 archive PUTs, 24 MiB of
downloads (a compaction every few pushes, each downloading every archive) and left 28
archives stored. In process, with MemorySource as S3.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from compile_helpers import BUCKET, ManifestWrites
from compile_helpers import compile_node as node

from agent.compile.keys import CompileKeyParts, compile_key
from agent.compile.transfer import COMPACT_AFTER_ARCHIVES
from agent.testing import MemorySource, unsealed

PARTS = CompileKeyParts(torch_version="2.13.0", model_key="pacing")
KEY = compile_key(PARTS)
MANIFEST = f"cc/node/{KEY}/manifest.json"


def _archives(source: MemorySource) -> int:
    return len(unsealed(source.objects[BUCKET][MANIFEST])["archives"])


def _artifacts(source: MemorySource) -> int:
    return sum(1 for name in source.objects[BUCKET] if "/artifacts/" in name)


async def test_a_push_soon_after_an_upload_waits_and_says_until_when(tmp_path: Path) -> None:
    """With the default interval (60 s), a second push of a changed key right after the first
    is not uploaded: its reason names the setting and the wait; S3 got one archive."""
    source = MemorySource(objects={BUCKET: {}})
    async with node(tmp_path, source, min_upload_interval_seconds=60) as caches:
        path = (await caches.ensure(PARTS)).info.path
        (path / "inductor" / "a.so").write_bytes(os.urandom(100))
        first = await caches.push(KEY)
        (path / "inductor" / "b.so").write_bytes(os.urandom(38))
        second = await caches.push(KEY)
    assert first.uploaded
    assert not second.uploaded
    assert "compile_cache.min_upload_interval_seconds" in second.skipped_reason
    assert "goes up in" in second.skipped_reason
    assert _artifacts(source) == 1


async def test_the_watcher_uploads_a_key_put_off_by_the_interval_once_it_is_over(
    tmp_path: Path,
) -> None:
    """A change the watcher reports while its key may not go up yet is uploaded when the
    interval ends, without another change to report it."""
    source = ManifestWrites(objects={BUCKET: {}})
    async with node(tmp_path, source, quiet_seconds=0.2, min_upload_interval_seconds=1.0) as caches:
        path = (await caches.ensure(PARTS)).info.path
        (path / "inductor" / "a.so").write_bytes(os.urandom(100))
        async with asyncio.timeout(30):
            await source.manifests(1)
            (path / "inductor" / "b.so").write_bytes(os.urandom(38))
            await source.manifests(2)
    listed = unsealed(source.objects[BUCKET][MANIFEST])
    names = {f[0] for archive in listed["archives"] for f in archive["files"]}
    assert names == {"inductor/a.so", "inductor/b.so"}


async def test_a_key_is_compacted_at_most_once_per_retired_grace(tmp_path: Path) -> None:
    """Twice COMPACT_AFTER_ARCHIVES + 2 uploads in a row compact the key once: the second run
    of archives stays listed until the grace is over, instead of downloading all again."""
    source = MemorySource(objects={BUCKET: {}})
    async with node(tmp_path, source) as caches:
        path = (await caches.ensure(PARTS)).info.path
        for number in range(2 * (COMPACT_AFTER_ARCHIVES + 1)):
            (path / "inductor" / f"k{number}.so").write_bytes(os.urandom(64))
            assert (await caches.push(KEY)).uploaded
    # One union after the first COMPACT_AFTER_ARCHIVES + 1, then one archive per upload.
    assert _archives(source) == 1 + COMPACT_AFTER_ARCHIVES + 1
