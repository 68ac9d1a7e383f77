"""A TCP server on an asyncio loop of its own in a thread, for the test doubles that proxy.

``FaultProxy`` and ``HttpProxy`` serve from a thread so that a synchronous test
and a daemon in a subprocess can both use them. ``LoopThreadServer`` holds what
they share: ``start()`` returns once the server listens (or re-raises why it
could not), ``stop()`` stops accepting, cancels every open connection and joins
the thread. A subclass handles one connection (``_connection``) and may turn a
client away before that (``_admit``).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import threading
from typing import ClassVar, Self

from ._process import Startable

__all__ = ["LoopThreadServer"]


class LoopThreadServer(Startable):
    """Listens on ``host:port`` (0: any free port) from a loop of its own in a thread."""

    # What the server is, in messages ("HTTP proxy"), and its thread's name.
    _what: ClassVar[str]
    _thread_name: ClassVar[str]

    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    @property
    def port(self) -> int:
        """The port the proxy listens on, once start() has returned."""
        if not self._port:
            raise RuntimeError("The proxy has no port until start() has returned.")
        return self._port

    def start(self) -> Self:
        """Listen on a loop of its own in a thread; returns once it accepts connections."""
        if self._thread is not None:
            raise RuntimeError("The proxy is already running.")
        self._ready.clear()
        self._failure = None
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._thread.join()
            self._thread = None
            raise RuntimeError(f"The {self._what} could not start: {self._failure}") from (
                self._failure
            )
        return self

    def stop(self) -> None:
        """Stop listening, cut every open connection and join the thread; idempotent."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            return
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
        thread.join()
        self._thread = None

    def close(self) -> None:
        """Stop the proxy (the end of a ``with`` block)."""
        self.stop()

    # -- what a subclass serves --------------------------------------------------------

    @abc.abstractmethod
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one client connection until it ends; close ``writer`` on the way out."""

    async def _admit(self, writer: asyncio.StreamWriter, open_connections: int) -> bool:
        """Whether to serve a new client while ``open_connections`` are served; every one here.

        A subclass that turns one away answers it on ``writer`` and closes it.
        """
        return True

    # -- the loop in the thread --------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to start(), which re-raises it
            self._failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        connections: set[asyncio.Task[None]] = set()

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            if not await self._admit(writer, len(connections)):
                return
            connections.add(task)
            try:
                await self._connection(reader, writer)
            finally:
                connections.discard(task)

        server = await asyncio.start_server(accept, self._host, self._port)
        self._port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()
            server.close()
            for task in list(connections):
                task.cancel()
            await asyncio.gather(*connections, return_exceptions=True)
