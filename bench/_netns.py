"""A network namespace of the bench's own, joined to the host by one veth pair.

The server runs inside it (``Namespace.wrap(argv)``), the clients on the host;
the only route between them is the pair's /30 of link-local addresses
(169.254.213.1 on the host, .2 inside), which no router forwards, so no byte
of a run leaves the machine or reaches another address. The namespace, the
pair and every process still inside are removed by ``close()``, which the
``with`` block runs on any exit (the bench turns SIGTERM into an exception so
that it does).

Needs root (``ip netns``, ``tc``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from ._shaping import Profile, tc_batch

__all__ = ["HOST_ADDRESS", "NAMESPACE_ADDRESS", "Namespace", "NamespaceError"]

HOST_ADDRESS = "169.254.213.1"
NAMESPACE_ADDRESS = "169.254.213.2"
PREFIX_LENGTH = 30
_COMMAND_TIMEOUT = 60.0


class NamespaceError(RuntimeError):
    """The namespace, its link or its shaping could not be set up."""


def _run(argv: Sequence[str], *, timeout: float = _COMMAND_TIMEOUT) -> str:
    result = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise NamespaceError(f"{' '.join(argv)}: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


class Namespace:
    """``pwbench<pid>`` and its veth pair; a context manager that removes both."""

    def __init__(self, tag: str | None = None) -> None:
        suffix = tag if tag is not None else str(os.getpid())
        self.name = f"pwbench{suffix}"
        # Interface names stop at 15 characters.
        self.host_dev = f"pwb{suffix}h"[:15]
        self.inner_dev = f"pwb{suffix}n"[:15]
        self._made = False

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def open(self) -> Self:
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise NamespaceError(f"{tool} is not installed (apt-get install iproute2).")
        if os.geteuid() != 0:
            raise NamespaceError("the shaped bench needs root (network namespaces, tc).")
        _run(["ip", "netns", "add", self.name])
        self._made = True
        _run(
            [
                *("ip", "link", "add", self.host_dev, "type", "veth"),
                *("peer", "name", self.inner_dev, "netns", self.name),
            ]
        )
        _run(["ip", "addr", "add", f"{HOST_ADDRESS}/{PREFIX_LENGTH}", "dev", self.host_dev])
        _run(["ip", "link", "set", self.host_dev, "up"])
        self.exec(
            ["ip", "addr", "add", f"{NAMESPACE_ADDRESS}/{PREFIX_LENGTH}", "dev", self.inner_dev]
        )
        self.exec(["ip", "link", "set", self.inner_dev, "up"])
        self.exec(["ip", "link", "set", "lo", "up"])
        return self

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def exec(self, argv: Sequence[str], *, timeout: float = _COMMAND_TIMEOUT) -> str:
        """Run ``argv`` inside the namespace to completion; its stdout."""
        return _run(self.wrap(argv), timeout=timeout)

    def shape(self, profile: Profile) -> None:
        """Replace the shaping of what the server sends with ``profile``'s tree."""
        with contextlib.suppress(NamespaceError):
            self.exec(["tc", "qdisc", "del", "dev", self.inner_dev, "root"])
        with tempfile.NamedTemporaryFile("w", prefix="pwbench-tc-", suffix=".batch") as batch:
            batch.write("\n".join(tc_batch(self.inner_dev, profile)) + "\n")
            batch.flush()
            self.exec(["tc", "-batch", batch.name], timeout=120.0)

    def class_bytes(self) -> dict[str, int]:
        """Bytes sent so far by each htb class (``1:1`` the link, ``1:1xx`` the leaves)."""
        out = self.exec(["tc", "-s", "class", "show", "dev", self.inner_dev])
        counts: dict[str, int] = {}
        current = ""
        for line in out.splitlines():
            words = line.split()
            if words[:2] == ["class", "htb"]:
                current = words[2]
            elif words[:1] == ["Sent"] and current:
                counts[current] = int(words[1])
        return counts

    def pids(self) -> list[int]:
        """Processes living in the namespace."""
        if not self._made:
            return []
        try:
            out = _run(["ip", "netns", "pids", self.name], timeout=10.0)
        except (NamespaceError, subprocess.TimeoutExpired):
            return []
        return [int(word) for word in out.split() if word.isdigit()]

    def close(self) -> None:
        """Kill what runs inside, delete the pair and the namespace; never raises."""
        if not self._made:
            return
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            pids = self.pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while pids and time.monotonic() < deadline and self.pids():
                time.sleep(0.05)
        with contextlib.suppress(NamespaceError, subprocess.TimeoutExpired):
            _run(["ip", "link", "del", self.host_dev], timeout=10.0)
        with contextlib.suppress(NamespaceError, subprocess.TimeoutExpired):
            _run(["ip", "netns", "del", self.name], timeout=10.0)
        self._made = False
        if Path(f"/run/netns/{self.name}").exists():
            print(f"warning: namespace {self.name} is still there; remove it by hand", flush=True)
