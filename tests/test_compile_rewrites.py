"""A file uploaded while a compiler was still writing it must not stay in S3 that way.

Inductor links a kernel straight to its final path (``gcc -o <hash>.so``), so
an upload that runs while the linker works (the key was quiet for
``quiet_seconds``, or ``prewarm compile push``) can pack the ``.so`` empty or
cut short. Seen with real torch.compile on the loaded 2-core test VM
(tests/test_compile_cache.py with the quiet-time upload): the manifest listed
``inductor/3b/c3bn....main.so`` with 0 bytes while the node held 62,560. The
merge then compares paths only, so the finished file is never sent and every
node that restores the key gets the empty one. In process here, with
MemorySource as S3.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from store_helpers import open_store

from agent._config import CompileCacheSettings, Settings, TierSettings
from agent.compile.cache import CompileCaches
from agent.compile.keys import CompileKeyParts, compile_key
from agent.testing import MemorySource

BUCKET = "caches"
PARTS = CompileKeyParts(torch_version="2.13.0", model_key="rewrites")
KEY = compile_key(PARTS)
KERNEL = "inductor/3b/kernel.main.so"
LINKED = b"\x7fELF" + bytes(range(256)) * 40


@contextlib.asynccontextmanager
async def node(root: Path, source: MemorySource) -> AsyncIterator[CompileCaches]:
    """One node's compile caches under ``root``, sharing ``source``'s bucket."""
    store = await open_store(root)
    settings = Settings(
        tiers=TierSettings(shm_root=root / "shm", disk_root=root / "disk"),
        compile_cache=CompileCacheSettings(uri=f"s3://{BUCKET}/cc", quiet_seconds=3600),
    )
    async with CompileCaches(settings, store, source) as caches:
        yield caches


@pytest.mark.xfail(
    strict=True,
    reason="merge by path: a file rewritten after its upload is never sent again "
    "(agent/compile/remote.py upload, transfer.py pack_delta, manifest.py known)",
)
async def test_a_file_finished_after_it_was_uploaded_reaches_the_next_node_whole(
    tmp_path: Path,
) -> None:
    """A kernel packed half-linked, then finished, is restored on a new node as finished."""
    source = MemorySource(objects={BUCKET: {}})
    async with node(tmp_path / "a", source) as first:
        kernel = (await first.ensure(PARTS)).info.path / KERNEL
        kernel.parent.mkdir(parents=True)
        kernel.write_bytes(b"")  # the linker has created its output, not written it yet
        caught = await first.push(KEY)
        assert caught.uploaded
        kernel.write_bytes(LINKED)
        await first.push(KEY)

    async with node(tmp_path / "b", source) as second:
        restored = await second.ensure(PARTS)
    assert restored.restored
    assert (restored.info.path / KERNEL).read_bytes() == LINKED
