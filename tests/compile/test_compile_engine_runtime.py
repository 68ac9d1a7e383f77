"""Key parts from the engine's own world: the interpreter the command runs in, not prewarm's.

The "engine" is a venv made here (``python -m venv --without-pip``) with
distributions that only exist as metadata (torch 2.10.0+cu128, vLLM 0.16.0,
Triton 3.6.0) and a ``vllm`` console script whose shebang names the venv's
Python: real ``importlib.metadata`` in a real other interpreter. The
launches are the real ``prewarm exec`` against the real daemon.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from agent_helpers import AgentFactory

from agent.client import Client
from agent.compile.engine_runtime import interpreter_of, probe_interpreter
from agent.testing import SampleModel

# The engine stand-in: says where its cache is, writes one artifact, and says it is ready.
ENGINE_SCRIPT = """\
import getpass, json, os, pathlib, sys
root = pathlib.Path(os.environ["VLLM_CACHE_ROOT"])
(root / "torch_compile_cache").mkdir(parents=True, exist_ok=True)
(root / "torch_compile_cache" / "graph.py").write_text(" ".join(sys.argv))
if os.environ.get("READY_FILE"):
    pathlib.Path(os.environ["READY_FILE"]).touch()
headers = pathlib.Path(os.environ["TMPDIR"], "torchinductor_" + getpass.getuser())
seen = {"root": str(root), "tmpdir": os.environ["TMPDIR"]}
seen["headers"] = str((headers / "precompiled_headers").resolve())
seen["vec_isa_ok"] = os.environ.get("TORCHINDUCTOR_VEC_ISA_OK")
print(json.dumps(seen))
"""
TORCH_VERSION_PY = """\
from typing import Optional
__version__ = '2.10.0+cu128'
cuda: Optional[str] = '12.8'
hip: Optional[str] = None
"""


def _distribution(site: Path, name: str, version: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture
def engine_venv(tmp_path: Path) -> Path:
    """A venv apart from prewarm's with torch, vLLM and Triton as metadata; its bin directory."""
    venv = tmp_path / "engine"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    _distribution(site, "torch", "2.10.0+cu128")
    _distribution(site, "vllm", "0.16.0")
    _distribution(site, "triton", "3.6.0")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (site / "torch" / "version.py").write_text(TORCH_VERSION_PY)
    script = venv / "bin" / "vllm"
    script.write_text(f"#!{venv / 'bin' / 'python'}\n{ENGINE_SCRIPT}")
    script.chmod(0o755)
    return venv / "bin"


def _env(bin_dir: Path, socket: Path, **more: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PREWARM_") and k != "TORCHINDUCTOR_VEC_ISA_OK"
    }
    env["PREWARM_SOCKET_PATH"] = str(socket)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
    return {**env, **more}


def _exec(
    uri: str, flags: list[str], env: dict[str, str], *options: str
) -> subprocess.CompletedProcess[str]:
    launcher = [sys.executable, "-m", "agent.cli", "exec", uri, "--compile-key", "engine=vllm"]
    return subprocess.run(
        [*launcher, *options, "--", "vllm", "serve", "{model}", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_the_interpreter_is_found_from_a_console_script_and_python_m(engine_venv: Path) -> None:
    """``vllm`` (its shebang) and ``python3 -m vllm...`` both lead to the engine's Python."""
    env = {"PATH": str(engine_venv)}
    python = interpreter_of(["vllm", "serve", "m"], env)
    assert python == str(engine_venv / "python")
    assert interpreter_of(["python3", "-m", "vllm.entrypoints.openai.api_server"], env) == str(
        engine_venv / "python3"
    )
    assert interpreter_of(["/bin/sh", "-c", "vllm serve m"], env) is None


def test_pips_sh_trampoline_for_long_paths_leads_to_its_python(
    engine_venv: Path, tmp_path: Path
) -> None:
    """A console script pip wrote as ``#!/bin/sh`` + ``'''exec' PYTHON`` is followed too."""
    script = tmp_path / "sglang"
    script.write_text(f"#!/bin/sh\n'''exec' \"{engine_venv / 'python'}\" \"$0\" \"$@\"\n' '''\n")
    script.chmod(0o755)
    assert interpreter_of([str(script)], {}) == str(engine_venv / "python")


def test_the_probe_reads_the_engines_versions_without_importing_torch(engine_venv: Path) -> None:
    """Torch, vLLM, Triton and torch's CUDA build, from metadata (torch's import would fail)."""
    versions = probe_interpreter(str(engine_venv / "python"), {"PATH": str(engine_venv)})
    assert versions["torch"] == "2.10.0+cu128"
    assert (versions["vllm"], versions["triton"], versions["build_cuda"]) == (
        "0.16.0",
        "3.6.0",
        "12.8",
    )


@pytest.mark.slow  # two prewarm exec runs, each a fresh interpreter
def test_an_engine_in_another_venv_keys_on_its_own_versions(
    start_agent: AgentFactory, small_model: SampleModel, engine_venv: Path
) -> None:
    """prewarm's torch is 2.13; the engine's 2.10.0+cu128 (and its vLLM, Triton, CUDA) key."""
    agent = start_agent()
    done = _exec(small_model.uri, [], _env(engine_venv, agent.socket_path))
    assert done.returncode == 0, done.stderr
    with Client(agent.socket_path) as client:
        (cache,) = client.list_compile_caches()
    parts = cache.parts
    assert (parts.torch_version, parts.engine_version) == ("2.10.0+cu128", "0.16.0")
    assert (parts.triton_version, parts.cuda_version) == ("3.6.0", "12.8")
    assert parts.gpu_name == "cpu"  # no nvidia-smi on this machine
    seen = json.loads(done.stdout)
    assert seen["root"] == str(cache.path / "vllm")
    # Inductor's precompiled headers go to the key, through a private TMPDIR gone after.
    assert seen["headers"] == str((cache.path / "inductor" / "precompiled_headers").resolve())
    assert not Path(seen["tmpdir"]).exists()
    # No GPU: inductor is told the CPU's vector instruction sets build (no probe per start),
    # and the key says so: the probe writes builds of its own into the cache.
    assert seen["vec_isa_ok"] == "1"
    assert parts.extras["inductor_vec_isa_ok"] == "1"


@pytest.mark.slow  # two prewarm exec runs, each a fresh interpreter
def test_a_pods_own_vec_isa_setting_is_kept_and_keys_apart(
    start_agent: AgentFactory, small_model: SampleModel, engine_venv: Path
) -> None:
    """A pod's own TORCHINDUCTOR_VEC_ISA_OK is kept and keyed as inductor reads it: empty
    (inductor's own checks) is ``check``, 0 (scalar kernels) is ``0``; neither is the key of
    pods that run with prewarm's 1."""
    agent = start_agent()
    for value in ("", "0"):
        env = _env(engine_venv, agent.socket_path, TORCHINDUCTOR_VEC_ISA_OK=value)
        done = _exec(small_model.uri, [], env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["vec_isa_ok"] == value
    with Client(agent.socket_path) as client:
        parts = sorted(c.parts.extras["inductor_vec_isa_ok"] for c in client.list_compile_caches())
    assert parts == ["0", "check"]


@pytest.mark.slow  # three prewarm exec runs, each a fresh interpreter
def test_a_changed_setting_is_named_with_the_nearest_key_and_pod_local_values_share_it(
    start_agent: AgentFactory, small_model: SampleModel, engine_venv: Path, tmp_path: Path
) -> None:
    """Two pods differing only in host, port and side channel share a key; a third with more
    batched tokens misses, and exec names the nearest key and the flag that changed."""
    agent = start_agent()
    env = _env(engine_venv, agent.socket_path)
    pod_a = ["--max-num-batched-tokens", "8192", "--host", "10.0.0.1", "--port", "8000"]
    pod_b = ["--max-num-batched-tokens", "8192", "--host", "10.0.0.2", "--port", "8001"]
    for flags, side_channel in ((pod_a, "10.0.0.1"), (pod_b, "10.0.0.2")):
        done = _exec(small_model.uri, flags, {**env, "VLLM_NIXL_SIDE_CHANNEL_HOST": side_channel})
        assert done.returncode == 0, done.stderr
    with Client(agent.socket_path) as client:
        (shared,) = client.list_compile_caches()

    ready = tmp_path / "ready"
    done = _exec(
        small_model.uri,
        ["--max-num-batched-tokens", "16384"],
        {**env, "READY_FILE": str(ready)},
        "--ready-file",
        str(ready),
    )
    assert done.returncode == 0, done.stderr
    why = (
        f"nearest cached key {shared.key[:12]} differs in "
        "extras.flag.max_num_batched_tokens 8192 -> 16384"
    )
    assert why in done.stderr  # on the new key's line, before the launch
    verdict = next(line for line in done.stderr.splitlines() if ": miss:" in line)
    assert why in verdict, done.stderr
