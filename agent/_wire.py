"""The shared vocabulary in its protobuf spelling, for both ends of the gRPC socket.

The edge (server side) and the client convert tiers, pull phases, pull
options, compile key parts and timestamps through these functions only, so a
field added to the wire is mapped in one place. Daemon code below the edge
must not import this module: it imports the generated code (see the
import-linter contracts in pyproject.toml).
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from google.protobuf.timestamp_pb2 import Timestamp

from agent._exceptions import InvalidRequest
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._vocabulary import CompileKeyParts, PhaseName, PullOptions, TierName

__all__ = [
    "datetime_from_proto",
    "parts_from_proto",
    "parts_to_proto",
    "phase_from_proto",
    "phase_to_proto",
    "pull_options_from_proto",
    "pull_options_to_proto",
    "tier_from_proto",
    "tier_to_proto",
    "timestamp_to_proto",
]

_TIER_TO_PROTO: dict[TierName, pb.Tier.ValueType] = {"shm": pb.TIER_SHM, "disk": pb.TIER_DISK}
_TIER_FROM_PROTO: dict[int, TierName] = {value: name for name, value in _TIER_TO_PROTO.items()}
_PHASE_TO_PROTO: dict[PhaseName, pb.Phase.ValueType] = {
    "resolve": pb.PHASE_RESOLVE,
    "download": pb.PHASE_DOWNLOAD,
    "verify": pb.PHASE_VERIFY,
    "publish": pb.PHASE_PUBLISH,
    "done": pb.PHASE_DONE,
}
_PHASE_FROM_PROTO: dict[int, PhaseName] = {
    # A pull that has not reported yet is still resolving its URI.
    pb.PHASE_UNSPECIFIED: "resolve",
    **{value: name for name, value in _PHASE_TO_PROTO.items()},
}
# The message and the dataclass name their fields alike; extras (a map) is copied apart.
_PART_FIELDS = tuple(
    field.name for field in dataclasses.fields(CompileKeyParts) if field.name != "extras"
)


def tier_to_proto(tier: TierName | None) -> pb.Tier.ValueType:
    """None is TIER_UNSPECIFIED: "the agent's default tier"."""
    return pb.TIER_UNSPECIFIED if tier is None else _TIER_TO_PROTO[tier]


def tier_from_proto(value: int) -> TierName | None:
    """The tier a wire value names; None for unspecified or a value this side does not know.

    Each caller says what an unknown value means to it (a bad request on the
    agent, a version skew on the client).
    """
    return _TIER_FROM_PROTO.get(value)


def phase_to_proto(phase: PhaseName) -> pb.Phase.ValueType:
    return _PHASE_TO_PROTO[phase]


def phase_from_proto(value: int) -> PhaseName | None:
    """The phase a wire value names; None for a value this side does not know."""
    return _PHASE_FROM_PROTO.get(value)


def pull_options_to_proto(options: PullOptions) -> pb.PullOptions | None:
    """None when every option is left to the agent, so the request carries no message."""
    if options.data_plane is None and options.concurrency is None and options.chunk_size is None:
        return None
    return pb.PullOptions(
        data_plane=options.data_plane or "",
        concurrency=options.concurrency or 0,
        chunk_size=options.chunk_size or 0,
    )


def pull_options_from_proto(message: pb.PullOptions) -> PullOptions:
    """The request's overrides; zero values mean "the agent's setting"."""
    if message.concurrency < 0 or message.chunk_size < 0:
        raise InvalidRequest("concurrency and chunk_size must not be negative.")
    return PullOptions(
        data_plane=message.data_plane or None,  # type: ignore[arg-type]  # checked on creation
        concurrency=message.concurrency or None,
        chunk_size=message.chunk_size or None,
    )


def parts_to_proto(parts: CompileKeyParts) -> pb.CompileKeyParts:
    """InvalidRequest when a part has a type the message cannot hold (a typo'd keyword)."""
    values = {name: getattr(parts, name) for name in _PART_FIELDS}
    try:
        return pb.CompileKeyParts(**values, extras=dict(parts.extras))
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"Invalid compile key parts ({exc}): {parts}.") from exc


def parts_from_proto(message: pb.CompileKeyParts) -> CompileKeyParts:
    values = {name: getattr(message, name) for name in _PART_FIELDS}
    return CompileKeyParts(**values, extras=dict(message.extras))


def timestamp_to_proto(seconds: float) -> Timestamp:
    """Seconds since the epoch (time.time()) as a protobuf Timestamp."""
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def datetime_from_proto(stamp: Timestamp) -> datetime:
    """A protobuf Timestamp as an aware UTC datetime."""
    return stamp.ToDatetime(tzinfo=UTC)
