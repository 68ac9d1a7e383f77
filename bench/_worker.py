"""What a fresh process on the node runs, timed from the inside.

``python -m bench._worker MODE ...`` prints one JSON line. Each run is a new
process, like a pod's launch, and the clock starts after the imports (torch
among them), so interpreter start-up is left out for every contender alike.

Modes:
Transfers also report ``cpu``: their own threads sampled over the timed
window (``bench._threads``), so the CPU per GiB leaves the imports out too.

- ``boto3``: boto3's managed download (the machinery of ``download_file``)
  with a tuned TransferConfig, every file submitted at once to one transfer
  manager so ``max_concurrency`` is the concurrency of the whole model.
- ``streamer``: runai-model-streamer's ``SafetensorsStreamer`` reading every
  shard straight from S3 into CPU tensors, with the settings in the
  environment (``RUNAI_STREAMER_*``; see ``_contenders.streamer_env``).
- ``warm``: ``EnsureModel`` on a cached model (a hit), ``load_safetensors``,
  one read of every tensor (the timed launch), then one read per 4 KiB page of
  every tensor (reported apart: every page mapped).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench._threads import ThreadCpu

MiB = 1024**2
PAGE = 4096


def _boto3(args: argparse.Namespace) -> dict[str, Any]:
    import boto3.session
    from boto3.s3.transfer import TransferConfig, create_transfer_manager
    from botocore.config import Config

    session = boto3.session.Session(
        aws_access_key_id=args.access_key,
        aws_secret_access_key=args.secret_key,
        region_name="us-east-1",
    )
    client = session.client(
        "s3",
        endpoint_url=args.endpoint,
        config=Config(
            s3={"addressing_style": "path"},
            max_pool_connections=args.concurrency,
        ),
    )
    config = TransferConfig(
        multipart_threshold=args.chunk,
        multipart_chunksize=args.chunk,
        max_concurrency=args.concurrency,
        io_chunksize=MiB,
        preferred_transfer_client="classic",
    )
    dest = Path(args.dest)
    with ThreadCpu(os.getpid()) as threads:
        started = time.perf_counter()
        with create_transfer_manager(client, config) as manager:
            futures = [
                manager.download(args.bucket, key, str(dest / key.rsplit("/", 1)[-1]))
                for key in args.keys
            ]
            for future in futures:
                future.result()
        seconds = time.perf_counter() - started
    nbytes = sum(path.stat().st_size for path in dest.iterdir())
    return {"seconds": seconds, "bytes": nbytes, "cpu": threads.to_json(nbytes)}


def _streamer(args: argparse.Namespace) -> dict[str, Any]:
    from runai_model_streamer import (  # type: ignore[import-untyped,unused-ignore]
        SafetensorsStreamer,
    )

    urls = [f"s3://{args.bucket}/{key}" for key in args.keys]
    nbytes = 0
    tensors = 0
    with ThreadCpu(os.getpid()) as threads:
        started = time.perf_counter()
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(urls)
            for _name, tensor in streamer.get_tensors():
                # The tensors are already in memory; count them, as a loader would
                # before handing them on.
                nbytes += tensor.numel() * tensor.element_size()
                tensors += 1
        seconds = time.perf_counter() - started
    cpu = threads.to_json(nbytes)
    return {"seconds": seconds, "bytes": nbytes, "tensors": tensors, "cpu": cpu}


def _warm(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from agent.client import Client, load_safetensors

    client = Client(args.socket)
    started = time.perf_counter()
    handle = client.ensure(args.uri)
    ensured = time.perf_counter()
    tensors = load_safetensors(handle)
    mapped = time.perf_counter()
    # Every tensor read once (its first element): each one is really there.
    checksum = sum(int(t.reshape(-1)[:1].view(torch.uint8)[0]) for t in tensors.values())
    touched = time.perf_counter()
    # Then one read per 4 KiB page: every page of every tensor mapped, which a
    # copy to the GPU would otherwise do as it goes.
    nbytes = 0
    for tensor in tensors.values():
        flat = tensor.reshape(-1).view(torch.uint8)
        checksum += int(flat[::PAGE].sum()) + int(flat[-1])
        nbytes += flat.numel()
    faulted = time.perf_counter()
    # Once more on the same channel: what a hit costs once the connection is up.
    client.ensure(args.uri)
    again = time.perf_counter() - faulted
    client.close()
    return {
        "seconds": touched - started,
        "with_every_page": faulted - started,
        "ensure": ensured - started,
        "map": mapped - ensured,
        "touch_tensors": touched - mapped,
        "fault_pages": faulted - touched,
        "ensure_again": again,
        "hit": handle.hit,
        "bytes": nbytes,
        "tensors": len(tensors),
        "checksum": checksum,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._worker")
    modes = parser.add_subparsers(dest="mode", required=True)
    boto3 = modes.add_parser("boto3")
    boto3.add_argument("--endpoint", required=True)
    boto3.add_argument("--access-key", required=True)
    boto3.add_argument("--secret-key", required=True)
    boto3.add_argument("--dest", required=True)
    streamer = modes.add_parser("streamer")
    for mode in (boto3, streamer):
        mode.add_argument("--bucket", required=True)
        mode.add_argument("--concurrency", type=int, required=True)
        mode.add_argument("--chunk", type=int, required=True)
        mode.add_argument("keys", nargs="+")
    warm = modes.add_parser("warm")
    warm.add_argument("--socket", required=True)
    warm.add_argument("uri")
    args = parser.parse_args(argv)
    run = {"boto3": _boto3, "streamer": _streamer, "warm": _warm}[args.mode]
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
