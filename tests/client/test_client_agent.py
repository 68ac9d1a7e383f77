"""The client library against the real daemon and S3 server."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from agent.client import (
    AsyncClient,
    Client,
    InvalidRequest,
    NotFound,
    Progress,
    aensure,
    ensure,
    load_safetensors,
)
from agent.testing import AgentProcess, SampleModel


def test_cold_ensure_reports_progress_up_to_every_byte(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """A cold ensure() pulls every file, reporting progress from resolve up to the last byte."""
    seen: list[Progress] = []
    handle = ensure(small_model.uri, socket_path=agent_daemon.socket_path, progress=seen.append)
    assert not handle.hit
    assert handle.total_bytes == small_model.total_bytes
    assert sorted(f.path for f in handle.files) == sorted(
        k.removeprefix(small_model.prefix) for k in small_model.keys
    )
    assert seen[0].phase == "resolve"
    downloads = [p for p in seen if p.phase == "download"]
    assert downloads
    assert downloads[-1].bytes_total == small_model.total_bytes
    assert max(p.bytes_done for p in seen) == small_model.total_bytes
    assert handle.timings.total >= handle.timings.download > 0


async def test_async_ensure_of_a_cached_model_is_a_hit(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """aensure() of a model already cached is a hit on the same snapshot key and path."""
    first = await aensure(small_model.uri, socket_path=agent_daemon.socket_path)
    second = await aensure(small_model.uri, socket_path=agent_daemon.socket_path)
    assert second.hit
    assert (second.key, second.path) == (first.key, first.path)


async def test_async_client_gets_lists_and_evicts(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """AsyncClient gets by key prefix, lists and evicts; a get after the eviction is NotFound."""
    async with AsyncClient(agent_daemon.socket_path) as client:
        handle = await client.ensure(small_model.uri, tier="disk")
        info = await client.get(handle.key[:8])
        assert (info.key, info.tier, info.path) == (handle.key, "disk", handle.path)
        assert [m.key for m in await client.list_models()] == [handle.key]
        result = await client.evict(small_model.uri)
        assert [m.key for m in result.evicted] == [handle.key]
        assert result.bytes_freed == handle.total_bytes
        with pytest.raises(NotFound):
            await client.get(handle.key)


def test_status_counts_the_cached_model(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """status() counts the cached model and names both tier roots."""
    with Client(agent_daemon.socket_path) as client:
        client.ensure(small_model.uri)
        status = client.status()
    assert status.model_count == 1
    assert {t.tier: t.root for t in status.tiers} == {
        "shm": agent_daemon.shm_root,
        "disk": agent_daemon.disk_root,
    }


def test_bad_uri_is_an_invalid_request(agent_daemon: AgentProcess) -> None:
    """A URI that is not s3:// comes back from the agent as InvalidRequest."""
    with pytest.raises(InvalidRequest, match="not an S3 URI"):
        ensure("http://example.com/model", socket_path=agent_daemon.socket_path)


def test_weights_load_from_the_cache_without_a_copy(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """load_safetensors(handle) gives the saved values as CPU views of the snapshot's files."""
    handle = ensure(small_model.uri, socket_path=agent_daemon.socket_path)
    weights = load_safetensors(handle)
    assert weights.keys() == small_model.tensors.keys()
    for name, expected in small_model.tensors.items():
        assert np.array_equal(weights[name].numpy(), expected), name
    # Each tensor is a view of its file in the published snapshot directory.
    maps = _mapped_files()
    for tensor in weights.values():
        assert any(
            start <= tensor.data_ptr() < end and path.startswith(str(handle.path))
            for start, end, path in maps
        )
    assert all(t.device == torch.device("cpu") for t in weights.values())


def _mapped_files() -> list[tuple[int, int, str]]:
    found = []
    with Path("/proc/self/maps").open() as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end, fields[5].rstrip("\n")))
    return found


def test_load_safetensors_without_torch_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In a pod's minimal install (no torch), load_safetensors says which extra brings torch
    instead of a bare ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'prewarm-agent\[torch\]'"):
        load_safetensors(tmp_path)
