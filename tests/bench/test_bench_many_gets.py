"""bench.many_gets counts GETs in flight from the kernel's table of TCP connections."""

from __future__ import annotations

import socket

from bench.many_gets import open_connections


def test_open_connections_counts_established_clients_of_the_port_only() -> None:
    """Two clients connected to a listener count 2; the listener itself and a port with
    no clients count 0."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert open_connections(port) == 0
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        accepted = [listener.accept()[0] for _ in clients]
        try:
            assert open_connections(port) == 2
            with socket.create_server(("127.0.0.1", 0)) as other:
                assert open_connections(other.getsockname()[1]) == 0
        finally:
            for sock in clients + accepted:
                sock.close()
