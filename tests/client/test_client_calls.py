"""The client's lease, pin, garbage-collection and verification calls: what it sends and reads.

The server is tests.scripted_agent, a stand-in that answers what the test asks for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from scripted_agent import T0, ScriptedAgent, serve_scripted

from agent.client import (
    AsyncClient,
    Client,
    Conflict,
    FileProblem,
    IntegrityError,
    InvalidRequest,
    LeaseGrant,
    LeaseInfo,
    NotFound,
    Verification,
    ensure,
)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, ScriptedAgent]]:
    path = tmp_path / "agent.sock"
    with serve_scripted(path) as scripted:
        yield path, scripted


@pytest.fixture
def socket_path(served: tuple[Path, ScriptedAgent]) -> Path:
    return served[0]


@pytest.fixture
def scripted(served: tuple[Path, ScriptedAgent]) -> ScriptedAgent:
    return served[1]


def test_ensure_with_a_lease_returns_the_grant(socket_path: Path) -> None:
    """ensure(lease=True) returns the agent's lease grant; a plain ensure has no lease."""
    with Client(socket_path) as client:
        handle = client.ensure("s3://b/m/", lease=True, lease_ttl=30, client_name="me")
        assert client.ensure("s3://b/m/").lease is None
    assert handle.lease == LeaseGrant(
        id="lease-me", key="k1", expires=T0, socket_path=Path("/run/prewarm/lease.sock")
    )


def test_ensure_sends_the_lease_pin_and_strict_tier_options(
    socket_path: Path, scripted: ScriptedAgent
) -> None:
    """ensure() puts lease, TTL, pin and strict_tier on the wire; unset ones go as zero values."""
    with Client(socket_path) as client:
        client.ensure(
            "s3://b/m/", tier="disk", lease=True, lease_ttl=30, pin=True, strict_tier=True
        )
        client.ensure("s3://b/m/")
    asked, plain = scripted.ensure_requests
    assert (asked.lease, asked.lease_ttl_seconds, asked.pin, asked.strict_tier) == (
        True,
        30,
        True,
        True,
    )
    # 0 on the wire: the agent's default TTL.
    assert (plain.lease, plain.lease_ttl_seconds, plain.pin, plain.strict_tier) == (
        False,
        0,
        False,
        False,
    )


def test_handle_reports_the_bytes_a_resumed_pull_kept(socket_path: Path) -> None:
    """The handle carries the bytes a resumed pull kept from its journal."""
    assert ensure("s3://b/m/", socket_path=socket_path).resumed_bytes == 40


def test_lease_ttl_without_a_lease_is_refused_before_any_call(tmp_path: Path) -> None:
    """lease_ttl without lease=True is refused locally."""
    with Client(tmp_path / "unused.sock") as client, pytest.raises(InvalidRequest, match="lease"):
        client.ensure("s3://b/m/", lease_ttl=30)


def test_model_info_lists_leases_and_the_pin(socket_path: Path) -> None:
    """Model info converts leases (held ones with credentials, uid 0 included) and the pin flag."""
    with Client(socket_path) as client:
        info = client.get("abcdef12")
    assert info.pinned
    held, timed = info.leases
    assert held == LeaseInfo(
        id="held-1",
        client_name="ns/pod",
        pid=42,
        uid=0,
        gid=0,
        acquired=T0,
        expires=None,
        held=True,
    )
    # Nobody holds it: no credentials (not uid 0), and an expiry.
    assert (timed.pid, timed.uid, timed.gid, timed.held) == (None, None, None, False)
    assert timed.expires == T0


def test_renew_lease_returns_the_new_expiry(socket_path: Path) -> None:
    """renew_lease returns the new expiry; no TTL sends 0, the agent's default."""
    with Client(socket_path) as client:
        renewed = client.renew_lease("L1", ttl=90)
        default = client.renew_lease("L1")
    assert renewed.id == "L1"
    assert renewed.expires is not None
    assert (renewed.expires - T0).total_seconds() == 90
    assert default.expires is not None
    assert (default.expires - T0).total_seconds() == 60


def test_renew_or_release_of_an_unknown_lease_is_not_found(socket_path: Path) -> None:
    """Renewing or releasing an unknown lease raises NotFound; a known release succeeds."""
    with Client(socket_path) as client:
        with pytest.raises(NotFound):
            client.renew_lease("fail:NOT_FOUND")
        with pytest.raises(NotFound):
            client.release_lease("fail:NOT_FOUND")
        client.release_lease("L1")


def test_pin_and_unpin(socket_path: Path) -> None:
    """pin() and pin(pinned=False) return the model with the new pin state."""
    with Client(socket_path) as client:
        assert client.pin("abcdef12").pinned
        assert not client.pin("abcdef12", pinned=False).pinned


def test_evict_sends_force(socket_path: Path) -> None:
    """evict() without force surfaces the agent's Conflict; with force it returns what was freed."""
    with Client(socket_path) as client:
        with pytest.raises(Conflict, match="is leased"):
            client.evict("abcdef12")
        result = client.evict("abcdef12", force=True)
    assert [m.key for m in result.evicted] == ["abcdef12"]
    assert result.bytes_freed == 100


def test_collect_garbage_sends_the_tier(socket_path: Path) -> None:
    """collect_garbage() sends the tier asked for, or none for both."""
    with Client(socket_path) as client:
        assert client.collect_garbage(tier="disk").evicted[0].tier == "disk"
        assert client.collect_garbage().evicted[0].tier == "shm"


def test_verify_returns_each_snapshot_and_its_problems(socket_path: Path) -> None:
    """verify() returns one result per snapshot with its problems and whether it was evicted."""
    with Client(socket_path) as client:
        ok, bad = client.verify(all=True)
        [kept] = client.verify("s3://b/bad/", report_only=True)
    assert ok == Verification(
        uri="s3://b/ok/",
        key="ok1",
        ok=True,
        problems=(),
        evicted=False,
        bytes_checked=100,
        seconds=0.25,
    )
    assert not bad.ok
    assert bad.evicted
    assert bad.problems == (FileProblem(path="a.bin", check="hash", detail="xxh3 differs"),)
    assert not kept.evicted


@pytest.mark.parametrize(
    ("ref", "all_models", "word"), [(None, False, "neither"), ("s3://b/m/", True, "both")]
)
def test_verify_needs_exactly_one_of_ref_and_all(
    tmp_path: Path, ref: str | None, all_models: bool, word: str
) -> None:
    """verify() with both or neither of a ref and all=True is refused locally."""
    with Client(tmp_path / "unused.sock") as client, pytest.raises(InvalidRequest, match=word):
        client.verify(ref, all=all_models)


def test_status_reports_budgets_and_lease_counts(socket_path: Path) -> None:
    """status() converts per-tier budget, reserve, staging, lease and pin counts."""
    with Client(socket_path) as client:
        status = client.status()
    assert status.lease_count == 2
    [tier] = status.tiers
    assert (tier.budget_bytes, tier.reserve_bytes, tier.staging_bytes) == (1000, 50, 7)
    assert (tier.leased_count, tier.pinned_count) == (2, 1)


async def test_async_client_leases_pins_gc_and_verify(socket_path: Path) -> None:
    """The async client covers the same lease, pin, gc, evict and verify calls and error mapping."""
    async with AsyncClient(socket_path) as client:
        handle = await client.ensure("s3://b/m/", lease=True, client_name="a")
        assert handle.lease is not None
        assert handle.lease.id == "lease-a"
        renewed = await client.renew_lease("L1", ttl=5)
        assert renewed.expires is not None
        await client.release_lease("L1")
        assert (await client.pin("abcdef12")).pinned
        assert (await client.collect_garbage("disk")).evicted[0].tier == "disk"
        assert (await client.evict("abcdef12", force=True)).bytes_freed == 100
        assert [v.key for v in await client.verify(all=True)] == ["ok1", "bad1"]
        with pytest.raises(IntegrityError, match="DATA_LOSS"):
            await client.verify("fail:DATA_LOSS")
