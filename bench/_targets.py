"""The targets, judged from one run: each with the measured figure and a verdict.

The first ones come from issue 4 (cold pull vs the ceiling and the
alternatives, warm launches, concurrent clients, RSS, linear cost, hit cost);
``_node_targets`` adds issue 10's (cold at 2 and 8 GiB, CPU per GiB of the
daemon and of its busiest thread, RSS at 8 GiB vs 2 GiB, hits with S3 refusing
connections and with no S3 call).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._hits import NO_S3, REFUSED
from ._stats import Sample

__all__ = ["Target", "judge_targets"]

MiB = 1024**2
GiB = 1024**3
RSS_LIMIT = 256 * MiB
BUSIEST_THREAD_LIMIT = 0.1  # CPU-s per GiB: a bound of 10 GiB/s for the node
REFUSED_HIT_LIMIT = 0.050
NO_S3_HIT_LIMIT = 0.002


@dataclass(frozen=True)
class Target:
    """One target: what it asks for, what this run measured, and whether that meets it."""

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
    """Every target this run measured, with its verdict (None: not measured)."""
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
    targets += _node_targets(samples, planes=planes, scaling=scaling, hits=hits)
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


def _cpu(sample: Sample | None) -> dict[str, Any]:
    return (sample.extra.get("cpu") or {}) if sample is not None else {}


def _node_targets(
    samples: Mapping[str, Sample],
    *,
    planes: list[str],
    scaling: Mapping[str, Any],
    hits: Mapping[str, Any],
) -> list[Target]:
    """Issue 10's targets."""
    targets = [_cold_at(scaling, size) for size in (2 * GiB, 8 * GiB)]
    s5cmd = _cpu(_ok(samples, "s5cmd")).get("process_per_gib")
    for plane in planes:
        cpu = _cpu(_ok(samples, f"prewarm cold ({plane})"))
        per_gib, busiest = cpu.get("process_per_gib"), cpu.get("busiest_per_gib")
        targets.append(
            Target(
                f"daemon CPU per GiB vs s5cmd ({plane})",
                "<= s5cmd's CPU-s per GiB",
                "-" if per_gib is None or s5cmd is None else f"{per_gib:.2f} vs {s5cmd:.2f}",
                None if per_gib is None or s5cmd is None else per_gib <= s5cmd,
                "" if s5cmd is not None else "s5cmd not measured in this run",
            )
        )
        targets.append(
            Target(
                f"busiest daemon thread ({plane})",
                f"<= {BUSIEST_THREAD_LIMIT} CPU-s per GiB (>= 10 GiB/s bound)",
                "-"
                if busiest is None
                else f"{busiest:.3f} CPU-s/GiB, {cpu['busiest_thread']}: bound "
                f"{cpu['busiest_bound_gib_per_second']:.1f} GiB/s",
                None if busiest is None else busiest <= BUSIEST_THREAD_LIMIT,
            )
        )
    targets.append(_rss_at_8(scaling))
    modes = hits.get("modes") or {}
    targets.append(_hit_target(modes.get(REFUSED), REFUSED, REFUSED_HIT_LIMIT))
    targets.append(_hit_target(modes.get(NO_S3), NO_S3, NO_S3_HIT_LIMIT))
    return targets


def _point(scaling: Mapping[str, Any], size: int) -> dict[str, Any] | None:
    for point in scaling.get("points", []):
        if point.get("size") == size:
            return dict(point)
    return None


def _cold_at(scaling: Mapping[str, Any], size: int) -> Target:
    name = f"cold pull vs ceiling at {size / GiB:g} GiB ({scaling.get('plane', '-')})"
    point = _point(scaling, size)
    if point is None or "x_ceiling" not in point:
        why = "not in --scaling" if point is None else point.get("error", "no ceiling")
        return Target(name, ">= 0.90x", "-", None, str(why))
    return Target(
        name,
        ">= 0.90x the ceiling's throughput at the same size",
        f"{point['x_ceiling']:.2f}x ({point['best']:.2f} s, ceiling {point['ceiling_best']:.2f} s)",
        point["x_ceiling"] >= 0.9,
    )


def _rss_at_8(scaling: Mapping[str, Any]) -> Target:
    name = "daemon peak RSS at 8 GiB, vs 2 GiB"
    goal = "<= 256 MiB at 8 GiB and within 10% of the 2 GiB figure"
    big, small = _point(scaling, 8 * GiB), _point(scaling, 2 * GiB)
    if not big or not small or not big.get("vm_hwm") or not small.get("vm_hwm"):
        return Target(name, goal, "-", None, "needs 2GiB and 8GiB in --scaling")
    growth = big["vm_hwm"] / small["vm_hwm"] - 1.0
    return Target(
        name,
        goal,
        f"{big['vm_hwm'] / MiB:.0f} MiB at 8 GiB, {small['vm_hwm'] / MiB:.0f} MiB at 2 GiB "
        f"({growth * 100:+.0f}%)",
        big["vm_hwm"] <= RSS_LIMIT and abs(growth) <= 0.10,
        "VmHWM of the worst run at each size",
    )


def _hit_target(mode: Mapping[str, Any] | None, name: str, limit: float) -> Target:
    goal = f"<= {limit * 1000:g} ms agent-side"
    if not mode or "agent_median" not in mode:
        return Target(name, goal, "-", None, str((mode or {}).get("skipped", "not measured")))
    return Target(
        name,
        goal,
        f"median {mode['agent_median'] * 1000:.1f} ms agent-side (best "
        f"{mode['agent_best'] * 1000:.1f}, first {mode['agent_first'] * 1000:.1f}; client "
        f"median {mode['client_median'] * 1000:.1f} ms)",
        # "No S3 call" also means no byte from S3: the agent must not list behind the option.
        mode["agent_median"] <= limit and (name != NO_S3 or mode["served_per_call"] == 0),
        f"{mode['calls']} calls; judged on the median of the agent's own timing; "
        f"{mode['served_per_call']:.0f} bytes from S3 per call",
    )
