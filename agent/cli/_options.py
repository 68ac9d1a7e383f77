"""Options shared by the ``prewarm`` commands, written once so they read alike everywhere.

An option with an env var lets a pod spec turn it on without new arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agent._vocabulary import TierName

__all__ = [
    "AsRequesterOption",
    "CachedOnlyOption",
    "ExcludeOption",
    "IncludeOption",
    "JsonOption",
    "SocketOption",
    "TierOption",
    "WaitForAgentOption",
]

SocketOption = Annotated[
    Path | None,
    typer.Option(
        "--socket",
        envvar="PREWARM_SOCKET_PATH",
        help="The agent's socket (default: /run/prewarm/agent.sock).",
        show_default=False,
        # A socket is connected to, never read: click's readable check (os.access R_OK)
        # would stop a user outside the socket's group with "path ... is not readable",
        # exit 2, before the client could say which group to join (exit 3), and before
        # `exec --fallback` could fall back.
        readable=False,
    ),
]

CachedOnlyOption = Annotated[
    bool,
    typer.Option(
        "--cached-only",
        envvar="PREWARM_CACHED_ONLY",
        help="Answer from this node's cache with no S3 call: the newest cached snapshot, "
        "possibly stale; fail (NOT_FOUND) if none is cached.",
    ),
]
AsRequesterOption = Annotated[
    bool,
    typer.Option(
        "--as-requester",
        envvar="PREWARM_AS_REQUESTER",
        help="Send this pod's own AWS credentials (botocore's chain): the agent checks they "
        "may read the model, and pulls a miss with them. Required on a requester-scoped "
        "socket.",
    ),
]
WaitForAgentOption = Annotated[
    float,
    typer.Option(
        "--wait-for-agent",
        envvar="PREWARM_WAIT_FOR_AGENT",
        min=0,
        metavar="SECONDS",
        help="How long to wait for the agent to serve on its socket (a pod may start before "
        "the agent on a new node); 0 fails at once. A socket this user may not open is never "
        "waited for.",
    ),
]

TierOption = Annotated[
    TierName | None,
    typer.Option(help="Where to place the model if it is pulled (default: the agent's)."),
]
IncludeOption = Annotated[
    list[str] | None,
    typer.Option("--include", help="Only paths matching this glob (repeatable)."),
]
ExcludeOption = Annotated[
    list[str] | None,
    typer.Option("--exclude", help="Skip paths matching this glob (repeatable)."),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON on stdout, nothing else.")
]
