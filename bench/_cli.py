"""``python -m bench``: one run of the whole suite; prints a table and writes JSON."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import json
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ByteSize, TypeAdapter

from . import _agent as agent
from . import _contenders as contenders
from ._contenders import Context, RunResult
from ._model import BenchModel, publish_model
from ._report import judge_targets, markdown_table, text_table
from ._s3rver import S3RVER_VERSION, S3rver
from ._stats import Sample, linear_fit

MiB = 1024**2
GiB = 1024**3
BUCKET = "bench"
PLANES = ("aiobotocore", "streamer")
# The agent as installed: its own plane choice and tuning (concurrency from model size).
DEFAULTS = "prewarm cold (agent defaults)"
SECTIONS = ("ceiling", "s5cmd", "boto3", "streamer", "cold", "concurrent", "warm", "scale", "hits")
_HERE = Path(__file__).resolve().parent
RESULTS = _HERE / "results"


def _size(text: str) -> int:
    return int(TypeAdapter(ByteSize).validate_python(text))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--size", type=_size, default=2 * GiB, help="model size (default 2GiB)")
    parser.add_argument("--shards", type=int, default=8, help="safetensors shards (default 8)")
    parser.add_argument("--concurrency", type=int, default=16, help="parallel GETs (default 16)")
    parser.add_argument("--chunk", type=_size, default=64 * MiB, help="range size (default 64MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement")
    parser.add_argument("--clients", type=int, default=8, help="concurrent cold clients")
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})",
    )
    parser.add_argument(
        "--scale",
        default="0.5,1,2",
        help="cold-scaling model sizes as multiples of --size (default 0.5,1,2)",
    )
    parser.add_argument("--hit-calls", type=int, default=30, help="EnsureModel calls per hit")
    parser.add_argument(
        "--profile",
        choices=("auto", "always", "never"),
        default="auto",
        help="py-spy the daemon during a cold pull (auto: when below 0.9x the ceiling)",
    )
    parser.add_argument(
        "--planes",
        default=",".join(PLANES),
        help=f"data planes for the cold section (default {','.join(PLANES)})",
    )
    parser.add_argument(
        "--compare-source",
        type=Path,
        metavar="DIR",
        help="another checkout of prewarm: adds a cold row (aiobotocore) run with its agent",
    )
    parser.add_argument(
        "--agent-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for the daemon (repeatable), e.g. MALLOC_ARENA_MAX=2",
    )
    parser.add_argument("--output", type=Path, help="JSON path (default bench/results/<time>.json)")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    args.planes = [p.strip() for p in args.planes.split(",") if p.strip()]
    if set(args.planes) - set(PLANES):
        parser.error(f"unknown planes in {args.planes}; choose from {', '.join(PLANES)}")
    args.scale_factors = [float(x) for x in args.scale.split(",") if x.strip()]
    return args


def machine() -> dict[str, Any]:
    meminfo = Path("/proc/meminfo").read_text().split()
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    shm = shutil.disk_usage("/dev/shm")
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model,
        "memory_gib": round(int(meminfo[meminfo.index("MemTotal:") + 1]) / 1024**2, 1),
        "dev_shm_gib": round(shm.total / GiB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "node": _version(["node", "--version"]),
        "curl": _version(["curl", "--version"]).split(" (")[0],
        "s5cmd": _version([str(Path(sys.executable).parent / "s5cmd"), "version"]),
    }


def _version(argv: list[str]) -> str:
    import subprocess

    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    except OSError:
        return "missing"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "?"


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
    sample.extra["served_ratio"] = max(run["served"] for run in runs) / max(result.nbytes, 1)
    hwm = [run["vm_hwm"] for run in runs if "vm_hwm" in run]
    if hwm:
        sample.extra["peak_vm_hwm"] = max(hwm)
        sample.extra["peak_sampled_rss"] = max(run["sampled_peak_rss"] for run in runs)


def _attempt(sample: Sample, run: Callable[[], RunResult]) -> None:
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


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = dt.datetime.now(dt.UTC)
    output = args.output or RESULTS / f"{started:%Y%m%dT%H%M%SZ}.json"
    scratch = Path(tempfile.mkdtemp(prefix="prewarm-bench-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="prewarm-bench-models-", dir="/tmp"))
    try:
        with S3rver(BUCKET) as server:
            report = _run(args, server, scratch, work)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    report["command"] = " ".join(["python -m bench", *map(shlex.quote, sys.argv[1:])])
    report["started"] = started.isoformat()
    report["duration_seconds"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, default=str) + "\n")
    output.with_suffix(".md").write_text(report.pop("markdown"))
    print(report.pop("table"))
    print(f"\nJSON: {output}\nMarkdown: {output.with_suffix('.md')}")
    return 0


def _run(args: argparse.Namespace, server: S3rver, scratch: Path, work: Path) -> dict[str, Any]:
    agent_env = dict(item.split("=", 1) for item in args.agent_env)
    ctx = Context(
        server=server,
        concurrency=args.concurrency,
        chunk=args.chunk,
        scratch=scratch,
        agent_env=agent_env,
    )
    sections = set(args.sections)
    client = server.client()
    calibration = _calibrate(server, client, work)
    _say(f"s3rver {S3RVER_VERSION} at {server.endpoint_url}; byte counter: {calibration}")

    models: dict[str, BenchModel] = {}

    def model(name: str, size: int, shards: int) -> BenchModel:
        if name not in models:
            _say(f"generating and uploading {name} ({size / GiB:.2f} GiB, {shards} shards)")
            models[name] = publish_model(
                client, BUCKET, name, total_bytes=size, shards=shards, work=work
            )
        return models[name]

    main_model = model("main", args.size, args.shards)

    with agent.running_agent(ctx, None) as probe:
        default_plane = agent.reported_plane(probe)
    _say(f"the agent's default data plane here: {default_plane}")

    samples: dict[str, Sample] = {}
    for name in ("ceiling", "s5cmd", "boto3", "streamer"):
        if name in sections:
            samples[name] = Sample(name)
    planes: list[str] = []
    if "cold" in sections:
        planes = list(args.planes)
        for plane in planes:
            samples[f"prewarm cold ({plane})"] = Sample(f"prewarm cold ({plane})")
        samples[DEFAULTS] = Sample(DEFAULTS)
        if args.compare_source is not None:
            samples[_compare_name(args.compare_source)] = Sample(_compare_name(args.compare_source))
    elif "concurrent" in sections:
        samples[f"prewarm cold ({default_plane})"] = Sample(f"prewarm cold ({default_plane})")
    many_name = f"prewarm {args.clients} clients ({default_plane})"
    if "concurrent" in sections:
        samples[many_name] = Sample(many_name)

    # Side by side: every round runs each contender once, so drift over the
    # run (other load, thermal, the page cache) spreads over all of them.
    runners: dict[str, Callable[[], RunResult]] = {
        "ceiling": lambda: contenders.run_ceiling(ctx, main_model),
        "s5cmd": lambda: contenders.run_s5cmd(ctx, main_model),
        "boto3": lambda: contenders.run_boto3(ctx, main_model),
        "streamer": lambda: contenders.run_streamer(ctx, main_model),
        many_name: lambda: agent.concurrent_cold_pulls(ctx, main_model, None, clients=args.clients),
    }
    for plane in PLANES:
        runners[f"prewarm cold ({plane})"] = _cold_runner(ctx, main_model, plane)
    runners.setdefault(f"prewarm cold ({default_plane})", _cold_runner(ctx, main_model, None))
    runners[DEFAULTS] = functools.partial(agent.cold_pull, ctx, main_model, None, pinned=False)
    if args.compare_source is not None:
        runners[_compare_name(args.compare_source)] = functools.partial(
            agent.cold_pull, ctx, main_model, "aiobotocore", source=args.compare_source.resolve()
        )
    for round_index in range(args.repeats):
        for name, sample in samples.items():
            _say(f"round {round_index + 1}/{args.repeats}: {name}")
            _attempt(sample, runners[name])

    if "warm" in sections:
        samples.update(_warm(args, ctx, main_model))

    scaling: dict[str, Any] = {}
    if "scale" in sections:
        scaling = _scaling(args, ctx, model, default_plane)
    hits: dict[str, Any] = {}
    if "hits" in sections:
        hits = _hits(args, ctx, model, main_model)

    profile = _profile(
        args, ctx=ctx, samples=samples, model=main_model, planes=planes, default_plane=default_plane
    )

    targets = judge_targets(
        samples,
        planes=planes,
        default_plane=default_plane,
        model_bytes=main_model.total_bytes,
        scaling=scaling,
        hits=hits,
    )
    table = text_table(samples, targets)
    return {
        "machine": machine(),
        "server": {
            "name": "s3rver",
            "version": S3RVER_VERSION,
            "endpoint": server.endpoint_url,
            "byte_counter": calibration,
        },
        "settings": {
            "size": args.size,
            "shards": args.shards,
            "concurrency": args.concurrency,
            "chunk": args.chunk,
            "repeats": args.repeats,
            "clients": args.clients,
            "sections": args.sections,
            "streamer_env": contenders.streamer_env(args.concurrency, args.chunk),
            "agent_config": agent.agent_config(ctx, "<plane>"),
            "default_plane": default_plane,
            "agent_env": agent_env,
        },
        "models": {
            name: {"uri": m.uri, "bytes": m.total_bytes, "files": m.file_count}
            for name, m in models.items()
        },
        "results": {name: sample.to_json() for name, sample in samples.items()},
        "scaling": scaling,
        "hits": hits,
        "profile": profile,
        "targets": [t.to_json() for t in targets],
        "table": table,
        "markdown": markdown_table(samples, targets) + _markdown_extras(scaling, hits, profile),
    }


def _warm(args: argparse.Namespace, ctx: Context, model: BenchModel) -> dict[str, Sample]:
    """Repeat launches in new processes against one daemon that holds the model."""
    sample = Sample("prewarm warm launch", extra={"transfer": False})
    _say("warm launches (EnsureModel hit + load_safetensors + read every tensor)")
    with agent.running_agent(ctx, None) as daemon:
        agent.hit_latency(ctx, daemon, model, calls=1)  # pulls it once
        for _ in range(args.repeats):
            _attempt(sample, lambda: agent.warm_launch(ctx, daemon, model))
    paged = Sample("prewarm warm launch, every page read", extra={"transfer": False})
    for run in sample.extra.get("runs", []):
        paged.add(float(run["with_every_page"]))
        paged.nbytes = sample.nbytes
    paged.error = sample.error
    return {sample.name: sample, paged.name: paged}


def _compare_name(source: Path) -> str:
    import subprocess

    result = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    label = result.stdout.strip() or source.name
    return f"prewarm cold (aiobotocore, {label})"


def _cold_runner(ctx: Context, model: BenchModel, plane: str | None) -> Callable[[], RunResult]:
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


def _calibrate(server: S3rver, client: Any, work: Path) -> dict[str, Any]:
    """Check that the server's write counter moves by the bytes of a GET."""
    size = 8 * MiB
    path = work / "calibration.bin"
    path.write_bytes(os.urandom(size))
    client.upload_file(str(path), BUCKET, "calibration.bin")
    path.unlink()
    before = server.bytes_sent()
    body = client.get_object(Bucket=BUCKET, Key="calibration.bin")["Body"].read()
    counted = server.bytes_sent() - before
    if len(body) != size or not size <= counted <= size + 64 * 1024:
        raise RuntimeError(
            f"s3rver's write counter moved by {counted} bytes for a {size}-byte GET; "
            "it cannot count bytes served on this system"
        )
    return {"get_bytes": size, "counted": counted, "overhead": counted - size}


def _scaling(
    args: argparse.Namespace,
    ctx: Context,
    model: Callable[[str, int, int], BenchModel],
    plane: str,
) -> dict[str, Any]:
    sized = []
    for factor in args.scale_factors:
        size = int(args.size * factor)
        name = "main" if math.isclose(factor, 1.0) else f"cold-{size / GiB:g}g"
        sized.append(model(name, size, args.shards))
    samples = {m.name: Sample(f"cold {m.total_bytes / GiB:.2f} GiB") for m in sized}
    for round_index in range(args.repeats):
        for m in sized:
            _say(f"scaling round {round_index + 1}/{args.repeats}: cold {m.name}")
            _attempt(samples[m.name], functools.partial(agent.cold_pull, ctx, m, plane))
    good = [(m, samples[m.name]) for m in sized if samples[m.name].ok]
    result: dict[str, Any] = {
        "plane": plane,
        "points": [
            {
                "model": m.name,
                "bytes": m.total_bytes,
                "best": s.best,
                "median": s.median,
                "seconds_per_gib": s.best / (m.total_bytes / GiB),
                "vm_hwm": s.extra.get("peak_vm_hwm"),
                "runs": s.extra.get("runs", []),
            }
            for m, s in good
        ],
        "rss": {
            f"{m.total_bytes / GiB:.2f} GiB": int(s.extra["peak_vm_hwm"])
            for m, s in good
            if "peak_vm_hwm" in s.extra
        },
    }
    if len(good) >= 2:
        fit = linear_fit([m.total_bytes for m, _ in good], [s.best for _, s in good])
        result["fit"] = {
            "seconds_per_gib": fit.slope * GiB,
            "intercept": fit.intercept,
            "r_squared": fit.r_squared,
            "max_residual": fit.max_residual,
        }
    return result


def _hits(
    args: argparse.Namespace,
    ctx: Context,
    model: Callable[[str, int, int], BenchModel],
    main_model: BenchModel,
) -> dict[str, Any]:
    few = model("hits-4", 256 * MiB, 4)
    many = model("hits-64", 256 * MiB, 64)
    small = model("hits-small", 16 * MiB, args.shards)
    costs: dict[str, Any] = {}
    _say("hit latency (EnsureModel on cached models)")
    with agent.running_agent(ctx, None) as daemon:
        for m in (few, many, small, main_model):
            cost = agent.hit_latency(ctx, daemon, m, calls=args.hit_calls)
            costs[m.name] = {
                "files": m.file_count,
                "bytes": m.total_bytes,
                "best": cost.ensure_best,
                "median": cost.ensure_median,
                "served_per_call": cost.served_per_call,
            }
    return {
        "models": costs,
        "few_files": few.file_count,
        "many_files": many.file_count,
        "files_ratio": costs["hits-64"]["median"] / costs["hits-4"]["median"],
        "big_bytes": main_model.total_bytes,
        "small_bytes": small.total_bytes,
        "bytes_ratio": costs["main"]["median"] / costs["hits-small"]["median"],
    }


def _profile(
    args: argparse.Namespace,
    *,
    ctx: Context,
    samples: dict[str, Sample],
    model: BenchModel,
    planes: list[str],
    default_plane: str,
) -> dict[str, Any]:
    if args.profile == "never":
        return {}
    ceiling = samples.get("ceiling")
    profiles: dict[str, Any] = {}
    for plane in planes or [default_plane]:
        cold = samples.get(f"prewarm cold ({plane})")
        if cold is None or not cold.ok:
            continue
        below = ceiling is not None and ceiling.ok and ceiling.best / cold.best < 0.9
        if args.profile == "auto" and not below:
            continue
        _say(f"profiling the daemon (py-spy) during a cold pull on {plane}")
        try:
            py_spy = agent.install_py_spy(_HERE / ".cache")
            RESULTS.mkdir(parents=True, exist_ok=True)
            output = RESULTS / f"profile-{plane}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}.txt"
            profiles[plane] = agent.profile_cold_pull(ctx, model, plane, py_spy, output)
            profiles[plane]["raw"] = str(output)
        except Exception as exc:
            profiles[plane] = {"error": f"{type(exc).__name__}: {exc}"}
    if profiles:
        costs = [agent.fallocate_seconds(ctx.scratch, model) for _ in range(args.repeats)]
        profiles["fallocate"] = {"bytes": model.total_bytes, "best": min(costs), "runs": costs}
    return profiles


def _markdown_extras(scaling: dict[str, Any], hits: dict[str, Any], profile: dict[str, Any]) -> str:
    lines: list[str] = []
    if scaling.get("points"):
        lines += ["", f"Cold pulls by size ({scaling['plane']}):", ""]
        lines += ["| bytes | best s | median s | s/GiB | peak RSS MiB |", "|---|---|---|---|---|"]
        for p in scaling["points"]:
            rss = f"{p['vm_hwm'] / MiB:.0f}" if p.get("vm_hwm") else "-"
            lines.append(
                f"| {p['bytes'] / GiB:.2f} GiB | {p['best']:.2f} | {p['median']:.2f} | "
                f"{p['seconds_per_gib']:.2f} | {rss} |"
            )
    if hits.get("models"):
        lines += ["", "Hits (EnsureModel on a cached model):", ""]
        lines += ["| model | files | bytes | best ms | median ms | bytes from S3 per call |"]
        lines += ["|---|---|---|---|---|---|"]
        for name, h in hits["models"].items():
            lines.append(
                f"| {name} | {h['files']} | {h['bytes'] / MiB:.0f} MiB | {h['best'] * 1000:.1f} | "
                f"{h['median'] * 1000:.1f} | {h['served_per_call']:.0f} |"
            )
    for plane, p in profile.items():
        if plane == "fallocate":
            lines += [
                "",
                f"posix_fallocate of the model's files on /dev/shm alone (what staging does "
                f"before the first GET): best {p['best']:.2f} s for {p['bytes'] / GiB:.2f} GiB.",
            ]
            continue
        if "error" in p:
            lines += ["", f"Profile ({plane}): {p['error']}"]
            continue
        lines += ["", f"Profile of the daemon during a cold pull ({plane}, {p['samples']} "]
        lines[-1] += "samples, py-spy, CPU only):"
        lines += ["", "| self | function |", "|---|---|"]
        lines += [f"| {share * 100:.1f}% | `{name}` |" for name, share in p["self"]]
    return "\n".join(lines) + "\n"
