"""Leases across tenants, as hostile pods would try them (issue 16, items 5, 6 and 10).

In the lease table on a fake clock, and against a real LeaseServer on a tmp socket: renewals
that grow memory, a uid's cap shared by every tenant's pods, a lease-socket hello whose name
skips the API's field checks.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from subprocess import PIPE

import pytest

from agent._exceptions import NoSpace
from agent.edge.lease_socket import MAX_PENDING_PER_UID, LeaseServer
from agent.leases.table import LeaseTable, PeerCredentials

ROOT_IN_A_POD = PeerCredentials(pid=os.getpid(), uid=0, gid=0)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_renewing_one_lease_many_times_keeps_memory_flat() -> None:
    """10,000 RenewLease calls on one lease hold no more memory than a few: each renewal used
    to leave an 80-byte expiry entry behind for up to the lease's TTL (24 h)."""
    clock = FakeClock()
    table = LeaseTable(default_ttl=60, max_ttl=86_400, clock=clock)
    lease = table.grant("k1", ttl=86_400)
    for _ in range(100):  # warm up whatever the first calls allocate once
        table.renew(lease.id, 86_400)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for step in range(10_000):
            clock.now += 0.001
            table.renew(lease.id, 86_400 - step % 7)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 16 * 1024, f"{after - before} bytes kept by 10,000 renewals"
    clock.now += 86_401
    assert table.count() == 0  # and the lease still expires on time


def test_renewing_to_a_shorter_ttl_still_expires_on_time() -> None:
    """A renewal that shortens a lease takes effect: the lease ends at the new, earlier time."""
    clock = FakeClock()
    table = LeaseTable(default_ttl=60, max_ttl=600, clock=clock)
    lease = table.grant("k1", ttl=600)
    table.renew(lease.id, 10)
    clock.now += 11
    assert table.count() == 0


def test_a_uids_held_leases_are_capped_per_tenant_not_across_tenants() -> None:
    """Pods of two tenants that both run as root hold leases under separate caps: tenant A's
    root pods holding max_per_peer leases open do not stop tenant B's root pod from holding
    one; A's next lease is refused at its grant, by A's own cap."""
    table = LeaseTable(default_ttl=60, max_ttl=600, max_per_peer=3)
    for _ in range(3):
        table.hold(table.grant("k1", grantee="team-a").id, ROOT_IN_A_POD)
    held = table.hold(table.grant("k1", grantee="team-b").id, ROOT_IN_A_POD)
    assert held.held
    with pytest.raises(NoSpace, match="3 live leases"):
        table.grant("k1", grantee="team-a")


@pytest.fixture
async def lease_server(tmp_path: Path) -> AsyncIterator[LeaseServer]:
    table = LeaseTable(default_ttl=60, max_ttl=600)
    async with LeaseServer(table, tmp_path / "lease.sock", hello_timeout=30) as served:
        yield served


def _hello(path: Path, hello: dict[str, object]) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(json.dumps(hello).encode() + b"\n")
        reply: dict[str, object] = json.loads(sock.makefile("rb").readline())
        return reply


@pytest.mark.parametrize(
    ("name", "said"),
    [("n" * 300, "over the limit of 256 bytes"), ("pod\x1b[2Jx", "control and bidi")],
)
async def test_a_hello_name_gets_the_apis_field_checks(
    lease_server: LeaseServer, name: str, said: str
) -> None:
    """The hello's client name is checked as the API checks client_name (256 bytes, no control
    or bidi character): INVALID_ARGUMENT naming the field, and the lease is not held."""
    record = lease_server.table.grant("k1")
    reply = await asyncio.to_thread(_hello, lease_server.path, {"lease": record.id, "name": name})
    assert reply["ok"] is False
    assert reply["code"] == "INVALID_ARGUMENT"
    assert "name" in str(reply["error"])
    assert said in str(reply["error"])
    assert not lease_server.table.get(record.id).held


@pytest.fixture
def own_cgroup() -> Iterator[Path]:
    """A fresh cgroup (as a container runtime makes one per container); skipped where it
    cannot be made."""
    for hierarchy in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified")):
        group = hierarchy / f"prewarm-test-{uuid.uuid4().hex[:8]}"
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            yield group
        finally:
            group.rmdir()
        return
    pytest.skip("no cgroup hierarchy this test may create a group in (needs root)")


# Joins the cgroup, opens connections that never say hello, says so, and waits for EOF.
_SILENT_POD = """
import socket, sys
open(sys.argv[1] + "/cgroup.procs", "w").write("0")
silent = []
for _ in range(int(sys.argv[3])):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[2])
    silent.append(sock)
print("connected", flush=True)
sys.stdin.read()
"""


async def test_silent_lease_connections_of_one_containers_root_do_not_block_anothers(
    lease_server: LeaseServer, own_cgroup: Path
) -> None:
    """A root process in one container holding MAX_PENDING_PER_UID connections that never say
    hello leaves room for a root process in another container: its hello holds its lease."""
    silent = (str(own_cgroup), str(lease_server.path), str(MAX_PENDING_PER_UID))
    pod = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SILENT_POD, *silent, stdin=PIPE, stdout=PIPE
    )
    try:
        assert pod.stdout is not None
        assert await pod.stdout.readline() == b"connected\n"
        record = lease_server.table.grant("k1")
        reply = await asyncio.to_thread(_hello, lease_server.path, {"lease": record.id})
        assert reply == {"ok": True, "key": "k1"}
    finally:
        await pod.communicate(b"")
