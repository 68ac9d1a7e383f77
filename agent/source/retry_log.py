"""One warning per retry botocore makes, naming the endpoint and what failed.

botocore retries silently (its own logger says "Retry needed" at debug, with
no endpoint and no cause), so an S3 that keeps failing looked like a daemon
that hung. Two hooks on a client's event system fix that without taking over
any decision: ``needs-retry`` notes what failed on the request's context, and
``request-created`` logs it when botocore does send the request again (its
attempt number is then above 1), so a retry that the retry quota or the last
attempt prevents is never announced.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["log_retries", "log_second_try"]

log = logging.getLogger("agent.source.retries")

# Where the failure of the previous attempt waits for the next attempt's log line.
_FAILURE = "prewarm_failure"
# An attempt's failure as logged: the cause's own words are cut to this.
_CAUSE_LIMIT = 300


def log_retries(client: Any, *, endpoint: str, max_attempts: int) -> None:
    """Log every retry ``client`` makes (aiobotocore's or botocore's S3 client)."""

    def note_failure(
        request_dict: dict[str, Any],
        response: tuple[Any, dict[str, Any]] | None = None,
        caught_exception: BaseException | None = None,
        **_: Any,
    ) -> None:
        failure = _describe(response, caught_exception)
        if failure:
            request_dict.setdefault("context", {})[_FAILURE] = failure

    def announce_retry(request: Any, operation_name: str = "", **_: Any) -> None:
        context = getattr(request, "context", None) or {}
        attempt = int(context.get("retries", {}).get("attempt", 1))
        if attempt <= 1:
            return
        failure = context.get(_FAILURE, "an unknown failure")
        log.warning(
            "S3 at %s: retrying %s (attempt %d of %d) after %s",
            endpoint,
            operation_name,
            attempt,
            max_attempts,
            failure,
            extra={
                "endpoint": endpoint,
                "operation": operation_name,
                "attempt": attempt,
                "max_attempts": max_attempts,
                "failure": failure,
            },
        )

    client.meta.events.register("needs-retry.s3", note_failure)
    client.meta.events.register("request-created.s3", announce_retry)


def log_second_try(
    endpoint: str, operation: str, failure: BaseException, *, max_attempts: int
) -> None:
    """The listing's single first try failed (not refused): botocore's retries take over."""
    cause = _describe(None, failure)
    log.warning(
        "S3 at %s: %s failed on its first try (%s); trying again, up to %d attempts",
        endpoint,
        operation,
        cause,
        max_attempts,
        extra={"endpoint": endpoint, "operation": operation, "attempt": 1, "failure": cause},
    )


def _describe(response: tuple[Any, dict[str, Any]] | None, caught: BaseException | None) -> str:
    """What went wrong with an attempt, in a few words; empty when it succeeded."""
    if caught is not None:
        return f"{type(caught).__name__}: {str(caught)[:_CAUSE_LIMIT]}"
    if response is None:
        return ""
    http, parsed = response
    status = int(getattr(http, "status_code", 0) or 0)
    if status < 400:
        return ""
    code = parsed.get("Error", {}).get("Code", "") if isinstance(parsed, dict) else ""
    return f"HTTP {status}{f' {code}' if code else ''}"
