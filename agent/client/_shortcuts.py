"""One-call shortcuts: open a client, make one call, close the client."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from agent.compile.keys import CompileKeyParts

from ._async import AsyncClient
from ._compile_types import CompileCacheHandle
from ._sync import Client
from ._types import ModelHandle, Progress, TierName

__all__ = ["acompile_cache", "aensure", "compile_cache", "ensure"]


def ensure(
    uri: str,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    tier: TierName | None = None,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    client_name: str = "",
    progress: Callable[[Progress], None] | None = None,
    cached_only: bool = False,
    as_requester: bool = False,
) -> ModelHandle:
    """Open a client, ensure ``uri`` is cached, close the client; see ``Client.ensure``."""
    with Client(socket_path, timeout=timeout) as client:
        return client.ensure(
            uri,
            tier=tier,
            include=include,
            exclude=exclude,
            client_name=client_name,
            progress=progress,
            cached_only=cached_only,
            as_requester=as_requester,
        )


async def aensure(
    uri: str,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    tier: TierName | None = None,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    client_name: str = "",
    progress: Callable[[Progress], None] | None = None,
    cached_only: bool = False,
    as_requester: bool = False,
) -> ModelHandle:
    """Open an async client, ensure ``uri`` is cached, close the client.

    To bound the wait, wrap the call in ``asyncio.timeout()``.
    """
    async with AsyncClient(socket_path) as client:
        return await client.ensure(
            uri,
            tier=tier,
            include=include,
            exclude=exclude,
            client_name=client_name,
            progress=progress,
            cached_only=cached_only,
            as_requester=as_requester,
        )


def compile_cache(
    parts: CompileKeyParts | None = None,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    skip_restore: bool = False,
    client_name: str = "",
    **fields: Any,
) -> CompileCacheHandle:
    """``Client(socket_path).compile_cache(parts, **fields)``; see ``Client.compile_cache``."""
    with Client(socket_path, timeout=timeout) as client:
        return client.compile_cache(
            parts, skip_restore=skip_restore, client_name=client_name, **fields
        )


async def acompile_cache(
    parts: CompileKeyParts | None = None,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    skip_restore: bool = False,
    client_name: str = "",
    **fields: Any,
) -> CompileCacheHandle:
    """The asyncio form of ``compile_cache``; bound it with ``asyncio.timeout()``."""
    async with AsyncClient(socket_path) as client:
        return await client.compile_cache(
            parts, skip_restore=skip_restore, client_name=client_name, **fields
        )
