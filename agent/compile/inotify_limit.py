"""Whether the kernel would give this user one more inotify watch right now.

watchfiles watches a tree with one inotify watch per directory. When a new
directory appears after the user's watch limit is reached, the watch for it is
not made and nothing says so: its files are never seen. The kernel does tell
anyone who asks for a watch (ENOSPC), so the watcher asks, with a watch of its
own that it drops at once, after each batch of changes that added anything.
Python has no inotify binding; libc's functions are called through ctypes.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from pathlib import Path

__all__ = ["watch_limit_reached", "watch_limit_text"]

_IN_CREATE = 0x00000100
_IN_CLOEXEC = os.O_CLOEXEC
# The user's watch limit (all its processes together), and its user namespace's.
_LIMIT_FILES = ("/proc/sys/fs/inotify/max_user_watches", "/proc/sys/user/max_inotify_watches")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):
        return None  # not Linux, or a libc without inotify: nothing to ask
    return libc


def watch_limit_reached(path: Path) -> bool:
    """True when a watch on ``path`` is refused for the user's watch or instance limit."""
    libc = _libc()
    if libc is None:
        return False
    fd = libc.inotify_init1(_IN_CLOEXEC)
    if fd < 0:
        return ctypes.get_errno() in (errno.EMFILE, errno.ENFILE)
    try:
        if libc.inotify_add_watch(fd, os.fsencode(path), _IN_CREATE) >= 0:
            return False
        return ctypes.get_errno() == errno.ENOSPC
    finally:
        os.close(fd)


def watch_limit_text() -> str:
    """The limits in force, for a message: ``max_user_watches=8192`` and the like."""
    found = []
    for name in _LIMIT_FILES:
        try:
            found.append(f"{Path(name).name}={Path(name).read_text().strip()}")
        except OSError:
            continue
    return ", ".join(found) or "unknown"
