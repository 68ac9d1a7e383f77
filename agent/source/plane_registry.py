"""The data planes by name, and what ``auto`` means: the puller asks here for a plane.

Two planes, one per kind of source:

- ``processes``: the S3 data plane. Ranged GETs presigned by the daemon and sent
  by worker processes; every S3 pull goes through it, proxies included, and a
  requester-scoped pull presigns its GETs with the requester's keys.
- ``aiobotocore``: reads through the source's own reader in the event loop. It
  is what ``auto`` means for a source that cannot presign a GET (the in-memory
  test source); on S3 it is taken only when asked for by name, for an
  S3-compatible server that refuses presigned URLs.

Each plane owns its life cycle (``start``/``aclose``) and its sizing; the
registry only picks.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

from agent._config import S3Settings
from agent._exceptions import InvalidRequest
from agent._vocabulary import DataPlaneName
from agent.source.aiobotocore_plane import AiobotocorePlane
from agent.source.interface import ObjectSource
from agent.source.plane import DataPlane
from agent.source.process_plane import Presigner, ProcessPlane, Resolver

__all__ = ["DataPlanes"]


class DataPlanes:
    """The registry of data planes: built from the source and ``[s3]``, entered once.

    ``async with DataPlanes(...)`` starts the processes plane's workers when the
    source is S3; leaving stops them.
    """

    def __init__(
        self,
        source: ObjectSource,
        settings: S3Settings,
        *,
        gbps: float,
        resolve: Resolver | None = None,
    ) -> None:
        """``resolve``: how the processes plane learns the endpoint's addresses (DNS)."""
        self._source = source
        self._settings = settings
        self._in_loop = AiobotocorePlane(source)
        self._processes: ProcessPlane | None = None
        if isinstance(source, Presigner) and source.s3_settings is not None:
            self._processes = ProcessPlane(settings, source, gbps=gbps, resolve=resolve)

    async def __aenter__(self) -> Self:
        """Start the processes plane's workers (about 0.1 s now, not in the first pull)."""
        if self._processes is not None:
            await self._processes.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the worker processes."""
        if self._processes is not None:
            await self._processes.aclose()

    @property
    def default(self) -> DataPlane:
        """The plane a request that names none gets: the configured one, or auto's."""
        return self.choose(None)

    @property
    def processes(self) -> ProcessPlane | None:
        """The S3 data plane, or None when the source is not S3."""
        return self._processes

    def choose(self, name: DataPlaneName | None) -> DataPlane:
        """The plane a request naming ``name`` gets (None: the configured one).

        Both planes can pull through a source of the pull's own (``with_source``).
        InvalidRequest when the named plane cannot run on this agent's source.
        """
        wanted = name or self._settings.data_plane
        if wanted == "aiobotocore":
            return self._in_loop
        if self._processes is not None:
            return self._processes
        if wanted == "auto":
            return self._in_loop
        raise InvalidRequest(
            f"This agent's source is {self._source.name}, which cannot presign S3 GETs, so "
            "it has no processes data plane; ask for auto or the aiobotocore data plane."
        )

    def with_source(self, plane: DataPlane, source: ObjectSource) -> DataPlane:
        """``plane`` pulling through ``source`` instead of the agent's own source."""
        if isinstance(plane, ProcessPlane) and isinstance(source, Presigner):
            return plane.with_source(source)
        return AiobotocorePlane(source)
