"""``prewarm compile ls|show|why|evict|push|pull|compact``: the node's torch.compile caches."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.console import Console, Group, RenderableType
from rich.table import Table

from agent._vocabulary import human_bytes
from agent.client import (
    Client,
    CompileCacheHandle,
    CompileCacheInfo,
    CompileCompaction,
    CompileExplanation,
    CompileVerdict,
    InvalidRequest,
    NotFound,
)

from . import _render as render
from ._errors import agent_errors as _agent_errors
from ._options import SocketOption

__all__ = ["compile_app"]

_KEY_WIDTH = 12
_EPOCH = datetime.fromtimestamp(0, UTC)

compile_app = typer.Typer(
    name="compile",
    help="Inspect and manage the node's torch.compile caches (see docs/compile-cache.md).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

JsonOption = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON on stdout, nothing else.")
]
KeyArgument = Annotated[
    str, typer.Argument(help="A key or a unique prefix of 8+ hex digits (DOMAIN/KEY: a domain's).")
]


def _stdout() -> Console:
    return render.console()


def _when(moment: datetime | None) -> str:
    if moment is None or moment <= _EPOCH:
        return "-"
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _find(client: Client, ref: str) -> CompileCacheInfo:
    domain, slash, prefix = ref.strip().rpartition("/")
    prefix = prefix.lower()
    if len(prefix) < 8:
        raise InvalidRequest(f"{ref!r} is too short; give 8 or more hex digits of a key.")
    matches = [
        c
        for c in client.list_compile_caches()
        if c.key.startswith(prefix) and (not slash or c.domain == domain)
    ]
    if not matches:
        raise NotFound(
            f"No compile cache has a key starting with {prefix}. See `prewarm compile ls`."
        )
    if len(matches) > 1:
        raise InvalidRequest(
            f"Key prefix {prefix} matches {len(matches)} caches; give more digits."
        )
    return matches[0]


def _table(caches: list[CompileCacheInfo]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("domain", "key", "engine", "model", "torch", "gpu"):
        table.add_column(column, no_wrap=True)
    for column in ("tp", "size", "files"):
        table.add_column(column, justify="right")
    table.add_column("last used", no_wrap=True)
    table.add_column("uploaded", no_wrap=True)
    table.add_column("signed by", no_wrap=True)
    for c in caches:
        p = c.parts
        table.add_row(
            c.domain,
            c.key[:_KEY_WIDTH],
            f"{p.engine} {p.engine_version}".strip(),
            p.model_key[:_KEY_WIDTH] or "-",
            p.torch_version,
            p.gpu_name or "-",
            str(p.tensor_parallel),
            human_bytes(c.bytes),
            str(c.file_count),
            _when(c.last_used),
            _when(c.uploaded) if c.uploaded_digest else "no",
            c.signed_by or ("unsigned" if c.uploaded_digest else "-"),
        )
    return table


def _detail(c: CompileCacheInfo) -> RenderableType:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    p = c.parts
    rows = [
        ("domain", c.domain),
        ("key", c.key),
        ("path", str(c.path)),
        ("size", f"{human_bytes(c.bytes)} ({c.bytes} bytes), {c.file_count} files"),
        ("created", _when(c.created)),
        ("last used", _when(c.last_used)),
        ("restored", "yes" if c.restored else "no"),
        ("last launch", _verdict_line(c.last_verdict)),
        ("publish", "when a launch reports ready" if c.publish_on_ready else "when quiet"),
        ("uploaded", f"{_when(c.uploaded)} {c.uploaded_digest}" if c.uploaded_digest else "no"),
        ("signed by", c.signed_by or ("unsigned" if c.uploaded_digest else "-")),
        ("engine", f"{p.engine} {p.engine_version}".strip()),
        ("torch", p.torch_version),
        ("triton", p.triton_version or "-"),
        ("cuda", p.cuda_version or "-"),
        ("gpu", p.gpu_name or "-"),
        ("model", p.model_key or "-"),
        ("parallel", f"tp {p.tensor_parallel}, pp {p.pipeline_parallel}, dp {p.data_parallel}"),
        ("config hash", p.config_hash or "-"),
    ]
    rows += [(f"extra {name}", value) for name, value in sorted(p.extras.items())]
    for name, value in rows:
        grid.add_row(name, value)
    return Group(grid)


def _handle_line(handle: CompileCacheHandle) -> str:
    return (
        f"restored {handle.key} in {handle.restore_seconds:.2f} s: {handle.file_count} files, "
        f"{human_bytes(handle.bytes)} -> {handle.path}"
    )


@compile_app.command("ls")
def list_caches(socket: SocketOption = None, json_out: JsonOption = False) -> None:
    """List the compile caches on this node, most recently used first."""
    with _agent_errors(), Client(socket) as client:
        caches = client.list_compile_caches()
    if json_out:
        sys.stdout.write(render.to_json(caches) + "\n")
    elif not caches:
        _stdout().print("no compile caches")
    else:
        _stdout().print(_table(caches))


@compile_app.command()
def show(key: KeyArgument, socket: SocketOption = None, json_out: JsonOption = False) -> None:
    """Show one compile cache: its key parts, size and upload record."""
    with _agent_errors(), Client(socket) as client:
        info = _find(client, key)
    if json_out:
        sys.stdout.write(render.to_json(info) + "\n")
    else:
        _stdout().print(_detail(info))


@compile_app.command()
def why(key: KeyArgument, socket: SocketOption = None, json_out: JsonOption = False) -> None:
    """Why a key missed: the nearest other key of the same model (on this node or in S3),
    and what differs."""
    with _agent_errors(), Client(socket) as client:
        why = client.explain_compile_cache(key)
    if json_out:
        sys.stdout.write(render.to_json(_why_document(why)) + "\n")
        return
    nearest = why.nearest
    if nearest is None:
        lines = [f"{why.key[:_KEY_WIDTH]}: no other compile cache of its model and engine"]
    else:
        where = f"cached key {nearest.key[:_KEY_WIDTH]}"
        if nearest.location != "node":
            signer = f"signed by {nearest.signed_by}" if nearest.signed_by else "unsigned"
            where = f"key in S3 {nearest.key[:_KEY_WIDTH]} ({signer})"
        lines = [f"{why.key[:_KEY_WIDTH]}: nearest {where}, differs in"]
        lines += [f"  {c.part} {c.cached or '-'} -> {c.wanted or '-'}" for c in nearest.changes]
    if why.s3_note:
        lines.append(f"note: {why.s3_note}")
    _stdout().print("\n".join(lines), soft_wrap=True, markup=False)


def _why_document(why: CompileExplanation) -> dict[str, object]:
    nearest = why.nearest
    changes = (
        []
        if nearest is None
        else [{"part": c.part, "cached": c.cached, "wanted": c.wanted} for c in nearest.changes]
    )
    return {
        "key": why.key,
        "nearest": nearest.key if nearest else None,
        "location": nearest.location if nearest else None,
        "signed_by": nearest.signed_by if nearest else None,
        "changes": changes,
        "s3_note": why.s3_note,
    }


@compile_app.command()
def evict(key: KeyArgument, socket: SocketOption = None, json_out: JsonOption = False) -> None:
    """Remove a compile cache from this node (refused while a pod holds its compile lock)."""
    with _agent_errors(), Client(socket) as client:
        result = client.evict_compile_cache(key)
    if json_out:
        sys.stdout.write(render.to_json(result) + "\n")
        return
    keys = ", ".join(c.key[:_KEY_WIDTH] for c in result.evicted)
    _stdout().print(f"evicted compile cache {keys}, freed {human_bytes(result.bytes_freed)}")


@compile_app.command()
def push(key: KeyArgument, socket: SocketOption = None, json_out: JsonOption = False) -> None:
    """Pack and upload a compile cache now (skipped when S3 already has the same content)."""
    with _agent_errors(), Client(socket) as client:
        result = client.push_compile_cache(key)
    if json_out:
        sys.stdout.write(render.to_json(result) + "\n")
    elif result.uploaded:
        _stdout().print(
            f"uploaded {human_bytes(result.bytes)} ({result.digest}) to {result.uri}",
            soft_wrap=True,
        )
    else:
        _stdout().print(f"not uploaded: {result.skipped_reason}", soft_wrap=True)


@compile_app.command()
def pull(
    key: Annotated[str, typer.Argument(help="A key (all 32 hex digits if not on this node).")],
    socket: SocketOption = None,
    json_out: JsonOption = False,
) -> None:
    """Restore a compile cache from S3 now, replacing this node's copy."""
    with _agent_errors(), Client(socket) as client:
        handle = client.pull_compile_cache(key)
    if json_out:
        sys.stdout.write(render.to_json(handle) + "\n")
    else:
        _stdout().print(_handle_line(handle), soft_wrap=True)


@compile_app.command()
def compact(
    key: Annotated[
        str, typer.Argument(help="A key on this node (8+ hex digits), or a full key of 32.")
    ],
    socket: SocketOption = None,
    json_out: JsonOption = False,
) -> None:
    """Make a key's archives in S3 one archive now, so a restore reads one object."""
    with _agent_errors(), Client(socket) as client:
        result = client.compact_compile_cache(key)
    if json_out:
        sys.stdout.write(render.to_json(result) + "\n")
    else:
        _stdout().print(_compaction_line(result), soft_wrap=True, markup=False)


def _compaction_line(result: CompileCompaction) -> str:
    deleted = result.retired_deleted
    retired = f"; deleted {deleted} retired archives" if deleted else ""
    if result.compacted:
        return (
            f"compacted {result.archives_before} archives into one "
            f"({human_bytes(result.archive_bytes)}) at {result.uri}{retired}"
        )
    return f"not compacted: {result.skipped_reason}{retired}"


def _verdict_line(verdict: CompileVerdict | None) -> str:
    if verdict is None:
        return "none reported ready"
    when = f" at {_when(verdict.at)}" if verdict.at else ""
    by = f" by {verdict.client_name}" if verdict.client_name else ""
    return f"{verdict.describe()}{when}{by}"
