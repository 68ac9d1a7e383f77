"""The compile-cache calls, each described once for both clients (see ``_spec``).

Each function takes a public method's arguments (its signature and docstring
are the method's) and returns the call to run, with the conversions from the
compile messages to the values in ``_compile_types``.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent._exceptions import PrewarmError
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._wire import datetime_from_proto, parts_from_proto, parts_to_proto
from agent.compile.keys import CompileKeyParts

from ._compile import key_parts
from ._compile_types import (
    CompileCacheHandle,
    CompileCacheInfo,
    CompileCachePush,
    CompileEvictResult,
    CompileLockGrant,
    CompileReady,
    CompileVerdict,
)
from ._spec import Streamed, Unary

__all__ = [
    "compile_cache",
    "compile_lock",
    "compile_ready",
    "evict_compile_cache",
    "list_compile_caches",
    "pull_compile_cache",
    "push_compile_cache",
]

# What a lock waiter is told about the holder while it waits.
WaitCallback = Callable[[str], None]


def compile_cache(
    parts: CompileKeyParts | None = None,
    *,
    skip_restore: bool = False,
    client_name: str = "",
    publish_on_ready: bool = False,
    **fields: Any,
) -> Unary[CompileCacheHandle]:
    """The node's compile-cache directory for these key parts, restored from S3 if needed.

    Give ``parts`` (see ``detect_key_parts``) and/or the parts as keyword
    arguments. ``skip_restore`` keeps a new key empty even if S3 has it.
    ``publish_on_ready``: this caller reports its engine ready with
    ``compile_ready``; the key is then uploaded only at that report, so a
    launch that crashes first uploads nothing.
    """
    request = pb.EnsureCompileCacheRequest(
        parts=parts_to_proto(key_parts(parts, **fields)),
        skip_restore=skip_restore,
        client_name=client_name or _default_name(),
        publish_on_ready=publish_on_ready,
    )
    return Unary("EnsureCompileCache", request, _handle_from_proto)


def list_compile_caches() -> Unary[list[CompileCacheInfo]]:
    """Every compile cache on the node."""
    return Unary("ListCompileCaches", pb.ListCompileCachesRequest(), _infos_from_proto)


def evict_compile_cache(key: str) -> Unary[CompileEvictResult]:
    """Remove a compile cache (a key or a unique prefix of 8+ hex digits)."""
    request = pb.EvictCompileCacheRequest(key=key)
    return Unary("EvictCompileCache", request, _evict_result_from_proto)


def push_compile_cache(key: str) -> Unary[CompileCachePush]:
    """Pack and upload a compile cache now (skipped when S3 has the same content)."""
    request = pb.PushCompileCacheRequest(key=key)
    return Unary("PushCompileCache", request, _push_from_proto)


def pull_compile_cache(key: str) -> Unary[CompileCacheHandle]:
    """Restore a compile cache from S3 now, replacing this node's copy."""
    request = pb.PullCompileCacheRequest(key=key)
    return Unary("PullCompileCache", request, _handle_from_proto)


def compile_ready(key: str, *, client_name: str = "") -> Unary[CompileReady]:
    """The engine using ``key`` is ready: its verdict, after the key was uploaded (merged)."""
    request = pb.CompileReadyRequest(key=key, client_name=client_name or _default_name())
    return Unary("CompileReady", request, _ready_from_proto)


def compile_lock(
    parts: CompileKeyParts | None = None,
    *,
    client_name: str = "",
    on_wait: WaitCallback | None = None,
    **fields: Any,
) -> Streamed[CompileLockGrant]:
    """Hold the node's compile lock for a key for the life of the block.

    The first pod gets it at once; later ones wait (``on_wait`` is called
    with the holder's name) until it is their turn, or until the cache has
    become warm (``grant.exclusive`` is then False). The lock is released
    when the block exits or this process dies. Wrap the warm-up only, not
    the pod's whole life. The client's timeout does not apply.
    """
    request = pb.CompileLockRequest(
        parts=parts_to_proto(key_parts(parts, **fields)),
        client_name=client_name or _default_name(),
    )
    return Streamed("CompileLock", request, _LockReader(on_wait), timed=False)


class _LockReader:
    """Reads the lock stream's events until the grant."""

    def __init__(self, on_wait: WaitCallback | None) -> None:
        self._on_wait = on_wait
        self._waited_for = ""
        self._grant: CompileLockGrant | None = None

    def feed(self, event: pb.CompileLockEvent) -> bool:
        if event.state == pb.CompileLockEvent.STATE_WAITING:
            self._waited_for = event.holder
            if self._on_wait is not None:
                self._on_wait(event.holder)
            return False
        if event.state == pb.CompileLockEvent.STATE_GRANTED:
            self._grant = CompileLockGrant(
                key=event.key,
                warm=event.warm,
                waited=bool(self._waited_for),
                exclusive=not event.holder,
                waited_for=self._waited_for,
            )
            return True
        raise PrewarmError(
            f"The agent sent compile-lock state {event.state}; the client and the agent may "
            "be different versions."
        )

    def result(self, socket_path: Path) -> CompileLockGrant:
        if self._grant is None:
            raise PrewarmError(
                f"The prewarm agent on {socket_path} ended CompileLock without granting it; it "
                "may be stopping. Retry, or compile without the lock."
            )
        return self._grant


def _default_name() -> str:
    # In a pod, HOSTNAME is the pod's name: what an operator looks for in logs.
    return f"{os.environ.get('HOSTNAME') or platform.node()} (pid {os.getpid()})"


# -- protobuf ---------------------------------------------------------------------------------


def _handle_from_proto(msg: pb.CompileCacheHandle) -> CompileCacheHandle:
    return CompileCacheHandle(
        key=msg.key,
        path=Path(msg.path),
        env=dict(msg.env),
        restored=msg.restored,
        restore_seconds=msg.restore_seconds,
        restore_note=msg.restore_note,
        parts=parts_from_proto(msg.parts),
        bytes=msg.bytes,
        file_count=msg.file_count,
    )


def _info_from_proto(msg: pb.CompileCacheInfo) -> CompileCacheInfo:
    return CompileCacheInfo(
        key=msg.key,
        path=Path(msg.path),
        parts=parts_from_proto(msg.parts),
        bytes=msg.bytes,
        file_count=msg.file_count,
        created=datetime_from_proto(msg.created),
        last_used=datetime_from_proto(msg.last_used),
        uploaded_digest=msg.uploaded_digest,
        uploaded=datetime_from_proto(msg.uploaded) if msg.HasField("uploaded") else None,
        restored=msg.restored,
        last_verdict=_verdict_from_proto(msg.last_verdict)
        if msg.HasField("last_verdict")
        else None,
        publish_on_ready=msg.publish_on_ready,
        domain=msg.domain,
    )


def _verdict_from_proto(msg: pb.CompileVerdict) -> CompileVerdict:
    return CompileVerdict(
        verdict=msg.verdict,
        grown={g.sub_cache: (g.files_added, g.bytes_added) for g in msg.grown},
        at=datetime_from_proto(msg.at) if msg.HasField("at") else None,
        client_name=msg.client_name,
    )


def _ready_from_proto(msg: pb.CompileReadyResponse) -> CompileReady:
    return CompileReady(msg.key, _verdict_from_proto(msg.verdict), _push_from_proto(msg.upload))


def _infos_from_proto(msg: pb.ListCompileCachesResponse) -> list[CompileCacheInfo]:
    return [_info_from_proto(c) for c in msg.caches]


def _evict_result_from_proto(msg: pb.EvictCompileCacheResponse) -> CompileEvictResult:
    return CompileEvictResult(tuple(_info_from_proto(c) for c in msg.evicted), msg.bytes_freed)


def _push_from_proto(msg: pb.PushCompileCacheResponse) -> CompileCachePush:
    return CompileCachePush(msg.uploaded, msg.uri, msg.digest, msg.bytes, msg.skipped_reason)
