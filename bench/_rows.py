"""Which rows a run measures, side by side, and how each one runs.

A row is one contender over one scheme (``"s5cmd [https]"``); every round
runs each row once, in this order, so drift over the run (other load, the page
cache) spreads over all of them. The per-scheme rows come scheme by scheme:
the ceiling and the alternatives, then a cold pull per data plane and with the
agent's defaults. Concurrent clients run over one scheme (``Servers.preferred``).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from . import _agent as agent
from . import _contenders as contenders
from ._contenders import Context, RunResult
from ._model import BenchModel
from ._schemes import row
from ._sections import cold_runner, compare_name

__all__ = ["ALTERNATIVES", "DEFAULTS", "ColdRow", "Plan", "cold_name", "plan_rows"]

# The sections that are one row per scheme, besides the cold pulls.
ALTERNATIVES = ("ceiling", "s5cmd", "boto3", "streamer")
# The agent as installed: its own plane choice and tuning (concurrency from model size).
DEFAULTS = "prewarm cold (agent defaults)"


def cold_name(plane: str, scheme: str) -> str:
    """The row of a cold pull pinned to ``plane``."""
    return row(f"prewarm cold ({plane})", scheme)


@dataclass(frozen=True)
class ColdRow:
    """A cold pull's row: its scheme, plane (None: the agent's) and tuning."""

    name: str
    scheme: str
    plane: str | None
    # The run's concurrency and chunk size, or the agent's own tuning.
    pinned: bool = True
    source: Path | None = None  # another checkout's agent


@dataclass(frozen=True)
class Plan:
    """The rows in the order a round runs them, and which of them are cold pulls."""

    runners: dict[str, Callable[[], RunResult]]
    schemes: dict[str, str]  # row -> the scheme it runs over
    cold: list[ColdRow]
    concurrent: str | None  # the concurrent clients' row, if measured


def plan_rows(
    args: argparse.Namespace,
    contexts: Mapping[str, Context],
    model: BenchModel,
    *,
    default_plane: str,
    preferred: str,
) -> Plan:
    """Every row the sections asked for, in the order of a round."""
    sections = set(args.sections)
    runners: dict[str, Callable[[], RunResult]] = {}
    schemes: dict[str, str] = {}
    cold: list[ColdRow] = []
    for scheme, ctx in contexts.items():
        for name in ALTERNATIVES:
            if name in sections:
                runners[row(name, scheme)] = _alternative(name, ctx, model)
                schemes[row(name, scheme)] = scheme
        if "cold" in sections:
            cold += _cold_rows(args, scheme)
    concurrent = None
    if "concurrent" in sections:
        # The one-client row it is compared with, if the cold section does not run it.
        baseline = ColdRow(cold_name(default_plane, preferred), preferred, default_plane)
        if baseline.name not in {c.name for c in cold}:
            cold.append(baseline)
    for cold_row in cold:
        runners[cold_row.name] = _cold(contexts[cold_row.scheme], model, cold_row)
        schemes[cold_row.name] = cold_row.scheme
    if "concurrent" in sections:
        concurrent = row(f"prewarm {args.clients} clients ({default_plane})", preferred)
        runners[concurrent] = functools.partial(
            agent.concurrent_cold_pulls, contexts[preferred], model, None, clients=args.clients
        )
        schemes[concurrent] = preferred
    return Plan(runners=runners, schemes=schemes, cold=cold, concurrent=concurrent)


def _cold_rows(args: argparse.Namespace, scheme: str) -> list[ColdRow]:
    rows = [ColdRow(cold_name(plane, scheme), scheme, plane) for plane in args.planes]
    rows.append(ColdRow(row(DEFAULTS, scheme), scheme, None, pinned=False))
    if args.compare_source is not None:
        name = row(compare_name(args.compare_source), scheme)
        rows.append(ColdRow(name, scheme, "aiobotocore", source=args.compare_source.resolve()))
    return rows


def _alternative(name: str, ctx: Context, model: BenchModel) -> Callable[[], RunResult]:
    run = {
        "ceiling": contenders.run_ceiling,
        "s5cmd": contenders.run_s5cmd,
        "boto3": contenders.run_boto3,
        "streamer": contenders.run_streamer,
    }[name]
    return functools.partial(run, ctx, model)


def _cold(ctx: Context, model: BenchModel, cold_row: ColdRow) -> Callable[[], RunResult]:
    if cold_row.source is not None:
        return functools.partial(
            agent.cold_pull, ctx, model, cold_row.plane, source=cold_row.source
        )
    if not cold_row.pinned:
        return functools.partial(agent.cold_pull, ctx, model, cold_row.plane, pinned=False)
    assert cold_row.plane is not None
    return cold_runner(ctx, model, cold_row.plane)
