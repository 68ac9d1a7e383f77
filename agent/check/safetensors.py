"""Parse and validate a safetensors header, with the standard library only.

The format is an 8-byte little-endian header length N, N bytes of UTF-8 JSON
(tensor name -> dtype, shape, data_offsets relative to the data section, plus
an optional ``__metadata__`` str -> str map), then the data section. A file
that passes ``read_header`` can be mapped tensor by tensor without reading
outside the file or aliasing two tensors' bytes; it says nothing about the
values themselves (that is the content hash's job). The rules are the
safetensors library's own (0.8), so a file published here is one the library
loads: sorted by offsets, the tensors tile the data section from its first byte
to its last, with no gap, no overlap and nothing after the last tensor, and
every size fits in 64 bits. (Stricter in one place: a tensor named twice is
refused, where the library keeps one of the two silently.)

Both the agent (before publishing a snapshot) and the client's
``load_safetensors`` use this module, so it must import nothing outside the
standard library: the client runs in pods that have no xxhash, numpy or torch.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NoReturn

from agent._exceptions import IntegrityError

__all__ = [
    "CHECK",
    "DTYPE_BITS",
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "TensorSpec",
    "parse_header",
    "read_header",
]

# The value of IntegrityError.check for every failure raised here.
CHECK = "safetensors-header"

# The safetensors library's own cap (100 MB, decimal): it refuses larger headers
# too, so a bigger length field means a corrupt or foreign file, and checking it
# first keeps a flipped high bit from making us read gigabytes.
MAX_HEADER_BYTES = 100_000_000

# Every dtype the safetensors library (0.8) reads and writes, in bits per element.
# Sizes are in bits because F4 and F6 pack several elements per byte; a tensor's
# byte length is count * bits / 8, which must come out whole (the library's rule).
DTYPE_BITS: Mapping[str, int] = MappingProxyType(
    {
        "BOOL": 8,
        "F4": 4,
        "F6_E2M3": 6,
        "F6_E3M2": 6,
        "U8": 8,
        "I8": 8,
        "F8_E5M2": 8,
        "F8_E4M3": 8,
        "F8_E8M0": 8,
        "F8_E4M3FNUZ": 8,
        "F8_E5M2FNUZ": 8,
        "I16": 16,
        "U16": 16,
        "F16": 16,
        "BF16": 16,
        "I32": 32,
        "U32": 32,
        "F32": 32,
        "C64": 64,
        "F64": 64,
        "I64": 64,
        "U64": 64,
    }
)

_LENGTH_FIELD = 8
_METADATA_KEY = "__metadata__"
# Offsets and shapes are usize in the library; anything larger is refused there.
_MAX_COUNT = 2**64 - 1
# The most digits a JSON integer may have before it is even converted: 2**64 has
# 20, and converting a 5,000-digit literal is refused by Python (and slow).
_MAX_INT_DIGITS = 20


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor's entry; ``begin``/``end`` are byte offsets into the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """The tensor's size in the data section, in bytes."""
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A validated header; ``data_start`` is the file offset of the data section."""

    header_length: int
    data_start: int
    data_size: int
    tensors: Mapping[str, TensorSpec]
    metadata: Mapping[str, str]


def read_header(
    file: int | str | os.PathLike[str],
    *,
    size: int | None = None,
    path: str | None = None,
) -> SafetensorsHeader:
    """Read and validate the header of a file given by path or open descriptor.

    ``size`` is the file's size (``fstat`` when omitted): the puller passes the
    size the listing promised, so a short file fails here too. ``path`` names
    the file in errors (defaults to ``file`` itself when that is a path). Reads
    only the header, with ``pread``, so a descriptor's offset is left alone.
    """
    if isinstance(file, int):
        return _read_fd(file, size, path if path is not None else f"<fd {file}>")
    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_fd(fd, size, path if path is not None else os.fspath(file))
    finally:
        os.close(fd)


def parse_header(
    buffer: bytes | bytearray | memoryview | mmap.mmap, size: int, *, path: str
) -> SafetensorsHeader:
    """Validate the header at the start of ``buffer`` for a file of ``size`` bytes.

    ``buffer`` is anything sliceable to bytes that holds at least the length
    field and the header (an ``mmap`` of the whole file does); the data section
    need not be in it.
    """
    length = _header_length(bytes(buffer[:_LENGTH_FIELD]), size, path)
    return _parse(bytes(buffer[_LENGTH_FIELD : _LENGTH_FIELD + length]), size, path)


def _read_fd(fd: int, size: int | None, path: str) -> SafetensorsHeader:
    if size is None:
        size = os.fstat(fd).st_size
    length = _header_length(_pread_exact(fd, min(size, _LENGTH_FIELD), 0), size, path)
    raw = _pread_exact(fd, length, _LENGTH_FIELD)
    if len(raw) < length:
        # The file is shorter than ``size`` said (the caller's size is a promise).
        _fail(path, f"the file ends {length - len(raw)} bytes into its {length}-byte header")
    return _parse(raw, size, path)


def _pread_exact(fd: int, count: int, offset: int) -> bytes:
    parts: list[bytes] = []
    while count > 0:
        part = os.pread(fd, count, offset)
        if not part:
            break
        parts.append(part)
        count -= len(part)
        offset += len(part)
    return b"".join(parts)


def _header_length(field: bytes, size: int, path: str) -> int:
    if size < _LENGTH_FIELD or len(field) < _LENGTH_FIELD:
        _fail(
            path,
            f"the file is {min(size, len(field))} bytes long, too short for a safetensors file "
            "(it is truncated or not safetensors)",
        )
    length = int.from_bytes(field, "little")
    if length > MAX_HEADER_BYTES:
        _fail(
            path,
            f"the header length field says {length} bytes, more than the format's "
            f"{MAX_HEADER_BYTES}-byte cap (the file is corrupt or not safetensors)",
        )
    if length > size - _LENGTH_FIELD:
        _fail(
            path,
            f"the header length field says {length} bytes but the file holds "
            f"{size - _LENGTH_FIELD} after it (the file is truncated or not safetensors)",
        )
    return length


def _parse(raw: bytes, size: int, path: str) -> SafetensorsHeader:
    length = len(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _fail(path, f"the header is not valid JSON: it is not UTF-8 ({exc})", exc)
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_int=_bounded_int)
    except RecursionError as exc:
        # Hostile headers nest arrays thousands deep; no real header nests past 3.
        _fail(path, "the header is not a safetensors header: its JSON is nested too deep", exc)
    except ValueError as exc:  # JSONDecodeError, a duplicate key, an oversized integer
        _fail(path, f"the header is not valid JSON ({str(exc)[:200]})", exc)
    if not isinstance(header, dict):
        _fail(path, f"the header is a JSON {type(header).__name__}, not a JSON object")

    data_start = _LENGTH_FIELD + length
    data_size = size - data_start
    # The library reads `"__metadata__": null` as no metadata.
    metadata = _metadata(path, header.pop(_METADATA_KEY, None) or {})
    tensors = {name: _tensor(path, name, entry, data_size) for name, entry in header.items()}
    _check_contiguous(path, tensors, data_size)
    return SafetensorsHeader(
        header_length=length,
        data_start=data_start,
        data_size=data_size,
        tensors=MappingProxyType(tensors),
        metadata=MappingProxyType(metadata),
    )


class _DuplicateKeyError(ValueError):
    pass


def _bounded_int(literal: str) -> int:
    digits = len(literal.lstrip("-"))
    if digits > _MAX_INT_DIGITS:
        raise ValueError(
            f"an integer of {digits} digits, more than any 64-bit size or offset can have"
        )
    return int(literal)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys; two entries for one tensor
    # name is a corrupt header, not something to resolve silently.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(f"the key {key!r} appears twice")
        result[key] = value
    return result


def _metadata(path: str, value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        _fail(path, f"__metadata__ is {_short(value)}, not a JSON object of strings to strings")
    return value


def _tensor(path: str, name: str, entry: object, data_size: int) -> TensorSpec:
    where = f"tensor {name!r}"
    if not isinstance(entry, dict):
        _fail(path, f"{where} is described by {_short(entry)}, not a JSON object")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        _fail(
            path,
            f"{where} has dtype {_short(dtype)}, which is not a safetensors dtype "
            f"(known: {', '.join(DTYPE_BITS)})",
        )
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        _fail(path, f"{where} has shape {_short(shape)}, not a list of sizes >= 0")
    offsets = entry.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        _fail(
            path,
            f"{where} has data_offsets {_short(offsets)}, not a pair [begin, end] of ints >= 0",
        )
    begin, end = offsets
    if not begin <= end <= data_size:
        _fail(
            path,
            f"{where} has data_offsets {offsets!r}, outside the {data_size}-byte data "
            "section (the file is truncated or corrupt)",
        )
    bits = _bit_size(shape, DTYPE_BITS[dtype])
    if bits is None:
        _fail(path, f"{where} has shape {_short(shape)}, whose size does not fit in 64 bits")
    if bits % 8 or end - begin != bits // 8:
        need = f"{bits // 8}" if bits % 8 == 0 else f"{bits / 8} (not a whole number of)"
        _fail(
            path,
            f"{where} has {end - begin} bytes of data but its shape {shape} and dtype "
            f"{dtype} need {need} bytes",
        )
    return TensorSpec(dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _check_contiguous(path: str, tensors: dict[str, TensorSpec], data_size: int) -> None:
    # The library's rule: sorted by (begin, end), each tensor begins exactly where
    # the one before ended (the first at 0), and the last ends at the end of the
    # data section. A gap could hide bytes no tensor accounts for; an overlap
    # would alias two tensors; trailing bytes mean a truncated or spliced file.
    end = 0
    previous: tuple[str, TensorSpec] | None = None
    for name, spec in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if spec.begin != end:
            if previous is None:
                after = "the start of the data section"
            else:
                after = f"the end of tensor {previous[0]!r} (bytes {previous[1].begin}-{end})"
            kind = "overlaps" if spec.begin < end else "leaves a gap after"
            _fail(
                path,
                f"invalid offset: tensor {name!r} (bytes {spec.begin}-{spec.end}) {kind} "
                f"{after}; tensors must tile the data section in order",
            )
        end = spec.end
        previous = (name, spec)
    if end != data_size:
        _fail(
            path,
            f"the tensors end at byte {end} of the {data_size}-byte data section: "
            f"{data_size - end} bytes after them belong to no tensor "
            "(the file is corrupt or has data appended)",
        )


def _bit_size(shape: list[int], bits_per_element: int) -> int | None:
    # Folded the library's way (checked multiplication, in order): it refuses an
    # overflow even when a later dimension is 0, and stopping at the first
    # overflow keeps a header of a million huge dimensions from costing seconds.
    elements = 1
    for dimension in shape:
        elements *= dimension
        if elements > _MAX_COUNT:
            return None
    bits = elements * bits_per_element
    return bits if bits <= _MAX_COUNT else None


def _is_count(value: object) -> bool:
    # bool is an int subclass; `true` is not a size.
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT


def _short(value: object, limit: int = 80) -> str:
    # A corrupt header can hold megabytes in one field; keep messages readable.
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _fail(path: str, what: str, cause: BaseException | None = None) -> NoReturn:
    raise IntegrityError(f"{path}: {what}.", path=path, check=CHECK) from cause
