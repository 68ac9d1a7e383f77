"""S3 behind the ObjectSource interface: list, ranged reads, HEAD, small objects.

botocore's error shapes are translated into the prewarm error tree by
agent.source.s3_errors (shared with the threads plane), with ``raise ... from exc``.
Every request the agent waits on gets an answer or an error within
``first_byte_timeout_seconds`` (agent.source.deadlines), and every retry
botocore makes is logged with the endpoint (agent.source.retry_log).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import Any, Self

from aiobotocore.config import AioConfig
from botocore.httpsession import get_cert_path

from agent._config import S3Settings
from agent._exceptions import Conflict, SourceChanged, SourceUnavailable
from agent._uri import ModelUri
from agent.source.checksums import s3_checksum_of
from agent.source.deadlines import bound_requests, total_attempts
from agent.source.interface import (
    ListedObject,
    ObjectHead,
    ObjectTooLarge,
    RangeReader,
    RangeReadError,
    StoredObject,
)
from agent.source.proxies import proxy_for
from agent.source.retry_log import log_retries, log_second_try
from agent.source.s3_errors import (
    MISSING_CODES,
    SourceSilent,
    SourceUnreachable,
    error_code,
    silent_error,
    translate_s3_error,
)
from agent.source.sessions import new_session
from agent.source.tuning import connection_pool_size

__all__ = ["S3Source", "SourceSilent", "SourceUnreachable"]

# The endpoint botocore uses when none is configured.
_AWS_S3 = "https://s3.amazonaws.com"
# A conditional PUT that lost to another writer (409: two conditional writes at once).
# Bytes asked of a small object's body per read.
_BODY_READ = 1024 * 1024
_LOST_RACE_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})


class S3Source:
    """ObjectSource over aiobotocore, one pooled client for the agent's lifetime."""

    name = "aiobotocore"

    def __init__(self, settings: S3Settings, *, credentials: dict[str, str] | None = None) -> None:
        self._settings = settings
        # Static keys for this source only (a requester's); None: the standard AWS chain.
        self._credentials = dict(credentials or {})
        self._stack = AsyncExitStack()
        self._client: Any = None
        # Makes one attempt only; lists first, so a refused connection is known
        # after one try instead of after botocore's whole retry schedule.
        self._one_try_client: Any = None
        self._transport: dict[str, object] | None = None
        # Made on entry; its API models are the process's (agent.source.sessions).
        self._session: Any = None

    async def __aenter__(self) -> Self:
        """Build the pooled aiobotocore client (and the one-try client for first pages)."""
        settings = self._settings
        config = AioConfig(
            max_pool_connections=connection_pool_size(settings),
            connect_timeout=settings.connect_timeout_seconds,
            read_timeout=settings.attempt_timeout_seconds,
            retries={"max_attempts": settings.retries, "mode": "standard"},
            s3={"addressing_style": settings.addressing_style},
            # Requests are SigV4 anyway; saying so makes presigned GETs SigV4 too (botocore
            # presigns SigV2 otherwise, which signs no If-Match and newer regions refuse).
            signature_version="s3v4",
        )
        kwargs: dict[str, Any] = {}
        if settings.endpoint_url:
            kwargs["endpoint_url"] = settings.endpoint_url
        if settings.region:
            kwargs["region_name"] = settings.region
        kwargs |= self._credentials
        session = self._session = new_session()
        self._client = await self._stack.enter_async_context(
            session.create_client("s3", config=config, **kwargs)
        )
        log_retries(self._client, endpoint=self.endpoint, max_attempts=total_attempts(settings))
        one_try = config.merge(AioConfig(retries={"total_max_attempts": 1, "mode": "standard"}))
        self._one_try_client = await self._stack.enter_async_context(
            session.create_client("s3", config=one_try, **kwargs)
        )
        for client in (self._client, self._one_try_client):
            bound_requests(client, settings)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the clients."""
        await self._stack.aclose()

    @property
    def s3_settings(self) -> S3Settings:
        """The [s3] settings this source was built with."""
        return self._settings

    def with_credentials(
        self, access_key_id: str, secret_access_key: str, session_token: str
    ) -> S3Source:
        """A source like this one that signs with the given keys (enter it before use)."""
        keys = {"aws_access_key_id": access_key_id, "aws_secret_access_key": secret_access_key}
        if session_token:
            keys["aws_session_token"] = session_token
        return S3Source(self._settings, credentials=keys)

    @property
    def endpoint(self) -> str:
        """The S3 endpoint the client talks to."""
        return str(self._client.meta.endpoint_url) if self._client else "(not started)"

    async def list_objects(self, uri: ModelUri) -> list[ListedObject]:
        """Every object under the prefix (see ``list_pages``)."""
        return [item async for page in self.list_pages(uri) for item in page]

    async def list_pages(self, uri: ModelUri) -> AsyncGenerator[list[ListedObject], None]:
        """The objects under the prefix, one S3 page (up to 1,000) at a time.

        A caller that stops iterating stops the listing: no further page is
        asked for. SourceUnreachable at once when S3 cannot be reached: the
        first page's first try makes one attempt, so a connection that cannot
        be made is reported without retries. Any other failure of it
        (throttling, 5xx, a reset, no answer) is tried again with botocore's
        full retry schedule, within what is left of that page's deadline.
        """
        doing = f"listing {uri}"
        token = ""
        while True:
            if token:
                page = await self._list_page(
                    self._client, uri, doing, token, deadline=self._deadline()
                )
            else:
                page = await self._first_list_page(uri, doing)
            yield [
                ListedObject(
                    key=item["Key"],
                    size=int(item["Size"]),
                    etag=item["ETag"],
                    checksum_algorithm=",".join(item.get("ChecksumAlgorithm", ())),
                )
                for item in page.get("Contents", ())
            ]
            token = str(page.get("NextContinuationToken") or "") if page.get("IsTruncated") else ""
            if not token:
                return

    async def _first_list_page(self, uri: ModelUri, doing: str) -> dict[str, Any]:
        since = asyncio.get_running_loop().time()
        deadline = self._deadline()
        try:
            return await self._list_page(self._one_try_client, uri, doing, "", deadline=deadline)
        except SourceUnreachable:
            raise
        except SourceUnavailable as exc:
            attempts = total_attempts(self._settings)
            cause = exc.__cause__ or exc
            log_second_try(self.endpoint, "ListObjectsV2", cause, max_attempts=attempts)
            return await self._list_page(
                self._client, uri, doing, "", deadline=deadline, since=since
            )

    async def _list_page(
        self,
        client: Any,
        uri: ModelUri,
        doing: str,
        token: str,
        *,
        deadline: float,
        since: float | None = None,
    ) -> dict[str, Any]:
        more = {"ContinuationToken": token} if token else {}
        async with self._answer(doing, bucket=uri.bucket, deadline=deadline, since=since):
            page: dict[str, Any] = await client.list_objects_v2(
                Bucket=uri.bucket, Prefix=uri.prefix, **more
            )
        return page

    @asynccontextmanager
    async def open_range(
        self, bucket: str, key: str, *, etag: str, start: int, length: int
    ) -> AsyncIterator[RangeReader]:
        """The body of a ranged GET at ``etag``; errors mapped onto the error tree."""
        where = f"s3://{bucket}/{key} bytes {start}-{start + length - 1}"
        async with self._answer(f"reading {where}", bucket=bucket):
            response = await self._client.get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}", IfMatch=etag
            )
        body = response["Body"]
        try:
            if int(response.get("ContentLength", -1)) != length:
                raise RangeReadError(
                    f"S3 answered {response.get('ContentLength')} bytes for {where}; "
                    "expected the whole range."
                )
            yield _BodyReader(body, where, self)
        finally:
            body.close()

    async def presign_get(self, bucket: str, key: str, *, etag: str, expires_seconds: int) -> str:
        """A GET of the object that anyone holding the URL may send until it expires.

        ``If-Match`` is signed in: the request must carry that exact ETag, so
        the URL can only ever fetch this version of the object.
        """
        params = {"Bucket": bucket, "Key": key, "IfMatch": etag}
        try:
            url: str = await self._client.generate_presigned_url(
                "get_object", Params=params, ExpiresIn=expires_seconds
            )
        except Exception as exc:
            doing = f"signing a GET of s3://{bucket}/{key}"
            raise self._translate(exc, doing, bucket=bucket) from exc
        return url

    def transport(self) -> dict[str, object]:
        """How a client outside botocore must reach S3 to match this source.

        ``verify``/``cafile``: botocore verifies against AWS_CA_BUNDLE (or
        ``ca_bundle`` in the AWS config) when set, else its own default bundle.
        ``proxy``: the HTTP proxy the environment sets for the endpoint, as
        botocore reads it (agent.source.proxies), or None; SourceUnavailable when
        that proxy cannot be used.
        """
        if self._transport is None:
            session = self._session or new_session()  # a new session: ~15 ms
            bundle = session.get_config_variable("ca_bundle")
            self._transport = {"verify": True, "cafile": str(bundle or get_cert_path(True))}
        return self._transport | {"proxy": proxy_for(self._endpoint_url())}

    def _endpoint_url(self) -> str:
        """The endpoint the client talks to (what it would, before it is started)."""
        if self._client is not None:
            return str(self._client.meta.endpoint_url)
        return self._settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or _AWS_S3

    async def head_object(
        self, bucket: str, key: str, *, etag: str | None = None
    ) -> ObjectHead | None:
        """The object's size, ETag and checksum; None when it does not exist.

        With ``etag``: SourceChanged when the object is gone or was replaced.
        """
        condition = {"IfMatch": etag} if etag else {}
        try:
            async with self._answer(
                f"reading the metadata of s3://{bucket}/{key}", passed=_missing
            ):
                response = await self._client.head_object(
                    Bucket=bucket, Key=key, ChecksumMode="ENABLED", **condition
                )
        except _Missing as exc:
            if etag is None:
                return None
            raise SourceChanged(
                f"s3://{bucket}/{key} disappeared during the pull. "
                "Request the model again to pull the new snapshot."
            ) from exc.__cause__
        return ObjectHead(
            key=key,
            size=int(response.get("ContentLength", 0)),
            etag=str(response.get("ETag", "")),
            checksum=s3_checksum_of(response),
        )

    async def get_object(self, bucket: str, key: str, *, max_bytes: int) -> StoredObject | None:
        """A small object's bytes (at most ``max_bytes``); None when it does not exist."""
        doing = f"reading s3://{bucket}/{key}"
        try:
            async with self._answer(doing, bucket=bucket, passed=_missing):
                response = await self._client.get_object(Bucket=bucket, Key=key)
        except _Missing:
            return None
        async with self._answer(doing, bucket=bucket), response["Body"] as body:
            data = await _read_to_end(body, max_bytes + 1)
        if len(data) > max_bytes:
            raise ObjectTooLarge(
                f"s3://{bucket}/{key} holds more than the {max_bytes} bytes expected of it.",
                path=key,
                check="size",
            )
        return StoredObject(data, str(response.get("ETag", "")))

    async def put_object(
        self,
        bucket: str,
        key: str,
        body: bytes,
        *,
        content_type: str = "application/octet-stream",
        if_match: str | None = None,
        if_absent: bool = False,
    ) -> str:
        """Put a small object, conditionally if asked; its new ETag."""
        condition = {"IfMatch": if_match} if if_match else {}
        if if_absent:
            condition["IfNoneMatch"] = "*"
        try:
            response = await self._client.put_object(
                Bucket=bucket, Key=key, Body=body, ContentType=content_type, **condition
            )
        except Exception as exc:
            code = error_code(exc)
            # If-Match on a key deleted meanwhile is a 404: also a lost race.
            lost = code in _LOST_RACE_CODES or (if_match is not None and code in MISSING_CODES)
            if condition and lost:
                raise Conflict(
                    f"s3://{bucket}/{key} was changed by another writer first ({code})."
                ) from exc
            raise self._translate(exc, f"uploading s3://{bucket}/{key}", bucket=bucket) from exc
        return str(response.get("ETag", ""))

    async def delete_object(self, bucket: str, key: str) -> None:
        """Delete an object."""
        async with self._answer(f"deleting s3://{bucket}/{key}", bucket=bucket):
            await self._client.delete_object(Bucket=bucket, Key=key)

    async def put_object_multipart(
        self,
        bucket: str,
        key: str,
        parts: AsyncIterable[bytes],
        *,
        content_type: str = "application/octet-stream",
    ) -> str:
        """Upload an object from parts (multipart, aborted on failure); its ETag."""
        doing = f"uploading s3://{bucket}/{key} in parts"
        try:
            created = await self._client.create_multipart_upload(
                Bucket=bucket, Key=key, ContentType=content_type
            )
        except Exception as exc:
            raise self._translate(exc, doing, bucket=bucket) from exc
        upload_id = created["UploadId"]
        done: list[dict[str, Any]] = []
        try:
            async for body in parts:
                number = len(done) + 1
                response = await self._client.upload_part(
                    Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
                )
                done.append({"PartNumber": number, "ETag": response["ETag"]})
            completed = await self._client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
            )
        except BaseException as exc:
            # An unfinished upload keeps its parts (and their storage) until aborted.
            with contextlib.suppress(Exception):
                await self._client.abort_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload_id
                )
            if isinstance(exc, Exception):
                raise self._translate(exc, doing, bucket=bucket) from exc
            raise
        return str(completed.get("ETag", ""))

    def _translate(
        self, exc: Exception, doing: str, *, bucket: str = "", waited: float | None = None
    ) -> BaseException:
        """Map a botocore/aiohttp failure onto the prewarm error tree (agent.source.s3_errors)."""
        return translate_s3_error(exc, doing, endpoint=self.endpoint, bucket=bucket, waited=waited)

    def _deadline(self) -> float:
        """The loop time by which a request sent now must have its answer."""
        return asyncio.get_running_loop().time() + self._settings.first_byte_timeout_seconds

    @contextlib.asynccontextmanager
    async def _answer(
        self,
        doing: str,
        *,
        bucket: str = "",
        deadline: float | None = None,
        since: float | None = None,
        passed: Callable[[Exception], bool] = lambda _: False,
    ) -> AsyncIterator[None]:
        """Wait for one request's answer until ``deadline`` (default: one bound from now).

        Its failures leave translated into the error tree, with how long it
        waited (since ``since``, default now: an earlier try of the same
        request counts); one that ``passed`` accepts leaves as ``_Missing``
        instead, for the caller to judge. A deadline that passes is SourceSilent.
        """
        loop = asyncio.get_running_loop()
        started = loop.time() if since is None else since
        try:
            async with asyncio.timeout_at(
                self._deadline() if deadline is None else deadline
            ) as bound:
                yield
        except TimeoutError as exc:
            if not bound.expired():
                raise self._translate(exc, doing, bucket=bucket) from exc
            raise silent_error(self.endpoint, doing, loop.time() - started) from exc
        except Exception as exc:
            if passed(exc):
                raise _Missing from exc
            raise self._translate(exc, doing, bucket=bucket, waited=loop.time() - started) from exc


class _Missing(Exception):
    """The object a request named is not there (its cause is S3's answer)."""


def _missing(exc: Exception) -> bool:
    return error_code(exc) in MISSING_CODES


class _BodyReader:
    def __init__(self, body: Any, where: str, source: S3Source) -> None:
        self._body = body
        self._where = where
        self._source = source

    async def read(self, amount: int) -> bytes:
        try:
            data: bytes = await self._body.read(amount)
        except Exception as exc:
            raise self._source._translate(exc, f"reading {self._where}") from exc
        return data


async def _read_to_end(body: Any, limit: int) -> bytes:
    """A body's bytes up to ``limit`` (one past the caller's cap tells "too large").

    One ``read(n)`` returns what has arrived so far, not n bytes: a body bigger
    than a few network reads would come back cut short and look like garbage.
    """
    pieces: list[bytes] = []
    got = 0
    while got < limit:
        piece: bytes = await body.read(min(limit - got, _BODY_READ))
        if not piece:
            break
        pieces.append(piece)
        got += len(piece)
    return b"".join(pieces)
