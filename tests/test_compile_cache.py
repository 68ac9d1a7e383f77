"""Compile caches end to end: the real daemon, the real S3 server, real torch.compile.

The cache's own logic (index, restore, upload, pull, damaged archives) is
tested in process over MemorySource in test_compile_caches.py; here is what
needs the socket, the watcher's automatic upload and a real compiler.

The compile runs in child processes (tests/compile_probe.py) with the env vars
from the agent's handle, the inductor backend on the CPU, and TMPDIR inside the
test's own directory, so nothing is left behind outside it. Precompiled headers
are turned off in the children: inductor would otherwise rebuild a 150 MB
header in every fresh TMPDIR, cold and warm alike, which only makes the tests
slower.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
from agent_helpers import AgentFactory, RunningAgent
from watchfiles._rust_notify import RustNotify

from agent.client import (
    Client,
    CompileCacheHandle,
    CompileKeyParts,
    InvalidRequest,
    detect_key_parts,
)
from agent.compile.archive import content_digest
from agent.testing import SampleModel

PROBE = Path(__file__).with_name("compile_probe.py")
UPLOAD_DEADLINE = 90.0

T = TypeVar("T")


def _config(bucket: str) -> str:
    return f'[compile_cache]\nuri = "s3://{bucket}/compile"\nquiet_seconds = 0.5\n'


def _run_probe(handle: CompileCacheHandle, scratch: Path) -> dict[str, Any]:
    scratch.mkdir(parents=True)
    env = {
        **os.environ,
        **handle.env,
        "TMPDIR": str(scratch),
        "XDG_CACHE_HOME": str(scratch / "xdg"),
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
    }
    done = subprocess.run(
        [sys.executable, str(PROBE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _pointer(s3_client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    try:
        body = s3_client.get_object(Bucket=bucket, Key=f"compile/{key}/manifest.json")["Body"]
    except s3_client.exceptions.NoSuchKey:
        return None
    document: dict[str, Any] = json.loads(body.read())
    return document


def _once(agent: RunningAgent, condition: Callable[[], T | None], what: str) -> T:
    """``condition()``'s first non-None answer, asked again each time the agent logs.

    Whatever the agent does that a test waits for here (an upload, a restore)
    ends with a log line, so a change of its log file is the moment to look
    again. The watch starts before the first look, so no line can slip between.
    """
    deadline = time.monotonic() + UPLOAD_DEADLINE
    with RustNotify([str(agent.log_path)], False, False, 0, False, False) as log_changes:
        while (answer := condition()) is None:
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0, f"{what} within {UPLOAD_DEADLINE} s"
            changes = log_changes.watch(50, 10, left_ms, None)
            if changes == "signal":
                raise KeyboardInterrupt
            if changes == "timeout":
                answer = condition()
                assert answer is not None, f"{what} within {UPLOAD_DEADLINE} s"
                break
    return answer


def _wait_for_pointer(
    agent: RunningAgent, s3_client: Any, bucket: str, key: str, digest: str
) -> dict[str, Any]:
    """The manifest once its union has ``digest``: the agent's upload has finished."""

    def naming_digest() -> dict[str, Any] | None:
        pointer = _pointer(s3_client, bucket, key)
        return pointer if pointer is not None and pointer["digest"] == digest else None

    return _once(agent, naming_digest, f"no upload of {digest}")


@pytest.fixture
def parts() -> CompileKeyParts:
    return detect_key_parts(model_key="tiny-transformer", config_hash="probe-v1")


@pytest.mark.slow
def test_a_new_node_restores_the_uploaded_cache_and_hits_it(
    start_agent: AgentFactory,
    s3_client: Any,
    bucket: str,
    parts: CompileKeyParts,
    tmp_path: Path,
) -> None:
    """A filled cache is uploaded once quiet; a new node restores it and torch.compile hits it."""
    first = start_agent(_config(bucket))
    with Client(first.socket_path) as client:
        cold_handle = client.compile_cache(parts, client_name="pod-1")
    assert not cold_handle.restored
    assert "nothing uploaded yet" in cold_handle.restore_note
    assert cold_handle.path == first.disk_root / "compile" / cold_handle.key

    cold = _run_probe(cold_handle, tmp_path / "cold")
    assert cold["fxgraph_cache_miss"] > 0
    assert cold["fxgraph_cache_hit"] == 0
    local = content_digest(cold_handle.path)
    assert local.file_count > 0
    pointer = _wait_for_pointer(first, s3_client, bucket, cold_handle.key, local.digest)
    assert pointer["file_count"] == local.file_count

    second = start_agent(_config(bucket))  # a new node: empty disk, the same S3
    with Client(second.socket_path) as client:
        warm_handle = client.compile_cache(parts, client_name="pod-2")
    assert warm_handle.restored, warm_handle.restore_note
    assert warm_handle.key == cold_handle.key
    assert warm_handle.path == second.disk_root / "compile" / warm_handle.key
    assert content_digest(warm_handle.path).digest == local.digest

    warm = _run_probe(warm_handle, tmp_path / "warm")
    print(
        f"\ncold first call {cold['first_call_seconds']:.2f} s, warm first call on the new "
        f"node {warm['first_call_seconds']:.2f} s (restore {warm_handle.restore_seconds:.3f} s, "
        f"{warm_handle.file_count} files, {warm_handle.bytes} bytes), "
        f"fxgraph hits {warm['fxgraph_cache_hit']}"
    )
    assert warm["fxgraph_cache_hit"] > 0
    assert warm["fxgraph_cache_miss"] == 0
    assert warm["first_call_seconds"] < cold["first_call_seconds"] / 2


def test_another_key_part_gives_another_directory(
    start_agent: AgentFactory, parts: CompileKeyParts
) -> None:
    """Each distinct set of key parts gets its own directory; the same parts get the same one."""
    agent = start_agent()
    with Client(agent.socket_path) as client:
        one = client.compile_cache(parts)
        other = client.compile_cache(replace(parts, torch_version=parts.torch_version + ".post1"))
        again = client.compile_cache(parts)
    assert one.key != other.key
    assert one.path != other.path
    assert one.path.is_dir()
    assert other.path.is_dir()
    assert again.path == one.path
    assert one.restore_note == "compile_cache.uri is not set: local only"
    assert one.env["TORCHINDUCTOR_CACHE_DIR"] == str(one.path / "inductor")


def test_parts_without_a_torch_version_are_refused(start_agent: AgentFactory) -> None:
    """Key parts without a torch_version are refused as an invalid request."""
    agent = start_agent()
    with Client(agent.socket_path) as client, pytest.raises(InvalidRequest, match="torch_version"):
        client.compile_cache(engine="vllm", model_key="m")


def test_a_manifest_entry_restores_its_compile_cache_with_the_model(
    start_agent: AgentFactory, small_model: SampleModel, tmp_path: Path
) -> None:
    """A manifest's [model.compile] table creates the compile cache keyed to the pulled model."""
    manifests = tmp_path / "models.d"
    manifests.mkdir()
    (manifests / "m.toml").write_text(
        f'[[model]]\nuri = "{small_model.uri}"\n'
        '[model.compile]\nengine = "vllm"\ntorch_version = "2.13.0"\ntensor_parallel = 2\n'
    )
    agent = start_agent(f'[manifests]\ndirectory = "{manifests}"\n')
    with Client(agent.socket_path) as client:
        caches = _once(
            agent,
            lambda: client.list_compile_caches() or None,
            "the manifest's compile cache never appeared",
        )
        (model,) = client.list_models()
    (cache,) = caches
    assert cache.parts.model_key == model.key
    assert (cache.parts.engine, cache.parts.tensor_parallel) == ("vllm", 2)
