"""One way every ``prewarm`` command reports an expected failure: a line and an exit status.

The statuses, shared by all commands (``prewarm exec`` adds the child's own):

- 1 (``EXIT_ERROR``): the agent answered with an error, or a check failed;
- 2 (``EXIT_INVALID``): the request was refused as invalid;
- 3 (``EXIT_NO_AGENT``): no agent answered on the socket.

A message may quote what the caller typed or what the agent sent, and either
may be hostile: it is written escaped (``agent._exceptions.printable``), as
plain text on stderr, never through rich, so it can neither steer the terminal
nor be read as markup.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer

from agent._exceptions import printable
from agent.client import AgentUnavailable, InvalidRequest, PrewarmError

__all__ = ["EXIT_ERROR", "EXIT_INVALID", "EXIT_NO_AGENT", "agent_errors", "exit_status", "fail"]

EXIT_ERROR = 1
EXIT_INVALID = 2
EXIT_NO_AGENT = 3


def exit_status(exc: PrewarmError) -> int:
    """The exit status a command ends with for ``exc``."""
    if isinstance(exc, InvalidRequest):
        return EXIT_INVALID
    if isinstance(exc, AgentUnavailable):
        return EXIT_NO_AGENT
    return EXIT_ERROR


def fail(exc: PrewarmError, code: int | None = None) -> NoReturn:
    """Write ``exc`` as one escaped line on stderr and exit (with its status unless given)."""
    sys.stderr.write(f"error: {printable(str(exc))}\n")
    raise typer.Exit(exit_status(exc) if code is None else code)


@contextmanager
def agent_errors() -> Iterator[None]:
    """Expected errors become one line on stderr and an exit status, no traceback."""
    try:
        yield
    except PrewarmError as exc:
        fail(exc)
