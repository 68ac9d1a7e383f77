"""One way every ``prewarm`` command reports an expected failure: a line and an exit status.

The statuses, shared by all commands (``prewarm exec`` adds the child's own):

- 1 (``EXIT_ERROR``): the agent answered with an error (a setting the request needs left
  unset included: ``compile push`` without ``compile_cache.uri``), or a check failed;
- 2 (``EXIT_INVALID``): the request was refused as invalid;
- 3 (``EXIT_NO_AGENT``): no agent could be reached on the socket (missing, not a
  socket, not permitted, nothing listening: ``agent.client._unreachable`` says which).

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

__all__ = [
    "EXIT_ERROR",
    "EXIT_INVALID",
    "EXIT_NO_AGENT",
    "agent_errors",
    "exit_status",
    "fail",
    "say",
]

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


def say(text: str, *, prefix: str = "") -> None:
    """One escaped line on stderr (``prefix`` first: ``prewarm exec`` names itself in a pod's
    log, where the child's lines are interleaved with its own)."""
    sys.stderr.write(f"{prefix}{printable(text)}\n")


def fail(error: PrewarmError | str, code: int | None = None, *, prefix: str = "") -> NoReturn:
    """Write ``error`` as one escaped line on stderr and exit: with ``code`` when given, else
    the error's own status (a plain message without a code is EXIT_ERROR)."""
    say(f"error: {error}", prefix=prefix)
    if code is None:
        code = exit_status(error) if isinstance(error, PrewarmError) else EXIT_ERROR
    raise typer.Exit(code)


@contextmanager
def agent_errors() -> Iterator[None]:
    """Expected errors become one line on stderr and an exit status, no traceback."""
    try:
        yield
    except PrewarmError as exc:
        fail(exc)
