"""How many files and bytes one snapshot may hold, counted while its listing arrives.

``[access.limits]`` and each tenant socket's ``limits`` cap a snapshot's files
and bytes. Counted only after the whole listing, a 20,000-object prefix under
``max_files = 10`` cost 20 listing requests, their memory and their time before
the refusal; counted page by page, the listing stops at the first page that
passes a limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent._exceptions import NoSpace
from agent._uri import ModelUri

__all__ = ["LimitExceeded", "SnapshotLimit"]

_ECHO_LIMIT = 200


class LimitExceeded(NoSpace):
    """A request would go past one of the configured [access] limits."""


@dataclass(frozen=True, slots=True)
class SnapshotLimit:
    """The most files and bytes a snapshot may hold by one section of the config (0: any)."""

    max_files: int
    max_bytes: int
    # The section that set it, as the refusal names it: "[access.limits]", a socket's name.
    where: str

    def check(self, uri: ModelUri, files: int, size: int, *, complete: bool = True) -> None:
        """LimitExceeded when ``files`` or ``size`` passes this limit.

        ``complete`` False: the counts are of the listing so far, which stops here.
        """
        if self.max_files and files > self.max_files:
            counted = f"{files} files" if complete else f"more than {self.max_files} files"
            raise LimitExceeded(
                f"{_echo(uri)} has {counted}; max_files of {self.where} is {self.max_files}"
                f"{_stopped(complete)}. Narrow it with include/exclude or raise the limit."
            )
        if self.max_bytes and size > self.max_bytes:
            counted = f"{size} bytes" if complete else f"more than {self.max_bytes} bytes"
            raise LimitExceeded(
                f"{_echo(uri)} holds {counted}; max_bytes of {self.where} is {self.max_bytes}"
                f"{_stopped(complete)}. Narrow it with include/exclude or raise the limit."
            )


def _stopped(complete: bool) -> str:
    return "" if complete else " (the listing was stopped there)"


def _echo(value: object) -> str:
    text = str(value)
    return text if len(text) <= _ECHO_LIMIT else text[:_ECHO_LIMIT] + "..."
