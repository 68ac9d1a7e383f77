"""One target and what judging one needs: a row's sample if it was measured, and its CPU."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._stats import Sample

__all__ = ["RSS_LIMIT", "Target", "cpu_of", "measured", "point_at"]

MiB = 1024**2
RSS_LIMIT = 256 * MiB


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


def measured(samples: Mapping[str, Sample], name: str) -> Sample | None:
    """The row's sample when it has at least one good run."""
    sample = samples.get(name)
    return sample if sample is not None and sample.ok else None


def cpu_of(sample: Sample | None) -> dict[str, Any]:
    """The best run's CPU report (``_threads.cpu_report``), or nothing."""
    return (sample.extra.get("cpu") or {}) if sample is not None else {}


def point_at(scaling: Mapping[str, Any], size: int) -> dict[str, Any] | None:
    """One scheme's scaling point at ``size`` bytes (as --scaling asked), if measured."""
    for point in scaling.get("points", []):
        if point.get("size") == size:
            return dict(point)
    return None
