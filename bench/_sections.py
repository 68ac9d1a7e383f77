"""The warm and profile sections, and how each run is recorded.

Scaling is in ``_scaling``, hits in ``_hits``.

Every function here takes the run's ``Context`` and returns what the report
needs; a run that fails is recorded in its sample as an error and the suite
carries on with the next one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.client import Client

from . import _agent as agent
from . import _profile as profiling
from ._contenders import Context, RunResult
from ._model import BenchModel
from ._s3rver import S3rver
from ._schemes import row
from ._stats import Sample

__all__ = [
    "BUCKET",
    "RESULTS",
    "attempt",
    "calibrate",
    "cold_runner",
    "compare_name",
    "profile",
    "say",
    "warm",
]

MiB = 1024**2
GiB = 1024**3
BUCKET = "bench"
# What TLS may add to the bytes a server writes for a body: a record's header
# and tag are 29 bytes per 16 KiB at most (0.2%); s3rver may write smaller records.
TLS_FRAMING_ALLOWANCE = 0.02
_HERE = Path(__file__).resolve().parent
RESULTS = _HERE / "results"


def _record(sample: Sample, result: RunResult) -> None:
    sample.add(result.seconds)
    sample.nbytes = result.nbytes
    runs = sample.extra.setdefault("runs", [])
    runs.append(
        {
            "seconds": result.seconds,
            "bytes": result.nbytes,
            "client_cpu": result.client_cpu,
            "server_cpu": result.server_cpu,
            "served": result.served,
            **result.extra,
        }
    )
    best = min(runs, key=lambda run: run["seconds"])
    sample.extra["client_cpu"] = best["client_cpu"]
    sample.extra["server_cpu"] = best["server_cpu"]
    if best.get("cpu"):
        # The best run's CPU per GiB (whole process, busiest thread), as its time.
        sample.extra["cpu"] = best["cpu"]
    sample.extra["served_ratio"] = max(run["served"] for run in runs) / max(result.nbytes, 1)
    hwm = [run["vm_hwm"] for run in runs if "vm_hwm" in run]
    if hwm:
        # The worst run's peaks: what a node must leave room for.
        sample.extra["peak_vm_hwm"] = max(hwm)
        sample.extra["peak_sampled_rss"] = max(run["sampled_peak_rss"] for run in runs)
        sample.extra["peak_sampled_pss"] = max(run["sampled_peak_pss"] for run in runs)


def attempt(sample: Sample, run: Callable[[], RunResult]) -> None:
    """Run one measurement into ``sample``; a failure is recorded there and not retried."""
    if sample.error is not None:
        return  # failed before; do not pay for it again
    try:
        _record(sample, run())
    except Exception as exc:
        lines = [line for line in f"{type(exc).__name__}: {exc}".splitlines() if line.strip()]
        # The first line says what failed; the last one (a child's stderr) why.
        sample.error = " ... ".join(dict.fromkeys([lines[0][:300], lines[-1][:300]]))
        print(f"  {sample.name} failed: {sample.error}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)


def say(text: str) -> None:
    """A timestamped progress line on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def warm(args: argparse.Namespace, ctx: Context, model: BenchModel) -> dict[str, Sample]:
    """Repeat launches in new processes against one daemon that holds the model."""
    sample = Sample("prewarm warm launch", extra={"transfer": False})
    say("warm launches (EnsureModel hit + load_safetensors + read every tensor)")
    with agent.running_agent(ctx, None) as daemon:
        with Client(daemon.socket_path) as client:
            client.ensure(model.uri)  # pulls it once
        for _ in range(args.repeats):
            attempt(sample, lambda: agent.warm_launch(ctx, daemon, model))
    paged = Sample("prewarm warm launch, every page read", extra={"transfer": False})
    for run in sample.extra.get("runs", []):
        paged.add(float(run["with_every_page"]))
        paged.nbytes = sample.nbytes
    paged.error = sample.error
    return {sample.name: sample, paged.name: paged}


def compare_name(source: Path) -> str:
    """The row name for a cold pull by another checkout, labelled with its commit."""
    result = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    label = result.stdout.strip() or source.name
    return f"prewarm cold (aiobotocore, {label})"


def cold_runner(ctx: Context, model: BenchModel, plane: str | None) -> Callable[[], RunResult]:
    """A cold pull on ``plane`` that fails if the agent reports another plane."""

    def run() -> RunResult:
        result = agent.cold_pull(ctx, model, plane)
        reported = str(result.extra.get("plane", ""))
        if plane is not None and not reported.startswith(plane):
            # The knob exists but this agent has no such plane yet (it fell back).
            raise RuntimeError(
                f"the agent reports data_plane={reported!r} when configured with {plane!r}; "
                "that plane is not available in this build"
            )
        return result

    return run


def calibrate(server: S3rver, uploads: Any, work: Path) -> dict[str, Any]:
    """Check that the server's write counter moves by the bytes of a GET (TLS framing allowed).

    ``uploads``: a client of the server uploads go through (the same store).
    Over HTTPS the counter also counts each TLS record's header and tag
    (about 0.2% at 16 KiB records) and the handshake; ``per_byte`` says how
    much the counter moves per byte of body, for reading bytes served.
    """
    size = 8 * MiB
    key = "calibration.bin"
    path = work / key
    path.write_bytes(os.urandom(size))
    uploads.upload_file(str(path), BUCKET, key)
    path.unlink()
    client = server.client()
    before = server.bytes_sent()
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    counted = server.bytes_sent() - before
    client.close()
    slack = size * TLS_FRAMING_ALLOWANCE if server.tls is not None else 0
    if len(body) != size or not size <= counted <= size + slack + 64 * 1024:
        raise RuntimeError(
            f"s3rver's write counter ({server.scheme}) moved by {counted} bytes for a "
            f"{size}-byte GET; it cannot count bytes served on this system"
        )
    return {
        "scheme": server.scheme,
        "get_bytes": size,
        "counted": counted,
        "overhead": counted - size,
        "per_byte": counted / size,
    }


def profile(
    args: argparse.Namespace,
    *,
    ctx: Context,
    samples: dict[str, Sample],
    model: BenchModel,
    planes: list[str],
    default_plane: str,
) -> dict[str, Any]:
    """py-spy profiles of cold pulls (always, or below 0.9x the ceiling) and fallocate's cost.

    Over ``ctx``'s scheme only: the GIL columns cover every scheme.
    """
    if args.profile == "never":
        return {}
    scheme = ctx.server.scheme
    ceiling = samples.get(row("ceiling", scheme))
    profiles: dict[str, Any] = {}
    for plane in planes or [default_plane]:
        cold = samples.get(row(f"prewarm cold ({plane})", scheme))
        if cold is None or not cold.ok:
            continue
        below = ceiling is not None and ceiling.ok and ceiling.best / cold.best < 0.9
        if args.profile == "auto" and not below:
            continue
        say(f"profiling the daemon (py-spy) during a cold pull on {plane} over {scheme}")
        try:
            py_spy = profiling.install_py_spy(_HERE / ".cache")
            RESULTS.mkdir(parents=True, exist_ok=True)
            stamp = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
            output = RESULTS / f"profile-{plane}-{scheme}-{stamp}.txt"
            profiles[plane] = profiling.profile_cold_pull(
                ctx, model, plane, py_spy=py_spy, output=output
            )
            profiles[plane]["raw"] = str(output)
        except Exception as exc:
            profiles[plane] = {"error": f"{type(exc).__name__}: {exc}"}
    if profiles:
        costs = [profiling.fallocate_seconds(ctx.scratch, model) for _ in range(args.repeats)]
        profiles["fallocate"] = {"bytes": model.total_bytes, "best": min(costs), "runs": costs}
    return profiles
