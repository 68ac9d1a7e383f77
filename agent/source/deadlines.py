"""How long the agent waits for S3 to answer a request, and what it says when S3 does not.

An S3 endpoint that accepts the connection and never answers (a black-holed
address, a proxy that lost its upstream, a wedged S3-compatible server) is not
refused, so nothing fails fast: botocore waits its read timeout on every
attempt (``retries`` after the first), with backoff between. With a
60 s read timeout a cold pull sat silent for over seven minutes. Now each
request has a deadline, ``first_byte_timeout_seconds`` after it is sent, over
all of its attempts:

- ``bound_requests`` hooks a botocore client (aiobotocore's, and the threads
  plane's synchronous one alike) so that each attempt waits for S3's bytes at
  most a third of it (``attempt_timeout_seconds``) and never past the deadline (botocore's own
  per-request ``read_timeout``), and no retry starts once the deadline is near;
- the aiobotocore source also puts the deadline on each request it waits on
  (``asyncio.timeout``), so a server that trickles bytes cannot stretch it.

With the defaults (60 s, 20 s a read) a silent endpoint costs three attempts,
each retry logged (agent.source.retry_log), and fails at 60 s naming it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from agent._config import S3Settings

__all__ = [
    "BOUNDED_OPERATIONS",
    "bound_requests",
    "request_waited",
    "silence_advice",
    "total_attempts",
]

# The requests that wait for S3's answer. Uploads are left out: sending a large part
# may rightly take longer than any first-byte bound.
BOUNDED_OPERATIONS = ("ListObjectsV2", "HeadObject", "GetObject")
# Where a request's deadline (time.monotonic) lives in botocore's request context.
_DEADLINE = "prewarm_deadline"
# No retry starts with less than this left of its request's deadline: it could
# not get an answer from a healthy S3 anyway.
_LEAST_USEFUL_ATTEMPT = 0.5
# The read timeout of an attempt that starts at (or, after a backoff, past) the deadline.
_OUT_OF_TIME = 0.01
# Where the hook leaves, on the error botocore raises, how long its request waited.
_WAITED = "prewarm_waited"


def total_attempts(settings: S3Settings) -> int:
    """Attempts botocore makes of one request: ``retries`` counts those after the first."""
    return settings.retries + 1


def bound_requests(client: Any, settings: S3Settings) -> None:
    """Give each listing, HEAD and GET of ``client`` a deadline of ``first_byte_timeout_seconds``.

    Its first attempt stamps the deadline on botocore's request context (one
    per API call, shared by its attempts); every attempt then reads with a
    timeout of what is left, at most ``attempt_timeout_seconds``; and a retry is
    refused (botocore's ``needs-retry`` answered False, ahead of its own retry
    handler) once less than ``_LEAST_USEFUL_ATTEMPT`` is left.
    """
    bound = settings.first_byte_timeout_seconds
    longest_read = settings.attempt_timeout_seconds

    def time_the_attempt(request: Any, **_: Any) -> None:
        context = getattr(request, "context", None)
        if context is None:
            return
        now = time.monotonic()
        left = context.setdefault(_DEADLINE, now + bound) - now
        context["read_timeout"] = max(_OUT_OF_TIME, min(longest_read, left))

    def no_retry_out_of_time(
        request_dict: dict[str, Any], caught_exception: BaseException | None = None, **_: Any
    ) -> bool | None:
        deadline = request_dict.get("context", {}).get(_DEADLINE)
        if deadline is None:
            return None
        now = time.monotonic()
        if caught_exception is not None:
            # How long the request has waited so far, for the error to say (``request_waited``).
            with contextlib.suppress(AttributeError):
                setattr(caught_exception, _WAITED, now - (deadline - bound))
        if deadline - now < _LEAST_USEFUL_ATTEMPT:
            return False
        return None  # botocore's retry handler decides

    for operation in BOUNDED_OPERATIONS:
        client.meta.events.register(f"request-created.s3.{operation}", time_the_attempt)
        client.meta.events.register_first(f"needs-retry.s3.{operation}", no_retry_out_of_time)


def request_waited(exc: BaseException) -> float | None:
    """How long the request that failed with ``exc`` had waited, if its deadline hook knew."""
    seconds = getattr(exc, _WAITED, None)
    return seconds if isinstance(seconds, float) else None


def silence_advice(endpoint: str) -> str:
    """What to check when S3 at ``endpoint`` took a connection and sent nothing back."""
    return (
        f"Check that {endpoint} is S3 or a working S3-compatible server (s3.endpoint_url, "
        "AWS_ENDPOINT_URL), any proxy or firewall between this node and it, and S3's "
        "health; [s3] first_byte_timeout_seconds bounds this wait."
    )
