"""A file uploaded while a compiler was still writing it must not stay in S3 that way.

Inductor links a kernel straight to its final path (``gcc -o <hash>.so``), so
an upload that runs while the linker works (the key was quiet for
``quiet_seconds``, or ``prewarm compile push``) can pack the ``.so`` empty or
cut short. Seen with real torch.compile on the loaded 2-core test VM
(tests/compile/test_compile_cache.py with the quiet-time upload): the manifest listed
``inductor/3b/c3bn....main.so`` with 0 bytes while the node held 62,560. The
merge compared paths only, so the finished file was never sent and every node
that restored the key got the empty one. Now an upload sends every file whose
content differs from the newest copy the manifest lists, and a restore takes
the newest archive's copy of a path. In process here, with MemorySource as S3.
"""

from __future__ import annotations

from pathlib import Path

from compile_helpers import BUCKET
from compile_helpers import compile_node as node

from agent.compile.keys import CompileKeyParts, compile_key
from agent.source.interface import StoredObject
from agent.testing import MemorySource

PARTS = CompileKeyParts(torch_version="2.13.0", model_key="rewrites")
KEY = compile_key(PARTS)
KERNEL = "inductor/3b/kernel.main.so"
LINKED = b"\x7fELF" + bytes(range(256)) * 40


class LinkerAtManifestRead(MemorySource):
    """S3 in memory; once ``kernel`` is set, the next manifest read finishes writing it."""

    def __init__(self) -> None:
        super().__init__(objects={BUCKET: {}})
        self.kernel: Path | None = None

    async def get_object(self, bucket: str, key: str, *, max_bytes: int) -> StoredObject | None:
        if self.kernel is not None and key.endswith("/manifest.json"):
            self.kernel.write_bytes(LINKED)
            self.kernel = None
        return await super().get_object(bucket, key, max_bytes=max_bytes)


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


async def test_an_empty_copy_listed_after_the_finished_one_is_replaced_again(
    tmp_path: Path,
) -> None:
    """Newest listed wins, so a node re-sends a finished file even if an older archive has it."""
    source = MemorySource(objects={BUCKET: {}})
    async with node(tmp_path / "a", source) as late, node(tmp_path / "b", source) as early:
        late_kernel = (await late.ensure(PARTS)).info.path / KERNEL
        early_kernel = (await early.ensure(PARTS)).info.path / KERNEL
        for kernel in (late_kernel, early_kernel):
            kernel.parent.mkdir(parents=True)
        early_kernel.write_bytes(LINKED)
        assert (await early.push(KEY)).uploaded
        late_kernel.write_bytes(b"")  # caught mid-link after the finished copy went up
        assert (await late.push(KEY)).uploaded
        late_kernel.write_bytes(LINKED)
        assert (await late.push(KEY)).uploaded

    async with node(tmp_path / "c", source) as third:
        restored = await third.ensure(PARTS)
    assert (restored.info.path / KERNEL).read_bytes() == LINKED


async def test_a_file_written_between_hashing_and_packing_is_not_uploaded_yet(
    tmp_path: Path,
) -> None:
    """A file whose bytes change during the upload is still being written: nothing goes up."""
    source = LinkerAtManifestRead()
    async with node(tmp_path / "a", source) as first:
        kernel = (await first.ensure(PARTS)).info.path / KERNEL
        kernel.parent.mkdir(parents=True)
        kernel.write_bytes(b"")
        source.kernel = kernel  # the upload hashes it empty, then the linker writes it
        caught = await first.push(KEY)
        assert not caught.uploaded
        assert "still being written" in caught.skipped_reason
        assert not [name for name in source.objects[BUCKET] if name.endswith(".tar.zst")]
        assert (await first.push(KEY)).uploaded  # once it is quiet, the finished file goes
