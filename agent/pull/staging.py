"""The files of one pull: create or reopen them, write at offsets, check them before publish.

Everything here is blocking file I/O; the puller runs it in worker threads.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent._exceptions import IntegrityError, NoSpace
from agent._fs import open_beneath, open_dir, remove_tree
from agent._snapshot import Snapshot, SourceObject
from agent._vocabulary import TierName
from agent.check.hashes import ChunkHasher, combine
from agent.check.safetensors import read_header as read_safetensors_header
from agent.store.journal import DATA_DIR, CompletedRange, Journal, JournalHeader
from agent.store.roots import journal_key

__all__ = ["StagingFiles", "open_staging", "verify_before_publish"]

log = logging.getLogger(__name__)

_READ_BLOCK = 4 * 1024 * 1024


@dataclass
class StagingFiles:
    """Open descriptors of a pull's files, its journal, and the digests of done chunks."""

    root: Path
    snapshot: Snapshot
    chunk_size: int
    journal: Journal
    fds: dict[str, int]
    tier: TierName = "shm"
    # path -> chunk index -> digest of that chunk, as written (or re-hashed on resume)
    digests: dict[str, dict[int, bytes]] = field(default_factory=dict)

    @property
    def bypass_page_cache(self) -> bool:
        """Whether planes write around the page cache: on the disk tier only."""
        return self.tier == "disk"

    @property
    def data_dir(self) -> Path:
        """The directory the snapshot's files are written in."""
        return self.root / DATA_DIR

    def is_done(self, path: str, offset: int) -> bool:
        """Whether the range at ``offset`` of ``path`` is journaled already."""
        return offset // self.chunk_size in self.digests.get(path, {})

    def write_at(
        self, path: str, buffers: Sequence[bytes | memoryview], offset: int, hasher: ChunkHasher
    ) -> None:
        """Write buffers at offset and feed them to the range's hasher (in a worker thread)."""
        for buffer in buffers:
            hasher.update(buffer)
        fd = self.fds[path]
        total = sum(len(b) for b in buffers)
        try:
            done = os.pwritev(fd, buffers, offset)
            while done < total:  # pwritev may write less than asked; finish the tail
                done += os.pwrite(fd, b"".join(buffers)[done:], offset + done)
        except OSError as exc:
            raise _no_space_or(exc, self.snapshot, self.root) from exc

    def descriptor(self, path: str) -> int:
        """The open file of ``path``."""
        return self.fds[path]

    def write_failed(self, error: OSError) -> Exception:
        """NoSpace for a full tier, else the error itself."""
        return _no_space_or(error, self.snapshot, self.root)

    def complete_range(self, path: str, offset: int, length: int, digest: bytes) -> None:
        """Journal a whole range with its chunk digest."""
        self.digests.setdefault(path, {})[offset // self.chunk_size] = digest
        try:
            self.journal.record(path, offset, length, digest)
        except OSError as exc:
            raise _no_space_or(exc, self.snapshot, self.root) from exc

    def done_bytes(self, obj: SourceObject) -> int:
        """Bytes of ``obj`` complete here: its journaled chunks (re-hashed on resume)."""
        chunk = self.chunk_size
        done = self.digests.get(obj.relative_path, {})
        return sum(min(chunk, obj.size - index * chunk) for index in done)

    def journaled_bytes(self) -> int:
        """Bytes of the snapshot complete here: what a later pull would not fetch again."""
        return sum(self.done_bytes(obj) for obj in self.snapshot.objects)

    def file_digests(self) -> dict[str, str]:
        """Each file's digest, made from its ranges' digests in order."""
        digests: dict[str, str] = {}
        for obj in self.snapshot.objects:
            chunks = self.digests.get(obj.relative_path, {})
            count = -(-obj.size // self.chunk_size)
            missing = [i for i in range(count) if i not in chunks]
            if missing:
                raise IntegrityError(
                    f"{obj.relative_path}: chunks {missing[:5]} were never written; "
                    "not publishing.",
                    path=obj.relative_path,
                    check="complete",
                )
            digests[obj.relative_path] = combine([chunks[i] for i in range(count)])
        return digests

    def close(self) -> None:
        """Close every file (idempotent)."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        self.journal.close()


def open_staging(root: Path, snapshot: Snapshot, chunk_size: int, tier: TierName) -> StagingFiles:
    """Resume the staging directory's pull if its signed journal matches, else start it clean.

    On resume, each range the journal lists is re-hashed from the file and kept
    only if the digest matches, so a write torn by a power loss is fetched again.
    Files are opened through directory descriptors without following links; a
    staging directory holding a link, a hard link or a foreign file starts clean.
    """
    header = JournalHeader.for_snapshot(snapshot, chunk_size)
    secret = journal_key(root.parent.parent)  # <tier root>/staging/<key>
    resumed = _resume(root, header, secret)
    if resumed is not None:
        try:
            return _open_files(root, snapshot, chunk_size, tier, resumed=resumed)
        except _UntrustedEntry as exc:
            log.warning("not resuming %s: %s", root, exc)
    _clear(root)
    (root / DATA_DIR).mkdir(mode=0o755)
    journal = Journal.create(root, header, secret)
    return _open_files(root, snapshot, chunk_size, tier, resumed=(journal, []))


class _UntrustedEntry(Exception):
    """Staging holds something the agent did not make: start clean instead of resuming."""


def _resume(
    root: Path, header: JournalHeader, secret: bytes
) -> tuple[Journal, list[CompletedRange]] | None:
    try:
        for directory in (root, root / DATA_DIR):
            info = directory.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                return None
        return Journal.resume(root, header, secret)
    except FileNotFoundError:
        return None  # a first pull: nothing to resume, nothing to say
    except (OSError, ValueError) as exc:
        log.info("not resuming %s: %s", root, exc)
        return None


def _open_files(
    root: Path,
    snapshot: Snapshot,
    chunk_size: int,
    tier: TierName,
    *,
    resumed: tuple[Journal, list[CompletedRange]],
) -> StagingFiles:
    journal, completed = resumed
    fds: dict[str, int] = {}
    staging = StagingFiles(root, snapshot, chunk_size, journal, fds, tier)
    try:
        data = _open_data_dir(root)
        try:
            for obj in snapshot.objects:
                # On tmpfs, fallocate zero-fills every page that the pull then overwrites
                # (0.55 s of a 3.0 s cold pull of 2 GiB, docs/benchmarks.md); the budget
                # check has already reserved the room, and ENOSPC while writing is still
                # a clean NoSpace. Disk filesystems reserve extents without writing them.
                fds[obj.relative_path] = _open_file(
                    data, obj, snapshot, root, preallocate=tier != "shm"
                )
        finally:
            os.close(data)
        staging.digests = _verified(completed, fds, chunk_size)
    except BaseException:
        staging.close()
        raise
    return staging


def verify_before_publish(
    staging: StagingFiles, *, safetensors_headers: bool, durable: bool
) -> None:
    """Sizes and safetensors headers; flush to disk first on the disk tier."""
    for obj in staging.snapshot.objects:
        fd = staging.fds[obj.relative_path]
        size = os.fstat(fd).st_size
        if size != obj.size:
            raise IntegrityError(
                f"{obj.relative_path} has {size} bytes after the pull but the object has "
                f"{obj.size}; not publishing.",
                path=obj.relative_path,
                check="size",
            )
        if safetensors_headers and obj.relative_path.endswith(".safetensors"):
            read_safetensors_header(fd, size=size, path=obj.relative_path)
        if durable:
            os.fsync(fd)


def _open_data_dir(root: Path) -> int:
    try:
        return open_dir(root / DATA_DIR)
    except OSError as exc:
        raise _UntrustedEntry(f"{DATA_DIR} is not a directory ({exc.strerror})") from exc


def _open_file(
    data: int, obj: SourceObject, snapshot: Snapshot, root: Path, *, preallocate: bool
) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK
    try:
        fd = open_beneath(data, obj.relative_path, flags, 0o644, make_parents=True)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EISDIR):
            raise _UntrustedEntry(f"{obj.relative_path}: {exc.strerror}") from exc
        raise _no_space_or(exc, snapshot, root) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_uid != os.geteuid():
            raise _UntrustedEntry(f"{obj.relative_path} is not a plain file of the agent's")
        os.set_blocking(fd, True)
        if info.st_size != obj.size:
            os.ftruncate(fd, obj.size)
        if obj.size and preallocate:
            # Reserve the blocks now: a full disk fails here, not 90 % into the pull.
            os.posix_fallocate(fd, 0, obj.size)
    except _UntrustedEntry:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise _no_space_or(exc, snapshot, root) from exc
    return fd


def _verified(
    completed: Iterable[CompletedRange], fds: Mapping[str, int], chunk_size: int
) -> dict[str, dict[int, bytes]]:
    digests: dict[str, dict[int, bytes]] = {}
    for done in completed:
        hasher = ChunkHasher()
        position, end = done.offset, done.offset + done.length
        while position < end:
            piece = os.pread(fds[done.path], min(_READ_BLOCK, end - position), position)
            if not piece:
                break
            hasher.update(piece)
            position += len(piece)
        if position == end and hasher.digest() == done.digest:
            digests.setdefault(done.path, {})[done.offset // chunk_size] = done.digest
        else:
            log.warning(
                "journaled range %s@%d does not match its digest; fetching it again",
                done.path,
                done.offset,
            )
    return digests


def _clear(root: Path) -> None:
    remove_tree(root)  # a link in its place is unlinked, never followed
    root.mkdir(mode=0o755, parents=True)


def _no_space_or(exc: OSError, snapshot: Snapshot, root: Path) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        tier = root.parent.parent
        return NoSpace(
            f"The tier at {tier} ran out of space while pulling {snapshot.uri} "
            f"({snapshot.total_bytes} bytes). Evict models (`prewarm ls`, `prewarm evict`) or "
            "request the other tier."
        )
    return exc
