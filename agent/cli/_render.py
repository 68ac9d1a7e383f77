"""How the CLI shows things: human lines and rich tables, or JSON for machines.

Every value that came over the socket (URIs, keys, paths, client names, etags,
problems) may hold what its sender chose, so it is shown escaped: control and
other unprintable characters as ``\\x1b``-style text (agent._exceptions.printable),
and always as plain text, never as rich markup (``[link=...]`` would otherwise
become a terminal hyperlink). JSON output is escaped by the JSON encoder.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from agent._exceptions import printable
from agent._vocabulary import human_bytes
from agent.client import (
    AgentStatus,
    EvictResult,
    LeaseInfo,
    ModelHandle,
    ModelInfo,
    PullCancellation,
    PullStatus,
    TierStatus,
    Verification,
)

__all__ = [
    "BinarySpeedColumn",
    "InertConsole",
    "cancel_line",
    "cancel_summary",
    "console",
    "evict_summary",
    "filters_text",
    "gc_summary",
    "model_detail",
    "models_table",
    "pin_summary",
    "plain",
    "pull_summary",
    "rate",
    "status_view",
    "to_json",
    "verify_report",
]

_EPOCH = datetime.fromtimestamp(0, UTC)
_KEY_WIDTH = 12
# Enough of a lease id to tell leases apart and to grep the agent's log for.
_LEASE_ID_WIDTH = 8


class InertConsole(Console):
    """A console that shows every string it is handed as inert text.

    Each string printed or put in a table cell goes through ``render_str``:
    here it is escaped and never read as markup or emoji, so a tenant's key part
    holding ``[/bold]`` neither breaks the table nor becomes an OSC 8 link, and
    an ESC in a file name reaches the terminal as ``\\x1b``.
    """

    def render_str(self, text: str, **options: Any) -> Text:
        """``text`` escaped, as plain text whatever the caller asked."""
        options["markup"] = False
        options["emoji"] = False
        return super().render_str(printable(text), **options)


def console(*, stderr: bool = False) -> Console:
    """The CLI's console on stdout (or stderr): inert text, no highlighting.

    Off a terminal rich assumes 80 columns and would wrap or cut table cells;
    tables only take the width they need, so a wide page is safe there.
    """
    stream = sys.stderr if stderr else sys.stdout
    return InertConsole(
        stderr=stderr,
        highlight=False,
        markup=False,
        emoji=False,
        width=None if stream.isatty() else 400,
    )


def plain(value: object) -> Text:
    """A value from the agent as inert text: escaped, never read as markup."""
    return Text(printable(str(value)))


def rate(n: int, seconds: float) -> str:
    """Bytes per second in the binary units of the sizes printed beside it (MiB/s, GiB/s)."""
    if seconds <= 0:
        return "- MiB/s"
    return f"{human_bytes(int(n / seconds))}/s"


class BinarySpeedColumn(ProgressColumn):
    """A progress bar's transfer speed in binary units, like its DownloadColumn(binary_units).

    rich's TransferSpeedColumn is decimal only, which put "MiB" and "MB/s" on one line.
    """

    def render(self, task: Task) -> Text:
        """The task's speed so far (its finished speed once done), e.g. ``12.5 MiB/s``."""
        speed = task.finished_speed or task.speed
        if speed is None:
            return Text("?", style="progress.data.speed")
        return Text(f"{human_bytes(int(speed))}/s", style="progress.data.speed")


def pull_progress(console: Console, *, files: bool) -> Progress:
    """The bar of a pull on a terminal: phase, bar, bytes, speed (binary units), the files
    done when ``files`` (its tasks then carry a ``files`` field), time left. It goes away when
    the pull ends; the summary line stays. No column reads markup: the phase is the agent's."""
    columns: list[ProgressColumn] = [
        TextColumn("{task.description:<8}", markup=False),
        BarColumn(),
        DownloadColumn(binary_units=True),
        BinarySpeedColumn(),
    ]
    if files:
        columns.append(TextColumn("{task.fields[files]}", markup=False))
    columns.append(TimeRemainingColumn())
    return Progress(*columns, console=console, transient=True)


def _when(moment: datetime) -> str:
    # The agent leaves a timestamp unset (the epoch) when it has none.
    if moment <= _EPOCH:
        return "-"
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _uptime(seconds: float) -> str:
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m {secs}s"
    return f"{minutes}m {secs}s" if minutes else f"{seconds:.1f}s"


def pull_summary(handle: ModelHandle, *, cached_only: bool = False) -> Text:
    """One line: what happened, where the time went, where the model is.

    ``cached_only``: the request asked S3 nothing, so an unchecked answer says
    that rather than blaming S3 (the handle is ``resolved_offline`` either way).
    """
    return plain(_pull_line(handle, cached_only))


def _unchecked_note(handle: ModelHandle, cached_only: bool) -> str:
    if not handle.resolved_offline:
        return ""
    if cached_only:
        return " (cached only: the newest cached snapshot, S3 not asked whether it is current)"
    return " (S3 unreachable: served the newest cached snapshot without checking it is current)"


def _pull_line(handle: ModelHandle, cached_only: bool) -> str:
    t = handle.timings
    offline = _unchecked_note(handle, cached_only)
    if handle.hit:
        return f"hit: {handle.uri} in {t.total:.3f} s{offline} -> {handle.path}"
    phases = f"download {t.download:.2f} s, verify {t.verify:.2f} s, publish {t.publish:.2f} s"
    size = human_bytes(handle.total_bytes)
    if handle.joined:
        # The pull began before this request: its figures are the pull's, not this wait's.
        pulled = t.download + t.verify + t.publish
        return (
            f"joined a pull of {handle.uri} in progress: waited {t.total:.2f} s for it "
            f"(resolve {t.resolve:.2f} s, wait {t.wait:.2f} s); the pull took {pulled:.2f} s "
            f"({phases}), {size} at {rate(handle.total_bytes, pulled)}{offline} -> {handle.path}"
        )
    return (
        f"cold pull of {handle.uri} in {t.total:.2f} s (resolve {t.resolve:.2f} s, {phases}), "
        f"{size} at {rate(handle.total_bytes, t.total)}{offline} -> {handle.path}"
    )


def cancel_summary(pulls: list[PullCancellation]) -> Text:
    """``prewarm cancel``: one line per pull it named."""
    return plain("\n".join(cancel_line(p) for p in pulls))


def cancel_line(pull: PullCancellation) -> str:
    """What became of one pull: stopped, with what stays in staging, or why it goes on."""
    if not pull.cancelled:
        others = "another client waits" if pull.other_waiters == 1 else "other clients wait"
        return f"the pull of {pull.uri} goes on: {others} for it"
    kept = human_bytes(pull.kept_bytes)
    return (
        f"cancelled the pull of {pull.uri} ({pull.key[:_KEY_WIDTH]}); {kept} of "
        f"{human_bytes(pull.total_bytes)} kept in staging, a later pull resumes from them"
    )


def models_table(models: list[ModelInfo]) -> Table:
    """``prewarm ls``: one row per cached snapshot."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("key", no_wrap=True)
    table.add_column("uri", overflow="fold")
    # Snapshots of one URI with other include/exclude globs are other rows.
    table.add_column("filters", overflow="fold")
    table.add_column("tier")
    table.add_column("size", justify="right")
    table.add_column("files", justify="right")
    table.add_column("created", no_wrap=True)
    table.add_column("last used", no_wrap=True)
    table.add_column("hits", justify="right")
    table.add_column("leases", justify="right")
    table.add_column("pin")
    for m in sorted(models, key=lambda m: (m.uri, m.created)):
        table.add_row(
            plain(m.key[:_KEY_WIDTH]),
            plain(m.uri),
            plain(filters_text(m.include, m.exclude)),
            m.tier,
            human_bytes(m.total_bytes),
            str(m.file_count),
            _when(m.created),
            _when(m.last_used),
            str(m.hit_count),
            str(len(m.leases)),
            "pinned" if m.pinned else "-",
        )
    return table


def filters_text(include: tuple[str, ...], exclude: tuple[str, ...]) -> str:
    """A snapshot's globs in one cell: ``+GLOB`` included, ``-GLOB`` excluded, ``-`` none."""
    globs = [f"+{glob}" for glob in include] + [f"-{glob}" for glob in exclude]
    return " ".join(globs) or "-"


def _fields(rows: list[tuple[str, str]]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    for name, value in rows:
        grid.add_row(name, plain(value))
    return grid


def model_detail(info: ModelInfo) -> RenderableType:
    """``prewarm show``: one snapshot's fields, its leases and its files."""
    rows = [
        ("uri", info.uri),
        ("key", info.key),
        ("path", str(info.path)),
        ("tier", info.tier),
        ("size", f"{human_bytes(info.total_bytes)} ({info.total_bytes} bytes)"),
        ("files", str(info.file_count)),
        ("created", _when(info.created)),
        ("last used", _when(info.last_used)),
        ("hits", str(info.hit_count)),
        ("pinned", "yes" if info.pinned else "no"),
        ("leases", str(len(info.leases))),
        ("signature", info.verified_by or "not asked for"),
    ]
    if info.include:
        rows.append(("include", " ".join(info.include)))
    if info.exclude:
        rows.append(("exclude", " ".join(info.exclude)))
    files = Table(box=None, header_style="bold", pad_edge=False)
    files.add_column("path", overflow="fold")
    files.add_column("size", justify="right")
    files.add_column("etag", no_wrap=True)
    for f in sorted(info.files, key=lambda f: f.path):
        files.add_row(plain(f.path), human_bytes(f.size), plain(f.etag))
    parts: list[RenderableType] = [_fields(rows), ""]
    if info.leases:
        parts += [_leases_table(info.leases), ""]
    parts.append(files)
    return Group(*parts)


def _leases_table(leases: tuple[LeaseInfo, ...]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("lease", "client", "pid", "uid", "acquired", "state"):
        table.add_column(column, no_wrap=column != "client")
    for lease in sorted(leases, key=lambda lease: lease.acquired):
        table.add_row(
            plain(lease.id[:_LEASE_ID_WIDTH] or "-"),  # ids are shown to their holder only
            plain(lease.client_name or "-"),
            "-" if lease.pid is None else str(lease.pid),
            "-" if lease.uid is None else str(lease.uid),
            _when(lease.acquired),
            _lease_state(lease),
        )
    return table


def _lease_state(lease: LeaseInfo) -> str:
    if lease.held:
        return "held"
    if lease.expires is None:
        return "-"
    return f"expires {_when(lease.expires)}"


def evict_summary(result: EvictResult) -> Text:
    """``prewarm evict``: what was evicted and the bytes freed, in one line."""
    return plain(_evict_line(result))


def _evict_line(result: EvictResult) -> str:
    if not result.evicted:
        return "nothing evicted"
    keys = ", ".join(m.key[:_KEY_WIDTH] for m in result.evicted)
    uris = ", ".join(sorted({m.uri for m in result.evicted}))
    count = len(result.evicted)
    noun = "snapshot" if count == 1 else "snapshots"
    return f"evicted {count} {noun} of {uris} ({keys}), freed {human_bytes(result.bytes_freed)}"


def gc_summary(result: EvictResult) -> Text:
    """``prewarm gc``: what the pass collected and the bytes freed, in one line."""
    return plain(_gc_line(result))


def _gc_line(result: EvictResult) -> str:
    if not result.evicted:
        return "nothing to collect"
    keys = ", ".join(m.key[:_KEY_WIDTH] for m in result.evicted)
    count = len(result.evicted)
    noun = "snapshot" if count == 1 else "snapshots"
    return f"collected {count} {noun} ({keys}), freed {human_bytes(result.bytes_freed)}"


def pin_summary(info: ModelInfo) -> Text:
    """``prewarm pin``/``unpin``: the snapshot and its new state, in one line."""
    what = "pinned" if info.pinned else "unpinned"
    return plain(f"{what} {info.uri} ({info.key[:_KEY_WIDTH]})")


def verify_report(results: list[Verification]) -> Text:
    """One line per snapshot, then one indented line per problem, then the totals."""
    return plain(_verify_lines(results))


def _verify_lines(results: list[Verification]) -> str:
    if not results:
        return "no models cached"
    lines: list[str] = []
    for v in results:
        checked = f"{human_bytes(v.bytes_checked)} in {v.seconds:.2f} s"
        if v.ok:
            lines.append(f"ok      {v.key[:_KEY_WIDTH]}  {v.uri}  {checked}")
            continue
        fate = "evicted" if v.evicted else "kept"
        lines.append(f"FAILED  {v.key[:_KEY_WIDTH]}  {v.uri}  {checked}, {fate}")
        lines.extend(f"  {p.path}: {p.check}: {p.detail}" for p in v.problems)
    failed = sum(not v.ok for v in results)
    lines.append(f"{len(results) - failed} ok, {failed} failed")
    return "\n".join(lines)


def _pull_row(p: PullStatus) -> tuple[str, ...]:
    pr = p.progress
    done = f"{human_bytes(pr.bytes_done)} / {human_bytes(pr.bytes_total)}"
    return (
        printable(p.key[:_KEY_WIDTH] or "-"),
        printable(p.uri),
        p.tier,
        pr.phase,
        done,
        f"{pr.files_done}/{pr.files_total}",
        str(p.waiters),
        _when(p.started),
    )


def status_view(status: AgentStatus) -> RenderableType:
    """``prewarm status``: the agent, its tiers and the pulls in flight."""
    head = _fields(
        [
            ("version", status.version),
            ("uptime", _uptime(status.uptime_seconds)),
            ("socket", status.socket_path),
            ("default tier", status.default_tier),
            ("data plane", status.data_plane),
            ("models", str(status.model_count)),
            ("leases", str(status.lease_count)),
            (
                "compile caches",
                f"{status.compile_cache_count} ({human_bytes(status.compile_cache_bytes)})",
            ),
        ]
    )
    tiers = Table(box=None, header_style="bold", pad_edge=False, title_justify="left")
    columns = ("tier", "root", "capacity", "budget", "reserve", "used", "staging", "free")
    for column in (*columns, "models", "leased", "pinned"):
        tiers.add_column(column, justify="left" if column in ("tier", "root") else "right")
    for t in status.tiers:
        tiers.add_row(
            t.tier,
            plain(t.root),
            human_bytes(t.capacity_bytes),
            human_bytes(t.budget_bytes),
            human_bytes(t.reserve_bytes),
            human_bytes(t.used_bytes),
            human_bytes(t.staging_bytes),
            human_bytes(t.free_bytes),
            str(t.model_count),
            str(t.leased_count),
            str(t.pinned_count),
        )
    parts: list[RenderableType] = [head, "", tiers, *_resumable_lines(status.tiers), ""]
    if status.pulls:
        pulls = Table(box=None, header_style="bold", pad_edge=False)
        for column in ("key", "uri", "tier", "phase", "bytes", "files", "waiters", "started"):
            pulls.add_column(column)
        for p in status.pulls:
            pulls.add_row(*(plain(cell) for cell in _pull_row(p)))
        parts += ["pulls in flight:", pulls]
    else:
        parts.append("no pulls in flight")
    return Group(*parts)


def _resumable_lines(tiers: tuple[TierStatus, ...]) -> list[RenderableType]:
    """What stopped pulls left in staging, per tier: counted in staging, resumed by a pull."""
    return [
        f"{t.tier}: {human_bytes(t.resumable_bytes)} kept in staging by {t.resumable_count} "
        f"stopped pull{'s' if t.resumable_count > 1 else ''}; pulling the same snapshot "
        "again resumes from them"
        for t in tiers
        if t.resumable_count
    ]


def _json_default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def to_json(value: object) -> str:
    """Dataclasses (or lists of them) as indented JSON; times in ISO 8601, UTC."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif isinstance(value, list):
        value = [
            dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
            for v in value
        ]
    return json.dumps(value, indent=2, default=_json_default)
