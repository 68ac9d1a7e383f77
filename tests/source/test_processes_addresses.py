"""GETs spread over every address the S3 endpoint's name resolves to, as the AWS CRT does.

The endpoint is ``localhost``; the data plane's resolver is the test's and answers
two other loopback addresses. A fault proxy listens on each of the three addresses,
on one port, in front of one moto server: the listing (the control plane, which
resolves ``localhost`` itself) reaches the first, and the ranged GETs can only
reach the other two by the plane sending them there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_data_planes import assert_identical

from agent._config import Settings
from agent._uri import parse_uri
from agent._vocabulary import PullOptions
from agent.leases.table import LeaseTable
from agent.pull.puller import Puller
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest
from agent.service.results import EnsureResult
from agent.source.s3 import S3Source
from agent.store.catalog import Store
from agent.testing import FaultProxy, S3Server, SampleModel

MiB = 1024 * 1024
SPREAD = ["127.0.0.2", "127.0.0.3"]


async def test_gets_take_each_address_of_the_endpoint_in_turn(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both addresses the name resolves to serve ranged GETs of one pull, none goes to the
    address the control plane uses, and the model lands byte for byte; the resolver was
    asked for the endpoint's name and port."""
    asked: list[tuple[str, int]] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return list(SPREAD)

    with FaultProxy(s3_server.endpoint_url, host=SPREAD[0]) as first:
        port = first.port
        with (
            FaultProxy(s3_server.endpoint_url, host=SPREAD[1], port=port) as second,
            FaultProxy(s3_server.endpoint_url, host="127.0.0.1", port=port) as control,
        ):
            endpoint = f"http://localhost:{port}"
            for name, value in s3_server.env().items():
                monkeypatch.setenv(name, value)
            monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
            settings = Settings.model_validate(
                {
                    "socket_path": tmp_path / "agent.sock",
                    "tiers": {"shm_root": tmp_path / "shm", "disk_root": tmp_path / "disk"},
                    "s3": {
                        "endpoint_url": endpoint,
                        "addressing_style": "path",
                        "chunk_size": MiB,
                        "concurrency": 4,
                    },
                }
            )
            store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
            await store.open()
            async with (
                S3Source(settings.s3) as source,
                Puller(store, source, settings.s3, settings.integrity, resolve=resolve) as puller,
            ):
                service = AgentService(
                    store, puller, source, LeaseTable(60, 3600), settings=settings
                )
                request = EnsureRequest(
                    uri=parse_uri(small_model.uri), options=PullOptions(data_plane="processes")
                )
                results = [e async for e in service.ensure(request) if isinstance(e, EnsureResult)]
            spread = (first.forwarded, second.forwarded)
            listed = control.forwarded
    [result] = results
    sizes = [
        (small_model.source_dir / k[len(small_model.prefix) :]).stat().st_size
        for k in small_model.keys
    ]
    ranges = sum(-(-size // MiB) for size in sizes)
    assert asked == [("localhost", port)]
    assert all(count > 0 for count in spread), spread
    assert sum(spread) == ranges  # every GET went to a resolved address, none elsewhere
    assert listed > 0  # the listing and HEADs, through the control plane's own lookup
    assert_identical(result, small_model)
