"""Why the agent's socket cannot be reached: one diagnosis for every way of reaching it.

A failed connect says little, and says it alike for different faults: a
directory or a regular file at the path refuses a connect just as a socket
nobody listens on does. So the path itself is examined: its length, what it
names, the group of a socket (or directory) this user may not open, and one
plain connect. A call (``translate_rpc_error``), ``wait_for_agent`` and
``prewarm health`` all end here, so one situation reads the same from every
command.

The path comes from the agent's config, which a client cannot read (it may
not be the default file, and a pod has none), so the sentences say where it
is set on each side instead of quoting a value.
"""

from __future__ import annotations

import grp
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from agent._exceptions import AgentUnavailable

__all__ = ["MAX_SOCKET_PATH_BYTES", "Unreachable", "connect_error", "diagnose", "too_long"]

# A Unix socket address holds 108 bytes, the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107
# A listener whose backlog is full leaves a connect hanging: alive, but not answering.
PROBE_TIMEOUT_SECONDS = 1.0

_WHERE_THE_PATH_IS_SET = (
    "The agent serves on socket_path from its config (/etc/prewarm/agent.toml, or the file "
    "given to prewarmd --config); point this client at that path with --socket or "
    "PREWARM_SOCKET_PATH."
)
_START_THE_AGENT = (
    "Start the agent (systemctl start prewarmd, or the prewarm DaemonSet's pod on this node)."
)

# What stat(2) may find at the path instead of a socket.
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


@dataclass(frozen=True)
class Unreachable:
    """Why no agent can be reached at ``path`` (``cause``), what to do about it (``fix``),
    and whether waiting for the agent could change it (``lasting``: it cannot)."""

    path: Path
    cause: str
    fix: str
    lasting: bool

    def error(self) -> AgentUnavailable:
        """The one sentence every command says for it."""
        return AgentUnavailable(
            f"cannot reach the prewarm agent at {self.path}: {self.cause}. {self.fix}"
        )


def connect_error(path: Path) -> OSError | None:
    """One plain connect to ``path``: None if a listener took it, else why not."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_SECONDS)
        try:
            probe.connect(os.fsencode(path))
        except OSError as exc:
            return exc
    return None


def too_long(path: Path) -> Unreachable | None:
    """Why ``path`` can never be connected to, if it is longer than a socket address holds
    (known before any call: grpc itself would log the path raw on stderr and answer nothing)."""
    size = len(os.fsencode(path))
    if size <= MAX_SOCKET_PATH_BYTES:
        return None
    return Unreachable(
        path,
        f"the path is {size} bytes, longer than the {MAX_SOCKET_PATH_BYTES} a Unix socket "
        "address holds",
        "Use a shorter path (--socket / PREWARM_SOCKET_PATH).",
        lasting=True,
    )


def diagnose(path: Path, refusal: OSError | None = None) -> Unreachable | None:
    """Why ``path`` cannot be reached; None when it takes a connection now.

    ``refusal`` is a connect already tried and failed; without one, one is tried here.
    """
    unreachable = too_long(path)
    if unreachable is not None:
        return unreachable
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return Unreachable(
            path, "the socket does not exist", f"{_START_THE_AGENT} {_WHERE_THE_PATH_IS_SET}", False
        )
    except PermissionError:
        return _denied_on_the_way(path)
    if not stat.S_ISSOCK(mode):
        # The agent refuses to bind over anything but a socket: waiting cannot help.
        return Unreachable(path, f"it is {_kind(mode)}, not a socket", _WHERE_THE_PATH_IS_SET, True)
    refusal = refusal or connect_error(path)
    return None if refusal is None else _refused(path, refusal)


def _refused(path: Path, refusal: OSError) -> Unreachable:
    """Why a connect to the socket at ``path`` failed."""
    if isinstance(refusal, PermissionError):
        return _denied(path, "the socket", path)
    if isinstance(refusal, ConnectionRefusedError):
        return Unreachable(
            path,
            "the connection was refused: nothing listens on the socket",
            _START_THE_AGENT,
            False,
        )
    if isinstance(refusal, TimeoutError):
        return Unreachable(
            path,
            f"the socket did not take a connection within {PROBE_TIMEOUT_SECONDS:g} s",
            "The agent is overloaded or stuck: check systemctl status prewarmd.",
            lasting=False,
        )
    return Unreachable(path, refusal.strerror or str(refusal), _WHERE_THE_PATH_IS_SET, False)


def _denied_on_the_way(path: Path) -> Unreachable:
    """stat(2) was refused: name the first directory on the way this user may not search."""
    absolute = path.absolute()
    for entry in [*reversed(absolute.parents), absolute][1:]:
        try:
            entry.stat()  # needs search permission on the directory holding it
        except PermissionError:
            return _denied(path, f"the directory {entry.parent}", entry.parent)
        except OSError:
            break
    return _denied(path, f"the directory {absolute.parent}", absolute.parent)


def _denied(path: Path, what: str, owned: Path) -> Unreachable:
    """Permission denied on ``owned`` (the socket, or a directory on its way): name its group."""
    try:
        facts = owned.stat()
    except OSError:
        return Unreachable(
            path, f"permission denied on {what}", "Run as a member of its group or as root.", True
        )
    group = _group_name(facts.st_gid)
    return Unreachable(
        path,
        f"permission denied on {what} (group {group}, mode {stat.S_IMODE(facts.st_mode):04o})",
        f"Run as a member of group {group} or as root (in a pod: "
        f"securityContext.supplementalGroups: [{facts.st_gid}]).",
        lasting=True,
    )


def _group_name(gid: int) -> str:
    """The group's name where this system knows it (a pod's may not), else its number."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def _kind(mode: int) -> str:
    return next((name for test, name in _FILE_KINDS if test(mode)), "a special file")
