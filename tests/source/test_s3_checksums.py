"""S3's full-object checksums: picked out of responses, recomputed over downloaded files.

The arithmetic runs on local files; the tests that need S3's own answers put
objects on the real (moto) server.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import random
import zlib
from pathlib import Path
from typing import Any

import pytest
from botocore.httpchecksum import Crc32Checksum, Sha256Checksum

from agent.source.checksums import S3Checksum, full_object_checksum, s3_checksum_of

CHUNK = 64 * 1024
HAS_CRT = importlib.util.find_spec("awscrt") is not None


def _data(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.fixture
def data() -> bytes:
    return _data(5 * CHUNK + 1234)


@pytest.fixture
def data_file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    return path


def test_sha256_match_and_mismatch(data_file: Path, data: bytes) -> None:
    """A SHA256 checksum matches the file's bytes and not other bytes."""
    expected = _b64(hashlib.sha256(data).digest())
    assert full_object_checksum(data_file, "SHA256", expected) is True
    assert full_object_checksum(data_file, "SHA256", _b64(hashlib.sha256(b"x").digest())) is False


def test_crc32_is_big_endian_like_s3_reports_it(data_file: Path, data: bytes) -> None:
    """CRC32 is compared big-endian, as S3 encodes it; the little-endian value does not match."""
    expected = _b64(zlib.crc32(data).to_bytes(4, "big"))
    assert full_object_checksum(data_file, "CRC32", expected) is True
    little = _b64(zlib.crc32(data).to_bytes(4, "little"))
    assert full_object_checksum(data_file, "CRC32", little) is False


def test_values_agree_with_botocores_own_checksums(data_file: Path, data: bytes) -> None:
    """Our values for CRC32 and SHA256 equal the ones botocore itself computes."""
    for name, checksum in [("CRC32", Crc32Checksum()), ("SHA256", Sha256Checksum())]:
        checksum.update(data)
        assert full_object_checksum(data_file, name, checksum.b64digest()) is True, name


def test_other_hashlib_algorithms(data_file: Path, data: bytes) -> None:
    """SHA1, SHA512 and MD5 checksums are checked too."""
    for name, factory in [("SHA1", hashlib.sha1), ("SHA512", hashlib.sha512), ("MD5", hashlib.md5)]:
        assert full_object_checksum(data_file, name, _b64(factory(data).digest())) is True, name


def test_xxhash_algorithms_match_aws_checksums_test_vectors(tmp_path: Path) -> None:
    """The XXHASH64/3/128 checksums match aws-checksums' published test vectors."""
    # The vectors of awslabs/aws-checksums' xxhash tests, for "Hello world", seed 0.
    path = tmp_path / "hello"
    path.write_bytes(b"Hello world")
    vectors = {
        "XXHASH64": "c500b0c912b376d8",
        "XXHASH3": "b6acb9d84a38ff74",
        "XXHASH128": "7351f89812f97382b91d05b31e04dd7f",
    }
    for name, hexdigest in vectors.items():
        assert full_object_checksum(path, name, _b64(bytes.fromhex(hexdigest))) is True, name


def test_algorithm_name_is_case_insensitive(data_file: Path, data: bytes) -> None:
    """An algorithm named in lower case is the same algorithm."""
    assert full_object_checksum(data_file, "sha256", _b64(hashlib.sha256(data).digest())) is True


def test_composite_checksum_cannot_be_checked(data_file: Path, data: bytes) -> None:
    """A composite (multipart) checksum answers None: it cannot be told, so it is not guessed."""
    value = _b64(hashlib.sha256(data).digest())
    assert full_object_checksum(data_file, "SHA256", f"{value}-3") is None
    assert full_object_checksum(data_file, "SHA256", value, checksum_type="COMPOSITE") is None


def test_unknown_algorithm_cannot_be_checked(data_file: Path) -> None:
    """An algorithm we do not know answers None rather than a mismatch."""
    assert full_object_checksum(data_file, "ADLER32", _b64(bytes(4))) is None


@pytest.mark.parametrize("value", ["not base64!", _b64(bytes(5))])
def test_malformed_expected_value_cannot_be_checked(data_file: Path, value: str) -> None:
    """A value that is not base64 of the algorithm's size answers None."""
    assert full_object_checksum(data_file, "CRC32", value) is None


@pytest.mark.skipif(HAS_CRT, reason="awscrt is installed, so CRC32C can be computed")
@pytest.mark.parametrize(("name", "size"), [("CRC32C", 4), ("CRC64NVME", 8)])
def test_crt_algorithms_without_awscrt_cannot_be_checked(
    data_file: Path, name: str, size: int
) -> None:
    """Without awscrt, CRC32C and CRC64NVME answer None instead of failing."""
    assert full_object_checksum(data_file, name, _b64(bytes(size))) is None


def test_checksum_is_picked_from_a_head_response() -> None:
    """s3_checksum_of reads the checksum out of a HEAD response, or None if it has none."""
    head = {"ETag": '"abc"', "ChecksumCRC32": "iH6F8A==", "ChecksumType": "FULL_OBJECT"}
    assert s3_checksum_of(head) == S3Checksum("CRC32", "iH6F8A==", composite=False)
    assert s3_checksum_of({"ETag": '"abc"'}) is None


def test_multipart_checksum_without_a_type_is_treated_as_composite() -> None:
    """A multipart ETag without a ChecksumType makes the checksum composite (not checkable)."""
    head = {
        "ETag": '"0123abcd-2"',
        "ChecksumSHA256": "2qXW+F4KwLkYFPGnckLOh/NdC0Xlb0SDCCwI2sDVPqE=",
    }
    checksum = s3_checksum_of(head)
    assert checksum is not None
    assert checksum.composite


def test_multipart_full_object_checksum_is_checked() -> None:
    """A multipart object with ChecksumType FULL_OBJECT keeps a checkable checksum."""
    head = {"ETag": '"0123abcd-2"', "ChecksumCRC32": "iH6F8A==", "ChecksumType": "FULL_OBJECT"}
    checksum = s3_checksum_of(head)
    assert checksum is not None
    assert not checksum.composite


def _body(s3_client: Any, bucket: str, key: str, **kwargs: Any) -> dict[str, Any]:
    response: dict[str, Any] = s3_client.get_object(Bucket=bucket, Key=key, **kwargs)
    response["Body"].read()
    return response


@pytest.mark.parametrize("algorithm", ["SHA256", "CRC32", "SHA1"])
def test_checksum_stored_by_s3_matches_the_downloaded_file(
    s3_client: Any, bucket: str, tmp_path: Path, data: bytes, algorithm: str
) -> None:
    """The checksum S3 stores matches the uploaded bytes and catches one flipped bit."""
    s3_client.put_object(Bucket=bucket, Key="w.bin", Body=data, ChecksumAlgorithm=algorithm)
    head = s3_client.head_object(Bucket=bucket, Key="w.bin", ChecksumMode="ENABLED")
    checksum = s3_checksum_of(head)
    assert checksum is not None
    assert (checksum.algorithm, checksum.composite) == (algorithm, False)
    path = tmp_path / "w.bin"
    path.write_bytes(data)
    assert checksum.matches(path) is True
    corrupt = bytearray(data)
    corrupt[-1] ^= 0x01
    path.write_bytes(corrupt)
    assert checksum.matches(path) is False


def test_put_without_an_algorithm_gets_botocores_default_crc32(
    s3_client: Any, bucket: str, data_file: Path, data: bytes
) -> None:
    """An upload with no algorithm gets botocore's default CRC32, which we can check."""
    s3_client.put_object(Bucket=bucket, Key="w.bin", Body=data)
    head = s3_client.head_object(Bucket=bucket, Key="w.bin", ChecksumMode="ENABLED")
    checksum = s3_checksum_of(head)
    assert checksum is not None
    assert checksum.algorithm == "CRC32"
    assert checksum.matches(data_file) is True


def test_head_without_checksum_mode_reports_no_checksum(
    s3_client: Any, bucket: str, data: bytes
) -> None:
    """HEAD without ChecksumMode=ENABLED carries no checksum, so none is reported."""
    s3_client.put_object(Bucket=bucket, Key="w.bin", Body=data, ChecksumAlgorithm="SHA256")
    assert s3_checksum_of(s3_client.head_object(Bucket=bucket, Key="w.bin")) is None


def test_multipart_composite_checksum_is_not_checked(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    """A composite multipart checksum, from GET or from moto's HEAD, is never checked."""
    part = 5 * 1024 * 1024  # S3's minimum part size
    body = _data(2 * part, 7)
    upload = s3_client.create_multipart_upload(Bucket=bucket, Key="mp", ChecksumAlgorithm="SHA256")
    parts = []
    for number in (1, 2):
        response = s3_client.upload_part(
            Bucket=bucket,
            Key="mp",
            UploadId=upload["UploadId"],
            PartNumber=number,
            Body=body[(number - 1) * part : number * part],
            ChecksumAlgorithm="SHA256",
        )
        parts.append(
            {
                "PartNumber": number,
                "ETag": response["ETag"],
                "ChecksumSHA256": response["ChecksumSHA256"],
            }
        )
    s3_client.complete_multipart_upload(
        Bucket=bucket, Key="mp", UploadId=upload["UploadId"], MultipartUpload={"Parts": parts}
    )
    path = tmp_path / "mp"
    path.write_bytes(body)
    # GET reports it as S3 does ("-2" suffix, COMPOSITE); moto's HEAD drops both,
    # and the multipart ETag is what keeps that from reading as a mismatch.
    for response in (
        _body(s3_client, bucket, "mp", ChecksumMode="ENABLED"),
        s3_client.head_object(Bucket=bucket, Key="mp", ChecksumMode="ENABLED"),
    ):
        checksum = s3_checksum_of(response)
        assert checksum is not None
        assert checksum.composite
        assert checksum.matches(path) is None
