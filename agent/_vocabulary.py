"""The words both sides of the socket share: tiers, data planes, pull phases, pull options,
compile verdicts.

Defined once here, so the daemon, the client, the CLI and the API cannot drift
apart on what a tier is called or how big a chunk may be. Standard library
only: pods import this through ``agent.client``. The protobuf spelling of the
same words lives in ``agent._wire``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from agent._exceptions import InvalidRequest

__all__ = [
    "DATA_PLANE_NAMES",
    "LAUNCH_PHASES",
    "MAX_CHUNK_SIZE",
    "MAX_LAUNCH_PHASE_SECONDS",
    "MIN_CHUNK_SIZE",
    "PHASE_NAMES",
    "REMOVED_DATA_PLANES",
    "TIER_NAMES",
    "CompileKeyParts",
    "DataPlaneName",
    "PhaseName",
    "PullOptions",
    "TierName",
    "check_launch_phases",
    "check_pull_options",
    "check_tier",
    "describe_verdict",
    "human_bytes",
    "unknown_data_plane",
]

# Where a snapshot lives: RAM (/dev/shm) or local disk.
TierName = Literal["shm", "disk"]
TIER_NAMES: tuple[TierName, ...] = ("shm", "disk")

# What moves the bulk bytes of a pull (see docs/data-planes.md): "processes" for S3,
# "aiobotocore" (reads in the event loop) for sources that cannot presign a GET; "auto"
# is the one that fits the source.
DataPlaneName = Literal["auto", "processes", "aiobotocore"]
DATA_PLANE_NAMES: tuple[DataPlaneName, ...] = ("auto", "processes", "aiobotocore")
# Planes that were removed, and why: a config or request naming one is told what to use.
REMOVED_DATA_PLANES: dict[str, str] = {
    "threads": "the processes plane serves every S3 pull, proxies included",
    "streamer": (
        "the processes plane serves every S3 pull; the Run:ai Model Streamer stays useful to "
        "load the node's copy into an engine (docs/data-planes.md)"
    ),
}

# The phases a pull reports progress in, in the order it goes through them.
PhaseName = Literal["resolve", "download", "verify", "publish", "done"]
PHASE_NAMES: tuple[PhaseName, ...] = ("resolve", "download", "verify", "publish", "done")

# Where an engine launch's time goes, as `prewarm exec` reads it from the engine's own log
# lines (agent.cli._launch_phases) and the agent counts it (prewarm_engine_launch_seconds).
LAUNCH_PHASES = ("ready", "weights", "compile", "kv_cache_and_warmup", "start_and_rest")
MAX_LAUNCH_PHASE_SECONDS = 86_400.0


def check_launch_phases(phases: Mapping[str, float]) -> dict[str, float]:
    """``phases`` if every name is a launch phase and every value a plausible duration;
    InvalidRequest naming the first that is not."""
    for name, seconds in phases.items():
        if name not in LAUNCH_PHASES:
            raise InvalidRequest(
                f"{name[:64]!r} is not a launch phase; use {', '.join(LAUNCH_PHASES)}."
            )
        if not 0.0 <= seconds <= MAX_LAUNCH_PHASE_SECONDS:  # NaN fails both
            raise InvalidRequest(
                f"launch phase {name} of {seconds} s is not a duration from 0 to "
                f"{MAX_LAUNCH_PHASE_SECONDS:.0f} s."
            )
    return dict(phases)


# What a launch's compile verdict says when nothing grew (see agent.compile.verdict).
_NOTHING_GREW = {
    "hit": "hit: nothing compiled",
    "uncompiled": "uncompiled: the key holds no compiled code",
}


def describe_verdict(verdict: str, grown: Mapping[str, tuple[int, int]]) -> str:
    """A verdict in one line, the same in the agent's log and a pod's stderr:
    ``hit: nothing compiled``, ``partial miss: inductor +3 files (120.0 KiB)``."""
    if not grown:
        return _NOTHING_GREW.get(verdict, verdict)
    growth = ", ".join(
        f"{sub} +{files} files ({human_bytes(size)})"
        for sub, (files, size) in sorted(grown.items())
    )
    return f"{verdict}: {growth}"


# A chunk is one ranged GET and one journal line: under 1 MiB the request
# overhead dominates, over 4 GiB one failed range costs too much to redo.
MIN_CHUNK_SIZE = 1024**2
MAX_CHUNK_SIZE = 4 * 1024**3


def check_tier(name: str) -> TierName:
    """``name`` as a tier; InvalidRequest for anything but shm or disk."""
    for tier in TIER_NAMES:
        if name == tier:
            return tier
    raise InvalidRequest(f"Unknown tier {name!r}: choose 'shm' or 'disk'.")


def check_pull_options(
    data_plane: str | None = None, concurrency: int | None = None, chunk_size: int | None = None
) -> DataPlaneName | None:
    """Refuse pull options no pull could use; None for each means "the agent's setting".

    Returns the data plane as a ``DataPlaneName``. The CLI, the client, the
    API and ``PullOptions`` all check through here, so a bad value gets the
    same sentence wherever it is caught first.
    """
    plane: DataPlaneName | None = None
    if data_plane is not None:
        for name in DATA_PLANE_NAMES:
            if data_plane == name:
                plane = name
        if plane is None:
            raise InvalidRequest(unknown_data_plane(data_plane))
    if concurrency is not None and concurrency < 1:
        raise InvalidRequest(f"concurrency must be at least 1, not {concurrency}.")
    if chunk_size is not None and not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise InvalidRequest(f"chunk_size must be between 1 MiB and 4 GiB, not {chunk_size} bytes.")
    return plane


def unknown_data_plane(name: str) -> str:
    """The sentence that refuses data plane ``name``, naming what to use instead."""
    choices = ", ".join(DATA_PLANE_NAMES)
    removed = REMOVED_DATA_PLANES.get(name)
    if removed is not None:
        return f"The {name} data plane was removed ({removed}); use auto."
    return f"Unknown data plane {name!r}; use one of {choices}."


@dataclass(frozen=True, slots=True)
class PullOptions:
    """A request's overrides of the agent's pull settings; None keeps the agent's.

    Checked on construction, so an instance is always one a pull can use.
    """

    data_plane: DataPlaneName | None = None
    concurrency: int | None = None
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        check_pull_options(self.data_plane, self.concurrency, self.chunk_size)


# -- sizes as people read them (the agent's logs, a pod's verdicts, the CLI's tables) --


def human_bytes(n: int) -> str:
    """Binary units, like df -h: 1.0 GiB is 1024**3 bytes; under 1 KiB, whole bytes."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


# -- what a torch.compile cache depends on: one type for the daemon, the wire and the client --


@dataclass(frozen=True, slots=True)
class CompileKeyParts:
    """What compiled artifacts depend on. Any change gives another cache key.

    ``torch_version`` is required: every torch change invalidates compiled
    artifacts. ``engine_version`` defaults to the torch version for plain
    PyTorch. Parallel sizes of 0 mean 1. ``extras`` holds anything else that
    changes what gets compiled (dtype, max batch size, the Python version...).
    """

    engine: str = "torch"
    engine_version: str = ""
    torch_version: str = ""
    triton_version: str = ""
    cuda_version: str = ""
    gpu_name: str = ""
    model_key: str = ""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    config_hash: str = ""
    extras: dict[str, str] = field(default_factory=dict)
