"""The parts of a compile-cache key that ``prewarm exec`` reads from a vLLM or SGLang command.

vLLM hashes its config (``VllmConfig.compute_hash()``: the model, parallel,
cache, scheduler, LoRA, speculative and compilation configs) into
``torch_compile_cache/<hash>/``; SGLang's compiled graphs depend on the same
kinds of settings. Two launches that differ in such a flag compile different
graphs, so they get different keys; flags that change nothing compiled (host,
port, logging, memory fraction) are left out, so launches that differ only in
those share a key. Parallel sizes become the key's own parts; every other
graph-changing flag goes, normalised (``--a_b`` is ``--a-b``, ``--x=1`` is
``--x 1``, JSON values with sorted keys, order of flags ignored), into one
hash. docs/compile-cache.md lists the flags.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["detect_engine", "engine_key_fields", "merged_key_fields"]

_PARALLEL = {
    "vllm": {
        "--tensor-parallel-size": "tensor_parallel",
        "-tp": "tensor_parallel",
        "--pipeline-parallel-size": "pipeline_parallel",
        "-pp": "pipeline_parallel",
        "--data-parallel-size": "data_parallel",
        "-dp": "data_parallel",
    },
    "sglang": {
        "--tp-size": "tensor_parallel",
        "--tp": "tensor_parallel",
        "--pp-size": "pipeline_parallel",
        "--dp-size": "data_parallel",
        "--dp": "data_parallel",
    },
}
# Flags that take a value and change what the engine compiles.
_VALUED = {
    "vllm": frozenset(
        {
            "--dtype",
            "--quantization",
            "-q",
            "--kv-cache-dtype",
            "--max-model-len",
            "--max-num-batched-tokens",
            "--max-num-seqs",
            "--compilation-config",
            "-O",
            "--cuda-graph-sizes",
            "--max-loras",
            "--max-lora-rank",
            "--speculative-config",
            "--revision",
            "--hf-overrides",
            "--override-generation-config",
            "--enable-chunked-prefill",
        }
    ),
    "sglang": frozenset(
        {
            "--dtype",
            "--quantization",
            "--kv-cache-dtype",
            "--context-length",
            "--max-running-requests",
            "--chunked-prefill-size",
            "--torch-compile-max-bs",
            "--cuda-graph-max-bs",
            "--cuda-graph-bs",
            "--attention-backend",
            "--ep-size",
            "--speculative-algorithm",
            "--revision",
        }
    ),
}
# Switches (no value) that change what is compiled.
_SWITCHES = {
    "vllm": frozenset(
        {
            "--enforce-eager",
            "--enable-expert-parallel",
            "--enable-lora",
            "--no-enable-chunked-prefill",
            "--enable-prefix-caching",
            "--no-enable-prefix-caching",
        }
    ),
    "sglang": frozenset(
        {
            "--enable-torch-compile",
            "--disable-cuda-graph",
            "--enable-dp-attention",
            "--enable-mixed-chunk",
        }
    ),
}


def detect_engine(command: Sequence[str]) -> str | None:
    """``vllm`` or ``sglang`` when ``command`` starts one of them; None otherwise."""
    if not command:
        return None
    if Path(command[0]).name == "vllm":
        return "vllm"
    for index, part in enumerate(command[:-1]):
        if part == "-m":
            module = command[index + 1]
            if module.startswith("vllm."):
                return "vllm"
            if module.startswith("sglang."):
                return "sglang"
    return None


def _canonical(value: str) -> str:
    text = value.strip()
    if text[:1] in "{[":
        try:
            return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
        except ValueError:
            return text
    return text


def _flags(command: Sequence[str], switches: frozenset[str]) -> list[tuple[str, str | None]]:
    """Every ``--flag [value]`` of ``command``, normalised; a value only where one follows."""
    found: list[tuple[str, str | None]] = []
    index = 0
    while index < len(command):
        part = command[index]
        index += 1
        if part.startswith("-O") and not part.startswith("--"):
            rest = part[2:].lstrip("=")
            name, _, dotted = rest.partition("=") if rest.startswith(".") else ("", "", rest)
            if not rest and index < len(command):
                dotted, index = command[index], index + 1
            found.append((f"-O{name}", dotted))
            continue
        if not part.startswith("-") or part == "-":
            continue
        name, sep, value = part.partition("=")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        if sep:
            found.append((name, value))
        elif name not in switches and index < len(command) and not command[index].startswith("-"):
            found.append((name, command[index]))
            index += 1
        else:
            found.append((name, None))
    return found


def engine_key_fields(engine: str, command: Sequence[str]) -> dict[str, str]:
    """Key fields (as ``--compile-key`` gives them) that ``engine``'s ``command`` implies.

    Parallel sizes as ``tensor_parallel``/``pipeline_parallel``/``data_parallel``;
    every other graph-changing flag hashed into ``config_hash`` (``engine-flags:<16 hex>``).
    Empty for an engine this does not know.
    """
    if engine not in _VALUED:
        return {}
    parallel, valued, switches = _PARALLEL[engine], _VALUED[engine], _SWITCHES[engine]
    fields: dict[str, str] = {}
    settings: dict[str, str] = {}
    for name, value in _flags(command, switches):
        if name in parallel and value is not None:
            fields[parallel[name]] = value.strip()
        elif (name in valued or name.startswith("-O.")) and value is not None:
            settings["-O" if name == "-O" else name] = _canonical(value)
        elif name in switches:
            settings[name] = "true"
        elif name == "-O" and value is not None:
            settings["-O"] = _canonical(value)
    if settings:
        encoded = json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()
        fields["config_hash"] = "engine-flags:" + hashlib.sha256(encoded).hexdigest()[:16]
    return fields


def merged_key_fields(given: Mapping[str, str], derived: Mapping[str, str]) -> dict[str, str]:
    """``given`` (``--compile-key``) plus ``derived``; a derived hash beside a given one
    goes to ``extras.engine_flags``, and a given parallel size wins."""
    merged = dict(given)
    for name, value in derived.items():
        if name == "config_hash" and "config_hash" in given:
            merged["extras.engine_flags"] = value
        else:
            merged.setdefault(name, value)
    return merged
