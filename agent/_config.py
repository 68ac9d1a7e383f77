"""Typed settings: defaults < /etc/prewarm/agent.toml < PREWARM_* environment."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ByteSize, Field, PlainSerializer, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ._exceptions import InvalidRequest

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "ConfigError",
    "S3Settings",
    "Settings",
    "TierSettings",
    "load_settings",
    "render_toml",
]

DEFAULT_CONFIG_PATH = Path("/etc/prewarm/agent.toml")
CONFIG_PATH_ENV = "PREWARM_CONFIG"

TierName = Literal["shm", "disk"]


class ConfigError(InvalidRequest):
    """The configuration file or a PREWARM_* variable is invalid."""


def _parse_mode(value: object) -> object:
    if isinstance(value, str):
        return int(value, 8)
    return value


def _empty_to_none(value: object) -> object:
    return None if value == "" else value


OptionalText = Annotated[str | None, BeforeValidator(_empty_to_none)]

FileMode = Annotated[
    int,
    BeforeValidator(_parse_mode),
    Field(ge=0, le=0o777),
    PlainSerializer(lambda mode: f"{mode:04o}", return_type=str),
]


class S3Settings(BaseModel):
    """How the agent talks to S3. Credentials come from the standard AWS chain."""

    model_config = {"extra": "forbid"}

    # Unset: botocore's own resolution (AWS_ENDPOINT_URL, config files, AWS default).
    endpoint_url: OptionalText = None
    region: OptionalText = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    # Parallel ranged GETs per pull; memory is about concurrency x io_block.
    concurrency: int = Field(default=16, ge=1, le=512)
    # Size of each ranged GET.
    chunk_size: ByteSize = Field(default=ByteSize(64 * 1024**2), ge=1024**2)
    # Bytes gathered from a response body before one positional write.
    io_block: ByteSize = Field(default=ByteSize(4 * 1024**2), ge=64 * 1024)
    # botocore's attempts per request (connection errors, throttling, 5xx).
    max_attempts: int = Field(default=5, ge=1, le=20)
    # Extra attempts per range when a response body breaks off mid-stream.
    range_retries: int = Field(default=5, ge=0, le=20)
    connect_timeout_seconds: float = Field(default=10.0, gt=0)
    read_timeout_seconds: float = Field(default=60.0, gt=0)


class TierSettings(BaseModel):
    """Where each cache tier keeps its files."""

    model_config = {"extra": "forbid"}

    shm_root: Path = Path("/dev/shm/prewarm")
    disk_root: Path = Path("/var/lib/prewarm")


class Settings(BaseSettings):
    """Every setting of the agent and the CLI, with its effective value."""

    model_config = SettingsConfigDict(
        env_prefix="PREWARM_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    socket_path: Path = Path("/run/prewarm/agent.sock")
    # Mode of the socket file; group members may call the agent.
    socket_mode: FileMode = 0o660
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
    s3: S3Settings = S3Settings()

    @classmethod
    def settings_customise_sources(
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
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(
            f"Invalid configuration (file {path}, PREWARM_* environment): {problems}."
        ) from exc


def render_toml(settings: Settings) -> str:
    """The effective settings as a TOML document that load_settings accepts."""
    data = settings.model_dump(mode="json")
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    for name, value in data.items():
        if isinstance(value, dict):
            tables.append((name, value))
        else:
            lines.append(_toml_line(name, value))
    for table, values in tables:
        lines.append(f"\n[{table}]")
        lines.extend(_toml_line(name, value) for name, value in values.items())
    return "\n".join(lines) + "\n"


def _toml_line(name: str, value: object) -> str:
    if value is None:
        return f"# {name} is unset"
    return f"{name} = {_toml_value(value)}"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
