"""One node's compile caches in process: a real store and ``CompileCaches`` on tmp roots.

For the compile-cache tests that play S3 with a MemorySource: several nodes
sharing one source are several of these, each under its own root.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store_helpers import open_store

from agent._config import CompileCacheSettings, Settings, TierSettings
from agent.compile.cache import CompileCaches
from agent.compile.signing import Signing, Trust, load_signing_key, load_trusted_keys
from agent.source.interface import ObjectSource
from agent.testing import MemorySource, shared_keys

BUCKET = "caches"


@contextlib.asynccontextmanager
async def compile_node(
    root: Path,
    source: ObjectSource,
    *,
    shared: bool = True,
    budget: str = "10MiB",
    **settings: Any,
) -> AsyncIterator[CompileCaches]:
    """One node's compile caches under ``root``; ``shared`` points them at ``s3://caches/cc``
    in ``source``. ``settings`` are ``[compile_cache]`` settings; the quiet time (an hour by
    default) keeps uploads to when a test asks, uploads are not paced, and the nodes sign with
    and trust the tests' shared key unless a test names keys."""
    store = await open_store(root, budget)
    keys = shared_keys()
    defaults = {
        "quiet_seconds": 3600,
        # Tests push again and again on purpose; the pacing has tests of its own.
        "min_upload_interval_seconds": 0,
        "signing_key": keys.private,
        "trusted_keys": [keys.trusted],
    }
    config = Settings(
        tiers=TierSettings(shm_root=root / "shm", disk_root=root / "disk"),
        compile_cache=CompileCacheSettings(
            uri=f"s3://{BUCKET}/cc" if shared else None, **{**defaults, **settings}
        ),
    )
    async with CompileCaches(config, store, source) as caches:
        yield caches


def shared_signing(domain: str = "node") -> Signing:
    """``domain``'s signatures as every test node has them: the shared key signs and is
    trusted (for a test that reads or writes S3 beside the nodes)."""
    keys = shared_keys()
    return Signing(domain, load_signing_key(keys.private), Trust(load_trusted_keys([keys.trusted])))


@dataclass
class ManifestWrites(MemorySource):
    """The in-memory store, letting a test wait for the n-th manifest write of any key."""

    written: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def put_object(
        self,
        bucket: str,
        key: str,
        body: bytes,
        *,
        content_type: str = "application/octet-stream",
        if_match: str | None = None,
        if_absent: bool = False,
    ) -> str:
        etag = await super().put_object(
            bucket, key, body, content_type=content_type, if_match=if_match, if_absent=if_absent
        )
        if key.endswith("/manifest.json"):
            async with self.changed:
                self.written += 1
                self.changed.notify_all()
        return etag

    async def manifests(self, count: int) -> None:
        """Return once ``count`` manifest writes have happened."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.written >= count)
