"""One-call shortcuts: open a client, get a compile-cache handle, close the client."""

from __future__ import annotations

import os
from typing import Any

from agent.compile.keys import CompileKeyParts

from ._async import AsyncClient
from ._compile_types import CompileCacheHandle
from ._sync import Client

__all__ = ["acompile_cache", "compile_cache"]


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
