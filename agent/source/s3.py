"""S3 behind a small interface: list a prefix, read a byte range of one object.

This is the only module that knows botocore's error shapes; it translates them
into the prewarm error tree with ``raise ... from exc``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import Any, Self

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore import exceptions as boto

from agent._config import S3Settings
from agent._exceptions import AccessDenied, NotFound, SourceChanged, SourceUnavailable
from agent._uri import ModelUri
from agent.check.hashes import S3Checksum, s3_checksum_of
from agent.source.interface import ListedObject, RangeReader, RangeReadError
from agent.source.transfer import connection_pool_size

__all__ = ["S3Source"]

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


class S3Source:
    """ObjectSource over aiobotocore, one pooled client for the agent's lifetime."""

    name = "aiobotocore"

    def __init__(self, settings: S3Settings) -> None:
        self._settings = settings
        self._stack = AsyncExitStack()
        self._client: Any = None

    async def __aenter__(self) -> Self:
        settings = self._settings
        config = AioConfig(
            max_pool_connections=connection_pool_size(settings),
            connect_timeout=settings.connect_timeout_seconds,
            read_timeout=settings.read_timeout_seconds,
            retries={"max_attempts": settings.max_attempts, "mode": "standard"},
            s3={"addressing_style": settings.addressing_style},
        )
        kwargs: dict[str, Any] = {"config": config}
        if settings.endpoint_url:
            kwargs["endpoint_url"] = settings.endpoint_url
        if settings.region:
            kwargs["region_name"] = settings.region
        self._client = await self._stack.enter_async_context(
            get_session().create_client("s3", **kwargs)
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.aclose()

    @property
    def client(self) -> Any:
        """The pooled aiobotocore S3 client (for other parts that talk to S3)."""
        if self._client is None:
            raise RuntimeError("S3Source used outside its context")
        return self._client

    @property
    def endpoint(self) -> str:
        return str(self._client.meta.endpoint_url) if self._client else "(not started)"

    async def list_objects(self, uri: ModelUri) -> list[ListedObject]:
        listed: list[ListedObject] = []
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            async for page in paginator.paginate(Bucket=uri.bucket, Prefix=uri.prefix):
                listed.extend(
                    ListedObject(
                        key=item["Key"],
                        size=int(item["Size"]),
                        etag=item["ETag"],
                        checksum_algorithm=",".join(item.get("ChecksumAlgorithm", ())),
                    )
                    for item in page.get("Contents", ())
                )
        except Exception as exc:
            raise self._translate(exc, f"listing {uri}", bucket=uri.bucket) from exc
        return listed

    @asynccontextmanager
    async def open_range(
        self, bucket: str, key: str, *, etag: str, start: int, length: int
    ) -> AsyncIterator[RangeReader]:
        where = f"s3://{bucket}/{key} bytes {start}-{start + length - 1}"
        try:
            response = await self._client.get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}", IfMatch=etag
            )
        except Exception as exc:
            raise self._translate(exc, f"reading {where}", bucket=bucket) from exc
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

    async def head_checksum(self, bucket: str, key: str, *, etag: str) -> S3Checksum | None:
        try:
            response = await self._client.head_object(
                Bucket=bucket, Key=key, IfMatch=etag, ChecksumMode="ENABLED"
            )
        except Exception as exc:
            raise self._translate(exc, f"reading the checksum of s3://{bucket}/{key}") from exc
        return s3_checksum_of(response)

    def _translate(self, exc: Exception, doing: str, *, bucket: str = "") -> Exception:
        """Map a botocore/aiohttp failure onto the prewarm error tree."""
        if isinstance(exc, boto.ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            if code == "NoSuchBucket":
                return NotFound(
                    f"Bucket {bucket!r} does not exist at {self.endpoint} ({doing}). "
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
            if status >= 500 or code in ("SlowDown", "RequestTimeout", "InternalError"):
                return RangeReadError(f"S3 kept failing while {doing}: {code} (HTTP {status}).")
            return SourceUnavailable(f"S3 refused {doing}: {code} (HTTP {status}).")
        if isinstance(exc, boto.NoCredentialsError | boto.PartialCredentialsError):
            return AccessDenied(
                f"No usable AWS credentials for {doing}. Give the agent a role or set "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)."
            )
        if isinstance(
            exc,
            boto.EndpointConnectionError | boto.ConnectTimeoutError | boto.ConnectionClosedError,
        ):
            return SourceUnavailable(
                f"Cannot reach S3 at {self.endpoint} while {doing}: {exc}. "
                "Check the network and AWS_ENDPOINT_URL."
            )
        if isinstance(
            exc,
            boto.IncompleteReadError
            | boto.ResponseStreamingError
            | boto.ReadTimeoutError
            | boto.HTTPClientError
            | aiohttp.ClientError
            | ConnectionError
            | TimeoutError
            | asyncio.IncompleteReadError,
        ):
            return RangeReadError(f"Transfer broke off while {doing}: {exc}.")
        if isinstance(exc, boto.BotoCoreError):
            return SourceUnavailable(f"S3 client error while {doing}: {exc}.")
        return exc


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
