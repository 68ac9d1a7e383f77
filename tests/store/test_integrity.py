"""Content hashes (xxh3-128 over chunks), verify_files, and holding a file to a checksum."""

from __future__ import annotations

import base64
import hashlib
import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import xxhash

from agent import IntegrityError
from agent.check.hashes import (
    ALGORITHM,
    ChunkDigests,
    ChunkHasher,
    FileProblemReport,
    check_object_checksum,
    chunk_count,
    combine,
    hash_file,
    verify_files,
)
from agent.source.checksums import S3Checksum

CHUNK = 64 * 1024


def _data(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture
def data() -> bytes:
    # Five full chunks and a short sixth, so the last chunk is the odd one.
    return _data(5 * CHUNK + 1234)


@pytest.fixture
def data_file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    return path


def _pieces(chunk: bytes, rng: random.Random) -> Iterator[bytes]:
    at = 0
    while at < len(chunk):
        step = rng.randint(1, 20_000)
        yield chunk[at : at + step]
        at += step


def test_algorithm_name_says_what_the_manifest_records() -> None:
    """The manifest's algorithm name is "xxh3-128/chunks", part of the on-disk format."""
    assert ALGORITHM == "xxh3-128/chunks"


def test_digest_is_xxh3_128_over_the_chunk_digests(data_file: Path, data: bytes) -> None:
    """A file's digest is xxh3-128 of its chunks' xxh3-128 digests, concatenated in order."""
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    expected = xxhash.xxh3_128(b"".join(xxhash.xxh3_128(c).digest() for c in chunks)).hexdigest()
    result = hash_file(data_file, CHUNK)
    assert result.digest == expected
    assert len(result.chunk_digests) == 6


def test_chunks_hashed_out_of_order_in_pieces_match_hash_file(data_file: Path, data: bytes) -> None:
    """Chunks hashed in any order, fed in pieces of any size, give hash_file's digest."""
    rng = random.Random(1)
    table = ChunkDigests(len(data), CHUNK)
    order = list(range(chunk_count(len(data), CHUNK)))
    rng.shuffle(order)
    for index in order:
        start = index * CHUNK
        hasher = ChunkHasher()
        for piece in _pieces(data[start : start + table.chunk_length(index)], rng):
            hasher.update(piece)
        assert hasher.length == table.chunk_length(index)
        table.set(index, hasher.digest())
    assert table.finish() == hash_file(data_file, CHUNK)


def test_file_written_by_concurrent_workers_in_any_order_matches_hash_file(
    tmp_path: Path, data: bytes
) -> None:
    """Concurrent workers writing and hashing ranges at their offsets agree with hash_file."""
    # What the puller does: workers pwrite whole ranges at their offsets in any
    # order, each hashing its range as it writes it.
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    table = ChunkDigests(len(data), CHUNK)

    def write_range(index: int) -> None:
        hasher = ChunkHasher()
        start = index * CHUNK
        end = start + table.chunk_length(index)
        for at in range(start, end, 4096):
            block = data[at : min(at + 4096, end)]
            os.pwrite(fd, block, at)
            hasher.update(block)
        table.set(index, hasher.digest())

    order = list(range(chunk_count(len(data), CHUNK)))
    random.Random(2).shuffle(order)
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(write_range, order))
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    assert table.finish().digest == hash_file(path, CHUNK).digest


def test_resumed_chunk_hashes_the_part_on_disk_then_the_new_bytes(
    data_file: Path, data: bytes
) -> None:
    """A chunk resumed after a crash (bytes read back from disk, then new ones) hashes the same."""
    # After a crash mid-range the hasher's state is lost; the bytes already
    # written are read back, then hashing goes on with what arrives.
    index, written = 2, 5000
    start = index * CHUNK
    hasher = ChunkHasher()
    fd = os.open(data_file, os.O_RDONLY)
    try:
        hasher.update_from_fd(fd, start, written, bytearray(777))
    finally:
        os.close(fd)
    hasher.update(data[start + written : start + CHUNK])
    assert hasher.digest() == hash_file(data_file, CHUNK).chunk_digests[index]


def test_reading_past_the_end_of_a_file_is_an_eof_error(data_file: Path, data: bytes) -> None:
    """Feeding a hasher from beyond the end of the file raises EOFError saying it is short."""
    fd = os.open(data_file, os.O_RDONLY)
    try:
        with pytest.raises(EOFError, match="short"):
            ChunkHasher().update_from_fd(fd, len(data) - 10, 20)
    finally:
        os.close(fd)


@pytest.mark.parametrize("read_block", [1, 4096, 10_000, CHUNK, 4 * 1024 * 1024])
def test_read_block_does_not_change_the_digest(data_file: Path, read_block: int) -> None:
    """hash_file's read block size is a speed knob only; the digest is the same for any."""
    assert hash_file(data_file, CHUNK, read_block=read_block) == hash_file(data_file, CHUNK)


@pytest.mark.parametrize("size", [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK])
def test_chunk_count_matches_the_chunks_hashed(tmp_path: Path, size: int) -> None:
    """chunk_count agrees with the number of chunk digests hash_file produces, at the edges too."""
    path = tmp_path / "f"
    path.write_bytes(_data(size))
    assert len(hash_file(path, CHUNK).chunk_digests) == chunk_count(size, CHUNK)


def test_empty_file_has_no_chunks_and_the_digest_of_nothing(tmp_path: Path) -> None:
    """An empty file has no chunks and the digest of xxh3-128 over nothing."""
    path = tmp_path / "empty"
    path.write_bytes(b"")
    result = hash_file(path, CHUNK)
    assert result.chunk_digests == ()
    assert result.digest == xxhash.xxh3_128(b"").hexdigest() == combine([])
    assert ChunkDigests(0, CHUNK).finish() == result


def test_flipped_byte_changes_the_digest_and_only_its_chunk(data_file: Path, data: bytes) -> None:
    """One flipped byte changes the file digest and only the digest of the chunk holding it."""
    before = hash_file(data_file, CHUNK)
    flipped = bytearray(data)
    flipped[3 * CHUNK + 17] ^= 0x01
    data_file.write_bytes(flipped)
    after = hash_file(data_file, CHUNK)
    assert after.digest != before.digest
    changed = [
        i
        for i, (a, b) in enumerate(zip(before.chunk_digests, after.chunk_digests, strict=True))
        if a != b
    ]
    assert changed == [3]


def test_chunk_size_is_part_of_the_digest(data_file: Path) -> None:
    """The same bytes hashed with another chunk size give another digest."""
    assert hash_file(data_file, CHUNK).digest != hash_file(data_file, 2 * CHUNK).digest


def test_swapping_two_chunks_changes_the_digest(data_file: Path, data: bytes) -> None:
    """Chunk order is part of the digest: two chunks swapped do not hash the same."""
    swapped = data[CHUNK : 2 * CHUNK] + data[:CHUNK] + data[2 * CHUNK :]
    data_file.write_bytes(swapped)
    assert hash_file(data_file, CHUNK).digest != combine(
        xxhash.xxh3_128(data[i : i + CHUNK]).digest() for i in range(0, len(data), CHUNK)
    )


def test_unfinished_chunk_table_names_the_missing_chunks() -> None:
    """Finishing a file with chunks still undigested fails, naming those chunks."""
    table = ChunkDigests(3 * CHUNK, CHUNK)
    table.set(1, bytes(16))
    assert table.missing() == [0, 2]
    with pytest.raises(ValueError, match=r"chunks \[0, 2\] have no digest"):
        table.finish()


def test_chunk_digest_of_the_wrong_size_is_refused() -> None:
    """A chunk digest that is not 16 bytes is refused."""
    with pytest.raises(ValueError, match="16 bytes"):
        ChunkDigests(CHUNK, CHUNK).set(0, b"short")


# --- verify_files --------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path: Path) -> tuple[Path, list[tuple[str, int, str]]]:
    root = tmp_path / "model"
    (root / "sub").mkdir(parents=True)
    expected = []
    for seed, name in enumerate(["a.safetensors", "sub/b.safetensors", "config.json"]):
        body = _data(CHUNK * seed + 100, seed)
        (root / name).write_bytes(body)
        expected.append((name, len(body), hash_file(root / name, CHUNK).digest))
    return root, expected


def test_unchanged_files_have_no_problems(
    model_dir: tuple[Path, list[tuple[str, int, str]]],
) -> None:
    """verify_files finds nothing wrong with files as they were written."""
    root, expected = model_dir
    assert verify_files(root, expected, CHUNK) == []


def test_missing_file_is_reported(model_dir: tuple[Path, list[tuple[str, int, str]]]) -> None:
    """A deleted file is reported as "missing"."""
    root, expected = model_dir
    (root / "sub/b.safetensors").unlink()
    assert verify_files(root, expected, CHUNK) == [
        FileProblemReport("sub/b.safetensors", "missing", "the file is gone.")
    ]


def test_directory_in_place_of_a_file_is_reported_missing(
    model_dir: tuple[Path, list[tuple[str, int, str]]],
) -> None:
    """A directory where a file should be is reported as "missing", not read."""
    root, expected = model_dir
    (root / "config.json").unlink()
    (root / "config.json").mkdir()
    [problem] = verify_files(root, expected, CHUNK)
    assert (problem.path, problem.check) == ("config.json", "missing")


@pytest.mark.parametrize("link", ["config.json", "sub"])
def test_a_symlink_is_reported_even_when_its_target_holds_the_right_bytes(
    model_dir: tuple[Path, list[tuple[str, int, str]]], tmp_path: Path, link: str
) -> None:
    """verify never follows a link (a file or a directory on the path): it is a problem, not ok."""
    root, expected = model_dir
    outside = tmp_path / "outside"
    (root / link).rename(outside)
    (root / link).symlink_to(outside)
    [problem] = verify_files(root, expected, CHUNK)
    assert problem.check == "missing"
    assert problem.detail == "the path is a link or not a regular file."


def test_truncated_file_is_reported_as_a_size_problem(
    model_dir: tuple[Path, list[tuple[str, int, str]]],
) -> None:
    """A truncated file is a "size" problem, found by stat without hashing."""
    root, expected = model_dir
    path = root / "sub/b.safetensors"
    os.truncate(path, 10)
    [problem] = verify_files(root, expected, CHUNK)
    assert problem == FileProblemReport(
        "sub/b.safetensors", "size", f"the file has 10 bytes, not {expected[1][1]}."
    )


def test_changed_byte_is_reported_as_a_hash_problem(
    model_dir: tuple[Path, list[tuple[str, int, str]]],
) -> None:
    """A changed byte is a "hash" problem naming the recorded digest."""
    root, expected = model_dir
    path = root / "a.safetensors"
    with path.open("r+b") as file:
        file.seek(50)
        byte = file.read(1)
        file.seek(50)
        file.write(bytes([byte[0] ^ 0x80]))
    [problem] = verify_files(root, expected, CHUNK)
    assert (problem.path, problem.check) == ("a.safetensors", "hash")
    assert expected[0][2] in problem.detail
    assert "changed after it was written" in problem.detail


def test_every_problem_is_reported_not_just_the_first(
    model_dir: tuple[Path, list[tuple[str, int, str]]],
) -> None:
    """verify_files reports every broken file, not only the first."""
    root, expected = model_dir
    (root / "a.safetensors").unlink()
    os.truncate(root / "config.json", 0)
    checks = [(p.path, p.check) for p in verify_files(root, expected, CHUNK)]
    assert checks == [("a.safetensors", "missing"), ("config.json", "size")]


def test_problem_becomes_an_integrity_error_naming_file_and_check() -> None:
    """A FileProblemReport becomes an IntegrityError carrying its path and check."""
    error = FileProblemReport("a.safetensors", "hash", "it changed.").to_error()
    assert isinstance(error, IntegrityError)
    assert (error.path, error.check, str(error)) == (
        "a.safetensors",
        "hash",
        "a.safetensors: it changed.",
    )


# --- a file held to the checksum its source keeps ----------------------------------


def _sha256_of(raw: bytes) -> S3Checksum:
    return S3Checksum("SHA256", base64.b64encode(hashlib.sha256(raw).digest()).decode(), False)


def test_a_file_matching_its_objects_checksum_passes(data_file: Path, data: bytes) -> None:
    """A file whose bytes are the object's passes the source-checksum check silently."""
    check_object_checksum(data_file, _sha256_of(data), relative_path="w.bin", origin="s3://b/w")


def test_a_file_differing_from_its_objects_checksum_is_refused(data_file: Path) -> None:
    """A mismatch is an IntegrityError naming the file, the algorithm and the object."""
    with pytest.raises(IntegrityError, match=r"w\.bin: its SHA256 checksum.*s3://b/w") as caught:
        check_object_checksum(
            data_file, _sha256_of(b"other bytes"), relative_path="w.bin", origin="s3://b/w"
        )
    assert (caught.value.path, caught.value.check) == ("w.bin", "s3-sha256")


def test_a_checksum_that_cannot_be_computed_here_does_not_refuse_the_file(
    data_file: Path,
) -> None:
    """A composite checksum (parts unknown) cannot be told, so it passes rather than guess."""
    composite = S3Checksum("SHA256", _sha256_of(b"x").value, composite=True)
    check_object_checksum(data_file, composite, relative_path="w.bin", origin="s3://b/w")
