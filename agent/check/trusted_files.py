"""Files that decide whom the agent trusts, read once at start and held in memory.

A public key, a certificate chain or a Sigstore trust root says whose signatures a
source accepts: whoever can write one of them decides what the node publishes. So each
is opened without following a link (and without blocking on a FIFO planted at the path),
must be a regular file owned by root or the agent and writable by no one else, and is
read once. Verification then reads those bytes, handed to ``model_signing`` (which
takes paths) as an anonymous in-memory file of this process: what it reads is what was
checked at start, whatever the configured path holds now.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from agent._config import ConfigError

__all__ = ["held_file", "read_trusted_file"]

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def read_trusted_file(path: Path, *, what: str, max_bytes: int) -> bytes:
    """The bytes of ``what`` at ``path``; ConfigError saying what is wrong otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"{what} {path} is not a readable file ({exc.strerror}).") from None
    try:
        _check_owner_and_mode(path, os.fstat(fd), what)
        data = b""
        while chunk := os.read(fd, max_bytes + 1 - len(data)):
            data += chunk
        if len(data) > max_bytes:
            raise ConfigError(f"{what} {path} is over {max_bytes} bytes: not what it should be.")
        return data
    finally:
        os.close(fd)


def _check_owner_and_mode(path: Path, info: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(info.st_mode) or info.st_uid not in {0, os.geteuid()}:
        raise ConfigError(
            f"{what} {path} must be a regular file owned by root or the agent (it is owned "
            f"by uid {info.st_uid}): whoever can write it decides whose signatures are trusted."
        )
    if info.st_mode & _WRITABLE_BY_OTHERS:
        raise ConfigError(
            f"{what} {path} is writable by others (mode {stat.S_IMODE(info.st_mode):04o}): "
            f"whoever can write it decides whose signatures are trusted; chmod 644 {path}."
        )


@contextmanager
def held_file(data: bytes, name: str) -> Iterator[Path]:
    """A path to ``data`` in this process's memory (memfd), for as long as the block runs."""
    fd = os.memfd_create(f"prewarm-{name}", os.MFD_CLOEXEC)
    try:
        unwritten = memoryview(data)
        while unwritten:
            unwritten = unwritten[os.write(fd, unwritten) :]
        yield Path(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
