"""Hits: EnsureModel on a cached model, by model shape and by the state of S3.

Two measurements:

- by shape: few vs many files of the same bytes, and small vs big models of
  the same files (what a hit's cost grows with);
- by S3's state, on one model: S3 up; S3 refusing connections (the same
  daemon's cache, restarted with its endpoint on a closed loopback port); and
  a hit that asks for no S3 call at all (the client's ``cached_only`` option,
  when this build has it). Each gives the agent's own timing of the call
  (``handle.timings.total``) and the client's wall time around it.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from agent.client import Client
from agent.testing import AgentProcess

from . import _agent as agent
from ._contenders import Context
from ._model import BenchModel
from ._sections import say

__all__ = ["HIT_MODES", "HitCost", "hit_latency", "hit_modes", "hits", "no_s3_option"]

MiB = 1024**2
GiB = 1024**3
UP, REFUSED, NO_S3 = "hit, S3 up", "hit, S3 refusing connections", "hit with no S3 call"
HIT_MODES = (UP, REFUSED, NO_S3)
# A refused hit may wait out offline_after_seconds on a build without the fast
# fallback: a few calls say as much as thirty.
REFUSED_CALLS = 10


@dataclass(frozen=True)
class HitCost:
    """EnsureModel on a cached model: best and median seconds, bytes from S3 per call."""

    ensure_best: float
    ensure_median: float
    served_per_call: float


def hit_latency(ctx: Context, daemon: AgentProcess, model: BenchModel, calls: int) -> HitCost:
    """EnsureModel on a cached model, ``calls`` times from one client."""
    with Client(daemon.socket_path) as client:
        client.ensure(model.uri)  # pulled before, or pulled now
        timed = _time_hits(ctx, client, model.uri, calls)
    return HitCost(timed["client_best"], timed["client_median"], timed["served_per_call"])


def no_s3_option() -> str | None:
    """The client's keyword for a hit with no S3 call, or None if this build has none."""
    parameters = inspect.signature(Client.ensure).parameters
    return "cached_only" if "cached_only" in parameters else None


def _time_hits(
    ctx: Context, client: Client, uri: str, calls: int, **options: Any
) -> dict[str, Any]:
    walls: list[float] = []
    agent_side: list[float] = []
    offline = 0
    served = ctx.server.bytes_sent()
    for _ in range(calls):
        started = time.perf_counter()
        handle = client.ensure(uri, **options)
        walls.append(time.perf_counter() - started)
        agent_side.append(handle.timings.total)
        offline += handle.resolved_offline
        if not handle.hit:
            raise RuntimeError(f"EnsureModel({uri}) on a cached model was not a hit")
    return {
        "calls": calls,
        "options": options,
        # The first call is reported apart: a fallback may cost more once.
        "client_first": walls[0],
        "agent_first": agent_side[0],
        "client_best": min(walls),
        "client_median": _median(walls),
        "agent_best": min(agent_side),
        "agent_median": _median(agent_side),
        "resolved_offline_calls": offline,
        "served_per_call": (ctx.server.bytes_sent() - served) / calls,
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


@contextlib.contextmanager
def _refusing_endpoint(scheme: str) -> Iterator[str]:
    """A loopback URL whose port is bound but not listening: every connect is refused at once.

    Holding the port bound keeps anything else from taking it during the run.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        yield f"{scheme}://127.0.0.1:{held.getsockname()[1]}"


def hit_modes(ctx: Context, model: BenchModel, calls: int) -> dict[str, Any]:
    """Hits on ``model`` with S3 up, with S3 refusing connections, and with no S3 call."""
    modes: dict[str, Any] = {}
    option = no_s3_option()
    with agent.running_agent(ctx, None) as daemon:
        with Client(daemon.socket_path) as client:
            client.ensure(model.uri)  # the pull that fills the cache
            say(f"hits on {model.name}: {UP}")
            modes[UP] = _time_hits(ctx, client, model.uri, calls)
            if option is None:
                modes[NO_S3] = {"skipped": "this build's client has no cached_only option"}
            else:
                say(f"hits on {model.name}: {NO_S3}")
                modes[NO_S3] = _time_hits(ctx, client, model.uri, calls, **{option: True})
        daemon.stop()
        say(f"hits on {model.name}: {REFUSED} (the same cache, S3 at a closed port)")
        modes[REFUSED] = _refused(ctx, daemon, model, min(calls, REFUSED_CALLS))
    return modes


def _refused(ctx: Context, daemon: AgentProcess, model: BenchModel, calls: int) -> dict[str, Any]:
    with _refusing_endpoint(ctx.server.scheme) as url:
        env = ctx.server.env() | dict(ctx.agent_env) | {"AWS_ENDPOINT_URL": url}
        config = agent.agent_config(ctx, None)
        # root= is the first daemon's: its cache, which this one does not remove.
        with (
            AgentProcess(env=env, root=daemon.root, config=config) as refused,
            Client(refused.socket_path) as client,
        ):
            return _time_hits(ctx, client, model.uri, calls) | {"endpoint": url}


def hits(
    args: argparse.Namespace,
    ctx: Context,
    model: Callable[[str, int, int], BenchModel],
    main_model: BenchModel,
) -> dict[str, Any]:
    """Hit latency by shape (few and many files, small and big models) and by S3's state."""
    few = model("hits-4", 256 * MiB, 4)
    many = model("hits-64", 256 * MiB, 64)
    small = model("hits-small", 16 * MiB, args.shards)
    costs: dict[str, Any] = {}
    say("hit latency (EnsureModel on cached models)")
    with agent.running_agent(ctx, None) as daemon:
        for m in (few, many, small, main_model):
            cost = hit_latency(ctx, daemon, m, calls=args.hit_calls)
            costs[m.name] = {
                "files": m.file_count,
                "bytes": m.total_bytes,
                "best": cost.ensure_best,
                "median": cost.ensure_median,
                "served_per_call": cost.served_per_call,
            }
    return {
        "models": costs,
        "few_files": few.file_count,
        "many_files": many.file_count,
        "files_ratio": costs["hits-64"]["median"] / costs["hits-4"]["median"],
        "big_bytes": main_model.total_bytes,
        "small_bytes": small.total_bytes,
        "bytes_ratio": costs["main"]["median"] / costs["hits-small"]["median"],
        # On the small model: the mode, not the bytes, is what is measured.
        "modes": hit_modes(ctx, small, args.hit_calls),
        "modes_model": small.name,
    }
