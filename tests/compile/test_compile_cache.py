"""Compile caches end to end: the real daemon, the real S3 server, real torch.compile.

The cache's own logic (index, restore, upload, pull, damaged archives) is
tested in process over MemorySource in test_compile_caches.py (verdicts in
test_compile_verdicts.py); here is what needs the socket and a real compiler:
one cold compile on a first node, published when its launch reports ready,
then new nodes that restore it and report a hit (same shapes) or a partial
miss (a new shape).

The compile runs in child processes (tests/compile/compile_probe.py) with the env vars
from the agent's handle, the inductor backend on the CPU, and TMPDIR inside the
test's own directory, so nothing is left behind outside it. Precompiled headers
are turned off in the children: inductor would otherwise rebuild a 150 MB
header in every fresh TMPDIR, cold and warm alike, which only makes the tests
slower. So is inductor's build-and-load check of the CPU's vector ISA
(TORCHINDUCTOR_VEC_ISA_OK=1 trusts /proc/cpuinfo): C++ builds in every cold
child (its first call here: 26 s with them, 9 s without), and no part of what a
compile cache is tested for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import AgentFactory, when_logged

from agent.client import (
    Client,
    CompileCacheHandle,
    CompileKeyParts,
    CompileReady,
    InvalidRequest,
    detect_key_parts,
)
from agent.compile.archive import content_digest
from agent.testing import InProcessAgent, S3Server, SampleModel, unsealed

PROBE = Path(__file__).with_name("compile_probe.py")
UPLOAD_DEADLINE = 90.0


def _config(bucket: str) -> str:
    return f'[compile_cache]\nuri = "s3://{bucket}/compile"\nquiet_seconds = 0.5\n'


def _run_probe(
    handle: CompileCacheHandle, scratch: Path, *, batch: int = 2, sequence: int = 16
) -> dict[str, Any]:
    scratch.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        **handle.env,
        "TMPDIR": str(scratch),
        "XDG_CACHE_HOME": str(scratch / "xdg"),
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
        "TORCHINDUCTOR_VEC_ISA_OK": "1",
    }
    done = subprocess.run(
        [sys.executable, str(PROBE), str(batch), str(sequence)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _counters(probe: dict[str, Any]) -> str:
    return (
        f"FX graph {probe['fxgraph_cache_hit']} hit / {probe['fxgraph_cache_miss']} miss, "
        f"AOTAutograd {probe['aotautograd_cache_hit']} hit / {probe['aotautograd_cache_miss']} miss"
    )


def _pointer(s3_client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    try:
        body = s3_client.get_object(Bucket=bucket, Key=f"compile/node/{key}/manifest.json")["Body"]
    except s3_client.exceptions.NoSuchKey:
        return None
    document: dict[str, Any] = unsealed(body.read())
    return document


def _parts() -> CompileKeyParts:
    return detect_key_parts(model_key="tiny-transformer", config_hash="probe-v1")


@pytest.fixture
def parts() -> CompileKeyParts:
    return _parts()


@dataclass(frozen=True)
class UploadedCache:
    """A key compiled cold on a first node and uploaded to ``bucket``."""

    bucket: str
    cold_handle: CompileCacheHandle
    first_disk_root: Path
    cold: dict[str, Any]
    cold_ready: CompileReady
    digest: str
    file_count: int


@pytest.fixture(scope="module")
def uploaded_cache(
    s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UploadedCache]:
    """One cold compile, published at ready: the S3 state every "new node" test starts from.

    A cold compile costs 12-60 s here, so the tests of a new node share one.
    The first node is stopped (and its disk removed) before they run. It
    publishes when its launch reports ready (as ``prewarm exec --ready-url``
    does), not when quiet: a quiet-time upload can catch a kernel half-linked
    (test_compile_rewrites.py).
    """
    s3_client = s3_server.client()
    bucket = f"t-compile-cache-{uuid.uuid4().hex[:8]}"
    s3_client.create_bucket(Bucket=bucket)
    try:
        with InProcessAgent(env=s3_server.env(), config=_config(bucket)) as first:
            with Client(first.socket_path) as client:
                handle = client.compile_cache(_parts(), client_name="pod-1", publish_on_ready=True)
                cold = _run_probe(handle, tmp_path_factory.mktemp("cold"))
                ready = client.compile_ready(handle.key, client_name="pod-1")
            local = content_digest(handle.path)
            uploaded = UploadedCache(
                bucket, handle, first.disk_root, cold, ready, local.digest, local.file_count
            )
        yield uploaded
    finally:
        listed = s3_client.list_objects_v2(Bucket=bucket).get("Contents", [])
        for item in listed:
            s3_client.delete_object(Bucket=bucket, Key=item["Key"])
        s3_client.delete_bucket(Bucket=bucket)
        s3_client.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_new_node_restores_the_uploaded_cache_and_hits_it(
    uploaded_cache: UploadedCache,
    start_agent: AgentFactory,
    s3_client: Any,
    parts: CompileKeyParts,
    tmp_path: Path,
) -> None:
    """A cold compile (a miss) is uploaded; on a new node it is restored, hit, and judged hit."""
    cold, cold_handle = uploaded_cache.cold, uploaded_cache.cold_handle
    assert not cold_handle.restored
    assert "nothing uploaded yet" in cold_handle.restore_note
    assert cold_handle.path == uploaded_cache.first_disk_root / "compile" / "node" / cold_handle.key
    assert cold["fxgraph_cache_miss"] > 0
    assert cold["fxgraph_cache_hit"] == 0
    assert uploaded_cache.cold_ready.verdict.verdict == "miss"
    assert uploaded_cache.cold_ready.upload.uploaded
    assert uploaded_cache.file_count > 0
    manifest = _pointer(s3_client, uploaded_cache.bucket, cold_handle.key)
    assert manifest is not None
    assert manifest["digest"] == uploaded_cache.digest

    second = start_agent(_config(uploaded_cache.bucket))  # a new node: empty disk, the same S3
    with Client(second.socket_path) as client:
        warm_handle = client.compile_cache(parts, client_name="pod-2", publish_on_ready=True)
        assert warm_handle.restored, warm_handle.restore_note
        assert warm_handle.key == cold_handle.key
        assert warm_handle.path == second.disk_root / "compile" / "node" / warm_handle.key
        assert content_digest(warm_handle.path).digest == uploaded_cache.digest
        warm = _run_probe(warm_handle, tmp_path / "warm")
        ready = client.compile_ready(warm_handle.key, client_name="pod-2")
    print(
        f"\ncold first call {cold['first_call_seconds']:.2f} s ({_counters(cold)}), verdict "
        f"{uploaded_cache.cold_ready.verdict.describe()}, uploaded "
        f"{uploaded_cache.cold_ready.upload.bytes} bytes; restored "
        f"on a new node in {warm_handle.restore_seconds:.3f} s ({warm_handle.file_count} files, "
        f"{warm_handle.bytes} bytes), first call {warm['first_call_seconds']:.2f} s "
        f"({_counters(warm)}); verdict {ready.verdict.describe()}"
    )
    assert warm["fxgraph_cache_hit"] > 0
    assert warm["fxgraph_cache_miss"] == 0
    assert warm["first_call_seconds"] < cold["first_call_seconds"] / 2
    assert (ready.verdict.verdict, dict(ready.verdict.grown)) == ("hit", {})
    assert not ready.upload.uploaded  # a hit has nothing new to publish


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_new_shape_on_a_restored_key_is_a_partial_miss_naming_inductor(
    uploaded_cache: UploadedCache,
    start_agent: AgentFactory,
    s3_client: Any,
    parts: CompileKeyParts,
    tmp_path: Path,
) -> None:
    """A shape the restored cache lacks compiles: partial miss, inductor grew, merged into S3."""
    node = start_agent(_config(uploaded_cache.bucket))
    with Client(node.socket_path) as client:
        handle = client.compile_cache(parts, client_name="pod-3", publish_on_ready=True)
        assert handle.restored, handle.restore_note
        new_shape = _run_probe(handle, tmp_path / "new-shape", batch=4, sequence=32)
        ready = client.compile_ready(handle.key, client_name="pod-3")
        (info,) = client.list_compile_caches()
    verdict = ready.verdict
    print(
        f"\nnew shape on the restored key: first call {new_shape['first_call_seconds']:.2f} s "
        f"({_counters(new_shape)}); verdict {verdict.describe()}; uploaded "
        f"{ready.upload.bytes} bytes"
    )
    assert new_shape["fxgraph_cache_miss"] > 0
    assert verdict.verdict == "partial miss", verdict.describe()
    assert set(verdict.grown) == {"inductor"}, verdict.describe()
    files_added, bytes_added = verdict.grown["inductor"]
    assert files_added > 0
    assert bytes_added > 0
    assert info.last_verdict == verdict
    assert ready.upload.uploaded, ready.upload.skipped_reason
    manifest = _pointer(s3_client, uploaded_cache.bucket, handle.key)
    assert manifest is not None
    assert manifest["file_count"] == uploaded_cache.file_count + files_added


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
        caches = when_logged(
            agent,
            lambda: client.list_compile_caches() or None,
            "the manifest's compile cache",
            UPLOAD_DEADLINE,
        )
        (model,) = client.list_models()
    (cache,) = caches
    assert cache.parts.model_key == model.key
    assert (cache.parts.engine, cache.parts.tensor_parallel) == ("vllm", 2)
