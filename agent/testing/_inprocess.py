"""The real agent (``agent._daemon.serve``) on a thread of the test process.

A daemon subprocess costs about a second to start (a fresh interpreter
importing grpc, aiobotocore and pydantic); most tests only need something
serving the API on a Unix socket. ``InProcessAgent`` runs the same ``serve()``
with the same settings on its own event loop in a background thread, and
calls it ready when the gRPC health service on its socket says SERVING.

What differs from ``AgentProcess``, and why tests about these keep a subprocess:

- No signals: they go to the main thread, so ``serve()`` is given a stop
  event (and then installs no signal handlers) and ``stop()`` sets it instead
  of sending SIGTERM. There is no ``kill()``: a crash cannot be faked in-process.
- Process-global state is shared: the metrics registry (a second agent would
  register its gauges twice, and counters add up across agents), logging, and
  ``os.environ``. So only one in-process agent runs at a time
  (``InProcessAgent.active()``); the agent's ``AWS_*`` environment replaces the
  test process's while it runs and is put back when it stops.
- ``log_text()`` holds the agent's own log records (from its loop and worker
  threads) as the daemon's JSON lines, not what a process wrote on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

import grpc  # type: ignore[import-untyped,unused-ignore]

from agent._config import Settings, load_settings
from agent._daemon import serve
from agent._exceptions import PrewarmError
from agent.obs.logs import JsonFormatter, RequestContextFilter

from ._daemon import AgentStartupError, AgentTimeouts
from ._home import compile_cache_env
from ._process import purge_tree
from ._socket_watch import SocketWatch

__all__ = ["InProcessAgent"]

_NUMBERS = itertools.count(1)

_DEFAULT_TIMEOUTS = AgentTimeouts()

# The wait connects once the socket is created (SocketWatch); where inotify cannot say
# when, the connect is retried, faster than grpc's 1 s default.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 250),
]


class InProcessAgent:
    """``serve()`` on a background thread, with its own socket, tiers and config.

    The layout matches ``AgentProcess``: everything under ``root`` (a short
    directory under /tmp unless given), ``agent.sock``, ``shm``, ``disk``,
    ``agent.toml`` (from ``config``) and ``agent.log``. Settings come from
    ``config`` and the ``PREWARM_*`` variables of ``env`` (typically
    ``S3Server.env()``), never from the test process's own ``PREWARM_*``.
    """

    _active: ClassVar[InProcessAgent | None] = None
    _active_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        root: Path | None = None,
        config: str = "",
        timeouts: AgentTimeouts = _DEFAULT_TIMEOUTS,
    ) -> None:
        self._owns_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="pw-", dir="/tmp")) if root is None else root
        self.socket_path = self.root / "agent.sock"
        self.shm_root = self.root / "shm"
        self.disk_root = self.root / "disk"
        self.config_path = self.root / "agent.toml"
        self.log_path = self.root / "agent.log"
        self._extra_env = dict(env or {})
        self._config = config
        self._startup_timeout = timeouts.startup
        self._stop_timeout = timeouts.stop
        self._name = f"prewarm-agent-{next(_NUMBERS)}"
        self._starts = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._outcome: BaseException | None = None
        self._returncode: int | None = None
        self._saved_environ: dict[str, str | None] = {}
        self._log_handler: logging.Handler | None = None
        self._saved_level = logging.NOTSET

    @classmethod
    def active(cls) -> InProcessAgent | None:
        """The in-process agent running in this process now, if any."""
        return cls._active

    # -- where it is -----------------------------------------------------------------

    @property
    def target(self) -> str:
        """The gRPC target of the agent's socket."""
        return f"unix:{self.socket_path}"

    @property
    def pid(self) -> int | None:
        """The test process's pid while the agent runs (its socket peers see this one)."""
        return os.getpid() if self.running else None

    @property
    def running(self) -> bool:
        """True while serve() runs on the agent's thread."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def returncode(self) -> int | None:
        """What prewarmd would exit with: 0 after a clean stop, 1 after a PrewarmError."""
        return None if self.running else self._returncode

    def env(self) -> dict[str, str]:
        """The ``PREWARM_*`` and ``AWS_*`` variables the agent runs with."""
        env = dict(self._extra_env)
        env.update(
            {
                "PREWARM_SOCKET_PATH": str(self.socket_path),
                "PREWARM_TIERS__SHM_ROOT": str(self.shm_root),
                "PREWARM_TIERS__DISK_ROOT": str(self.disk_root),
                "PREWARM_CONFIG": str(self.config_path),
            }
            | compile_cache_env()
        )
        return env

    def log_text(self) -> str:
        """Every log line of the agent, as JSON, across restarts."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> Self:
        """Start serve() on a new thread and wait until the health service says SERVING."""
        with InProcessAgent._active_lock:
            if InProcessAgent._active is not None:
                raise AgentStartupError(
                    "Another in-process agent is running; run this one as an AgentProcess "
                    "(the metrics registry, logging and os.environ are per process)."
                )
            InProcessAgent._active = self
        try:
            self.config_path.write_text(self._config)
            self._starts += 1
            with self.log_path.open("a") as log:
                log.write(f"--- start #{self._starts}: in-process serve()\n")
            self._enter_environment()
            settings = self._load_settings()
            self._outcome, self._returncode = None, None
            # Watching from before the start: the socket cannot be created unseen.
            with SocketWatch(self.socket_path) as bound:
                thread = self._start_until_bound(bound, settings)
            self._wait_until_serving(thread)
        except BaseException:
            with contextlib.suppress(Exception):  # the startup error says more
                self.stop(self._stop_timeout)
            raise
        return self

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop serve() as SIGTERM would and wait for it; returns the exit code it implies.

        An agent that outlives ``timeout`` (default ``stop_timeout``) raises
        TimeoutError: a clean shutdown is part of what is tested.
        """
        thread = self._thread
        try:
            if thread is None:
                return self._returncode
            if self._loop is not None and self._stop_event is not None and thread.is_alive():
                self._loop.call_soon_threadsafe(self._stop_event.set)
            limit = self._stop_timeout if timeout is None else timeout
            thread.join(limit)
            if thread.is_alive():
                raise TimeoutError(f"The in-process agent did not stop within {limit:.0f} s.")
            self._thread = None
            if self._outcome is not None and not isinstance(self._outcome, PrewarmError):
                raise self._outcome
            return self._returncode
        finally:
            if not self.running:
                self._leave_environment()
                with InProcessAgent._active_lock:
                    if InProcessAgent._active is self:
                        InProcessAgent._active = None

    def restart(self) -> Self:
        """Stop the agent and start it again on the same directory (the cache survives)."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop the agent and remove the directory if this object created it."""
        try:
            self.stop()
        finally:
            if self._owns_root:
                purge_tree(self.root)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _start_until_bound(self, bound: SocketWatch, settings: Settings) -> threading.Thread:
        """Start serve() on its thread; return it once its socket is created, or it ended."""
        ended, ended_by_thread = os.pipe()  # readable once the thread closes its end
        try:
            thread = self._thread = threading.Thread(
                target=self._run, args=(settings, ended_by_thread), name=self._name
            )
            try:
                thread.start()
            except BaseException:
                os.close(ended_by_thread)
                raise
            bound.wait(ended, self._startup_timeout)
        finally:
            os.close(ended)
        return thread

    def _run(self, settings: Settings, ended: int) -> None:
        try:
            with asyncio.Runner() as runner:
                runner.run(self._serve(settings))
            self._returncode = 0
        except PrewarmError as exc:
            self._outcome, self._returncode = exc, 1
            logging.getLogger("agent.daemon").error("cannot start: %s", exc)
        except BaseException as exc:  # handed to the test by stop()
            self._outcome, self._returncode = exc, 1
        finally:
            os.close(ended)

    async def _serve(self, settings: Settings) -> None:
        loop = asyncio.get_running_loop()
        # Named workers, so the log handler can tell this agent's records apart.
        loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix=f"{self._name}-worker"))
        self._stop_event = asyncio.Event()
        self._loop = loop
        await serve(settings, self._stop_event)

    def _load_settings(self) -> Settings:
        # load_settings reads PREWARM_* from os.environ: show it this agent's, briefly.
        inherited = {n: os.environ.pop(n) for n in list(os.environ) if n.startswith("PREWARM_")}
        try:
            os.environ.update({k: v for k, v in self.env().items() if k.startswith("PREWARM_")})
            return load_settings(self.config_path)
        finally:
            for name in [n for n in os.environ if n.startswith("PREWARM_")]:
                del os.environ[name]
            os.environ.update(inherited)

    def _enter_environment(self) -> None:
        # botocore reads credentials and the endpoint from os.environ while the
        # agent runs; the test process's own are hidden.
        wanted = {k: v for k, v in self._extra_env.items() if k.startswith("AWS_")}
        names = {name for name in os.environ if name.startswith("AWS_")} | set(wanted)
        self._saved_environ = {name: os.environ.get(name) for name in names}
        for name in names:
            os.environ.pop(name, None)
        os.environ.update(wanted)
        self._attach_log_handler()

    def _leave_environment(self) -> None:
        self._detach_log_handler()
        for name in [n for n in os.environ if n.startswith(("AWS_", "RUNAI_STREAMER_"))]:
            del os.environ[name]
        os.environ.update({k: v for k, v in self._saved_environ.items() if v is not None})
        self._saved_environ = {}

    def _attach_log_handler(self) -> None:
        handler = logging.FileHandler(self.log_path)
        handler.setFormatter(JsonFormatter())
        handler.addFilter(RequestContextFilter())
        handler.addFilter(lambda record: (record.threadName or "").startswith(self._name))
        logger = logging.getLogger("agent")
        self._saved_level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        self._log_handler = handler

    def _detach_log_handler(self) -> None:
        if self._log_handler is None:
            return
        logger = logging.getLogger("agent")
        logger.removeHandler(self._log_handler)
        logger.setLevel(self._saved_level)
        self._log_handler.close()
        self._log_handler = None

    def _wait_until_serving(self, thread: threading.Thread) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        request = health_pb2.HealthCheckRequest(service="")
        updates = health_pb2_grpc.HealthStub(channel).Watch(
            request, wait_for_ready=True, timeout=self._startup_timeout
        )
        starting = threading.Event()
        starting.set()

        def abort_when_serve_returns() -> None:
            thread.join()
            if starting.is_set():
                updates.cancel()  # unblocks the wait below at once

        threading.Thread(
            target=abort_when_serve_returns, name=f"{self._name}-exit", daemon=True
        ).start()
        try:
            for update in updates:
                if update.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError as exc:
            reason = (
                f"serve() ended during startup ({self._outcome!r})"
                if not thread.is_alive()
                else f"did not report SERVING within {self._startup_timeout:.0f} s ({exc!r})"
            )
            raise AgentStartupError(
                f"The in-process agent {reason}.\n{self.log_text()[-12000:]}"
            ) from (self._outcome or exc)
        finally:
            starting.clear()
            updates.cancel()
            channel.close()
        raise AgentStartupError("The agent's health stream ended before it said SERVING.")
