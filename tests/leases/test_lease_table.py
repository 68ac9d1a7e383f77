"""The lease table's rules, on a fake clock: TTLs, expiry, renew, release, hold."""

from __future__ import annotations

import asyncio
import os

import pytest

from agent import AccessDenied, Conflict, InvalidRequest, NotFound
from agent.leases.table import LeaseTable, PeerCredentials

ME = PeerCredentials(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> LeaseTable:
    return LeaseTable(default_ttl=60, max_ttl=600, clock=clock)


def test_grant_without_ttl_uses_the_default(table: LeaseTable, clock: FakeClock) -> None:
    """A grant without a TTL expires after the default TTL, timed and not held yet."""
    record = table.grant("k1", "ns/pod")
    assert record.key == "k1"
    assert record.client_name == "ns/pod"
    assert record.acquired == clock.now
    assert record.expires == clock.now + 60
    assert not record.held
    assert record.holder is None


def test_ttl_of_zero_means_the_default(table: LeaseTable, clock: FakeClock) -> None:
    """A TTL of 0 asks for the default TTL, as the proto's zero value does."""
    assert table.grant("k1", ttl=0).expires == clock.now + 60


def test_ttl_above_the_maximum_is_clamped(table: LeaseTable, clock: FakeClock) -> None:
    """A TTL above the maximum (even infinite) is clamped to it, not refused."""
    assert table.grant("k1", ttl=10_000).expires == clock.now + 600
    assert table.grant("k1", ttl=float("inf")).expires == clock.now + 600


@pytest.mark.parametrize("ttl", [-1.0, float("nan")])
def test_negative_or_nan_ttl_is_invalid(table: LeaseTable, ttl: float) -> None:
    """A negative or NaN TTL is an InvalidRequest that says what to give instead."""
    with pytest.raises(InvalidRequest, match="positive number of seconds"):
        table.grant("k1", ttl=ttl)


def test_ids_are_unique_and_unguessable(table: LeaseTable) -> None:
    """Lease ids are distinct and long enough that another pod cannot guess one."""
    ids = {table.grant("k1").id for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) >= 20 for i in ids)


def test_lease_expires_at_its_ttl(table: LeaseTable, clock: FakeClock) -> None:
    """A timed lease is live until its expiry and gone (NotFound) from that instant."""
    record = table.grant("k1", ttl=30)
    clock.now += 29.9
    assert table.get(record.id) == record
    clock.now += 0.1
    assert table.active() == []
    assert table.leased_keys() == set()
    with pytest.raises(NotFound, match="does not exist or has expired"):
        table.get(record.id)


def test_renew_pushes_the_expiry_from_now(table: LeaseTable, clock: FakeClock) -> None:
    """Renewing sets the expiry to now + TTL, keeping the lease past its first expiry."""
    record = table.grant("k1", ttl=30)
    clock.now += 20
    renewed = table.renew(record.id, ttl=30)
    assert renewed.expires == clock.now + 30
    clock.now += 25
    assert [r.id for r in table.active()] == [record.id]


def test_renew_without_ttl_uses_the_default(table: LeaseTable, clock: FakeClock) -> None:
    """A renewal without a TTL uses the default TTL, not the lease's original one."""
    record = table.grant("k1", ttl=5)
    assert table.renew(record.id).expires == clock.now + 60


def test_renew_of_an_expired_lease_is_not_found_and_says_what_to_do(
    table: LeaseTable, clock: FakeClock
) -> None:
    """Renewing too late is NotFound and the message says to ask for a new lease."""
    record = table.grant("k1", ttl=10)
    clock.now += 10
    with pytest.raises(NotFound, match=r"EnsureModel\(lease=true\)"):
        table.renew(record.id)


def test_release_ends_the_lease(table: LeaseTable) -> None:
    """Release ends a lease at once and returns it; a second release is NotFound."""
    record = table.grant("k1")
    assert table.release(record.id) == record
    assert table.active() == []
    with pytest.raises(NotFound):
        table.release(record.id)


def test_unknown_id_is_not_found(table: LeaseTable) -> None:
    """Every operation on an unknown lease id is NotFound naming the id."""
    for call in (table.get, table.renew, table.release):
        with pytest.raises(NotFound, match="'nope' does not exist"):
            call("nope")
    with pytest.raises(NotFound):
        table.hold("nope", ME)


def test_held_lease_never_expires(table: LeaseTable, clock: FakeClock) -> None:
    """A held lease has no expiry, takes the holder's name, and cannot be renewed by id."""
    record = table.grant("k1", "granted-name", ttl=10)
    held = table.hold(record.id, ME, "holder-name")
    assert held.held
    assert held.holder == ME
    assert held.expires is None
    assert held.client_name == "holder-name"
    clock.now += 10_000
    assert table.for_key("k1") == [held]
    with pytest.raises(AccessDenied, match="cannot be renewed"):
        table.renew(record.id)
    assert table.for_key("k1") == [held]


def test_hold_without_a_name_keeps_the_granted_name(table: LeaseTable) -> None:
    """A hello without a name keeps the client name given at grant."""
    record = table.grant("k1", "granted-name")
    assert table.hold(record.id, ME).client_name == "granted-name"


def test_expired_lease_cannot_be_held(table: LeaseTable, clock: FakeClock) -> None:
    """A lease that expired before its hello cannot be held."""
    record = table.grant("k1", ttl=10)
    clock.now += 11
    with pytest.raises(NotFound):
        table.hold(record.id, ME)


def test_second_holder_is_refused(table: LeaseTable) -> None:
    """A held lease binds its process: another process is AccessDenied without learning the
    holder; a second connection of the holding process is a Conflict."""
    record = table.grant("k1")
    table.hold(record.id, ME)
    with pytest.raises(AccessDenied) as denied:
        table.hold(record.id, PeerCredentials(1, 2, 3))
    assert str(ME.pid) not in str(denied.value)
    with pytest.raises(Conflict, match="another connection of this process"):
        table.hold(record.id, ME)
    assert table.get(record.id).holder == ME


def test_unhold_ends_the_lease(table: LeaseTable) -> None:
    """Unhold (the connection closed) ends the lease and returns it once, then None."""
    record = table.grant("k1")
    table.hold(record.id, ME)
    ended = table.unhold(record.id)
    assert ended is not None
    assert ended.holder == ME
    assert table.active() == []
    assert table.unhold(record.id) is None


def test_queries_by_key(table: LeaseTable, clock: FakeClock) -> None:
    """for_key, leased_keys and active list live leases by snapshot, oldest first."""
    a1 = table.grant("a")
    clock.now += 1
    a2 = table.grant("a")
    b = table.grant("b")
    assert table.for_key("a") == [a1, a2]
    assert table.leased_keys() == {"a", "b"}
    assert [r.id for r in table.active()] == [a1.id, *sorted([a2.id, b.id])]


def test_bad_ttl_settings_are_refused() -> None:
    """A default TTL above the maximum is refused when the table is built."""
    with pytest.raises(InvalidRequest):
        LeaseTable(default_ttl=600, max_ttl=60)


async def test_wait_released_returns_when_a_timed_lease_expires() -> None:
    """wait_released wakes at a timed lease's expiry, with nothing else changing the table."""
    table = LeaseTable(default_ttl=0.05, max_ttl=1)
    record = table.grant("k1")
    async with asyncio.timeout(5):
        await table.wait_released(record.id)
    assert table.active() == []


async def test_wait_released_returns_on_release(table: LeaseTable) -> None:
    """wait_released blocks while the lease lives and returns when its connection ends it."""
    record = table.grant("k1")
    table.hold(record.id, ME)
    async with asyncio.timeout(5), asyncio.TaskGroup() as tasks:
        waiter = tasks.create_task(table.wait_released(record.id))
        await asyncio.sleep(0)  # let it start waiting
        assert not waiter.done()
        table.unhold(record.id)
