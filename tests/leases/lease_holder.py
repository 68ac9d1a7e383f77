"""A process that holds a lease while a test restarts the agent under it.

argv: SOCKET URI MODE. MODE ``sync`` holds with ``Client.leased``, ``async``
with ``AsyncClient.leased``: both take the lease again when the agent comes
back. ``raw`` speaks the lease socket's protocol itself and does nothing when
the connection closes, until the test writes ``again`` on stdin (then it says
its hello once more and prints the reply).

Prints ``held <key> <lease id>`` once held, then every warning of the client's
lease hold as ``log: <message>``; exits when stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys

from agent.client import AsyncClient, Client


class _Echo(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        print(f"log: {record.getMessage()}", flush=True)


def hold_sync(socket_path: str, uri: str) -> None:
    with Client(socket_path) as client, client.leased(uri, client_name="holder") as handle:
        assert handle.lease is not None
        print(f"held {handle.key} {handle.lease.id}", flush=True)
        sys.stdin.read()


async def hold_async(socket_path: str, uri: str) -> None:
    async with AsyncClient(socket_path) as client, client.leased(uri, client_name="holder") as h:
        assert h.lease is not None
        print(f"held {h.key} {h.lease.id}", flush=True)
        await asyncio.to_thread(sys.stdin.read)


def hold_raw(socket_path: str, uri: str) -> None:
    with Client(socket_path) as client:
        handle = client.ensure(uri, lease=True, client_name="holder")
    assert handle.lease is not None
    hello = json.dumps({"lease": handle.lease.id, "name": "holder"}).encode() + b"\n"
    lease_socket = str(handle.lease.socket_path)
    connection = _say_hello(lease_socket, hello)
    print(f"held {handle.key} {handle.lease.id}", flush=True)
    for line in sys.stdin:
        if line.strip() == "again":
            connection.close()
            connection = _say_hello(lease_socket, hello)


def _say_hello(path: str, hello: bytes) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    connection.sendall(hello)
    print(f"reply: {connection.recv(4096).decode().strip()}", flush=True)
    return connection


def main() -> None:
    socket_path, uri, mode = sys.argv[1:4]
    logging.getLogger("agent.client").addHandler(_Echo())
    if mode == "sync":
        hold_sync(socket_path, uri)
    elif mode == "async":
        asyncio.run(hold_async(socket_path, uri))
    else:
        hold_raw(socket_path, uri)


if __name__ == "__main__":
    main()
