"""What S3's failures mean, for every client the source runs: one translation.

The aiobotocore source (agent.source.s3) and the processes plane's range
workers meet the same S3 answers in different wrappers: aiohttp's and
botocore's errors on one side, a worker's report of ``http.client``'s and raw
sockets' on the other. Both map them here onto the prewarm error tree, so an
answer means the same whichever plane met it.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from botocore import exceptions as boto

from agent._exceptions import (
    AccessDenied,
    NotFound,
    PrewarmError,
    SourceChanged,
    SourceUnavailable,
)
from agent.source.deadlines import request_waited, silence_advice
from agent.source.interface import RangeReadError
from agent.source.pacing import is_transient_answer

__all__ = [
    "MISSING_CODES",
    "SourceSilent",
    "SourceUnreachable",
    "answer_error",
    "broken_off_error",
    "error_code",
    "silent_error",
    "translate_s3_error",
    "unreachable_error",
]

_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "403",
    }
)
_CHANGED_CODES = frozenset({"PreconditionFailed", "412", "NoSuchKey", "InvalidRange", "416"})
# HEAD answers have no body, so a missing key there is only "404".
MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_BROKEN_OFF = (
    boto.IncompleteReadError,
    boto.ResponseStreamingError,
    boto.ReadTimeoutError,
    boto.HTTPClientError,
    aiohttp.ClientError,
    ConnectionError,
    TimeoutError,
    asyncio.IncompleteReadError,
)


class SourceUnreachable(SourceUnavailable):
    """No connection to S3 at all (refused, no route, DNS, TLS, connect timeout).

    Unlike a slow or failing answer this is known at once, so a listing that
    meets it is not retried: a cached snapshot can be served immediately.
    """


class SourceSilent(SourceUnavailable):
    """S3 took the connection but sent no answer within the bound (a read timeout).

    Unlike a refused connection this costs the whole wait, so the message says
    how long was waited and which endpoint kept silent.
    """


def silent_error(endpoint: str, doing: str, waited: float | None) -> SourceSilent:
    """The error for a request to ``endpoint`` that got no answer in ``waited`` seconds."""
    within = f" in {waited:.1f} s" if waited is not None else ""
    return SourceSilent(
        f"S3 at {endpoint} accepted the connection but sent no answer{within} while "
        f"{doing}. {silence_advice(endpoint)}"
    )


def translate_s3_error(
    exc: BaseException,
    doing: str,
    *,
    endpoint: str,
    bucket: str = "",
    broken_off: tuple[type[BaseException], ...] = (),
    waited: float | None = None,
) -> BaseException:
    """Map a botocore / aiohttp / socket failure onto the prewarm error tree.

    ``doing`` says what the agent was doing ("reading s3://b/k bytes 0-9");
    ``broken_off`` adds the failures that mean "the transfer broke off, try
    again" for the caller's own reader (http.client's, say); ``waited`` is how
    long the request waited, said when S3 kept silent. Anything not recognised
    is returned as is.
    """
    translated = _answered(exc, doing, endpoint=endpoint, bucket=bucket)
    if translated is None:
        translated = _transport_failure(
            exc, doing, endpoint=endpoint, broken_off=broken_off, waited=waited
        )
    return exc if translated is None else translated


def _answered(exc: BaseException, doing: str, *, endpoint: str, bucket: str) -> PrewarmError | None:
    """What an error S3 answered with (or the client's own credential check) means."""
    if isinstance(exc, boto.ClientError):
        error = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        return answer_error(
            status, str(error.get("Code") or status), doing, endpoint=endpoint, bucket=bucket
        )
    if isinstance(exc, boto.NoCredentialsError | boto.PartialCredentialsError):
        return AccessDenied(
            f"No usable AWS credentials for {doing}. Give the agent a role or set "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)."
        )
    return None


def _transport_failure(
    exc: BaseException,
    doing: str,
    *,
    endpoint: str,
    broken_off: tuple[type[BaseException], ...],
    waited: float | None,
) -> PrewarmError | None:
    """What a failure to reach S3, or a transfer that broke off, means; None if neither."""
    if _is_unreachable(exc):
        return unreachable_error(doing, endpoint=endpoint, cause=str(exc))
    if isinstance(exc, boto.ReadTimeoutError):
        return silent_error(endpoint, doing, waited if waited is not None else request_waited(exc))
    if isinstance(exc, boto.ConnectionClosedError) or _broke_an_open_connection(exc):
        return SourceUnavailable(
            f"S3 at {endpoint} closed the connection while {doing}: {exc}. "
            "Check the network and AWS_ENDPOINT_URL."
        )
    if isinstance(exc, _BROKEN_OFF + broken_off):
        return broken_off_error(doing, cause=str(exc))
    if isinstance(exc, boto.BotoCoreError):
        return SourceUnavailable(f"S3 client error while {doing}: {exc}.")
    return None


def answer_error(
    status: int, code: str, doing: str, *, endpoint: str, bucket: str = ""
) -> PrewarmError:
    """What an S3 error answer (HTTP ``status``, error ``code``) means, as a prewarm error.

    A transient answer (5xx, throttling) is a RangeReadError, which the planes
    retry; the rest are final.
    """
    if code == "NoSuchBucket":
        named = f"Bucket {bucket!r}" if bucket else "The bucket"
        return NotFound(
            f"{named} does not exist at {endpoint} ({doing}). "
            "Check the URI, and AWS_ENDPOINT_URL / region if you use a custom endpoint."
        )
    if code in _DENIED_CODES or status == 403:
        return AccessDenied(
            f"S3 denied {doing} ({code}). Grant the node's role s3:ListBucket and "
            "s3:GetObject on it, or check the credentials the agent runs with."
        )
    if code in _CHANGED_CODES or status in (412, 416):
        return SourceChanged(
            f"The object changed or disappeared while {doing} ({code}). "
            "Request the model again to pull the new snapshot."
        )
    if is_transient_answer(status, code):
        return RangeReadError(f"S3 kept failing while {doing}: {code} (HTTP {status}).")
    return SourceUnavailable(f"S3 refused {doing}: {code} (HTTP {status}).")


def unreachable_error(doing: str, *, endpoint: str, cause: str) -> SourceUnreachable:
    """No connection could be made to ``endpoint`` while ``doing``."""
    return SourceUnreachable(
        f"Cannot reach S3 at {endpoint} while {doing}: {cause}. "
        "Check the node's network, DNS and AWS_ENDPOINT_URL."
    )


def broken_off_error(doing: str, *, cause: str) -> RangeReadError:
    """A transfer that started and broke off (a reset, a short or cut body): retried."""
    return RangeReadError(f"Transfer broke off while {doing}: {cause}.")


def _is_unreachable(exc: BaseException) -> bool:
    """True when no connection was made: refused, no route, DNS, TLS handshake, connect timeout.

    botocore's ConnectionError covers its endpoint, connect-timeout, proxy and
    TLS errors; aiobotocore wraps aiohttp's connector errors into them, and the
    raw aiohttp/socket forms are checked too in case one comes through unwrapped.
    A connection that was made and then reset is not among them, although
    aiobotocore wraps it in the same EndpointConnectionError.
    """
    if _broke_an_open_connection(exc):
        return False
    return isinstance(
        exc,
        boto.ConnectionError
        | aiohttp.ClientConnectorError
        | socket.gaierror
        | ConnectionRefusedError,
    )


def _broke_an_open_connection(exc: BaseException) -> bool:
    """True for aiobotocore's EndpointConnectionError around a reset of a connection it had.

    aiohttp raises ClientConnectorError when the connection cannot be made and
    another ClientConnectionError (ClientOSError: ECONNRESET, EPIPE) when an
    open one breaks; aiobotocore wraps both alike, so the cause tells them apart.
    """
    if not isinstance(exc, boto.EndpointConnectionError):
        return False
    cause = exc.kwargs.get("error")
    return isinstance(cause, aiohttp.ClientConnectionError) and not isinstance(
        cause, aiohttp.ClientConnectorError
    )


def error_code(exc: BaseException) -> str:
    """S3's error code of a client error (its HTTP status when it sent none), else ""."""
    if isinstance(exc, boto.ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return str(error.get("Code") or status)
    return ""
