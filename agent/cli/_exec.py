"""``prewarm exec``: run an inference engine on this node's cached copy of a model.

    prewarm exec s3://models/llama-3-8b/ -- vllm serve {model} --port 8000

1. ensures the model through the agent (a progress display on stderr) with a
   lease, and the compile cache when ``--compile-key`` asks for one;
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
stderr gives the launch's verdict (hit, partial miss, miss) and the upload. A
command that exits non-zero before it was ready uploads nothing. Without a
readiness signal the agent uploads the key once it has been quiet. For vLLM
and SGLang the key's parallel sizes and a hash of the graph-changing flags are
read from the command itself (``_engine_flags``).

With ``--cached-only`` (or ``PREWARM_CACHED_ONLY=1``) the agent makes no S3
call: the newest cached snapshot is used even if S3 has changed since, and a
model not cached on this node fails (NOT_FOUND) instead of being pulled.
With ``--as-requester`` (or ``PREWARM_AS_REQUESTER=1``) the pod's own AWS
credentials go with the request (see ``Client.ensure``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from agent.client import (
    AgentUnavailable,
    Client,
    CompileCacheHandle,
    InvalidRequest,
    ModelHandle,
    PrewarmError,
    detect_key_parts,
    wait_for_agent,
)
from agent.client import Progress as PullProgress
from agent.client._compile import key_fields_from_text
from agent.client._messages import key_parts as key_parts_from

from . import _render as render
from ._engine_flags import detect_engine, engine_key_fields, merged_key_fields
from ._options import (
    AsRequesterOption,
    CachedOnlyOption,
    ExcludeOption,
    IncludeOption,
    SocketOption,
    TierOption,
    WaitForAgentOption,
)
from ._ready import ReadyWatch, ready_waiter, report_ready

__all__ = ["CachedOnlyOption", "exec_command"]

# The same statuses as every other prewarm command (see _app).
EXIT_ERROR = 1
EXIT_INVALID = 2
EXIT_NO_AGENT = 3
# What a shell answers for a command it cannot find or cannot run.
EXIT_NOT_FOUND = 127
EXIT_CANNOT_RUN = 126

PLACEHOLDER = "{model}"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def exec_command(
    uri: Annotated[str, typer.Argument(help="The model, e.g. s3://models/llama-3-8b/.")],
    command: Annotated[
        list[str],
        typer.Argument(
            help="The command to run, after --. Every {model} in it becomes the model's "
            "local directory.",
            show_default=False,
        ),
    ],
    *,
    tier: TierOption = None,
    include: IncludeOption = None,
    exclude: ExcludeOption = None,
    compile_key: Annotated[
        list[str] | None,
        typer.Option(
            "--compile-key",
            help="A compile-cache key part as NAME=VALUE (repeatable), e.g. engine=vllm; "
            "extras as extras.NAME=VALUE. The model's key is added by itself.",
        ),
    ] = None,
    fallback: Annotated[
        bool,
        typer.Option(
            "--fallback",
            help="If the agent cannot be reached, run the command against the original URI "
            "(with a warning) instead of failing with exit 3.",
        ),
    ] = False,
    ready_url: Annotated[
        str | None,
        typer.Option(
            "--ready-url",
            help="The engine's health URL (e.g. http://127.0.0.1:8000/health): the compile "
            "cache is uploaded once it answers 2xx, never if the command fails first.",
            show_default=False,
        ),
    ] = None,
    ready_file: Annotated[
        Path | None,
        typer.Option(
            "--ready-file",
            help="A file the engine (or its wrapper) creates when ready: the compile cache is "
            "uploaded once it exists, never if the command fails first.",
            show_default=False,
        ),
    ] = None,
    cached_only: CachedOnlyOption = False,
    as_requester: AsRequesterOption = False,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            envvar="PREWARM_CLIENT_NAME",
            help="How the agent lists this client (default: host name and command).",
            show_default=False,
        ),
    ] = None,
    socket: SocketOption = None,
    wait_for_agent_seconds: WaitForAgentOption = 60.0,
) -> None:
    """Run COMMAND on the node's cached copy of a model, holding a lease while it runs.

    prewarm exec s3://models/llama-3-8b/ -- vllm serve {model} --port 8000
    """
    if not command:
        _fail("give the command to run after --, e.g. -- vllm serve {model}", EXIT_INVALID)
    try:
        key_parts = parse_compile_key(compile_key or ())
        if key_parts:
            engine = key_parts.get("engine") or detect_engine(command) or ""
            key_parts.setdefault("engine", engine)
            derived = engine_key_fields(engine.strip().lower(), command)
            key_parts = merged_key_fields(key_parts, derived)
        key_fields_from_text(key_parts)  # refuse bad parts before pulling anything
        ready_wait = ready_waiter(ready_url, ready_file)
    except InvalidRequest as exc:
        _fail(str(exc), EXIT_INVALID)
    client_name = name or _default_name(command)
    _report_lease_holding()
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(Client(socket))
        try:
            wait_for_agent(client.socket_path, wait_for_agent_seconds, waiting=_say_waiting)
            # The display ends with the pull; the lease stays in the stack.
            with _progress_display(uri) as show:
                handle = stack.enter_context(
                    client.leased(
                        uri,
                        tier=tier,
                        include=include or (),
                        exclude=exclude or (),
                        client_name=client_name,
                        progress=show,
                        cached_only=cached_only,
                        as_requester=as_requester,
                    )
                )
        except AgentUnavailable as exc:
            if not fallback:
                _fail(f"{exc} (--fallback would run the command against {uri})", EXIT_NO_AGENT)
            sys.stderr.write(
                f"prewarm: warning: {exc}\nprewarm: warning: --fallback: running the command "
                f"against {uri} itself; this pod downloads the model on its own.\n"
            )
            raise typer.Exit(run_child(substitute(command, uri), dict(os.environ))) from None
        except InvalidRequest as exc:
            _fail(str(exc), EXIT_INVALID)
        except PrewarmError as exc:
            _fail(str(exc), EXIT_ERROR)
        summary = render.pull_summary(handle, cached_only=cached_only)
        sys.stderr.write(f"prewarm: {summary}\n")
        env = dict(os.environ)
        watch: ReadyWatch | None = None
        if key_parts:
            cache = _compile_cache(client, key_parts, handle, ready_wait is not None)
            if cache is not None:
                env.update(cache.env)
                if ready_wait is not None:
                    watch = ReadyWatch(ready_wait, lambda: report_ready(client, cache.key))
        # The lease stays held (ExitStack) until the child has exited.
        code = run_child(substitute(command, str(handle.path)), env, watch)
    raise typer.Exit(code)


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


def _compile_cache(
    client: Client, key_parts: Mapping[str, str], handle: ModelHandle, publish_on_ready: bool
) -> CompileCacheHandle | None:
    """The compile cache's environment for the child (see docs/compile-cache.md).

    What the launcher can detect itself (torch, Triton, CUDA, GPU) is filled in
    when torch is importable here; ``model_key`` defaults to the snapshot's key.
    A compile cache the agent cannot give is a warning: the command compiles cold.
    """
    try:
        fields = key_fields_from_text(key_parts)
    except InvalidRequest as exc:
        _fail(str(exc), EXIT_INVALID)
    fields.setdefault("model_key", handle.key)
    try:
        parts = detect_key_parts(**fields)
    except ImportError:  # no torch in this image: the parts given are all there is
        parts = key_parts_from(None, **fields)
    try:
        cache = client.compile_cache(
            parts,
            client_name=f"prewarm exec ({handle.key[:12]})",
            publish_on_ready=publish_on_ready,
        )
    except PrewarmError as exc:
        sys.stderr.write(
            f"prewarm: warning: no compile cache ({exc}); the command compiles cold.\n"
        )
        return None
    how = f"restored in {cache.restore_seconds:.2f} s" if cache.restored else "local"
    if cache.restore_note:
        how = f"new: {cache.restore_note}"
    sys.stderr.write(f"prewarm: compile cache {cache.key[:12]} ({how}) -> {cache.path}\n")
    return cache


def run_child(argv: list[str], env: dict[str, str], watch: ReadyWatch | None = None) -> int:
    """Run ``argv`` to the end, forwarding signals; its exit status as a shell reports it.

    ``watch`` waits for the engine to be ready while it runs (see ``_ready``).
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
            child = subprocess.Popen(argv, env=env, process_group=0)
        except FileNotFoundError:
            sys.stderr.write(f"prewarm: {argv[0]}: command not found\n")
            return EXIT_NOT_FOUND
        except PermissionError as exc:
            sys.stderr.write(f"prewarm: {argv[0]}: cannot run it: {exc.strerror}\n")
            return EXIT_CANNOT_RUN
        for signum in pending:
            child.send_signal(signum)
        if watch is not None:
            watch.start()
        returncode = child.wait()
        if watch is not None and not watch.child_exited(returncode):
            sys.stderr.write(
                f"prewarm: the command exited with status {returncode} before it was ready; "
                "its compile artifacts are not uploaded.\n"
            )
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - returncode if returncode < 0 else returncode


def _default_name(command: Sequence[str]) -> str:
    # In a pod the host name is the pod name.
    host = os.environ.get("HOSTNAME") or os.uname().nodename
    return f"{host}: {Path(command[0]).name}"


def _say_waiting(why: str) -> None:
    # The wait's bound and the flag that sets it are in the pod's log, in case it runs out.
    sys.stderr.write(
        f"prewarm: the agent is not serving yet ({why}); waiting for it "
        "(--wait-for-agent / PREWARM_WAIT_FOR_AGENT)\n"
    )
    sys.stderr.flush()


def _fail(message: str, code: int) -> NoReturn:
    sys.stderr.write(f"prewarm: error: {message}\n")
    raise typer.Exit(code)


@contextlib.contextmanager
def _progress_display(uri: str) -> Iterator[Callable[[PullProgress], None]]:
    """A progress callback: a bar on a terminal, a line per step in a pod's log."""
    console = Console(stderr=True)
    if not console.is_terminal:
        yield _ProgressLines(uri)
        return
    progress = Progress(
        TextColumn("{task.description:<8}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        render.BinarySpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    task = progress.add_task("resolve", total=None)

    def update(event: PullProgress) -> None:
        progress.update(
            task,
            description=event.phase,
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
                f" {render.human_bytes(event.bytes_done)} of "
                f"{render.human_bytes(event.bytes_total)} ({tenth * 10}%)"
            )
        sys.stderr.write(f"prewarm: {self._uri}: {event.phase}{done}\n")
        sys.stderr.flush()
