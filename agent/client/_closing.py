"""``with`` and ``async with`` for the client's connections: the block's end closes them."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["ClosedOnAsyncExit", "ClosedOnExit"]


class ClosedOnExit:
    """``with obj:`` gives ``obj`` and calls its ``close()`` when the block exits."""

    def close(self) -> None:
        raise NotImplementedError  # pragma: no cover - every subclass closes something

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ClosedOnAsyncExit:
    """``async with obj:`` gives ``obj`` and awaits its ``close()`` when the block exits."""

    async def close(self) -> None:
        raise NotImplementedError  # pragma: no cover - every subclass closes something

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
