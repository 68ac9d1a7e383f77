"""Ctrl-C while a command waits on a pull: stop the pull, unless another client waits on it.

``prewarm pull`` and ``prewarm exec`` name their wait on the pull with a waiter
token (``PullWatch``, passed to ``ensure``). Interrupted, they ask the agent to
cancel the pull that token waited on, only if no other request waits on it
(``only_if_unwatched``; the agent does not count this command's own request,
which may not have ended there yet), say in one line what became of it, and exit
130, as a shell does after SIGINT. What a cancelled pull wrote stays in the
agent's staging, and the line says how much: the next pull of the model resumes
from it. A command interrupted before its request reached a pull stops nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import typer

from agent.client import Client, Conflict, NotFound, PrewarmError, Progress

from . import _render as render
from ._errors import say

__all__ = ["EXIT_INTERRUPTED", "PullWatch", "stop_pull_when_interrupted"]

# 128 + SIGINT, what a shell reports for a command Ctrl-C stopped.
EXIT_INTERRUPTED = 130


class PullWatch:
    """One command's wait on a pull: its waiter token, and where its progress is shown."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        # Where progress is shown (a bar, log lines); None: nowhere.
        self.show: Callable[[Progress], None] | None = None

    def __call__(self, event: Progress) -> None:
        """Show one progress event of the pull."""
        if self.show is not None:
            self.show(event)


@contextmanager
def stop_pull_when_interrupted(
    client: Client, uri: str, watch: PullWatch, *, as_requester: bool = False, prefix: str = ""
) -> Iterator[None]:
    """On Ctrl-C inside the block: stop the pull ``watch`` waited on unless another client
    waits on it, say what became of it, exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        say(f"interrupted: {_stop_unwatched(client, uri, watch, as_requester)}", prefix=prefix)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _stop_unwatched(client: Client, uri: str, watch: PullWatch, as_requester: bool) -> str:
    """Ask the agent to stop the pull if nobody else waits on it; what became of it."""
    try:
        pulls = client.cancel_pull(
            uri, only_if_unwatched=True, waiter_token=watch.token, as_requester=as_requester
        )
    except NotFound:
        return f"no pull of {uri} is running for this command (none had started, or it ended)"
    except Conflict as exc:
        return f"the pull of {uri} goes on: {exc}"
    except PrewarmError as exc:
        return f"the agent was not asked to stop the pull of {uri}, which may go on: {exc}"
    except KeyboardInterrupt:
        return f"interrupted again: the pull of {uri} may go on"
    return "; ".join(render.cancel_line(pull) for pull in pulls)
