"""Model URIs (``s3://bucket/prefix``) and the safety of object keys under them.

The agent writes each object to a file named by its key, as root, and prints
keys to people's terminals, so a key or prefix is refused when a part of it is
longer than a file name may be (255 bytes), when it is longer than S3 allows a
key to be (1,024 bytes), or when it holds a control character (C0, DEL, C1) or
a bidi override, isolate or mark (text that reads differently from what it is).
Messages name the offending character by its code point and quote the value
escaped and shortened (agent._exceptions.quoted), never raw.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from agent._exceptions import InvalidRequest, UnsafeObjectKey, quoted

__all__ = [
    "MAX_COMPONENT_BYTES",
    "MAX_KEY_BYTES",
    "MAX_URI_BYTES",
    "ModelUri",
    "forbidden_character",
    "parse_uri",
    "refuse_whole_bucket",
    "safe_relative_path",
    "uri_matches",
    "valid_bucket_name",
]

# NAME_MAX of every Linux file system the tiers live on.
MAX_COMPONENT_BYTES = 255
# S3's own limit on an object key; a prefix or a key under it is never longer.
MAX_KEY_BYTES = 1024
# "s3://", the longest bucket name, "/" and the longest key, rounded up.
MAX_URI_BYTES = 1100

# S3 bucket naming rules (the general-purpose bucket subset every endpoint accepts).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_URI_HELP = "Use the form s3://bucket/prefix, e.g. s3://models/llama-3-8b/."
# C0 controls, DEL, C1 controls; bidi embeddings and overrides (U+202A-U+202E),
# isolates (U+2066-U+2069) and marks (U+200E, U+200F, U+061C).
_FORBIDDEN_RE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")
_CONTROL_NAMES = {0x00: "NUL", 0x1B: "ESC", 0x7F: "DEL", 0x0A: "line feed", 0x0D: "carriage return"}


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
    size = len(raw.encode("utf-8", "surrogatepass"))
    if size > MAX_URI_BYTES:
        raise InvalidRequest(
            f"The model URI {quoted(raw, 60)} is {size} bytes long, over the limit of "
            f"{MAX_URI_BYTES} bytes (S3 keys are at most {MAX_KEY_BYTES}). {_URI_HELP}"
        )
    _refuse_forbidden(raw, what=f"The model URI {quoted(raw)}", exc=InvalidRequest, fix=_URI_HELP)
    scheme, sep, rest = raw.partition("://")
    if not sep or scheme.lower() != "s3":
        raise InvalidRequest(
            f"The model URI {quoted(raw)} is not an S3 URI (only s3:// is supported). " + _URI_HELP
        )
    bucket, _, prefix = rest.partition("/")
    if not valid_bucket_name(bucket):
        raise InvalidRequest(
            f"{quoted(bucket, 80)} in {quoted(raw)} is not a valid S3 bucket name "
            "(3-63 lowercase letters, digits, dots or hyphens). " + _URI_HELP
        )
    if "?" in prefix or "#" in prefix:
        raise InvalidRequest(
            f"The model URI {quoted(raw)} has a query or fragment; prewarm takes a plain "
            "prefix. " + _URI_HELP
        )
    prefix = prefix.lstrip("/")
    if prefix:
        prefix = prefix.rstrip("/") + "/"
        _check_parts(
            prefix.rstrip("/"),
            what=f"The prefix of {quoted(raw)}",
            exc=InvalidRequest,
            fix=_URI_HELP,
        )
    return ModelUri(bucket=bucket, prefix=prefix)


def valid_bucket_name(name: str) -> bool:
    """Whether ``name`` follows S3's bucket naming rules (the subset every endpoint accepts)."""
    return bool(_BUCKET_RE.fullmatch(name)) and ".." not in name


def refuse_whole_bucket(uri: ModelUri, allowed: Collection[str]) -> None:
    """Refuse a URI with no prefix unless its bucket is one that may be asked for whole.

    ``s3://models`` caches every object in the bucket as one model: a typo of
    ``s3://models/llama/`` would list and pull all of it, evicting other models to
    make room up to the tier's budget. A bucket that holds exactly one model is
    named in ``access.whole_buckets`` (an explicit, per-bucket opt-in).
    """
    if uri.prefix or uri.bucket in allowed:
        return
    raise InvalidRequest(
        f"{uri} names a whole bucket (no prefix): every object in it would be cached as one "
        f"model. Name the model's prefix (s3://{uri.bucket}/<model>/); if this bucket holds "
        f'exactly one model, allow it with access.whole_buckets = ["{uri.bucket}"] in '
        "agent.toml."
    )


def safe_relative_path(uri: ModelUri, key: str) -> str:
    """Return ``key`` relative to the URI's prefix, refusing anything unsafe.

    Raises UnsafeObjectKey for keys that would resolve outside the model
    directory once written to disk (``..`` or ``.`` components, absolute paths,
    empty components), that no file system could name (a component over 255
    bytes, a key over 1,024), or that hold control or bidi characters.
    """
    if not key.startswith(uri.prefix):
        raise UnsafeObjectKey(f"Object key {quoted(key)} is not under the prefix of {uri}.")
    relative = key[len(uri.prefix) :]
    _check_parts(
        relative,
        what=f"Object key {quoted(key)} under {uri}",
        exc=UnsafeObjectKey,
        fix="Rename the object, or leave it out with an exclude glob.",
    )
    return relative


def forbidden_character(text: str) -> str | None:
    """A description of the first control or bidi character in ``text``, or None."""
    found = _FORBIDDEN_RE.search(text)
    if found is None:
        return None
    code = ord(found.group())
    kind = "bidi control" if code > 0x9F else "control character"
    name = _CONTROL_NAMES.get(code)
    named = f"U+{code:04X} ({name})" if name else f"U+{code:04X}"
    return f"the {kind} {named} at character {found.start()}"


def _refuse_forbidden(text: str, *, what: str, exc: type[InvalidRequest], fix: str) -> None:
    found = forbidden_character(text)
    if found is not None:
        raise exc(f"{what} contains {found}; control and bidi characters are refused. {fix}")


def _check_parts(path: str, *, what: str, exc: type[InvalidRequest], fix: str) -> None:
    _refuse_forbidden(path, what=what, exc=exc, fix=fix)
    size = len(path.encode("utf-8", "surrogatepass"))
    if size > MAX_KEY_BYTES:
        raise exc(f"{what} is {size} bytes long, over S3's limit of {MAX_KEY_BYTES} bytes. {fix}")
    if path.startswith("/"):
        raise exc(f"{what} is an absolute path. {fix}")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise exc(f"{what} has an empty, '.' or '..' path component. {fix}")
    for part in parts:
        part_size = len(part.encode("utf-8", "surrogatepass"))
        if part_size > MAX_COMPONENT_BYTES:
            raise exc(
                f"{what} has a path component of {part_size} bytes, over the limit of "
                f"{MAX_COMPONENT_BYTES} bytes a file name may have. {fix}"
            )


def uri_matches(patterns: Sequence[str], uri: ModelUri) -> bool:
    """Whether ``uri`` is among ``patterns`` (none: every URI is): a glob (``*?[``) is
    matched against the whole URI, a plain prefix names a directory and all below it."""
    if not patterns:
        return True
    text = str(uri)
    return any(_pattern_matches(pattern, text) for pattern in patterns)


def _pattern_matches(pattern: str, uri: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(uri, pattern)
    # A plain prefix names a directory: it and everything below it.
    directory = pattern.rstrip("/") + "/"
    return uri.startswith(directory) or uri == pattern
