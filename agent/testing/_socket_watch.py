"""Waiting for a Unix socket to be created: inotify on its directory, never a sleep loop.

A test agent binds its API socket a moment before it serves. Connecting before
that fails, and grpc retries a failed connect with a backoff (20 ms growing to
250 ms in the test agents), so a start was seen up to a backoff step late, and
each try cost a connect. ``SocketWatch`` is made before the agent starts and
watches the socket's directory; ``wait`` returns as soon as the socket's name
is created there (a stale socket left by a killed agent is removed and bound
again: created anew), or when the agent is gone, or at the deadline. Where
inotify cannot be had (no instance left), ``wait`` returns at once and the
caller's connect retries as before.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import time
from pathlib import Path

from ._process import Closeable

__all__ = ["SocketWatch"]

# <sys/inotify.h>
_IN_MOVED_TO = 0x80
_IN_CREATE = 0x100
_IN_Q_OVERFLOW = 0x4000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
# struct inotify_event: int wd; uint32_t mask, cookie, len; char name[len].
_EVENT = struct.Struct("iIII")


class SocketWatch(Closeable):
    """Watches the directory of ``path`` for the socket's creation, from construction on."""

    def __init__(self, path: Path) -> None:
        self._name = os.fsencode(path.name)
        self._fd = -1
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return
        if libc.inotify_add_watch(fd, os.fsencode(path.parent), _IN_CREATE | _IN_MOVED_TO) < 0:
            os.close(fd)
            return
        self._fd = fd

    def wait(self, ended: int, timeout: float) -> bool:
        """Block until the socket is created, ``ended`` (a descriptor: a pidfd, a pipe) is
        readable, or ``timeout`` s pass; True when the socket was created (or may have been:
        no inotify, or its queue overflowed)."""
        if self._fd < 0:
            return True
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([self._fd, ended], [], [], left)
            if self._fd in readable and self._created():
                return True
            if ended in readable:
                return False
        return False

    def _created(self) -> bool:
        try:
            data = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return False
        offset = 0
        while offset + _EVENT.size <= len(data):
            _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            name = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0")
            offset += _EVENT.size + length
            if mask & _IN_Q_OVERFLOW or name == self._name:
                return True
        return False

    def close(self) -> None:
        """Stop watching; safe to call twice."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
