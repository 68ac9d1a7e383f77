"""Compile-cache key parts on the client side: detected from this process, or given as text.

    from agent.client import Client, detect_key_parts

    with Client() as agent:
        parts = detect_key_parts("vllm", model_key=handle.key, tensor_parallel=8)
        cache = agent.compile_cache(parts)
        cache.apply()                        # before the engine imports torch
        with agent.compile_lock(parts) as grant:
            warm_up()                        # one pod per node compiles; others wait

``detect_key_parts`` imports torch when it runs, ``megacache`` when it enters.
The client's methods send the parts to the agent (``_client``); they are
checked and put on the wire in ``_messages``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ._client import Client
from ._exceptions import InvalidRequest
from ._messages import KEY_FIELDS, key_parts
from ._models import CompileKeyParts

__all__ = ["MEGACACHE_FILE", "detect_key_parts", "key_fields_from_text", "megacache"]

_TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")


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
        elif name in KEY_FIELDS and name != "extras":
            found[name] = value
        else:
            raise InvalidRequest(
                f"Unknown compile key part {name!r}; the parts are "
                f"{', '.join(sorted(KEY_FIELDS - {'extras'}))} and extras.NAME."
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


MEGACACHE_FILE = "megacache/artifacts.bin"


@contextlib.contextmanager
def megacache(
    parts: CompileKeyParts | None = None,
    *,
    socket_path: str | None = None,
    client_name: str = "",
    **fields: Any,
) -> Iterator[Path]:
    """PyTorch's Mega-Cache kept in the agent's compile cache for a key: hits on a new node.

    On enter, asks the agent for the key's directory (restored from S3 on a new
    node) and loads the artifacts saved there with
    ``torch.compiler.load_cache_artifacts``; on exit, saves what this process
    compiled (``torch.compiler.save_cache_artifacts``) back, where the agent
    uploads it. No environment variable is needed: inductor and AOTAutograd
    find the loaded artifacts in their own caches. Yields the key directory.

        with megacache(detect_key_parts(model_key="my-model")):
            model = torch.compile(model); model(x)

    On the CPU the artifacts carry no compiled C++ kernels (``.so``): the FX
    graph and AOTAutograd hit, the C++ compiler still runs.
    """
    import torch

    with Client(socket_path) as agent:
        handle = agent.compile_cache(key_parts(parts, **fields), client_name=client_name)
    artifacts = handle.path / MEGACACHE_FILE
    try:
        saved = artifacts.read_bytes()
    except FileNotFoundError:
        saved = b""
    if saved:
        torch.compiler.load_cache_artifacts(saved)
    yield handle.path
    result = torch.compiler.save_cache_artifacts()
    if result is None:
        return
    artifacts.parent.mkdir(parents=True, exist_ok=True)
    # The agent packs only whole files: ".tmp" names are never packed.
    partial = artifacts.with_name(f"{artifacts.name}.{os.getpid()}.tmp")
    partial.write_bytes(result[0])
    partial.replace(artifacts)
