"""load_safetensors maps files written by the real safetensors library, without copying."""

from __future__ import annotations

import gc
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from agent.client import ModelHandle, NotFound, PhaseTimings, SafetensorsError, load_safetensors


def _sample() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=gen)
    return {
        "f64": base.double(),
        "f32": base,
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "i64": torch.arange(-5, 7, dtype=torch.int64).reshape(3, 4),
        "i32": torch.arange(10, dtype=torch.int32),
        "i16": torch.arange(-3, 3, dtype=torch.int16),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8).reshape(16, 16),
        "bool": torch.tensor([[True, False], [False, True]]),
        "f8_e4m3": base.to(torch.float8_e4m3fn),
        "f8_e5m2": base.to(torch.float8_e5m2),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 8),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch.equal has no float8 kernel on the CPU; the bytes say the same thing.
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _mappings_of(path: Path) -> list[tuple[int, int, str]]:
    """(start, end, perms) of every mapping of ``path`` in this process."""
    target = os.path.realpath(path)
    found = []
    with Path("/proc/self/maps").open() as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == target:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end, fields[1]))
    return found


def _write_raw(path: Path, header: object, data: bytes, length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(_sample(), str(path), metadata={"format": "pt"})
    return path


def test_values_match_what_was_saved_for_every_dtype(model_file: Path) -> None:
    """Every saved tensor, of every dtype, loads with the same values."""
    loaded = load_safetensors(model_file)
    expected = _sample()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert _same(loaded[name], tensor), name


def test_values_match_the_safetensors_library(model_file: Path) -> None:
    """load_safetensors agrees with the safetensors library on names and values."""
    ours = load_safetensors(model_file)
    theirs = load_file(str(model_file))
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert _same(ours[name], theirs[name]), name


def test_every_tensor_points_into_a_private_mapping_of_its_file(model_file: Path) -> None:
    """Each non-empty tensor's data lies inside a private (copy-on-write) mapping of the file."""
    loaded = load_safetensors(model_file)
    mappings = _mappings_of(model_file)
    assert mappings, "the file is not mapped"
    for name, tensor in loaded.items():
        if tensor.numel() == 0:
            continue
        first, last = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
        inside = [m for m in mappings if m[0] <= first and last <= m[1]]
        assert inside, f"{name} at {first:#x} is not inside a mapping of {model_file}"
        assert inside[0][2][3] == "p", f"{name} is in a shared mapping: {inside[0][2]}"


def test_zero_size_tensor_keeps_its_shape_and_dtype(model_file: Path) -> None:
    """A zero-element tensor loads with its shape and dtype."""
    empty = load_safetensors(model_file)["empty"]
    assert empty.shape == (0, 8)
    assert empty.dtype == torch.float32


def test_writing_to_a_tensor_changes_neither_the_file_nor_a_second_load(model_file: Path) -> None:
    """Writing into a loaded tensor changes neither the file nor what a second load reads."""
    before = model_file.read_bytes()
    first = load_safetensors(model_file)
    first["f32"].fill_(42.0)
    assert model_file.read_bytes() == before
    assert _same(load_safetensors(model_file)["f32"], _sample()["f32"])


def test_mapping_lives_as_long_as_a_tensor_and_no_longer(model_file: Path) -> None:
    """The file stays mapped while any view of one of its tensors lives, and no longer."""
    kept = load_safetensors(model_file)["u8"][3]
    gc.collect()
    # Only one row of one tensor is left, and it still reads the file's bytes.
    assert _mappings_of(model_file)
    assert kept.tolist() == list(range(48, 64))
    del kept
    gc.collect()
    assert _mappings_of(model_file) == []


def test_directory_loads_every_file_recursively(tmp_path: Path) -> None:
    """A directory loads the tensors of every .safetensors file below it, subfolders included."""
    (tmp_path / "sub").mkdir()
    save_file({"a": torch.ones(3)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(2, 2)}, str(tmp_path / "sub" / "model-00002.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    loaded = load_safetensors(tmp_path)
    assert sorted(loaded) == ["a", "b"]
    assert _same(loaded["b"], torch.zeros(2, 2))


def test_model_handle_is_loaded_from_its_path(model_file: Path) -> None:
    """A ModelHandle is loaded from its path."""
    handle = ModelHandle(
        uri="s3://bucket/model/",
        key="k",
        path=model_file.parent,
        tier="disk",
        hit=True,
        files=(),
        total_bytes=model_file.stat().st_size,
        timings=PhaseTimings(0, 0, 0, 0, 0, 0),
        resolved_offline=False,
    )
    assert "bf16" in load_safetensors(handle)


def test_same_tensor_name_in_two_files_is_refused(tmp_path: Path) -> None:
    """A tensor name found in two files is refused rather than one silently winning."""
    save_file({"w": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(1)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(SafetensorsError, match="'w' is in both"):
        load_safetensors(tmp_path)


def test_directory_without_safetensors_is_refused(tmp_path: Path) -> None:
    """A directory with no .safetensors file is a SafetensorsError."""
    with pytest.raises(SafetensorsError, match=r"no \*\.safetensors file"):
        load_safetensors(tmp_path)


def test_missing_path_is_not_found(tmp_path: Path) -> None:
    """A path that does not exist is NotFound."""
    with pytest.raises(NotFound, match="does not exist"):
        load_safetensors(tmp_path / "nope")


def test_truncated_file_is_refused(model_file: Path) -> None:
    """A truncated file is refused: tensor offsets fall outside the data section."""
    data = model_file.read_bytes()
    model_file.write_bytes(data[: len(data) - 10])
    with pytest.raises(SafetensorsError, match=r"outside the .*data section"):
        load_safetensors(model_file)


def test_file_shorter_than_the_length_field_is_refused(tmp_path: Path) -> None:
    """A file shorter than the 8-byte header length field is refused as too short."""
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(SafetensorsError, match="too short"):
        load_safetensors(path)


def test_header_length_beyond_the_file_is_refused(tmp_path: Path) -> None:
    """A header length field larger than the file is refused."""
    path = _write_raw(tmp_path / "x.safetensors", {}, b"", length=1 << 40)
    with pytest.raises(SafetensorsError, match="header length field"):
        load_safetensors(path)


def test_header_that_is_not_json_is_refused(tmp_path: Path) -> None:
    """A header that is not valid JSON is refused."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"\xff{[}")
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        load_safetensors(path)


def test_offsets_past_the_data_section_are_refused(tmp_path: Path) -> None:
    """Data offsets past the end of the data section are refused."""
    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    path = _write_raw(tmp_path / "x.safetensors", header, bytes(16))
    with pytest.raises(SafetensorsError, match="outside the 16-byte data section"):
        load_safetensors(path)


def test_offsets_that_disagree_with_the_shape_are_refused(tmp_path: Path) -> None:
    """Data offsets whose span differs from shape times dtype size are refused."""
    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}
    path = _write_raw(tmp_path / "x.safetensors", header, bytes(16))
    with pytest.raises(SafetensorsError, match="need 16"):
        load_safetensors(path)


def test_unknown_dtype_is_refused(tmp_path: Path) -> None:
    """A dtype the loader does not know is refused by name."""
    header = {"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}
    path = _write_raw(tmp_path / "x.safetensors", header, bytes(8))
    with pytest.raises(SafetensorsError, match="dtype 'C64'"):
        load_safetensors(path)


def test_negative_dimension_is_refused(tmp_path: Path) -> None:
    """A negative dimension in a shape is refused."""
    header = {"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}
    path = _write_raw(tmp_path / "x.safetensors", header, b"")
    with pytest.raises(SafetensorsError, match="shape"):
        load_safetensors(path)
