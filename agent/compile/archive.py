"""A compile-cache directory as one ``.tar.zst`` archive, and a content digest of it.

Packing skips what is not an artifact: lock files, temporary files and
directories (inductor's ``.<pid>.<tid>.tmp``, Triton's ``tmp.pid_*``,
``tempfile``'s ``tmpXXXXXXXX``), byte-code caches. A file that changes while it
is being packed aborts the pack (``ChangedDuringPack``); the watcher packs
again once the directory is quiet.

The digest covers each kept file's relative path, kind, executable bit, size
and sha256, in path order: it is the same for the same content wherever the
directory lives, and it is what an uploaded archive is named and checked by.

Archives hold regular files and directories only. Packing skips symbolic
links (a link is no compiled artifact, and one pod's link must never reach
every node). Unpacking trusts nothing in the archive. Refused, with
IntegrityError naming the member: any link (symbolic or hard), absolute paths,
``..`` components, a name component over 255 bytes or a path over 4096,
devices, FIFOs, more bytes than allowed, and content whose digest differs from
the one expected (a truncated or corrupt archive). A full disk while unpacking
is NoSpace. Everything runs in worker threads; nothing here is async; an
unpack stops at its next block once its ``cancel`` event is set.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import tarfile
import threading
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import zstandard

from agent._exceptions import IntegrityError, NoSpace, PrewarmError
from agent.compile.frames import FrameReader

__all__ = [
    "ChangedDuringPack",
    "FileFacts",
    "PackResult",
    "UnpackCancelled",
    "UnpackResult",
    "content_digest",
    "digest_of_files",
    "is_ignored",
    "pack",
    "unpack",
    "walk_artifacts",
]

DIGEST_PREFIX = "sha256:"
_DIGEST_SALT = b"prewarm-compile-cache-v1\n"
_COPY_BLOCK = 1024 * 1024
_ZSTD_LEVEL = 3
_TEMPFILE_NAME = re.compile(r"^tmp[a-z0-9_]{8}$")
_IGNORED_SUFFIXES = (".lock", ".tmp", ".temp", ".partial", ".part", ".swp", "~")
_IGNORED_NAMES = frozenset({"__pycache__"})
# Linux's limits (NAME_MAX, PATH_MAX): a longer member name could never be created.
_MAX_NAME_BYTES = 255
_MAX_PATH_BYTES = 4096


class ChangedDuringPack(PrewarmError):
    """A file changed (or vanished) while the directory was being packed; pack again later."""


class UnpackCancelled(PrewarmError):
    """The caller stopped an unpack (its restore timed out or was cancelled)."""


# One packed file as a manifest lists it: path, size, sha256, executable.
FileFacts = tuple[str, int, str, bool]


@dataclass(frozen=True, slots=True)
class PackResult:
    """What packing a key directory produced: the archive's digest and size, and its files."""

    digest: str
    file_count: int
    # Bytes of the files packed, and of the compressed archive.
    content_bytes: int
    archive_bytes: int
    files: tuple[FileFacts, ...] = ()


@dataclass(frozen=True, slots=True)
class UnpackResult:
    """What unpacking an archive produced: its digest, and the files and bytes it held."""

    digest: str
    file_count: int
    content_bytes: int


@dataclass(frozen=True, slots=True)
class _Entry:
    path: str  # relative, with "/" separators
    kind: str  # "f" (regular file); the digest format leaves room for other kinds
    executable: bool
    size: int
    content: str  # sha256 of the bytes, or the link's target


def is_ignored(relative: str) -> bool:
    """True for paths that are not artifacts: locks, temporary files, partial writes."""
    for part in relative.split("/"):
        if part in _IGNORED_NAMES or part.endswith(_IGNORED_SUFFIXES):
            return True
        if part.startswith(("tmp.", ".nfs")) or _TEMPFILE_NAME.match(part):
            return True
    return False


def _digest_of(entries: list[_Entry]) -> str:
    hasher = hashlib.sha256(_DIGEST_SALT)
    for entry in sorted(entries, key=lambda e: e.path):
        mode = "x" if entry.executable else "-"
        hasher.update(
            f"{entry.kind}\0{entry.path}\0{mode}\0{entry.size}\0{entry.content}\n".encode(
                "utf-8", "surrogateescape"
            )
        )
    return DIGEST_PREFIX + hasher.hexdigest()


def digest_of_files(files: Iterable[FileFacts]) -> str:
    """The digest of a set of files as listed (a union of archives, say)."""
    return _digest_of([_Entry(path, "f", exe, size, sha) for path, size, sha, exe in files])


def walk_artifacts(
    directory: Path, group: int | None = None, foreign: list[str] | None = None
) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Every kept regular file under ``directory``, never following links, in path order.

    Symbolic links are not artifacts: they are neither packed nor counted. With
    ``group``, neither is a file of another group or with a second hard link:
    in a compile domain's setgid directory every file made there has the
    domain's group, so such a file was moved or linked in from elsewhere (by
    someone outside the domain). Their paths are added to ``foreign``.
    """
    pending = [""]
    while pending:
        prefix = pending.pop()
        base = directory / prefix if prefix else directory
        try:
            listing = sorted(os.scandir(base), key=lambda e: e.name)
        except FileNotFoundError:
            continue  # removed while we walked; its files are not artifacts any more
        children: list[str] = []
        for item in listing:
            relative = f"{prefix}/{item.name}" if prefix else item.name
            if is_ignored(relative):
                continue
            if item.is_dir(follow_symlinks=False):
                children.append(relative)
            elif item.is_file(follow_symlinks=False):
                if group is None or _belongs_to(item, group):
                    yield relative, item
                elif foreign is not None:
                    foreign.append(relative)
        pending.extend(reversed(children))


def _belongs_to(item: os.DirEntry[str], group: int) -> bool:
    try:
        info = item.stat(follow_symlinks=False)
    except FileNotFoundError:
        return False  # gone since the listing: not an artifact any more
    return info.st_gid == group and info.st_nlink == 1


class _HashingReader:
    """Reads a file for tarfile while hashing it; stops at the size announced in the header."""

    def __init__(self, handle: IO[bytes], size: int) -> None:
        self._handle = handle
        self._left = size
        self.hasher = hashlib.sha256()

    def read(self, amount: int = -1) -> bytes:
        if amount < 0 or amount > self._left:
            amount = self._left
        data = self._handle.read(amount)
        self._left -= len(data)
        self.hasher.update(data)
        return data


def _tar_info(name: str, *, size: int = 0, mode: int = 0o644) -> tarfile.TarInfo:
    # Fixed owner and time: the archive says only what the digest covers.
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _pack_file(tar: tarfile.TarFile, directory: Path, relative: str) -> _Entry:
    path = directory / relative
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, OSError) as exc:
        raise ChangedDuringPack(f"{relative} went away while packing ({exc}).") from exc
    with os.fdopen(fd, "rb") as handle:
        before = os.fstat(handle.fileno())
        if not stat.S_ISREG(before.st_mode):
            raise ChangedDuringPack(f"{relative} is no longer a regular file.")
        executable = bool(before.st_mode & 0o111)
        info = _tar_info(relative, size=before.st_size, mode=0o755 if executable else 0o644)
        reader = _HashingReader(handle, before.st_size)
        try:
            tar.addfile(info, reader)
        except OSError as exc:  # tarfile's "unexpected end of data": the file shrank
            raise ChangedDuringPack(f"{relative} shrank while packing.") from exc
        after = os.fstat(handle.fileno())
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise ChangedDuringPack(f"{relative} was written to while packing.")
    return _Entry(relative, "f", executable, before.st_size, reader.hasher.hexdigest())


def _result(entries: list[_Entry], archive_bytes: int) -> PackResult:
    return PackResult(
        digest=_digest_of(entries),
        file_count=len(entries),
        content_bytes=sum(e.size for e in entries),
        archive_bytes=archive_bytes,
        files=tuple((e.path, e.size, e.content, e.executable) for e in entries),
    )


def pack(
    directory: Path,
    archive: Path,
    *,
    skip: Container[str] = frozenset(),
    group: int | None = None,
) -> PackResult:
    """Write ``directory``'s artifacts to ``archive`` (.tar.zst) and return their digest.

    Paths in ``skip`` (already uploaded by someone) are left out, and with
    ``group`` the files that are not that group's (see ``walk_artifacts``).

    Raises ChangedDuringPack when a file changes under it; ``archive`` is then
    incomplete and the caller removes it.
    """
    entries: list[_Entry] = []
    with archive.open("wb") as raw:
        compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True)
        with (
            compressor.stream_writer(raw, closefd=False) as compressed,
            tarfile.open(fileobj=compressed, mode="w|", format=tarfile.PAX_FORMAT) as tar,
        ):
            for relative, _ in walk_artifacts(directory, group):
                if relative not in skip:
                    entries.append(_pack_file(tar, directory, relative))
        raw.flush()
        os.fsync(raw.fileno())
        archive_bytes = raw.tell()
    return _result(entries, archive_bytes)


def content_digest(
    directory: Path, group: int | None = None, foreign: list[str] | None = None
) -> PackResult:
    """The digest ``pack`` would give, without writing an archive (``group`` as there)."""
    entries: list[_Entry] = []
    for relative, item in walk_artifacts(directory, group, foreign):
        hasher = hashlib.sha256()
        try:
            fd = os.open(item.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as handle:
                size = 0
                while block := handle.read(_COPY_BLOCK):
                    hasher.update(block)
                    size += len(block)
                executable = bool(os.fstat(handle.fileno()).st_mode & 0o111)
        except OSError as exc:  # gone, or replaced by a link since the walk
            raise ChangedDuringPack(f"{relative} went away while hashing ({exc}).") from exc
        entries.append(_Entry(relative, "f", executable, size, hasher.hexdigest()))
    return _result(entries, 0)


def _refuse(archive: Path, member: str, why: str) -> IntegrityError:
    return IntegrityError(
        f"Refused compile-cache archive {archive.name}: member {member!r} {why}. The archive "
        "was not extracted; the pod gets an empty directory and the next upload replaces it.",
        path=member,
        check="unsafe-archive",
    )


def _safe_member_name(archive: Path, name: str) -> str:
    if "\x00" in name or name.startswith("/") or not name:
        raise _refuse(archive, name, "has an absolute or empty path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise _refuse(archive, name, "has a '..' component")
    encoded = [os.fsencode(p) for p in parts]
    if any(len(p) > _MAX_NAME_BYTES for p in encoded):
        raise _refuse(archive, name[:300], f"has a name component over {_MAX_NAME_BYTES} bytes")
    if sum(len(p) + 1 for p in encoded) > _MAX_PATH_BYTES:
        raise _refuse(archive, name[:300], f"has a path over {_MAX_PATH_BYTES} bytes")
    return "/".join(parts)


class _Extractor:
    def __init__(
        self, archive: Path, dest: Path, max_bytes: int, cancel: threading.Event | None
    ) -> None:
        self.archive = archive
        self.dest = dest
        self.max_bytes = max_bytes
        self.cancel = cancel
        self.entries: list[_Entry] = []
        self.written = 0

    def check_cancelled(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise UnpackCancelled(f"Unpacking {self.archive.name} was stopped by its caller.")

    def member(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        self.check_cancelled()
        name = _safe_member_name(self.archive, member.name)
        target = self.dest / name
        if member.isdir():
            target.mkdir(parents=True, exist_ok=True)
        elif member.isreg():
            self._file(tar, member, name, target)
        elif member.issym():
            # Nothing is ever packed as a link; one here was put in by hand.
            raise _refuse(self.archive, member.name, "is a symbolic link (archives hold no links)")
        elif member.islnk():
            raise _refuse(self.archive, member.name, "is a hard link (archives hold no links)")
        else:
            raise _refuse(self.archive, member.name, "is a device, FIFO or other special file")

    def _file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, name: str, target: Path) -> None:
        self.written += member.size
        if self.written > self.max_bytes:
            raise IntegrityError(
                f"Refused compile-cache archive {self.archive.name}: it unpacks to more than "
                f"{self.max_bytes} bytes, more than the disk tier can take.",
                path=name,
                check="size",
            )
        source = tar.extractfile(member)
        if source is None:  # pragma: no cover - regular members always have data
            raise _refuse(self.archive, member.name, "has no data")
        target.parent.mkdir(parents=True, exist_ok=True)
        executable = bool(member.mode & 0o111)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        hasher = hashlib.sha256()
        with os.fdopen(os.open(target, flags, 0o755 if executable else 0o644), "wb") as out:
            while block := source.read(_COPY_BLOCK):
                self.check_cancelled()
                hasher.update(block)
                out.write(block)
        self.entries.append(_Entry(name, "f", executable, member.size, hasher.hexdigest()))


def unpack(
    archive: Path,
    dest: Path,
    *,
    expected_digest: str,
    max_bytes: int,
    cancel: threading.Event | None = None,
) -> UnpackResult:
    """Extract ``archive`` into the empty directory ``dest`` and check its digest.

    Raises IntegrityError (check "unsafe-archive", "archive", "digest" or
    "size") when the archive is unsafe, unreadable, truncated or not what was
    expected, NoSpace when the disk fills, UnpackCancelled once ``cancel`` is
    set; ``dest`` then holds a partial extraction for the caller to remove.
    """
    extractor = _Extractor(archive, dest, max_bytes, cancel)
    try:
        with archive.open("rb") as raw:
            stream = FrameReader(raw, archive)
            with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
                for member in tar:
                    extractor.member(tar, member)
            # tarfile stops at its end-of-archive marker; the frame must end as well.
            while stream.read(_COPY_BLOCK):
                pass
    except FileExistsError as exc:
        raise _refuse(archive, str(exc.filename or "?"), "appears twice") from exc
    except OSError as exc:
        raise _unpack_os_error(archive, exc) from exc
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise IntegrityError(
            f"Compile-cache archive {archive.name} is corrupt or truncated ({exc}).",
            path=archive.name,
            check="archive",
        ) from exc
    digest = _digest_of(extractor.entries)
    if digest != expected_digest:
        raise IntegrityError(
            f"Compile-cache archive {archive.name} holds content {digest}, not the "
            f"{expected_digest} its pointer names: it is truncated or corrupt.",
            path=archive.name,
            check="digest",
        )
    return UnpackResult(digest, len(extractor.entries), sum(e.size for e in extractor.entries))


def _unpack_os_error(archive: Path, exc: OSError) -> PrewarmError:
    """What a failed write while unpacking means to the caller: a full disk, or a bad archive."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(
            f"The disk filled while unpacking compile-cache archive {archive.name}; free space "
            "on the disk tier (or lower its budget) and try again."
        )
    member = str(exc.filename or archive.name)
    return IntegrityError(
        f"Refused compile-cache archive {archive.name}: member {member[:300]!r} cannot be "
        f"created ({os.strerror(exc.errno or 0)}). The archive was not extracted.",
        path=member[:300],
        check="unsafe-archive",
    )
