"""The shaped bench's contenders and calibration, each one timed run with a deadline.

Every run reads the same model from the same shaped server. A run that passes
its deadline is killed and reported as such (its rate then is a bound, not a
measurement); one that fails is reported with its error; neither stops the
bench. The server's counters (503 SlowDowns sent) are read around each run.

Contenders:

- ``ceiling``: curl, one process, ``--parallel`` ranged GETs of presigned URLs
  (8 MiB ranges, 128 at once) to /dev/null; 503s are retried (``--retry``).
- ``s5cmd``: its defaults, and hand-tuned (~128 connections, 8 MiB parts).
- ``prewarm``: the real daemon, cold, with its defaults; and pinned to the
  hand-tuned shape (128 streams, 8 MiB).
- ``streamer``: the Run:ai Model Streamer into CPU tensors with its defaults,
  and with the seed's tuning (``ceil(size_GB / 4)`` streams, 3 s request
  timeout, 1 MiB/s low-speed limit), when it is importable.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.client import Client
from agent.testing._process import purge_tree

from ._agent import running_agent
from ._contenders import (
    STREAMER_LOW_SPEED_LIMIT,
    STREAMER_REQUEST_TIMEOUT_MS,
    Context,
    curl_range_entries,
    run_child,
    s5cmd_binary,
)
from ._model import BenchModel
from ._shaped_server import ShapedS3rver

__all__ = [
    "CONTENDERS",
    "HAND_TUNED",
    "TUNED_CHUNK",
    "TUNED_CONNECTIONS",
    "Contender",
    "Outcome",
    "calibrate",
    "daemon_log_lines",
    "s5cmd_shape",
]

MiB = 1024**2
GB = 1000**3
TUNED_CONNECTIONS = 128
TUNED_CHUNK = 8 * MiB
# What the daemon's log says about how hard it pushes and when it backs off.
_LOG_PATTERN = re.compile(r"slowdown|concurrency|in flight", re.IGNORECASE)
_LOG_LINES_KEPT = 40


@dataclass
class Outcome:
    """One contender's run: how long, how many bytes, and how it ended."""

    contender: str
    status: str  # "ok", "timeout", "failed", "skipped"
    seconds: float = 0.0
    nbytes: int = 0
    note: str = ""
    slowdowns: int = 0
    object_reads: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_per_second(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 and self.status == "ok" else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "contender": self.contender,
            "status": self.status,
            "seconds": self.seconds,
            "bytes": self.nbytes,
            "mib_per_second": self.bytes_per_second / MiB,
            "note": self.note,
            "slowdowns_sent": self.slowdowns,
            "object_reads": self.object_reads,
            **self.extra,
        }


Run = Callable[[Context, BenchModel, float], Outcome]


@dataclass(frozen=True)
class Contender:
    name: str
    run: Run
    hand_tuned: bool = False


def _server(ctx: Context) -> ShapedS3rver:
    server = ctx.server
    if not isinstance(server, ShapedS3rver):
        raise TypeError("the shaped bench runs against a ShapedS3rver")
    return server


def _timed(name: str, ctx: Context, body: Callable[[], Outcome]) -> Outcome:
    """Run ``body``, turning a deadline or an error into an outcome; count the server's 503s."""
    server = _server(ctx)
    before = server.stats()
    started = time.perf_counter()
    try:
        outcome = body()
    except subprocess.TimeoutExpired as exc:
        outcome = Outcome(name, "timeout", note=f"killed after {exc.timeout:.0f} s")
        outcome.seconds = time.perf_counter() - started
    except Exception as exc:  # one contender failing must not stop the bench
        outcome = Outcome(name, "failed", note=_one_line(exc))
        outcome.seconds = time.perf_counter() - started
    after = server.stats()
    outcome.slowdowns = int(after["slowDowns"]) - int(before["slowDowns"])
    outcome.object_reads = int(after["objectReads"]) - int(before["objectReads"])
    return outcome


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return (lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}")[:300]


# -- curl: the raw ceiling -----------------------------------------------------------------


def curl_ranges(
    ctx: Context, model: BenchModel, *, connections: int, chunk: int, timeout: float
) -> Outcome:
    """Every byte of ``model`` as ranged GETs, ``connections`` at once, to /dev/null."""
    curl = shutil.which("curl")
    if curl is None:
        raise RuntimeError("curl is not installed (apt-get install curl).")
    # 503 SlowDown is one of the answers curl's --retry retries (after 1 s, doubling).
    entries = curl_range_entries(ctx, model, chunk, retries=8)
    with tempfile.NamedTemporaryFile("w", dir=ctx.scratch, suffix=".curl") as config:
        config.write("next\n".join(entries))
        config.flush()
        argv = [curl, "--silent", "--show-error", "--noproxy", "*"]
        argv += ["--parallel", "--parallel-immediate", "--parallel-max", str(connections)]
        argv += ["--config", config.name]
        child = run_child(ctx, argv, ctx.child_env(), timeout=timeout)
    lines = [line.split() for line in child.stdout.splitlines() if line.strip()]
    nbytes = sum(int(size) for code, size in lines if code in ("200", "206"))
    if nbytes != model.total_bytes:
        codes = sorted({code for code, _ in lines})
        raise RuntimeError(f"curl fetched {nbytes} of {model.total_bytes} bytes (HTTP {codes})")
    name = f"curl ceiling ({connections} x {chunk // MiB} MiB)"
    return Outcome(name, "ok", seconds=child.wall, nbytes=nbytes, extra={"requests": len(lines)})


def _ceiling(ctx: Context, model: BenchModel, timeout: float) -> Outcome:
    name = f"curl ceiling ({TUNED_CONNECTIONS} x {TUNED_CHUNK // MiB} MiB)"
    return _timed(
        name,
        ctx,
        lambda: curl_ranges(
            ctx, model, connections=TUNED_CONNECTIONS, chunk=TUNED_CHUNK, timeout=timeout
        ),
    )


# -- s5cmd ---------------------------------------------------------------------------------


def s5cmd_shape(files: int, connections: int) -> tuple[int, int]:
    """s5cmd's ``--numworkers`` and per-file ``--concurrency`` for about ``connections`` GETs.

    One worker per file (s5cmd copies a file per worker), and the connections
    split evenly between them, rounded up.
    """
    workers = max(1, min(files, connections))
    return workers, math.ceil(connections / workers)


def _s5cmd(ctx: Context, model: BenchModel, timeout: float, *, tuned: bool) -> Outcome:
    name = "s5cmd (defaults)"
    if tuned:
        name = f"s5cmd ({TUNED_CONNECTIONS} x {TUNED_CHUNK // MiB} MiB)"

    def body() -> Outcome:
        dest = Path(tempfile.mkdtemp(prefix="s5cmd-", dir=ctx.scratch))
        try:
            argv = [s5cmd_binary(), "--endpoint-url", ctx.server.endpoint_url]
            extra: dict[str, Any] = {}
            options: list[str] = []
            if tuned:
                workers, per_file = s5cmd_shape(model.file_count, TUNED_CONNECTIONS)
                argv += ["--numworkers", str(workers)]
                options = ["--concurrency", str(per_file), "--part-size", str(TUNED_CHUNK // MiB)]
                extra = {"workers": workers, "per_file_concurrency": per_file}
            argv += ["cp", *options, f"s3://{model.bucket}/{model.prefix}*", f"{dest}/"]
            child = run_child(ctx, argv, ctx.child_env(), timeout=timeout)
            nbytes = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
        finally:
            purge_tree(dest)
        if nbytes != model.total_bytes:
            raise RuntimeError(f"s5cmd wrote {nbytes} of {model.total_bytes} bytes")
        return Outcome(name, "ok", seconds=child.wall, nbytes=nbytes, extra=extra)

    return _timed(name, ctx, body)


# -- prewarm -------------------------------------------------------------------------------


def daemon_log_lines(text: str, limit: int = _LOG_LINES_KEPT) -> tuple[int, list[str]]:
    """The daemon's log lines about concurrency and back-off: how many, and the first/last few."""
    found = [line.rstrip() for line in text.splitlines() if _LOG_PATTERN.search(line)]
    if len(found) <= limit:
        return len(found), found
    half = limit // 2
    return len(found), [*found[:half], f"… {len(found) - limit} more …", *found[-half:]]


def _prewarm(ctx: Context, model: BenchModel, timeout: float, *, pinned: bool) -> Outcome:
    name = "prewarm (defaults)"
    if pinned:
        name = f"prewarm ({TUNED_CONNECTIONS} x {TUNED_CHUNK // MiB} MiB)"
        ctx = Context(
            server=ctx.server,
            concurrency=TUNED_CONNECTIONS,
            chunk=TUNED_CHUNK,
            scratch=ctx.scratch,
            agent_env=ctx.agent_env,
        )

    def body() -> Outcome:
        with running_agent(ctx, None, pinned=pinned) as agent:
            try:
                outcome = _ensure(name, agent.socket_path, model, timeout)
            finally:
                count, lines = daemon_log_lines(_read(agent.log_path))
        outcome.extra |= {"log_matches": count, "log_lines": lines}
        return outcome

    return _timed(name, ctx, body)


def _ensure(name: str, socket: Path, model: BenchModel, timeout: float) -> Outcome:
    """One cold EnsureModel with a deadline; a failure is an outcome, not an exception."""
    with Client(socket, timeout=timeout) as client:
        started = time.perf_counter()
        try:
            handle = client.ensure(model.uri, tier="shm")
        except Exception as exc:
            seconds = time.perf_counter() - started
            status = "timeout" if seconds >= timeout * 0.99 else "failed"
            return Outcome(name, status, seconds=seconds, note=_one_line(exc))
        seconds = time.perf_counter() - started
        plane = client.status().data_plane
    if handle.hit:
        return Outcome(name, "failed", seconds=seconds, note="the cold pull was a cache hit")
    if handle.total_bytes != model.total_bytes:
        note = f"published {handle.total_bytes} of {model.total_bytes} bytes"
        return Outcome(name, "failed", seconds=seconds, note=note)
    return Outcome(name, "ok", seconds=seconds, nbytes=handle.total_bytes, extra={"plane": plane})


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# -- the Run:ai Model Streamer -------------------------------------------------------------


def streamer_available() -> bool:
    return importlib.util.find_spec("runai_model_streamer") is not None


def seed_streams(nbytes: int) -> int:
    """The seed's tuning for the streamer: one stream per 4 GB of model, at least one."""
    return max(1, math.ceil(nbytes / (4 * GB)))


def _streamer(ctx: Context, model: BenchModel, timeout: float, *, seed: bool) -> Outcome:
    streams = seed_streams(model.total_bytes)
    name = (
        f"streamer (seed: {streams} stream{'s' * (streams > 1)})" if seed else "streamer (defaults)"
    )
    if not streamer_available():
        return Outcome(name, "skipped", note="runai_model_streamer is not importable in this venv")
    env: dict[str, str] = {}
    if seed:
        env = {
            "RUNAI_STREAMER_CONCURRENCY": str(streams),
            "RUNAI_STREAMER_MEMORY_LIMIT": "-1",
            "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": str(STREAMER_REQUEST_TIMEOUT_MS),
            "RUNAI_STREAMER_S3_LOW_SPEED_LIMIT": str(STREAMER_LOW_SPEED_LIMIT),
        }

    def body() -> Outcome:
        # --concurrency/--chunk are the worker's required arguments; the
        # streamer itself reads only its environment.
        argv = [sys.executable, "-m", "bench._worker", "streamer", "--bucket", model.bucket]
        argv += ["--concurrency", "0", "--chunk", "0", *model.shard_keys]
        child = run_child(ctx, argv, ctx.child_env(env), timeout=timeout)
        report = json.loads(child.stdout.strip().splitlines()[-1])
        shard_bytes = sum(size for key, size in model.objects if key in model.shard_keys)
        nbytes = int(report["bytes"])
        # Tensor bytes: each shard less its safetensors header.
        if nbytes < shard_bytes * 0.99:
            raise RuntimeError(f"the streamer returned {nbytes} of {shard_bytes} bytes")
        extra = {"env": env, "process_wall": child.wall}
        return Outcome(name, "ok", seconds=float(report["seconds"]), nbytes=nbytes, extra=extra)

    return _timed(name, ctx, body)


def _bound(run: Callable[..., Outcome], **options: bool) -> Run:
    def bound(ctx: Context, model: BenchModel, timeout: float) -> Outcome:
        return run(ctx, model, timeout, **options)

    return bound


CONTENDERS: tuple[Contender, ...] = (
    Contender("ceiling", _ceiling, hand_tuned=True),
    Contender("s5cmd-tuned", _bound(_s5cmd, tuned=True), hand_tuned=True),
    Contender("s5cmd", _bound(_s5cmd, tuned=False)),
    Contender("prewarm", _bound(_prewarm, pinned=False)),
    Contender("prewarm-pinned", _bound(_prewarm, pinned=True)),
    Contender("streamer", _bound(_streamer, seed=False)),
    Contender("streamer-seed", _bound(_streamer, seed=True)),
)
HAND_TUNED = tuple(c.name for c in CONTENDERS if c.hand_tuned)


# -- calibration ---------------------------------------------------------------------------


def single_connection(ctx: Context, model: BenchModel, *, seconds: float) -> dict[str, Any]:
    """One ranged GET sized to last about ``seconds`` at the profile's per-connection rate."""
    server = _server(ctx)
    key, size = max(model.objects, key=lambda item: item[1])
    length = min(size, max(MiB, int(server.profile.per_connection * seconds)))
    client = server.client(signature_version="s3v4")
    url = client.generate_presigned_url(
        "get_object", Params={"Bucket": model.bucket, "Key": key}, ExpiresIn=3600
    )
    client.close()
    argv = ["curl", "--silent", "--show-error", "--noproxy", "*", "--output", "/dev/null"]
    argv += ["--range", f"0-{length - 1}", "--write-out"]
    argv += ["%{http_code} %{size_download} %{time_starttransfer} %{time_total}"]
    if server.ca_bundle is not None:
        argv += ["--cacert", str(server.ca_bundle)]
    result = subprocess.run(
        [*argv, url], capture_output=True, text=True, timeout=seconds * 10 + 30, check=False
    )
    code, nbytes, first, total = result.stdout.split()
    if code != "206":
        raise RuntimeError(f"single GET answered HTTP {code}: {result.stderr.strip()}")
    body_seconds = float(total) - float(first)
    rate = int(nbytes) / body_seconds if body_seconds > 0 else 0.0
    return {
        "bytes": int(nbytes),
        "first_byte_ms": float(first) * 1000,
        "seconds": float(total),
        "bytes_per_second": rate,
        "of_per_connection": rate / server.profile.per_connection,
    }


def calibrate(
    ctx: Context, model: BenchModel, *, connections: Sequence[int], timeout: float
) -> dict[str, Any]:
    """One connection's rate, then the raw ceiling at each count of ``connections``."""
    report: dict[str, Any] = {"single": single_connection(ctx, model, seconds=3.0)}
    for count in connections:
        run = functools.partial(
            curl_ranges, ctx, model, connections=count, chunk=TUNED_CHUNK, timeout=timeout
        )
        outcome = _timed(f"curl ceiling ({count} x {TUNED_CHUNK // MiB} MiB)", ctx, run)
        report[f"ceiling_{count}"] = outcome.to_json()
    return report
