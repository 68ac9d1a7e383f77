"""systemd's notify protocol (sd_notify), stdlib only.

Under ``Type=notify`` systemd passes ``$NOTIFY_SOCKET``: a datagram socket that
takes newline-separated ``KEY=VALUE`` lines. The daemon says ``READY=1`` once it
serves, ``STATUS=...`` for ``systemctl status``, ``STOPPING=1`` when it begins to
shut down, and ``WATCHDOG=1`` at least once per ``$WATCHDOG_USEC`` when the unit
sets ``WatchdogSec=``. Outside systemd nothing is set and every call is a no-op,
so the daemon calls the notifier unconditionally.

A notification that cannot be delivered is logged and dropped: systemd not
listening is never a reason for the agent to stop serving pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Mapping

__all__ = ["SystemdNotifier"]

log = logging.getLogger(__name__)

# Refresh STATUS at least this often even when the watchdog is slower (or off).
STATUS_REFRESH_SECONDS = 10.0
# Longest a notification may block the event loop before it is dropped.
SEND_TIMEOUT_SECONDS = 2.0


class SystemdNotifier:
    """Sends sd_notify messages to ``address`` (``$NOTIFY_SOCKET``); inert when it is None."""

    def __init__(self, address: str | None, watchdog_seconds: float | None = None) -> None:
        """``address``: ``$NOTIFY_SOCKET`` (a path, or ``@name``: abstract); None: inert."""
        self._address = _socket_address(address) if address else None
        if address and self._address is None:
            log.warning(
                "NOTIFY_SOCKET=%r is neither a path nor an abstract socket ('@name'), the only "
                "kinds prewarmd speaks; systemd will not hear from it",
                address,
            )
        self.watchdog_seconds = watchdog_seconds if self._address is not None else None
        self._last_status: str | None = None
        self._warned = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> SystemdNotifier:
        """The notifier systemd asked for through the environment (an inert one if none)."""
        env = os.environ if environ is None else environ
        return cls(env.get("NOTIFY_SOCKET") or None, _watchdog_seconds(env))

    @property
    def enabled(self) -> bool:
        """Whether messages go anywhere (systemd gave a socket the agent can speak to)."""
        return self._address is not None

    # -- messages ----------------------------------------------------------------------

    def ready(self, status: str) -> None:
        """Tell systemd the agent serves, with a status line."""
        self._send("READY=1", f"STATUS={status}")
        self._last_status = status

    def status(self, status: str) -> None:
        """Replace the status line ``systemctl status`` shows (sent only when it changed)."""
        if status != self._last_status:
            self._send(f"STATUS={status}")
            self._last_status = status

    def stopping(self, status: str) -> None:
        """Tell systemd the agent is stopping, and why it may take a while."""
        self._send("STOPPING=1", f"STATUS={status}")
        self._last_status = status

    def watchdog(self) -> None:
        """Reset systemd's watchdog timer."""
        self._send("WATCHDOG=1")

    # -- the heartbeat -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def heartbeat(self, describe: Callable[[], str]) -> AsyncIterator[None]:
        """Ping the watchdog and refresh STATUS from ``describe()`` while the block runs.

        The pings come from a task on the event loop, so they stop when the loop
        is stuck, which is what systemd's watchdog is there to catch. Pinging
        starts only here (after READY): systemd arms the watchdog at the first
        ping, and start-up may legitimately block for longer than the interval.
        """
        if not self.enabled:
            yield
            return
        period = STATUS_REFRESH_SECONDS
        if self.watchdog_seconds is not None:
            # Half the interval, as sd_watchdog_enabled(3) advises: one late
            # ping must not be the one that gets the agent killed.
            period = min(period, self.watchdog_seconds / 2)
        async with asyncio.TaskGroup() as tasks:
            beat = tasks.create_task(self._beat(period, describe), name="sd-notify-heartbeat")
            try:
                yield
            finally:
                beat.cancel()

    async def _beat(self, period: float, describe: Callable[[], str]) -> None:
        while True:
            if self.watchdog_seconds is not None:
                self.watchdog()
            self.status(describe())
            await asyncio.sleep(period)

    # -- plumbing ----------------------------------------------------------------------

    def _send(self, *lines: str) -> None:
        if self._address is None:
            return
        message = "\n".join(lines).encode("utf-8", errors="replace")
        try:
            # A socket per message, as libsystemd does: nothing to close on any exit path.
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                # PID 1's queue is shared by every service and can be full for a
                # moment (net.unix.max_dgram_qlen); wait a little, never forever.
                sock.settimeout(SEND_TIMEOUT_SECONDS)
                sock.sendto(message, self._address)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning(
                    "cannot notify systemd on %s (%s); carrying on without it",
                    _printable(self._address),
                    exc,
                )


def _socket_address(address: str) -> str | bytes | None:
    if address.startswith("@"):
        # Abstract namespace: a leading NUL instead of the '@' that systemd prints.
        return b"\0" + address[1:].encode()
    if address.startswith("/"):
        return address
    return None  # e.g. systemd 254's vsock: addresses, for VMs


def _watchdog_seconds(env: Mapping[str, str]) -> float | None:
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (we were started by a wrapper)
    return int(usec) / 1_000_000


def _printable(address: str | bytes) -> str:
    return "@" + address[1:].decode(errors="replace") if isinstance(address, bytes) else address
