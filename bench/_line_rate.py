"""Issue 15's targets: cold pulls at s5cmd's speed and cost, over HTTP and HTTPS, with no
interpreter lock, event loop or worker's memory as the limit.

- Each cold row (every plane, and the agent's defaults), over each scheme: at
  least s5cmd's speed at no more than s5cmd's CPU per GiB, the daemon's CPU
  being its whole tree (its range workers included); and its event loop's
  thread (the daemon's main thread) at most ``LOOP_LIMIT`` CPU-s per GiB.
- Over HTTPS, where a Python reader takes its lock once per TLS record: the
  seconds any one process of the daemon holds its interpreter lock per GiB
  (py-spy ``--gil``, ``_gil``) at most ``GIL_LIMIT``, a bound of 50 GiB/s.
- At 2 and 8 GiB (the scale section, its pinned default plane): the same
  comparison with s5cmd, and the tree's peak RSS at most 256 MiB (PSS beside it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._rows import DEFAULTS, cold_name
from ._schemes import row
from ._stats import Sample
from ._target import RSS_LIMIT, Target, cpu_of, measured, point_at

__all__ = ["GIL_LIMIT", "LOOP_LIMIT", "line_rate_targets"]

MiB = 1024**2
GiB = 1024**3
GIL_LIMIT = 0.02  # seconds held per GiB in any one process: >= 50 GiB/s
LOOP_LIMIT = 0.05  # CPU-s per GiB in the daemon's event-loop thread
SIZES = (2 * GiB, 8 * GiB)


def line_rate_targets(
    samples: Mapping[str, Sample],
    *,
    schemes: Sequence[str],
    cold_rows: Sequence[str | None],
    scaling: Mapping[str, Mapping[str, Any]],
) -> list[Target]:
    """``cold_rows``: the planes of the cold rows, None for the agent's defaults."""
    targets: list[Target] = []
    for scheme in schemes:
        s5cmd = measured(samples, row("s5cmd", scheme))
        for plane in cold_rows:
            name = cold_name(plane, scheme) if plane is not None else row(DEFAULTS, scheme)
            if name not in samples:
                continue
            label = plane or "agent defaults"
            cold = measured(samples, name)
            targets.append(_vs_s5cmd(cold, s5cmd, row(f"cold pull vs s5cmd ({label})", scheme)))
            targets.append(_loop(cold, row(f"event-loop thread ({label})", scheme)))
            if scheme == "https":
                targets.append(_gil(cold, row(f"interpreter lock per process ({label})", scheme)))
        one = scaling.get(scheme) or {}
        for size in SIZES:
            plane = one.get("plane", "-")
            at = f"at {size / GiB:g} GiB ({plane})"
            targets.append(_vs_s5cmd_at(one, size, row(f"cold pull vs s5cmd {at}", scheme)))
            targets.append(_memory_at(one, size, row(f"daemon tree peak memory {at}", scheme)))
    return targets


_VS_S5CMD = ">= 1.0x s5cmd's speed at <= 1.0x its CPU-s per GiB"


def _vs_s5cmd(cold: Sample | None, s5cmd: Sample | None, name: str) -> Target:
    per_gib = cpu_of(cold).get("process_per_gib")
    s5cmd_per_gib = cpu_of(s5cmd).get("process_per_gib")
    if cold is None or s5cmd is None or per_gib is None or not s5cmd_per_gib:
        why = "the cold pull failed" if cold is None else "s5cmd not measured in this run"
        return Target(name, _VS_S5CMD, "-", None, why)
    speed = s5cmd.best / cold.best
    cost = per_gib / s5cmd_per_gib
    return Target(
        name,
        _VS_S5CMD,
        f"{speed:.2f}x speed ({cold.rate / MiB:.0f} vs {s5cmd.rate / MiB:.0f} MiB/s), "
        f"{cost:.2f}x CPU ({per_gib:.2f} vs {s5cmd_per_gib:.2f} CPU-s/GiB)",
        speed >= 1.0 and cost <= 1.0,
        "best runs; the daemon's CPU counts its worker processes",
    )


def _loop(cold: Sample | None, name: str) -> Target:
    goal = f"<= {LOOP_LIMIT} CPU-s per GiB"
    cpu = cpu_of(cold)
    per_gib = cpu.get("main_thread_per_gib")
    if per_gib is None:
        return Target(name, goal, "-", None, "the cold pull failed" if cold is None else "")
    return Target(
        name,
        goal,
        f"{per_gib:.3f} CPU-s/GiB",
        per_gib <= LOOP_LIMIT,
        f"the daemon's main thread; its busiest thread: {cpu.get('busiest_thread')}",
    )


def _gil(cold: Sample | None, name: str) -> Target:
    goal = f"<= {GIL_LIMIT} s held per GiB in any one process (>= {1 / GIL_LIMIT:.0f} GiB/s)"
    gil = (cold.extra.get("gil") or {}) if cold is not None else {}
    if "busiest_per_gib" not in gil:
        why = gil.get("error") or ("the cold pull failed" if cold is None else "not measured")
        return Target(name, goal, "-", None, str(why))
    bound = gil.get("bound_gib_per_second")
    return Target(
        name,
        goal,
        f"{gil['busiest_per_gib']:.3f} s/GiB in {gil['busiest_process']} "
        f"(bound {'-' if bound is None else f'{bound:.1f}'} GiB/s); "
        f"the daemon's own process {gil['daemon_per_gib']:.3f}",
        gil["busiest_per_gib"] <= GIL_LIMIT,
        f"py-spy --gil at {gil['rate']} Hz during one more cold pull "
        f"({gil.get('py_spy_behind_warnings', 0)} 'behind' warnings)",
    )


def _vs_s5cmd_at(scaling: Mapping[str, Any], size: int, name: str) -> Target:
    point = point_at(scaling, size)
    if point is None or "x_s5cmd" not in point or not point.get("s5cmd_cpu_per_gib"):
        why = "not in --scaling" if point is None else point.get("error", "no s5cmd run")
        return Target(name, _VS_S5CMD, "-", None, str(why))
    cost = point["cpu_per_gib"] / point["s5cmd_cpu_per_gib"]
    return Target(
        name,
        _VS_S5CMD,
        f"{point['x_s5cmd']:.2f}x speed ({point['best']:.2f} s vs {point['s5cmd_best']:.2f} s), "
        f"{cost:.2f}x CPU ({point['cpu_per_gib']:.2f} vs "
        f"{point['s5cmd_cpu_per_gib']:.2f} CPU-s/GiB)",
        point["x_s5cmd"] >= 1.0 and cost <= 1.0,
    )


def _memory_at(scaling: Mapping[str, Any], size: int, name: str) -> Target:
    goal = "RSS summed over its processes <= 256 MiB"
    point = point_at(scaling, size)
    if point is None or not point.get("tree_rss"):
        why = "not in --scaling" if point is None else point.get("error", "not sampled")
        return Target(name, goal, "-", None, str(why))
    return Target(
        name,
        goal,
        f"RSS {point['tree_rss'] / MiB:.0f} MiB, PSS {(point.get('tree_pss') or 0) / MiB:.0f} MiB",
        point["tree_rss"] <= RSS_LIMIT,
        "worst run; PSS counts a page shared by the daemon and its workers once; "
        f"the daemon's own VmHWM {(point.get('vm_hwm') or 0) / MiB:.0f} MiB",
    )
