"""Publish after ready, end to end: the real ``prewarm exec``, the real daemon, the real S3 server.

The launched command is tests/compile/exec_ready_child.py, which writes an artifact
into its compile cache as an engine would, and either crashes or serves a
real health endpoint that turns ready when the test says so. The verdict and
merge logic are tested in process (test_compile_verdicts.py); the Mega-Cache
helper's hits with real inductor in fresh processes are at the end.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import AgentFactory
from prometheus_client.parser import text_string_to_metric_families

from agent.testing import SampleModel, unsealed

CHILD = str(Path(__file__).with_name("exec_ready_child.py"))
MEGACACHE_PROBE = str(Path(__file__).with_name("megacache_probe.py"))
KEY_ARGS = ("--compile-key", "engine=torch", "--compile-key", "model_key=launch-test")


def _config(bucket: str) -> str:
    return f'[compile_cache]\nuri = "s3://{bucket}/compile"\nquiet_seconds = 0.2\n'


def _exec(socket_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env["PREWARM_SOCKET_PATH"] = str(socket_path)
    return subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "exec", *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _serving(socket_path: Path, uri: str, *child_args: str) -> subprocess.Popen[str]:
    """``prewarm exec --ready-url`` of the stand-in engine serving its health URL."""
    port = _free_port()
    health = f"http://127.0.0.1:{port}/health"
    command = (sys.executable, CHILD, "serve", str(port), *child_args)
    return _exec(socket_path, uri, *KEY_ARGS, "--ready-url", health, "--", *command)


def _manifests(s3_client: Any, bucket: str) -> list[str]:
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="compile/")
    return [o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith("manifest.json")]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.slow
def test_a_command_that_crashes_before_ready_uploads_nothing(
    start_agent: AgentFactory, small_model: SampleModel, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    """Exit 3 before the ready file appears: exec says so, and S3 gets no manifest."""
    agent = start_agent(_config(bucket))
    launcher = _exec(
        agent.socket_path,
        small_model.uri,
        *KEY_ARGS,
        "--ready-file",
        str(tmp_path / "ready"),
        "--",
        sys.executable,
        CHILD,
        "crash",
    )
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 3, stderr
    assert "exited with status 3 before it was ready" in stderr
    assert _manifests(s3_client, bucket) == []


@pytest.mark.slow
def test_the_cache_is_uploaded_once_the_health_url_answers_and_the_verdict_is_printed(
    start_agent: AgentFactory, small_model: SampleModel, s3_client: Any, bucket: str
) -> None:
    """Nothing is uploaded while /health says 503; after 200, exec prints 'miss' and S3 has it."""
    agent = start_agent(_config(bucket))
    launcher = _serving(agent.socket_path, small_model.uri)
    assert launcher.stdout is not None
    assert launcher.stdin is not None
    assert launcher.stderr is not None
    assert launcher.stdout.readline() == "serving\n"
    assert _manifests(s3_client, bucket) == []
    launcher.stdin.write("ready\n")
    launcher.stdin.flush()
    verdict = next(line for line in launcher.stderr if ": miss:" in line or "error" in line)
    assert "inductor +1 files" in verdict, verdict
    assert "uploaded" in verdict
    (manifest_key,) = _manifests(s3_client, bucket)
    manifest = unsealed(s3_client.get_object(Bucket=bucket, Key=manifest_key)["Body"].read())
    assert manifest["file_count"] == 1
    _, rest = launcher.communicate("exit\n", timeout=60)
    assert launcher.returncode == 0, rest


_LAUNCH_SAMPLES = ("prewarm_engine_launch_seconds_count", "prewarm_engine_launch_seconds_sum")


def _launch_samples(port: int) -> dict[str, float]:
    """prewarm_engine_launch_seconds' count and sum per phase (engine torch), as served."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _LAUNCH_SAMPLES and sample.labels["engine"] == "torch":
                suffix = sample.name.rsplit("_", 1)[1]
                samples[f"{sample.labels['phase']}.{suffix}"] = sample.value
    return samples


@pytest.mark.slow
def test_the_verdict_line_says_where_the_launch_went_and_the_agent_counts_it(
    start_agent: AgentFactory, small_model: SampleModel, bucket: str
) -> None:
    """An engine printing vLLM 0.16's start-up lines: its output still reaches exec's stdout,
    the verdict line breaks the launch down (weights, compile from the cache, KV cache and
    warm-up, the rest), and the agent counts each phase for the engine."""
    metrics_port = _free_port()
    agent = start_agent(_config(bucket) + f"\n[metrics]\nport = {metrics_port}\n")
    # An agent in this process shares the registry with earlier ones: count what grows.
    before = _launch_samples(metrics_port)
    launcher = _serving(agent.socket_path, small_model.uri, "vllm")
    assert launcher.stdout is not None
    assert launcher.stdin is not None
    assert launcher.stderr is not None
    printed = [launcher.stdout.readline() for _ in range(6)]
    assert printed[0].endswith("Loading weights took 1.25 seconds\n")
    assert printed[-1] == "serving\n"
    launcher.stdin.write("ready\n")
    launcher.stdin.flush()
    verdict = next(line for line in launcher.stderr if ": miss:" in line or "error" in line)
    took = re.search(
        r"; ready in ([\d.]+) s: weights 1\.2 s, compile 3\.2 s \(loaded from the cache\), "
        r"KV cache and warm-up 4\.3 s, start-up and the rest ([\d.]+) s$",
        verdict.strip(),
    )
    assert took, verdict
    assert float(took[2]) == pytest.approx(max(0.0, float(took[1]) - 1.5 - 7.5), abs=0.1)
    _, rest = launcher.communicate("exit\n", timeout=60)
    assert launcher.returncode == 0, rest
    after = _launch_samples(metrics_port)
    grown = {name: value - before.get(name, 0.0) for name, value in after.items()}
    assert grown["compile.count"] == 1
    assert grown["compile.sum"] == pytest.approx(3.2)
    assert grown["kv_cache_and_warmup.sum"] == pytest.approx(4.3)
    assert grown["ready.count"] == 1


def _megacache_probe(socket_path: Path, scratch: Path) -> dict[str, Any]:
    scratch.mkdir(parents=True)
    env = {
        **os.environ,
        "TMPDIR": str(scratch),  # a fresh inductor cache: hits can only come from the helper
        # As in test_compile_cache.py: no 150 MB precompiled header and no build-and-load
        # check of the CPU's vector ISA in each fresh TMPDIR (most of a cold child's time).
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
        "TORCHINDUCTOR_VEC_ISA_OK": "1",
    }
    done = subprocess.run(
        [sys.executable, MEGACACHE_PROBE, str(socket_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_the_megacache_helper_gives_fx_graph_and_aot_autograd_hits_in_a_fresh_process(
    start_agent: AgentFactory, tmp_path: Path
) -> None:
    """A second plain-PyTorch process with an empty inductor cache hits via the saved Mega-Cache."""
    agent = start_agent()
    cold = _megacache_probe(agent.socket_path, tmp_path / "cold")
    warm = _megacache_probe(agent.socket_path, tmp_path / "warm")
    print(f"\nmegacache: cold {cold}, warm {warm}")
    assert cold["fxgraph_cache_hit"] == 0
    assert warm["fxgraph_cache_hit"] > 0
    assert warm["aotautograd_cache_hit"] > 0
