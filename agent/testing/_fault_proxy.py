"""A fault-injecting HTTP proxy in front of an S3 server, on loopback.

``FaultProxy`` forwards every request to the upstream S3 server unchanged, and
answers some of them badly, by rules a test sets::

    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.add(Fault.truncate(after_bytes=100_000, key="model.safetensors"))
        proxy.add(Fault.slow_down(times=2))
        ... point the agent at proxy.endpoint_url ...
        assert proxy.injected("truncate") == 1

Faults: ``internal_error`` (HTTP 500, S3's InternalError body), ``slow_down``
(HTTP 503, S3's SlowDown body), ``reset`` (the connection is reset before any
response byte), ``truncate`` (the upstream response's headers, promising the
whole body, then ``after_bytes`` of it, then the connection is closed) and
``stall`` (the same, but the connection stays open and silent until the client
gives up: what a low-speed limit is for) and ``silent`` (the request is taken and
never answered, not a byte, until the client gives up: an endpoint that accepts
connections and says nothing, what a first-byte deadline is for). A rule
matches requests by method and by a substring of the path, ``times`` times
(``None``: every matching request); the first matching rule with uses left wins.

The proxy runs its own asyncio loop in a thread, so a synchronous test and a
daemon in a subprocess can both use it; ``start()`` returns once it listens.
It speaks just enough HTTP/1.1 for S3 clients: Content-Length and chunked
bodies, keep-alive, one upstream connection per client connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from ._http_wire import (
    PIECE,
    S3_ERRORS,
    Request,
    body_until_close,
    chunked_body,
    error_response,
    parse_response_head,
    read_request,
    reset,
    sized_body,
)
from ._loop_server import LoopThreadServer

__all__ = ["Fault", "FaultKind", "FaultProxy"]

FaultKind = Literal["internal_error", "slow_down", "reset", "truncate", "stall", "silent"]

# Faults the proxy answers itself, without asking the upstream.
_ANSWERED_BY_THE_PROXY = frozenset({"reset", "silent", *S3_ERRORS})

# One side of a proxied connection.
_Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class Fault:
    """One rule: which requests to spoil, how, and how many times."""

    kind: FaultKind
    # Substring of the request path, query excluded (e.g. an object key); empty matches all.
    key: str = ""
    method: str = "GET"
    # Matching requests to spoil; None spoils every one.
    times: int | None = 1
    # truncate, stall: body bytes sent before the connection is closed or goes silent.
    after_bytes: int = 0
    used: int = field(default=0, init=False)

    @classmethod
    def internal_error(cls, *, key: str = "", times: int | None = 1) -> Fault:
        """Answer matching requests with HTTP 500 and S3's InternalError body."""
        return cls("internal_error", key=key, times=times)

    @classmethod
    def slow_down(cls, *, key: str = "", times: int | None = 1) -> Fault:
        """Answer matching requests with HTTP 503 and S3's SlowDown body."""
        return cls("slow_down", key=key, times=times)

    @classmethod
    def reset(cls, *, key: str = "", method: str = "GET", times: int | None = 1) -> Fault:
        """Reset the connection of matching requests before any response byte."""
        return cls("reset", key=key, method=method, times=times)

    @classmethod
    def truncate(cls, *, after_bytes: int, key: str = "", times: int | None = 1) -> Fault:
        """Send the headers and ``after_bytes`` of the body, then close the connection."""
        return cls("truncate", key=key, times=times, after_bytes=after_bytes)

    @classmethod
    def stall(cls, *, after_bytes: int = 0, key: str = "", times: int | None = 1) -> Fault:
        """Send the headers and ``after_bytes`` of the body, then say nothing more."""
        return cls("stall", key=key, times=times, after_bytes=after_bytes)

    @classmethod
    def silent(cls, *, key: str = "", method: str = "GET", times: int | None = 1) -> Fault:
        """Take matching requests and never answer them, not a byte."""
        return cls("silent", key=key, method=method, times=times)

    def _matches(self, method: str, target: str) -> bool:
        left = self.times is None or self.used < self.times
        path = urllib.parse.unquote(urllib.parse.urlsplit(target).path)
        return left and method == self.method and self.key in path


class FaultProxy(LoopThreadServer):
    """Loopback HTTP proxy to ``upstream`` that injects the faults a test adds."""

    _what = "fault proxy"
    _thread_name = "fault-proxy"

    def __init__(self, upstream: str, *, host: str = "127.0.0.1", port: int = 0) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"FaultProxy forwards to plain http:// servers, not {upstream!r}.")
        super().__init__(host, port)
        self._upstream = (parsed.hostname, parsed.port or 80)
        self._lock = threading.Condition()
        self._faults: list[Fault] = []
        self._injected: Counter[str] = Counter()
        self._forwarded = 0

    # -- rules -------------------------------------------------------------------------

    def add(self, *faults: Fault) -> None:
        """Add rules after those already set; the first matching rule with uses left wins."""
        with self._lock:
            self._faults.extend(faults)

    def clear(self) -> None:
        """Drop every rule (the counts of what was injected stay)."""
        with self._lock:
            self._faults.clear()

    def injected(self, kind: FaultKind | None = None) -> int:
        """How many faults were injected (of one kind, or in all)."""
        with self._lock:
            return self._injected[kind] if kind else sum(self._injected.values())

    def wait_injected(self, kind: FaultKind, count: int = 1, timeout: float = 30.0) -> None:
        """Block until ``count`` faults of ``kind`` were injected; TimeoutError otherwise."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._injected[kind] >= count, timeout):
                raise TimeoutError(
                    f"{self._injected[kind]} of {count} {kind} faults injected in {timeout} s."
                )

    @property
    def forwarded(self) -> int:
        """Requests answered by the upstream server (truncated ones included)."""
        with self._lock:
            return self._forwarded

    def _take(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault._matches(method, path):
                    fault.used += 1
                    self._injected[fault.kind] += 1
                    self._lock.notify_all()
                    return fault
            return None

    # -- where it listens ----------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        """The URL to give an S3 client instead of the upstream's."""
        return f"http://{self._host}:{self.port}"

    # -- one client connection -------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: _Stream | None = None
        try:
            while (request := await read_request(reader)) is not None:
                fault = self._take(request.method, request.target)
                if fault is not None and fault.kind in _ANSWERED_BY_THE_PROXY:
                    if not await _answer_in_place_of_s3(fault, request, reader, writer):
                        return
                    continue
                if upstream is None:
                    upstream = await asyncio.open_connection(*self._upstream)
                if not await self._forward(request, (reader, writer), upstream, fault=fault):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return  # the client or the upstream went away; so does this connection
        finally:
            if upstream is not None:
                upstream[1].close()
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _forward(
        self, request: Request, client: _Stream, upstream: _Stream, *, fault: Fault | None
    ) -> bool:
        """Send one request upstream and relay its answer, cut or stalled as ``fault`` says.

        True when the client connection can carry another request.
        """
        upstream[1].write(request.head + request.body)
        await upstream[1].drain()
        limit = fault.after_bytes if fault is not None else None
        keep = await self._relay(upstream[0], client[1], request.method, limit)
        with self._lock:
            self._forwarded += 1
        if fault is not None and fault.kind == "stall":
            await _wait_for_hang_up(client[0])  # say nothing more until the client gives up
        return keep

    async def _relay(
        self,
        upstream: asyncio.StreamReader,
        client: asyncio.StreamWriter,
        method: str,
        limit: int | None,
    ) -> bool:
        """Copy one response; with ``limit``, stop after that many body bytes. True: keep-alive."""
        head = await upstream.readuntil(b"\r\n\r\n")
        status, headers = parse_response_head(head)
        client.write(head)
        budget = limit
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            body_reader = None
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body_reader = chunked_body(upstream)
        elif "content-length" in headers:
            body_reader = sized_body(upstream, int(headers["content-length"]))
        else:
            body_reader = body_until_close(upstream)
        if body_reader is not None:
            async for received in body_reader:
                piece = received if budget is None else received[:budget]
                if budget is not None:
                    budget -= len(piece)
                client.write(piece)
                await client.drain()
                if budget == 0:
                    break
        await client.drain()
        if limit is not None:
            return False  # the body was cut short: the connection cannot be reused
        return headers.get("connection", "").lower() != "close" and (
            body_reader is None or "content-length" in headers or "transfer-encoding" in headers
        )


async def _answer_in_place_of_s3(
    fault: Fault, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> bool:
    """Fail one request as ``fault`` says; True when the connection carries on."""
    if fault.kind == "reset":
        reset(writer)
        return False
    if fault.kind == "silent":
        await _wait_for_hang_up(reader)  # never a byte back
        return False
    writer.write(error_response(fault.kind, request.target))
    await writer.drain()
    return True


async def _wait_for_hang_up(reader: asyncio.StreamReader) -> None:
    """Read and drop what the client sends until it closes the connection."""
    while await reader.read(PIECE):
        pass
