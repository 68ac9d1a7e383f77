"""Who may cache what: the source allowlist, requester-scoped checks and request limits.

The edge builds a ``Requester`` for each request (the tenant of the socket it
came in on, and the pod's own credentials if it sent them) and puts it in the
request; the service's entry points hand it to the functions here. A request
with no requester (in-process callers, tests) is not restricted.

Requester-scoped access: with the pod's credentials the agent lists the prefix
(ListObjectsV2) and HEADs every file of the snapshot at the ETag the agent's
own listing pinned. S3 authorises HEAD with s3:GetObject,
so this proves the pod may read each object, not only the first one, whatever
per-key policy the bucket has; a hit or a pull then gives it nothing it could
not have downloaded itself. This runs on every request, hit or miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from agent._config import AccessLimits, Settings
from agent._exceptions import AccessDenied, SourceUnavailable
from agent._snapshot import Snapshot
from agent._uri import ModelUri, parse_uri, uri_matches
from agent.pull.snapshot_limits import LimitExceeded, SnapshotLimit
from agent.source.interface import ObjectSource

__all__ = [
    "NODE_TENANT",
    "PullGate",
    "Requester",
    "RequesterKeys",
    "Tenant",
    "check_snapshot",
    "check_source",
    "check_unchecked",
    "may_pull",
    "snapshot_limits",
    "start_pull",
    "tenants_from_settings",
]

log = logging.getLogger(__name__)

NODE_TENANT = "node"
# HEADs in flight at once while checking a requester's access to one snapshot.
_HEAD_CONCURRENCY = 16
_ECHO_LIMIT = 200


class PullGate:
    """Counts the pulls each tenant started, against its limit and the node's."""

    def __init__(self, node_limit: int) -> None:
        self._node_limit = node_limit
        self._started: dict[str, set[str]] = {}

    def admit(self, tenant: Tenant, key: str, in_flight: Collection[str]) -> None:
        """Count a new pull of ``key`` for ``tenant``; LimitExceeded at once when full.

        ``in_flight`` are the keys being pulled now: pulls that ended drop out
        of every tenant's count here, so there is nothing to release.
        """
        running = set(in_flight)
        for keys in self._started.values():
            keys.intersection_update(running)
        if self._node_limit and len(running) >= self._node_limit:
            raise LimitExceeded(
                f"{len(running)} pulls are running on this node, the most [access.limits] "
                f"max_concurrent_pulls allows ({self._node_limit}). Retry when one ends."
            )
        mine = self._started.setdefault(tenant.name, set())
        limit = tenant.limits.max_concurrent_pulls
        if limit and len(mine) >= limit:
            raise LimitExceeded(
                f"Socket {tenant.name!r} has {len(mine)} pulls running, the most its "
                f"max_concurrent_pulls allows ({limit}). Retry when one ends."
            )
        mine.add(key)


@dataclass(frozen=True, slots=True)
class Tenant:
    """The callers of one socket: what they may cache and how much."""

    name: str
    # Globs on the normalised URI; empty allows any. Both lists must allow a source.
    sources: tuple[str, ...]
    node_sources: tuple[str, ...]
    limits: AccessLimits
    node_limits: AccessLimits
    gate: PullGate = field(compare=False)
    requester_scoped: bool = False
    # Longest lease TTL this socket's requests get; None: only leases.max_ttl_seconds.
    max_lease_seconds: float | None = None
    # Whose compile caches this socket's requests get (agent.compile.domains); the
    # node's socket sees every domain and makes its caches in "node".
    compile_domain: str = ""
    # Most of a tier's ceiling this socket's leases may hold; None: no share (the node's).
    tier_share: float | None = None

    def allows(self, uri: ModelUri) -> bool:
        """Whether both the node's sources and this socket's own allow ``uri``."""
        return uri_matches(self.node_sources, uri) and uri_matches(self.sources, uri)

    def lease_ttl(self, requested: float | None, default: float) -> float | None:
        """The TTL a lease asked for on this socket gets: clamped to ``max_lease_seconds``.

        ``requested`` None or 0 asks for ``default``; a bad value (negative, NaN) is
        passed on for the lease table to refuse with its own message.
        """
        cap = self.max_lease_seconds
        if cap is None:
            return requested
        ttl = requested or default
        return min(ttl, cap) if ttl >= 0 else ttl

    def snapshot_limits(self) -> tuple[SnapshotLimit, ...]:
        """The node's files/bytes limits per snapshot, then this socket's own."""
        return tuple(
            SnapshotLimit(limits.max_files, int(limits.max_bytes), where)
            for limits, where in ((self.node_limits, "[access.limits]"), (self.limits, self.name))
            if limits.max_files or limits.max_bytes
        )

    def check_snapshot(self, snapshot: Snapshot) -> None:
        """LimitExceeded when the snapshot has more files or bytes than a limit allows."""
        for limit in self.snapshot_limits():
            limit.check(snapshot.uri, len(snapshot.objects), snapshot.total_bytes)


@dataclass(frozen=True, slots=True)
class RequesterKeys:
    """A pod's AWS credentials: used for its own checks, never logged or kept."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True)
class Requester:
    """Who asks: the tenant of the socket a request came in on, and the pod's keys if sent."""

    tenant: Tenant
    keys: RequesterKeys | None = None

    @property
    def name(self) -> str:
        """The socket (tenant) a lease is granted to, and whose pulls its Status shows."""
        return self.tenant.name

    @property
    def sees_everything(self) -> bool:
        """Whether this is the node's own socket, which sees every tenant's leases and pulls."""
        return self.tenant.name == NODE_TENANT

    def lease_ttl(self, requested: float | None, default: float) -> float | None:
        """The TTL a lease asked for by this requester gets (its socket's cap)."""
        return self.tenant.lease_ttl(requested, default)


@runtime_checkable
class CredentialScopedSource(Protocol):
    """A source that can sign with someone else's keys (S3Source)."""

    def with_credentials(
        self, access_key_id: str, secret_access_key: str, session_token: str
    ) -> contextlib.AbstractAsyncContextManager[ObjectSource]: ...


def tenants_from_settings(settings: Settings) -> tuple[Tenant, dict[str, Tenant]]:
    """The node's own tenant (API socket, manifests) and one per [[access.sockets]] entry."""
    access = settings.access
    gate = PullGate(access.limits.max_concurrent_pulls)
    node_sources = tuple(access.sources)

    node = Tenant(NODE_TENANT, (), node_sources, AccessLimits(), access.limits, gate)
    sockets = {
        s.name: Tenant(
            s.name,
            tuple(s.sources),
            node_sources,
            s.limits,
            access.limits,
            gate,
            requester_scoped=s.requester_scoped,
            max_lease_seconds=s.max_lease_seconds,
            compile_domain=s.domain,
            tier_share=1 / len(access.sockets) if s.tier_share == "fair" else s.tier_share,
        )
        for s in access.sockets
    }
    return node, sockets


def check_source(uri: ModelUri | str, requester: Requester | None) -> None:
    """AccessDenied when ``requester``'s tenant may not cache ``uri``; no S3 call is made.

    ``uri`` is a string only for a URI from the config (the compile-cache prefix).
    """
    if requester is None:
        return
    parsed = parse_uri(uri) if isinstance(uri, str) else uri
    tenant = requester.tenant
    if not tenant.allows(parsed):
        allowed = tenant.sources or tenant.node_sources
        raise AccessDenied(
            f"{_echo(parsed)} is not among the sources socket {tenant.name!r} may cache "
            f"({', '.join(allowed)}). Ask the node's admin to allow it in [access] sources."
        )


def may_pull(uri: ModelUri, requester: Requester | None) -> bool:
    """Whether ``check_source`` lets ``requester`` cache ``uri`` (no error, no S3 call)."""
    return requester is None or requester.tenant.allows(uri)


def snapshot_limits(requester: Requester | None) -> tuple[SnapshotLimit, ...]:
    """The requester's limits per snapshot, which its listings are counted against."""
    return () if requester is None else requester.tenant.snapshot_limits()


def check_unchecked(requester: Requester | None) -> None:
    """Before a cached copy is served without S3 (offline): refused where access is checked."""
    if requester is not None and (requester.keys or requester.tenant.requester_scoped):
        raise SourceUnavailable(
            "S3 cannot be reached to check this pod's access, and a requester-scoped "
            "request is never answered unchecked. Retry when S3 answers."
        )


async def check_snapshot(
    source: ObjectSource, snapshot: Snapshot, requester: Requester | None
) -> None:
    """After the listing, before any answer: the requester's own access, then the limits."""
    if requester is None:
        return
    keys = requester.keys
    if keys is None and requester.tenant.requester_scoped:
        raise AccessDenied(
            f"Socket {requester.tenant.name!r} is requester-scoped: send the pod's AWS "
            "credentials with the request (ensure(..., as_requester=True))."
        )
    if keys is not None:
        await _check_reads(source, keys, snapshot)
    requester.tenant.check_snapshot(snapshot)


def start_pull(key: str, in_flight: Collection[str], requester: Requester | None) -> None:
    """Admit a new pull of ``key`` for ``requester``'s tenant (LimitExceeded when full)."""
    if requester is not None:
        requester.tenant.gate.admit(requester.tenant, key, in_flight)


async def _check_reads(source: ObjectSource, keys: RequesterKeys, snapshot: Snapshot) -> None:
    if not isinstance(source, CredentialScopedSource):
        raise AccessDenied(
            f"This agent's source ({source.name}) cannot check a requester's credentials."
        )
    uri = snapshot.uri
    async with source.with_credentials(
        keys.access_key_id, keys.secret_access_key, keys.session_token
    ) as scoped:
        await scoped.list_objects(uri)
        limit = asyncio.Semaphore(_HEAD_CONCURRENCY)

        async def head(key: str, etag: str) -> None:
            async with limit:
                # With the ETag: SourceChanged when the object went away or was replaced.
                await scoped.head_object(uri.bucket, key, etag=etag)

        heads = [asyncio.create_task(head(o.key, o.etag)) for o in snapshot.objects]
        try:
            await asyncio.gather(*heads)
        finally:
            for task in heads:
                task.cancel()
            await asyncio.gather(*heads, return_exceptions=True)


def _echo(value: object) -> str:
    text = str(value)
    return text if len(text) <= _ECHO_LIMIT else text[:_ECHO_LIMIT] + "..."
