"""A forward HTTP proxy on loopback, for tests of clients that reach S3 through one.

``HttpProxy`` serves the two things clients ask of a proxy, and records each as a
``ProxiedRequest``::

    with HttpProxy(credentials=("user", "secret")) as proxy:
        os.environ["HTTPS_PROXY"] = proxy.authorized_url
        ... pull ...
        assert proxy.tunnels and not proxy.refused

- ``CONNECT host:port``: a tunnel. The proxy connects, answers 200 and relays
  bytes both ways without reading them (TLS with the origin goes inside), so
  it records the tunnel, not the requests in it.
- A request in absolute form (``GET http://host:port/path?query``): relayed to
  that origin in origin form, the answer relayed back; keep-alive on both sides.

With ``credentials`` it answers 407 to anything without the matching
``Proxy-Authorization: Basic`` header (and closes). ``hosts`` maps names to
addresses that only the proxy resolves, like an /etc/hosts of its own: a test
can name an endpoint (``s3.prewarm.invalid``) that a client reaches through the
proxy or not at all.

It stays small and harmless: it listens on a loopback address only, connects
only to loopback addresses (502 for any other, as for one it cannot reach),
serves at most ``max_connections`` clients at once (503 beyond) and refuses
request heads over 64 KiB. It runs its own asyncio loop in a thread, like ``FaultProxy``, so a
synchronous test and a daemon in a subprocess can both use it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import threading
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Literal

from ._http_wire import (
    PIECE,
    Request,
    body_until_close,
    chunked_body,
    parse_response_head,
    read_request,
    sized_body,
)
from ._loop_server import LoopThreadServer

__all__ = ["HttpProxy", "ProxiedRequest"]

_Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
# Headers meant for the proxy itself, never passed on to the origin.
_HOP_HEADERS = frozenset({"proxy-authorization", "proxy-connection"})


@dataclass(frozen=True, slots=True)
class ProxiedRequest:
    """One thing the proxy was asked: a tunnel, or a request it relayed (or refused)."""

    kind: Literal["tunnel", "request"]
    method: str
    target: str  # "host:port" for a tunnel; the absolute URL for a request
    host: str  # the Host header ("" when there was none)
    user_agent: str
    range: str | None
    # The answer: 200 for a tunnel made, the origin's status for a relayed request,
    # or the proxy's own refusal (400, 407, 502, 503).
    status: int


class HttpProxy(LoopThreadServer):
    """A loopback forward proxy (CONNECT and absolute form) that records what it served."""

    _what = "HTTP proxy"
    _thread_name = "http-proxy"

    def __init__(
        self,
        *,
        credentials: tuple[str, str] | None = None,
        hosts: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int = 64,
    ) -> None:
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"HttpProxy listens on loopback addresses only, not {host!r}.")
        super().__init__(host, port)
        self._credentials = credentials
        self._expected = _basic(*credentials) if credentials else None
        self._hosts = {name.lower(): address for name, address in (hosts or {}).items()}
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._served: list[ProxiedRequest] = []

    # -- what it served ----------------------------------------------------------------

    def served(self, kind: Literal["tunnel", "request"] | None = None) -> list[ProxiedRequest]:
        """Everything asked of the proxy so far (of one kind), in order."""
        with self._lock:
            return [r for r in self._served if kind is None or r.kind == kind]

    @property
    def tunnels(self) -> int:
        """CONNECT tunnels made."""
        return sum(1 for r in self.served("tunnel") if r.status == 200)

    @property
    def requests(self) -> int:
        """Absolute-form requests relayed to an origin."""
        return sum(1 for r in self.served("request") if r.status not in _REFUSALS)

    @property
    def refused(self) -> int:
        """Tunnels and requests the proxy refused itself (bad credentials, request or origin)."""
        return sum(1 for r in self.served() if r.status in _REFUSALS)

    def clear(self) -> None:
        """Forget what was served so far."""
        with self._lock:
            self._served.clear()

    def _record(self, kind: Literal["tunnel", "request"], request: _Parsed, status: int) -> None:
        headers = request.headers
        entry = ProxiedRequest(
            kind,
            request.method,
            request.target,
            headers.get("host", ""),
            headers.get("user-agent", ""),
            headers.get("range"),
            status,
        )
        with self._lock:
            self._served.append(entry)

    # -- where it listens ----------------------------------------------------------------

    @property
    def url(self) -> str:
        """The proxy's URL, without credentials (``http://127.0.0.1:port``)."""
        return f"http://{self._authority}"

    @property
    def authorized_url(self) -> str:
        """The proxy's URL with its credentials in it (``http://user:password@...``)."""
        if self._credentials is None:
            raise RuntimeError("This proxy was started without credentials.")
        user, password = (urllib.parse.quote(part, safe="") for part in self._credentials)
        return f"http://{user}:{password}@{self._authority}"

    @property
    def _authority(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self.port}"

    # -- one client connection -------------------------------------------------------------

    async def _admit(self, writer: asyncio.StreamWriter, open_connections: int) -> bool:
        """Turn a client away with a 503 while ``max_connections`` are served."""
        if open_connections < self._max_connections:
            return True
        await _refuse(writer, 503, "Service Unavailable")
        return False

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[str, int, _Stream] | None = None
        try:
            while (raw := await read_request(reader)) is not None:
                request = _parse(raw)
                if self._expected is not None and request.authorization != self._expected:
                    self._record(_kind(request), request, 407)
                    await _refuse(writer, 407, "Proxy Authentication Required")
                    return
                if request.method == "CONNECT":
                    await self._tunnel(request, (reader, writer))
                    return
                upstream = await self._relay(request, (reader, writer), upstream)
                if upstream is None:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return  # the client or the origin went away, or sent what is not HTTP
        finally:
            if upstream is not None:
                upstream[2][1].close()
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _open(self, host: str, port: int) -> _Stream | None:
        """A connection to ``host`` (through ``hosts``) if it is on loopback; None otherwise."""
        address = self._hosts.get(host.lower(), host)
        try:
            stream = await asyncio.open_connection(address, port)
        except OSError:
            return None
        peer = stream[1].get_extra_info("peername")
        if peer is None or not ipaddress.ip_address(peer[0]).is_loopback:
            stream[1].close()
            return None
        return stream

    async def _tunnel(self, request: _Parsed, client: _Stream) -> None:
        """Make the tunnel a CONNECT asks for, and relay bytes both ways until one side ends."""
        host, port = _authority(request.target)
        origin = await self._open(host, port) if host else None
        if origin is None:
            status = 400 if not host else 502
            self._record("tunnel", request, status)
            await _refuse(client[1], status, "Bad Request" if not host else "Bad Gateway")
            return
        self._record("tunnel", request, 200)
        client[1].write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        try:
            await client[1].drain()
            await asyncio.gather(_pipe(client[0], origin[1]), _pipe(origin[0], client[1]))
        finally:
            origin[1].close()

    async def _relay(
        self, request: _Parsed, client: _Stream, upstream: tuple[str, int, _Stream] | None
    ) -> tuple[str, int, _Stream] | None:
        """Relay one absolute-form request; the origin's connection to keep, or None to close."""
        url = urllib.parse.urlsplit(request.target)
        host = url.hostname or ""
        try:
            port = url.port or 80
        except ValueError:
            host = ""
        if url.scheme != "http" or not host:
            self._record("request", request, 400)
            await _refuse(client[1], 400, "Bad Request")
            return None
        if upstream is None or upstream[:2] != (host, port):
            if upstream is not None:
                upstream[2][1].close()
            origin = await self._open(host, port)
            if origin is None:
                self._record("request", request, 502)
                await _refuse(client[1], 502, "Bad Gateway")
                return None
            upstream = (host, port, origin)
        origin_reader, origin_writer = upstream[2]
        origin_writer.write(request.origin_form_head(url) + request.body)
        await origin_writer.drain()
        status, keep = await _relay_answer(origin_reader, client[1], request.method)
        self._record("request", request, status)
        if not keep:
            upstream[2][1].close()
            return None
        return upstream


# The statuses the proxy answers itself, refusing.
_REFUSALS = frozenset({400, 407, 502, 503})


@dataclass(frozen=True, slots=True)
class _Parsed:
    """A client's request, its headers by lower-cased name."""

    method: str
    target: str
    version: str
    lines: list[str]  # header lines as received
    headers: dict[str, str]
    body: bytes

    @property
    def authorization(self) -> str | None:
        return self.headers.get("proxy-authorization")

    def origin_form_head(self, url: urllib.parse.SplitResult) -> bytes:
        """The request's head for the origin: origin form, without the proxy's headers."""
        target = f"{url.path or '/'}?{url.query}" if url.query else url.path or "/"
        kept = [line for line in self.lines if line.split(":", 1)[0].lower() not in _HOP_HEADERS]
        head = "\r\n".join([f"{self.method} {target} {self.version}", *kept]) + "\r\n\r\n"
        return head.encode("latin-1")


def _parse(request: Request) -> _Parsed:
    lines = request.head.decode("latin-1").split("\r\n")
    version = lines[0].split(" ", 2)[2] if lines[0].count(" ") >= 2 else "HTTP/1.1"
    header_lines = [line for line in lines[1:] if line]
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return _Parsed(request.method, request.target, version, header_lines, headers, request.body)


def _kind(request: _Parsed) -> Literal["tunnel", "request"]:
    return "tunnel" if request.method == "CONNECT" else "request"


def _authority(target: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) as a CONNECT names it; ("", 0) if it is not one."""
    host, _, port = target.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "", 0
    return host, int(port)


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


async def _refuse(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    """Answer with the proxy's own status and close."""
    challenge = 'Proxy-Authenticate: Basic realm="prewarm-test-proxy"\r\n' if status == 407 else ""
    head = f"HTTP/1.1 {status} {reason}\r\n{challenge}"
    head += "Content-Length: 0\r\nConnection: close\r\n\r\n"
    with contextlib.suppress(ConnectionError, OSError):
        writer.write(head.encode("latin-1"))
        await writer.drain()
    writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes until ``reader`` ends, then end ``writer``'s side too."""
    try:
        while piece := await reader.read(PIECE):
            writer.write(piece)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
            else:
                writer.close()


async def _relay_answer(
    origin: asyncio.StreamReader, client: asyncio.StreamWriter, method: str
) -> tuple[int, bool]:
    """Copy one answer from the origin to the client: its status, and whether to keep going."""
    head = await origin.readuntil(b"\r\n\r\n")
    status, headers = parse_response_head(head)
    client.write(head)
    chunked = headers.get("transfer-encoding", "").lower() == "chunked"
    body: AsyncIterator[bytes] | None
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        body = None
    elif chunked:
        body = chunked_body(origin)
    elif "content-length" in headers:
        body = sized_body(origin, int(headers["content-length"]))
    else:
        body = body_until_close(origin)
    if body is not None:
        async for piece in body:
            client.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece)
            await client.drain()
        if chunked:
            client.write(b"0\r\n\r\n")
    await client.drain()
    until_close = body is not None and not chunked and "content-length" not in headers
    return status, headers.get("connection", "").lower() != "close" and not until_close
