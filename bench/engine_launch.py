"""By hand: launch-to-ready of a real vLLM through ``prewarm exec``, cold, restored, uncompiled.

One run starts moto's S3 server on loopback, uploads a model directory to
``s3://models/minilm/`` and, for each repeat, launches the same
``vllm serve {model} --runner pooling`` through ``prewarm exec --compile-key
engine=vllm`` three times:

1. ``cold``: on node 1 (a fresh ``prewarmd``, empty tiers): the model is pulled,
   the compile-cache key is new, vLLM compiles, and the agent uploads the key.
2. ``restored``: on node 2 (another fresh ``prewarmd``, same S3): the key is
   restored from S3 before the engine starts; the verdict should be ``hit``.
3. ``compile off``: on node 2 again, the same command with ``-cc '{"mode":0}'``
   (vLLM's ``CompilationMode.NONE``): the baseline a restored cache competes with.

Each repeat uses its own compile-cache prefix in S3, so its node 1 is cold again.
Launch-to-ready is measured here, from starting ``prewarm exec`` to the first
200 of vLLM's ``/health``. Every launch gets a fresh ``$HOME`` and ``$TMPDIR``
base, so what it leaves outside the key directory can be listed. Run from the
repository root with the project's venv, vLLM in a venv of its own::

    .venv/bin/python -m bench.engine_launch --vllm /tmp/vllm-venv/bin/vllm \
        --model-dir /path/to/all-MiniLM-L6-v2 --repeats 2

Everything it starts (S3 server, agents, engines, temporary directories) is
stopped and removed at the end, on Ctrl-C and on SIGTERM too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
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
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from agent.testing import AgentProcess, AgentTimeouts, S3Server, upload_directory
from agent.testing._process import purge_tree

BUCKET = "models"
PREFIX = "minilm"
URI = f"s3://{BUCKET}/{PREFIX}/"
COMPILE_OFF = ("-cc", '{"mode":0}')
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
# vLLM's start-up lines worth keeping: where the cache is, and what compiling cost.
_ENGINE_LINE = re.compile(
    r"Using cache directory|torch\.compile takes|Compiling a graph|Directly load|"
    r"compiled graph|init engine|AOTAutograd cache (hit|miss)|fx graph cache (hit|miss)|"
    r"Dynamo bytecode transform time|Application startup complete",
    re.IGNORECASE,
)


@dataclass
class Launch:
    """What one ``prewarm exec`` launch did, as seen from outside and from its log."""

    repeat: int
    label: str
    node: str
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
    outside: list[str] = field(default_factory=list)
    key_contents: list[str] = field(default_factory=list)
    engine_lines: list[str] = field(default_factory=list)
    trace_counts: dict[str, int] = field(default_factory=dict)
    log: str = ""
    error: str = ""


@dataclass(frozen=True)
class Setup:
    """What every launch of the run shares: the commands, the S3 server, the scratch space."""

    prewarm: list[str]
    vllm: Path
    s3: S3Server
    scratch: Path
    timeout: float
    log_dir: Path | None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, run every repeat, print the tables; 130 on Ctrl-C."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--vllm",
        type=Path,
        default=Path("/tmp/vllm-venv/bin/vllm"),
        help="vLLM's console script, in the venv vLLM is installed in",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        required=True,
        help="a model directory vLLM can serve with --runner pooling",
    )
    parser.add_argument("--repeats", type=int, default=2, help="sets of three launches")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds one launch may take to be ready"
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="one more restored launch on a fresh node with "
        "TORCH_LOGS=aot,inductor,dynamo, counting cache hits (not timed)",
    )
    parser.add_argument(
        "--log-dir", type=Path, help="keep every launch's output and a JSON report here"
    )
    args = parser.parse_args(argv)
    # A plain `kill` must tear everything down too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        launches = _run(args)
    except KeyboardInterrupt:
        print("\ninterrupted; everything the benchmark started has been stopped.", file=sys.stderr)
        return 130
    print(_report(launches))
    return 0 if all(not launch.error for launch in launches) else 1


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM unwinds like Ctrl-C, through every cleanup."""
    raise SystemExit(128 + signum)


def _run(args: argparse.Namespace) -> list[Launch]:
    """Start the S3 server, upload the model, and run ``args.repeats`` sets of launches."""
    model_dir: Path = args.model_dir.resolve()
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"{model_dir} has no config.json: not a model directory")
    if not os.access(args.vllm, os.X_OK):
        raise SystemExit(f"{args.vllm} is not an executable vLLM console script")
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    launches: list[Launch] = []
    with contextlib.ExitStack() as cleanup:
        # Short, so the agents' socket paths stay under AF_UNIX's 107 bytes.
        scratch = Path(tempfile.mkdtemp(prefix="pw-eng-"))
        cleanup.callback(purge_tree, scratch)
        s3 = cleanup.enter_context(S3Server())
        client = s3.client()
        cleanup.callback(client.close)
        client.create_bucket(Bucket=BUCKET)
        started = time.monotonic()
        keys = upload_directory(client, BUCKET, PREFIX, model_dir)
        _say(f"uploaded {len(keys)} files to {URI} in {time.monotonic() - started:.1f} s")
        setup = Setup(_prewarm_command(), args.vllm, s3, scratch, args.timeout, args.log_dir)
        for repeat in range(1, args.repeats + 1):
            launches += _one_set(setup, client, repeat)
        if args.trace:
            launches.append(_traced_launch(setup, args.repeats))
        if args.log_dir is not None:
            report = [launch.__dict__ for launch in launches]
            (args.log_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return launches


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
    return AgentProcess(env=setup.s3.env(), parent=setup.scratch, config=config, timeouts=timeouts)


def _one_set(setup: Setup, client: Any, repeat: int) -> list[Launch]:
    """Cold on node 1, then restored and compilation-off on node 2."""
    done: list[Launch] = []
    with _agent(setup, repeat) as node1:
        done.append(_launch(setup, node1, Launch(repeat, "cold", "node 1")))
    done[-1].s3_compile_bytes = _s3_bytes(client, f"compile-{repeat}/")
    with _agent(setup, repeat) as node2:
        done.append(_launch(setup, node2, Launch(repeat, "restored", "node 2")))
        off = Launch(repeat, "compile off", "node 2")
        done.append(_launch(setup, node2, off, extra=COMPILE_OFF))
    return done


def _traced_launch(setup: Setup, repeat: int) -> Launch:
    """A restored launch on a fresh node with inductor's and AOTAutograd's cache logs on."""
    with _agent(setup, repeat) as node3:
        launch = Launch(repeat, "restored, traced", "node 3")
        env = {"TORCH_LOGS": "aot,inductor,dynamo"}
        _launch(setup, node3, launch, env=env)
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


def _launch(
    setup: Setup,
    agent: AgentProcess,
    launch: Launch,
    *,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Launch:
    """One ``prewarm exec`` of vLLM: time it to ready, wait for the verdict, stop it."""
    name = f"r{launch.repeat}-{launch.label.replace(' ', '-').replace(',', '')}"
    home, tmp = setup.scratch / f"home-{name}", setup.scratch / f"tmp-{name}"
    home.mkdir()
    tmp.mkdir()
    port = _free_port()
    url = f"http://127.0.0.1:{port}/health"
    argv = [*setup.prewarm, "exec", URI, "--compile-key", "engine=vllm", "--ready-url", url]
    argv += ["--", str(setup.vllm), "serve", "{model}", "--runner", "pooling"]
    # Loopback only: vLLM listens on every interface by default (the host is never keyed).
    argv += ["--host", "127.0.0.1", "--port", str(port), *extra]
    child_env = _launch_env(agent, home, tmp) | (env or {})
    _say(f"set {launch.repeat}: {launch.label} on {launch.node}: {' '.join(argv)}")
    launch.load_before = os.getloadavg()
    shared_before = _top_entries()
    with _Running(argv, child_env) as running:
        launch.ready_seconds = _wait_ready(url, running, setup.timeout)
        if launch.ready_seconds is None:
            launch.error = f"not ready within {setup.timeout:.0f} s (exit {running.poll()})"
        else:
            _say(f"  ready after {launch.ready_seconds:.1f} s; waiting for the verdict")
            running.wait_for(lambda line: _VERDICT_LINE.match(line) is not None, 300.0)
        # The private TMPDIR goes when exec exits: list it while the engine still runs.
        launch.outside = _listing(tmp, "$TMPDIR")
        launch.load_after = os.getloadavg()
    launch.returncode = running.returncode
    launch.outside += _listing(home, "$HOME")
    # Machine-wide, so another user's processes may add entries here too.
    new = sorted(_top_entries() - shared_before - {str(setup.scratch)})
    launch.outside += [f"new since the launch started: {entry}" for entry in new]
    _parse(launch, running.lines)
    if key := _KEY_LINE.match(launch.key_line):
        launch.key_contents = _listing(Path(key["path"]), "key", depth=2)
    launch.log = "".join(line for _, line in running.lines)
    if setup.log_dir is not None:
        (setup.log_dir / f"{name}.log").write_text(launch.log)
    _say(f"  {launch.verdict_line or launch.error or 'no verdict line'}")
    return launch


def _launch_env(agent: AgentProcess, home: Path, tmp: Path) -> dict[str, str]:
    """The pod's environment: this agent's socket, a fresh HOME and TMPDIR, no network."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREWARM_", "AWS_", "VLLM_"))}
    for name in ("XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_LOGS"):
        env.pop(name, None)
    env |= {
        "PREWARM_SOCKET_PATH": str(agent.socket_path),
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # vLLM would otherwise phone home with usage statistics.
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }
    return env


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


def _report(launches: list[Launch]) -> str:
    """The Markdown tables: one row per launch, then what each left outside its key."""
    rows = [
        "| set | launch | node | launch-to-ready s | model line at s | key line at s "
        "| restore s | verdict | uploaded (exec) | S3 compile prefix B | load 1m before/after "
        "| exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for launch in launches:
        verdict = launch.verdict_line.split(": ", 2)[-1] if launch.verdict_line else launch.error
        rows.append(
            f"| {launch.repeat} | {launch.label} | {launch.node} | {_num(launch.ready_seconds)} "
            f"| {_num(launch.line_times.get('model'))} "
            f"| {_num(launch.line_times.get('compile cache'))} "
            f"| {_num(launch.restore_seconds)} | {verdict.replace('|', '/')} "
            f"| {launch.uploaded or '-'} | {launch.s3_compile_bytes or '-'} "
            f"| {launch.load_before[0]:.2f} / {launch.load_after[0]:.2f} | {launch.returncode} |"
        )
    rows.append("")
    for launch in launches:
        rows.append(f"**set {launch.repeat}, {launch.label}** ({launch.node})")
        rows.append("")
        details = [launch.pull_line, launch.key_line, *launch.key_contents, *launch.outside]
        details += launch.engine_lines
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
