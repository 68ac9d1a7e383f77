"""Compile caches from a pod: a directory per key, restored from S3, and a node-wide lock.

    from agent.client import Client, detect_key_parts

    with Client() as agent:
        parts = detect_key_parts("vllm", model_key=handle.key, tensor_parallel=8)
        cache = agent.compile_cache(parts)
        cache.apply()                        # before the engine imports torch
        with agent.compile_lock(parts) as grant:
            warm_up()                        # one pod per node compiles; others wait

Imports only grpc, protobuf and the standard library; ``detect_key_parts``
imports torch when it runs.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from agent._exceptions import InvalidRequest, PrewarmError
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent.compile.keys import CompileKeyParts

from ._compile_types import (
    CompileCacheHandle,
    CompileCacheInfo,
    CompileCachePush,
    CompileEvictResult,
    CompileLockGrant,
)
from ._errors import translate_rpc_error

__all__ = [
    "AsyncCompileMixin",
    "CompileMixin",
    "detect_key_parts",
    "key_fields_from_text",
    "key_parts",
]

_KEY_FIELDS = frozenset(f.name for f in dataclass_fields(CompileKeyParts))
_TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")
# What a lock waiter is told about the holder while it waits.
WaitCallback = Callable[[str], None]


def key_parts(parts: CompileKeyParts | None = None, **fields: Any) -> CompileKeyParts:
    """``parts`` (or empty parts) with ``fields`` replaced; unknown names are refused."""
    unknown = set(fields) - _KEY_FIELDS
    if unknown:
        raise InvalidRequest(
            f"Unknown compile key part(s) {', '.join(sorted(unknown))}; "
            f"the parts are {', '.join(sorted(_KEY_FIELDS))}."
        )
    return replace(parts or CompileKeyParts(), **fields)


_SIZES = frozenset({"tensor_parallel", "pipeline_parallel", "data_parallel"})


def key_fields_from_text(pairs: Mapping[str, str]) -> dict[str, Any]:
    """Key parts given as text (``--compile-key NAME=VALUE``) as ``CompileKeyParts`` fields.

    Parallel sizes become numbers; ``extras.NAME`` goes into ``extras``.
    Unknown names and non-numeric sizes are refused with InvalidRequest.
    """
    found: dict[str, Any] = {}
    extras: dict[str, str] = {}
    for name, value in pairs.items():
        if name.startswith("extras."):
            extras[name.removeprefix("extras.")] = value
        elif name in _SIZES:
            if not value.strip().isdigit():
                raise InvalidRequest(
                    f"Compile key part {name} must be a whole number, not {value!r}."
                )
            found[name] = int(value)
        elif name in _KEY_FIELDS and name != "extras":
            found[name] = value
        else:
            raise InvalidRequest(
                f"Unknown compile key part {name!r}; the parts are "
                f"{', '.join(sorted(_KEY_FIELDS - {'extras'}))} and extras.NAME."
            )
    if extras:
        found["extras"] = extras
    return found


def _installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _gpu_name(torch: Any) -> str:
    """The first GPU's name, without initialising CUDA in this process when it can.

    Engines that fork workers (vLLM) fail if the parent initialised CUDA, so
    NVML (pynvml) or nvidia-smi are asked first; torch only when CUDA is
    already initialised. Like NVML, this ignores CUDA_VISIBLE_DEVICES: nodes
    are assumed to hold one GPU model.
    """
    if torch.cuda.is_initialized():
        return str(torch.cuda.get_device_name(0))
    with contextlib.suppress(Exception):
        import pynvml  # type: ignore[import-not-found,unused-ignore]

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            return name.decode() if isinstance(name, bytes) else str(name)
        finally:
            pynvml.nvmlShutdown()
    smi = shutil.which("nvidia-smi")
    if smi:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [smi, "--query-gpu=name", "--format=csv,noheader", "--id=0"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            )
            if out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
    if torch.version.hip is None and not torch.cuda.is_available():
        return "cpu"
    return ""


def detect_key_parts(engine: str = "torch", **fields: Any) -> CompileKeyParts:
    """Key parts this process can find out itself, with ``fields`` over them.

    Detected: the torch version, the Triton and CUDA (or ROCm) versions, the
    first GPU's name ("cpu" on a machine without one), the engine's version
    (vLLM, SGLang: the installed package; torch: torch's), and the Python
    version as the ``python`` extra. Give what it cannot know: ``model_key``,
    parallel sizes, ``config_hash``, more ``extras`` (merged with the
    detected ones). Imports torch; works without a GPU.
    """
    import torch

    cuda = torch.version.cuda or (f"rocm-{torch.version.hip}" if torch.version.hip else "")
    engine_version = {"vllm": _installed("vllm"), "sglang": _installed("sglang")}.get(
        engine.strip().lower(), ""
    )
    detected = CompileKeyParts(
        engine=engine,
        engine_version=engine_version,
        torch_version=str(torch.__version__),
        triton_version=next(filter(None, map(_installed, _TRITON_DISTRIBUTIONS)), ""),
        cuda_version=cuda,
        gpu_name=_gpu_name(torch),
    )
    extras = {"python": platform.python_version(), **dict(fields.pop("extras", {}))}
    return key_parts(detected, extras=extras, **fields)


# -- protobuf ---------------------------------------------------------------------------------


def parts_to_proto(parts: CompileKeyParts) -> pb.CompileKeyParts:
    try:
        return pb.CompileKeyParts(
            engine=parts.engine,
            engine_version=parts.engine_version,
            torch_version=parts.torch_version,
            triton_version=parts.triton_version,
            cuda_version=parts.cuda_version,
            gpu_name=parts.gpu_name,
            model_key=parts.model_key,
            tensor_parallel=parts.tensor_parallel,
            pipeline_parallel=parts.pipeline_parallel,
            data_parallel=parts.data_parallel,
            config_hash=parts.config_hash,
            extras=parts.extras,
        )
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"Invalid compile key parts ({exc}): {parts}.") from exc


def parts_from_proto(msg: pb.CompileKeyParts) -> CompileKeyParts:
    return CompileKeyParts(
        engine=msg.engine,
        engine_version=msg.engine_version,
        torch_version=msg.torch_version,
        triton_version=msg.triton_version,
        cuda_version=msg.cuda_version,
        gpu_name=msg.gpu_name,
        model_key=msg.model_key,
        tensor_parallel=msg.tensor_parallel,
        pipeline_parallel=msg.pipeline_parallel,
        data_parallel=msg.data_parallel,
        config_hash=msg.config_hash,
        extras=dict(msg.extras),
    )


def _when(stamp: Any) -> datetime:
    return datetime.fromtimestamp(stamp.ToNanoseconds() / 1e9, UTC)


def handle_from_proto(msg: pb.CompileCacheHandle) -> CompileCacheHandle:
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


def info_from_proto(msg: pb.CompileCacheInfo) -> CompileCacheInfo:
    return CompileCacheInfo(
        key=msg.key,
        path=Path(msg.path),
        parts=parts_from_proto(msg.parts),
        bytes=msg.bytes,
        file_count=msg.file_count,
        created=_when(msg.created),
        last_used=_when(msg.last_used),
        uploaded_digest=msg.uploaded_digest,
        uploaded=_when(msg.uploaded) if msg.HasField("uploaded") else None,
        restored=msg.restored,
    )


def _ensure_request(
    parts: CompileKeyParts | None, skip_restore: bool, client_name: str, fields: dict[str, Any]
) -> pb.EnsureCompileCacheRequest:
    return pb.EnsureCompileCacheRequest(
        parts=parts_to_proto(key_parts(parts, **fields)),
        skip_restore=skip_restore,
        client_name=client_name or _default_name(),
    )


def _lock_request(
    parts: CompileKeyParts | None, client_name: str, fields: dict[str, Any]
) -> pb.CompileLockRequest:
    return pb.CompileLockRequest(
        parts=parts_to_proto(key_parts(parts, **fields)),
        client_name=client_name or _default_name(),
    )


def _default_name() -> str:
    # In a pod, HOSTNAME is the pod's name: what an operator looks for in logs.
    return f"{os.environ.get('HOSTNAME') or platform.node()} (pid {os.getpid()})"


class _LockState:
    """Reads the lock stream's events until the grant."""

    def __init__(self, on_wait: WaitCallback | None) -> None:
        self._on_wait = on_wait
        self.waited_for = ""

    def event(self, event: pb.CompileLockEvent) -> CompileLockGrant | None:
        if event.state == pb.CompileLockEvent.STATE_WAITING:
            self.waited_for = event.holder
            if self._on_wait is not None:
                self._on_wait(event.holder)
            return None
        if event.state == pb.CompileLockEvent.STATE_GRANTED:
            return CompileLockGrant(
                key=event.key,
                warm=event.warm,
                waited=bool(self.waited_for),
                exclusive=not event.holder,
                waited_for=self.waited_for,
            )
        raise PrewarmError(
            f"The agent sent compile-lock state {event.state}; the client and the agent may "
            "be different versions."
        )


def _no_grant(socket_path: Path) -> PrewarmError:
    return PrewarmError(
        f"The prewarm agent on {socket_path} ended CompileLock without granting it; it may be "
        "stopping. Retry, or compile without the lock."
    )


class CompileMixin:
    """The compile-cache calls of ``Client``."""

    _stub: Any
    _timeout: float | None
    _socket_path: Path

    def _unary(self, method: Any, request: Any) -> Any:
        raise NotImplementedError  # pragma: no cover - Client provides it

    def compile_cache(
        self,
        parts: CompileKeyParts | None = None,
        *,
        skip_restore: bool = False,
        client_name: str = "",
        **fields: Any,
    ) -> CompileCacheHandle:
        """The node's compile-cache directory for these key parts, restored from S3 if needed.

        Give ``parts`` (see ``detect_key_parts``) and/or the parts as keyword
        arguments. ``skip_restore`` keeps a new key empty even if S3 has it.
        """
        request = _ensure_request(parts, skip_restore, client_name, fields)
        return handle_from_proto(self._unary(self._stub.EnsureCompileCache, request))

    def list_compile_caches(self) -> list[CompileCacheInfo]:
        response = self._unary(self._stub.ListCompileCaches, pb.ListCompileCachesRequest())
        return [info_from_proto(c) for c in response.caches]

    def evict_compile_cache(self, key: str) -> CompileEvictResult:
        """Remove a compile cache (a key or a unique prefix of 8+ hex digits)."""
        response = self._unary(self._stub.EvictCompileCache, pb.EvictCompileCacheRequest(key=key))
        return CompileEvictResult(
            tuple(info_from_proto(c) for c in response.evicted), response.bytes_freed
        )

    def push_compile_cache(self, key: str) -> CompileCachePush:
        """Pack and upload a compile cache now (skipped when S3 has the same content)."""
        response = self._unary(self._stub.PushCompileCache, pb.PushCompileCacheRequest(key=key))
        return CompileCachePush(
            response.uploaded,
            response.uri,
            response.digest,
            response.bytes,
            response.skipped_reason,
        )

    def pull_compile_cache(self, key: str) -> CompileCacheHandle:
        """Restore a compile cache from S3 now, replacing this node's copy."""
        response = self._unary(self._stub.PullCompileCache, pb.PullCompileCacheRequest(key=key))
        return handle_from_proto(response)

    @contextlib.contextmanager
    def compile_lock(
        self,
        parts: CompileKeyParts | None = None,
        *,
        client_name: str = "",
        on_wait: WaitCallback | None = None,
        **fields: Any,
    ) -> Iterator[CompileLockGrant]:
        """Hold the node's compile lock for a key for the life of the block.

        The first pod gets it at once; later ones wait (``on_wait`` is called
        with the holder's name) until it is their turn, or until the cache has
        become warm (``grant.exclusive`` is then False). The lock is released
        when the block exits or this process dies. Wrap the warm-up only, not
        the pod's whole life. The client's timeout does not apply.
        """
        call = self._stub.CompileLock(_lock_request(parts, client_name, fields))
        try:
            state = _LockState(on_wait)
            grant = None
            try:
                for event in call:
                    grant = state.event(event)
                    if grant is not None:
                        break
            except grpc.RpcError as exc:
                raise translate_rpc_error(exc, self._socket_path) from exc
            if grant is None:
                raise _no_grant(self._socket_path)
            yield grant
        finally:
            call.cancel()


class AsyncCompileMixin:
    """The compile-cache calls of ``AsyncClient``."""

    _timeout: float | None
    _socket_path: Path

    def _get_stub(self) -> Any:
        raise NotImplementedError  # pragma: no cover - AsyncClient provides it

    async def _unary(self, method: Any, request: Any) -> Any:
        raise NotImplementedError  # pragma: no cover - AsyncClient provides it

    async def compile_cache(
        self,
        parts: CompileKeyParts | None = None,
        *,
        skip_restore: bool = False,
        client_name: str = "",
        **fields: Any,
    ) -> CompileCacheHandle:
        """See ``Client.compile_cache``."""
        request = _ensure_request(parts, skip_restore, client_name, fields)
        return handle_from_proto(await self._unary(self._get_stub().EnsureCompileCache, request))

    async def list_compile_caches(self) -> list[CompileCacheInfo]:
        stub = self._get_stub()
        response = await self._unary(stub.ListCompileCaches, pb.ListCompileCachesRequest())
        return [info_from_proto(c) for c in response.caches]

    async def evict_compile_cache(self, key: str) -> CompileEvictResult:
        stub = self._get_stub()
        response = await self._unary(stub.EvictCompileCache, pb.EvictCompileCacheRequest(key=key))
        return CompileEvictResult(
            tuple(info_from_proto(c) for c in response.evicted), response.bytes_freed
        )

    async def push_compile_cache(self, key: str) -> CompileCachePush:
        stub = self._get_stub()
        response = await self._unary(stub.PushCompileCache, pb.PushCompileCacheRequest(key=key))
        return CompileCachePush(
            response.uploaded,
            response.uri,
            response.digest,
            response.bytes,
            response.skipped_reason,
        )

    async def pull_compile_cache(self, key: str) -> CompileCacheHandle:
        stub = self._get_stub()
        response = await self._unary(stub.PullCompileCache, pb.PullCompileCacheRequest(key=key))
        return handle_from_proto(response)

    @contextlib.asynccontextmanager
    async def compile_lock(
        self,
        parts: CompileKeyParts | None = None,
        *,
        client_name: str = "",
        on_wait: WaitCallback | None = None,
        **fields: Any,
    ) -> AsyncIterator[CompileLockGrant]:
        """See ``Client.compile_lock``."""
        call = self._get_stub().CompileLock(_lock_request(parts, client_name, fields))
        try:
            state = _LockState(on_wait)
            grant = None
            try:
                async for event in call:
                    grant = state.event(event)
                    if grant is not None:
                        break
            except grpc.RpcError as exc:
                raise translate_rpc_error(exc, self._socket_path) from exc
            if grant is None:
                raise _no_grant(self._socket_path)
            yield grant
        finally:
            call.cancel()
