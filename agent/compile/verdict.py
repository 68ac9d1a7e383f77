"""Did a launch reuse its compile cache? Files and bytes added per sub-cache, as a verdict.

A key directory holds one sub-directory per JIT cache (``inductor``,
``triton``, ``vllm``...). The index keeps, per key, what each sub-cache held
at the last *baseline*: when the directory was restored or created, and after
each launch's verdict. When an engine reports ready, what was added since is:

- nothing, on a key that holds compiled artifacts: ``hit``;
- nothing, on a key that holds none: ``uncompiled`` (compilation off, or an
  engine that compiles nothing: there was nothing to reuse, so it is no hit);
- something, on a key that held artifacts at the baseline: ``partial miss``,
  naming the sub-caches that grew (a new shape, a new flag);
- something, on a key that was empty: ``miss`` (a cold compile).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent._vocabulary import describe_verdict
from agent.compile.archive import walk_artifacts

__all__ = [
    "HIT",
    "MISS",
    "PARTIAL_MISS",
    "UNCOMPILED",
    "SubCacheSizes",
    "Verdict",
    "judge",
    "measure_sub_caches",
]

HIT = "hit"
UNCOMPILED = "uncompiled"
PARTIAL_MISS = "partial miss"
MISS = "miss"
_MAX_VERDICT_NAME = 32
# Files directly in the key directory, outside any sub-cache.
TOP_LEVEL = "."

# Artifacts that are kept and uploaded but are not compiled code, so they never make a
# launch a miss: vLLM records each model's inspected architecture in
# ``modelinfos/<model>.json`` (vllm/model_executor/models/registry.py), even with
# compilation off.
NOT_COMPILED = ("vllm/modelinfos/",)

# Per sub-cache: (files, bytes) of artifacts.
SubCacheSizes = dict[str, tuple[int, int]]


def measure_sub_caches(directory: Path, group: int | None = None) -> SubCacheSizes:
    """Compiled artifacts per sub-cache (as packed: no locks, temporary files, links or other
    groups' files; and not ``NOT_COMPILED``)."""
    sizes: SubCacheSizes = {}
    for relative, item in walk_artifacts(directory, group):
        if relative.startswith(NOT_COMPILED):
            continue
        sub = relative.split("/", 1)[0] if "/" in relative else TOP_LEVEL
        try:
            size = item.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
        files, total = sizes.get(sub, (0, 0))
        sizes[sub] = (files + 1, total + size)
    return sizes


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one launch added to its key's cache, and what that makes it."""

    verdict: str
    # Sub-cache -> (files added, bytes added); only those that grew.
    grown: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    at: float = 0.0
    client: str = ""

    @property
    def files_added(self) -> int:
        """Files the launch added, over every sub-cache."""
        return sum(files for files, _ in self.grown.values())

    @property
    def bytes_added(self) -> int:
        """Bytes the launch added, over every sub-cache."""
        return sum(size for _, size in self.grown.values())

    def describe(self) -> str:
        """One line: ``hit: nothing compiled``, or the verdict and what grew, e.g.
        ``partial miss: inductor +3 files (120.0 KiB)``."""
        return describe_verdict(self.verdict, self.grown)

    def to_json(self) -> dict[str, Any]:
        """The verdict as the index's JSON record holds it."""
        grown = {sub: list(pair) for sub, pair in self.grown.items()}
        return {"verdict": self.verdict, "grown": grown, "at": self.at, "client": self.client}

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> Verdict:
        """A verdict from ``to_json``'s form; ValueError names a bad one."""
        verdict = document["verdict"]
        # A newer agent's verdict name is kept as it is (a rollback must not make the
        # record unreadable, which drops the cache); only a malformed one is refused.
        if not isinstance(verdict, str) or not verdict or len(verdict) > _MAX_VERDICT_NAME:
            raise ValueError(f"verdict {verdict!r}")
        grown = {str(k): (int(v[0]), int(v[1])) for k, v in dict(document["grown"]).items()}
        return cls(verdict, grown, float(document["at"]), str(document.get("client", "")))


def judge(baseline: SubCacheSizes, now: SubCacheSizes, *, client: str = "") -> Verdict:
    """The verdict of a launch whose key went from ``baseline`` to ``now``."""
    grown: dict[str, tuple[int, int]] = {}
    for sub, (files, size) in now.items():
        before_files, before_size = baseline.get(sub, (0, 0))
        if files > before_files or size > before_size:
            grown[sub] = (max(0, files - before_files), max(0, size - before_size))
    if not grown:
        verdict = HIT if any(files for files, _ in now.values()) else UNCOMPILED
    elif any(files for files, _ in baseline.values()):
        verdict = PARTIAL_MISS
    else:
        verdict = MISS
    return Verdict(verdict, grown, time.time(), client)
