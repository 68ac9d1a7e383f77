"""``python -m bench.shaped``: cold pulls from S3 as it behaves, one command, as root.

Loopback is not S3: there one connection carries GB/s, so the number of GETs in
flight never matters. Here the S3 server (s3rver) runs in a network namespace
made for the run, behind a veth pair whose outgoing traffic is shaped per
connection and per link (``bench._shaping``), with a first-byte latency and,
in one profile, 503 SlowDown past a GET rate per prefix (``s3rver_shaped.js``).
Each contender pulls the same model from it (``bench._shaped_runs``), and the
report gives MiB/s, the share of the nominal link and the share of the best
hand-tuned contender (s5cmd at 128 x 8 MiB, or the raw curl ceiling) on the
same profile, size and scheme.

Everything it makes (namespace, veth pair, server processes, daemons, the
store and scratch directories) is removed on exit, SIGINT and SIGTERM
included; every pull has a deadline (``--pull-timeout``). It is a by-hand
bench: it needs root, ``ip``/``tc``, node/npm, curl and s5cmd, and is not
part of the test suite.

    sudo .venv/bin/python -m bench.shaped --profiles all --sizes 1GiB,4GiB \\
        --schemes http,https --out docs/bench-shaped.json
    sudo .venv/bin/python -m bench.shaped --quick
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from agent.testing._process import purge_tree

from ._contenders import Context
from ._model import BenchModel, publish_model
from ._netns import NAMESPACE_ADDRESS, Namespace
from ._s3rver import S3RVER_VERSION
from ._scaling import parse_sizes
from ._schemes import parse_schemes
from ._shaped_runs import CONTENDERS, HAND_TUNED, Outcome, calibrate
from ._shaped_server import ShapedS3rver
from ._shaping import MB, PROFILES, QUICK_PROFILES, Profile, parse_profiles
from ._system import machine
from ._tls import LoopbackCertificate, write_loopback_certificate

MiB = 1024**2
GiB = 1024**3
BUCKET = "bench"
SHARD_BYTES = 256 * MiB
DEFAULT_TIMEOUT = 300.0
QUICK_TIMEOUT = 240.0
CALIBRATION_CONNECTIONS = (64, 128)
# Uploads go through a server with no latency, no limit and no shaping.
_UPLOAD = Profile("upload", per_connection=10**12, link=10**12, first_byte_ms=0)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.shaped",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--profiles",
        default="all",
        help=f"comma-separated profiles, or all (default): {', '.join(PROFILES)}",
    )
    parser.add_argument("--sizes", default="1GiB,4GiB", help="model sizes (default 1GiB,4GiB)")
    parser.add_argument("--schemes", default="http,https", help="http,https (default both)")
    parser.add_argument(
        "--contenders",
        default=",".join(c.name for c in CONTENDERS),
        help="comma-separated contenders (default all)",
    )
    parser.add_argument(
        "--pull-timeout",
        type=float,
        help=f"seconds one pull may take before it is killed (default {DEFAULT_TIMEOUT:.0f}, "
        f"{QUICK_TIMEOUT:.0f} with --quick)",
    )
    parser.add_argument(
        "--no-calibration",
        dest="calibration",
        action="store_false",
        help="skip the single-connection and raw-ceiling checks of each profile",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: 1GiB, http, profiles {','.join(QUICK_PROFILES)} (overrides "
        "--profiles, --sizes, --schemes)",
    )
    parser.add_argument(
        "--out", type=Path, help="JSON path (default bench/results/shaped-<time>.json)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.profiles, args.sizes, args.schemes = ",".join(QUICK_PROFILES), "1GiB", "http"
        if args.pull_timeout is None:
            args.pull_timeout = QUICK_TIMEOUT
    if args.pull_timeout is None:
        args.pull_timeout = DEFAULT_TIMEOUT
    try:
        args.profile_list = parse_profiles(args.profiles)
        args.scheme_list = parse_schemes(args.schemes)
        args.size_list = parse_sizes(args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    names = [name.strip() for name in args.contenders.split(",") if name.strip()]
    known = {c.name for c in CONTENDERS}
    if unknown := sorted(set(names) - known):
        parser.error(f"unknown contenders {unknown}; choose from {','.join(known)}")
    args.contender_list = [c for c in CONTENDERS if c.name in names]
    return args


def say(text: str) -> None:
    print(text, flush=True)


def _terminate(signum: int, frame: FrameType | None) -> None:
    # The with blocks below tear everything down on the way out.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    started = dt.datetime.now(dt.UTC)
    out: Path = (
        args.out or Path(__file__).parent / "results" / f"shaped-{started:%Y%m%dT%H%M%SZ}.json"
    )
    report: dict[str, Any] = {
        "command": " ".join(["python -m bench.shaped", *map(shlex.quote, sys.argv[1:])]),
        "started": started.isoformat(),
        "commit": _commit(),
        "machine": machine(),
        "s3rver": S3RVER_VERSION,
        "pull_timeout": args.pull_timeout,
        "profiles": {p.name: _profile_json(p) for p in args.profile_list},
        "calibration": {},
        "cells": [],
    }
    with _workspace() as (store, scratch, work, secrets), Namespace() as namespace:
        say(f"namespace {namespace.name}: server at {NAMESPACE_ADDRESS} via {namespace.host_dev}")
        certificate = write_loopback_certificate(secrets, NAMESPACE_ADDRESS)
        models = _publish(namespace, store, work, args.size_list)
        bench = _Bench(args, report, namespace, store, scratch, certificate, models)
        try:
            for profile in args.profile_list:
                bench.run_profile(profile)
        finally:
            # A client interrupted mid-run (Popen leaves it on KeyboardInterrupt).
            _stop_children()
    report["duration_seconds"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
    markdown = render_markdown(report)
    report["markdown"] = markdown
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    say("\n" + markdown)
    say(f"JSON: {out}")
    return 0


def _stop_children() -> None:
    """SIGTERM every process this one started that is still running."""
    me = os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The fields after the command's closing parenthesis: state, ppid, ...
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == me:
                os.kill(int(stat.parent.name), signal.SIGTERM)


@contextlib.contextmanager
def _workspace() -> Iterator[tuple[Path, Path, Path, Path]]:
    # The store on the disk (served from the page cache), pulls into /dev/shm.
    store = Path(tempfile.mkdtemp(prefix="prewarm-shaped-store-"))
    scratch = Path(tempfile.mkdtemp(prefix="prewarm-shaped-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="prewarm-shaped-models-"))
    secrets = Path(tempfile.mkdtemp(prefix="prewarm-shaped-tls-"))
    try:
        yield store, scratch, work, secrets
    finally:
        for path in (store, scratch, work, secrets):
            purge_tree(path)


def _publish(
    namespace: Namespace, store: Path, work: Path, sizes: Sequence[int]
) -> dict[int, BenchModel]:
    models: dict[int, BenchModel] = {}
    with ShapedS3rver(BUCKET, namespace, _UPLOAD, directory=store) as uploads:
        client = uploads.client()
        for size in sizes:
            shards = max(1, size // SHARD_BYTES)
            name = f"m{size // MiB}mib"
            say(f"generating and uploading {name}: {size / GiB:g} GiB in {shards} shards")
            models[size] = publish_model(
                client, BUCKET, name, total_bytes=size, shards=shards, work=work
            )
    return models


@dataclass(frozen=True)
class _Bench:
    """What every profile's runs share."""

    args: argparse.Namespace
    report: dict[str, Any]
    namespace: Namespace
    store: Path
    scratch: Path
    certificate: LoopbackCertificate
    models: dict[int, BenchModel]

    def run_profile(self, profile: Profile) -> None:
        say(f"\n== profile {profile.name}: {profile.describe()}")
        self.namespace.shape(profile)
        with contextlib.ExitStack() as stack:
            contexts = {
                scheme: Context(
                    server=stack.enter_context(self._server(profile, scheme)),
                    concurrency=0,
                    chunk=0,
                    scratch=self.scratch,
                )
                for scheme in self.args.scheme_list
            }
            if self.args.calibration:
                self._calibrate(profile, contexts)
            for size, model in sorted(self.models.items()):
                for scheme, ctx in contexts.items():
                    cell = self._run_cell(profile, ctx, model, scheme)
                    cell["size"] = size  # nominal: the model is that and its small files
                    self.report["cells"].append(cell)
                    say(render_cell(cell))

    def _server(self, profile: Profile, scheme: str) -> ShapedS3rver:
        tls = self.certificate if scheme == "https" else None
        return ShapedS3rver(BUCKET, self.namespace, profile, directory=self.store, tls=tls)

    def _calibrate(self, profile: Profile, contexts: dict[str, Context]) -> None:
        scheme = self.args.scheme_list[0]
        smallest = self.models[min(self.models)]
        say(f"calibrating over {scheme} with {smallest.name}")
        calibration = calibrate(
            contexts[scheme],
            smallest,
            connections=CALIBRATION_CONNECTIONS,
            timeout=self.args.pull_timeout,
        )
        calibration["scheme"] = scheme
        self.report["calibration"][profile.name] = calibration
        say(render_calibration(profile, calibration))

    def _run_cell(
        self, profile: Profile, ctx: Context, model: BenchModel, scheme: str
    ) -> dict[str, Any]:
        say(f"-- {profile.name}, {model.total_bytes / GiB:.2f} GiB, {scheme}")
        outcomes: list[Outcome] = []
        for contender in self.args.contender_list:
            started = time.monotonic()
            outcome = contender.run(ctx, model, self.args.pull_timeout)
            outcome.extra.setdefault("key", contender.name)
            outcomes.append(outcome)
            rate = outcome.bytes_per_second / MiB
            say(
                f"   {outcome.contender}: {outcome.status} {rate:.0f} MiB/s in "
                f"{outcome.seconds:.1f} s ({time.monotonic() - started:.0f} s with set-up)"
                f"{_note(outcome)}"
            )
        return cell_report(profile, model, scheme, outcomes)


def cell_report(
    profile: Profile, model: BenchModel, scheme: str, outcomes: Sequence[Outcome]
) -> dict[str, Any]:
    """One profile x size x scheme: each row's rate against the link and the best hand-tuned."""
    best = max(
        (o.bytes_per_second for o in outcomes if o.extra.get("key") in HAND_TUNED), default=0.0
    )
    rows = []
    for outcome in outcomes:
        row = outcome.to_json()
        rate = outcome.bytes_per_second
        row["of_link"] = rate / profile.link
        row["of_best_hand_tuned"] = rate / best if best else None
        rows.append(row)
    return {
        "profile": profile.name,
        "size": model.total_bytes,
        "scheme": scheme,
        "model": {"name": model.name, "files": model.file_count, "bytes": model.total_bytes},
        "best_hand_tuned_mib_per_second": best / MiB,
        "rows": rows,
    }


def _note(outcome: Outcome) -> str:
    parts = []
    if outcome.slowdowns:
        parts.append(f"{outcome.slowdowns} SlowDown 503s")
    if outcome.note:
        parts.append(outcome.note)
    return f" [{'; '.join(parts)}]" if parts else ""


# -- reports -------------------------------------------------------------------------------


def render_calibration(profile: Profile, calibration: dict[str, Any]) -> str:
    single = calibration["single"]
    lines = [
        f"calibration {profile.name} [{calibration.get('scheme', '')}]: one connection "
        f"{single['bytes_per_second'] / MB:.1f} MB/s ({single['of_per_connection']:.0%} of "
        f"{profile.per_connection / MB:g}), first byte {single['first_byte_ms']:.0f} ms"
    ]
    for count in CALIBRATION_CONNECTIONS:
        run = calibration.get(f"ceiling_{count}")
        if run is None:
            continue
        rate = run["mib_per_second"] * MiB
        lines.append(
            f"  raw ceiling at {count} connections: {rate / MB:.0f} MB/s "
            f"({rate / profile.link:.0%} of the {profile.link / MB:g} MB/s link), {run['status']}"
            + (f", {run['slowdowns_sent']} SlowDown 503s" if run["slowdowns_sent"] else "")
        )
    return "\n".join(lines)


def render_cell(cell: dict[str, Any]) -> str:
    profile = PROFILES.get(cell["profile"])
    about = profile.describe() if profile else cell["profile"]
    lines = [
        f"\n### {cell['profile']}, {cell['size'] / GiB:g} GiB ({cell['model']['files']} files), "
        f"{cell['scheme']}: {about}",
        "",
        "| contender | status | seconds | MiB/s | % of link | % of best hand-tuned | 503s sent |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in cell["rows"]:
        ok = row["status"] == "ok"
        best = row["of_best_hand_tuned"]
        lines.append(
            f"| {row['contender']} | {row['status']} | {row['seconds']:.1f} | "
            f"{row['mib_per_second']:.0f} | {row['of_link']:.0%} | "
            f"{f'{best:.0%}' if ok and best else '—'} | {row['slowdowns_sent']} |"
        )
    for row in cell["rows"]:
        if row["note"] and row["status"] != "ok":
            lines.append(f"- {row['contender']}: {row['note']}")
    for row in cell["rows"]:
        if "log_lines" in row:
            lines.append(
                f"- {row['contender']} daemon log, lines on SlowDown / concurrency / in flight: "
                f"{row['log_matches']}"
            )
            lines.extend(f"    {log_message(line)}" for line in row["log_lines"])
    return "\n".join(lines)


def log_message(line: str) -> str:
    """A daemon log line as ``time level logger: message`` when it is a JSON record."""
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict) or "msg" not in record:
        return line
    where = " ".join(str(record.get(name, "")) for name in ("ts", "level", "logger"))
    return f"{where}: {record['msg']}"


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"Command: `{report['command']}` (commit {report['commit'][:12]})", ""]
    for name, profile in report["profiles"].items():
        lines.append(f"- {name}: {profile['describe']}")
    lines.append("")
    for name, calibration in report["calibration"].items():
        lines.append(render_calibration(PROFILES[name], calibration))
    lines.extend(render_cell(cell) for cell in report["cells"])
    return "\n".join(lines) + "\n"


def _profile_json(profile: Profile) -> dict[str, Any]:
    return {
        "per_connection_bytes_per_second": profile.per_connection,
        "link_bytes_per_second": profile.link,
        "first_byte_ms": profile.first_byte_ms,
        "get_rate_per_prefix": profile.get_rate,
        "get_burst": profile.get_burst,
        "streams_needed": profile.streams_needed,
        "describe": profile.describe(),
    }


def _commit() -> str:
    result = subprocess.run(
        ["git", "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parent,
    )
    return result.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
