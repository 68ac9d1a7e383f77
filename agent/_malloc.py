"""Freed large buffers go back to the operating system (glibc's malloc).

glibc serves an allocation above ``M_MMAP_THRESHOLD`` (128 KiB) with a mapping
of its own and unmaps it when it is freed, but by default it raises that
threshold to the size of each such block freed (up to 32 MiB). After the first
data-plane buffer (512 KiB per worker thread of the threads plane) was freed,
the next ones came from the worker threads' malloc arenas, which keep what they
held: three rounds of 64 concurrent cold pulls left the daemon at 340 MB instead
of about 110 MB, and 16 pulls at 179 MB instead of 110 MB. Setting the threshold
explicitly turns that adjustment off (mallopt(3)); a buffer then costs one mmap
and one munmap, once per worker and pull.
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["return_large_buffers"]

# mallopt(3) parameter numbers, and glibc's default threshold.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 128 * 1024


def return_large_buffers() -> bool:
    """Fix glibc's mmap threshold at its default for this process; False where not glibc.

    Call at start, before the process has threads: the setting is process-wide.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))
