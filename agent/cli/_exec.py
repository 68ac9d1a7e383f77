"""``prewarm exec``: run an inference engine on this node's cached copy of a model.

    prewarm exec s3://models/llama-3-8b/ -- vllm serve {model} --port 8000

1. ensures the model through the agent (a progress display on stderr) with a
   lease, and the compile cache when ``--compile-key`` asks for one; Ctrl-C
   while it waits stops the pull unless another client waits on it, and exits
   130 saying what became of it (``_interrupt``);
2. replaces ``{model}`` in every argument of the command with the model's
   local directory and adds the compile cache's environment variables;
3. runs the command as a child in its own process group, holding the lease
   open on the agent's lease socket for as long as the child lives, and
   forwards SIGTERM, SIGINT and SIGHUP to it (the child's own process group
   means a terminal's Ctrl-C reaches it once, through this process);
4. exits with the child's exit status, or 128 + the signal that killed it.

An agent that is not serving yet (a pod that started first on a new node) is
waited for, up to ``--wait-for-agent`` seconds (``PREWARM_WAIT_FOR_AGENT``,
60 by default). With ``--fallback``, an agent that cannot be reached by then is
not fatal: the command runs with ``{model}`` replaced by the original URI
(engines such as vLLM can stream from S3 themselves), after a warning on
stderr. Without it, exit 3.

With ``--ready-url URL`` or ``--ready-file PATH`` the compile cache is
published only once the engine is ready (see ``_ready``): then one line on
stderr gives the launch's verdict (hit, partial miss, miss), on a miss the
nearest cached key of the same model and the parts that differ, and the
upload. A command that exits non-zero before it was ready uploads nothing.
Without a readiness signal the agent uploads the key once it has been quiet.

The key's versions (torch, Triton, the engine, Python, torch's CUDA build)
come from the interpreter the command runs in, not this launcher's
(``agent.compile.engine_runtime``); for vLLM and SGLang the parallel sizes and
the compile-relevant settings are read from the command itself, by meaning
(``_engine_flags``); ``--key-ignore`` leaves more out.

With ``--cached-only`` (or ``PREWARM_CACHED_ONLY=1``) the agent makes no S3
call: the newest cached snapshot is used even if S3 has changed since, and a
model not cached on this node fails (NOT_FOUND) instead of being pulled.
With ``--as-requester`` (or ``PREWARM_AS_REQUESTER=1``) the pod's own AWS
credentials go with the request (see ``Client.ensure``).
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Annotated, NoReturn

import typer

from agent._exceptions import printable
from agent._vocabulary import TierName, human_bytes
from agent.client import (
    AgentUnavailable,
    Client,
    CompileCacheHandle,
    CompileNearest,
    InvalidRequest,
    ModelHandle,
    PrewarmError,
    detect_key_parts,
    wait_for_agent,
)
from agent.client import Progress as PullProgress
from agent.client._compile import key_fields_from_text
from agent.client._messages import key_parts as key_parts_from
from agent.compile.engine_runtime import (
    VEC_ISA_OK,
    engine_runtime_fields,
    interpreter_of,
    probe_interpreter,
)
from agent.compile.keys import CompileKeyParts

from . import _render as render
from ._engine_flags import detect_engine, engine_key_fields, merged_key_fields
from ._errors import EXIT_INVALID, EXIT_NO_AGENT, fail, say
from ._interrupt import PullWatch, stop_pull_when_interrupted
from ._launch_phases import LaunchLog, describe_phases
from ._options import (
    AsRequesterOption,
    CachedOnlyOption,
    ExcludeOption,
    IncludeOption,
    SocketOption,
    TierOption,
    WaitForAgentOption,
)
from ._ready import ReadyWaiter, ReadyWatch, ready_waiter

__all__ = ["CachedOnlyOption", "exec_command"]

# What a shell answers for a command it cannot find or cannot run.
EXIT_NOT_FOUND = 127
EXIT_CANNOT_RUN = 126

PLACEHOLDER = "{model}"
# Inductor's folder for precompiled headers, under $TMPDIR/torchinductor_<user>/.
PRECOMPILED_HEADERS = "precompiled_headers"
# Characters inductor replaces in the user name of that folder.
_UNSAFE_IN_USER = re.compile(r'[\\/:*?"<>|]')
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True, slots=True)
class _ModelRequest:
    """What to lease: the model and how the agent should place and fetch it."""

    uri: str
    command: Sequence[str]
    tier: TierName | None
    include: Sequence[str]
    exclude: Sequence[str]
    client_name: str
    cached_only: bool
    as_requester: bool


@dataclass(frozen=True, slots=True)
class _Launch:
    """What the command line asks for besides the model: its compile key and readiness."""

    command: Sequence[str]
    key_fields: Mapping[str, str]  # empty: no compile cache
    key_ignore: frozenset[str]
    ready_wait: ReadyWaiter | None
    client_name: str


UriArgument = Annotated[str, typer.Argument(help="The model, e.g. s3://models/llama-3-8b/.")]
CommandArgument = Annotated[
    list[str],
    typer.Argument(
        help="The command to run, after --. Every {model} in it becomes the model's "
        "local directory.",
        show_default=False,
    ),
]
CompileKeyOption = Annotated[
    list[str] | None,
    typer.Option(
        "--compile-key",
        help="A compile-cache key part as NAME=VALUE (repeatable), e.g. engine=vllm; "
        "extras as extras.NAME=VALUE. The model's key is added by itself.",
    ),
]
KeyIgnoreOption = Annotated[
    list[str] | None,
    typer.Option(
        "--key-ignore",
        envvar="PREWARM_KEY_IGNORE",
        help="A derived key part or engine setting to leave out of the compile key "
        "(repeatable; the variable: separated by spaces), e.g. flag.max_num_seqs, "
        "compilation_config.debug_dump_path, extras.python.",
    ),
]
FallbackOption = Annotated[
    bool,
    typer.Option(
        "--fallback",
        help="If the agent cannot be reached, run the command against the original URI "
        "(with a warning) instead of failing with exit 3.",
    ),
]
ReadyUrlOption = Annotated[
    str | None,
    typer.Option(
        "--ready-url",
        help="The engine's health URL (e.g. http://127.0.0.1:8000/health): the compile "
        "cache is uploaded once it answers 2xx, never if the command fails first.",
        show_default=False,
    ),
]
ReadyFileOption = Annotated[
    Path | None,
    typer.Option(
        "--ready-file",
        help="A file the engine (or its wrapper) creates when ready: the compile cache is "
        "uploaded once it exists, never if the command fails first.",
        show_default=False,
    ),
]
NameOption = Annotated[
    str | None,
    typer.Option(
        "--name",
        envvar="PREWARM_CLIENT_NAME",
        help="How the agent lists this client (default: host name and command).",
        show_default=False,
    ),
]


def exec_command(
    uri: UriArgument,
    command: CommandArgument,
    *,
    tier: TierOption = None,
    include: IncludeOption = None,
    exclude: ExcludeOption = None,
    compile_key: CompileKeyOption = None,
    key_ignore: KeyIgnoreOption = None,
    fallback: FallbackOption = False,
    ready_url: ReadyUrlOption = None,
    ready_file: ReadyFileOption = None,
    cached_only: CachedOnlyOption = False,
    as_requester: AsRequesterOption = False,
    name: NameOption = None,
    socket: SocketOption = None,
    wait_for_agent_seconds: WaitForAgentOption = 60.0,
) -> None:
    """Run COMMAND on the node's cached copy of a model, holding a lease while it runs.

    prewarm exec s3://models/llama-3-8b/ -- vllm serve {model} --port 8000
    """
    if not command:
        _fail("give the command to run after --, e.g. -- vllm serve {model}", EXIT_INVALID)
    client_name = name or _default_name(command)
    launch = _plan_launch(
        command,
        compile_key or (),
        key_ignore=frozenset(key_ignore or ()),
        ready=(ready_url, ready_file),
        client_name=client_name,
    )
    model = _ModelRequest(
        uri, command, tier, include or (), exclude or (), client_name, cached_only, as_requester
    )
    _report_lease_holding()
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(Client(socket))
        handle = _lease_model(
            stack, client, model, wait_seconds=wait_for_agent_seconds, fallback=fallback
        )
        _say(render.pull_summary(handle, cached_only=cached_only).plain)
        env, watch, log = _compile_env(stack, client, launch, handle)
        # The lease stays held (ExitStack) until the child has exited.
        code = run_child(substitute(command, str(handle.path)), env, watch, log)
    raise typer.Exit(code)


def _plan_launch(
    command: Sequence[str],
    compile_key: Sequence[str],
    *,
    key_ignore: frozenset[str],
    ready: tuple[str | None, Path | None],
    client_name: str,
) -> _Launch:
    """The launch the options describe; bad key parts or readiness options exit 2 at once."""
    try:
        given = parse_compile_key(compile_key)
        fields: dict[str, str] = {}
        if given:
            engine = given.get("engine") or detect_engine(command) or ""
            given.setdefault("engine", engine)
            derived = engine_key_fields(engine.strip().lower(), command, key_ignore)
            fields = merged_key_fields(given, derived)
        key_fields_from_text(fields)  # refuse bad parts before pulling anything
        ready_wait = ready_waiter(*ready)
    except InvalidRequest as exc:
        _fail(exc)
    return _Launch(command, fields, key_ignore, ready_wait, client_name)


def _lease_model(
    stack: contextlib.ExitStack,
    client: Client,
    model: _ModelRequest,
    *,
    wait_seconds: float,
    fallback: bool,
) -> ModelHandle:
    """The model's handle, leased until ``stack`` closes; without an agent, the fallback."""
    watch = PullWatch()
    interrupted = stop_pull_when_interrupted(
        client, model.uri, watch, as_requester=model.as_requester, prefix=PREFIX
    )
    try:
        wait_for_agent(client.socket_path, wait_seconds, waiting=_say_waiting)
        # The display ends with the pull; the lease stays in the stack.
        with interrupted, _progress_display(model.uri) as show:
            watch.show = show
            return stack.enter_context(
                client.leased(
                    model.uri,
                    tier=model.tier,
                    include=model.include,
                    exclude=model.exclude,
                    client_name=model.client_name,
                    progress=watch,
                    cached_only=model.cached_only,
                    as_requester=model.as_requester,
                    waiter_token=watch.token,
                )
            )
    except AgentUnavailable as exc:
        if not fallback:
            _fail(f"{exc} (--fallback would run the command against {model.uri})", EXIT_NO_AGENT)
        _say(f"warning: {exc}")
        _say(
            f"warning: --fallback: running the command against {model.uri} itself; "
            "this pod downloads the model on its own."
        )
        raise typer.Exit(
            run_child(substitute(model.command, model.uri), dict(os.environ))
        ) from None
    except PrewarmError as exc:
        _fail(exc)


def _compile_env(
    stack: contextlib.ExitStack, client: Client, launch: _Launch, handle: ModelHandle
) -> tuple[dict[str, str], ReadyWatch | None, LaunchLog | None]:
    """The child's environment (with the compile cache's variables), its readiness watch and
    the log its output passes through on the way (where its start-up went); what it needs
    cleaned up after the child exits goes on ``stack``."""
    env = dict(os.environ)
    if not launch.key_fields:
        return env, None, None
    parts = _key_parts(launch, handle, env)
    cache = _compile_cache(client, parts, launch)
    if cache is None:
        return env, None, None
    env.update(cache.env)
    _share_precompiled_headers(stack, env, cache.path)
    _skip_instruction_set_builds(env, cache.parts)
    if launch.ready_wait is None:
        return env, None, None
    # Through a pipe a Python engine would hold its prints back in a block buffer.
    env.setdefault("PYTHONUNBUFFERED", "1")
    log = LaunchLog()
    watch = ReadyWatch(launch.ready_wait, lambda: _report_ready(client, cache, launch, log))
    return env, watch, log


def _report_lease_holding() -> None:
    """Say on stderr when the agent restarts under the command and the lease is taken again."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("prewarm: warning: %(message)s"))
    logger = logging.getLogger("agent.client.leases")
    logger.addHandler(handler)
    logger.propagate = False


def substitute(command: Sequence[str], model: str) -> list[str]:
    """``command`` with every ``{model}`` replaced, also inside arguments (--model={model})."""
    return [part.replace(PLACEHOLDER, model) for part in command]


def parse_compile_key(pairs: Sequence[str]) -> dict[str, str]:
    """NAME=VALUE pairs as a dict; InvalidRequest names a malformed one."""
    parts: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise InvalidRequest(
                f"--compile-key {pair!r} is not NAME=VALUE; e.g. --compile-key engine=vllm."
            )
        parts[key.strip()] = value
    return parts


def _key_parts(launch: _Launch, handle: ModelHandle, env: Mapping[str, str]) -> CompileKeyParts:
    """The key parts: given, then the command's flags, then the engine's own world.

    The versions come from the interpreter the command runs in (see
    ``agent.compile.engine_runtime``); a command whose Python cannot be found (a
    shell script, a binary) is keyed on what this launcher's Python has, with a
    note on stderr. ``model_key`` defaults to the snapshot's key.
    """
    engine = launch.key_fields.get("engine", "").strip().lower()
    world = _engine_runtime(engine, launch.command, env, launch.key_ignore)
    fields = key_fields_from_text(merged_key_fields(launch.key_fields, world))
    fields.setdefault("model_key", handle.key)
    if "torch_version" in fields:
        return key_parts_from(None, **fields)
    _say(
        "note: the command's Python was not found or has no torch; the compile key "
        "uses the versions of prewarm's own Python."
    )
    try:
        return detect_key_parts(**fields)
    except ImportError:  # no torch in this image: the parts given are all there is
        return key_parts_from(None, **fields)


def _engine_runtime(
    engine: str, command: Sequence[str], env: Mapping[str, str], ignore: frozenset[str]
) -> dict[str, str]:
    """Key parts read from the command's interpreter and the node's GPU; {} if none found."""
    interpreter = interpreter_of(command, env)
    versions = probe_interpreter(interpreter, env) if interpreter else {}
    if not versions.get("torch"):
        return {}
    world = engine_runtime_fields(engine, versions, env)
    return {name: value for name, value in world.items() if name not in ignore}


def _compile_cache(
    client: Client, parts: CompileKeyParts, launch: _Launch
) -> CompileCacheHandle | None:
    """The key's compile cache; one the agent cannot give is a warning (the command compiles
    cold). A new key names the nearest cached key of the same model and what differs."""
    try:
        cache = client.compile_cache(
            parts, client_name=launch.client_name, publish_on_ready=launch.ready_wait is not None
        )
    except PrewarmError as exc:
        _say(f"warning: no compile cache ({exc}); the command compiles cold.")
        return None
    how = f"restored in {cache.restore_seconds:.2f} s" if cache.restored else "local"
    if cache.restore_note:
        how = f"new: {cache.restore_note}"
        nearest = _nearest(client, cache)
        how += f"; {nearest.summary}" if nearest else ""
    _say(f"compile cache {cache.key[:12]} ({how}) -> {cache.path}")
    return cache


def _share_precompiled_headers(
    stack: contextlib.ExitStack, env: dict[str, str], key_directory: Path
) -> None:
    """Give the command a private ``$TMPDIR`` whose precompiled headers live in the key.

    Inductor builds its precompiled headers (CPU; about 120 MB, 5-8 s) in
    ``$TMPDIR/torchinductor_<user>/precompiled_headers`` whatever
    ``TORCHINDUCTOR_CACHE_DIR`` says, and rebuilds them in every fresh
    ``$TMPDIR``, even when every kernel is a cache hit. The command gets a
    ``$TMPDIR`` of its own (a short path inside the old one, removed when it
    exits) in which that folder is a link into the key directory: the headers
    become artifacts like any other, kept, uploaded and restored with the key
    (GCC ignores a header built by another compiler or with other flags, and
    inductor names each by both). Being private, the link never outlives the
    launch nor reaches another process's torch.
    """
    base = env.get("TMPDIR") or tempfile.gettempdir()
    target = key_directory / "inductor" / PRECOMPILED_HEADERS
    try:
        private = Path(tempfile.mkdtemp(prefix="prewarm-", dir=base))
    except OSError as exc:  # a read-only or missing TMPDIR: the headers stay where they were
        _say(f"note: precompiled headers are not kept: {exc.strerror}")
        return
    stack.callback(shutil.rmtree, private, ignore_errors=True)
    link = private / ("torchinductor_" + _UNSAFE_IN_USER.sub("_", _user())) / PRECOMPILED_HEADERS
    try:
        target.mkdir(parents=True, exist_ok=True)
        link.parent.mkdir(mode=0o700)
        link.symlink_to(target, target_is_directory=True)
    except OSError as exc:
        _say(f"note: precompiled headers are not kept: {exc.strerror}")
    env["TMPDIR"] = str(private)


def _skip_instruction_set_builds(env: dict[str, str], parts: CompileKeyParts) -> None:
    """On a node without a GPU, tell inductor the vector instruction sets build (unless set).

    Torch 2.10's inductor (vLLM 0.16's) proves in every process it starts that
    each vector instruction set the CPU reports also builds and loads: a C++
    build and a subprocess that imports torch, per set. ``TORCHINDUCTOR_VEC_ISA_OK=1``
    skips that base check only: the CPU's own flags are still read, and the
    checks of AVX-512 VNNI, BF16 and AMX still run. A pod's own value is kept:
    empty for inductor's checks (a compiler that cannot build what the CPU
    reports), ``0`` for no vector instructions at all. The value is a key part
    (``extras.inductor_vec_isa_ok``, see ``vec_isa_ok_part``). Not on GPU nodes,
    where it was not measured. What it saves: docs/benchmarks.md.
    """
    if parts.gpu_name == "cpu":
        env.setdefault(VEC_ISA_OK, "1")


def _user() -> str:
    """The user name inductor puts in its default folder's name (``getpass.getuser()``)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid_{os.getuid()}"


def _nearest(client: Client, cache: CompileCacheHandle) -> CompileNearest | None:
    """The key of the same model nearest to ``cache``'s, on this node or in S3."""
    try:
        return client.explain_compile_cache(cache.key).nearest
    except PrewarmError:
        return None


def _report_ready(
    client: Client, cache: CompileCacheHandle, launch: _Launch, log: LaunchLog
) -> None:
    """The engine is ready: one stderr line with the verdict, why it missed, the upload, and
    where the launch's time went."""
    phases = log.phases(ready=log.elapsed())
    try:
        ready = client.compile_ready(
            cache.key, client_name=launch.client_name, launch_phases=phases
        )
    except PrewarmError as exc:
        _say(f"warning: could not report the engine ready: {exc}")
        return
    upload = ready.upload
    if upload.uploaded:
        published = f"uploaded {human_bytes(upload.bytes)} to {upload.uri}"
    else:
        published = f"not uploaded: {upload.skipped_reason}"
    why = f"; {ready.nearest.summary}" if ready.nearest else ""
    took = describe_phases(phases, compile_loaded=log.compile_loaded)
    _say(f"compile cache {cache.key[:12]}: {ready.verdict.describe()}{why}; {published}; {took}")
    sys.stderr.flush()


def run_child(
    argv: list[str],
    env: dict[str, str],
    watch: ReadyWatch | None = None,
    log: LaunchLog | None = None,
) -> int:
    """Run ``argv`` to the end, forwarding signals; its exit status as a shell reports it.

    ``watch`` waits for the engine to be ready while it runs (see ``_ready``); its output
    passes through ``log``, when there is one, on its way to this process's own.
    """
    child: subprocess.Popen[bytes] | None = None
    pending: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if child is None:
            pending.append(signum)  # arrived while starting: delivered right after
        else:
            child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    try:
        try:
            # Its own process group: signals reach it once, through forward(),
            # not a second time from the terminal.
            piped = subprocess.PIPE if log is not None else None
            child = subprocess.Popen(argv, env=env, process_group=0, stdout=piped, stderr=piped)
        except FileNotFoundError:
            _say(f"{argv[0]}: command not found")
            return EXIT_NOT_FOUND
        except PermissionError as exc:
            _say(f"{argv[0]}: cannot run it: {exc.strerror}")
            return EXIT_CANNOT_RUN
        for signum in pending:
            child.send_signal(signum)
        returncode = _watch_child(child, watch, log)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - returncode if returncode < 0 else returncode


def _watch_child(
    child: subprocess.Popen[bytes], watch: ReadyWatch | None, log: LaunchLog | None
) -> int:
    """Wait for the child, its output passing through ``log`` and ``watch`` waiting for it
    to be ready meanwhile; its return code."""
    if log is not None:
        log.start(child)
    if watch is not None:
        watch.start()
    returncode = child.wait()
    if log is not None:
        log.drain()
    if watch is not None and not watch.child_exited(returncode):
        _say(
            f"the command exited with status {returncode} before it was ready; "
            "its compile artifacts are not uploaded."
        )
    return returncode


def _default_name(command: Sequence[str]) -> str:
    # In a pod the host name is the pod name.
    host = os.environ.get("HOSTNAME") or os.uname().nodename
    return f"{host}: {Path(command[0]).name}"


def _say_waiting(why: str) -> None:
    # The wait's bound and the flag that sets it are in the pod's log, in case it runs out.
    _say(
        f"the agent is not serving yet ({why}); waiting for it "
        "(--wait-for-agent / PREWARM_WAIT_FOR_AGENT)"
    )
    sys.stderr.flush()


# Every line exec writes says where it comes from: in a pod's log it sits among the child's.
PREFIX = "prewarm: "


def _say(text: str) -> None:
    """One line on stderr for the pod's log; text from the agent, S3 or the command line is
    escaped (agent.cli._errors), so it cannot move the cursor or open a link."""
    say(text, prefix=PREFIX)


def _fail(error: PrewarmError | str, code: int | None = None) -> NoReturn:
    fail(error, code, prefix=PREFIX)


@contextlib.contextmanager
def _progress_display(uri: str) -> Iterator[Callable[[PullProgress], None]]:
    """A progress callback: a bar on a terminal, a line per step in a pod's log."""
    console = render.console(stderr=True)
    if not console.is_terminal:
        yield _ProgressLines(uri)
        return
    progress = render.pull_progress(console, files=False)
    task = progress.add_task("resolve", total=None)

    def update(event: PullProgress) -> None:
        progress.update(
            task,
            description=printable(event.phase),
            completed=event.bytes_done,
            total=event.bytes_total or None,
        )

    with progress:
        yield update


class _ProgressLines:
    """Progress for logs: one line per phase, and one per tenth of the download."""

    def __init__(self, uri: str) -> None:
        self._uri = uri
        self._phase = ""
        self._tenth = -1

    def __call__(self, event: PullProgress) -> None:
        tenth = event.bytes_done * 10 // event.bytes_total if event.bytes_total else 0
        if event.phase == self._phase and (event.phase != "download" or tenth <= self._tenth):
            return
        self._phase, self._tenth = event.phase, tenth
        done = ""
        if event.phase == "download" and event.bytes_total:
            done = (
                f" {human_bytes(event.bytes_done)} of "
                f"{human_bytes(event.bytes_total)} ({tenth * 10}%)"
            )
        _say(f"{self._uri}: {event.phase}{done}")
        sys.stderr.flush()
