"""Just enough HTTP/1.1 for the fault proxy to stand between S3 clients and an S3 server.

Requests and responses with Content-Length or chunked bodies, S3's XML error
responses, and a connection reset instead of a clean close. Kept apart from
``_fault_proxy`` so the proxy reads as rules and relaying, not parsing.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass

__all__ = [
    "PIECE",
    "S3_ERRORS",
    "Request",
    "body_until_close",
    "chunked_body",
    "error_response",
    "parse_response_head",
    "read_request",
    "reset",
    "sized_body",
]

# Bytes relayed per read.
PIECE = 256 * 1024
_HEADER_LIMIT = 64 * 1024
# Fault kind -> (HTTP status, reason phrase, S3 error code, S3 message).
S3_ERRORS: dict[str, tuple[int, str, str, str]] = {
    "internal_error": (
        500,
        "Internal Server Error",
        "InternalError",
        "We encountered an internal error. Please try again.",
    ),
    "slow_down": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}


@dataclass
class Request:
    """One client request, with its head kept as received so it is forwarded unchanged."""

    method: str
    target: str
    head: bytes  # request line and headers
    body: bytes


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """One whole request (head and body) from a client; None when it closed an idle connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None  # the client closed an idle keep-alive connection
    except asyncio.LimitOverrunError as exc:
        raise ValueError("request headers too long") from exc
    if len(head) > _HEADER_LIMIT:
        raise ValueError("request headers too long")
    request_line, headers = _parse_request_head(head)
    method, target, _ = request_line.split(" ", 2)
    body = b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b"".join([_encode_chunk(p) async for p in chunked_body(reader)]) + b"0\r\n\r\n"
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    return Request(method, target, head, body)


def _parse_request_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    return lines[0], _header_dict(lines[1:])


def parse_response_head(head: bytes) -> tuple[int, dict[str, str]]:
    """The status code and lower-cased headers of a response head."""
    lines = head.decode("latin-1").split("\r\n")
    return int(lines[0].split(" ", 2)[1]), _header_dict(lines[1:])


def _header_dict(lines: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return headers


async def sized_body(reader: asyncio.StreamReader, size: int) -> AsyncIterator[bytes]:
    """A body of ``size`` bytes, in pieces of at most ``PIECE``."""
    left = size
    while left:
        piece = await reader.read(min(PIECE, left))
        if not piece:
            raise asyncio.IncompleteReadError(b"", left)
        left -= len(piece)
        yield piece


async def body_until_close(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """A body that ends when the sender closes the connection."""
    while piece := await reader.read(PIECE):
        yield piece


async def chunked_body(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The data of a chunked body, one chunk at a time (trailers read and dropped)."""
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)


def _encode_chunk(piece: bytes) -> bytes:
    return f"{len(piece):x}\r\n".encode() + piece + b"\r\n"


def error_response(kind: str, target: str) -> bytes:
    """A whole S3 XML error response for a fault kind in S3_ERRORS."""
    status, reason, code, message = S3_ERRORS[kind]
    resource = urllib.parse.urlsplit(target).path
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{resource}</Resource><RequestId>prewarm-fault-proxy</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        "x-amz-request-id: prewarm-fault-proxy\r\n"
        "\r\n"
    ).encode()
    return head + body


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST instead of a FIN: the peer sees ECONNRESET."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport = writer.transport
    transport.abort()
