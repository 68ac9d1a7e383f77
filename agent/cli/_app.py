"""The ``prewarm`` command: people on the node talking to the agent's socket."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    Progress,
    TaskID,
)

from agent._exceptions import printable
from agent._version import __version__
from agent._vocabulary import DataPlaneName, TierName
from agent.client import Client, EnsureOptions, InvalidRequest, ModelHandle
from agent.client import Progress as PullProgress

from . import _render as render
from ._compile import compile_app
from ._errors import EXIT_ERROR, agent_errors, fail
from ._exec import exec_command
from ._health import health_command
from ._interrupt import PullWatch, stop_pull_when_interrupted
from ._options import (
    AsRequesterOption,
    CachedOnlyOption,
    ExcludeOption,
    IncludeOption,
    JsonOption,
    SocketOption,
    TierOption,
)

__all__ = ["app"]

app = typer.Typer(
    name="prewarm",
    help="Inspect and manage the model cache of this node's prewarm agent.",
    no_args_is_help=True,
    add_completion=False,
    # Expected errors are reported in one line (see _errors); anything
    # else is a bug, and a plain traceback is the most useful report of it.
    pretty_exceptions_enable=False,
)


_SIZE = re.compile(r"\s*(\d+)\s*([kmg]?)(i?)(b?)\s*", re.IGNORECASE)


def _parse_size(text: str) -> int:
    """'64MiB', '64M', '1GiB', '8388608' -> bytes; KB/MB/GB (with a B, no i) are decimal."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise typer.BadParameter(f"{text!r} is not a size like 64MiB, 1GiB or 8388608")
    number, prefix, binary, byte = match.groups()
    base = 1000 if byte and not binary else 1024
    power = " kmg".index(prefix.lower() or " ")
    return int(number) * int(base**power)


def _stdout() -> Console:
    return render.console()


def _client_name() -> str:
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or f"uid {os.getuid()}"
    return f"prewarm cli ({user})"


def _show_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"prewarm {__version__}\n")
        raise typer.Exit


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_show_version, is_eager=True
        ),
    ] = False,
) -> None:
    """Inspect and manage the model cache of this node's prewarm agent."""


class _Bar:
    """A progress callback that drives a rich progress bar on stderr."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._task: TaskID = progress.add_task("resolve", total=None, files="")

    def __call__(self, event: PullProgress) -> None:
        """Move the bar to where ``event`` says the pull is."""
        files = f"{event.files_done}/{event.files_total} files" if event.files_total else ""
        self._progress.update(
            self._task,
            description=printable(event.phase),
            completed=event.bytes_done,
            total=event.bytes_total or None,
            files=files,
        )


def _pull(
    client: Client, uri: str, options: EnsureOptions, watch: PullWatch, *, bar: bool
) -> ModelHandle:
    """``ensure``, its wait named by ``watch``'s token and its progress shown through
    ``watch``: with ``bar``, a bar on a terminal."""
    watching: EnsureOptions = {**options, "progress": watch, "waiter_token": watch.token}
    console = render.console(stderr=True)
    if not (bar and console.is_terminal):
        # Logs, pipes and --json get the summary line (or the JSON) only, not bar frames.
        return client.ensure(uri, **watching)
    progress = render.pull_progress(console, files=True)
    with progress:
        watch.show = _Bar(progress)
        return client.ensure(uri, **watching)


@app.command()
def pull(
    uri: Annotated[str, typer.Argument(help="The model, e.g. s3://models/llama-3-8b/.")],
    *,
    tier: TierOption = None,
    include: IncludeOption = None,
    exclude: ExcludeOption = None,
    pin: Annotated[
        bool, typer.Option("--pin", help="Pin it: never evicted by pressure (see `unpin`).")
    ] = False,
    strict_tier: Annotated[
        bool,
        typer.Option("--strict-tier", help="Fail rather than use the other tier when full."),
    ] = False,
    data_plane: Annotated[
        DataPlaneName | None,
        typer.Option(help="What moves the bytes if this starts a pull (default: the agent's)."),
    ] = None,
    concurrency: Annotated[
        int | None,
        # Checked with the client's other pull options (agent._vocabulary).
        typer.Option(
            help="GETs in flight, pinned, if this starts a pull; unset, the agent grows them "
            "until the link is full (default: the agent's)."
        ),
    ] = None,
    chunk_size: Annotated[
        int | None,
        typer.Option(
            parser=_parse_size,
            metavar="SIZE",
            help="Bytes per ranged GET and journal entry, e.g. 64MiB (default: the agent's).",
        ),
    ] = None,
    cached_only: CachedOnlyOption = False,
    as_requester: AsRequesterOption = False,
    socket: SocketOption = None,
    json_out: JsonOption = False,
) -> None:
    """Make sure a model is in the node cache, pulling it if needed.

    --data-plane, --concurrency and --chunk-size apply only when this request
    starts the pull; joining a pull in progress keeps that pull's settings.
    Ctrl-C stops the pull too, unless another client waits on it; what it
    wrote stays in staging, and the next pull resumes from it.
    """
    watch = PullWatch()
    options = EnsureOptions(
        tier=tier,
        include=include or (),
        exclude=exclude or (),
        client_name=_client_name(),
        pin=pin,
        strict_tier=strict_tier,
        data_plane=data_plane,
        concurrency=concurrency,
        chunk_size=chunk_size,
        cached_only=cached_only,
        as_requester=as_requester,
    )
    with agent_errors(), Client(socket) as client:
        with stop_pull_when_interrupted(client, uri, watch, as_requester=as_requester):
            handle = _pull(client, uri, options, watch, bar=not json_out)
        if json_out:
            sys.stdout.write(render.to_json(handle) + "\n")
        else:
            _stdout().print(render.pull_summary(handle, cached_only=cached_only), soft_wrap=True)


@app.command()
def cancel(
    ref: Annotated[
        str,
        typer.Argument(
            help="A URI stops every pull of it; a key (or a unique prefix, 8+ hex digits) that "
            "pull. `prewarm status` lists the pulls in flight."
        ),
    ],
    as_requester: AsRequesterOption = False,
    socket: SocketOption = None,
    json_out: JsonOption = False,
) -> None:
    """Stop a pull in progress: what it wrote stays in staging, and the next pull resumes.

    Clients waiting on it fail with CANCELLED. A pull already publishing cannot
    be stopped; a tenant's socket stops only pulls no other socket waits on.
    """
    with agent_errors(), Client(socket) as client:
        pulls = client.cancel_pull(ref, as_requester=as_requester)
    if json_out:
        sys.stdout.write(render.to_json(pulls) + "\n")
    else:
        _stdout().print(render.cancel_summary(pulls), soft_wrap=True)


@app.command("ls")
def list_models(socket: SocketOption = None, json_out: JsonOption = False) -> None:
    """List the models in the node cache.

    FILTERS shows a snapshot's include (+GLOB) and exclude (-GLOB) globs: one URI pulled
    with other filters is another snapshot, on a row of its own.
    """
    with agent_errors(), Client(socket) as client:
        models = client.list_models()
    if json_out:
        sys.stdout.write(render.to_json(models) + "\n")
    elif not models:
        _stdout().print("no models cached")
    else:
        _stdout().print(render.models_table(models))


@app.command()
def show(
    ref: Annotated[str, typer.Argument(help="A URI, a key, or a unique key prefix (8+ chars).")],
    socket: SocketOption = None,
    json_out: JsonOption = False,
) -> None:
    """Show one cached model, its leases and its files."""
    with agent_errors(), Client(socket) as client:
        info = client.get(ref)
    if json_out:
        sys.stdout.write(render.to_json(info) + "\n")
    else:
        _stdout().print(render.model_detail(info))


@app.command()
def evict(
    ref: Annotated[
        str, typer.Argument(help="A key (or unique prefix) evicts one snapshot; a URI all of it.")
    ],
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Evict even leased or pinned snapshots (processes that mapped the files "
            "keep their pages; new requests pull again).",
        ),
    ] = False,
    socket: SocketOption = None,
    json_out: JsonOption = False,
) -> None:
    """Remove models from the node cache."""
    with agent_errors(), Client(socket) as client:
        result = client.evict(ref, force=force)
    if json_out:
        sys.stdout.write(render.to_json(result) + "\n")
    else:
        _stdout().print(render.evict_summary(result), soft_wrap=True)


@app.command()
def gc(
    tier: Annotated[TierName | None, typer.Option(help="Only this tier (default: both).")] = None,
    socket: SocketOption = None,
    json_out: JsonOption = False,
) -> None:
    """Run an eviction pass now (normally the agent runs one at the high watermark)."""
    with agent_errors(), Client(socket) as client:
        result = client.collect_garbage(tier)
    if json_out:
        sys.stdout.write(render.to_json(result) + "\n")
    else:
        _stdout().print(render.gc_summary(result), soft_wrap=True)


@app.command()
def verify(
    ref: Annotated[
        str | None,
        typer.Argument(help="A URI, a key, or a unique key prefix; or --all.", show_default=False),
    ] = None,
    *,
    all_models: Annotated[bool, typer.Option("--all", help="Verify every cached model.")] = False,
    report_only: Annotated[
        bool,
        typer.Option("--report-only", help="Only report; keep snapshots that fail."),
    ] = False,
    socket: SocketOption = None,
    json_out: JsonOption = False,
) -> None:
    """Re-hash cached files; snapshots that fail are evicted. Exits 1 if any failed."""
    if all_models == bool(ref):
        # Said in the command's own terms (the client's check names its all=True).
        fail(
            InvalidRequest(
                "give one model to verify (a URI or a key) or --all, "
                + ("not both." if all_models else "e.g. `prewarm verify --all`.")
            )
        )
    with agent_errors(), Client(socket) as client:
        results = client.verify(ref, all=all_models, report_only=report_only)
    if json_out:
        sys.stdout.write(render.to_json(results) + "\n")
    else:
        _stdout().print(render.verify_report(results), soft_wrap=True, markup=False)
    if not all(v.ok for v in results):
        raise typer.Exit(EXIT_ERROR)


RefArgument = Annotated[
    str, typer.Argument(help="A URI (its newest snapshot), a key, or a unique key prefix.")
]


@app.command()
def pin(ref: RefArgument, socket: SocketOption = None, json_out: JsonOption = False) -> None:
    """Pin a cached model: pressure never evicts it (evict --force still does)."""
    _pin(ref, pinned=True, socket=socket, json_out=json_out)


@app.command()
def unpin(ref: RefArgument, socket: SocketOption = None, json_out: JsonOption = False) -> None:
    """Unpin a cached model: it is evicted by pressure like any other again."""
    _pin(ref, pinned=False, socket=socket, json_out=json_out)


def _pin(ref: str, *, pinned: bool, socket: Path | None, json_out: bool) -> None:
    with agent_errors(), Client(socket) as client:
        info = client.pin(ref, pinned=pinned)
    if json_out:
        sys.stdout.write(render.to_json(info) + "\n")
    else:
        _stdout().print(render.pin_summary(info), soft_wrap=True, markup=False)


@app.command()
def status(socket: SocketOption = None, json_out: JsonOption = False) -> None:
    """Show the agent's version, tiers (budgets, usage, leases, pins) and pulls in flight."""
    with agent_errors(), Client(socket) as client:
        agent_status = client.status()
    if json_out:
        sys.stdout.write(render.to_json(agent_status) + "\n")
    else:
        _stdout().print(render.status_view(agent_status))


# `prewarm exec URI [OPTIONS] -- CMD ...`: everything after -- belongs to CMD.
app.command("exec")(exec_command)
app.command("health")(health_command)
app.add_typer(compile_app, name="compile")
