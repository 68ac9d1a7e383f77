"""Repeated measurements and the little arithmetic the report needs."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LinearFit", "Sample", "linear_fit"]


@dataclass
class Sample:
    """Repeats of one measurement: seconds per run, and what each run moved.

    ``best`` (the fastest run) is what ratios use: on a small, shared machine the
    noise only ever makes a run slower, so the fastest is the least disturbed.
    The median is reported next to it.
    """

    name: str
    nbytes: int = 0
    seconds: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def add(self, seconds: float) -> None:
        self.seconds.append(seconds)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.seconds)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def rate(self) -> float:
        """Bytes per second of the best run."""
        return self.nbytes / self.best if self.ok and self.best > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "bytes": self.nbytes, "seconds": self.seconds}
        if self.ok:
            data |= {"best": self.best, "median": self.median, "bytes_per_second": self.rate}
        if self.error is not None:
            data["error"] = self.error
        return data | self.extra


@dataclass(frozen=True)
class LinearFit:
    """y = intercept + slope * x by least squares, with how well it fits."""

    slope: float
    intercept: float
    r_squared: float
    # Largest relative distance of a point from the line.
    max_residual: float


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("a fit needs at least two (x, y) points")
    mean_x = statistics.fmean(xs)
    mean_y = statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a fit needs at least two distinct x values")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = mean_y - slope * mean_x
    predicted = [intercept + slope * x for x in xs]
    ss_res = sum((y - p) ** 2 for y, p in zip(ys, predicted, strict=True))
    ss_tot = sum((y - mean_y) ** 2 for y in ys)
    r_squared = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    max_residual = max(abs(y - p) / abs(y) for y, p in zip(ys, predicted, strict=True) if y)
    return LinearFit(slope, intercept, r_squared, max_residual)
