"""What a torch.compile cache depends on, the key derived from it, and each engine's env.

Standard library only. The parts themselves (``CompileKeyParts``) live in the
foundation ``agent._vocabulary``, shared with the wire maps and the client,
which do not import this module.

Every part is normalised before hashing (whitespace, case of the engine name,
unset parallel sizes as 1, extras in sorted order), so two pods that describe
the same setup in slightly different words share one key. Anything that is a
real difference (another torch build, another GPU, another tensor-parallel
size) gives another key: compiled artifacts are only valid for the exact stack
that produced them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Literal

from agent._exceptions import InvalidRequest
from agent._uri import forbidden_character
from agent._vocabulary import CompileKeyParts

__all__ = [
    "ENGINES",
    "KEY_FORMAT",
    "CompileKeyParts",
    "EngineName",
    "compile_key",
    "engine_env",
    "normalise_parts",
    "parts_from_dict",
    "parts_to_dict",
    "sub_cache_dirs",
]

EngineName = Literal["torch", "vllm", "sglang"]
ENGINES: tuple[EngineName, ...] = ("torch", "vllm", "sglang")
_ALIASES: Mapping[str, EngineName] = {"pytorch": "torch", "": "torch"}
# Bumped when the hashed document changes shape: every key changes with it.
KEY_FORMAT = 1
KEY_LENGTH = 32
_MAX_TEXT = 256
_MAX_EXTRAS = 64
_SPACES = re.compile(r"\s+")


def _text(name: str, value: object, *, collapse: bool = False) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"Compile key part {name} must be a string, not {value!r}.")
    text = _SPACES.sub(" ", value).strip() if collapse else value.strip()
    # Control and bidi characters, as the API refuses them: parts read back from S3
    # (manifests, the index of keys by model) reach logs and people's terminals.
    found = forbidden_character(text)
    if found is not None:
        raise InvalidRequest(f"Compile key part {name} contains {found}; it is refused.")
    if len(text) > _MAX_TEXT:
        raise InvalidRequest(
            f"Compile key part {name} is {len(text)} characters long; at most {_MAX_TEXT} are "
            "allowed (hash long values, e.g. put a config's sha256 in config_hash)."
        )
    return text


def _size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(
            f"Compile key part {name} must be a whole number >= 0 (0 means 1), not {value!r}."
        )
    return value or 1


def normalise_parts(parts: CompileKeyParts) -> CompileKeyParts:
    """The canonical form of ``parts``; raises InvalidRequest saying what is wrong."""
    engine_text = _text("engine", parts.engine).lower()
    engine = _ALIASES.get(engine_text, engine_text)
    if engine not in ENGINES:
        raise InvalidRequest(
            f"Unknown engine {parts.engine!r}; use one of {', '.join(ENGINES)} "
            "(plain PyTorch is 'torch')."
        )
    torch_version = _text("torch_version", parts.torch_version)
    if not torch_version:
        raise InvalidRequest(
            "Compile key part torch_version is required: every torch change invalidates "
            "compiled artifacts. Pass torch.__version__ (the client's detect_key_parts() does)."
        )
    if not isinstance(parts.extras, Mapping):
        raise InvalidRequest(
            f"Compile key part extras must map names to strings, not {parts.extras!r}."
        )
    if len(parts.extras) > _MAX_EXTRAS:
        raise InvalidRequest(
            f"{len(parts.extras)} extras given; at most {_MAX_EXTRAS} are allowed."
        )
    extras: dict[str, str] = {}
    for raw_name, raw_value in parts.extras.items():
        name = _text("extras key", raw_name)
        if not name:
            raise InvalidRequest("An extras key is empty; name every extra part.")
        extras[name] = _text(f"extras[{name!r}]", raw_value)
    engine_version = _text("engine_version", parts.engine_version)
    return CompileKeyParts(
        engine=engine,
        engine_version=engine_version or (torch_version if engine == "torch" else ""),
        torch_version=torch_version,
        triton_version=_text("triton_version", parts.triton_version),
        cuda_version=_text("cuda_version", parts.cuda_version),
        gpu_name=_text("gpu_name", parts.gpu_name, collapse=True),
        model_key=_text("model_key", parts.model_key),
        tensor_parallel=_size("tensor_parallel", parts.tensor_parallel),
        pipeline_parallel=_size("pipeline_parallel", parts.pipeline_parallel),
        data_parallel=_size("data_parallel", parts.data_parallel),
        config_hash=_text("config_hash", parts.config_hash),
        extras=dict(sorted(extras.items())),
    )


def parts_to_dict(parts: CompileKeyParts) -> dict[str, Any]:
    """A JSON-ready dict of the parts (extras as a plain, sorted dict)."""
    document: dict[str, Any] = {f.name: getattr(parts, f.name) for f in fields(parts)}
    document["extras"] = dict(sorted(parts.extras.items()))
    return document


def parts_from_dict(document: Mapping[str, Any]) -> CompileKeyParts:
    """Parts from a dict as ``parts_to_dict`` writes it; unknown names are refused."""
    known = {f.name for f in fields(CompileKeyParts)}
    unknown = set(document) - known
    if unknown:
        raise InvalidRequest(f"Unknown compile key parts: {', '.join(sorted(unknown))}.")
    return replace(CompileKeyParts(), **dict(document))


def compile_key(parts: CompileKeyParts) -> str:
    """The cache key of (normalised) parts: 32 hex digits of a sha256."""
    canonical = normalise_parts(parts)
    document = {"v": KEY_FORMAT, **parts_to_dict(canonical)}
    encoded = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(encoded.encode()).hexdigest()[:KEY_LENGTH]


# Every JIT cache an engine (or a kernel library it loads) writes, as the variable that
# moves it and the sub-directory of the key directory it moves to. Names and defaults
# come from each project's source; see docs/compile-cache.md for the files.
_COMMON_DIRS: Mapping[str, str] = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "DG_JIT_CACHE_DIR": "deep_gemm",
    # DeepGEMM's Python JIT before its C++ rewrite read this name instead.
    "DG_CACHE_DIR": "deep_gemm",
    "CUDA_CACHE_PATH": "cuda",
}
_ENGINE_DIRS: Mapping[str, Mapping[str, str]] = {
    "torch": {},
    "vllm": {"VLLM_CACHE_ROOT": "vllm"},
    # SGLang points DeepGEMM at SGLANG_DG_CACHE_DIR itself, whatever DG_JIT_CACHE_DIR says.
    "sglang": {"SGLANG_CACHE_DIR": "sglang", "SGLANG_DG_CACHE_DIR": "deep_gemm"},
}
# The driver's PTX JIT cache evicts beyond 256 MiB by default (CUDA programming guide,
# "CUDA Environment Variables"); 1 GiB keeps a large engine's kernels, under the 4 GiB cap.
CUDA_CACHE_MAXSIZE = str(1024**3)


def sub_cache_dirs(engine: str) -> tuple[str, ...]:
    """The sub-directories of a key directory that ``engine``'s variables point at."""
    names = {**_COMMON_DIRS, **_ENGINE_DIRS.get(engine, {})}.values()
    return tuple(sorted(set(names)))


def engine_env(engine: str, directory: Path, key: str) -> dict[str, str]:
    """The environment variables that point every JIT cache of ``engine`` into ``directory``.

    Inductor, Triton, torch C++ extensions, FlashInfer's JIT workspace,
    DeepGEMM's JIT cache and the CUDA driver's ComputeCache for every engine;
    vLLM's root (its torch.compile and AOT-compile caches live under it) or
    SGLang's. TORCH_COMPILE_CACHE_KEY_TAG goes into every torch.compile cache
    key, so artifacts made for this key never mix with others in a shared
    remote cache.
    """
    env = {
        name: str(directory / sub)
        for name, sub in {**_COMMON_DIRS, **_ENGINE_DIRS.get(engine, {})}.items()
    }
    env["CUDA_CACHE_MAXSIZE"] = CUDA_CACHE_MAXSIZE
    env["TORCH_COMPILE_CACHE_KEY_TAG"] = f"prewarm-{key[:16]}"
    return env
