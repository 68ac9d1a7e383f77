"""Which process holds a lease, told apart from any later process that reuses its pid.

A lease held on the lease socket lives exactly as long as its connection, so
while the agent runs the kernel tells it when the holder goes. Across a restart
of the agent that connection is gone, and a pid alone names nobody for sure:
the kernel hands freed pids out again. A process is therefore named by its pid
and its start time (clock ticks after boot, field 22 of ``/proc/<pid>/stat``),
and its death is watched with a pidfd, which refers to that one process and
becomes readable when it exits.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
from pathlib import Path

__all__ = [
    "boot_id",
    "effective_uid",
    "open_pidfd",
    "pidfd_exited",
    "process_start_time",
    "start_time_of_peer",
]

# getsockopt(SOL_SOCKET, SO_PEERPIDFD): a pidfd of a Unix socket's peer (Linux 6.5).
# Python 3.11's socket module does not name it.
_SO_PEERPIDFD = 77
_PROC = Path("/proc")
# Fields of /proc/<pid>/stat after the command name's closing parenthesis start at
# field 3 (state); starttime is field 22.
_STARTTIME_AFTER_COMM = 22 - 3


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot; None if there is no such process."""
    if pid <= 0:
        return None
    try:
        text = (_PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields follow the last ")".
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return int(fields[_STARTTIME_AFTER_COMM])
    except (IndexError, ValueError):
        return None


def effective_uid(pid: int) -> int | None:
    """The effective uid of process ``pid`` (what SO_PEERCRED reports); None if it is gone."""
    try:
        status = (_PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            parts = line.split()
            return int(parts[2]) if len(parts) > 2 else None
    return None


def boot_id() -> str:
    """This boot's random id: start times from another boot name other processes."""
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``, or None when it has exited or pidfds are not available."""
    if pid <= 0:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def pidfd_exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (its pidfd is readable then)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def start_time_of_peer(sock: socket.socket, pid: int) -> int | None:
    """The start time of the process on the other end of ``sock`` (SO_PEERCRED's ``pid``).

    Read through a pidfd of the peer (SO_PEERPIDFD where the kernel has it, else
    ``pidfd_open(pid)``), which must still be open after the read: so the start
    time read is the peer's own and not that of a process that took its pid.
    None when the peer is not visible here (another pid namespace: pid 0) or gone.
    """
    pidfd = _peer_pidfd(sock)
    if pidfd is None:
        pidfd = open_pidfd(pid)
    if pidfd is None:
        return None
    try:
        started = process_start_time(pid)
        return None if pidfd_exited(pidfd) else started
    finally:
        os.close(pidfd)


def _peer_pidfd(sock: socket.socket) -> int | None:
    with contextlib.suppress(OSError):
        pidfd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
        if pidfd > 0:
            return pidfd
    return None
