"""The checksums S3 stores for objects, and whether a file on disk matches one.

S3 can keep a full-object checksum per object (``ChecksumAlgorithm`` in a
listing, the ``Checksum<NAME>`` fields of HEAD with ``ChecksumMode=ENABLED``).
``s3_checksum_of`` picks it out of a response and ``full_object_checksum``
recomputes it over a downloaded file, where it can be computed here; it answers
None rather than guess. The content hash the cache records is another thing
(agent.check.hashes); this one only says the bytes are the ones S3 holds.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import xxhash

from agent.check.hashes import READ_BLOCK

__all__ = [
    "S3_CHECKSUM_ALGORITHMS",
    "S3Checksum",
    "full_object_checksum",
    "s3_checksum_of",
]

# As S3 names them (ChecksumAlgorithm, and the Checksum<NAME> fields of HEAD),
# in the order we prefer when an object has more than one: cheapest first.
S3_CHECKSUM_ALGORITHMS = (
    "XXHASH3",
    "XXHASH128",
    "XXHASH64",
    "CRC64NVME",
    "CRC32C",
    "CRC32",
    "MD5",
    "SHA1",
    "SHA256",
    "SHA512",
)


# A multipart upload's ETag: hex MD5 of the parts' MD5s, then "-<parts>".
_MULTIPART_ETAG = re.compile(r"[0-9a-fA-F]+-[0-9]+")


class _Digest(Protocol):
    def update(self, data: Any, /) -> Any: ...
    def digest(self) -> bytes: ...


@dataclass(frozen=True, slots=True)
class S3Checksum:
    """A checksum S3 reports for an object: base64 of the big-endian value.

    ``composite`` is True for a checksum of the parts' checksums (a multipart
    upload with ChecksumType COMPOSITE), which ``matches`` cannot check.
    """

    algorithm: str
    value: str
    composite: bool

    def matches(self, path: str | os.PathLike[str]) -> bool | None:
        """``full_object_checksum`` of ``path`` against this checksum."""
        kind = "COMPOSITE" if self.composite else None
        return full_object_checksum(path, self.algorithm, self.value, checksum_type=kind)


def s3_checksum_of(head: Mapping[str, Any]) -> S3Checksum | None:
    """The checksum in a HeadObject/GetObject response (ChecksumMode=ENABLED), if any.

    Composite when S3 says so (ChecksumType COMPOSITE, or a "-<parts>" suffix on
    the value), and also when the response has no ChecksumType but the ETag
    has a "-<parts>" suffix: then the object was uploaded in parts and the
    checksum's kind is unknown, and treating it as full-object could fail a good
    file. (moto's HEAD answers composite checksums that way: no suffix, no type.)
    """
    for algorithm in S3_CHECKSUM_ALGORITHMS:
        value = head.get(f"Checksum{algorithm}")
        if isinstance(value, str) and value:
            kind = head.get("ChecksumType")
            etag = str(head.get("ETag", "")).strip('"')
            composite = (
                kind == "COMPOSITE"
                or "-" in value
                or (kind is None and _MULTIPART_ETAG.fullmatch(etag) is not None)
            )
            return S3Checksum(algorithm, value, composite)
    return None


def full_object_checksum(
    path: str | os.PathLike[str],
    algorithm: str,
    expected_base64: str,
    *,
    checksum_type: str | None = None,
    read_block: int = READ_BLOCK,
) -> bool | None:
    """Whether a file matches S3's full-object checksum; None if it cannot be told.

    None, never a guess, when:
    - the checksum is composite (ChecksumType COMPOSITE, or a "-<parts>"
      suffix): it is a checksum of the parts' checksums, and checking it needs
      the part boundaries (GetObjectAttributes ObjectParts), which we do not fetch;
    - the algorithm needs awscrt (CRC32C, CRC64NVME through botocore's CRT
      classes) and awscrt is not installed, or the algorithm is unknown;
    - the expected value is not base64 of a value of the algorithm's size.
    A mismatch is False. Blocking: a full read of the file; run it in a thread.
    Measured like ``hash_file``: XXHASH3 12.7 GB/s, CRC32 4.7 GB/s, SHA256
    1.7 GB/s, MD5 0.8 GB/s; for a 200 GB model with SHA256 checksums that is two
    minutes of one core, which is why ``IntegritySettings.s3_checksums`` exists.
    """
    if checksum_type == "COMPOSITE" or "-" in expected_base64:
        return None
    factory = _s3_hasher(algorithm.upper())
    if factory is None:
        return None
    hasher = factory()
    try:
        expected = base64.b64decode(expected_base64, validate=True)
    except binascii.Error:
        return None
    if len(expected) != len(hasher.digest()):
        return None
    buffer = bytearray(read_block)
    view = memoryview(buffer)
    with Path(path).open("rb", buffering=0) as file:
        while count := file.readinto(buffer):
            hasher.update(view[:count])
    return hasher.digest() == expected


def _md5() -> _Digest:
    # An integrity check, not security; FIPS builds refuse md5 without this flag.
    return hashlib.md5(usedforsecurity=False)


def _s3_hasher(algorithm: str) -> Callable[[], _Digest] | None:
    from botocore import httpchecksum

    # botocore's own classes where it has them, so the digest is exactly what
    # botocore would compare a GetObject body with (big-endian CRCs included).
    factories: dict[str, Callable[[], _Digest]] = {
        "CRC32": httpchecksum.Crc32Checksum,
        "CRC32C": httpchecksum.CrtCrc32cChecksum,
        "CRC64NVME": httpchecksum.CrtCrc64NvmeChecksum,
        "SHA1": httpchecksum.Sha1Checksum,
        "SHA256": httpchecksum.Sha256Checksum,
        "SHA512": httpchecksum.Sha512Checksum,
        # botocore computes these only through awscrt; xxhash gives the same
        # canonical (big-endian) digests, checked against aws-checksums' vectors.
        "XXHASH64": xxhash.xxh64,
        "XXHASH3": xxhash.xxh3_64,
        "XXHASH128": xxhash.xxh3_128,
        "MD5": _md5,
    }
    factory = factories.get(algorithm)
    if factory is None:
        return None
    try:
        # The CRT classes exist without awscrt (or with one too old for
        # CRC64NVME) and fail on first use; probe once, answer "cannot check".
        factory().update(b"")
    except (AttributeError, TypeError, ImportError):
        return None
    return factory
