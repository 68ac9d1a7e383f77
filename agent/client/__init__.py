"""The prewarm client: ask the node's agent for a model, get a local directory.

    from agent.client import Client, ensure, load_safetensors

    handle = ensure("s3://models/llama-3-8b/")
    weights = load_safetensors(handle)   # zero-copy, mapped from the cache

    with Client() as agent, agent.leased("s3://models/llama-3-8b/") as handle:
        weights = load_safetensors(handle)   # not evicted while the block runs

Imports only grpc, protobuf and the standard library; torch is imported by
``load_safetensors`` when it runs.
"""

from agent._exceptions import (
    AccessDenied,
    AgentUnavailable,
    Conflict,
    IntegrityError,
    InvalidRequest,
    NoSpace,
    NotFound,
    PrewarmError,
    SourceChanged,
    SourceUnavailable,
    UnsafeObjectKey,
)

from ._async import AsyncClient
from ._compile import detect_key_parts, megacache
from ._compile_types import (
    CompileCacheHandle,
    CompileCacheInfo,
    CompileCachePush,
    CompileEvictResult,
    CompileKeyParts,
    CompileLockGrant,
    CompileReady,
    CompileVerdict,
)
from ._convert import DEFAULT_LEASE_SOCKET_PATH, DEFAULT_SOCKET_PATH, SOCKET_ENV
from ._hold import AsyncLeaseHold, LeaseHold
from ._shortcuts import acompile_cache, aensure, compile_cache, ensure
from ._sync import Client
from ._tensors import SafetensorsError, load_safetensors
from ._types import (
    AgentStatus,
    DataPlaneName,
    EvictResult,
    FileEntry,
    FileProblem,
    LeaseGrant,
    LeaseInfo,
    ModelHandle,
    ModelInfo,
    PhaseName,
    PhaseTimings,
    Progress,
    PullStatus,
    TierName,
    TierStatus,
    Verification,
)
from ._wait import wait_for_agent

__all__ = [
    "DEFAULT_LEASE_SOCKET_PATH",
    "DEFAULT_SOCKET_PATH",
    "SOCKET_ENV",
    "AccessDenied",
    "AgentStatus",
    "AgentUnavailable",
    "AsyncClient",
    "AsyncLeaseHold",
    "Client",
    "CompileCacheHandle",
    "CompileCacheInfo",
    "CompileCachePush",
    "CompileEvictResult",
    "CompileKeyParts",
    "CompileLockGrant",
    "CompileReady",
    "CompileVerdict",
    "Conflict",
    "DataPlaneName",
    "EvictResult",
    "FileEntry",
    "FileProblem",
    "IntegrityError",
    "InvalidRequest",
    "LeaseGrant",
    "LeaseHold",
    "LeaseInfo",
    "ModelHandle",
    "ModelInfo",
    "NoSpace",
    "NotFound",
    "PhaseName",
    "PhaseTimings",
    "PrewarmError",
    "Progress",
    "PullStatus",
    "SafetensorsError",
    "SourceChanged",
    "SourceUnavailable",
    "TierName",
    "TierStatus",
    "UnsafeObjectKey",
    "Verification",
    "acompile_cache",
    "aensure",
    "compile_cache",
    "detect_key_parts",
    "ensure",
    "load_safetensors",
    "megacache",
    "wait_for_agent",
]
