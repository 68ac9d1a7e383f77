"""The manifest file format: a TOML array of ``[[model]]`` tables, read with line numbers.

::

    [[model]]
    uri = "s3://models/llama-3-8b/"
    tier = "shm"            # optional; the agent's default_tier otherwise
    pin = true              # optional; never evicted by pressure while listed
    include = ["*.safetensors", "*.json"]
    exclude = ["original/*"]

    [model.compile]         # optional: compile-cache key parts to restore too
    engine = "vllm"
    engine_version = "0.9.1"

``read_manifest`` turns one file into ``ManifestEntry`` values or raises
``ManifestError`` naming the file and the line, so an operator can fix a
ConfigMap from the log alone (the format is in docs/manifests.md). A file over
``MAX_MANIFEST_BYTES`` is refused before it is read: a list of models is a few
KiB, and parsing a 300 MB file would take the daemon's memory with it.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agent._exceptions import InvalidRequest
from agent._snapshot import check_globs
from agent._uri import parse_uri
from agent._vocabulary import TierName
from agent.compile.keys import CompileKeyParts, normalise_parts

__all__ = [
    "MAX_MANIFEST_BYTES",
    "CompileSpec",
    "Identity",
    "ManifestEntry",
    "ManifestError",
    "read_manifest",
]

# A thousand entries take about 100 KiB; ten times that is plenty.
MAX_MANIFEST_BYTES = 1024 * 1024

_TOML_LINE = re.compile(r"at line (\d+)")
_ENTRY_HEADER = re.compile(r"^\s*\[\[\s*model\s*\]\]")
_SCHEMA_HINT = (
    " Each [[model]] takes uri and optionally tier, pin, include, exclude, strict_tier and "
    "a [model.compile] table; see docs/manifests.md."
)

# (uri, include, exclude): what a snapshot key is made of, less the objects.
Identity = tuple[str, tuple[str, ...], tuple[str, ...]]


class ManifestError(InvalidRequest):
    """A manifest file cannot be used; ``path`` and ``line`` say where (line 0: unknown)."""

    def __init__(self, message: str, *, path: Path, line: int) -> None:
        """``message`` says what is wrong; ``path`` and ``line`` where."""
        super().__init__(message)
        self.path = path
        self.line = line


class CompileSpec(BaseModel):
    """Compile-cache key parts; the model's snapshot key is added when it is known."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: str = ""
    engine_version: str = ""
    torch_version: str = ""
    triton_version: str = ""
    cuda_version: str = ""
    gpu_name: str = ""
    tensor_parallel: int = Field(default=0, ge=0)
    pipeline_parallel: int = Field(default=0, ge=0)
    data_parallel: int = Field(default=0, ge=0)
    config_hash: str = ""
    extras: dict[str, str] = Field(default_factory=dict)
    # The compile domain to restore it into (a tenant's compile_domain); empty: the node's.
    # Not a key part: the same key lives once per domain.
    domain: str = ""

    def key_parts(self) -> dict[str, Any]:
        """The fields that are compile-cache key parts (everything but ``domain``)."""
        return self.model_dump(exclude={"domain"})


class _EntrySchema(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str
    tier: TierName | None = None
    pin: bool = False
    include: list[str] = Field(default_factory=list)
    exclude: list[str] = Field(default_factory=list)
    strict_tier: bool = False
    compile: CompileSpec | None = None

    @field_validator("uri")
    @classmethod
    def _valid_uri(cls, value: str) -> str:
        try:
            return str(parse_uri(value))
        except InvalidRequest as exc:
            raise ValueError(str(exc)) from exc

    @field_validator("include", "exclude")
    @classmethod
    def _valid_globs(cls, value: list[str]) -> list[str]:
        try:
            return list(check_globs(value, what="A glob"))
        except InvalidRequest as exc:
            raise ValueError(str(exc)) from exc

    @field_validator("compile")
    @classmethod
    def _valid_compile(cls, value: CompileSpec | None) -> CompileSpec | None:
        # The compile cache's own rules (torch_version required, known engine...),
        # so a bad table is reported with its line now, not when the model is cached.
        if value is not None:
            try:
                normalise_parts(CompileKeyParts(**value.key_parts()))
            except InvalidRequest as exc:
                raise ValueError(str(exc)) from exc
        return value


class _FileSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: list[_EntrySchema] = Field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """One model a manifest asks for, and where it was written."""

    uri: str
    tier: TierName | None
    pin: bool
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    strict_tier: bool
    compile: CompileSpec | None
    # Where the entry is written, for the log; not part of what it asks for.
    path: Path = field(compare=False)
    line: int = field(compare=False)

    @property
    def identity(self) -> Identity:
        """What names the snapshot the entry asks for: URI, include and exclude."""
        return (self.uri, self.include, self.exclude)

    @property
    def where(self) -> str:
        """``path:line``, for the log."""
        return f"{self.path}:{self.line}"

    def pinned(self) -> ManifestEntry:
        """The same entry asking for a pin (a model listed twice is pinned if any listing pins)."""
        return replace(self, pin=True)


def read_manifest(path: Path) -> tuple[ManifestEntry, ...]:
    """The entries of one manifest file; ManifestError says what is wrong and where."""
    try:
        # O_NONBLOCK: a FIFO swapped in for the file must not hang the reader.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(descriptor, "rb") as file:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode):
                raise OSError(f"{path} is not a regular file")
            if status.st_size > MAX_MANIFEST_BYTES:
                raise _too_large(path, status.st_size)
            # Read one byte past the cap: the file may grow after the fstat.
            raw = file.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise _too_large(path, len(raw))
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(
            f"Cannot read manifest {path}: {exc}. Fix its permissions or encoding (UTF-8).",
            path=path,
            line=0,
        ) from exc
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = _TOML_LINE.search(str(exc))
        # tomllib (3.11) puts the position in the message only: "at line 3, column 5"
        # or "at end of document".
        line = int(found[1]) if found else len(text.splitlines())
        raise ManifestError(
            f"Manifest {path}, line {line}: not valid TOML: {exc}.", path=path, line=line
        ) from exc
    try:
        parsed = _FileSchema.model_validate(document)
    except ValidationError as exc:
        raise _schema_error(path, text, exc) from exc
    headers = _entry_lines(text)
    return tuple(
        ManifestEntry(
            uri=entry.uri,
            tier=entry.tier,
            pin=entry.pin,
            include=tuple(entry.include),
            exclude=tuple(entry.exclude),
            strict_tier=entry.strict_tier,
            compile=entry.compile,
            path=path,
            line=headers[index] if index < len(headers) else 0,
        )
        for index, entry in enumerate(parsed.model)
    )


def _too_large(path: Path, size: int) -> ManifestError:
    return ManifestError(
        f"Manifest {path} is {size} bytes, over the limit of {MAX_MANIFEST_BYTES} bytes "
        "(1 MiB); it was not read. Split it into several files in the directory.",
        path=path,
        line=0,
    )


def _schema_error(path: Path, text: str, exc: ValidationError) -> ManifestError:
    """The first schema problem, with its line and the key path (``model[1].tier``)."""
    error = exc.errors()[0]
    location = error["loc"]
    line = _line_of(text, location)
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in location).lstrip(".")
    extra = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
    hint = _SCHEMA_HINT if error["type"] in ("extra_forbidden", "missing") else ""
    return ManifestError(
        f"Manifest {path}, line {line}: {where}: {_describe(error)}{extra}.{hint}",
        path=path,
        line=line,
    )


def _describe(error: Mapping[str, Any]) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown key"
    if error["type"] == "missing":
        return "required key missing"
    message = str(error["msg"])
    return message.removeprefix("Value error, ").rstrip(".")


def _entry_lines(text: str) -> list[int]:
    """1-based line of each ``[[model]]`` header, in order."""
    return [n for n, line in enumerate(text.splitlines(), 1) if _ENTRY_HEADER.match(line)]


def _line_of(text: str, location: Sequence[int | str]) -> int:
    """Best guess at the line a schema error points to (0 when nothing matches).

    tomllib keeps no positions, so the entry is found by counting ``[[model]]``
    headers, and the key by its ``name =`` line inside the entry.
    """
    lines = text.splitlines()
    start, end = 0, len(lines)
    rest = list(location)
    if len(rest) >= 2 and rest[0] == "model" and isinstance(rest[1], int):
        headers = [line - 1 for line in _entry_lines(text)]
        if rest[1] < len(headers):
            start = headers[rest[1]]
            end = headers[rest[1] + 1] if rest[1] + 1 < len(headers) else len(lines)
        rest = rest[2:]
    found = start + 1 if start or location[:1] == ("model",) else 0
    for name in (part for part in rest if isinstance(part, str)):
        key = re.compile(rf"^\s*\[*\s*(model\.)?[\"']?{re.escape(name)}[\"']?\s*(=|\])")
        for number in range(start, end):
            if key.match(lines[number]):
                found, start = number + 1, number
                break
    return found
