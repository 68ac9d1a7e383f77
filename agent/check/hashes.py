"""Content hashes of cached files, and the check of a file against a source's checksum.

The content hash ("xxh3-128/chunks") is built for a file written as ranges, out
of order, by concurrent workers, and resumed after a crash:

    chunk i  = bytes [i * chunk_size, min((i + 1) * chunk_size, size))
    digest   = xxh3_128(xxh3_128(chunk 0) || xxh3_128(chunk 1) || ...), as hex

Each chunk is hashed on its own, in order within the chunk, so a worker hashes
the range it writes as the bytes go by (``ChunkHasher``), chunks finish in any
order (``ChunkDigests``), and a resumed pull keeps the digests of the chunks it
already has. ``hash_file`` computes the same value from the file on disk, which
is what ``prewarm verify`` does later. An empty file has no chunks; its digest
is xxh3_128 of the empty string. The chunk size is part of the definition, so
the manifest records it next to the algorithm name and the digest.

xxh3 is a checksum against corruption (torn writes, bit rot, a bad disk, a
buggy writer), not a defence against someone who can write the cache: anyone
who can change a file can change its manifest too.

``check_object_checksum`` holds a file to a checksum the source keeps for the
whole object (agent.source.checksums computes S3's); the source says whether
it matches, this module says what a mismatch means.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

import xxhash

from agent._exceptions import IntegrityError
from agent._fs import open_beneath, open_dir

__all__ = [
    "ALGORITHM",
    "DIGEST_SIZE",
    "READ_BLOCK",
    "ChunkDigests",
    "ChunkHasher",
    "FileDigest",
    "FileProblemReport",
    "ObjectChecksum",
    "check_object_checksum",
    "chunk_count",
    "combine",
    "hash_file",
    "verify_files",
]

# The name the manifest records next to the chunk size and the hex digest.
ALGORITHM = "xxh3-128/chunks"
DIGEST_SIZE = 16
# Big enough that the per-call overhead vanishes, small enough to stay in cache
# while xxh3 reads it back: 1-4 MiB measured best (see hash_file).
READ_BLOCK = 4 * 1024 * 1024

ProblemKind = Literal["missing", "size", "hash"]


class ChunkHasher:
    """Hashes one chunk fed in order, in pieces of any size.

    The puller keeps one per range it writes and feeds it each block as the
    block is written; a chunk's digest depends only on its bytes, not on how
    they were cut into pieces.
    """

    __slots__ = ("_length", "_state")

    def __init__(self) -> None:
        """A hasher with nothing fed yet."""
        self._state = xxhash.xxh3_128()
        self._length = 0

    @property
    def length(self) -> int:
        """Bytes fed so far."""
        return self._length

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Feed the next bytes of the chunk."""
        self._state.update(data)
        self._length += len(data)

    def update_from_fd(
        self, fd: int, offset: int, length: int, buffer: bytearray | None = None
    ) -> None:
        """Feed ``length`` bytes of an open file from ``offset``, reusing ``buffer``.

        Positional reads (``preadv``), so the descriptor may be shared with
        writers. For resuming a chunk after a crash: feed the part already on
        disk, then go on with ``update`` as new bytes arrive.
        """
        buffer = buffer if buffer is not None else bytearray(min(READ_BLOCK, max(length, 1)))
        view = memoryview(buffer)
        while length > 0:
            want = view[: min(len(view), length)]
            got = os.preadv(fd, [want], offset)
            if got == 0:
                raise EOFError(f"the file ends at byte {offset}, {length} bytes short")
            self.update(want[:got])
            offset += got
            length -= got

    def digest(self) -> bytes:
        """The chunk's 16-byte digest (feeding may go on afterwards)."""
        return self._state.digest()


def chunk_count(size: int, chunk_size: int) -> int:
    """How many chunks a file of ``size`` bytes has (0 for an empty file)."""
    return -(-size // chunk_size)


def combine(chunk_digests: Iterable[bytes]) -> str:
    """The file's hex digest from its chunks' digests, in chunk order."""
    return xxhash.xxh3_128(b"".join(chunk_digests)).hexdigest()


@dataclass(frozen=True, slots=True)
class FileDigest:
    """A file's content hash and the digests of its chunks (in order)."""

    digest: str
    chunk_digests: tuple[bytes, ...]


class ChunkDigests:
    """The chunk digests of one file as they complete, in any order.

    The puller makes one per file, ``set``s each chunk when its range is fully
    written, and calls ``finish`` once the download is done.
    """

    def __init__(self, size: int, chunk_size: int) -> None:
        """Slots for the chunks of a ``size``-byte file; ValueError for a chunk size under 1."""
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, not {chunk_size}")
        self.size = size
        self.chunk_size = chunk_size
        self._digests: list[bytes | None] = [None] * chunk_count(size, chunk_size)

    def chunk_length(self, index: int) -> int:
        """Bytes in chunk ``index`` (the last one may be shorter)."""
        return min(self.chunk_size, self.size - index * self.chunk_size)

    def set(self, index: int, digest: bytes) -> None:
        """Record chunk ``index``'s digest; ValueError if it is not a 16-byte digest."""
        if len(digest) != DIGEST_SIZE:
            raise ValueError(f"a chunk digest is {DIGEST_SIZE} bytes, not {len(digest)}")
        self._digests[index] = digest

    def missing(self) -> list[int]:
        """The indexes of the chunks without a digest yet, in order."""
        return [i for i, d in enumerate(self._digests) if d is None]

    def finish(self) -> FileDigest:
        """The file's digest; ValueError if a chunk has no digest yet."""
        digests = tuple(d for d in self._digests if d is not None)
        if len(digests) != len(self._digests):
            raise ValueError(f"chunks {self.missing()[:10]} have no digest yet")
        return FileDigest(combine(digests), digests)


def hash_file(
    path: str | os.PathLike[str], chunk_size: int, *, read_block: int = READ_BLOCK
) -> FileDigest:
    """The content hash of a file on disk (blocking: run it in a thread).

    One buffer, reused with positional ``readinto``-style reads (``preadv``).
    Measured once on a 512 MiB file in /dev/shm (2-vCPU AMD EPYC VM, 64 MiB
    chunks, best of 3): 13.3 GB/s with 1 or 4 MiB read blocks, 11.9 GB/s with
    16 MiB (the block falls out of cache before xxh3 reads it); the reads alone
    run at 15.5 GB/s and xxh3_128 over bytes already in memory at 31 GB/s, so the
    copy out of the page cache is the bound. Mapping the file instead (no copy)
    was slower, 7.5 GB/s, paying a page fault per 4 KiB. The reads and xxh3
    release the GIL: two threads hashing at once reached 18 GB/s together.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _hash_fd(fd, chunk_size, read_block=read_block, name=os.fspath(path))
    finally:
        os.close(fd)


def _hash_fd(fd: int, chunk_size: int, *, read_block: int, name: str) -> FileDigest:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, not {chunk_size}")
    buffer = bytearray(min(read_block, chunk_size))
    size = os.fstat(fd).st_size
    # A hint for the disk tier; tmpfs ignores it.
    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
    digests: list[bytes] = []
    for start in range(0, size, chunk_size):
        hasher = ChunkHasher()
        try:
            hasher.update_from_fd(fd, start, min(chunk_size, size - start), buffer)
        except EOFError as exc:
            raise IntegrityError(
                f"{name} shrank while it was being hashed ({exc}).", path=name, check="size"
            ) from exc
        digests.append(hasher.digest())
    return FileDigest(combine(digests), tuple(digests))


@dataclass(frozen=True, slots=True)
class FileProblemReport:
    """One file of a cached model that failed verification."""

    path: str
    check: ProblemKind
    detail: str

    def to_error(self) -> IntegrityError:
        """The problem as the error the API answers with (its check named)."""
        return IntegrityError(f"{self.path}: {self.detail}", path=self.path, check=self.check)


def verify_files(
    directory: str | os.PathLike[str],
    expected: Iterable[tuple[str, int, str]],
    chunk_size: int,
) -> list[FileProblemReport]:
    """Check files against (relative path, size, hex digest); report every failure.

    Sizes are checked first, so a truncated file costs a ``stat``, not a read.
    Only bytes count: each file is re-hashed, never taken from a journal, and
    reached without following a symlink. Blocking; run it in a thread.
    """
    problems: list[FileProblemReport] = []
    try:
        root = open_dir(directory)
    except OSError as exc:
        gone = f"the snapshot directory cannot be opened as one ({exc.strerror})."
        return [FileProblemReport(relative, "missing", gone) for relative, _, _ in expected]
    try:
        for entry in expected:
            problem = _check_file(root, entry, chunk_size)
            if problem is not None:
                problems.append(problem)
    finally:
        os.close(root)
    return problems


def _check_file(
    root: int, entry: tuple[str, int, str], chunk_size: int
) -> FileProblemReport | None:
    relative, size, digest = entry
    # Opened component by component without following links: a symlink in the
    # snapshot is a problem to report, never a path to hash (or to trust).
    try:
        fd = open_beneath(root, relative, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return FileProblemReport(relative, "missing", "the file is gone.")
    except OSError:
        return FileProblemReport(relative, "missing", "the path is a link or not a regular file.")
    try:
        actual = _digest_of_regular_file(fd, relative, size, chunk_size)
    finally:
        os.close(fd)
    if isinstance(actual, FileProblemReport):
        return actual
    if actual != digest:
        return FileProblemReport(
            relative,
            "hash",
            f"the content hash is {actual}, the manifest recorded {digest}; "
            "the file changed after it was written.",
        )
    return None


def _digest_of_regular_file(
    fd: int, relative: str, size: int, chunk_size: int
) -> str | FileProblemReport:
    """The file's content digest, or why it is not the file the manifest recorded."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        return FileProblemReport(relative, "missing", "the path is not a regular file.")
    if info.st_size != size:
        return FileProblemReport(
            relative, "size", f"the file has {info.st_size} bytes, not {size}."
        )
    try:
        return _hash_fd(fd, chunk_size, read_block=READ_BLOCK, name=relative).digest
    except IntegrityError as exc:
        return FileProblemReport(relative, "size", str(exc))


class ObjectChecksum(Protocol):
    """A checksum the source keeps for a whole object (e.g. S3's SHA256 or CRC32)."""

    @property
    def algorithm(self) -> str:
        """The checksum's name, as S3 spells it (``SHA256``, ``CRC32``, ...)."""

    def matches(self, path: str | os.PathLike[str]) -> bool | None:
        """Whether the file holds the object's bytes; None when it cannot be told."""
        ...


def check_object_checksum(
    path: str | os.PathLike[str], checksum: ObjectChecksum, *, relative_path: str, origin: str
) -> None:
    """Raise IntegrityError if the file at ``path`` differs from ``origin``'s checksum.

    A checksum that cannot be computed here passes: the content hash and the
    size checks still hold. Blocking: a full read of the file; run it in a thread.
    """
    if checksum.matches(path) is False:
        raise IntegrityError(
            f"{relative_path}: its {checksum.algorithm} checksum differs from the one S3 "
            f"holds for {origin}; not publishing. Pull it again; if it repeats, the "
            "object or the network path is corrupting data.",
            path=relative_path,
            check=f"s3-{checksum.algorithm.lower()}",
        )
