"""A stand-in Prewarm server for client tests: it answers what the test asks for.

``uri``/``ref``/``id`` "fail:CODE" aborts with CODE; "s3://b/nohandle/" ends
EnsureModel without a handle. The behaviour under test is the client's
(tests/cli/test_cli.py runs the real agent).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc

__all__ = ["T0", "ScriptedAgent", "serve_scripted"]

T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


def timestamp(moment: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def lease_infos() -> list[pb.LeaseInfo]:
    # One lease held open by root (uid 0 is a real uid), one timed and not held.
    return [
        pb.LeaseInfo(
            id="held-1",
            client_name="ns/pod",
            pid=42,
            uid=0,
            gid=0,
            acquired=timestamp(T0),
            held=True,
        ),
        pb.LeaseInfo(
            id="timed-1", client_name="batch", acquired=timestamp(T0), expires=timestamp(T0)
        ),
    ]


class ScriptedAgent(pb_grpc.PrewarmServicer):
    """``uri``/``ref``/``id`` "fail:CODE" aborts with CODE; "s3://b/nohandle/" ends without
    a handle. ``ensure_requests`` keeps what EnsureModel received."""

    def __init__(self) -> None:
        self.ensure_requests: list[pb.EnsureModelRequest] = []

    def EnsureModel(self, request: pb.EnsureModelRequest, context: Any) -> Iterator[Any]:
        self.ensure_requests.append(request)
        maybe_abort(request.uri, context)
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
                    expires=timestamp(T0),
                    socket_path="/run/prewarm/lease.sock",
                )
                if request.lease
                else None,
            )
        )

    def GetModel(self, request: pb.GetModelRequest, context: Any) -> pb.ModelInfo:
        maybe_abort(request.ref, context)
        return pb.ModelInfo(
            uri="s3://b/m/",
            key=request.ref,
            tier=pb.TIER_SHM,
            hit_count=3,
            leases=lease_infos(),
            pinned=True,
        )

    def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        return pb.ListModelsResponse()

    def EvictModel(self, request: pb.EvictModelRequest, context: Any) -> pb.EvictModelResponse:
        maybe_abort(request.ref, context)
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
        maybe_abort(request.id, context)
        expires = T0.timestamp() + (request.ttl_seconds or 60)
        return pb.Lease(
            id=request.id,
            key="k1",
            expires=timestamp(datetime.fromtimestamp(expires, UTC)),
            socket_path="/run/prewarm/lease.sock",
        )

    def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: Any
    ) -> pb.ReleaseLeaseResponse:
        maybe_abort(request.id, context)
        return pb.ReleaseLeaseResponse()

    def PinModel(self, request: pb.PinModelRequest, context: Any) -> pb.ModelInfo:
        maybe_abort(request.ref, context)
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
        maybe_abort(request.ref, context)
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


def maybe_abort(value: str, context: Any) -> None:
    if value.startswith("fail:"):
        code = grpc.StatusCode[value.removeprefix("fail:")]
        context.abort(code, f"the agent says {code.name}")


@contextmanager
def serve_scripted(path: Path) -> Iterator[ScriptedAgent]:
    """Serve a fresh ScriptedAgent on ``path`` for the length of the block."""
    # RPCs it does not script (the compile-cache ones) answer UNIMPLEMENTED, as the
    # generated base class does at run time; the stubs only declare them abstract.
    scripted = ScriptedAgent()  # type: ignore[abstract]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PrewarmServicer_to_server(scripted, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        yield scripted
    finally:
        server.stop(grace=None).wait()
