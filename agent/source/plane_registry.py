"""The data planes by name, and what ``auto`` means: the puller asks here for a plane.

As uvicorn maps each protocol name to its implementation and resolves ``auto``
in one place, ``DataPlanes`` holds the planes this agent can run (by name),
why each missing one cannot run, and the choice behind ``auto``:
``AUTO_DATA_PLANE``, chosen by measurement (docs/data-planes.md), then, where
that one cannot run here, the next best along ``AUTO_FALLBACK``.

A pull through a source of its own (a requester's credentials) needs a plane
that can take one: the processes plane presigns its GETs with it and the
aiobotocore plane reads through it; the threads plane and the streamer sign
with the node's role, so they cannot.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType
from typing import Literal, Self

from agent._config import ConfigError, S3Settings
from agent._exceptions import InvalidRequest
from agent._vocabulary import DataPlaneName
from agent.source.aiobotocore_plane import AiobotocorePlane
from agent.source.interface import ObjectSource
from agent.source.plane import DataPlane
from agent.source.process_plane import (
    Presigner,
    ProcessPlane,
    WorkerPool,
    processes_unavailable,
)
from agent.source.streamer_plane import StreamerPlane, load_streamer, streamer_unavailable
from agent.source.threads_plane import ThreadsPlane
from agent.source.tuning import worker_processes

__all__ = ["AUTO_DATA_PLANE", "AUTO_FALLBACK", "DataPlanes"]

log = logging.getLogger(__name__)

PlaneName = Literal["processes", "threads", "streamer", "aiobotocore"]

# What data_plane = "auto" means, chosen by measurement (docs/data-planes.md).
AUTO_DATA_PLANE: PlaneName = "processes"
# Where auto goes when its plane cannot run here: the next best, down to the
# aiobotocore plane, which runs on any source.
AUTO_FALLBACK: dict[PlaneName, PlaneName] = {
    "processes": "threads",
    "threads": "aiobotocore",
    "streamer": "aiobotocore",
}
# The planes that can pull through a source of the pull's own (a requester's keys).
_TAKE_A_SOURCE = frozenset({"processes", "aiobotocore"})


class DataPlanes:
    """The registry of data planes: built from the source and ``[s3]``, entered once.

    ``async with DataPlanes(...)`` loads the streamer when it is wanted,
    refuses a configured plane that cannot run (ConfigError), and starts the
    processes plane's workers when it is the default; leaving closes them.
    """

    def __init__(self, source: ObjectSource, settings: S3Settings, *, gbps: float) -> None:
        self._source = source
        self._settings = settings
        self._aiobotocore = AiobotocorePlane(source)
        self._planes: dict[str, DataPlane] = {self._aiobotocore.name: self._aiobotocore}
        self._missing: dict[str, str] = {}
        s3 = source.s3_settings
        # The threads plane and the streamer speak S3 themselves (their own clients).
        not_s3 = f"the source is {source.name}, not S3"
        if s3 is not None:
            self._planes["threads"] = ThreadsPlane(s3)
        else:
            self._missing["threads"] = not_s3
        missing = processes_unavailable(source, s3)
        if missing is None and isinstance(source, Presigner):
            pool = WorkerPool(worker_processes(settings, gbps=gbps))
            self._planes["processes"] = ProcessPlane(settings, source, pool)
        else:
            self._missing["processes"] = missing or not_s3
        missing = streamer_unavailable() if s3 is not None else not_s3
        if missing is not None:
            self._missing["streamer"] = missing

    async def __aenter__(self) -> Self:
        """Load what is wanted, refuse a configured plane that cannot run, start the default."""
        await self._load_streamer()
        configured = self._settings.data_plane
        if configured != "auto" and configured in self._missing:
            raise ConfigError(_config_refusal(configured, self._missing[configured]))
        default = self.default
        if configured == "auto" and default.name != AUTO_DATA_PLANE:
            log.info(
                "data plane: %s (auto's %s is not available here: %s)",
                default.name,
                AUTO_DATA_PLANE,
                self._missing[AUTO_DATA_PLANE],
            )
        if isinstance(default, ProcessPlane):
            await default.start()  # about 0.1 s now, not in the first cold pull
        elif isinstance(default, ThreadsPlane):
            default.prepare()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the threads plane's client and stop the worker processes."""
        threads = self._planes.get("threads")
        if isinstance(threads, ThreadsPlane):
            threads.close()
        processes = self._planes.get("processes")
        if isinstance(processes, ProcessPlane):
            await processes.aclose()

    @property
    def default(self) -> DataPlane:
        """The plane a request that names none gets: the configured one, or auto's."""
        return self.choose(self._settings.data_plane)

    def choose(self, name: DataPlaneName | None, *, scoped: bool = False) -> DataPlane:
        """The plane a request naming ``name`` gets (None: the configured one).

        ``scoped``: the pull goes through a source of its own, so the plane must
        take one; the configured plane gives way to aiobotocore when it cannot.
        InvalidRequest when the named plane cannot run here or cannot take a source.
        """
        if scoped and name not in (None, "auto", *_TAKE_A_SOURCE):
            raise InvalidRequest(
                f"The {name} data plane signs with the agent's own credentials, so it cannot "
                "pull with the requester's; ask for the processes or aiobotocore data plane, "
                "or auto."
            )
        plane = self._resolve(name or self._settings.data_plane)
        if scoped and plane.name not in _TAKE_A_SOURCE:
            return self._aiobotocore
        return plane

    def through(self, plane: DataPlane, source: ObjectSource) -> DataPlane:
        """``plane`` pulling through ``source`` instead of the agent's own source."""
        if isinstance(plane, ProcessPlane) and isinstance(source, Presigner):
            return plane.with_source(source)
        return AiobotocorePlane(source)

    def _resolve(self, name: DataPlaneName) -> DataPlane:
        if name != "auto":
            plane = self._planes.get(name)
            if plane is None:
                raise _request_refusal(name, self._missing[name], self._source.name)
            return plane
        wanted: PlaneName | None = AUTO_DATA_PLANE
        while wanted is not None:
            if wanted in self._planes:
                return self._planes[wanted]
            wanted = AUTO_FALLBACK.get(wanted)
        return self._aiobotocore

    def _wants_streamer(self) -> bool:
        configured = self._settings.data_plane
        return configured == "streamer" or (configured == "auto" and AUTO_DATA_PLANE == "streamer")

    async def _load_streamer(self) -> None:
        """Build the streamer plane where it can run; import it now when it is wanted.

        The import brings torch (seconds): at start-up, not in the first pull.
        """
        settings = self._source.s3_settings
        if "streamer" in self._missing or settings is None:
            return
        if self._wants_streamer():
            missing = await asyncio.to_thread(load_streamer)
            if missing is not None:
                self._missing["streamer"] = missing
                return
        self._planes["streamer"] = StreamerPlane(settings, self._source, self._aiobotocore)


def _config_refusal(name: str, missing: str) -> str:
    if name == "streamer":
        return (
            f"s3.data_plane is 'streamer' but {missing}. Install the streamer extra "
            "(pip install 'prewarm-agent[streamer]') or set data_plane = 'auto'."
        )
    return f"s3.data_plane is '{name}' but {missing}; set data_plane = 'auto'."


def _request_refusal(name: str, missing: str, source_name: str) -> InvalidRequest:
    if name == "threads":
        return InvalidRequest(
            f"The threads data plane reads from S3 and this agent's source is "
            f"{source_name}; ask for the aiobotocore data plane or auto."
        )
    others = (
        "the threads or aiobotocore data plane,"
        if name == "processes"
        else ("the aiobotocore data plane")
    )
    return InvalidRequest(
        f"This agent has no {name} data plane ({missing}); ask for {others} or auto."
    )
