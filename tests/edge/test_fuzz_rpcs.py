"""Property-based fuzzing of every RPC against the running daemon: whatever the fields hold
(huge, empty, control characters, any unicode, extreme numbers), each call ends with a status
code the error tree names, never UNKNOWN or INTERNAL, and the daemon stays healthy.

Deterministic (derandomize), so CI runs the same inputs each time: --fuzz-examples of them,
600 in `make test` (seconds), 6,000 in `make fuzz` (about a minute), run before a release.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import grpc
import pytest
from agent_helpers import RunningAgent
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent.client import Client

pytestmark = pytest.mark.slow

_SERVICE = pb.DESCRIPTOR.services_by_name["Prewarm"]
# The codes the error tree answers with (agent._exceptions), plus the ends of a stream we cut.
_KNOWN = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.CANCELLED,
}
# (method, code) of every call made, for the closing line.
_FUZZED: list[tuple[str, str]] = []

# Strings a hostile or buggy client would send: plausible values, their near misses, and junk.
_PLAUSIBLE = st.sampled_from(
    [
        "",
        "s3://bucket/m/",
        "s3://fuzz-bucket/model/",
        "s3://bucket/../etc/",
        "s3://bucket/m/?versionId=1",
        "0123456789abcdef0123456789abcdef",
        "01234567",
        "*.safetensors",
        "[",
        "**",
        "vllm",
        "torch",
        "/",
        "..",
        "%00",
    ]
)
_CONTROL = st.text(alphabet=st.characters(codec="utf-8", categories=["Cc", "Cf"]), max_size=8)
# Mostly plausible, so that many requests get past the field checks into the service.
_STRINGS = st.one_of(
    _PLAUSIBLE,
    _PLAUSIBLE,
    _PLAUSIBLE,
    st.text(max_size=64),
    _PLAUSIBLE.flatmap(lambda base: _CONTROL.map(lambda junk: base + junk)),
    st.integers(200, 20_000).map(lambda n: "s3://bucket/" + "a" * n),
)
_DOUBLES = st.one_of(
    st.sampled_from([0.0, -0.0, -1.0, 1e-300, 1e300, float("nan"), float("inf"), -float("inf")]),
    st.floats(allow_nan=True, allow_infinity=True),
)
_INTS = {
    FieldDescriptor.TYPE_INT32: st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-2, 64)),
    FieldDescriptor.TYPE_INT64: st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-2, 2**30)),
}


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.message_type is not None:
        return _message(field.message_type, depth + 1)
    if field.type == FieldDescriptor.TYPE_STRING:
        return _STRINGS
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return _DOUBLES
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.integers(-3, 12)
    return _INTS.get(field.type, st.integers(-(2**31), 2**31 - 1))


def _message(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments for ``descriptor``'s message: any subset of its fields, any values."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            fields[field.name] = st.dictionaries(
                _STRINGS, _value(entry.fields_by_name["value"], depth), max_size=70
            )
        elif field.is_repeated:
            fields[field.name] = st.one_of(
                st.lists(_value(field, depth), max_size=4),
                st.integers(0, 400).map(lambda n: ["*"] * n),
            )
        elif field.type != FieldDescriptor.TYPE_MESSAGE or depth < 2:
            fields[field.name] = _value(field, depth)
    return st.fixed_dictionaries({}, optional=fields)


@st.composite
def _calls(draw: st.DrawFn) -> tuple[str, bytes]:
    method = draw(st.sampled_from([m.name for m in _SERVICE.methods]))
    descriptor = _SERVICE.methods_by_name[method].input_type
    request_type = getattr(pb, descriptor.name)
    message: Message = request_type(**_build(descriptor, draw(_message(descriptor))))
    return method, message.SerializeToString()


def _build(descriptor: Descriptor, values: dict[str, Any]) -> dict[str, Any]:
    # Nested messages are drawn as dicts; turn them into their types.
    built: dict[str, Any] = {}
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        entry = field.message_type
        if entry is not None and not entry.GetOptions().map_entry and isinstance(value, dict):
            built[name] = getattr(pb, entry.name)(**_build(entry, value))
        else:
            built[name] = value
    return built


def _code_of(agent: RunningAgent, method: str, payload: bytes) -> grpc.StatusCode:
    """Call ``method``; EnsureModel is read to its end, CompileLock cut at its first event (a
    granted lock is held until the caller goes)."""
    path = f"/{_SERVICE.full_name}/{method}"
    with grpc.insecure_channel(agent.target) as channel:
        try:
            if _SERVICE.methods_by_name[method].server_streaming:
                streaming: Any = channel.unary_stream(path)
                stream = streaming(payload, timeout=20)
                for _ in stream:
                    if method == "CompileLock":
                        stream.cancel()
                        break
            else:
                unary: Any = channel.unary_unary(path)
                unary(payload, timeout=20)
        except grpc.RpcError as error:
            call: Any = error  # the error of a call is also its grpc.Call
            code: grpc.StatusCode = call.code()
            details = call.details() or ""
            assert code in _KNOWN, f"{method} {payload[:200]!r} -> {code}: {details}"
            # The agent's own answer, not the transport's (an oversized status is "Stream removed").
            assert code == grpc.StatusCode.CANCELLED or "Stream removed" not in details, details
            return code
    return grpc.StatusCode.OK


def test_every_rpc_answers_fuzzed_fields_with_a_known_code(
    agent_daemon: RunningAgent, fuzz_examples: int
) -> None:
    """--fuzz-examples generated requests (make fuzz: 6,000) across all RPCs: each ends OK or
    with a code of the error tree (never UNKNOWN, INTERNAL or a timeout), every RPC is called,
    and Status still answers afterwards.
    """
    started = time.monotonic()

    @settings(
        max_examples=fuzz_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(call=_calls())
    def fuzz(call: tuple[str, bytes]) -> None:
        method, payload = call
        _FUZZED.append((method, _code_of(agent_daemon, method, payload).name))

    fuzz()
    with Client(agent_daemon.socket_path) as client:
        assert client.status().version
    seconds = time.monotonic() - started
    codes = Counter(code for _, code in _FUZZED)
    methods = {method for method, _ in _FUZZED}
    print(f"fuzzed {len(_FUZZED)} calls over {len(methods)} RPCs in {seconds:.1f} s: {codes}")
    assert len(methods) == len(_SERVICE.methods)
