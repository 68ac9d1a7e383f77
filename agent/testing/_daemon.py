"""The real agent daemon in a subprocess, with its own socket, tiers and config.

``AgentProcess`` runs ``python -m agent`` with everything it touches under one
short temporary directory, and calls it ready when the standard gRPC health
service on its socket says SERVING. Readiness is waited for through inotify
(the socket's creation) and gRPC (the health service), never by sleeping; a
daemon that dies during startup fails the wait at once, with its output in the
error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

import grpc  # type: ignore[import-untyped,unused-ignore]

from ._home import AgentHome
from ._process import log_tail, source_env, stop_process
from ._socket_watch import SocketWatch

__all__ = ["AgentProcess", "AgentStartupError", "AgentTimeouts"]

# grpc retries a refused connect with exponential backoff from 1 s. The wait
# connects once the socket is created (SocketWatch); where inotify cannot say
# when, the connect is retried, faster than grpc's default.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 250),
]


class _Cancellable(Protocol):
    def cancel(self) -> bool: ...


# A grpc call or future.
_Call = TypeVar("_Call", bound=_Cancellable)


class AgentStartupError(RuntimeError):
    """The daemon exited, or did not report SERVING, before the startup deadline."""


@dataclass(frozen=True)
class AgentTimeouts:
    """Seconds a test agent's ``start()`` waits for SERVING and ``stop()`` for the exit."""

    startup: float = 30.0
    stop: float = 30.0


class _StartupCalls:
    """The health calls a start waits on, cancelled at once when the daemon exits.

    Cancelling a call from another thread is safe in grpc; closing the channel
    under a call in flight is not (it crashed the test process).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[Any] = []
        self._ended = False

    def track(self, call: _Call) -> _Call:
        """``call``, cancelled now if the wait has ended, else when it ends."""
        with self._lock:
            if not self._ended:
                self._calls.append(call)
                return call
        call.cancel()
        return call

    def end(self) -> None:
        """Cancel every call tracked, and any tracked from now on."""
        with self._lock:
            self._ended = True
            calls, self._calls = self._calls, []
        for call in calls:
            call.cancel()


class AgentProcess(AgentHome):
    """One ``python -m agent`` process and the directory it lives in.

    Everything sits under ``root``, laid out as ``AgentHome`` says (``root``
    or a short directory made in ``parent``): ``agent.toml`` is written from
    ``config`` and ``agent.log`` gets stdout and stderr of every start,
    appended. The daemon sees ``os.environ`` without any inherited
    ``PREWARM_*`` or ``AWS_*`` variable, then ``env`` (typically
    ``S3Server.env()``), then the ``PREWARM_*`` paths of the layout.

    ``restart()`` keeps the directory, so the cache survives it. ``close()``
    stops the daemon and removes a directory it created.
    """

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        root: Path | None = None,
        parent: Path | None = None,
        config: str = "",
        argv: Sequence[str] | None = None,
        timeouts: AgentTimeouts = AgentTimeouts(),
    ) -> None:
        super().__init__(root=root, parent=parent)
        self._extra_env = dict(env or {})
        self._config = config
        self._argv = list(argv) if argv is not None else [sys.executable, "-m", "agent"]
        self._startup_timeout = timeouts.startup
        self._stop_timeout = timeouts.stop
        self._proc: subprocess.Popen[bytes] | None = None
        self._starts = 0

    # -- where it is -----------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The daemon's process id; None before the first start()."""
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        """True while the daemon process has not exited."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit code once the daemon has exited; None while it runs, or before a start."""
        return None if self._proc is None else self._proc.poll()

    def env(self) -> dict[str, str]:
        """The full environment the daemon is started with."""
        env = source_env(
            {
                name: value
                for name, value in os.environ.items()
                if not name.startswith(("PREWARM_", "AWS_"))
            }
        )
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self._extra_env)
        env.update(self.home_env())
        return env

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> Self:
        """Start the daemon and wait until its health service says SERVING."""
        if self.running:
            raise AgentStartupError(f"The agent is already running (pid {self.pid}).")
        self.config_path.write_text(self._config)
        self._starts += 1
        # Watching from before the start: the socket cannot be created unseen.
        with SocketWatch(self.socket_path) as bound, self.log_path.open("ab") as log:
            log.write(f"--- start #{self._starts}: {' '.join(self._argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._argv,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                self._wait_until_serving(self._proc, bound)
            except BaseException:
                stop_process(self._proc, signal.SIGKILL, timeout=10.0)
                raise
        return self

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM the daemon and wait for it; returns its exit code (None if never started).

        A daemon that outlives ``timeout`` (default ``stop_timeout``) is killed
        and TimeoutError is raised: a clean shutdown is part of what is tested.
        """
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return self.returncode
        limit = self._stop_timeout if timeout is None else timeout
        if not stop_process(proc, signal.SIGTERM, timeout=limit):
            raise TimeoutError(
                f"The agent did not exit within {limit:.0f} s of SIGTERM and was killed.\n"
                f"{self._log_tail()}"
            )
        return proc.returncode

    def kill(self) -> int | None:
        """SIGKILL the daemon (a crash, as far as it can tell) and wait for it."""
        if self._proc is None:
            return None
        stop_process(self._proc, signal.SIGKILL, timeout=10.0)
        return self._proc.returncode

    def restart(self, *, kill: bool = False) -> Self:
        """Stop (or kill) the daemon and start it again on the same directory."""
        if kill:
            self.kill()
        else:
            self.stop()
        return self.start()

    def close(self) -> None:
        """Stop the daemon and remove the directory if this object created it."""
        try:
            if self.running:
                self.stop()
        finally:
            self.remove_home()

    # -- internals ---------------------------------------------------------------------

    def _wait_until_serving(self, proc: subprocess.Popen[bytes], bound: SocketWatch) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + self._startup_timeout
        exited = os.pidfd_open(proc.pid)
        try:
            # Connect once the socket is there (the first try then succeeds); an exit
            # or the deadline falls through to the checks below, which say why.
            bound.wait(exited, self._startup_timeout)
        finally:
            os.close(exited)
        # No channel_ready_future: the Check below waits for the channel itself, and a
        # channel that had one takes 200 ms to close (grpc polls its connectivity so).
        channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        calls = _StartupCalls()

        def abort_when_process_exits() -> None:
            proc.wait()
            calls.end()

        threading.Thread(target=abort_when_process_exits, name="agent-exit", daemon=True).start()
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="")
            remaining = max(deadline - time.monotonic(), 0.1)
            check = stub.Check.future(request, wait_for_ready=True, timeout=remaining)
            response = calls.track(check).result()
            if response.status != health_pb2.HealthCheckResponse.SERVING:
                # Still warming up (e.g. reconciling the store): follow the
                # status stream instead of asking again.
                remaining = max(deadline - time.monotonic(), 0.1)
                updates = calls.track(stub.Watch(request, wait_for_ready=True, timeout=remaining))
                try:
                    for update in updates:
                        if update.status == health_pb2.HealthCheckResponse.SERVING:
                            break
                finally:
                    updates.cancel()
        except (grpc.RpcError, grpc.FutureCancelledError) as exc:
            code = proc.poll()
            if code is not None:
                reason = f"exited with code {code} during startup"
            else:
                reason = f"did not report SERVING within {self._startup_timeout:.0f} s ({exc!r})"
            raise AgentStartupError(
                f"The agent ({' '.join(self._argv)}) {reason}.\n{self._log_tail()}"
            ) from exc
        finally:
            calls.end()
            channel.close()

    def _log_tail(self, limit: int = 12000) -> str:
        return log_tail(
            self.log_text(),
            heading=f"--- agent output ({self.log_path}) ---",
            empty=f"(the agent wrote nothing; log {self.log_path})",
            limit=limit,
        )
