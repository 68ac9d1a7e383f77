"""How long the agent waits for S3 to answer a request, and what it says when S3 does not.

An S3 endpoint that accepts the connection and never answers (a black-holed
address, a proxy that lost its upstream, a wedged S3-compatible server) is not
refused, so nothing fails fast: botocore waits its read timeout on every attempt
(``max_attempts`` retries after the first), with backoff between. With a 60 s read
timeout a cold pull sat silent for over six minutes. Two bounds make the wait
short and known:

- every botocore client of the source (aiobotocore's, and the synchronous one of
  the threads plane) reads with ``attempt_read_timeout``: ``read_timeout_seconds``,
  or less, so that every attempt and botocore's longest backoff between them fit
  in ``first_byte_timeout_seconds``;
- the aiobotocore source also gives each request it waits on (a listing page, a
  HEAD, a GET until its headers, a small object) a deadline of
  ``first_byte_timeout_seconds`` over all its attempts, so a server that trickles
  bytes just faster than the read timeout cannot stretch the wait either.
"""

from __future__ import annotations

from agent._config import S3Settings

__all__ = [
    "MIN_ATTEMPT_SECONDS",
    "attempt_read_timeout",
    "longest_backoff",
    "silence_advice",
    "total_attempts",
]

# No attempt waits less than this for S3's next byte, whatever the bound: a shorter
# read timeout would fail requests that a healthy but busy S3 answers.
MIN_ATTEMPT_SECONDS = 1.0
# botocore's standard retry backoff: rand(0, 1) x min(2 ** (attempt - 1), 20) seconds.
_BACKOFF_BASE = 2.0
_BACKOFF_CAP = 20.0


def longest_backoff(attempts: int) -> float:
    """The most botocore may sleep between ``attempts`` attempts of one request."""
    return sum(min(_BACKOFF_BASE**retry, _BACKOFF_CAP) for retry in range(attempts - 1))


def total_attempts(settings: S3Settings) -> int:
    """Attempts botocore makes of one request: its ``max_attempts`` counts the retries only."""
    return settings.max_attempts + 1


def attempt_read_timeout(settings: S3Settings) -> float:
    """Seconds one attempt waits for S3's next byte: botocore's ``read_timeout``.

    ``read_timeout_seconds``, lowered so that every silent attempt and the
    longest backoff between them end within ``first_byte_timeout_seconds``
    (about 4.8 s with the defaults: 6 attempts, up to 31 s of backoff, 60 s),
    but never under ``MIN_ATTEMPT_SECONDS``.
    """
    attempts = total_attempts(settings)
    share = (settings.first_byte_timeout_seconds - longest_backoff(attempts)) / attempts
    return max(MIN_ATTEMPT_SECONDS, min(settings.read_timeout_seconds, share))


def silence_advice(endpoint: str) -> str:
    """What to check when S3 at ``endpoint`` took a connection and sent nothing back."""
    return (
        f"Check that {endpoint} is S3 or a working S3-compatible server (s3.endpoint_url, "
        "AWS_ENDPOINT_URL), any proxy or firewall between this node and it, and S3's "
        "health; [s3] first_byte_timeout_seconds bounds this wait."
    )
