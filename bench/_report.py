"""The report: the run's tables as text and Markdown (the targets are judged in ``_targets``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._hits import HIT_MODES
from ._schemes import row as scheme_row
from ._stats import Sample
from ._targets import Target

__all__ = ["markdown_extras", "markdown_table", "text_table"]

MiB = 1024**2
GiB = 1024**3


def _ok(samples: Mapping[str, Sample], name: str) -> Sample | None:
    sample = samples.get(name)
    return sample if sample is not None and sample.ok else None


_COLUMNS = ("what", "best s", "median s", "MiB/s", "x ceiling", "client CPU s", "server CPU s")


def _rows(samples: Mapping[str, Sample]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for name, sample in samples.items():
        if not sample.ok:
            rows.append((f"{name} [not measured, see below]", "-", "-", "-", "-", "-", "-"))
            continue
        # Each row against the ceiling over its own scheme.
        scheme = sample.extra.get("scheme")
        ceiling = _ok(samples, scheme_row("ceiling", scheme)) if scheme else None
        transfer = sample.extra.get("transfer", True)
        vs = f"{ceiling.best / sample.best:.2f}" if ceiling is not None and transfer else "-"
        rate = f"{sample.rate / MiB:.0f}" if transfer else "-"
        rows.append(
            (
                name,
                f"{sample.best:.3f}",
                f"{sample.median:.3f}",
                rate,
                vs,
                _cpu(sample, "client_cpu"),
                _cpu(sample, "server_cpu"),
            )
        )
    return rows


def _cpu(sample: Sample, key: str) -> str:
    value = sample.extra.get(key)
    return "-" if value is None else f"{value:.2f}"


_CPU_COLUMNS = (
    "what",
    "CPU-s/GiB (process tree)",
    "busiest thread",
    "its CPU-s/GiB",
    "bound GiB/s",
    "main thread CPU-s/GiB",
    "GIL s/GiB (busiest process)",
    "GIL busiest in",
    "GIL bound GiB/s",
    "GIL s/GiB (daemon process)",
    "peak RSS / PSS MiB (tree)",
    "threads",
)


def _cpu_rows(samples: Mapping[str, Sample]) -> list[tuple[str, ...]]:
    """CPU per GiB of the best run: the whole tree, its busiest and main threads; GIL; memory."""
    rows: list[tuple[str, ...]] = []
    for name, sample in samples.items():
        cpu = sample.extra.get("cpu") if sample.ok else None
        if not cpu:
            continue
        rows.append(
            (
                name,
                _number(cpu.get("process_per_gib"), 2),
                str(cpu.get("busiest_thread") or "-"),
                _number(cpu.get("busiest_per_gib"), 3),
                _number(cpu.get("busiest_bound_gib_per_second"), 1),
                _number(cpu.get("main_thread_per_gib"), 3),
                *_gil_cells(sample.extra.get("gil") or {}),
                _memory_cell(sample),
                str(cpu.get("threads_seen", "-")),
            )
        )
    return rows


def _gil_cells(gil: Mapping[str, Any]) -> tuple[str, str, str, str]:
    """Busiest process's seconds held per GiB, which process, the bound, the daemon's own."""
    if "busiest_per_gib" not in gil:
        return ("failed" if "error" in gil else "-", "-", "-", "-")
    return (
        _number(gil["busiest_per_gib"], 3),
        str(gil["busiest_process"] or "-"),
        _number(gil.get("bound_gib_per_second"), 1),
        _number(gil.get("daemon_per_gib"), 3),
    )


def _memory_cell(sample: Sample) -> str:
    rss, pss = sample.extra.get("peak_sampled_rss"), sample.extra.get("peak_sampled_pss")
    if not rss:
        return "-"
    return f"{rss / MiB:.0f} / {pss / MiB:.0f}" if pss else f"{rss / MiB:.0f} / -"


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _text(header: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    rows = [header, *body]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for index, row in enumerate(rows):
        rest = zip(row[1:], widths[1:], strict=True)
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in rest]
        lines.append("  ".join(cells))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _markdown(header: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in body]


def text_table(samples: Mapping[str, Sample], targets: list[Target]) -> str:
    lines = _text(_COLUMNS, _rows(samples))
    cpu = _cpu_rows(samples)
    if cpu:
        lines += ["", *_text(_CPU_COLUMNS, cpu)]
    lines.append("")
    lines += [f"{s.name}: {s.error}" for s in samples.values() if s.error is not None]
    lines.append("")
    for target in targets:
        verdict = {True: "MET", False: "MISSED", None: "n/a"}[target.met]
        lines.append(f"[{verdict:>6}] {target.name}: {target.measured} (goal {target.goal})")
        if target.note:
            lines.append(f"         {target.note}")
    return "\n".join(lines)


_CPU_CAPTION = (
    "CPU per GiB moved (best run; from /proc/<pid>/task/*/stat, over the contender's process "
    "and its descendants; the daemon's main thread runs its event loop). Interpreter lock "
    "(GIL): seconds held per GiB per process, from py-spy --gil during one more cold pull; "
    "its bound is 1 / the busiest process's figure. Peak memory: the worst run, summed over "
    "the daemon's processes."
)


def markdown_table(samples: Mapping[str, Sample], targets: list[Target]) -> str:
    lines = _markdown(_COLUMNS, _rows(samples))
    cpu = _cpu_rows(samples)
    if cpu:
        lines += ["", _CPU_CAPTION, ""]
        lines += _markdown(_CPU_COLUMNS, cpu)
    errors = [f"- {s.name}: {s.error}" for s in samples.values() if s.error is not None]
    if errors:
        lines += ["", *errors]
    lines += ["", "| target | goal | measured | met | note |", "|---|---|---|---|---|"]
    for target in targets:
        verdict = {True: "yes", False: "**no**", None: "n/a"}[target.met]
        lines.append(
            f"| {target.name} | {target.goal} | {target.measured} | {verdict} | {target.note} |"
        )
    return "\n".join(lines) + "\n"


def markdown_extras(
    scaling: Mapping[str, Mapping[str, Any]], hits: dict[str, Any], profile: dict[str, Any]
) -> str:
    """Markdown for the sections beyond the main table: scaling (per scheme), hits, profiles."""
    lines: list[str] = []
    for scheme, one in scaling.items():
        lines += _scaling_lines(one, scheme)
    lines += _hit_lines(hits)
    for plane, p in profile.items():
        if plane == "fallocate":
            lines += [
                "",
                f"posix_fallocate of the model's files on /dev/shm alone (what staging does "
                f"before the first GET): best {p['best']:.2f} s for {p['bytes'] / GiB:.2f} GiB.",
            ]
            continue
        if "error" in p:
            lines += ["", f"Profile ({plane}): {p['error']}"]
            continue
        lines += ["", f"Profile of the daemon during a cold pull ({plane}, {p['samples']} "]
        lines[-1] += "samples, py-spy, CPU only):"
        lines += ["", "| self | function |", "|---|---|"]
        lines += [f"| {share * 100:.1f}% | `{name}` |" for name, share in p["self"]]
    return "\n".join(lines) + "\n"


_SCALING_COLUMNS = (
    "size",
    "best s",
    "median s",
    "MiB/s",
    "x ceiling",
    "x s5cmd",
    "CPU-s/GiB (tree)",
    "s5cmd CPU-s/GiB",
    "busiest thread CPU-s/GiB",
    "main thread CPU-s/GiB",
    "peak RSS / PSS MiB (tree)",
)


def _scaling_lines(scaling: Mapping[str, Any], scheme: str) -> list[str]:
    if not scaling.get("points"):
        return []
    rows: list[tuple[str, ...]] = []
    for p in scaling["points"]:
        size = f"{p['size'] / GiB:g} GiB" if p["size"] >= GiB else f"{p['size'] / MiB:g} MiB"
        if "best" not in p:
            blanks = ["-"] * (len(_SCALING_COLUMNS) - 2)
            rows.append((size, *blanks, f"not measured: {p.get('error', '?')}"[:80]))
            continue
        rss = f"{p['tree_rss'] / MiB:.0f} / {(p.get('tree_pss') or 0) / MiB:.0f}"
        rows.append(
            (
                size,
                f"{p['best']:.2f}",
                f"{p['median']:.2f}",
                f"{p['bytes_per_second'] / MiB:.0f}",
                _number(p.get("x_ceiling"), 2),
                _number(p.get("x_s5cmd"), 2),
                _number(p.get("cpu_per_gib"), 2),
                _number(p.get("s5cmd_cpu_per_gib"), 2),
                _number(p.get("busiest_per_gib"), 3),
                _number(p.get("main_thread_per_gib"), 3),
                rss if p.get("tree_rss") else "-",
            )
        )
    title = f"Cold pulls by size over {scheme.upper()} ({scaling['plane']}; each beside its own "
    lines = ["", title + "ceiling and s5cmd):", ""]
    lines += _markdown(_SCALING_COLUMNS, rows)
    if fit := scaling.get("fit"):
        lines += [
            "",
            f"Fit: {fit['seconds_per_gib']:.2f} s/GiB + {fit['intercept']:.2f} s, "
            f"R^2 {fit['r_squared']:.4f}, worst point {fit['max_residual'] * 100:.1f}% off.",
        ]
    return lines


def _hit_lines(hits: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if hits.get("models"):
        lines += ["", "Hits (EnsureModel on a cached model):", ""]
        header = ("model", "files", "bytes", "best ms", "median ms", "bytes from S3 per call")
        lines += _markdown(
            header,
            [
                (
                    name,
                    str(h["files"]),
                    f"{h['bytes'] / MiB:.0f} MiB",
                    f"{h['best'] * 1000:.1f}",
                    f"{h['median'] * 1000:.1f}",
                    f"{h['served_per_call']:.0f}",
                )
                for name, h in hits["models"].items()
            ],
        )
    modes = hits.get("modes") or {}
    if modes:
        lines += ["", f"Hits by S3's state ({hits.get('modes_model', '?')}):", ""]
        header = (
            "row",
            "calls",
            "agent-side ms (median / best / first)",
            "client ms (median / best)",
            "offline answers",
            "bytes from S3 per call",
        )
        rows: list[tuple[str, ...]] = []
        for name in HIT_MODES:
            m = modes.get(name) or {}
            if "agent_median" not in m:
                rows.append((name, "-", "-", "-", "-", str(m.get("skipped", "not measured"))))
                continue
            rows.append(
                (
                    name,
                    str(m["calls"]),
                    f"{m['agent_median'] * 1000:.2f} / {m['agent_best'] * 1000:.2f} / "
                    f"{m['agent_first'] * 1000:.2f}",
                    f"{m['client_median'] * 1000:.2f} / {m['client_best'] * 1000:.2f}",
                    str(m["resolved_offline_calls"]),
                    f"{m['served_per_call']:.0f}",
                )
            )
        lines += _markdown(header, rows)
    return lines
