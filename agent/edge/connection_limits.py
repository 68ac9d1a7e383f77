"""How many connections each gRPC socket keeps, and the descriptors the process may open.

Every connection to a socket holds one of the agent's file descriptors for as
long as it stays open, and an idle one costs its client nothing: 1,100 idle
connections used to exhaust a daemon with the usual 1,024-descriptor limit,
and then no socket could accept anyone. gRPC core bounds it per server:

- ``grpc.max_allowed_incoming_connections``: past it, a new connection is
  closed as soon as it is accepted (the client sees UNAVAILABLE, "Connection
  reset by peer"); each socket has a server of its own, so one tenant filling
  its socket leaves the others, and the node's API socket, their own room;
- ``grpc.server_handshake_timeout_ms``: a connection that never sends the
  HTTP/2 preface is dropped after this long instead of gRPC's 120 s;
- ``grpc.max_connection_idle_ms``: a connection with no call for this long is
  closed with a GOAWAY; gRPC clients reconnect at their next call unseen.

At start the soft descriptor limit is raised to the hard one (systemd's hard
limit is 524,288; the soft one stays at 1,024 for compatibility with
``select``, which grpc and asyncio do not use), and a warning says when even
that is below what the caps could take.
"""

from __future__ import annotations

import logging
import resource

__all__ = [
    "HANDSHAKE_TIMEOUT_MS",
    "IDLE_TIMEOUT_MS",
    "connection_options",
    "raise_descriptor_limit",
]

log = logging.getLogger("agent.daemon")

HANDSHAKE_TIMEOUT_MS = 10_000
IDLE_TIMEOUT_MS = 5 * 60_000
# Descriptors beyond the sockets' connections: tier files, S3 connections, inotify,
# the lease socket's connections, the metrics endpoint.
_SPARE_DESCRIPTORS = 512


def connection_options(max_connections: int) -> list[tuple[str, int]]:
    """The gRPC server options that bound one socket's connections."""
    return [
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_connection_idle_ms", IDLE_TIMEOUT_MS),
    ]


def raise_descriptor_limit(connections: int) -> int:
    """Raise the soft descriptor limit to the hard one; warn if it cannot hold ``connections``.

    ``connections`` is what every socket's cap allows together. Returns the soft
    limit now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    needed = connections + _SPARE_DESCRIPTORS
    if soft < needed:
        log.warning(
            "the open-file limit (%d) is below what the sockets' connection caps allow (%d "
            "connections, plus %d for the agent's own files); with every socket full the "
            "agent could not open its files. Raise LimitNOFILE (or the container's nofile "
            "ulimit), or lower access.max_connections_per_socket.",
            soft,
            connections,
            _SPARE_DESCRIPTORS,
        )
    return soft
