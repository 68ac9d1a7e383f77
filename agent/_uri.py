"""Model URIs (``s3://bucket/prefix``) and the safety of object keys under them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent._exceptions import InvalidRequest, UnsafeObjectKey

__all__ = ["ModelUri", "parse_uri", "safe_relative_path"]

# S3 bucket naming rules (the general-purpose bucket subset every endpoint accepts).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_URI_HELP = "Use the form s3://bucket/prefix, e.g. s3://models/llama-3-8b/."


@dataclass(frozen=True, slots=True)
class ModelUri:
    """A normalised model location: a bucket and a directory-like prefix.

    ``prefix`` is empty (the whole bucket) or ends with exactly one ``/``.
    """

    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_uri(raw: str) -> ModelUri:
    """Parse and normalise ``raw``; raise InvalidRequest saying what is wrong."""
    if not raw:
        raise InvalidRequest(f"The model URI is empty. {_URI_HELP}")
    if "\x00" in raw:
        raise InvalidRequest(f"The model URI {raw!r} contains a NUL byte. {_URI_HELP}")
    scheme, sep, rest = raw.partition("://")
    if not sep or scheme.lower() != "s3":
        raise InvalidRequest(
            f"The model URI {raw!r} is not an S3 URI (only s3:// is supported). {_URI_HELP}"
        )
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
        raise InvalidRequest(
            f"{bucket!r} in {raw!r} is not a valid S3 bucket name "
            "(3-63 lowercase letters, digits, dots or hyphens). " + _URI_HELP
        )
    if "?" in prefix or "#" in prefix:
        raise InvalidRequest(
            f"The model URI {raw!r} has a query or fragment; prewarm takes a plain prefix. "
            + _URI_HELP
        )
    prefix = prefix.lstrip("/")
    if prefix:
        prefix = prefix.rstrip("/") + "/"
        _check_parts(
            prefix.rstrip("/"), what=f"The prefix of {raw!r}", exc=InvalidRequest, fix=_URI_HELP
        )
    return ModelUri(bucket=bucket, prefix=prefix)


def safe_relative_path(uri: ModelUri, key: str) -> str:
    """Return ``key`` relative to the URI's prefix, refusing anything unsafe.

    Raises UnsafeObjectKey for keys that would resolve outside the model
    directory once written to disk: ``..`` or ``.`` components, absolute paths,
    empty components, NUL bytes.
    """
    if not key.startswith(uri.prefix):
        raise UnsafeObjectKey(f"Object key {key!r} is not under the prefix of {uri}.")
    relative = key[len(uri.prefix) :]
    _check_parts(
        relative,
        what=f"Object key {key!r} under {uri}",
        exc=UnsafeObjectKey,
        fix="Rename the object, or leave it out with an exclude glob.",
    )
    return relative


def _check_parts(path: str, *, what: str, exc: type[InvalidRequest], fix: str) -> None:
    if "\x00" in path:
        raise exc(f"{what} contains a NUL byte. {fix}")
    if path.startswith("/"):
        raise exc(f"{what} is an absolute path. {fix}")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise exc(f"{what} has an empty, '.' or '..' path component. {fix}")
