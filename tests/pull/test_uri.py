"""Model URI parsing and object-key safety."""

from __future__ import annotations

import pytest

from agent import InvalidRequest, UnsafeObjectKey
from agent._uri import ModelUri, parse_uri, refuse_whole_bucket, safe_relative_path


@pytest.mark.parametrize(
    ("raw", "bucket", "prefix"),
    [
        ("s3://models/llama", "models", "llama/"),
        ("s3://models/llama/", "models", "llama/"),
        ("s3://models/llama///", "models", "llama/"),
        ("S3://models/a/b", "models", "a/b/"),
        ("s3://models", "models", ""),
        ("s3://models/", "models", ""),
        ("s3://my.bucket-1/x", "my.bucket-1", "x/"),
    ],
)
def test_parse_uri_normalises_prefix_to_a_directory(raw: str, bucket: str, prefix: str) -> None:
    """A URI becomes (bucket, prefix) with the prefix ending in exactly one slash."""
    assert parse_uri(raw) == ModelUri(bucket, prefix)


def test_normalised_uri_prints_in_canonical_form() -> None:
    """A parsed URI prints as s3://bucket/prefix/."""
    assert str(parse_uri("s3://models/llama")) == "s3://models/llama/"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("", "empty"),
        ("https://models/llama", "not an S3 URI"),
        ("models/llama", "not an S3 URI"),
        ("s3://Models/llama", "not a valid S3 bucket name"),
        ("s3://ab/llama", "not a valid S3 bucket name"),
        ("s3://my_bucket/llama", "not a valid S3 bucket name"),
        ("s3://a..b/llama", "not a valid S3 bucket name"),
        ("s3://models/llama?versionId=1", "query or fragment"),
        ("s3://models/a/../b", "'..'"),
        ("s3://models/a/./b", "'.'"),
        ("s3://models/a//b", "empty"),
        ("s3://models/a\x00b", "NUL"),
    ],
)
def test_parse_uri_rejects_bad_input_with_a_reason(raw: str, fragment: str) -> None:
    """A malformed URI raises InvalidRequest naming the fault and the expected form."""
    with pytest.raises(InvalidRequest) as info:
        parse_uri(raw)
    assert fragment in str(info.value)
    assert "s3://bucket/prefix" in str(info.value)


def test_safe_relative_path_strips_the_prefix() -> None:
    """An object key under the prefix maps to its path relative to the model directory."""
    uri = parse_uri("s3://models/llama/")
    assert safe_relative_path(uri, "llama/sub/model.safetensors") == "sub/model.safetensors"


@pytest.mark.parametrize(
    "key",
    [
        "llama/../etc/passwd",
        "llama/a/../../x",
        "llama//etc/passwd",
        "llama/./x",
        "llama/x\x00y",
        "llama/",
        "other/x",
    ],
)
def test_safe_relative_path_refuses_keys_that_escape(key: str) -> None:
    """Keys with '..', '.', empty or NUL parts, or outside the prefix raise UnsafeObjectKey."""
    with pytest.raises(UnsafeObjectKey):
        safe_relative_path(parse_uri("s3://models/llama/"), key)


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        ("llama/" + "a" * 256, "path component of 256 bytes, over the limit of 255 bytes"),
        ("llama/" + "\u00e9" * 128, "path component of 256 bytes"),
        ("llama/" + "/".join(["d" * 200] * 22), "over S3's limit of 1024 bytes"),
        ("llama/\x1b[31mred", "control character U+001B (ESC) at character 0"),
        ("llama/a\u202egpj.exe", "bidi control U+202E at character 1"),
        ("llama/a\u2066b", "bidi control U+2066"),
        ("llama/a\x85b", "control character U+0085"),
        ("llama/a\x7fb", "U+007F (DEL)"),
    ],
)
def test_safe_relative_path_refuses_long_parts_and_control_characters(
    key: str, fragment: str
) -> None:
    """Over-long components or keys, control and bidi characters: UnsafeObjectKey naming the limit
    or the code point, with the key escaped and cut in the message.
    """
    with pytest.raises(UnsafeObjectKey) as info:
        safe_relative_path(parse_uri("s3://models/llama/"), key)
    message = str(info.value)
    assert fragment in message
    assert message.isprintable()
    assert len(message) < 600


def test_a_255_byte_component_is_accepted() -> None:
    """A component of exactly 255 bytes is a valid file name and is accepted."""
    uri = parse_uri("s3://models/llama/")
    assert safe_relative_path(uri, "llama/" + "a" * 255) == "a" * 255


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("s3://models/" + "a" * 16384, "16396 bytes long, over the limit of 1100 bytes"),
        ("s3://models/\x1b]8;;http://x\x07", "control character U+001B (ESC)"),
        ("s3://models/a\u202eb", "bidi control U+202E"),
        ("s3://models/" + "p" * 300 + "/", "path component of 300 bytes"),
    ],
)
def test_parse_uri_refuses_huge_uris_and_control_characters(raw: str, fragment: str) -> None:
    """A URI over its byte limit or holding control or bidi characters is InvalidRequest that names
    the limit or the code point and never repeats the URI raw or whole.
    """
    with pytest.raises(InvalidRequest) as info:
        parse_uri(raw)
    message = str(info.value)
    assert fragment in message
    assert message.isprintable()
    assert len(message) < 600


def test_a_whole_bucket_is_refused_unless_its_bucket_is_allowed() -> None:
    """s3://bucket with no prefix is InvalidRequest naming the opt-in; an allowed bucket and any
    URI with a prefix pass."""
    with pytest.raises(InvalidRequest, match=r'access.whole_buckets = \["models"\]'):
        refuse_whole_bucket(parse_uri("s3://models"), allowed=["other"])
    refuse_whole_bucket(parse_uri("s3://models/"), allowed=["models"])
    refuse_whole_bucket(parse_uri("s3://models/llama/"), allowed=[])
