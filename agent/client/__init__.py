"""The prewarm client: ask the node's agent for a model, get a local directory.

    from agent.client import Client, ensure, load_safetensors

    handle = ensure("s3://models/llama-3-8b/")
    weights = load_safetensors(handle)   # zero-copy, mapped from the cache

    with Client() as agent, agent.leased("s3://models/llama-3-8b/") as handle:
        weights = load_safetensors(handle)   # not evicted while the block runs

Imports only grpc, protobuf and the standard library; torch is imported by
``load_safetensors`` when it runs.

The modules, each one concept: ``_client`` (``Client``, ``AsyncClient`` and the
one-call shortcuts), ``_models`` (every value returned, the options taken),
``_exceptions`` (the error tree and grpc errors mapped onto it), ``_messages``
(requests built and answers read), ``_transport`` (the socket, the channel,
waiting for the agent), ``_unreachable`` (why the socket cannot be reached, in
one sentence for every caller), ``_leases`` (holding a lease open),
``_compile`` (key parts, Mega-Cache), ``_tensors`` (``load_safetensors``).
"""

from ._client import AsyncClient, Client, acompile_cache, aensure, compile_cache, ensure
from ._compile import detect_key_parts, megacache
from ._exceptions import (
    AccessDenied,
    AgentUnavailable,
    Cancelled,
    Conflict,
    IntegrityError,
    InvalidRequest,
    NoSpace,
    NotFound,
    PrewarmError,
    SafetensorsError,
    SourceChanged,
    SourceUnavailable,
    UnsafeObjectKey,
)
from ._leases import AsyncLeaseHold, LeaseHold
from ._models import (
    AgentStatus,
    CompileCacheHandle,
    CompileCacheInfo,
    CompileCachePush,
    CompileCompaction,
    CompileEvictResult,
    CompileExplanation,
    CompileKeyChange,
    CompileKeyParts,
    CompileLockGrant,
    CompileNearest,
    CompileReady,
    CompileVerdict,
    DataPlaneName,
    EnsureOptions,
    EvictResult,
    FileEntry,
    FileProblem,
    LeasedOptions,
    LeaseGrant,
    LeaseInfo,
    ModelHandle,
    ModelInfo,
    PhaseName,
    PhaseTimings,
    Progress,
    PullCancellation,
    PullStatus,
    TierName,
    TierStatus,
    Verification,
)
from ._tensors import load_safetensors
from ._transport import DEFAULT_LEASE_SOCKET_PATH, DEFAULT_SOCKET_PATH, SOCKET_ENV, wait_for_agent

__all__ = [
    "DEFAULT_LEASE_SOCKET_PATH",
    "DEFAULT_SOCKET_PATH",
    "SOCKET_ENV",
    "AccessDenied",
    "AgentStatus",
    "AgentUnavailable",
    "AsyncClient",
    "AsyncLeaseHold",
    "Cancelled",
    "Client",
    "CompileCacheHandle",
    "CompileCacheInfo",
    "CompileCachePush",
    "CompileCompaction",
    "CompileEvictResult",
    "CompileExplanation",
    "CompileKeyChange",
    "CompileKeyParts",
    "CompileLockGrant",
    "CompileNearest",
    "CompileReady",
    "CompileVerdict",
    "Conflict",
    "DataPlaneName",
    "EnsureOptions",
    "EvictResult",
    "FileEntry",
    "FileProblem",
    "IntegrityError",
    "InvalidRequest",
    "LeaseGrant",
    "LeaseHold",
    "LeaseInfo",
    "LeasedOptions",
    "ModelHandle",
    "ModelInfo",
    "NoSpace",
    "NotFound",
    "PhaseName",
    "PhaseTimings",
    "PrewarmError",
    "Progress",
    "PullCancellation",
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
