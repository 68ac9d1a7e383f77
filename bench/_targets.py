"""The targets, judged from one run: each with the measured figure and a verdict.

The first ones come from issue 4 (cold pull vs the ceiling and the
alternatives, warm launches, concurrent clients, RSS, linear cost, hit cost);
``_node_targets`` adds issue 10's (cold at 2 and 8 GiB, CPU per GiB of the
daemon and of its busiest thread, RSS at 8 GiB vs 2 GiB, hits with S3 refusing
connections and with no S3 call); ``_line_rate`` issue 15's (prewarm against
s5cmd over HTTP and HTTPS, interpreter locks, the event loop, memory with
worker processes). A per-row target is judged over every scheme measured, its
name ending in the scheme; warm launches, concurrent clients and hits run over
one scheme. "The daemon" is its process tree: the daemon and its workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._hits import NO_S3, REFUSED
from ._line_rate import line_rate_targets
from ._rows import cold_name
from ._schemes import row
from ._stats import Sample
from ._target import RSS_LIMIT, Target, cpu_of, measured, point_at

__all__ = ["RunOutline", "Target", "judge_targets"]

MiB = 1024**2
GiB = 1024**3
BUSIEST_THREAD_LIMIT = 0.1  # CPU-s per GiB: a bound of 10 GiB/s for the node
REFUSED_HIT_LIMIT = 0.050
NO_S3_HIT_LIMIT = 0.002
ALTERNATIVES = ("s5cmd", "boto3", "streamer")


@dataclass(frozen=True)
class RunOutline:
    """What one run measured: its schemes, its rows and the main model's size."""

    schemes: Sequence[str]
    # The scheme warm launches, concurrent clients and hits ran over.
    preferred: str
    # The data planes whose cold pulls ran (empty without the cold section).
    planes: Sequence[str]
    default_plane: str
    # The concurrent clients' row (over ``preferred``), if measured.
    concurrent: str | None
    model_bytes: int


def judge_targets(
    samples: Mapping[str, Sample],
    outline: RunOutline,
    *,
    scaling: Mapping[str, Mapping[str, Any]],
    hits: Mapping[str, Any],
) -> list[Target]:
    """Every target this run measured, with its verdict (None: not measured).

    ``scaling``: the scale section's result per scheme; ``hits``: the hit section's.
    """
    schemes, preferred, planes = outline.schemes, outline.preferred, outline.planes
    concurrent, default_plane = outline.concurrent, outline.default_plane
    targets: list[Target] = []
    for scheme in schemes:
        for plane in planes:
            targets += _cold_targets(samples, plane, scheme)
    targets.append(_warm_target(samples, preferred))
    if concurrent is not None:
        targets += _concurrent_targets(samples, concurrent, cold_name(default_plane, preferred))
    for scheme in schemes:
        if target := _peak_rss_target(samples, planes, scheme, outline.model_bytes):
            targets.append(target)
    for scheme, one in scaling.items():
        if one.get("fit"):
            targets.append(_linear_target(one["fit"], scheme))
    targets += _node_targets(samples, schemes=schemes, planes=planes, scaling=scaling, hits=hits)
    targets += _hit_shape_targets(hits)
    targets += line_rate_targets(
        samples, schemes=schemes, cold_rows=[*planes, None], scaling=scaling
    )
    return targets


def _cold_targets(samples: Mapping[str, Sample], plane: str, scheme: str) -> list[Target]:
    """Issue 4's: the cold pull against the ceiling and against every alternative."""
    name = cold_name(plane, scheme)
    cold, ceiling = measured(samples, name), measured(samples, row("ceiling", scheme))
    title = row(f"cold pull vs ceiling ({plane})", scheme)
    if cold is None or ceiling is None:
        sample = samples.get(name)
        reason = (sample.error if sample is not None else "not run") if cold is None else None
        return [Target(title, ">= 0.90x", "-", None, reason or "no ceiling")]
    ratio = ceiling.best / cold.best
    targets = [
        Target(
            title,
            ">= 0.90x the ceiling's throughput",
            f"{ratio:.2f}x ({_rate(cold)} vs {_rate(ceiling)})",
            ratio >= 0.9,
            _phases_note(cold, ceiling),
        )
    ]
    alternatives = [s for n in ALTERNATIVES if (s := measured(samples, row(n, scheme)))]
    if alternatives:
        fastest = min(alternatives, key=lambda s: s.best)
        targets.append(
            Target(
                row(f"cold pull vs alternatives ({plane})", scheme),
                "faster than s5cmd, boto3 and the streamer",
                f"{cold.best:.2f} s vs fastest alternative {fastest.name} "
                f"{fastest.best:.2f} s ({fastest.best / cold.best:.2f}x)",
                all(cold.best < s.best for s in alternatives),
            )
        )
    return targets


def _warm_target(samples: Mapping[str, Sample], scheme: str) -> Target:
    name = "warm repeat launch vs streamer re-download"
    warm = measured(samples, "prewarm warm launch")
    streamer = measured(samples, row("streamer", scheme))
    if warm is None or streamer is None:
        return Target(name, ">= 99% less time", "-", None)
    saved = 1.0 - warm.best / streamer.best
    note = ""
    paged = measured(samples, "prewarm warm launch, every page read")
    if paged is not None:
        note = (
            f"reading every page too: {paged.best * 1000:.0f} ms, "
            f"{(1.0 - paged.best / streamer.best) * 100:.1f}% less"
        )
    return Target(
        f"{name} [{scheme}]",
        ">= 99% less time",
        f"{saved * 100:.1f}% less ({warm.best * 1000:.0f} ms vs {streamer.best:.2f} s)",
        saved >= 0.99,
        note,
    )


def _concurrent_targets(
    samples: Mapping[str, Sample], concurrent: str, one_client: str
) -> list[Target]:
    many = measured(samples, concurrent)
    if many is None:
        return []
    clients = many.extra.get("runs", [{}])[0].get("clients", "?")
    served = float(many.extra.get("served_ratio", 0.0))
    targets = [
        Target(
            f"{clients} concurrent cold clients: bytes from S3",
            "1.0x the model's bytes",
            f"{served:.4f}x",
            served < 1.01,
            "counted as bytes the server wrote (headers, listings and TLS framing included)",
        )
    ]
    one = measured(samples, one_client)
    if one is not None:
        ratio = many.best / one.best
        targets.append(
            Target(
                f"{clients} concurrent cold clients: wall time",
                "<= 1.1x one client",
                f"{ratio:.2f}x ({many.best:.2f} s vs {one.best:.2f} s)",
                ratio <= 1.1,
            )
        )
    return targets


def _peak_rss_target(
    samples: Mapping[str, Sample], planes: Sequence[str], scheme: str, model_bytes: int
) -> Target | None:
    """Issue 4's, on the tree: the daemon and its workers, RSS summed over them."""
    peaks = [
        (plane, int(s.extra["peak_sampled_rss"]), int(s.extra["peak_vm_hwm"]))
        for plane in planes
        if (s := measured(samples, cold_name(plane, scheme))) and "peak_sampled_rss" in s.extra
    ]
    if not peaks:
        return None
    return Target(
        row(f"daemon peak RSS while pulling {model_bytes / GiB:.1f} GiB", scheme),
        "<= 256 MiB",
        ", ".join(f"{plane} {tree / MiB:.0f} MiB" for plane, tree, _ in peaks),
        max(tree for _, tree, _ in peaks) <= RSS_LIMIT,
        "sampled RSS summed over the daemon's processes, worst run; the daemon's own VmHWM: "
        + ", ".join(f"{plane} {hwm / MiB:.0f} MiB" for plane, _, hwm in peaks),
    )


def _linear_target(fit: Mapping[str, Any], scheme: str) -> Target:
    return Target(
        row("cold cost linear in bytes", scheme),
        "seconds = a + b x bytes",
        f"R^2 {fit['r_squared']:.4f}, worst point {fit['max_residual'] * 100:.1f}% off, "
        f"{fit['seconds_per_gib']:.2f} s/GiB + {fit['intercept']:.2f} s",
        fit["r_squared"] >= 0.98 and fit["max_residual"] <= 0.1,
    )


def _hit_shape_targets(hits: Mapping[str, Any]) -> list[Target]:
    targets: list[Target] = []
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


def _node_targets(
    samples: Mapping[str, Sample],
    *,
    schemes: Sequence[str],
    planes: Sequence[str],
    scaling: Mapping[str, Mapping[str, Any]],
    hits: Mapping[str, Any],
) -> list[Target]:
    """Issue 10's, per scheme."""
    targets: list[Target] = []
    for scheme in schemes:
        one = scaling.get(scheme, {})
        targets += [_cold_at(one, size, scheme) for size in (2 * GiB, 8 * GiB)]
        s5cmd = cpu_of(measured(samples, row("s5cmd", scheme))).get("process_per_gib")
        for plane in planes:
            cpu = cpu_of(measured(samples, cold_name(plane, scheme)))
            targets += _cpu_targets(cpu, s5cmd, plane, scheme)
        targets.append(_rss_at_8(one, scheme))
    modes = hits.get("modes") or {}
    targets.append(_hit_target(modes.get(REFUSED), REFUSED, REFUSED_HIT_LIMIT))
    targets.append(_hit_target(modes.get(NO_S3), NO_S3, NO_S3_HIT_LIMIT))
    return targets


def _cpu_targets(
    cpu: Mapping[str, Any], s5cmd: float | None, plane: str, scheme: str
) -> list[Target]:
    per_gib, busiest = cpu.get("process_per_gib"), cpu.get("busiest_per_gib")
    return [
        Target(
            row(f"daemon CPU per GiB vs s5cmd ({plane})", scheme),
            "<= s5cmd's CPU-s per GiB",
            "-" if per_gib is None or s5cmd is None else f"{per_gib:.2f} vs {s5cmd:.2f}",
            None if per_gib is None or s5cmd is None else per_gib <= s5cmd,
            "" if s5cmd is not None else "s5cmd not measured in this run",
        ),
        Target(
            row(f"busiest daemon thread ({plane})", scheme),
            f"<= {BUSIEST_THREAD_LIMIT} CPU-s per GiB (>= 10 GiB/s bound)",
            "-"
            if busiest is None
            else f"{busiest:.3f} CPU-s/GiB, {cpu['busiest_thread']}: bound "
            f"{cpu['busiest_bound_gib_per_second']:.1f} GiB/s",
            None if busiest is None else busiest <= BUSIEST_THREAD_LIMIT,
        ),
    ]


def _cold_at(scaling: Mapping[str, Any], size: int, scheme: str) -> Target:
    name = row(f"cold pull vs ceiling at {size / GiB:g} GiB ({scaling.get('plane', '-')})", scheme)
    point = point_at(scaling, size)
    if point is None or "x_ceiling" not in point:
        why = "not in --scaling" if point is None else point.get("error", "no ceiling")
        return Target(name, ">= 0.90x", "-", None, str(why))
    return Target(
        name,
        ">= 0.90x the ceiling's throughput at the same size",
        f"{point['x_ceiling']:.2f}x ({point['best']:.2f} s, ceiling {point['ceiling_best']:.2f} s)",
        point["x_ceiling"] >= 0.9,
    )


def _rss_at_8(scaling: Mapping[str, Any], scheme: str) -> Target:
    name = row("daemon peak RSS at 8 GiB, vs 2 GiB", scheme)
    goal = "<= 256 MiB at 8 GiB and within 10% of the 2 GiB figure"
    big, small = point_at(scaling, 8 * GiB), point_at(scaling, 2 * GiB)
    if not big or not small or not big.get("tree_rss") or not small.get("tree_rss"):
        return Target(name, goal, "-", None, "needs 2GiB and 8GiB in --scaling")
    growth = big["tree_rss"] / small["tree_rss"] - 1.0
    return Target(
        name,
        goal,
        f"{big['tree_rss'] / MiB:.0f} MiB at 8 GiB, {small['tree_rss'] / MiB:.0f} MiB at 2 GiB "
        f"({growth * 100:+.0f}%)",
        big["tree_rss"] <= RSS_LIMIT and abs(growth) <= 0.10,
        "sampled RSS summed over the daemon's processes, worst run at each size",
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
