"""Options shared by ``prewarm pull`` and ``prewarm exec``; each env var lets a pod spec turn
it on without new arguments."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["AsRequesterOption", "CachedOnlyOption"]

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
