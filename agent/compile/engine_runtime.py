"""The key parts of the world a command runs in: its interpreter's torch, Triton, engine, GPU.

``prewarm exec`` may be installed apart from the engine (its own venv, a pipx
install, another image layer), so its own ``import torch`` says nothing about
what the engine will compile with. This module finds the Python the command
will run (``python -m x``, a console script's shebang such as ``vllm``'s, the
``/bin/sh`` trampoline pip writes for long paths) and asks it once, in one
subprocess that reads ``importlib.metadata`` and torch's ``version.py``
without importing torch (well under a second). The GPU's name and compute
capability come from ``nvidia-smi`` when there is one: the node's, whatever
the interpreter. On a machine without ``nvidia-smi`` the GPU is ``cpu`` and
the architecture part is left out.

Standard library only: the CLI imports this module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "VEC_ISA_OK",
    "engine_runtime_fields",
    "interpreter_of",
    "probe_interpreter",
    "vec_isa_ok_part",
]

PROBE_TIMEOUT_SECONDS = 30.0
_SHEBANG_BYTES = 1024
_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?[tdm]?(\.exe)?")
# pip writes this trampoline when the interpreter's path is too long for a shebang line.
_TRAMPOLINE = re.compile(r"""^'''exec' "?([^"\s]+)"? """, re.MULTILINE)
_TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")
_ENGINE_DISTRIBUTIONS = ("torch", "vllm", "sglang", *_TRITON_DISTRIBUTIONS)
# Inductor's config.cpp.vec_isa_ok: prewarm exec turns its build check of each vector
# instruction set off on a node without a GPU (agent/cli/_exec.py says why); a key part:
# the check builds libraries of its own into the cache, and 0 means scalar kernels.
VEC_ISA_OK = "TORCHINDUCTOR_VEC_ISA_OK"

# Runs in the engine's interpreter: no torch import (seconds, and CUDA), only metadata.
_PROBE = r"""
import importlib.util, json, os, platform, re, sys
try:
    from importlib import metadata
except ImportError:
    metadata = None
def version(name):
    try:
        return metadata.version(name)
    except Exception:
        return ""
found = {"python": platform.python_version()}
for name in sys.argv[1:]:
    found[name] = version(name)
try:
    spec = importlib.util.find_spec("torch")
    origin = spec.origin if spec is not None else None
    with open(os.path.join(os.path.dirname(origin), "version.py")) as source:
        text = source.read()
    for name in ("cuda", "hip"):
        match = re.search(r"^%s\s*(?::[^=]*)?=\s*'([^']*)'" % name, text, re.M)
        found["build_" + name] = match.group(1) if match else ""
except Exception:
    pass
print(json.dumps(found))
"""


def _is_python(path: str) -> bool:
    return _PYTHON_NAME.fullmatch(Path(path).name) is not None


def _which(name: str, env: Mapping[str, str]) -> str | None:
    return shutil.which(name, path=env.get("PATH", os.defpath))


def _first_bytes(path: str) -> str:
    try:
        with Path(path).open("rb") as stream:
            return stream.read(_SHEBANG_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""


def _shebang_interpreter(script: str, env: Mapping[str, str]) -> str | None:
    """The Python a script's ``#!`` line (or pip's ``/bin/sh`` trampoline) runs it with."""
    head = _first_bytes(script)
    words = head[2:].partition("\n")[0].split() if head.startswith("#!") else []
    if not words:
        return None
    if Path(words[0]).name == "env":
        # ``#!/usr/bin/env python3`` or ``#!/usr/bin/env -S python3 -u``
        names = [word for word in words[1:] if not word.startswith("-")]
        return _which(names[0], env) if names and _is_python(names[0]) else None
    if _is_python(words[0]):
        return words[0]
    trampoline = _TRAMPOLINE.search(head)
    if Path(words[0]).name == "sh" and trampoline and _is_python(trampoline.group(1)):
        return trampoline.group(1)
    return None


def interpreter_of(command: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The Python ``command`` runs in, or None when it is not (visibly) a Python program.

    ``python3 -m vllm.entrypoints...`` is its ``python3`` (looked up on the
    command's PATH); ``vllm serve`` is the interpreter on ``vllm``'s shebang
    line. A shell script or a binary is None: the caller falls back.
    """
    if not command:
        return None
    program = command[0] if "/" in command[0] else _which(command[0], env)
    if program is None:
        return None
    if _is_python(program):
        return program
    return _shebang_interpreter(program, env)


def probe_interpreter(interpreter: str, env: Mapping[str, str]) -> dict[str, str]:
    """The versions ``interpreter`` sees (Python, torch, Triton, engines, torch's CUDA/HIP build).

    One subprocess with the command's own environment; {} when it cannot run
    or answers nonsense, so that the caller falls back.
    """
    try:
        done = subprocess.run(
            [interpreter, "-c", _PROBE, *_ENGINE_DISTRIBUTIONS],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_SECONDS,
            check=True,
        )
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}
    if not isinstance(answer, dict):
        return {}
    return {str(name): str(value) for name, value in answer.items() if isinstance(value, str)}


def _gpu(env: Mapping[str, str]) -> tuple[str, str]:
    """(name, compute capability) of the node's first GPU; ("cpu", "") without nvidia-smi."""
    smi = _which("nvidia-smi", env)
    if smi is None:
        return "cpu", ""
    try:
        done = subprocess.run(
            [smi, "--query-gpu=name,compute_cap", "--format=csv,noheader", "--id=0"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "", ""
    name, comma, arch = done.stdout.strip().partition("\n")[0].rpartition(",")
    return (name.strip(), arch.strip()) if comma else ("", "")


def vec_isa_ok_part(env: Mapping[str, str]) -> str:
    """What inductor makes of the engine's ``TORCHINDUCTOR_VEC_ISA_OK``, as a key part.

    ``1``: trust the CPU's flags (the pod's value, or prewarm exec's when the pod
    has none); ``0``: no vector instruction set at all (scalar kernels); any other
    value, empty included: inductor's own build-and-load checks.
    """
    value = env.get(VEC_ISA_OK, "1")
    return value if value in ("0", "1") else "check"


def engine_runtime_fields(
    engine: str, versions: Mapping[str, str], env: Mapping[str, str]
) -> dict[str, str]:
    """Key parts (as ``--compile-key`` text) from a probe's ``versions`` and the node's GPU."""
    cuda = versions.get("build_cuda", "")
    hip = versions.get("build_hip", "")
    gpu_name, gpu_arch = _gpu(env)
    fields = {
        "torch_version": versions.get("torch", ""),
        "triton_version": next(
            (versions[name] for name in _TRITON_DISTRIBUTIONS if versions.get(name)), ""
        ),
        "cuda_version": cuda or (f"rocm-{hip}" if hip else ""),
        "gpu_name": gpu_name,
        "extras.python": versions.get("python", ""),
    }
    if engine in ("vllm", "sglang"):
        fields["engine_version"] = versions.get(engine, "")
    if gpu_arch:
        fields["extras.gpu_arch"] = gpu_arch
    if gpu_name == "cpu":
        fields["extras.inductor_vec_isa_ok"] = vec_isa_ok_part(env)
    return {name: value for name, value in fields.items() if value}
