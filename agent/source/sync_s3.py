"""botocore's synchronous S3 client for worker threads, and what its answers mean.

The threads data plane (agent.source.threads_plane) sends its ranged GETs from
worker threads, so it needs a client that blocks instead of one bound to the
event loop. It is built from the same ``S3Settings`` as the aiobotocore source
(endpoint, region, addressing style, timeouts, retries; credentials and TLS
from the same AWS chain), so both speak to S3 alike.

A body is read with ``http.client.HTTPResponse.readinto``: it reads from the
socket straight into the caller's buffer with the GIL released, where urllib3's
``readinto`` reads into a bytes object first and copies (``body_reader``).
"""

from __future__ import annotations

import http.client
import socket
from collections.abc import Callable
from typing import Any

from botocore.config import Config
from botocore.session import get_session

from agent._config import S3Settings
from agent.source.deadlines import bound_requests, total_attempts
from agent.source.retry_log import log_retries
from agent.source.s3_errors import translate_s3_error
from agent.source.tuning import connection_pool_size

__all__ = ["THREADS_USER_AGENT", "body_reader", "body_socket", "make_sync_client", "translate"]

# Sent with every GET of the threads plane, so a server's log tells the planes apart.
THREADS_USER_AGENT = "prewarm-threads"

# OSError covers resets, timeouts and TLS errors; ValueError a read on a response
# whose socket was shut down under it.
_BROKEN_OFF = (http.client.HTTPException, OSError, ValueError)


def make_sync_client(settings: S3Settings) -> Any:
    """A thread-safe botocore S3 client configured like the agent's aiobotocore one."""
    config = Config(
        max_pool_connections=connection_pool_size(settings),
        connect_timeout=settings.connect_timeout_seconds,
        read_timeout=settings.read_timeout_seconds,
        retries={"max_attempts": settings.max_attempts, "mode": "standard"},
        s3={"addressing_style": settings.addressing_style},
        user_agent_extra=THREADS_USER_AGENT,
        # S3 sends no checksum of a range; the whole object is checked after the pull.
        response_checksum_validation="when_required",
    )
    kwargs: dict[str, Any] = {"config": config}
    if settings.endpoint_url:
        kwargs["endpoint_url"] = settings.endpoint_url
    if settings.region:
        kwargs["region_name"] = settings.region
    client = get_session().create_client("s3", **kwargs)
    endpoint = str(client.meta.endpoint_url)
    log_retries(client, endpoint=endpoint, max_attempts=total_attempts(settings))
    # The listing's deadline per request, so a silent GET here fails when one there would.
    bound_requests(client, settings)
    return client


def body_reader(body: Any) -> Callable[[memoryview], int]:
    """``readinto`` of a botocore streaming body, without a copy where the stack allows.

    botocore's ``StreamingBody`` wraps urllib3's response, which wraps
    ``http.client``'s; only the innermost reads into the given buffer directly.
    Any other shape falls back to urllib3's (copying) ``readinto``.
    """
    raw = getattr(body, "_raw_stream", body)
    inner = getattr(raw, "_fp", None)
    if isinstance(inner, http.client.HTTPResponse):
        return inner.readinto
    reader: Callable[[memoryview], int] = raw.readinto
    return reader


def body_socket(body: Any) -> socket.socket | None:
    """The socket a body arrives on, so a watchdog can cut a slow or cancelled read short.

    Taken from the reader ``http.client`` reads the body from (a buffered
    ``SocketIO``): a response that will close its connection has already
    detached it from urllib3's connection object.
    """
    raw = getattr(body, "_raw_stream", body)
    inner = getattr(raw, "_fp", None)
    socket_io = getattr(getattr(inner, "fp", None), "raw", None)
    for candidate in (
        getattr(socket_io, "_sock", None),
        getattr(getattr(raw, "_connection", None), "sock", None),
    ):
        if isinstance(candidate, socket.socket):
            return candidate
    return None


def translate(exc: BaseException, doing: str, endpoint: str) -> BaseException:
    """Map a botocore / http.client / socket failure onto the prewarm error tree.

    The same translation as the aiobotocore source's (agent.source.s3_errors),
    plus what a body read with ``http.client`` raises when it breaks off.
    """
    return translate_s3_error(exc, doing, endpoint=endpoint, broken_off=_BROKEN_OFF)
