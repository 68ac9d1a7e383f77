"""The client over a real Unix socket: status codes to the error tree, stream handling.

The server here is a stand-in that answers what the test asks for; the
behaviour under test is the client's (tests/test_cli.py runs the real agent).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc
from agent.client import (
    AccessDenied,
    AgentUnavailable,
    AsyncClient,
    Client,
    Conflict,
    FileProblem,
    IntegrityError,
    InvalidRequest,
    LeaseGrant,
    LeaseInfo,
    NoSpace,
    NotFound,
    PrewarmError,
    Progress,
    SourceChanged,
    SourceUnavailable,
    Verification,
    aensure,
    ensure,
)

T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


def _ts(moment: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def _lease_infos() -> list[pb.LeaseInfo]:
    # One lease held open by root (uid 0 is a real uid), one timed and not held.
    return [
        pb.LeaseInfo(
            id="held-1", client_name="ns/pod", pid=42, uid=0, gid=0, acquired=_ts(T0), held=True
        ),
        pb.LeaseInfo(id="timed-1", client_name="batch", acquired=_ts(T0), expires=_ts(T0)),
    ]


class _Scripted(pb_grpc.PrewarmServicer):
    """``uri``/``ref``/``id`` "fail:CODE" aborts with CODE; "s3://b/nohandle/" ends without
    a handle. ``ensure_requests`` keeps what EnsureModel received."""

    def __init__(self) -> None:
        self.ensure_requests: list[pb.EnsureModelRequest] = []

    def EnsureModel(self, request: pb.EnsureModelRequest, context: Any) -> Iterator[Any]:
        self.ensure_requests.append(request)
        _maybe_abort(request.uri, context)
        for done in (0, 50, 100):
            yield pb.EnsureModelEvent(
                progress=pb.Progress(
                    phase=pb.PHASE_DOWNLOAD, bytes_done=done, bytes_total=100, key="k1"
                )
            )
        if request.uri == "s3://b/nohandle/":
            return
        yield pb.EnsureModelEvent(
            handle=pb.ModelHandle(
                uri=request.uri,
                key="k1",
                path="/cache/k1",
                tier=pb.TIER_DISK if request.tier == pb.TIER_DISK else pb.TIER_SHM,
                total_bytes=100,
                files=[pb.FileEntry(path="model.safetensors", size=100, etag='"e"')],
                timings=pb.PhaseTimings(download_seconds=0.5, total_seconds=0.75),
                resumed_bytes=40,
                lease=pb.Lease(
                    id=f"lease-{request.client_name}",
                    key="k1",
                    expires=_ts(T0),
                    socket_path="/run/prewarm/lease.sock",
                )
                if request.lease
                else None,
            )
        )

    def GetModel(self, request: pb.GetModelRequest, context: Any) -> pb.ModelInfo:
        _maybe_abort(request.ref, context)
        return pb.ModelInfo(
            uri="s3://b/m/",
            key=request.ref,
            tier=pb.TIER_SHM,
            hit_count=3,
            leases=_lease_infos(),
            pinned=True,
        )

    def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        return pb.ListModelsResponse()

    def EvictModel(self, request: pb.EvictModelRequest, context: Any) -> pb.EvictModelResponse:
        _maybe_abort(request.ref, context)
        if not request.force:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.ref} is leased")
        return pb.EvictModelResponse(
            evicted=[pb.ModelInfo(uri="s3://b/m/", key=request.ref, tier=pb.TIER_SHM)],
            bytes_freed=100,
        )

    def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        return pb.StatusResponse(
            version="9.9.9",
            default_tier=pb.TIER_SHM,
            lease_count=2,
            tiers=[
                pb.TierStatus(
                    tier=pb.TIER_DISK,
                    root="/var/lib/prewarm",
                    budget_bytes=1000,
                    reserve_bytes=50,
                    staging_bytes=7,
                    leased_count=2,
                    pinned_count=1,
                )
            ],
        )

    def RenewLease(self, request: pb.RenewLeaseRequest, context: Any) -> pb.Lease:
        _maybe_abort(request.id, context)
        expires = T0.timestamp() + (request.ttl_seconds or 60)
        return pb.Lease(
            id=request.id,
            key="k1",
            expires=_ts(datetime.fromtimestamp(expires, UTC)),
            socket_path="/run/prewarm/lease.sock",
        )

    def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: Any
    ) -> pb.ReleaseLeaseResponse:
        _maybe_abort(request.id, context)
        return pb.ReleaseLeaseResponse()

    def PinModel(self, request: pb.PinModelRequest, context: Any) -> pb.ModelInfo:
        _maybe_abort(request.ref, context)
        return pb.ModelInfo(
            uri="s3://b/m/", key=request.ref, tier=pb.TIER_SHM, pinned=request.pinned
        )

    def CollectGarbage(
        self, request: pb.CollectGarbageRequest, context: Any
    ) -> pb.CollectGarbageResponse:
        # The evicted snapshot is on the tier asked for (both: shm).
        return pb.CollectGarbageResponse(
            evicted=[pb.ModelInfo(uri="s3://b/m/", key="k1", tier=request.tier or pb.TIER_SHM)],
            bytes_freed=100,
        )

    def VerifyModels(
        self, request: pb.VerifyModelsRequest, context: Any
    ) -> pb.VerifyModelsResponse:
        _maybe_abort(request.ref, context)
        ok = pb.ModelVerification(
            uri="s3://b/ok/", key="ok1", ok=True, bytes_checked=100, seconds=0.25
        )
        bad = pb.ModelVerification(
            uri="s3://b/bad/",
            key="bad1",
            ok=False,
            problems=[pb.FileProblem(path="a.bin", check="hash", detail="xxh3 differs")],
            # report_only keeps the snapshot
            evicted=not request.report_only,
        )
        return pb.VerifyModelsResponse(results=[ok, bad] if request.all else [bad])


def _maybe_abort(value: str, context: Any) -> None:
    if value.startswith("fail:"):
        code = grpc.StatusCode[value.removeprefix("fail:")]
        context.abort(code, f"the agent says {code.name}")


@pytest.fixture
def scripted() -> _Scripted:
    # RPCs it does not script (the compile-cache ones) answer UNIMPLEMENTED, as the
    # generated base class does at run time; the stubs only declare them abstract.
    return _Scripted()  # type: ignore[abstract]


@pytest.fixture
def socket_path(tmp_path: Path, scripted: _Scripted) -> Iterator[Path]:
    path = tmp_path / "agent.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PrewarmServicer_to_server(scripted, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    yield path
    server.stop(grace=None).wait()


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("INVALID_ARGUMENT", InvalidRequest),
        ("NOT_FOUND", NotFound),
        ("PERMISSION_DENIED", AccessDenied),
        ("RESOURCE_EXHAUSTED", NoSpace),
        ("FAILED_PRECONDITION", Conflict),
        ("ABORTED", SourceChanged),
        ("UNAVAILABLE", SourceUnavailable),
        ("DATA_LOSS", IntegrityError),
    ],
)
def test_status_code_becomes_its_error_class_with_the_agents_message(
    socket_path: Path, code: str, error: type[PrewarmError]
) -> None:
    with Client(socket_path) as client, pytest.raises(error) as info:
        client.get(f"fail:{code}")
    assert str(info.value) == f"the agent says {code}"
    assert isinstance(info.value.__cause__, grpc.RpcError)


def test_unmapped_status_code_is_a_plain_prewarm_error(socket_path: Path) -> None:
    with Client(socket_path) as client, pytest.raises(PrewarmError) as info:
        client.get("fail:INTERNAL")
    assert type(info.value) is PrewarmError
    assert "the agent says INTERNAL" in str(info.value)


def test_error_in_the_stream_is_mapped_too(socket_path: Path) -> None:
    with pytest.raises(NotFound, match="the agent says NOT_FOUND"):
        ensure("fail:NOT_FOUND", socket_path=socket_path)


def test_missing_socket_is_agent_unavailable_with_a_hint(tmp_path: Path) -> None:
    missing = tmp_path / "nobody.sock"
    with Client(missing) as client, pytest.raises(AgentUnavailable) as info:
        client.status()
    assert str(info.value).startswith(f"no prewarm agent is listening on {missing}")
    assert "PREWARM_SOCKET_PATH" in str(info.value)


def test_socket_nobody_listens_on_is_agent_unavailable(tmp_path: Path) -> None:
    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(dead))
    with Client(dead) as client, pytest.raises(AgentUnavailable, match="connection refused"):
        client.list_models()


def test_socket_path_comes_from_the_environment(
    socket_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREWARM_SOCKET_PATH", str(socket_path))
    with Client() as client:
        assert client.socket_path == socket_path
        assert client.get("abcdef12").hit_count == 3


def test_ensure_reports_each_progress_event_and_returns_the_handle(socket_path: Path) -> None:
    seen: list[Progress] = []
    handle = ensure("s3://b/m/", socket_path=socket_path, tier="disk", progress=seen.append)
    assert [p.bytes_done for p in seen] == [0, 50, 100]
    assert {p.phase for p in seen} == {"download"}
    assert handle.tier == "disk"
    assert handle.path == Path("/cache/k1")
    assert handle.files[0].etag == '"e"'
    assert handle.timings.download == 0.5


def test_stream_that_ends_without_a_handle_is_an_error(socket_path: Path) -> None:
    with pytest.raises(PrewarmError, match="without a model handle"):
        ensure("s3://b/nohandle/", socket_path=socket_path)


def test_bare_string_as_include_is_refused_before_any_call(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="sequence of glob patterns"):
        ensure("s3://b/m/", socket_path=tmp_path / "unused.sock", include="*.json")


def test_unknown_tier_is_refused_before_any_call(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="choose 'shm' or 'disk'"):
        ensure("s3://b/m/", socket_path=tmp_path / "unused.sock", tier="nvme")  # type: ignore[arg-type]


async def test_async_client_streams_progress_and_maps_errors(socket_path: Path) -> None:
    seen: list[Progress] = []
    handle = await aensure("s3://b/m/", socket_path=socket_path, progress=seen.append)
    assert handle.tier == "shm"
    assert len(seen) == 3
    async with AsyncClient(socket_path) as client:
        assert (await client.get("abcdef12")).key == "abcdef12"
        with pytest.raises(Conflict, match="the agent says FAILED_PRECONDITION"):
            await client.get("fail:FAILED_PRECONDITION")


async def test_async_client_on_missing_socket_is_agent_unavailable(tmp_path: Path) -> None:
    async with AsyncClient(tmp_path / "nobody.sock") as client:
        with pytest.raises(AgentUnavailable, match="no prewarm agent is listening"):
            await client.status()


def test_exception_from_the_progress_callback_reaches_the_caller(socket_path: Path) -> None:
    class Stop(Exception):
        pass

    def on_progress(_: Progress) -> None:
        raise Stop

    with pytest.raises(Stop):
        ensure("s3://b/m/", socket_path=socket_path, progress=on_progress)


# --- leases, pins, garbage collection, verification: what the client sends and reads --------


def test_ensure_with_a_lease_returns_the_grant(socket_path: Path) -> None:
    with Client(socket_path) as client:
        handle = client.ensure("s3://b/m/", lease=True, lease_ttl=30, client_name="me")
        assert client.ensure("s3://b/m/").lease is None
    assert handle.lease == LeaseGrant(
        id="lease-me", key="k1", expires=T0, socket_path=Path("/run/prewarm/lease.sock")
    )


def test_ensure_sends_the_lease_pin_and_strict_tier_options(
    socket_path: Path, scripted: _Scripted
) -> None:
    with Client(socket_path) as client:
        client.ensure(
            "s3://b/m/", tier="disk", lease=True, lease_ttl=30, pin=True, strict_tier=True
        )
        client.ensure("s3://b/m/")
    asked, plain = scripted.ensure_requests
    assert (asked.lease, asked.lease_ttl_seconds, asked.pin, asked.strict_tier) == (
        True,
        30,
        True,
        True,
    )
    # 0 on the wire: the agent's default TTL.
    assert (plain.lease, plain.lease_ttl_seconds, plain.pin, plain.strict_tier) == (
        False,
        0,
        False,
        False,
    )


def test_handle_reports_the_bytes_a_resumed_pull_kept(socket_path: Path) -> None:
    assert ensure("s3://b/m/", socket_path=socket_path).resumed_bytes == 40


def test_lease_ttl_without_a_lease_is_refused_before_any_call(tmp_path: Path) -> None:
    with Client(tmp_path / "unused.sock") as client, pytest.raises(InvalidRequest, match="lease"):
        client.ensure("s3://b/m/", lease_ttl=30)


def test_model_info_lists_leases_and_the_pin(socket_path: Path) -> None:
    with Client(socket_path) as client:
        info = client.get("abcdef12")
    assert info.pinned
    held, timed = info.leases
    assert held == LeaseInfo(
        id="held-1",
        client_name="ns/pod",
        pid=42,
        uid=0,
        gid=0,
        acquired=T0,
        expires=None,
        held=True,
    )
    # Nobody holds it: no credentials (not uid 0), and an expiry.
    assert (timed.pid, timed.uid, timed.gid, timed.held) == (None, None, None, False)
    assert timed.expires == T0


def test_renew_lease_returns_the_new_expiry(socket_path: Path) -> None:
    with Client(socket_path) as client:
        renewed = client.renew_lease("L1", ttl=90)
        default = client.renew_lease("L1")
    assert renewed.id == "L1"
    assert renewed.expires is not None
    assert (renewed.expires - T0).total_seconds() == 90
    assert default.expires is not None
    assert (default.expires - T0).total_seconds() == 60


def test_renew_or_release_of_an_unknown_lease_is_not_found(socket_path: Path) -> None:
    with Client(socket_path) as client:
        with pytest.raises(NotFound):
            client.renew_lease("fail:NOT_FOUND")
        with pytest.raises(NotFound):
            client.release_lease("fail:NOT_FOUND")
        client.release_lease("L1")


def test_pin_and_unpin(socket_path: Path) -> None:
    with Client(socket_path) as client:
        assert client.pin("abcdef12").pinned
        assert not client.pin("abcdef12", pinned=False).pinned


def test_evict_sends_force(socket_path: Path) -> None:
    with Client(socket_path) as client:
        with pytest.raises(Conflict, match="is leased"):
            client.evict("abcdef12")
        result = client.evict("abcdef12", force=True)
    assert [m.key for m in result.evicted] == ["abcdef12"]
    assert result.bytes_freed == 100


def test_collect_garbage_sends_the_tier(socket_path: Path) -> None:
    with Client(socket_path) as client:
        assert client.collect_garbage(tier="disk").evicted[0].tier == "disk"
        assert client.collect_garbage().evicted[0].tier == "shm"


def test_verify_returns_each_snapshot_and_its_problems(socket_path: Path) -> None:
    with Client(socket_path) as client:
        ok, bad = client.verify(all=True)
        [kept] = client.verify("s3://b/bad/", report_only=True)
    assert ok == Verification(
        uri="s3://b/ok/",
        key="ok1",
        ok=True,
        problems=(),
        evicted=False,
        bytes_checked=100,
        seconds=0.25,
    )
    assert not bad.ok
    assert bad.evicted
    assert bad.problems == (FileProblem(path="a.bin", check="hash", detail="xxh3 differs"),)
    assert not kept.evicted


@pytest.mark.parametrize(
    ("ref", "all_models", "word"), [(None, False, "neither"), ("s3://b/m/", True, "both")]
)
def test_verify_needs_exactly_one_of_ref_and_all(
    tmp_path: Path, ref: str | None, all_models: bool, word: str
) -> None:
    with Client(tmp_path / "unused.sock") as client, pytest.raises(InvalidRequest, match=word):
        client.verify(ref, all=all_models)


def test_status_reports_budgets_and_lease_counts(socket_path: Path) -> None:
    with Client(socket_path) as client:
        status = client.status()
    assert status.lease_count == 2
    [tier] = status.tiers
    assert (tier.budget_bytes, tier.reserve_bytes, tier.staging_bytes) == (1000, 50, 7)
    assert (tier.leased_count, tier.pinned_count) == (2, 1)


async def test_async_client_leases_pins_gc_and_verify(socket_path: Path) -> None:
    async with AsyncClient(socket_path) as client:
        handle = await client.ensure("s3://b/m/", lease=True, client_name="a")
        assert handle.lease is not None
        assert handle.lease.id == "lease-a"
        renewed = await client.renew_lease("L1", ttl=5)
        assert renewed.expires is not None
        await client.release_lease("L1")
        assert (await client.pin("abcdef12")).pinned
        assert (await client.collect_garbage("disk")).evicted[0].tier == "disk"
        assert (await client.evict("abcdef12", force=True)).bytes_freed == 100
        assert [v.key for v in await client.verify(all=True)] == ["ok1", "bad1"]
        with pytest.raises(IntegrityError, match="DATA_LOSS"):
            await client.verify("fail:DATA_LOSS")
