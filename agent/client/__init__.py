"""The prewarm client: ask the node's agent for a model, get a local directory.

    from agent.client import ensure, load_safetensors

    handle = ensure("s3://models/llama-3-8b/")
    weights = load_safetensors(handle)   # zero-copy, mapped from the cache

Imports only grpc, protobuf and the standard library; torch is imported by
``load_safetensors`` when it runs.
"""

from agent._exceptions import (
    AccessDenied,
    AgentUnavailable,
    Conflict,
    InvalidRequest,
    NoSpace,
    NotFound,
    PrewarmError,
    SourceChanged,
    SourceUnavailable,
    UnsafeObjectKey,
)

from ._async import AsyncClient, aensure
from ._convert import DEFAULT_SOCKET_PATH, SOCKET_ENV
from ._sync import Client, ensure
from ._tensors import SafetensorsError, load_safetensors
from ._types import (
    AgentStatus,
    EvictResult,
    FileEntry,
    ModelHandle,
    ModelInfo,
    PhaseName,
    PhaseTimings,
    Progress,
    PullStatus,
    TierName,
    TierStatus,
)

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "SOCKET_ENV",
    "AccessDenied",
    "AgentStatus",
    "AgentUnavailable",
    "AsyncClient",
    "Client",
    "Conflict",
    "EvictResult",
    "FileEntry",
    "InvalidRequest",
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
    "aensure",
    "ensure",
    "load_safetensors",
]
