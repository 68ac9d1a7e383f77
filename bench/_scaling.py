"""Cold scaling: cold pulls of models of several sizes, each beside its own ceiling and s5cmd.

Every size gets its own ceiling (curl over the same objects) and s5cmd in the
same round as its cold pull (prewarm with its defaults: nothing pinned), over
each scheme, so "x ceiling" and "x s5cmd" compare like with like at each size.
Per size and scheme the report gives wall time, MiB/s, the ratios, the
daemon's CPU seconds per GiB (the daemon and its workers, its busiest thread,
its event loop's thread) and its peak memory summed over its processes (RSS
and PSS); across sizes, a least-squares fit of seconds on bytes.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ByteSize, TypeAdapter

from . import _agent as agent
from . import _contenders as contenders
from ._contenders import Context, RunResult
from ._model import BenchModel
from ._sections import attempt, say
from ._stats import Sample, linear_fit

__all__ = ["parse_sizes", "scaling"]

MiB = 1024**2
GiB = 1024**3


def parse_sizes(text: str) -> list[int]:
    """``"1GiB,2GiB"`` -> byte counts; a clear ValueError for anything else."""
    sizes: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            size = int(TypeAdapter(ByteSize).validate_python(item))
        except ValueError:
            raise ValueError(f"{item!r} is not a size; write sizes like 512MiB or 2GiB") from None
        if size <= 0:
            raise ValueError(f"{item!r}: a model size must be more than 0 bytes")
        sizes.append(size)
    if not sizes:
        raise ValueError("no sizes given; write a comma-separated list like 1GiB,2GiB,4GiB,8GiB")
    return sorted(set(sizes))


def _model_name(size: int, main_size: int) -> str:
    if size == main_size:
        return "main"
    return f"cold-{size / GiB:g}g" if size >= GiB else f"cold-{size / MiB:g}m"


def scaling(
    args: argparse.Namespace,
    contexts: Mapping[str, Context],
    model: Callable[[str, int, int], BenchModel],
    plane: str,
) -> dict[str, Any]:
    """Per scheme: per --scaling size, a ceiling, s5cmd and a cold pull each round; a fit."""
    sized = [model(_model_name(size, args.size), size, args.shards) for size in args.sizes]
    runs = {
        (scheme, m.name, what): Sample(f"{what} {m.total_bytes / GiB:.2f} GiB [{scheme}]")
        for scheme in contexts
        for m in sized
        for what in _CONTENDERS
    }
    for round_index in range(args.repeats):
        for m in sized:
            for scheme, ctx in contexts.items():
                say(
                    f"scaling round {round_index + 1}/{args.repeats}: ceiling, s5cmd and cold "
                    f"{m.name} [{scheme}]"
                )
                for what, run in _runs(ctx, m, plane).items():
                    attempt(runs[(scheme, m.name, what)], run)
    return {
        scheme: _summary(
            plane,
            [
                _point(m, size, {what: runs[(scheme, m.name, what)] for what in _CONTENDERS})
                for m, size in zip(sized, args.sizes, strict=True)
            ],
        )
        for scheme in contexts
    }


_CONTENDERS = ("ceiling", "s5cmd", "cold")


def _runs(ctx: Context, m: BenchModel, plane: str) -> dict[str, Callable[[], RunResult]]:
    return {
        "ceiling": functools.partial(contenders.run_ceiling, ctx, m),
        "s5cmd": functools.partial(contenders.run_s5cmd, ctx, m),
        # prewarm with its own tuning (adaptive GETs, automatic parts), as a node runs it.
        "cold": functools.partial(agent.cold_pull, ctx, m, plane, pinned=False),
    }


def _summary(plane: str, points: list[dict[str, Any]]) -> dict[str, Any]:
    good = [p for p in points if "best" in p]
    result: dict[str, Any] = {"plane": plane, "points": points}
    if len(good) >= 2:
        fit = linear_fit([p["bytes"] for p in good], [p["best"] for p in good])
        result["fit"] = {
            "seconds_per_gib": fit.slope * GiB,
            "intercept": fit.intercept,
            "r_squared": fit.r_squared,
            "max_residual": fit.max_residual,
        }
    return result


def _point(m: BenchModel, size: int, contenders: Mapping[str, Sample]) -> dict[str, Any]:
    """One model size's figures: the cold pull against the ceiling and s5cmd."""
    ceiling, s5cmd, cold = (contenders[what] for what in _CONTENDERS)
    # size: what --scaling asked for; bytes: the model's (its small files included).
    point: dict[str, Any] = {"model": m.name, "size": size, "bytes": m.total_bytes}
    if not cold.ok:
        return point | {"error": cold.error or "no run"}
    cpu = cold.extra.get("cpu") or {}
    point |= {
        "best": cold.best,
        "median": cold.median,
        "bytes_per_second": cold.rate,
        "seconds_per_gib": cold.best / (m.total_bytes / GiB),
        "cpu_per_gib": cpu.get("process_per_gib"),
        "busiest_per_gib": cpu.get("busiest_per_gib"),
        "busiest_thread": cpu.get("busiest_thread"),
        "busiest_bound_gib_per_second": cpu.get("busiest_bound_gib_per_second"),
        "main_thread_per_gib": cpu.get("main_thread_per_gib"),
        # The worst run's peaks: what a node must leave room for.
        "vm_hwm": cold.extra.get("peak_vm_hwm"),
        "tree_rss": cold.extra.get("peak_sampled_rss"),
        "tree_pss": cold.extra.get("peak_sampled_pss"),
        "runs": cold.extra.get("runs", []),
    }
    if ceiling.ok:
        point |= {"ceiling_best": ceiling.best, "x_ceiling": ceiling.best / cold.best}
    else:
        point["ceiling_error"] = ceiling.error or "no run"
    if s5cmd.ok:
        s5cmd_cpu = (s5cmd.extra.get("cpu") or {}).get("process_per_gib")
        point |= {
            "s5cmd_best": s5cmd.best,
            "x_s5cmd": s5cmd.best / cold.best,
            "s5cmd_cpu_per_gib": s5cmd_cpu,
        }
    else:
        point["s5cmd_error"] = s5cmd.error or "no run"
    return point
