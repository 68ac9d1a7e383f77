"""What the client hands back for compile caches: plain, frozen values."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from agent.compile.keys import CompileKeyParts

__all__ = [
    "CompileCacheHandle",
    "CompileCacheInfo",
    "CompileCachePush",
    "CompileEvictResult",
    "CompileKeyParts",
    "CompileLockGrant",
    "CompileReady",
    "CompileVerdict",
]


@dataclass(frozen=True, slots=True)
class CompileCacheHandle:
    """A compile-cache directory on this node and the env vars that point an engine at it.

    Apply ``env`` before the engine imports torch (``handle.apply()`` sets it in
    ``os.environ``), or pass it to the engine's process.
    """

    key: str
    path: Path
    env: dict[str, str]
    # True when this request restored the directory from S3, and how long that took.
    restored: bool
    restore_seconds: float
    # Why a restore was not used (nothing uploaded yet, a refused archive...).
    restore_note: str
    parts: CompileKeyParts
    bytes: int
    file_count: int

    def apply(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Set ``env`` in ``environ`` (default ``os.environ``)."""
        (os.environ if environ is None else environ).update(self.env)


@dataclass(frozen=True, slots=True)
class CompileVerdict:
    """Whether a launch reused its compile cache: ``hit``, ``partial miss`` or ``miss``."""

    verdict: str
    # Sub-cache (inductor, triton, vllm...) -> (files added, bytes added); only those that grew.
    grown: dict[str, tuple[int, int]]
    at: datetime | None
    client_name: str

    def describe(self) -> str:
        """One line, e.g. ``partial miss: inductor +3 files (120 kB)``."""
        if not self.grown:
            return "hit: nothing compiled" if self.verdict == "hit" else self.verdict
        growth = ", ".join(
            f"{sub} +{files} files ({size} B)" for sub, (files, size) in sorted(self.grown.items())
        )
        return f"{self.verdict}: {growth}"


@dataclass(frozen=True, slots=True)
class CompileCacheInfo:
    """A compile cache on the node, as ``prewarm compile ls`` lists it."""

    key: str
    path: Path
    parts: CompileKeyParts
    bytes: int
    file_count: int
    created: datetime
    last_used: datetime
    # Content digest of the last upload or restore ("" if none), and when.
    uploaded_digest: str
    uploaded: datetime | None
    restored: bool
    # The last launch that reported ready (None before any did).
    last_verdict: CompileVerdict | None = None
    # Uploaded only when a launch reports ready, never when quiet.
    publish_on_ready: bool = False
    # The compile domain it belongs to (a tenant's, or "node").
    domain: str = ""


@dataclass(frozen=True, slots=True)
class CompileEvictResult:
    evicted: tuple[CompileCacheInfo, ...]
    bytes_freed: int


@dataclass(frozen=True, slots=True)
class CompileCachePush:
    """What a push did: uploaded, or why not."""

    uploaded: bool
    uri: str
    digest: str
    # Bytes of the archive uploaded (0 when skipped).
    bytes: int
    skipped_reason: str = ""


@dataclass(frozen=True, slots=True)
class CompileReady:
    """A launch's verdict and the upload that followed it."""

    key: str
    verdict: CompileVerdict
    upload: CompileCachePush


@dataclass(frozen=True, slots=True)
class CompileLockGrant:
    """The node's compile lock for a key, as granted to this caller."""

    key: str
    # True when the directory already held artifacts when the lock was granted:
    # the compile will mostly hit the cache.
    warm: bool
    # True when another pod held the lock first and this caller waited.
    waited: bool
    # False when this caller was let go without the lock because the cache
    # became warm while it waited (the holder may still be compiling more).
    exclusive: bool = True
    # Who held the lock while this caller waited ("" if it did not wait).
    waited_for: str = ""
