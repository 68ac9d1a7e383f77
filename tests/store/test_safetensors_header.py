"""The safetensors header check: real files pass, each kind of corruption is named."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agent import IntegrityError
from agent.check.safetensors import (
    CHECK,
    DTYPE_BITS,
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    TensorSpec,
    parse_header,
    read_header,
)
from agent.client import SafetensorsError, _tensors


def _sample() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=gen)
    return {
        "f32": base,
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "f64": base.double(),
        "i64": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "u16": torch.zeros(5, dtype=torch.uint16),
        "bool": torch.tensor([True, False, True]),
        "f8_e4m3": base.to(torch.float8_e4m3fn),
        "f8_e5m2": base.to(torch.float8_e5m2),
        "f8_e4m3fnuz": base.to(torch.float8_e4m3fnuz),
        "f8_e8m0": torch.zeros(7, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "f4": torch.zeros(3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "c64": torch.zeros(2, dtype=torch.complex64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 8),
        "empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
    }


def _raw_header(path: Path) -> dict[str, object]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    parsed: dict[str, object] = json.loads(data[8 : 8 + length])
    return parsed


def _write(path: Path, header: object, data: bytes, *, length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _refused(path: Path) -> IntegrityError:
    with pytest.raises(IntegrityError) as caught:
        read_header(path)
    assert caught.value.path == str(path)
    assert caught.value.check == CHECK
    assert str(caught.value).startswith(f"{path}: ")
    return caught.value


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(_sample(), str(path), metadata={"format": "pt", "note": "x"})
    return path


def test_file_written_by_the_safetensors_library_is_accepted(model_file: Path) -> None:
    """A file saved by the safetensors library parses to exactly the header it wrote."""
    header = read_header(model_file)
    raw = _raw_header(model_file)

    assert header.data_start == 8 + header.header_length
    assert header.data_size == model_file.stat().st_size - header.data_start
    assert dict(header.metadata) == {"format": "pt", "note": "x"}
    assert set(header.tensors) == set(_sample())
    for name, spec in header.tensors.items():
        entry = raw[name]
        assert isinstance(entry, dict)
        assert spec == TensorSpec(
            dtype=entry["dtype"],
            shape=tuple(entry["shape"]),
            begin=entry["data_offsets"][0],
            end=entry["data_offsets"][1],
        )


def test_library_dtype_names_are_the_ones_written(model_file: Path) -> None:
    """The dtype names we read (BF16, the F8 family, F4) are the library's own."""
    dtypes = {name: spec.dtype for name, spec in read_header(model_file).tensors.items()}
    assert dtypes["bf16"] == "BF16"
    assert dtypes["f8_e4m3"] == "F8_E4M3"
    assert dtypes["f8_e5m2"] == "F8_E5M2"
    assert dtypes["f8_e8m0"] == "F8_E8M0"
    assert dtypes["f4"] == "F4"


def test_empty_tensors_are_accepted_with_their_shape(model_file: Path) -> None:
    """Zero-element tensors are accepted and keep their shape, with no bytes of data."""
    tensors = read_header(model_file).tensors
    assert tensors["empty"].shape == (0, 8)
    assert tensors["empty"].nbytes == 0
    assert tensors["empty_bf16"].shape == (3, 0)


def test_descriptor_path_and_buffer_give_the_same_header(model_file: Path) -> None:
    """A path, a descriptor (offset untouched) and a buffer all parse to the same header."""
    by_path = read_header(model_file)
    fd = os.open(model_file, os.O_RDONLY)
    try:
        os.lseek(fd, 5, os.SEEK_SET)
        by_fd = read_header(fd, path="model.safetensors")
        assert os.lseek(fd, 0, os.SEEK_CUR) == 5, "read_header moved the descriptor's offset"
    finally:
        os.close(fd)
    data = model_file.read_bytes()
    by_buffer = parse_header(data, len(data), path="model.safetensors")
    assert by_path == by_fd == by_buffer


def test_header_is_read_only(model_file: Path) -> None:
    """The parsed tensor table cannot be modified."""
    header: SafetensorsHeader = read_header(model_file)
    with pytest.raises(TypeError):
        header.tensors["x"] = TensorSpec("U8", (0,), 0, 0)  # type: ignore[index]


def test_errors_from_a_descriptor_name_the_given_path(model_file: Path) -> None:
    """Errors from a descriptor carry the path the caller named, in the message and the error."""
    fd = os.open(model_file, os.O_RDONLY)
    try:
        with pytest.raises(IntegrityError, match=r"^staging/model\.safetensors: ") as caught:
            read_header(fd, size=4, path="staging/model.safetensors")
    finally:
        os.close(fd)
    assert caught.value.path == "staging/model.safetensors"


def test_file_shorter_than_the_length_field_is_refused(tmp_path: Path) -> None:
    """A file under 8 bytes, too short for the length field, is refused."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    assert "3 bytes long, too short" in str(_refused(path))


def test_empty_file_is_refused(tmp_path: Path) -> None:
    """An empty file is refused as too short."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"")
    assert "too short" in str(_refused(path))


def test_flipped_high_byte_of_the_length_field_hits_the_cap(model_file: Path) -> None:
    """A corrupted high byte of the length field is refused by the 100 MB header cap."""
    data = bytearray(model_file.read_bytes())
    data[6] ^= 0xFF
    model_file.write_bytes(data)
    assert f"more than the format's {MAX_HEADER_BYTES}-byte cap" in str(_refused(model_file))


def test_flipped_low_byte_of_the_length_field_points_past_the_file(model_file: Path) -> None:
    """A length field under the cap but past the end of the file is refused, naming both."""
    data = bytearray(model_file.read_bytes())
    data[2] ^= 0x40  # + 4 MiB: under the cap, past the end of this small file
    model_file.write_bytes(data)
    message = str(_refused(model_file))
    assert "header length field says" in message
    assert f"the file holds {len(data) - 8} after it" in message


def test_file_truncated_inside_the_header_is_refused(model_file: Path) -> None:
    """A file cut off inside its header is refused."""
    data = model_file.read_bytes()
    model_file.write_bytes(data[:40])
    assert "header length field says" in str(_refused(model_file))


def test_file_truncated_inside_the_data_is_refused(model_file: Path) -> None:
    """A file cut off inside its tensor data is refused: tensors lie outside the data."""
    data = model_file.read_bytes()
    model_file.write_bytes(data[:-10])
    assert "outside the" in str(_refused(model_file))


def test_size_promised_by_the_listing_is_checked_against_the_file(model_file: Path) -> None:
    """A file shorter than the size S3 listed is refused even if its header looks whole."""
    # The puller passes the size S3 listed; a short file is caught even if the
    # header itself claims nothing past the end of what is there.
    size = model_file.stat().st_size
    model_file.write_bytes(model_file.read_bytes()[:20])
    with pytest.raises(IntegrityError, match=r"the file ends .* into its .*-byte header"):
        read_header(model_file, size=size)


def test_header_that_is_not_json_is_refused(tmp_path: Path) -> None:
    """A header that is not valid JSON is refused."""
    path = _write(tmp_path / "x.safetensors", b'{"w": {"dtype": "F32",', b"")
    assert "not valid JSON" in str(_refused(path))


def test_header_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    """A header that is not UTF-8 is refused."""
    path = _write(tmp_path / "x.safetensors", b'{"\xff": {}}', b"")
    assert "not UTF-8" in str(_refused(path))


def test_header_that_is_a_json_array_is_refused(tmp_path: Path) -> None:
    """A header that is JSON but not an object is refused."""
    path = _write(tmp_path / "x.safetensors", [1, 2], b"")
    assert "JSON list, not a JSON object" in str(_refused(path))


def test_tensor_named_twice_is_refused(tmp_path: Path) -> None:
    """A tensor name that appears twice in the header is refused, not silently overwritten."""
    entry = '{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    path = _write(tmp_path / "x.safetensors", f'{{"w": {entry}, "w": {entry}}}'.encode(), b"\0")
    assert "the key 'w' appears twice" in str(_refused(path))


def test_metadata_with_non_string_values_is_refused(tmp_path: Path) -> None:
    """__metadata__ with non-string values is refused."""
    path = _write(tmp_path / "x.safetensors", {"__metadata__": {"layers": 32}}, b"")
    assert "__metadata__ is {'layers': 32}" in str(_refused(path))


def test_unknown_dtype_is_refused(tmp_path: Path) -> None:
    """A dtype safetensors does not define is refused by name."""
    header = {"w": {"dtype": "Q4_K", "shape": [1], "data_offsets": [0, 1]}}
    path = _write(tmp_path / "x.safetensors", header, b"\0")
    assert "tensor 'w' has dtype 'Q4_K', which is not a safetensors dtype" in str(_refused(path))


@pytest.mark.parametrize("shape", [[-1], [2, "3"], [True], 4, None])
def test_shape_that_is_not_a_list_of_sizes_is_refused(tmp_path: Path, shape: object) -> None:
    """A shape that is not a list of non-negative integers is refused."""
    header = {"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, 0]}}
    path = _write(tmp_path / "x.safetensors", header, b"")
    assert f"tensor 'w' has shape {shape!r}, not a list of sizes" in str(_refused(path))


@pytest.mark.parametrize("offsets", [[0], [0, 1, 2], [-1, 0], [0.0, 1.0], "0-1"])
def test_malformed_data_offsets_are_refused(tmp_path: Path, offsets: object) -> None:
    """data_offsets that are not a pair of non-negative integers are refused."""
    header = {"w": {"dtype": "U8", "shape": [1], "data_offsets": offsets}}
    path = _write(tmp_path / "x.safetensors", header, b"\0")
    assert "not a pair [begin, end]" in str(_refused(path))


def test_offsets_past_the_data_section_are_refused(tmp_path: Path) -> None:
    """A tensor whose offsets reach past the data section is refused."""
    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    path = _write(tmp_path / "x.safetensors", header, bytes(16))
    message = str(_refused(path))
    assert "tensor 'w' has data_offsets [8, 24], outside the 16-byte data section" in message


def test_begin_after_end_is_refused(tmp_path: Path) -> None:
    """A tensor whose begin offset is past its end is refused."""
    header = {"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 2]}}
    path = _write(tmp_path / "x.safetensors", header, bytes(8))
    assert "data_offsets [4, 2], outside" in str(_refused(path))


def test_length_that_disagrees_with_the_shape_is_refused(tmp_path: Path) -> None:
    """A tensor whose byte length does not match its shape and dtype is refused."""
    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}
    path = _write(tmp_path / "x.safetensors", header, bytes(16))
    message = str(_refused(path))
    assert "tensor 'w' has 8 bytes of data but its shape [4] and dtype F32 need 16" in message


def test_packed_dtype_that_ends_inside_a_byte_is_refused(tmp_path: Path) -> None:
    """A 4-bit tensor with an odd element count (half a byte) is refused."""
    header = {"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}
    path = _write(tmp_path / "x.safetensors", header, bytes(2))
    assert "need 1.5 (not a whole number of) bytes" in str(_refused(path))


def test_overlapping_tensors_are_refused(tmp_path: Path) -> None:
    """Two tensors sharing bytes are refused, naming both and their ranges."""
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
    }
    path = _write(tmp_path / "x.safetensors", header, bytes(20))
    message = str(_refused(path))
    assert "tensor 'b' (bytes 12-20) overlaps the end of tensor 'a' (bytes 0-16)" in message


def test_tensor_inside_another_is_refused(tmp_path: Path) -> None:
    """A tensor lying wholly inside another is refused as an overlap."""
    header = {
        "outer": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
        "inner": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},
    }
    path = _write(tmp_path / "x.safetensors", header, bytes(16))
    assert "overlap" in str(_refused(path))


def test_empty_tensors_sit_between_others_not_inside_them(tmp_path: Path) -> None:
    """Zero-length tensors are accepted at a boundary; one inside another is an invalid offset,
    as the library says.
    """
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "e1": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        "e2": {"dtype": "F32", "shape": [0, 3], "data_offsets": [16, 16]},
    }
    path = _write(tmp_path / "x.safetensors", header, bytes(16))
    assert set(read_header(path).tensors) == {"a", "e1", "e2"}
    header["e1"]["data_offsets"] = [8, 8]
    path = _write(tmp_path / "y.safetensors", header, bytes(16))
    assert "invalid offset: tensor 'e1'" in str(_refused(path))


def test_adjacent_tensors_do_not_overlap(tmp_path: Path) -> None:
    """Tensors that touch end to start, listed out of order, do not overlap."""
    header = {
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
    }
    path = _write(tmp_path / "x.safetensors", header, bytes(8))
    assert read_header(path).tensors["b"] == TensorSpec("U8", (4,), 4, 8)


def test_huge_field_is_shortened_in_the_message(tmp_path: Path) -> None:
    """A huge bad field is shortened in the error message, which stays under 1000 characters."""
    header = {"w": {"dtype": "x" * 10_000, "shape": [1], "data_offsets": [0, 1]}}
    path = _write(tmp_path / "x.safetensors", header, b"\0")
    assert len(str(_refused(path))) < 1000


def test_client_loader_maps_only_dtypes_the_parser_knows() -> None:
    """The client loader maps no dtype the header parser would refuse."""
    assert _tensors._DTYPES.keys() <= DTYPE_BITS.keys()


def test_client_error_is_an_integrity_error_with_path_and_check(tmp_path: Path) -> None:
    """The client loader's error is an IntegrityError naming the file and the check."""
    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}
    path = _write(tmp_path / "x.safetensors", header, bytes(16))
    with pytest.raises(SafetensorsError) as caught:
        _tensors.load_safetensors(path)
    assert isinstance(caught.value, IntegrityError)
    assert (caught.value.path, caught.value.check) == (str(path), CHECK)


def test_client_loader_maps_the_other_eight_bit_dtypes(tmp_path: Path) -> None:
    """The client loader reads the F8_E8M0 and FNUZ 8-bit dtypes as their torch types."""
    raw = torch.arange(0, 250, 10, dtype=torch.uint8)
    dtypes = {
        "e8m0": ("F8_E8M0", torch.float8_e8m0fnu),
        "e4m3fnuz": ("F8_E4M3FNUZ", torch.float8_e4m3fnuz),
        "e5m2fnuz": ("F8_E5M2FNUZ", torch.float8_e5m2fnuz),
    }
    # Written by hand: safetensors' save_file sometimes takes these views for
    # shared storage (its check cannot size these dtypes) and refuses them.
    count = raw.numel()
    header = {
        name: {"dtype": tag, "shape": [count], "data_offsets": [i * count, (i + 1) * count]}
        for i, (name, (tag, _)) in enumerate(dtypes.items())
    }
    encoded = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(raw.tolist()) * len(dtypes))
    loaded = _tensors.load_safetensors(path)
    for name, (_, dtype) in dtypes.items():
        assert loaded[name].dtype == dtype
        assert torch.equal(loaded[name].view(torch.uint8), raw), name


def test_client_loader_refuses_a_packed_dtype_by_name(tmp_path: Path) -> None:
    """The client loader refuses the packed F4 dtype by name instead of misreading it."""
    path = tmp_path / "x.safetensors"
    save_file({"w": torch.zeros(3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, str(path))
    with pytest.raises(SafetensorsError, match="dtype 'F4', which load_safetensors"):
        _tensors.load_safetensors(path)
