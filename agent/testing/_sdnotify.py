"""systemd's side of sd_notify: a datagram socket that records what a daemon tells it.

``NotifySocket`` binds a Unix datagram socket (a path, or an abstract name),
drains it on a thread as systemd does (the kernel queues only a few datagrams,
``net.unix.max_dgram_qlen``, before senders block or fail), and keeps every
message in arrival order. ``env()`` gives the variables systemd would set for a
``Type=notify`` unit; ``wait_for()`` blocks on a condition until a matching
message arrives.
"""

from __future__ import annotations

import os
import selectors
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ._process import Closeable

__all__ = ["NotifyMessage", "NotifySocket"]


@dataclass(frozen=True, slots=True)
class NotifyMessage:
    """One datagram: its ``KEY=VALUE`` lines in order, and when it arrived (monotonic)."""

    lines: tuple[str, ...]
    received: float

    def get(self, key: str) -> str | None:
        """The value of ``key`` in this message (the last one if repeated), or None."""
        found = None
        for line in self.lines:
            name, _, value = line.partition("=")
            if name == key:
                found = value
        return found

    def __contains__(self, line: object) -> bool:
        return line in self.lines


class NotifySocket(Closeable):
    """A stand-in for systemd's ``$NOTIFY_SOCKET``; use as a context manager."""

    def __init__(self, *, abstract: bool = False) -> None:
        self._directory: Path | None = None
        if abstract:
            self.address = f"@prewarm-test-{uuid.uuid4().hex}"
            bind_to: str | bytes = b"\0" + self.address[1:].encode()
        else:
            self._directory = Path(tempfile.mkdtemp(prefix="pw-notify-", dir="/tmp"))
            self.address = str(self._directory / "notify.sock")
            bind_to = self.address
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._socket.bind(bind_to)
        self._wake_r, self._wake_w = os.pipe()
        self._messages: list[NotifyMessage] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._drain, name="notify-socket", daemon=True)
        self._reader.start()

    def env(self, *, watchdog_usec: int | None = None) -> dict[str, str]:
        """What systemd puts in a notify unit's environment."""
        env = {"NOTIFY_SOCKET": self.address}
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        return env

    @property
    def messages(self) -> list[NotifyMessage]:
        """Every message so far, in arrival order."""
        with self._changed:
            return list(self._messages)

    def wait_for(
        self, predicate: Callable[[NotifyMessage], bool], *, timeout: float = 30.0
    ) -> NotifyMessage:
        """The first message (already received or still to come) for which ``predicate`` holds."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for message in self._messages[seen:]:
                    if predicate(message):
                        return message
                seen = len(self._messages)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"No matching sd_notify message within {timeout:.0f} s; "
                        f"received: {[m.lines for m in self._messages]}"
                    )
                self._changed.wait(remaining)

    def close(self) -> None:
        """Stop the reader thread, close the socket and remove its directory."""
        os.write(self._wake_w, b"x")
        self._reader.join()
        self._socket.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._directory is not None:
            Path(self.address).unlink(missing_ok=True)
            self._directory.rmdir()

    def _drain(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._socket, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = {key.fileobj for key, _ in selector.select()}
                if self._socket in ready:
                    data = self._socket.recv(65536)
                    message = NotifyMessage(
                        tuple(data.decode(errors="replace").split("\n")), time.monotonic()
                    )
                    with self._changed:
                        self._messages.append(message)
                        self._changed.notify_all()
                elif self._wake_r in ready:
                    return
