"""The [access] section of the settings: source allowlist, tenant sockets, limits.

Kept apart from agent._config only for size; agent._config re-exports it.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Annotated

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    Field,
    PlainSerializer,
    model_validator,
)
from pydantic_settings import NoDecode

from agent._uri import valid_bucket_name

__all__ = [
    "COMPILE_DOMAIN",
    "AccessLimits",
    "AccessSettings",
    "FileMode",
    "SourcePatterns",
    "TenantSocketSettings",
]


def _parse_mode(value: object) -> object:
    if isinstance(value, str):
        return int(value, 8)
    return value


FileMode = Annotated[
    int,
    BeforeValidator(_parse_mode),
    Field(ge=0, le=0o777),
    PlainSerializer(lambda mode: f"{mode:04o}", return_type=str),
]


def _list_from_text(value: str, example: str) -> object:
    """An environment variable's list: JSON, or one item or several, comma-separated.

    ``PREWARM_ACCESS__SOURCES='s3://models/*'`` is what people write; pydantic-settings
    would only take JSON (``'["s3://models/*"]'``) and die with a traceback otherwise.
    """
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{value[:200]!r} starts like a JSON list but is not one ({exc.msg}); write a "
                f"JSON list or comma-separated items, e.g. {example}"
            ) from None
    return [item.strip() for item in text.split(",") if item.strip()]


def _check_source_patterns(value: object) -> object:
    if isinstance(value, str):
        value = _list_from_text(value, "'s3://models-prod/*,s3://shared/llama/'")
    if isinstance(value, list):
        for pattern in value:
            if not isinstance(pattern, str) or not pattern.startswith("s3://"):
                raise ValueError(
                    f"{pattern!r} is not an S3 URI pattern; write e.g. 's3://models-prod/*'"
                )
            if len(pattern) > 1024:
                raise ValueError(f"the source pattern {pattern[:64]!r}... is over 1024 characters")
            if _matches_every_bucket(pattern):
                raise ValueError(
                    f"{pattern!r} matches every bucket the node's role can read; name the "
                    "buckets (e.g. 's3://models-prod/*'), or leave the list empty to allow any "
                    "source (the daemon then warns at every start)"
                )
    return value


def _matches_every_bucket(pattern: str) -> bool:
    # Two bucket names that share no character: a pattern matching both covers any bucket.
    return all(
        fnmatch.fnmatchcase(f"s3://{bucket}/model/", pattern)
        or fnmatch.fnmatchcase(f"s3://{bucket}/", pattern)
        for bucket in ("abc", "x-y.9z")
    )


def _check_tenant_socket_mode(mode: int) -> int:
    if mode & 0o002:
        raise ValueError(
            f"mode {mode:04o} lets any local user connect to this tenant's socket and act as "
            "the tenant; give the tenant's pods a group (mode 0660 and group = ...) or mount "
            "the socket into its pods only with mode 0600"
        )
    return mode


def check_api_socket_mode(mode: int) -> int:
    """The node's API socket may evict, pin and read every snapshot: never world-connectable."""
    if mode & 0o002:
        raise ValueError(
            f"mode {mode:04o} lets any local user evict, pin and list the whole cache; use 0660 "
            "with socket_group for the node's tools, and [[access.sockets]] for pods"
        )
    return mode


def _check_bucket_names(value: object) -> object:
    if isinstance(value, str):
        value = _list_from_text(value, "'one-model-bucket,another'")
    if isinstance(value, list):
        for name in value:
            if not isinstance(name, str) or not valid_bucket_name(name):
                raise ValueError(
                    f"{name!r} is not a bucket name; write the bare name, e.g. "
                    "'one-model-bucket' (no s3://, no prefix)"
                )
    return value


# Bucket names; NoDecode as for SourcePatterns below.
BucketNames = Annotated[list[str], NoDecode, BeforeValidator(_check_bucket_names)]

# A compile domain names a directory and an S3 prefix component: never "." or "..".
COMPILE_DOMAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# Globs on the normalised URI (s3://bucket/prefix/); a pattern without * ? [ is a prefix.
# NoDecode: an environment variable reaches the validator as text (JSON or comma-separated).
SourcePatterns = Annotated[list[str], NoDecode, BeforeValidator(_check_source_patterns)]


class AccessLimits(BaseModel):
    """Bounds on what one request may cost; 0 means no limit."""

    model_config = {"extra": "forbid"}

    # Files and bytes one snapshot may hold (checked after the listing, before any GET).
    max_files: int = Field(default=0, ge=0)
    max_bytes: ByteSize = Field(default=ByteSize(0), ge=0)
    # New pulls running at once; joining a pull of the same snapshot is not a new pull.
    max_concurrent_pulls: int = Field(default=0, ge=0)


class TenantSocketSettings(BaseModel):
    """One tenant's socket: whoever can open it is that tenant."""

    model_config = {"extra": "forbid"}

    # Names the tenant in logs and errors.
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
    path: Path
    # Connecting needs write permission: others-write (0666) would make every local user the tenant.
    mode: Annotated[FileMode, AfterValidator(_check_tenant_socket_mode)] = 0o660
    # Group that owns the socket (name); empty keeps the daemon's group.
    group: str = ""
    # The sources this tenant may cache, within [access].sources when that is set.
    sources: SourcePatterns = Field(default_factory=list)
    limits: AccessLimits = AccessLimits()
    # Each request must carry the pod's own AWS credentials; the agent checks with them
    # that the pod may list and read the snapshot before it answers with a path.
    requester_scoped: bool = False
    # Whose compile caches this tenant's pods get and fill (a path component of the
    # key directories and of the S3 prefix). Empty: the tenant's name. Tenants given
    # the same compile_domain share compile caches (and need the same group).
    compile_domain: str = ""
    # Longest TTL a lease granted or renewed on this socket gets (longer asks are
    # clamped): a tenant's timed lease must not keep a snapshot for a day. Pods that
    # need longer hold their lease open on the lease socket (prewarm exec does).
    max_lease_seconds: float = Field(default=3600.0, gt=0)

    @property
    def domain(self) -> str:
        """The compile domain this socket's requests use."""
        return self.compile_domain or self.name

    @model_validator(mode="after")
    def _domain_is_a_directory_name(self) -> TenantSocketSettings:
        if not COMPILE_DOMAIN.fullmatch(self.domain):
            raise ValueError(
                f"compile domain {self.domain!r} (socket {self.name!r}) must start with a letter "
                "or digit, then letters, digits, '.', '_' or '-', at most 64 in all: it names "
                "a directory and an S3 prefix. Set compile_domain."
            )
        return self


class AccessSettings(BaseModel):
    """Who may cache what: source allowlist, tenant sockets, limits."""

    model_config = {"extra": "forbid"}

    # Allowed sources for every socket, manifests and compile caches. Empty allows any
    # source (the old behaviour; the daemon warns at start).
    sources: SourcePatterns = Field(default_factory=list)
    # Largest request message the sockets accept.
    max_request_bytes: ByteSize = Field(default=ByteSize(256 * 1024), ge=1024, le=4 * 1024**2)
    # Connections each gRPC socket (the API socket, each tenant's) keeps open at once;
    # past it a new one is closed as it is accepted (the client sees UNAVAILABLE).
    max_connections_per_socket: int = Field(default=256, ge=8, le=65_536)
    # Limits for the whole agent (max_concurrent_pulls counts every socket's pulls).
    limits: AccessLimits = AccessLimits()
    # Per-tenant sockets; none: the one API socket (socket_path) serves everyone.
    sockets: list[TenantSocketSettings] = Field(default_factory=list)
    # Buckets a model URI may name whole (s3://bucket, no prefix): each holds one model.
    # Any other whole-bucket URI is refused (INVALID_ARGUMENT): it caches every object.
    whole_buckets: BucketNames = Field(default_factory=list)

    @model_validator(mode="after")
    def _distinct_sockets(self) -> AccessSettings:
        names = [s.name for s in self.sockets]
        paths = [s.path for s in self.sockets]
        if len(set(names)) != len(names) or len(set(paths)) != len(paths):
            raise ValueError("each [[access.sockets]] entry needs its own name and path")
        groups: dict[str, set[str]] = {}
        for entry in self.sockets:
            groups.setdefault(entry.domain, set()).add(entry.group)
        for domain, shared in groups.items():
            if len(shared) > 1:
                raise ValueError(
                    f"the sockets sharing compile domain {domain!r} have different groups "
                    f"({', '.join(sorted(repr(g) for g in shared))}); the domain's directories "
                    "belong to one group: give them the same group, or their own domains"
                )
        if "node" in names:
            # "node" is the API socket's identity: a tenant by that name could renew
            # or release the node's leases.
            raise ValueError('"node" names the node\'s own API socket; name the tenant otherwise')
        return self
