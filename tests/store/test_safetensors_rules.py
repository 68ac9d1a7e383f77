"""The safetensors header check agrees with the safetensors library, and hostile headers get
DATA_LOSS (IntegrityError) with a clear message, never a RecursionError or ValueError."""

from __future__ import annotations

import json
import struct
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors._safetensors_rust import deserialize

from agent import IntegrityError
from agent.check.safetensors import CHECK, DTYPE_BITS, parse_header

_DTYPES = ("U8", "F16", "F32", "F4", "F6_E2M3", "BOOL", "I64")


def _file(header: bytes | dict[str, Any], data: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _ours(blob: bytes) -> str | None:
    """None when our check accepts the file, else its message."""
    try:
        parse_header(blob, len(blob), path="x.safetensors")
    except IntegrityError as exc:
        return str(exc) if exc.check == CHECK else f"wrong check {exc.check!r}: {exc}"
    return None


def _library(blob: bytes) -> str | None:
    """None when the safetensors library accepts the file, else its message."""
    try:
        deserialize(blob)
    except Exception as exc:  # the library raises SafetensorError
        return str(exc)
    return None


def test_a_gap_with_trailing_bytes_is_an_invalid_offset_as_in_the_library() -> None:
    """The published-but-unloadable file of issue 11: a gap between tensors, made up by trailing
    bytes, is refused with "invalid offset", as the library refuses it.
    """
    header = {
        "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
        "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]},
    }
    blob = _file(header, bytes(8))
    assert "invalid offset" in (_library(blob) or "")
    message = _ours(blob)
    assert message is not None
    assert "invalid offset: tensor 'b' (bytes 4-6) leaves a gap after the end of tensor 'a'" in (
        message
    )


def test_bytes_after_the_last_tensor_are_refused() -> None:
    """A data section longer than the last tensor's end is refused, naming the spare bytes."""
    header = {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}
    blob = _file(header, bytes(5))
    assert _library(blob) is not None
    assert "3 bytes after them belong to no tensor" in (_ours(blob) or "")


def test_a_first_tensor_that_does_not_start_at_zero_is_refused() -> None:
    """The data section must begin with a tensor: a leading gap is an invalid offset."""
    header = {"a": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}
    blob = _file(header, bytes(3))
    assert _library(blob) is not None
    assert "after the start of the data section" in (_ours(blob) or "")


def test_a_header_nested_100k_deep_is_data_loss_not_a_recursion_error() -> None:
    """100,000 nested arrays in the header give IntegrityError saying it is nested too deep."""
    header = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "nested too deep" in (_ours(_file(header, b"")) or "")


def test_a_5000_digit_integer_is_data_loss_not_a_value_error() -> None:
    """A 5,000-digit offset gives IntegrityError naming the digit count, not Python's int limit."""
    header = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,' + b"9" * 5000 + b"]}}"
    message = _ours(_file(header, b"x")) or ""
    assert "an integer of 5000 digits" in message
    assert "9999" not in message


def test_a_million_huge_dimensions_are_refused_at_once() -> None:
    """A shape whose element count overflows 64 bits is refused at the first overflow, fast."""
    shape = ",".join(["18446744073709551615"] * 1_000_000)
    header = ('{"a":{"dtype":"U8","shape":[' + shape + '],"data_offsets":[0,0]}}').encode()
    started = time.monotonic()
    message = _ours(_file(header, b"")) or ""
    assert "does not fit in 64 bits" in message
    assert time.monotonic() - started < 5


def test_a_size_that_overflows_before_a_zero_dimension_is_refused_like_the_library() -> None:
    """[2**63, 4, 0] overflows while multiplying although the product is 0: both refuse it."""
    header = {"a": {"dtype": "U8", "shape": [2**63, 4, 0], "data_offsets": [0, 0]}}
    blob = _file(header, b"")
    assert "overflow" in (_library(blob) or "")
    assert "does not fit in 64 bits" in (_ours(blob) or "")


def test_null_metadata_is_no_metadata_as_in_the_library() -> None:
    """`"__metadata__": null` is accepted as no metadata, like the library does."""
    header = {"__metadata__": None, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    blob = _file(header, b"x")
    assert _library(blob) is None
    assert _ours(blob) is None


@st.composite
def _headers(draw: st.DrawFn) -> bytes:
    """Tensor tables that are mostly well formed, then nudged: an offset, a size or the data
    section's length off by a little, or the order shuffled."""
    count = draw(st.integers(0, 4))
    header: dict[str, Any] = {}
    offset = 0
    for index in range(count):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        elements = 1
        for dimension in shape:
            elements *= dimension
        nbytes = elements * DTYPE_BITS[dtype] // 8
        begin = offset + draw(st.sampled_from((0, 0, 0, 1, -1)))
        end = begin + nbytes + draw(st.sampled_from((0, 0, 0, 1, -1)))
        header[f"t{index}"] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        offset = max(offset, end)
    names = draw(st.permutations(list(header)))
    shuffled = {name: header[name] for name in names}
    data_size = max(0, offset + draw(st.sampled_from((0, 0, 1, -1, 3))))
    return _file(shuffled, bytes(data_size))


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(blob=_headers())
def test_our_verdict_is_the_librarys_on_nudged_headers(blob: bytes) -> None:
    """On 400 generated headers, our check accepts exactly the files the library accepts."""
    ours, library = _ours(blob), _library(blob)
    assert (ours is None) == (library is None), (ours, library)
