"""What the agent logs about leases: never a lease id (a capability), and one line at shutdown.

A lease id lets whoever knows it hold, renew or release the lease, so logs (journald, shipped
off the node) carry a short tag of it instead: the first 8 hex digits of its SHA-256, enough
to follow one lease through the log and useless for taking it. A daemon stopped while pods
hold leases ends them all at once, and says so in one line instead of a traceback each.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import ExitStack

from agent_helpers import ProcessFactory

from agent.client import Client
from agent.leases.table import lease_tag
from agent.testing import AgentProcess, SampleModel


def _records(agent: AgentProcess) -> list[dict[str, object]]:
    return [json.loads(line) for line in agent.log_text().splitlines() if line[:1] == "{"]


def _hello(path: str, lease_id: str) -> tuple[socket.socket, dict[str, object]]:
    """A connection to the lease socket that sent the hello for ``lease_id``, and the reply."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    sock.sendall(json.dumps({"lease": lease_id, "name": "ns/pod"}).encode() + b"\n")
    return sock, json.loads(sock.makefile("rb").readline())


def _end(sock: socket.socket) -> None:
    """Half-close and wait for the agent's end: the lease is over once this returns."""
    sock.shutdown(socket.SHUT_WR)
    while sock.recv(4096):
        pass
    sock.close()


def test_lease_ids_never_reach_the_log_only_their_tags(
    start_agent_process: ProcessFactory, small_model: SampleModel
) -> None:
    """Granting, holding, a refused second hold, releasing on close, renewing and releasing
    over the API: at log level debug no line holds a lease id, and each lease's tag is there."""
    agent = start_agent_process('log_level = "debug"\n')
    with Client(agent.socket_path) as client:
        held = client.ensure(small_model.uri, lease=True).lease
        timed = client.ensure(small_model.uri, lease=True).lease
        assert held is not None
        assert timed is not None
        holder, reply = _hello(str(held.socket_path), held.id)
        assert reply["ok"] is True
        second, refused = _hello(str(held.socket_path), held.id)
        assert refused["ok"] is False
        second.close()
        _end(holder)
        client.renew_lease(timed.id, ttl=120)
        client.release_lease(timed.id)
    text = agent.log_text()
    for lease in (held, timed):
        assert lease.id not in text
        assert lease_tag(lease.id) in text


def _holding(agent: AgentProcess, uri: str, count: int) -> Iterator[socket.socket]:
    with Client(agent.socket_path) as client:
        for _ in range(count):
            lease = client.ensure(uri, lease=True).lease
            assert lease is not None
            sock, reply = _hello(str(lease.socket_path), lease.id)
            assert reply["ok"] is True, reply
            yield sock


def test_stopping_with_leases_held_logs_one_summary_line(
    start_agent_process: ProcessFactory, small_model: SampleModel
) -> None:
    """SIGTERM while 40 connections hold leases: the agent exits 0 and, from the stop on, logs
    no warning, error or traceback and exactly one line about leases, giving their count."""
    agent = start_agent_process()
    with ExitStack() as connections:
        for sock in _holding(agent, small_model.uri, 40):
            connections.callback(sock.close)
        assert agent.stop() == 0
    records = _records(agent)
    stopping = next(i for i, r in enumerate(records) if str(r["msg"]).startswith("stopping"))
    after = records[stopping:]
    assert [r for r in after if r["level"] in ("warning", "error", "critical") or "exc" in r] == []
    about_leases = [r for r in after if "lease" in str(r["msg"])]
    assert len(about_leases) == 1, about_leases
    assert "40 leases" in str(about_leases[0]["msg"])
