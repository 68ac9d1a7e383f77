"""Requests a hostile tenant may send, and what the agent does with them (issue 16, items 5, 10).

In-process against the in-memory source where the behaviour is the service's (glob matching
must not stall the event loop), and end to end over real tenant sockets where it is the edge's
(pins and long leases are node-only effects).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import AgentFactory

from agent._exceptions import AccessDenied, NoSpace, NotFound
from agent._uri import parse_uri
from agent.client import Client, LeaseGrant
from agent.pull.resolver import resolve
from agent.testing import MemorySource, SampleModel, make_safetensors_model, upload_model
from agent.testing._process import purge_tree

# As many include globs as a request may carry, each near the 1,024-byte cap, written to
# cost the most to match: every "*" may stretch, and nothing ever matches.
HOSTILE_GLOBS = tuple(f"{n}*" + "a*" * 500 + "z" for n in range(256))


class LoopLag:
    """The longest an event-loop callback waited past its due time while this ran.

    A timer re-armed every ``interval`` seconds: when something holds the loop, the next
    tick runs late by as long as it held it. Any RPC (Status, say) would have waited as long.
    """

    def __init__(self, interval: float = 0.01) -> None:
        self._interval = interval
        self._loop = asyncio.get_running_loop()
        self._due = time.monotonic() + interval
        self._handle = self._loop.call_later(interval, self._tick)
        self.worst = 0.0

    def _tick(self) -> None:
        now = time.monotonic()
        self.worst = max(self.worst, now - self._due)
        self._due = now + self._interval
        self._handle = self._loop.call_later(self._interval, self._tick)

    def stop(self) -> float:
        """Stop, counting the tick that is overdue now (the loop may not have run it yet)."""
        self._handle.cancel()
        return max(self.worst, time.monotonic() - self._due)


@pytest.fixture
def big_listing() -> MemorySource:
    """10,000 objects under one prefix, as a tenant's own bucket might hold."""
    source = MemorySource()
    for number in range(10_000):
        source.put("models", f"big/dir{number % 50}/file-{number:06d}.safetensors", b"")
    return source


async def test_matching_hostile_globs_against_a_big_listing_never_holds_the_event_loop(
    big_listing: MemorySource,
) -> None:
    """256 globs of ~1 KiB against 10,000 objects take seconds of CPU; the event loop (which
    answers every other RPC, Status included) is held for a small fraction of that, the
    listing's own share: the matching runs in a worker thread. (Before, it was held all along.)
    """
    started = time.monotonic()
    lag = LoopLag()
    try:
        with pytest.raises(NotFound, match="none passes the include/exclude"):
            await resolve(big_listing, parse_uri("s3://models/big/"), HOSTILE_GLOBS, ())
    finally:
        worst = lag.stop()
    took = time.monotonic() - started
    assert took > 0.5, f"the matching took only {took:.2f} s: not hostile enough to show"
    # As a share of the time taken: a loaded machine slows both alike.
    assert worst < took / 4, f"the event loop was held for {worst:.2f} s of {took:.2f} s"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: Unix socket paths are limited to 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="pw-tr-", dir="/tmp"))
    yield directory
    purge_tree(directory)


def _tenant(socket: Path, extra: str = "") -> str:
    return f'[[access.sockets]]\nname = "team-a"\npath = "{socket}"\n{extra}'


def test_a_tenant_socket_refuses_to_pin_through_ensure_model(
    start_agent: AgentFactory, small_model: SampleModel, short_dir: Path
) -> None:
    """EnsureModel(pin=true) on a tenant socket is PERMISSION_DENIED before any work (PinModel
    is node-only, and a pin keeps the tiers full past restarts); nothing is pinned, and the
    node's API socket still pins."""
    tenant_socket = short_dir / "a.sock"
    agent = start_agent(_tenant(tenant_socket))
    with Client(tenant_socket) as tenant, pytest.raises(AccessDenied, match="pin=true"):
        tenant.ensure(small_model.uri, pin=True)
    with Client(agent.socket_path) as node:
        assert node.status().model_count == 0
        assert node.ensure(small_model.uri, pin=True).path
        assert [model.pinned for model in node.list_models()] == [True]


def test_a_tenants_lease_ttl_is_capped_by_its_max_lease_seconds(
    start_agent: AgentFactory, small_model: SampleModel, short_dir: Path
) -> None:
    """A 24 h lease asked for on a tenant socket is granted for max_lease_seconds (here 120 s),
    and renewing it for 24 h gives 120 s again; the node's API socket still gets 24 h."""
    tenant_socket = short_dir / "a.sock"
    agent = start_agent(_tenant(tenant_socket, "max_lease_seconds = 120\n"))
    day = 24 * 3600.0
    with Client(tenant_socket) as tenant:
        granted = tenant.ensure(small_model.uri, lease=True, lease_ttl=day).lease
        assert granted is not None
        assert _seconds_left(granted) <= 120
        assert _seconds_left(tenant.renew_lease(granted.id, day)) <= 120
    with Client(agent.socket_path) as node:
        from_node = node.ensure(small_model.uri, lease=True, lease_ttl=day).lease
        assert from_node is not None
        assert _seconds_left(from_node) > day - 60


def _seconds_left(lease: LeaseGrant) -> float:
    assert lease.expires is not None
    return (lease.expires - datetime.now(UTC)).total_seconds()


def _models(s3_client: Any, bucket: str, root: Path, count: int) -> list[SampleModel]:
    """``count`` different 9 MiB single-shard models in ``bucket``."""
    made = []
    for number in range(count):
        directory = root / f"m{number}"
        tensors = make_safetensors_model(directory, total_bytes=9 * 2**20, shards=1, seed=number)
        made.append(upload_model(s3_client, bucket, f"m{number}", directory, tensors=tensors))
    return made


def test_a_tenant_that_keeps_leasing_gets_its_share_and_another_still_gets_room(
    start_agent: AgentFactory, s3_client: Any, bucket: str, tmp_path: Path, short_dir: Path
) -> None:
    """Two tenants on a 20 MiB tier (fair share: half each): A holds one 9 MiB model leased and
    is refused a second (RESOURCE_EXHAUSTED naming its share), while B gets its model leased
    beside A's; a refusal for a full tier names no one's snapshots; A gets room again once it
    releases."""
    first, second, third = _models(s3_client, bucket, tmp_path, 3)
    a_socket, b_socket = short_dir / "a.sock", short_dir / "b.sock"
    agent = start_agent(
        '[tiers]\nshm_budget = "20MiB"\n'
        f'[[access.sockets]]\nname = "team-a"\npath = "{a_socket}"\n'
        f'[[access.sockets]]\nname = "team-b"\npath = "{b_socket}"\n'
    )
    with Client(a_socket) as a, Client(b_socket) as b, Client(agent.socket_path) as node:
        handle = a.ensure(first.uri, lease=True, tier="shm")
        held = handle.lease
        assert held is not None
        with pytest.raises(NoSpace) as refused:
            a.ensure(second.uri, lease=True, tier="shm")
        message = str(refused.value)
        assert "past its share of the tier (50%" in message
        assert "tier_share" in message
        assert b.ensure(third.uri, lease=True, tier="shm").lease is not None
        with pytest.raises(NoSpace) as full:
            node.ensure(second.uri, lease=True, tier="shm", strict_tier=True)
        assert "No tier can hold" in str(full.value)
        assert handle.key[:12] not in str(full.value)
        a.release_lease(held.id)
        assert a.ensure(second.uri, lease=True, tier="shm").lease is not None
