"""Measure the two data planes side by side: the numbers behind s3.data_plane = "auto".

Usage (against a running S3-compatible server holding a model under a prefix):

    AWS_ACCESS_KEY_ID=S3RVER AWS_SECRET_ACCESS_KEY=S3RVER \\
    python scripts/measure_data_planes.py --endpoint http://127.0.0.1:4599 \\
        --uri s3://bench/m/ --rounds 5 --config aiobotocore:2:64 --config streamer:2:64

Each ``--config PLANE:CONCURRENCY:CHUNK_MIB`` is pulled once per round, each
pull in a fresh process (so its peak RSS is its own and the streamer's import is
not shared), configurations interleaved so that a noisy neighbour hits them all
alike. A pull is the real puller: ranged GETs or the streamer, positional writes
into a staging directory on /dev/shm, chunk hashes, the journal, verify and
publish. Prints one JSON line per pull and a summary table (medians).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO))
    from agent._config import S3Settings
    from agent._uri import parse_uri
    from agent.pull.puller import Puller
    from agent.pull.resolver import resolve
    from agent.source.s3 import S3Source
    from agent.store.catalog import Store
    from agent.testing._process import purge_tree

    plane, concurrency, chunk_mib = args.child.split(":")

    async def pull() -> dict[str, Any]:
        root = Path(tempfile.mkdtemp(prefix="measure-", dir="/dev/shm"))
        try:
            settings = S3Settings(
                endpoint_url=args.endpoint,
                addressing_style="path",
                data_plane=plane,
                concurrency=int(concurrency),
                chunk_size=int(chunk_mib) * 1024**2,
            )
            store = Store({"shm": root / "shm", "disk": root / "disk"})
            await store.open()
            async with S3Source(settings) as source, Puller(store, source, settings) as puller:
                snapshot = await resolve(source, parse_uri(args.uri), (), ())
                before = resource.getrusage(resource.RUSAGE_SELF)
                started = time.monotonic()
                flight, _ = puller.join(snapshot, "shm")
                await flight.result()
                seconds = time.monotonic() - started
                after = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            return {
                "plane": plane,
                "concurrency": int(concurrency),
                "chunk_mib": int(chunk_mib),
                "bytes": snapshot.total_bytes,
                "seconds": round(seconds, 3),
                "download_seconds": round(flight.timings.download, 3),
                "mb_per_s": round(snapshot.total_bytes / seconds / 1e6, 1),
                "cpu_seconds": round(cpu, 2),
                "peak_rss_mib": after.ru_maxrss // 1024,
                "load": os.getloadavg()[0],
            }
        finally:
            purge_tree(root)

    print(json.dumps(asyncio.run(pull())), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--uri", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--config", action="append", default=[], metavar="PLANE:CONC:CHUNK_MIB")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return 0
    configs = args.config or ["aiobotocore:2:64", "streamer:2:64"]
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    env = dict(
        os.environ, RUNAI_STREAMER_LOG_LEVEL=os.environ.get("RUNAI_STREAMER_LOG_LEVEL", "ERROR")
    )
    for _ in range(args.rounds):
        for config in configs:
            argv = [sys.executable, __file__, "--endpoint", args.endpoint, "--uri", args.uri]
            done = subprocess.run(
                [*argv, "--child", config], capture_output=True, text=True, env=env, check=False
            )
            if done.returncode != 0:
                print(f"{config}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            results[config].append(row)
            print(json.dumps(row), flush=True)
    header = ["MB/s median", "min", "max", "CPU s", "RSS MiB"]
    print(f"\n{'plane:conc:chunk':<24}" + "".join(f"{h:>12}" for h in header))
    for config, rows in results.items():
        if not rows:
            continue
        speeds = [r["mb_per_s"] for r in rows]
        print(
            f"{config:<24}{statistics.median(speeds):>12.0f}{min(speeds):>12.0f}"
            f"{max(speeds):>12.0f}{statistics.median(r['cpu_seconds'] for r in rows):>12.2f}"
            f"{max(r['peak_rss_mib'] for r in rows):>12}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
