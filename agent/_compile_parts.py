"""What a torch.compile cache depends on: the key parts, shared by both ends of the socket.

A foundation, standard library only: the daemon (``agent.compile.keys``, which
normalises the parts and hashes them into a key), the wire maps
(``agent._wire``) and the client all use this one type, so a pod builds and
sends parts without importing the daemon's compile package.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompileKeyParts"]


@dataclass(frozen=True, slots=True)
class CompileKeyParts:
    """What compiled artifacts depend on. Any change gives another cache key.

    ``torch_version`` is required: every torch change invalidates compiled
    artifacts. ``engine_version`` defaults to the torch version for plain
    PyTorch. Parallel sizes of 0 mean 1. ``extras`` holds anything else that
    changes what gets compiled (dtype, max batch size, the Python version...).
    """

    engine: str = "torch"
    engine_version: str = ""
    torch_version: str = ""
    triton_version: str = ""
    cuda_version: str = ""
    gpu_name: str = ""
    model_key: str = ""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    config_hash: str = ""
    extras: dict[str, str] = field(default_factory=dict)
