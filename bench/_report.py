"""The report: targets judged from one run's samples, a text table, and Markdown."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._stats import Sample

__all__ = ["Target", "judge_targets", "markdown_extras", "markdown_table", "text_table"]

MiB = 1024**2
GiB = 1024**3
RSS_LIMIT = 256 * MiB


@dataclass(frozen=True)
class Target:
    name: str
    goal: str
    measured: str
    met: bool | None  # None: not measured in this run
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "goal": self.goal,
            "measured": self.measured,
            "met": self.met,
            "note": self.note,
        }


def _ok(samples: Mapping[str, Sample], name: str) -> Sample | None:
    sample = samples.get(name)
    return sample if sample is not None and sample.ok else None


def judge_targets(
    samples: Mapping[str, Sample],
    *,
    planes: list[str],
    default_plane: str,
    model_bytes: int,
    scaling: Mapping[str, Any],
    hits: Mapping[str, Any],
) -> list[Target]:
    targets: list[Target] = []
    ceiling = _ok(samples, "ceiling")
    alternatives = [s for n in ("s5cmd", "boto3", "streamer") if (s := _ok(samples, n))]
    for plane in planes:
        cold = _ok(samples, f"prewarm cold ({plane})")
        if cold is None or ceiling is None:
            reason = samples[f"prewarm cold ({plane})"].error if cold is None else "no ceiling"
            targets.append(
                Target(f"cold pull vs ceiling ({plane})", ">= 0.90x", "-", None, reason or "")
            )
            continue
        ratio = ceiling.best / cold.best
        targets.append(
            Target(
                f"cold pull vs ceiling ({plane})",
                ">= 0.90x the ceiling's throughput",
                f"{ratio:.2f}x ({_rate(cold)} vs {_rate(ceiling)})",
                ratio >= 0.9,
                _phases_note(cold, ceiling),
            )
        )
        if alternatives:
            fastest = min(alternatives, key=lambda s: s.best)
            targets.append(
                Target(
                    f"cold pull vs alternatives ({plane})",
                    "faster than s5cmd, boto3 and the streamer",
                    f"{cold.best:.2f} s vs fastest alternative {fastest.name} "
                    f"{fastest.best:.2f} s ({fastest.best / cold.best:.2f}x)",
                    all(cold.best < s.best for s in alternatives),
                )
            )

    warm = _ok(samples, "prewarm warm launch")
    streamer = _ok(samples, "streamer")
    if warm is not None and streamer is not None:
        saved = 1.0 - warm.best / streamer.best
        note = ""
        paged = _ok(samples, "prewarm warm launch, every page read")
        if paged is not None:
            note = (
                f"reading every page too: {paged.best * 1000:.0f} ms, "
                f"{(1.0 - paged.best / streamer.best) * 100:.1f}% less"
            )
        targets.append(
            Target(
                "warm repeat launch vs streamer re-download",
                ">= 99% less time",
                f"{saved * 100:.1f}% less ({warm.best * 1000:.0f} ms vs {streamer.best:.2f} s)",
                saved >= 0.99,
                note,
            )
        )
    else:
        targets.append(Target("warm repeat launch vs streamer", ">= 99% less time", "-", None))

    many = _ok(samples, f"prewarm 8 clients ({default_plane})")
    one = _ok(samples, f"prewarm cold ({default_plane})")
    if many is not None:
        served = float(many.extra.get("served_ratio", 0.0))
        targets.append(
            Target(
                "8 concurrent cold clients: bytes from S3",
                "1.0x the model's bytes",
                f"{served:.4f}x",
                served < 1.01,
                "counted as bytes the server wrote (headers and listings included)",
            )
        )
        if one is not None:
            ratio = many.best / one.best
            targets.append(
                Target(
                    "8 concurrent cold clients: wall time",
                    "<= 1.1x one client",
                    f"{ratio:.2f}x ({many.best:.2f} s vs {one.best:.2f} s)",
                    ratio <= 1.1,
                )
            )

    peaks = [
        (plane, int(s.extra["peak_vm_hwm"]))
        for plane in planes
        if (s := _ok(samples, f"prewarm cold ({plane})")) and "peak_vm_hwm" in s.extra
    ]
    if peaks:
        worst = max(peak for _, peak in peaks)
        measured = ", ".join(f"{plane} {peak / MiB:.0f} MiB" for plane, peak in peaks)
        targets.append(
            Target(
                f"daemon peak RSS while pulling {model_bytes / GiB:.1f} GiB",
                "<= 256 MiB",
                measured,
                worst <= RSS_LIMIT,
            )
        )
    if scaling.get("rss"):
        sizes = scaling["rss"]
        spread = max(sizes.values()) - min(sizes.values())
        targets.append(
            Target(
                "peak RSS independent of model size",
                "flat across sizes",
                ", ".join(f"{k}: {v / MiB:.0f} MiB" for k, v in sizes.items())
                + f" (spread {spread / MiB:.0f} MiB)",
                spread <= 32 * MiB and max(sizes.values()) <= RSS_LIMIT,
            )
        )
    if scaling.get("fit"):
        fit = scaling["fit"]
        targets.append(
            Target(
                "cold cost linear in bytes",
                "seconds = a + b x bytes",
                f"R^2 {fit['r_squared']:.4f}, worst point {fit['max_residual'] * 100:.1f}% off, "
                f"{fit['seconds_per_gib']:.2f} s/GiB + {fit['intercept']:.2f} s",
                fit["r_squared"] >= 0.98 and fit["max_residual"] <= 0.1,
            )
        )
    if hits.get("files_ratio") is not None:
        targets.append(
            Target(
                "hit cost grows with file count",
                f"{hits['many_files']} vs {hits['few_files']} files, same bytes: grows",
                f"{hits['files_ratio']:.2f}x",
                hits["files_ratio"] > 1.0,
                "EnsureModel on a cached model; it re-lists the prefix, so it scales with objects",
            )
        )
    if hits.get("bytes_ratio") is not None:
        targets.append(
            Target(
                "hit cost independent of bytes",
                f"{hits['big_bytes'] / GiB:.2f} GiB vs {hits['small_bytes'] / MiB:.0f} MiB, "
                "same files: ~1x",
                f"{hits['bytes_ratio']:.2f}x",
                0.75 <= hits["bytes_ratio"] <= 1.33,
            )
        )
    return targets


def _phases_note(cold: Sample, ceiling: Sample) -> str:
    """Where the best cold run's time went, by the agent's own phase timings."""
    runs = cold.extra.get("runs", [])
    if not runs or "download" not in runs[0]:
        return ""
    best = min(runs, key=lambda run: run["seconds"])
    return (
        f"best run: download phase {best['download']:.2f} s "
        f"({ceiling.best / best['download']:.2f}x the ceiling), outside any phase "
        f"(staging set-up) {best['outside_phases']:.2f} s, resolve {best['resolve']:.2f} s"
    )


def _rate(sample: Sample) -> str:
    return f"{sample.rate / MiB:.0f} MiB/s"


_COLUMNS = ("what", "best s", "median s", "MiB/s", "x ceiling", "client CPU s", "server CPU s")


def _rows(samples: Mapping[str, Sample]) -> list[tuple[str, ...]]:
    ceiling = _ok(samples, "ceiling")
    rows: list[tuple[str, ...]] = []
    for name, sample in samples.items():
        if not sample.ok:
            rows.append((f"{name} [not measured, see below]", "-", "-", "-", "-", "-", "-"))
            continue
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


def text_table(samples: Mapping[str, Sample], targets: list[Target]) -> str:
    rows = [_COLUMNS, *_rows(samples)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = []
    for index, row in enumerate(rows):
        rest = zip(row[1:], widths[1:], strict=True)
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in rest]
        lines.append("  ".join(cells))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines += [f"{s.name}: {s.error}" for s in samples.values() if s.error is not None]
    lines.append("")
    for target in targets:
        verdict = {True: "MET", False: "MISSED", None: "n/a"}[target.met]
        lines.append(f"[{verdict:>6}] {target.name}: {target.measured} (goal {target.goal})")
        if target.note:
            lines.append(f"         {target.note}")
    return "\n".join(lines)


def markdown_table(samples: Mapping[str, Sample], targets: list[Target]) -> str:
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(samples)]
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


def markdown_extras(scaling: dict[str, Any], hits: dict[str, Any], profile: dict[str, Any]) -> str:
    """Markdown for the sections beyond the main table: scaling, hits, profiles."""
    lines: list[str] = []
    if scaling.get("points"):
        lines += ["", f"Cold pulls by size ({scaling['plane']}):", ""]
        lines += ["| bytes | best s | median s | s/GiB | peak RSS MiB |", "|---|---|---|---|---|"]
        for p in scaling["points"]:
            rss = f"{p['vm_hwm'] / MiB:.0f}" if p.get("vm_hwm") else "-"
            lines.append(
                f"| {p['bytes'] / GiB:.2f} GiB | {p['best']:.2f} | {p['median']:.2f} | "
                f"{p['seconds_per_gib']:.2f} | {rss} |"
            )
    if hits.get("models"):
        lines += ["", "Hits (EnsureModel on a cached model):", ""]
        lines += ["| model | files | bytes | best ms | median ms | bytes from S3 per call |"]
        lines += ["|---|---|---|---|---|---|"]
        for name, h in hits["models"].items():
            lines.append(
                f"| {name} | {h['files']} | {h['bytes'] / MiB:.0f} MiB | {h['best'] * 1000:.1f} | "
                f"{h['median'] * 1000:.1f} | {h['served_per_call']:.0f} |"
            )
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
