"""``make demo``: a local S3 server, the agent, and one model pulled cold then warm.

Everything runs on this machine and is removed at the end: moto's S3 server on
loopback, a ~256 MiB 4-shard safetensors model uploaded to
``s3://demo/models/demo-llm/``, and the real daemon (``python -m agent``) on a
private socket. The client asks for the model twice: the first call pulls it
from S3 into the shm tier, the second is a cache hit. Then every tensor is
mapped (zero-copy) and a few are compared with what was uploaded.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

from agent.client import Client, ModelHandle, Progress, load_safetensors
from agent.testing import AgentProcess, S3Server, make_safetensors_model, upload_directory
from agent.testing._process import purge_tree

MiB = 1024 * 1024
BUCKET = "demo"
PREFIX = "models/demo-llm"
URI = f"s3://{BUCKET}/{PREFIX}/"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="model size in MiB (default 256)")
    parser.add_argument("--shards", type=int, default=4, help="safetensors shards (default 4)")
    args = parser.parse_args(argv)
    # A plain `kill` must tear down the server and the agent too, like Ctrl-C.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(args.mib * MiB, args.shards)
    except KeyboardInterrupt:
        print("\ninterrupted; everything the demo started has been stopped.", file=sys.stderr)
        return 130


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _run(total_bytes: int, shards: int) -> int:
    with contextlib.ExitStack() as cleanup:
        # Unwinds in reverse: client, agent, S3 server, temporary directories.
        agent, originals = _start_everything(cleanup, total_bytes, shards)
        client = cleanup.enter_context(Client(agent.socket_path))

        print("\ncold pull (S3 -> shm tier)")
        bar = _ProgressLine()
        started = time.perf_counter()
        cold = client.ensure(URI, tier="shm", progress=bar)
        cold_seconds = time.perf_counter() - started
        bar.finish()
        _report(cold, cold_seconds)

        print("\nwarm pull (same node, same model)")
        started = time.perf_counter()
        warm = client.ensure(URI, tier="shm")
        warm_seconds = time.perf_counter() - started
        _report(warm, warm_seconds)

        print("\nmapping the weights")
        started = time.perf_counter()
        tensors = load_safetensors(warm)
        map_seconds = time.perf_counter() - started
        checked = _compare(tensors, originals)
        print(
            f"  {len(tensors)} tensors mapped in {map_seconds * 1000:.1f} ms; "
            f"{checked} compared equal to the uploaded ones"
        )

        problems = _problems(cold, warm, tensors, originals)
        print()
        print(f"cold  {cold_seconds:7.2f} s  ({_rate(cold.total_bytes, cold_seconds)})")
        print(f"warm  {warm_seconds:7.2f} s  (cache hit: {warm.hit})")
        print(f"speed-up  {cold_seconds / max(warm_seconds, 1e-6):.0f}x")
        for problem in problems:
            print(f"PROBLEM: {problem}", file=sys.stderr)
        return 1 if problems else 0


def _start_everything(
    cleanup: contextlib.ExitStack, total_bytes: int, shards: int
) -> tuple[AgentProcess, dict[str, np.ndarray[Any, Any]]]:
    """Model on disk and in S3, the S3 server and the agent; each registered for cleanup."""
    work = Path(tempfile.mkdtemp(prefix="prewarm-demo-"))
    cleanup.callback(purge_tree, work)
    # The agent's root holds its socket and its tiers; put it on tmpfs when
    # there is one, so the shm tier really is RAM-backed.
    agent_root = Path(tempfile.mkdtemp(prefix="pw-demo-", dir=_ram_dir()))
    cleanup.callback(purge_tree, agent_root)

    _step(f"generating a {total_bytes / MiB:.0f} MiB, {shards}-shard safetensors model")
    started = time.perf_counter()
    source = work / "demo-llm"
    originals = make_safetensors_model(source, total_bytes=total_bytes, shards=shards)
    _done(started)

    _step("starting the S3 server (moto, loopback)")
    started = time.perf_counter()
    s3 = cleanup.enter_context(S3Server())
    s3_client = s3.client()
    cleanup.callback(s3_client.close)
    _done(started, s3.endpoint_url)

    _step(f"uploading to {URI}")
    started = time.perf_counter()
    s3_client.create_bucket(Bucket=BUCKET)
    keys = upload_directory(s3_client, BUCKET, PREFIX, source)
    _done(started, f"{len(keys)} objects")

    _step("starting the agent (python -m agent)")
    started = time.perf_counter()
    # As a node should run: only the demo's bucket may be cached (docs/security.md).
    access = f'[access]\nsources = ["s3://{BUCKET}/*"]\n'
    agent = AgentProcess(env=s3.env(), root=agent_root, config=access)
    cleanup.callback(agent.close)
    agent.start()
    _done(started, str(agent.socket_path))
    return agent, originals


def _ram_dir() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and shm.stat().st_mode & 0o002 else None


def _report(handle: ModelHandle, seconds: float) -> None:
    t = handle.timings
    print(f"  {handle.path}  ({len(handle.files)} files, {handle.total_bytes / MiB:.1f} MiB)")
    print(f"  hit={handle.hit}  tier={handle.tier}  key={handle.key[:16]}...")
    print(
        f"  resolve {t.resolve:.3f}s  wait {t.wait:.3f}s  download {t.download:.3f}s  "
        f"verify {t.verify:.3f}s  publish {t.publish:.3f}s  agent total {t.total:.3f}s  "
        f"client wall {seconds:.3f}s"
    )
    if not handle.hit and t.download > 0:
        print(f"  download throughput {_rate(handle.total_bytes, t.download)}")


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / MiB / max(seconds, 1e-9):.0f} MiB/s"


def _compare(
    tensors: Mapping[str, torch.Tensor], originals: Mapping[str, np.ndarray[Any, Any]]
) -> int:
    names = sorted(originals)
    # First, last, and a float16 and a float32 one from the middle.
    sample = {names[0], names[-1]}
    sample |= {next(n for n in names if "q_proj" in n), next(n for n in names if "up_proj" in n)}
    equal = 0
    for name in sorted(sample):
        if name in tensors and torch.equal(tensors[name], torch.from_numpy(originals[name])):
            equal += 1
    return equal


def _problems(
    cold: ModelHandle,
    warm: ModelHandle,
    tensors: Mapping[str, torch.Tensor],
    originals: Mapping[str, np.ndarray[Any, Any]],
) -> list[str]:
    problems = []
    if cold.hit:
        problems.append("the first pull was a cache hit; the cache was not empty")
    if not warm.hit:
        problems.append("the second pull was not a cache hit")
    if warm.path != cold.path:
        problems.append(f"the warm pull answered {warm.path}, the cold one {cold.path}")
    if set(tensors) != set(originals):
        problems.append("the mapped tensors are not the uploaded ones")
    elif _compare(tensors, originals) != 4:
        problems.append("some mapped tensors differ from the uploaded ones")
    return problems


class _ProgressLine:
    """One line of pull progress, redrawn in place on a terminal."""

    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()
        self._last_phase = ""
        self._last_percent = -1

    def __call__(self, event: Progress) -> None:
        percent = int(100 * event.bytes_done / event.bytes_total) if event.bytes_total else 0
        if self._tty:
            line = (
                f"  {event.phase:<8} {percent:3d}%  {event.bytes_done / MiB:7.1f} / "
                f"{event.bytes_total / MiB:.1f} MiB  files {event.files_done}/{event.files_total}"
            )
            print(f"\r{line:<70}", end="", file=sys.stderr, flush=True)
        elif event.phase != self._last_phase or percent >= self._last_percent + 25:
            print(f"  {event.phase} {percent}%", file=sys.stderr, flush=True)
            self._last_percent = percent
        self._last_phase = event.phase

    def finish(self) -> None:
        if self._tty:
            print(file=sys.stderr)


def _step(text: str) -> None:
    print(f"{text} ...", end=" ", flush=True)


def _done(started: float, detail: str = "") -> None:
    seconds = time.perf_counter() - started
    print(f"{seconds:.1f}s" + (f"  {detail}" if detail else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
