"""Typed settings: defaults < /etc/prewarm/agent.toml < PREWARM_* environment."""

from __future__ import annotations

import difflib
import fnmatch
import json
import os
import re
import tomllib
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    Field,
    PlainSerializer,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from agent._exceptions import InvalidRequest
from agent._uri import valid_bucket_name
from agent._vocabulary import (
    REMOVED_DATA_PLANES,
    DataPlaneName,
    TierName,
    unknown_data_plane,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "ENV_PREFIX",
    "NESTED_DELIMITER",
    "NOT_SETTINGS",
    "AccessLimits",
    "AccessSettings",
    "CompileCacheSettings",
    "ConfigError",
    "IntegritySettings",
    "LeaseSettings",
    "ManifestSettings",
    "MetricsSettings",
    "S3Settings",
    "Settings",
    "TenantSocketSettings",
    "TierSettings",
    "load_settings",
    "parse_size_or_percent",
    "render_toml",
    "settings_env_names",
    "unknown_env_vars",
    "unknown_environment",
]

# -- the PREWARM_* environment as the settings read it: which names exist, what went wrong --
#
# pydantic-settings ignores a variable that names no setting, so a typo such as
# ``PREWARM_METRICS_PORT`` (one underscore where nested keys take two) changes
# nothing without a word; and it raises its own ``SettingsError`` with a
# traceback when a list or table in a variable is not JSON. This module names the
# intended variable for the first and writes a sentence for the second.

ENV_PREFIX = "PREWARM_"
NESTED_DELIMITER = "__"

# PREWARM_* variables that are not settings of the daemon, and who reads them.
NOT_SETTINGS = frozenset(
    {
        "PREWARM_CONFIG",  # the config file's path (prewarmd)
        "PREWARM_CLIENT_NAME",  # prewarm exec --name
        "PREWARM_CACHED_ONLY",  # prewarm pull/exec --cached-only
        "PREWARM_AS_REQUESTER",  # prewarm pull/exec --as-requester
        "PREWARM_WAIT_FOR_AGENT",  # prewarm exec/health --wait-for-agent
        "PREWARM_KEY_IGNORE",  # prewarm exec --key-ignore
        "PREWARM_TEST_CRASH_AT",  # tests only: where the daemon kills itself
    }
)


def settings_env_names(model: type[BaseModel], prefix: str = ENV_PREFIX) -> Iterator[str]:
    """Every variable that sets a field of ``model``: tables too, and each key inside them."""
    for name, field in model.model_fields.items():
        env_name = f"{prefix}{name.upper()}"
        yield env_name
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from settings_env_names(annotation, env_name + NESTED_DELIMITER)


def unknown_env_vars(model: type[BaseModel], environ: Mapping[str, str]) -> list[str]:
    """A sentence for each PREWARM_* variable that no setting reads, naming the likely one."""
    known = set(settings_env_names(model)) | NOT_SETTINGS
    sentences = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known:
            continue
        sentences.append(f"{name} is not a prewarm setting and is ignored{_hint(upper, known)}")
    return sentences


def _hint(name: str, known: set[str]) -> str:
    # One underscore where a nested key needs two is the usual slip; try that first.
    doubled = [
        candidate
        for candidate in known
        if NESTED_DELIMITER in candidate and candidate.replace(NESTED_DELIMITER, "_") == name
    ]
    close = doubled or difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
    if close:
        return f"; did you mean {close[0]}? (nested keys take two underscores)"
    return (
        "; the settings are in the README's configuration table (nested keys take two "
        "underscores: PREWARM_S3__REGION)"
    )


DEFAULT_CONFIG_PATH = Path("/etc/prewarm/agent.toml")
CONFIG_PATH_ENV = "PREWARM_CONFIG"


class ConfigError(InvalidRequest):
    """The configuration file or a PREWARM_* variable is invalid."""


def _empty_to_none(value: object) -> object:
    return None if value == "" else value


OptionalText = Annotated[str | None, BeforeValidator(_empty_to_none)]


def _known_data_plane(value: object) -> object:
    if isinstance(value, str) and value in REMOVED_DATA_PLANES:
        raise ValueError(unknown_data_plane(value))
    return value


# Attempts a request that S3 leaves unanswered gets within first_byte_timeout_seconds.
ATTEMPTS_PER_DEADLINE = 3


class S3Settings(BaseModel):
    """How the agent talks to S3. Credentials come from the standard AWS chain."""

    model_config = {"extra": "forbid"}

    # Unset: botocore's own resolution (AWS_ENDPOINT_URL, config files, AWS default).
    endpoint_url: OptionalText = None
    region: OptionalText = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    # What moves the bulk bytes: "auto" (the processes plane for S3: presigned ranged
    # GETs sent by worker processes), or "aiobotocore" (reads in the event loop, for an
    # S3-compatible server that refuses presigned URLs). docs/data-planes.md.
    data_plane: Annotated[DataPlaneName, BeforeValidator(_known_data_plane)] = "auto"
    # Worker processes of the processes plane, each with its own interpreter lock.
    # "auto": sized for target_gbps (docs/data-planes.md); a number pins it.
    worker_processes: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"
    # The node's bandwidth to S3 that automatic sizing plans for, in Gbit/s.
    # "auto": the instance type's (EC2, from the DMI product name), else 25.
    target_gbps: Annotated[float, Field(gt=0, le=3200)] | Literal["auto"] = "auto"
    # GETs in flight. "auto": found by measuring the link, node-wide, up to
    # max_concurrency (docs/data-planes.md); a number pins it for every pull.
    concurrency: Annotated[int, Field(ge=1, le=8192)] | Literal["auto"] = "auto"
    # The most GETs the node keeps in flight. "auto": twice what target_gbps needs at
    # 50 MB/s per GET, 256 to 4096.
    max_concurrency: Annotated[int, Field(ge=1, le=8192)] | Literal["auto"] = "auto"
    # Size of each ranged GET, and of each range the journal records (resume granularity).
    # "auto": 8-64 MiB, so every stream reads several and S3's request limit is kept.
    chunk_size: Annotated[ByteSize, Field(ge=1024**2)] | Literal["auto"] = "auto"
    # Retries after a request's first attempt (connection errors, throttling, 5xx, no
    # answer), and after a range's body breaks off (each resumes after the last good byte).
    retries: int = Field(default=5, ge=0, le=20)
    # The deadline model (README "Deadlines"): connecting; S3's answer to a request over
    # all its attempts (each attempt waits a third of it, so a silent endpoint is tried
    # three times, each retry logged); a body's speed. A body that keeps moving is never
    # cut for taking long: a 64 MiB part at 3 MB/s takes 22 s, and that is fine.
    connect_timeout_seconds: float = Field(default=10.0, gt=0, le=600)
    first_byte_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    # A GET that moves less than low_speed_limit bytes/s over low_speed_seconds is cut
    # and resumed, so one slow connection never stalls a pull.
    low_speed_limit: ByteSize = Field(default=ByteSize(1024**2), ge=0)
    low_speed_seconds: float = Field(default=3.0, ge=0.1, le=600)

    @property
    def attempt_timeout_seconds(self) -> float:
        """Longest one attempt waits for S3's bytes: a third of the first-byte deadline."""
        return self.first_byte_timeout_seconds / ATTEMPTS_PER_DEADLINE


def _check_size_or_percent(value: object) -> object:
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        parse_size_or_percent(value)  # raises ValueError with the reason
    return value


# "40%" (of RAM for shm, of the filesystem for disk) or a size: "200GiB", "500000000".
SizeOrPercent = Annotated[str, BeforeValidator(_check_size_or_percent)]


def parse_size_or_percent(spec: str) -> tuple[float, int]:
    """(fraction, bytes): exactly one of them is non-zero... or both zero for "0"."""
    text = spec.strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise ValueError(f"{spec!r} is not a percentage like '40%'") from None
        if not 0 <= percent <= 100:
            raise ValueError(f"{spec!r} must be between 0% and 100%")
        return percent / 100, 0
    try:
        return 0.0, int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise ValueError(f"{spec!r} is neither a size like '200GiB' nor a percentage") from None


class TierSettings(BaseModel):
    """Where each cache tier keeps its files, and how much it may hold."""

    model_config = {"extra": "forbid"}

    shm_root: Path = Path("/dev/shm/prewarm")
    disk_root: Path = Path("/var/lib/prewarm")
    # Most the cache may hold: a size, or a percentage of RAM (shm) / of the filesystem (disk).
    shm_budget: SizeOrPercent = "50%"
    disk_budget: SizeOrPercent = "80%"
    # Free space always left on the tier's filesystem (size or % of the filesystem).
    shm_reserve: SizeOrPercent = "1GiB"
    disk_reserve: SizeOrPercent = "5%"
    # Eviction starts when a tier holds more than high x budget and stops at low x budget.
    high_watermark: float = Field(default=0.9, gt=0, le=1)
    low_watermark: float = Field(default=0.8, gt=0, le=1)
    # If the hinted tier cannot hold a model even after eviction, use the other one.
    fallback: bool = True
    # The only group that may pass through the roots to a snapshot it was handed (roots 0710);
    # empty: anyone may pass (0711), and a snapshot's unguessable path is the only key.
    group: str = ""

    @model_validator(mode="after")
    def _watermarks_in_order(self) -> TierSettings:
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must not exceed high_watermark "
                f"({self.high_watermark})"
            )
        return self


class LeaseSettings(BaseModel):
    """Leases keep a snapshot from being evicted while a pod uses it."""

    model_config = {"extra": "forbid"}

    # Where clients hold leases open (a connection per lease; we read SO_PEERCRED).
    # Unset (or empty): lease.sock next to the API socket, so one mounted directory has both.
    socket_path: Annotated[Path | None, BeforeValidator(_empty_to_none)] = None
    # TTL of a lease nobody holds open, unless the request asks for another.
    default_ttl_seconds: float = Field(default=60.0, gt=0)
    # Longest TTL a request may ask for (longer ones are clamped).
    max_ttl_seconds: float = Field(default=24 * 3600.0, gt=0)
    # Live leases one requesting socket may have, and leases one uid may hold open:
    # excess is RESOURCE_EXHAUSTED, so no client can grow the table without bound.
    max_per_peer: int = Field(default=256, ge=1, le=100_000)


class CompileCacheSettings(BaseModel):
    """torch.compile caches kept per node and shared across nodes through S3."""

    model_config = {"extra": "forbid"}

    # s3://bucket/prefix where packed caches are restored from and uploaded to; unset: local only.
    uri: OptionalText = None
    # Upload a key's directory once it has been quiet (no new files) this long.
    quiet_seconds: float = Field(default=30.0, gt=0)
    # Watch key directories and upload what pods produce.
    upload: bool = True
    # A restore that takes longer is abandoned: the pod gets an empty directory and compiles.
    restore_timeout_seconds: float = Field(default=120.0, gt=0)
    # Keys one compile domain (a tenant, or the node) may hold on this node; a new key
    # past it is RESOURCE_EXHAUSTED. Bounds directories, inotify watches and S3 reads.
    max_keys_per_domain: int = Field(default=128, ge=1, le=100_000)
    # Longest a CompileLock waiter waits for the holder; then it is let go without the
    # lock (and compiles on its own) rather than wait forever.
    lock_wait_seconds: float = Field(default=600.0, gt=0)
    # How long a miss waits for S3 to list the other keys of its model (why-miss) before
    # it is explained with this node's keys alone.
    why_timeout_seconds: float = Field(default=5.0, gt=0, le=120)
    # A key is uploaded at most once this often (a push or the watcher sooner waits): tiny
    # changes pushed again and again would each cost an archive PUT and, every few, a
    # compaction that downloads them all.
    min_upload_interval_seconds: float = Field(default=60.0, ge=0, le=86400)
    # Ed25519 private key (PEM, mode 0600) this node signs its uploads with; unset: its
    # uploads go unsigned, and nodes that require signatures will not restore them.
    signing_key: Annotated[Path | None, BeforeValidator(_empty_to_none)] = None
    # Public keys (PEM files, or directories of *.pub) whose signatures a restore trusts.
    trusted_keys: list[Path] = Field(default_factory=list, max_length=256)
    # Restore caches nobody signed (the migration from agents that did not sign). Off:
    # a compile cache is code every node runs, and a refused one costs only a compile.
    accept_unsigned: bool = False


class MetricsSettings(BaseModel):
    """Prometheus metrics over HTTP; off unless a port is set."""

    model_config = {"extra": "forbid"}

    # 0 disables the HTTP endpoint.
    port: int = Field(default=0, ge=0, le=65535)
    # Loopback by default: metrics are for the node's own scraper.
    address: str = "127.0.0.1"


class ManifestSettings(BaseModel):
    """Prefetch manifests: models a node should hold, listed in TOML files."""

    model_config = {"extra": "forbid"}

    directory: Path = Path("/etc/prewarm/models.d")
    # Pulls started from manifests at the same time.
    concurrency: int = Field(default=2, ge=1, le=64)


class IntegritySettings(BaseModel):
    """Checks run before a snapshot is published."""

    model_config = {"extra": "forbid"}

    # Validate the header of every *.safetensors file.
    safetensors_headers: bool = True
    # Compare objects' full-object S3 checksums (ChecksumMode) when they have them;
    # costs one HEAD per object and one read of the file.
    s3_checksums: bool = True


# The [access] section: source allowlist, tenant sockets, limits.


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


def _printable(value: str) -> str:
    if not value.isprintable():
        raise ValueError("must be printable text (no control characters)")
    return value


# An identity or issuer: printable (handles and logs echo it), as long as a workload's
# URI gets.
SigstoreText = Annotated[str, Field(min_length=1, max_length=512), AfterValidator(_printable)]


class ModelSignatureSettings(BaseModel):
    """A signature the models of some sources must carry to be published (OpenSSF
    model signing; the signatures extra)."""

    model_config = {"extra": "forbid"}

    # The sources it applies to (the patterns of [access] sources).
    sources: SourcePatterns
    # "key": the publisher's elliptic-curve public key (PEM) in public_key;
    # "certificate": the chain (PEM files) its signing certificate must chain to;
    # "sigstore": a Sigstore bundle, verified offline against trust_root, signed by
    # identity as oidc_issuer vouched for it.
    method: Literal["key", "certificate", "sigstore"] = "key"
    public_key: Annotated[Path | None, BeforeValidator(_empty_to_none)] = None
    certificates: list[Path] = Field(default_factory=list, max_length=16)
    # A Sigstore client trust config or trusted_root.json (root-owned, read at start).
    trust_root: Annotated[Path | None, BeforeValidator(_empty_to_none)] = None
    # The signer's identity as its certificate names it (an email, or a workload's URI)
    # and the OIDC issuer that vouched for it; both must match exactly.
    identity: Annotated[SigstoreText | None, BeforeValidator(_empty_to_none)] = None
    oidc_issuer: Annotated[SigstoreText | None, BeforeValidator(_empty_to_none)] = None
    # The signature's file name in the model's prefix.
    signature: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,255}$")] = "model.sig"

    @model_validator(mode="after")
    def _has_what_its_method_needs(self) -> ModelSignatureSettings:
        if not self.sources:
            raise ValueError("a model signature needs the sources it applies to")
        if self.method == "key" and self.public_key is None:
            raise ValueError('method "key" needs public_key (the publisher\'s PEM public key)')
        if self.method == "certificate" and not self.certificates:
            raise ValueError('method "certificate" needs certificates (the chain, PEM files)')
        if self.method == "sigstore":
            _has_what_sigstore_needs(self)
        return self


def _has_what_sigstore_needs(entry: ModelSignatureSettings) -> None:
    missing = [
        f"{name} ({what})"
        for name, what, value in (
            ("trust_root", "the Sigstore trust root's JSON file", entry.trust_root),
            ("identity", "the signer's email or workload URI", entry.identity),
            ("oidc_issuer", "the OIDC issuer that vouched for it", entry.oidc_issuer),
        )
        if value is None
    ]
    if missing:
        needed = f"{', '.join(missing[:-1])} and {missing[-1]}" if len(missing) > 1 else missing[0]
        raise ValueError(f'method "sigstore" needs {needed}')


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
    # Most of each tier this tenant's leases may hold (a fraction of the tier's ceiling),
    # so a tenant that keeps re-leasing cannot keep the others out. "fair": an equal
    # share, 1 / the number of tenant sockets.
    tier_share: Annotated[float, Field(gt=0, le=1)] | Literal["fair"] = "fair"
    # The domain's own signing key and trusted keys, in place of [compile_cache]'s
    # (one key per tenant domain); unset: the node's.
    compile_signing_key: Annotated[Path | None, BeforeValidator(_empty_to_none)] = None
    compile_trusted_keys: list[Path] | None = Field(default=None, max_length=256)
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
    # Sources whose models must carry a verified signature before they are published.
    model_signatures: list[ModelSignatureSettings] = Field(default_factory=list, max_length=64)
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


def _absolute(path: Path) -> Path:
    if not path.is_absolute():
        raise ValueError(f"{path} is not an absolute path")
    return path


AbsolutePath = Annotated[Path, AfterValidator(_absolute)]
# A Kubernetes namespace or service account name (an RFC 1123 label / subdomain).
_KUBERNETES_NAME = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
KubernetesNames = list[Annotated[str, Field(pattern=_KUBERNETES_NAME)]]


class CsiTenantSettings(BaseModel):
    """Which pods a CSI volume serves as which tenant: by namespace, and service account."""

    model_config = {"extra": "forbid"}

    # The [[access.sockets]] entry (its name) whose socket the volume's requests go to, so
    # the agent checks them as that tenant's; "node": the API socket (every source the
    # node allows; no socket volumes).
    tenant: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
    namespaces: KubernetesNames = Field(min_length=1, max_length=1024)
    # Empty: every service account in those namespaces.
    service_accounts: KubernetesNames = Field(default_factory=list, max_length=1024)


class CsiSettings(BaseModel):
    """The CSI node plugin (``prewarm-csi``): pods get models through csi volumes."""

    model_config = {"extra": "forbid"}

    driver_name: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")] = (
        "csi.prewarm.io"
    )
    # Where the kubelet (through node-driver-registrar) reaches the plugin.
    endpoint: AbsolutePath = Path("/var/lib/kubelet/plugins/csi.prewarm.io/csi.sock")
    # Target paths must lie under <kubelet_dir>/pods/.
    kubelet_dir: AbsolutePath = Path("/var/lib/kubelet")
    # One record per published volume (its target, its snapshot): what a restart picks up.
    state_dir: AbsolutePath = Path("/var/lib/prewarm-csi")
    # The node's name as the kubelet knows it; empty: this host's name.
    node_id: str = Field(default="", max_length=256)
    tenants: list[CsiTenantSettings] = Field(default_factory=list, max_length=256)


class Settings(BaseSettings):
    """Every setting of the agent and the CLI, with its effective value."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=NESTED_DELIMITER,
        extra="forbid",
        validate_default=True,
    )

    socket_path: Path = Path("/run/prewarm/agent.sock")
    # Mode of the socket file; group members may call the agent.
    socket_mode: Annotated[FileMode, AfterValidator(check_api_socket_mode)] = 0o660
    # Group that owns the socket (name); empty keeps the daemon's group.
    socket_group: str = ""
    # Tier for requests that give no hint.
    default_tier: TierName = "shm"
    # Serve the newest cached snapshot of a URI when S3 cannot be reached...
    offline_fallback: bool = True
    # ...or has not answered the listing within this many seconds.
    offline_after_seconds: float = Field(default=2.0, gt=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Seconds a SIGTERM waits for RPCs to finish before cancelling them.
    shutdown_grace_seconds: float = Field(default=10.0, ge=0)
    tiers: TierSettings = TierSettings()
    leases: LeaseSettings = LeaseSettings()
    integrity: IntegritySettings = IntegritySettings()
    compile_cache: CompileCacheSettings = CompileCacheSettings()
    metrics: MetricsSettings = MetricsSettings()
    manifests: ManifestSettings = ManifestSettings()
    s3: S3Settings = S3Settings()
    access: AccessSettings = AccessSettings()
    csi: CsiSettings = CsiSettings()

    @model_validator(mode="after")
    def _csi_tenants_are_sockets(self) -> Settings:
        names = {entry.name for entry in self.access.sockets} | {"node"}
        scoped = {entry.name for entry in self.access.sockets if entry.requester_scoped}
        for entry in self.csi.tenants:
            if entry.tenant not in names:
                raise ValueError(
                    f"[[csi.tenants]] names tenant {entry.tenant!r}, which no [[access.sockets]] "
                    f"entry has (known: {', '.join(sorted(names))}); add the socket or fix the name"
                )
            if entry.tenant in scoped:
                raise ValueError(
                    f"[[csi.tenants]] names tenant {entry.tenant!r}, whose socket is "
                    "requester_scoped: every request there must carry the pod's own AWS "
                    "credentials, which the CSI plugin does not have; map these namespaces to a "
                    "socket that is not requester_scoped"
                )
        return self

    @property
    def lease_socket_path(self) -> Path:
        return self.leases.socket_path or self.socket_path.parent / "lease.sock"

    @classmethod
    def settings_customise_sources(  # noqa: PLR0917  (pydantic-settings calls it so)
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's values arrive as init arguments (see load_settings) and
        # the environment must win over them, so env goes first.
        return (env_settings, init_settings)


def config_path_from_env(explicit: Path | None = None) -> tuple[Path, bool]:
    """The config file to read, and whether the user named it explicitly."""
    if explicit is not None:
        return explicit, True
    from_env = os.environ.get(CONFIG_PATH_ENV)
    if from_env:
        return Path(from_env), True
    return DEFAULT_CONFIG_PATH, False


def load_settings(config_path: Path | None = None) -> Settings:
    """Build the effective settings; raise ConfigError naming the culprit."""
    path, explicit = config_path_from_env(config_path)
    file_values: dict[str, Any] = {}
    if path.exists():
        try:
            file_values = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"Cannot read config file {path}: {exc}. Fix or remove it.") from exc
    elif explicit:
        raise ConfigError(
            f"Config file {path} does not exist. Create it, or unset {CONFIG_PATH_ENV} / --config "
            "to run on defaults."
        )
    try:
        return Settings(**file_values)
    except SettingsError as exc:
        raise ConfigError(_environment_problem(exc)) from exc
    except ValidationError as exc:
        problems = config_problems(exc, path, os.environ)
        raise ConfigError(f"Invalid configuration: {'; '.join(problems)}.") from exc


# -- validation errors in the project's words --
#
# pydantic speaks of "Extra inputs are not permitted" and of union members such as
# "constrained-int"; an operator needs the setting's name, where its value came
# from (which file, which variable), what it must be, and the name they probably
# meant. Each error becomes one sentence of that shape.

# Settings that existed once, each with what to set instead.
REMOVED_SETTINGS: dict[tuple[str, ...], str] = {
    ("s3", "read_timeout_seconds"): (
        "each attempt now waits a third of s3.first_byte_timeout_seconds: set that instead"
    ),
    ("s3", "request_timeout_ms"): (
        "renamed s3.low_speed_seconds, in seconds (request_timeout_ms = 3000 is "
        "low_speed_seconds = 3)"
    ),
    ("s3", "max_attempts"): "renamed s3.retries (the same count: retries after the first attempt)",
    ("s3", "range_retries"): (
        "s3.retries counts the retries of every request and of every range: set that instead"
    ),
    ("s3", "io_block"): (
        "removed, with nothing to set instead: the read step is fixed at 4 MiB (64 KiB to "
        "4 MiB made no measured difference)"
    ),
}

# What a union member's error asks for, as the noun after "must be".
_WANTED: dict[str, str] = {
    "int_parsing": "a whole number",
    "int_type": "a whole number",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "text",
    "list_type": "a list",
    "dict_type": "a table",
    "model_type": "a table",
    "path_type": "a path",
    "byte_size_unit": "a size such as 4MiB",
    "byte_size": "a size such as 4MiB",
}
_BOUNDS = {
    "greater_than": "more than {gt}",
    "greater_than_equal": "at least {ge}",
    "less_than": "less than {lt}",
    "less_than_equal": "at most {le}",
    "too_long": "at most {max_length} long",
    "too_short": "at least {min_length} long",
    "string_pattern_mismatch": "text matching {pattern}",
    "literal_error": "{expected}",
}
# Union members show in an error's location ("constrained-int", "literal['auto']").
_MEMBER_TAG = re.compile(r"[\[\]'\-]|^(int|float|str|bool|none|list|dict|bytes)$")


def config_problems(exc: ValidationError, path: Path, environ: Mapping[str, str]) -> list[str]:
    """One sentence per setting ``exc`` refuses: its name, its source, what it must be."""
    by_setting: dict[tuple[str | int, ...], list[Any]] = {}
    for error in exc.errors():
        where = tuple(part for part in error["loc"] if not _is_member_tag(part))
        by_setting.setdefault(where, []).append(error)
    return [_problem(where, errors, path, environ) for where, errors in by_setting.items()]


def _is_member_tag(part: str | int) -> bool:
    return isinstance(part, str) and _MEMBER_TAG.search(part) is not None


def _problem(
    where: tuple[str | int, ...], errors: list[Any], path: Path, environ: Mapping[str, str]
) -> str:
    name = _dotted(where)
    source = _source_of(where, path, environ)
    first = errors[0]
    if first["type"] == "extra_forbidden":
        return f"{name} ({source}) is not a setting: {_instead(where)}"
    if first["type"] == "missing":
        return f"{name} ({source}) is required"
    shown = _shown_value(first.get("input"))
    custom = [e["msg"].removeprefix("Value error, ") for e in errors if e["type"] == "value_error"]
    if custom:
        return f"{name} ({source}) = {shown}: {' '.join(custom)}"
    wanted = " or ".join(dict.fromkeys(_wanted(e) for e in errors))
    return f"{name} ({source}) = {shown}: must be {wanted}"


def _wanted(error: Any) -> str:
    if error["type"] in _WANTED:
        return _WANTED[error["type"]]
    bound = _BOUNDS.get(error["type"])
    if bound is not None:
        try:
            context = {key: _plain(value) for key, value in error.get("ctx", {}).items()}
            return bound.format(**context)
        except (KeyError, IndexError):
            pass
    return str(error["msg"]).removeprefix("Input should be ")


def _plain(value: object) -> object:
    """0.0 as 0: a bound as the operator would write it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _dotted(where: tuple[str | int, ...]) -> str:
    text = ""
    for part in where:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or "the configuration"


def _source_of(where: tuple[str | int, ...], path: Path, environ: Mapping[str, str]) -> str:
    """The variable that set ``where`` (or a table above it), else the file."""
    upper = {name.upper(): name for name in environ}
    keys = [part for part in where if isinstance(part, str)]
    for depth in range(len(keys), 0, -1):
        variable = ENV_PREFIX + NESTED_DELIMITER.join(keys[:depth]).upper()
        if variable in upper:
            return f"from {upper[variable]}"
    return f"in {path}"


def _instead(where: tuple[str | int, ...]) -> str:
    """What to write instead of a key no setting has: its replacement, or the likely name."""
    keys = tuple(part for part in where if isinstance(part, str))
    if keys in REMOVED_SETTINGS:
        return f"it was removed; {REMOVED_SETTINGS[keys]}"
    known = _fields_at(where[:-1])
    close = difflib.get_close_matches(str(where[-1]), known, n=1, cutoff=0.6)
    if close:
        return f"did you mean {_dotted((*where[:-1], close[0]))}?"
    table = _dotted(where[:-1]) if len(where) > 1 else "the top level"
    return f"{table} takes {', '.join(sorted(known))}"


def _fields_at(where: tuple[str | int, ...]) -> list[str]:
    """The setting names of the table at ``where`` (list indices step into the item)."""
    model: type[BaseModel] = Settings
    for part in where:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        inner = _model_in(field.annotation) if field is not None else None
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = _model_in(argument)
        if found is not None:
            return found
    return None


def _shown_value(value: object) -> str:
    """A value as the operator wrote it, cut short and without control characters."""
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    text = "".join(ch if ch.isprintable() else "?" for ch in text)
    return text if len(text) <= 60 else text[:57] + "..."


def _environment_problem(exc: SettingsError) -> str:
    """pydantic-settings could not decode a PREWARM_* variable: which, and how to write it."""
    # Its message names the top-level field ('error parsing value for field "access" ...').
    field = re.search(r'field "(\w+)"', str(exc))
    prefix = f"{ENV_PREFIX}{field[1].upper()}" if field else ENV_PREFIX
    names = sorted(name for name in os.environ if name.upper().startswith(prefix))
    return (
        f"Cannot read the PREWARM_* environment ({', '.join(names) or exc}): a list or a table "
        "in a PREWARM_* variable is written as JSON, e.g. "
        """PREWARM_ACCESS__SOCKETS='[{"name": "team-a", "path": "/run/prewarm/team-a.sock"}]' """
        "(access.sources also takes comma-separated patterns)."
    )


def unknown_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """A sentence for each PREWARM_* variable no setting reads (prewarmd warns with them)."""
    return unknown_env_vars(Settings, os.environ if environ is None else environ)


def render_toml(settings: Settings) -> str:
    """The effective settings as a TOML document that load_settings accepts."""
    lines: list[str] = []
    _toml_table(lines, "", settings.model_dump(mode="json"))
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_table(lines: list[str], name: str, values: dict[str, Any]) -> None:
    """Scalars first, then sub-tables, then arrays of tables (TOML's required order)."""
    tables = {k: v for k, v in values.items() if isinstance(v, dict)}
    arrays = {
        k: v for k, v in values.items() if isinstance(v, list) and v and isinstance(v[0], dict)
    }
    lines.extend(
        _toml_line(key, value)
        for key, value in values.items()
        if key not in tables and key not in arrays
    )
    for key, table in tables.items():
        lines.append(f"\n[{name}{key}]")
        _toml_table(lines, f"{name}{key}.", table)
    for key, items in arrays.items():
        for item in items:
            lines.append(f"\n[[{name}{key}]]")
            _toml_table(lines, f"{name}{key}.", item)


def _toml_line(name: str, value: object) -> str:
    if value is None:
        return f"# {name} is unset"
    return f"{name} = {_toml_value(value)}"


def _toml_value(value: object) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
