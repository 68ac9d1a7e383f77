"""Sizes as people read them, in one unit family (binary: KiB, MiB, GiB), on both sides.

The agent's log lines, the verdicts a pod prints and the CLI's tables all say
sizes the same way, so a line that mixes an upload and a verdict never puts
raw bytes beside MiB.
"""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: int) -> str:
    """Binary units, like df -h: 1.0 GiB is 1024**3 bytes; under 1 KiB, whole bytes."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
