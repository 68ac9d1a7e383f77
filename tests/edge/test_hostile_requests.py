"""Hostile input gets a clear code and a bounded, escaped message: undecodable bytes, oversized
fields, control and bidi characters in requests and object keys; the CLI never shows them raw.

The requests the field checks refuse (oversized, control characters, odd numbers, long values
echoed back) change nothing in an agent, so their 27 cases ask one daemon, started once for
the module (``refusing_agent``), which must hold nothing when they are done; the tests that
count log records or make the agent pull start their own.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import grpc
import pytest
from agent_helpers import AgentFactory, RunningAgent, cache_entries
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

from agent._exceptions import MESSAGE_LIMIT, InvalidRequest, quoted
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent.cli import _render as render
from agent.client import Client, FileEntry, LeaseInfo, ModelInfo
from agent.edge.status import DETAIL_BYTES, status_detail
from agent.testing import AgentProcess, S3Server

_SERVICE = pb.DESCRIPTOR.services_by_name["Prewarm"]
_HUGE = "x" * 16384


def _call(agent: RunningAgent, method: str, request: bytes | Message) -> grpc.RpcError:
    """Send ``request`` (a message, or raw bytes) to ``method``; the error it ends with."""
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    streaming = _SERVICE.methods_by_name[method].server_streaming
    path = f"/{_SERVICE.full_name}/{method}"
    with grpc.insecure_channel(agent.target) as channel:
        try:
            # Raw bytes both ways: the payload may be no message at all.
            if streaming:
                stream: Any = channel.unary_stream(path)
                for _ in stream(payload, timeout=30):
                    pass
            else:
                unary: Any = channel.unary_unary(path)
                unary(payload, timeout=30)
        except grpc.RpcError as error:
            return error
    raise AssertionError(f"{method} accepted {payload[:40]!r}")


@pytest.fixture(scope="module")
def refusing_agent(s3_server: S3Server) -> Iterator[AgentProcess]:
    """One daemon for the module's requests that the field checks refuse; it must hold nothing
    after them (no snapshot, no staging, no manifest): sharing it hid no state from a test.

    A subprocess, so the tests that need this process's own in-process agent (log records
    in caplog) still get one."""
    with AgentProcess(env=s3_server.env()) as agent:
        yield agent
        assert cache_entries(agent) == {}
        with Client(agent.socket_path) as client:
            status = client.status()
        assert (status.model_count, status.lease_count, status.pulls) == (0, 0, ())
        assert status.compile_cache_count == 0


def _details(error: grpc.RpcError) -> str:
    assert isinstance(error, grpc.Call)
    return error.details() or ""


def _code(error: grpc.RpcError) -> grpc.StatusCode:
    assert isinstance(error, grpc.Call)
    return error.code()


def test_garbage_bytes_to_every_method_are_invalid_argument_and_one_warning(
    agent_daemon: RunningAgent, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes that are not protobuf, sent 3 times to every RPC: INVALID_ARGUMENT each time, one
    warning in the log in all, no error-level record or traceback, and the agent still answers.
    """
    caplog.set_level(logging.INFO)
    methods = [method.name for method in _SERVICE.methods]
    for method in methods:
        for _ in range(3):
            error = _call(agent_daemon, method, b"\xff\xff\xff\xff not protobuf")
            assert _code(error) == grpc.StatusCode.INVALID_ARGUMENT, (method, _details(error))
            assert "is not a protobuf message of its type" in _details(error)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    warnings = [r for r in caplog.records if "not a protobuf message" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    with Client(agent_daemon.socket_path) as client:
        assert client.status().version


_OVERSIZED: list[tuple[str, Message, str]] = [
    ("EnsureModel", pb.EnsureModelRequest(uri=f"s3://bucket/{_HUGE}"), "uri"),
    ("EnsureModel", pb.EnsureModelRequest(uri="s3://bucket/m/", include=[_HUGE]), "include"),
    ("EnsureModel", pb.EnsureModelRequest(uri="s3://bucket/m/", exclude=["*"] * 1000), "exclude"),
    ("EnsureModel", pb.EnsureModelRequest(uri="s3://bucket/m/", client_name=_HUGE), "client_name"),
    ("GetModel", pb.GetModelRequest(ref=_HUGE), "ref"),
    ("EvictModel", pb.EvictModelRequest(ref=_HUGE), "ref"),
    ("PinModel", pb.PinModelRequest(ref=_HUGE), "ref"),
    ("VerifyModels", pb.VerifyModelsRequest(ref=_HUGE), "ref"),
    ("RenewLease", pb.RenewLeaseRequest(id=_HUGE), "id"),
    ("ReleaseLease", pb.ReleaseLeaseRequest(id=_HUGE), "id"),
    ("EvictCompileCache", pb.EvictCompileCacheRequest(key=_HUGE), "key"),
    ("PushCompileCache", pb.PushCompileCacheRequest(key=_HUGE), "key"),
    (
        "EnsureCompileCache",
        pb.EnsureCompileCacheRequest(parts=pb.CompileKeyParts(engine="vllm", gpu_name=_HUGE)),
        "gpu_name",
    ),
    (
        "CompileLock",
        pb.CompileLockRequest(parts=pb.CompileKeyParts(extras={f"k{i}": "v" for i in range(99)})),
        "extras",
    ),
]


@pytest.mark.parametrize(
    ("method", "request_message", "field"),
    _OVERSIZED,
    ids=[f"{method}.{field}" for method, _, field in _OVERSIZED],
)
def test_an_oversized_field_is_invalid_argument_naming_the_field_and_limit(
    refusing_agent: AgentProcess, method: str, request_message: Message, field: str
) -> None:
    """A 16 KiB string (or too many entries) in any field is INVALID_ARGUMENT naming the field and
    its limit, with a short detail, never RESOURCE_EXHAUSTED from an oversized status.
    """
    error = _call(refusing_agent, method, request_message)
    assert _code(error) == grpc.StatusCode.INVALID_ARGUMENT, _details(error)
    assert f".{field} " in _details(error)
    assert "over the limit of" in _details(error)
    assert len(_details(error)) < 300


@pytest.mark.parametrize(
    ("method", "request_message", "fragment"),
    [
        ("EnsureModel", pb.EnsureModelRequest(uri="s3://bucket/\x1b[2J"), "U+001B (ESC)"),
        ("GetModel", pb.GetModelRequest(ref="a\u202eb"), "U+202E"),
        (
            "EnsureModel",
            pb.EnsureModelRequest(uri="s3://bucket/m/", client_name="\x9b31m"),
            "U+009B",
        ),
        ("RenewLease", pb.RenewLeaseRequest(id="x", ttl_seconds=float("nan")), "finite"),
        (
            "EnsureModel",
            pb.EnsureModelRequest(uri="s3://bucket/m/", lease_ttl_seconds=1e999),
            "finite",
        ),
    ],
    ids=["esc-in-uri", "bidi-in-ref", "c1-in-client-name", "nan-ttl", "infinite-ttl"],
)
def test_control_characters_and_odd_numbers_are_invalid_argument(
    refusing_agent: AgentProcess, method: str, request_message: Message, fragment: str
) -> None:
    """Control or bidi characters in any string field, and non-finite numbers, are refused with
    INVALID_ARGUMENT naming the code point; the detail holds no raw control character.
    """
    error = _call(refusing_agent, method, request_message)
    assert _code(error) == grpc.StatusCode.INVALID_ARGUMENT, _details(error)
    assert fragment in _details(error)
    assert _details(error).isprintable()


def test_the_client_sees_invalid_request_for_a_16_kib_uri(refusing_agent: AgentProcess) -> None:
    """Through the client a 16 KiB URI is InvalidRequest (exit 2 in the CLI), not NoSpace."""
    with Client(refusing_agent.socket_path) as client, pytest.raises(InvalidRequest) as caught:
        client.ensure(f"s3://bucket/{_HUGE}")
    assert "over the limit of 1100 bytes" in str(caught.value)


class _HostileKeys:
    """Puts objects under hostile keys, and deletes them by name before the bucket goes (a
    listing cannot carry an ESC in its XML, so the bucket fixture could not find them)."""

    def __init__(self, client: Any, bucket: str) -> None:
        self._client, self._bucket, self._keys = client, bucket, ["m/config.json"]
        client.put_object(Bucket=bucket, Key="m/config.json", Body=b"{}")

    def put(self, key: str) -> None:
        self._keys.append(key)
        self._client.put_object(Bucket=self._bucket, Key=key, Body=b"x")

    def delete_all(self) -> None:
        for key in self._keys:
            self._client.delete_object(Bucket=self._bucket, Key=key)


@pytest.fixture
def hostile_keys(s3_server: S3Server, bucket: str) -> Iterator[_HostileKeys]:
    """A good object under m/ in ``bucket``, and a way to add hostile ones beside it."""
    client = s3_server.client()
    keys = _HostileKeys(client, bucket)
    yield keys
    keys.delete_all()
    client.close()


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        ("m/\x1b[2Jclear.json", "control character U+001B (ESC)"),
        ("m/evil\u202enosj.txt", "bidi control U+202E"),
        ("m/" + "n" * 300 + ".json", "over the limit of 255 bytes"),
    ],
    ids=["escape-sequence", "bidi-override", "300-byte-name"],
)
def test_a_hostile_object_key_is_invalid_argument_and_nothing_is_cached(
    start_agent: AgentFactory, hostile_keys: _HostileKeys, bucket: str, key: str, fragment: str
) -> None:
    """An object key with ESC, a bidi override or a 300-byte name refuses the pull with
    INVALID_ARGUMENT naming the code point or limit, the key escaped; nothing is cached.
    """
    hostile_keys.put(key)
    agent = start_agent()
    error = _call(agent, "EnsureModel", pb.EnsureModelRequest(uri=f"s3://{bucket}/m/"))
    assert _code(error) == grpc.StatusCode.INVALID_ARGUMENT, _details(error)
    assert fragment in _details(error)
    assert _details(error).isprintable()
    assert cache_entries(agent) == {}


def test_a_status_detail_fits_grpc_metadata_whatever_the_message() -> None:
    """Any message, however long or unprintable, becomes a detail within DETAIL_BYTES once
    percent-encoded as grpc-message is, with control characters escaped.
    """
    for text in ("\u4e2d" * 5000, "%" * 9000, "\x1b[31m" * 3000, "a" * 20000):
        detail = status_detail(InvalidRequest(text))
        assert len(quote(detail, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")) <= DETAIL_BYTES
        assert "\x1b" not in detail


def test_messages_are_capped_and_quotes_are_short() -> None:
    """A message is cut to MESSAGE_LIMIT characters, and quoted() keeps 200 of a value, escaped."""
    assert len(str(InvalidRequest("y" * 50_000))) == MESSAGE_LIMIT
    shown = quoted("\x1b" * 10_000)
    assert len(shown) < 240
    assert "\x1b" not in shown
    assert "(40002 characters)" in shown


def _hostile_model() -> ModelInfo:
    moment = datetime(2026, 1, 1, tzinfo=UTC)
    return ModelInfo(
        uri="s3://b/\x1b]8;;http://evil\x07[link=http://evil]click[/link]\u202e/",
        key="\x1b[2Jabcdef0123456789",
        path=Path("/cache/\x1b[31mred"),
        tier="shm",
        total_bytes=1,
        file_count=1,
        created=moment,
        last_used=moment,
        hit_count=0,
        files=(FileEntry(path="\x1b[1Aup.bin", size=1, etag="\x07bell"),),
        include=("\x9b2J",),
        exclude=(),
        leases=(LeaseInfo("", "ns/\x1b[8mhidden", 1, 0, 0, moment, None, True),),
    )


@pytest.mark.parametrize("view", ["ls", "show"])
def test_the_cli_shows_agent_values_escaped_and_never_as_markup(view: str) -> None:
    """`prewarm ls` and `show` print ESC, BEL, C1 and bidi characters as escapes and rich markup
    in a URI as literal text: nothing from the agent reaches the terminal as a control sequence.
    """
    model = _hostile_model()
    table = render.models_table([model]) if view == "ls" else render.model_detail(model)
    out = io.StringIO()
    Console(file=out, width=400, color_system=None, force_terminal=False).print(table)
    text = out.getvalue()
    for raw in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert raw not in text
    assert "\\x1b" in text
    if view == "show":
        assert "[link=http://evil]click[/link]" in text


def test_the_cli_console_prints_every_string_escaped_and_never_as_markup() -> None:
    """On a colour terminal, the console every command prints with shows a string or a table
    cell holding markup and ESC as literal text: no hyperlink, no cursor movement, no error."""
    out = io.StringIO()
    console = render.InertConsole(file=out, width=400, force_terminal=True, highlight=False)
    table = Table("part")
    table.add_row("[/bold] \x1b[2J")
    console.print("[link=http://evil]click[/link] \x1b]8;;http://evil\x07x")
    console.print(table)
    text = out.getvalue()
    assert "[link=http://evil]click[/link]" in text
    assert "[/bold]" in text
    assert "\x1b]8" not in text
    assert "\x1b[2J" not in text
    assert "\\x1b[2J" in text


_LONG_PART = "a" * 250
_LONG_URI = "s3://no-such-bucket-echo/" + "/".join([_LONG_PART] * 3) + "/"
_SPACED_URI = "s3://no-such-bucket-echo/" + "/".join([" ".join(["w" * 40] * 5)] * 4) + "/"
_ECHOES = [
    ("EnsureModel", pb.EnsureModelRequest(uri=_LONG_URI)),
    ("EnsureModel", pb.EnsureModelRequest(uri=_LONG_URI, cached_only=True)),
    ("GetModel", pb.GetModelRequest(ref=_LONG_URI)),
    ("EvictModel", pb.EvictModelRequest(ref=_LONG_URI)),
    ("PinModel", pb.PinModelRequest(ref=_LONG_URI, pinned=True)),
    ("GetModel", pb.GetModelRequest(ref="z" * 1000)),
    ("EnsureModel", pb.EnsureModelRequest(uri=_SPACED_URI, cached_only=True)),
]


@pytest.mark.parametrize(
    ("method", "request_message"),
    _ECHOES,
    ids=["ensure", "cached-only", "get", "evict", "pin", "bad-ref", "spaced-uri"],
)
def test_a_value_under_its_field_limit_is_echoed_cut_to_200_characters(
    refusing_agent: AgentProcess, method: str, request_message: Message
) -> None:
    """A URI or ref within its 1,100-byte limit but over 200 characters is quoted in the error
    cut to 200 characters and marked with its length, whichever RPC repeats it and even when it
    holds spaces; no 201 characters of the caller's value come back in a row.
    """
    error = _call(refusing_agent, method, request_message)
    detail = _details(error)
    for field in request_message.DESCRIPTOR.fields:
        value = getattr(request_message, field.name)
        if isinstance(value, str) and len(value) > 200:
            assert value[:201] not in detail, detail
            assert value[:150] in detail, detail
            assert re.search(r"\u2026 \(\d+ characters\)", detail), detail
