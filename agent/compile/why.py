"""Why a key missed: the nearest cached key of the same model, and the parts that differ.

A miss that does not say what to change is the complaint users of compile
caches make most (a per-pod variable in a key makes every pod miss). Every
launch of one model on one node whose key is new is compared with the keys
already cached for that model: the one with the fewest differing parts is
the *nearest*, and its differences (``torch_version 2.10.0 -> 2.13.0``,
``extras.flag.max_num_batched_tokens 8192 -> 16384``) are what changed.

Standard library only: the CLI (``prewarm exec``, ``prewarm compile why``)
and the daemon (its log line and metric) both use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Literal

from agent.compile.keys import CompileKeyParts, normalise_parts

__all__ = ["KeyLocation", "Nearest", "PartChange", "closer", "nearest_key", "part_changes"]

# Where the nearest key was found: cached on this node, or only uploaded to S3
# (by another node of the same compile domain).
KeyLocation = Literal["node", "s3"]

_SHOWN_CHANGES = 6
_KEY_SHOWN = 12


@dataclass(frozen=True, slots=True)
class PartChange:
    """One key part that differs: its name, its value in the cached key, the value wanted."""

    name: str
    cached: str
    wanted: str

    def describe(self) -> str:
        """``torch_version 2.10.0 -> 2.13.0`` (``-`` for a part that is unset on one side)."""
        return f"{self.name} {self.cached or '-'} -> {self.wanted or '-'}"


@dataclass(frozen=True, slots=True)
class Nearest:
    """The cached key closest to a wanted one, and what differs between them."""

    key: str
    changes: tuple[PartChange, ...]
    location: KeyLocation = "node"
    # For a key in S3: the trusted key that signed its index entry ("" when unsigned and
    # the domain accepts that). Another node's upload is worth naming by who made it.
    signed_by: str = ""

    def describe(self) -> str:
        """One clause for a verdict line: the nearest key, where it is, its first differences."""
        shown = ", ".join(change.describe() for change in self.changes[:_SHOWN_CHANGES])
        more = len(self.changes) - _SHOWN_CHANGES
        tail = f" and {more} more" if more > 0 else ""
        return f"nearest {self.where()} differs in {shown}{tail}"

    def where(self) -> str:
        """``cached key 9a41c07e3d12``, or ``key in S3 9a41c07e3d12 (signed by node-a)``."""
        if self.location == "node":
            return f"cached key {self.key[:_KEY_SHOWN]}"
        signer = f"signed by {self.signed_by}" if self.signed_by else "unsigned"
        return f"key in S3 {self.key[:_KEY_SHOWN]} ({signer})"


def _flat(parts: CompileKeyParts) -> dict[str, str]:
    """Every part as text, extras as ``extras.NAME``."""
    flat = {f.name: str(getattr(parts, f.name)) for f in fields(parts) if f.name != "extras"}
    flat.update({f"extras.{name}": value for name, value in parts.extras.items()})
    return flat


def part_changes(cached: CompileKeyParts, wanted: CompileKeyParts) -> tuple[PartChange, ...]:
    """The parts (normalised, so spelling never counts) that differ, in name order."""
    before, after = _flat(normalise_parts(cached)), _flat(normalise_parts(wanted))
    return tuple(
        PartChange(name, before.get(name, ""), after.get(name, ""))
        for name in sorted(before.keys() | after.keys())
        if before.get(name, "") != after.get(name, "")
    )


def nearest_key(
    wanted: CompileKeyParts,
    cached: Iterable[tuple[str, CompileKeyParts]],
    *,
    own_key: str = "",
    location: KeyLocation = "node",
    signers: Mapping[str, str] | None = None,
) -> Nearest | None:
    """The key of the same model (and engine) with the fewest differing parts; None if none.

    ``own_key`` (the wanted key itself, when it is cached) is never its own nearest.
    Ties go to the key listed first. ``signers`` names who signed each key's entry.
    """
    target = normalise_parts(wanted)
    best: Nearest | None = None
    for key, parts in cached:
        if key == own_key:
            continue
        other = normalise_parts(parts)
        if (other.model_key, other.engine) != (target.model_key, target.engine):
            continue
        changes = part_changes(other, target)
        if changes and (best is None or len(changes) < len(best.changes)):
            best = Nearest(key, changes, location, (signers or {}).get(key, ""))
    return best


def closer(first: Nearest | None, second: Nearest | None) -> Nearest | None:
    """The one with fewer differing parts; a tie goes to ``first`` (the node's, say)."""
    if first is None or (second is not None and len(second.changes) < len(first.changes)):
        return second
    return first
