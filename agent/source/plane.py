"""The interface between the puller and whatever moves the bulk bytes.

A data plane is handed the ranges of a pull that are not in the staging
directory yet, and must, for each one, write its bytes at its offset
(``RangeSink.write_at`` with a fresh ``ChunkHasher``), report them
(``ProgressSink.add_bytes``), then journal the range
(``RangeSink.complete_range``). It returns once every range is journaled,
or raises from the prewarm error tree naming the object and the cause; ranges
journaled before a failure stay, so the next pull resumes after them.

The sinks are Protocols so that the source never imports the pull layer: the
puller's ``Flight`` is the progress sink and its ``StagingFiles`` the range
sink, both by shape.

Two implementations, held by name in agent.source.plane_registry:
``ProcessPlane`` (process_plane: the S3 data plane, presigned ranged GETs sent
by worker processes, each with its own interpreter lock, as many in flight as
the link takes: agent.source.link) and ``AiobotocorePlane`` (aiobotocore_plane:
reads through the source's own reader in the event loop, for sources that
cannot presign). See docs/data-planes.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from agent._exceptions import PrewarmError
from agent._snapshot import Snapshot, SourceObject
from agent.check.hashes import ChunkHasher
from agent.source.tuning import Tuning

__all__ = [
    "ByteRange",
    "DataPlane",
    "ProgressSink",
    "RangeCursor",
    "RangeSink",
    "plan_ranges",
    "root_cause",
    "write_in_thread",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ByteRange:
    """One journal range: ``length`` bytes of ``obj`` from ``start`` (chunk-aligned)."""

    obj: SourceObject
    start: int
    length: int

    @property
    def where(self) -> str:
        """The range, as messages name it: path and byte span."""
        return f"{self.obj.relative_path} bytes {self.start}-{self.start + self.length - 1}"


@dataclass(slots=True)
class RangeCursor:
    """How far a plane got into one range, and the hash of what it wrote: a retry resumes here."""

    range: ByteRange
    hasher: ChunkHasher
    written: int = 0

    @property
    def offset(self) -> int:
        """The file offset the next byte of this range goes to."""
        return self.range.start + self.written

    @property
    def missing(self) -> int:
        """Bytes of this range not written yet."""
        return self.range.length - self.written


class ProgressSink(Protocol):
    """Where a plane reports the bytes it wrote: the pull's progress (``Flight``)."""

    @property
    def snapshot(self) -> Snapshot:
        """The snapshot being pulled."""
        ...

    @property
    def key(self) -> str:
        """The snapshot's key."""
        ...

    def add_bytes(self, obj: SourceObject, count: int) -> None:
        """``count`` bytes of ``obj`` arrived from the source and were written."""
        ...


class RangeSink(Protocol):
    """The files a plane writes into and journals ranges of (``StagingFiles``)."""

    @property
    def chunk_size(self) -> int:
        """Bytes per journal range."""
        ...

    @property
    def bypass_page_cache(self) -> bool:
        """Whether a plane should write around the page cache (O_DIRECT): the disk tier,
        where a 100 GiB pull must not fill RAM with dirty pages."""
        ...

    def is_done(self, path: str, offset: int) -> bool:
        """Whether the range at ``offset`` of ``path`` is journaled already."""
        ...

    def write_at(
        self, path: str, buffers: Sequence[bytes | memoryview], offset: int, hasher: ChunkHasher
    ) -> None:
        """Write ``buffers`` at ``offset`` and feed them to ``hasher`` (blocking)."""
        ...

    def complete_range(self, path: str, offset: int, length: int, digest: bytes) -> None:
        """Journal a whole range with its chunk digest."""
        ...

    def descriptor(self, path: str) -> int:
        """The open file of ``path``, for a plane that writes it from another process."""
        ...

    def write_failed(self, error: OSError) -> Exception:
        """What a failed write into ``path`` means: NoSpace for a full tier, else the error."""
        ...


class DataPlane(Protocol):
    """Moves a pull's bulk bytes: see the module docstring for what it must do."""

    name: str

    async def download(
        self,
        flight: ProgressSink,
        staging: RangeSink,
        ranges: Sequence[ByteRange],
        tuning: Tuning,
    ) -> None:
        """Write and journal every range; raise a PrewarmError naming what failed."""
        ...


def plan_ranges(snapshot: Snapshot, staging: RangeSink) -> list[ByteRange]:
    """The ranges of the snapshot that the staging directory does not hold yet, in order."""
    chunk = staging.chunk_size
    return [
        ByteRange(obj, start, min(chunk, obj.size - start))
        for obj in snapshot.objects
        for start in range(0, obj.size, chunk)
        if not staging.is_done(obj.relative_path, start)
    ]


def root_cause(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to report from a task group: the first prewarm error, else the first."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        current = pending.pop(0)
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        else:
            leaves.append(current)
    return next((e for e in leaves if isinstance(e, PrewarmError)), leaves[0])


async def write_in_thread(function: Callable[..., T], *args: Any) -> T:
    """Run a blocking write in a worker thread; if cancelled, let it finish first.

    A write left running after its pull gave up could land on a descriptor
    number that has since been reused for another file.
    """
    job = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job])
        raise
