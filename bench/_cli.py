"""``python -m bench``: one run of the whole suite; prints the tables and writes JSON and Markdown.

The ceiling, the alternatives and prewarm's cold pulls run over HTTP and over
HTTPS (one s3rver per scheme on the same store), each row named with its
scheme; prewarm's CPU and memory count the daemon and its worker processes,
and one more cold pull per cold row under py-spy gives the seconds each of its
processes holds its interpreter lock per GiB.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic import ByteSize, TypeAdapter

from agent.testing._process import purge_tree

from . import _agent as agent
from . import _contenders as contenders
from . import _sections as suite
from ._contenders import Context
from ._gil import measure_gil
from ._hits import hits as hit_section
from ._model import BenchModel, publish_model
from ._report import markdown_extras, markdown_table, text_table
from ._rows import ALTERNATIVES, Plan, plan_rows
from ._s3rver import S3RVER_VERSION
from ._scaling import parse_sizes
from ._scaling import scaling as scaling_section
from ._schemes import SCHEMES, Servers, parse_schemes, serve_schemes
from ._sections import BUCKET, RESULTS
from ._stats import Sample
from ._system import machine
from ._targets import RunOutline, judge_targets

MiB = 1024**2
GiB = 1024**3
PLANES = ("processes", "aiobotocore")
DEFAULT_SCALING = "1GiB,2GiB,4GiB,8GiB"
SECTIONS = (*ALTERNATIVES, "cold", "concurrent", "warm", "scale", "hits")


def parse_size(text: str) -> int:
    return int(TypeAdapter(ByteSize).validate_python(text))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--size", type=parse_size, default=2 * GiB, help="model size (default 2GiB)"
    )
    parser.add_argument("--shards", type=int, default=8, help="safetensors shards (default 8)")
    parser.add_argument("--concurrency", type=int, default=16, help="parallel GETs (default 16)")
    parser.add_argument(
        "--chunk", type=parse_size, default=64 * MiB, help="range size (default 64MiB)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement")
    parser.add_argument("--clients", type=int, default=8, help="concurrent cold clients")
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})",
    )
    parser.add_argument(
        "--schemes",
        default=",".join(SCHEMES),
        help="comma-separated schemes the ceiling, alternatives, cold and scale rows run over, "
        "side by side against the same store (default http,https; HTTPS with a self-signed "
        "certificate trusted through AWS_CA_BUNDLE); concurrent, warm, hits and the CPU "
        "profile run over https when it is asked for, else http",
    )
    parser.add_argument(
        "--scaling",
        default=DEFAULT_SCALING,
        metavar="SIZES",
        help=f"model sizes for the cold-scaling section, each beside its own ceiling and "
        f"s5cmd (default {DEFAULT_SCALING})",
    )
    parser.add_argument("--hit-calls", type=int, default=30, help="EnsureModel calls per hit")
    parser.add_argument(
        "--profile",
        choices=("auto", "always", "never"),
        default="auto",
        help="py-spy the daemon during a cold pull (auto: when below 0.9x the ceiling)",
    )
    parser.add_argument(
        "--no-gil",
        dest="gil",
        action="store_false",
        help="skip the extra cold pull of each cold row (each plane and the agent's defaults, "
        "each scheme) under py-spy --gil that gives the GIL columns and targets",
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
    try:
        args.schemes = parse_schemes(args.schemes)
    except ValueError as exc:
        parser.error(f"--schemes: {exc}")
    try:
        args.sizes = parse_sizes(args.scaling)
    except ValueError as exc:
        parser.error(f"--scaling: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = dt.datetime.now(dt.UTC)
    output = args.output or RESULTS / f"{started:%Y%m%dT%H%M%SZ}.json"
    scratch = Path(tempfile.mkdtemp(prefix="prewarm-bench-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="prewarm-bench-models-", dir="/tmp"))
    try:
        with serve_schemes(BUCKET, args.schemes) as servers:
            report = _run(args, servers, scratch, work)
    finally:
        purge_tree(scratch)
        purge_tree(work)
    report["command"] = " ".join(["python -m bench", *map(shlex.quote, sys.argv[1:])])
    report["started"] = started.isoformat()
    report["duration_seconds"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, default=str) + "\n")
    output.with_suffix(".md").write_text(report.pop("markdown"))
    print(report.pop("table"))
    print(f"\nJSON: {output}\nMarkdown: {output.with_suffix('.md')}")
    return 0


def _run(args: argparse.Namespace, servers: Servers, scratch: Path, work: Path) -> dict[str, Any]:
    agent_env = dict(item.split("=", 1) for item in args.agent_env)
    contexts = {
        scheme: Context(
            server=server,
            concurrency=args.concurrency,
            chunk=args.chunk,
            scratch=scratch,
            agent_env=agent_env,
        )
        for scheme, server in servers.by_scheme.items()
    }
    preferred = servers.preferred
    sections = set(args.sections)
    uploads = servers.uploads.client()
    calibration = {
        scheme: suite.calibrate(server, uploads, work)
        for scheme, server in servers.by_scheme.items()
    }
    for scheme, server in servers.by_scheme.items():
        suite.say(
            f"s3rver {S3RVER_VERSION} at {server.endpoint_url}; byte counter: {calibration[scheme]}"
        )

    models: dict[str, BenchModel] = {}

    def model(name: str, size: int, shards: int) -> BenchModel:
        if name not in models:
            suite.say(f"generating and uploading {name} ({size / GiB:.2f} GiB, {shards} shards)")
            models[name] = publish_model(
                uploads, BUCKET, name, total_bytes=size, shards=shards, work=work
            )
        return models[name]

    main_model = model("main", args.size, args.shards)

    with agent.running_agent(contexts[preferred], None) as probe:
        default_plane = agent.reported_plane(probe)
    suite.say(f"the agent's default data plane here: {default_plane}")

    plan = plan_rows(args, contexts, main_model, default_plane=default_plane, preferred=preferred)
    samples = _rounds(args, plan)
    if "cold" in sections and args.gil:
        measure_gil(plan.cold, contexts, samples, main_model)

    if "warm" in sections:
        samples.update(suite.warm(args, contexts[preferred], main_model))

    scaling: dict[str, Any] = {}
    if "scale" in sections:
        scaling = scaling_section(args, contexts, model, default_plane)
    hits: dict[str, Any] = {}
    if "hits" in sections:
        hits = hit_section(args, contexts[preferred], model, main_model)

    profile = suite.profile(
        args,
        ctx=contexts[preferred],
        samples=samples,
        model=main_model,
        planes=args.planes if "cold" in sections else [],
        default_plane=default_plane,
    )

    outline = RunOutline(
        schemes=args.schemes,
        preferred=preferred,
        planes=args.planes if "cold" in sections else [],
        default_plane=default_plane,
        concurrent=plan.concurrent,
        model_bytes=main_model.total_bytes,
    )
    targets = judge_targets(samples, outline, scaling=scaling, hits=hits)
    table = text_table(samples, targets)
    return {
        "machine": machine(),
        "server": {
            "name": "s3rver",
            "version": S3RVER_VERSION,
            "endpoints": {s: server.endpoint_url for s, server in servers.by_scheme.items()},
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
            "schemes": args.schemes,
            "one_scheme_sections": preferred,
            "planes": args.planes,
            "gil": args.gil,
            "scaling": args.sizes,
            "streamer_env": contenders.streamer_env(args.concurrency, args.chunk),
            "agent_config": agent.agent_config(contexts[preferred], "<plane>"),
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
        "markdown": markdown_table(samples, targets) + markdown_extras(scaling, hits, profile),
    }


def _rounds(args: argparse.Namespace, plan: Plan) -> dict[str, Sample]:
    """Every row once per round, ``--repeats`` rounds: drift spreads over all of them."""
    samples = {name: Sample(name, extra={"scheme": plan.schemes[name]}) for name in plan.runners}
    for round_index in range(args.repeats):
        for name, sample in samples.items():
            suite.say(f"round {round_index + 1}/{args.repeats}: {name}")
            suite.attempt(sample, plan.runners[name])
    return samples
