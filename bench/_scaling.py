"""Cold scaling: cold pulls of models of several sizes, each beside its own ceiling.

Every size gets its own ceiling (curl over the same objects) in the same
round as its cold pull, so "x ceiling" compares like with like at each size.
Per size the report gives wall time, MiB/s, the ratio to that ceiling, the
daemon's CPU seconds per GiB (whole process and busiest thread) and its peak
RSS; across sizes, a least-squares fit of seconds on bytes.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from pydantic import ByteSize, TypeAdapter

from . import _agent as agent
from . import _contenders as contenders
from ._contenders import Context
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
    ctx: Context,
    model: Callable[[str, int, int], BenchModel],
    plane: str,
) -> dict[str, Any]:
    """Per --scaling size: a ceiling and a cold pull each round; points and a linear fit."""
    sized = [model(_model_name(size, args.size), size, args.shards) for size in args.sizes]
    colds = {m.name: Sample(f"cold {m.total_bytes / GiB:.2f} GiB") for m in sized}
    ceilings = {m.name: Sample(f"ceiling {m.total_bytes / GiB:.2f} GiB") for m in sized}
    for round_index in range(args.repeats):
        for m in sized:
            say(f"scaling round {round_index + 1}/{args.repeats}: ceiling and cold {m.name}")
            attempt(ceilings[m.name], functools.partial(contenders.run_ceiling, ctx, m))
            attempt(colds[m.name], functools.partial(agent.cold_pull, ctx, m, plane))
    points = [
        _point(m, size, colds[m.name], ceilings[m.name])
        for m, size in zip(sized, args.sizes, strict=True)
    ]
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


def _point(m: BenchModel, size: int, cold: Sample, ceiling: Sample) -> dict[str, Any]:
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
        # The worst run's peak: what a node must leave room for.
        "vm_hwm": cold.extra.get("peak_vm_hwm"),
        "runs": cold.extra.get("runs", []),
    }
    if ceiling.ok:
        point |= {"ceiling_best": ceiling.best, "x_ceiling": ceiling.best / cold.best}
    else:
        point["ceiling_error"] = ceiling.error or "no run"
    return point
