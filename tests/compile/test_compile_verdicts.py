"""Launch verdicts and publish-on-ready, in process: real directories, S3 played by MemorySource.

A launch that reports ready is judged by what it added to its key since the
restore (or the previous ready launch): hit, partial miss naming the sub-cache,
or miss; and only then is the key uploaded (merged into the manifest).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from compile_helpers import BUCKET
from compile_helpers import compile_node as node

from agent.compile.cache import COMPILE_MISS_PARTS
from agent.compile.keys import CompileKeyParts, compile_key
from agent.compile.verdict import Verdict, judge
from agent.obs.metrics import COMPILE_LAUNCHES
from agent.testing import MemorySource, unsealed

PARTS = CompileKeyParts(torch_version="2.13.0", model_key="verdicts")
KEY = compile_key(PARTS)
MANIFEST = f"cc/node/{KEY}/manifest.json"


def _compile(directory: Path, sub: str, name: str) -> None:
    """Write one artifact as an engine would."""
    (directory / sub).mkdir(parents=True, exist_ok=True)
    (directory / sub / name).write_bytes(os.urandom(1000))


async def test_cold_then_restored_then_new_shape_give_miss_hit_partial_miss(
    tmp_path: Path,
) -> None:
    """A cold compile is a miss; a new node that restored it hits; a new shape is a partial miss."""
    source = MemorySource(objects={BUCKET: {}})
    misses_before = COMPILE_LAUNCHES.labels("torch", "miss")._value.get()
    async with node(tmp_path / "a", source) as first:
        path = (await first.ensure(PARTS, publish_on_ready=True)).info.path
        _compile(path, "inductor", "graph-1")
        cold = await first.ready(KEY, "pod-a")
    assert cold.verdict.verdict == "miss"
    assert cold.verdict.grown == {"inductor": (1, 1000)}
    assert cold.push is not None
    assert cold.push.uploaded
    assert COMPILE_LAUNCHES.labels("torch", "miss")._value.get() == misses_before + 1

    async with node(tmp_path / "b", source) as second:
        restored = await second.ensure(PARTS, publish_on_ready=True)
        assert restored.restored
        hit = await second.ready(KEY, "pod-b")
        _compile(restored.info.path, "triton", "kernel-2")
        partial = await second.ready(KEY[:8], "pod-b")
        (info,) = await second.caches()
    assert (hit.verdict.verdict, hit.verdict.grown) == ("hit", {})
    assert hit.push is not None
    assert not hit.push.uploaded
    assert partial.verdict.verdict == "partial miss"
    assert partial.verdict.grown == {"triton": (1, 1000)}
    assert "triton +1 files" in partial.verdict.describe()
    assert info.last_verdict is not None
    assert info.last_verdict.verdict == "partial miss"
    manifest = unsealed(source.objects[BUCKET][MANIFEST])
    assert manifest["file_count"] == 2  # the partial miss was merged, not overwritten


async def test_a_key_waiting_for_ready_is_not_uploaded_when_quiet(tmp_path: Path) -> None:
    """With publish_on_ready, a settled key (e.g. an engine that crashed) uploads nothing."""
    source = MemorySource(objects={BUCKET: {}})
    async with node(tmp_path, source, quiet_seconds=0.05) as caches:
        path = (await caches.ensure(PARTS, publish_on_ready=True)).info.path
        _compile(path, "inductor", "half-made")
        await caches._settled(f"node/{KEY}")  # what the watcher runs once the key is quiet
        assert MANIFEST not in source.objects[BUCKET]
        (info,) = await caches.caches()
    assert info.publish_on_ready
    assert info.last_verdict is None


async def test_vllm_model_infos_alone_never_make_a_launch_a_miss(tmp_path: Path) -> None:
    """``vllm/modelinfos/*.json`` (written with compilation off too) is no compiled code: the
    launch is ``uncompiled`` (nothing compiled, nothing reused), not a miss and not a hit."""
    source = MemorySource(objects={BUCKET: {}})
    async with node(tmp_path, source) as caches:
        path = (await caches.ensure(PARTS, publish_on_ready=True)).info.path
        _compile(path, "vllm/modelinfos", "model.json")
        launch = await caches.ready(KEY, "pod-a")
        _compile(path, "inductor", "graph-1")
        cold = await caches.ready(KEY, "pod-a")
    assert (launch.verdict.verdict, launch.verdict.grown) == ("uncompiled", {})
    assert launch.verdict.describe() == "uncompiled: the key holds no compiled code"
    assert launch.nearest is None  # nothing missed, so nothing to explain
    assert launch.push is not None
    assert launch.push.uploaded  # still kept and shared: vLLM reads it back
    assert cold.verdict.verdict == "miss"  # nothing compiled was there before


async def test_a_miss_is_counted_by_the_parts_that_differ_from_the_nearest_key(
    tmp_path: Path,
) -> None:
    """A new key of a cached model counts each part that differs from the nearest cached key."""
    source = MemorySource(objects={BUCKET: {}})
    newer = CompileKeyParts(
        torch_version="2.14.0", model_key="verdicts", extras={"flag.dtype": "float16"}
    )
    torch_misses = COMPILE_MISS_PARTS.labels("torch", "torch_version")
    dtype_misses = COMPILE_MISS_PARTS.labels("torch", "extras.flag.dtype")
    before = (torch_misses._value.get(), dtype_misses._value.get())
    async with node(tmp_path, source) as caches:
        await caches.ensure(PARTS, publish_on_ready=True)
        path = (await caches.ensure(newer, publish_on_ready=True)).info.path
        _compile(path, "inductor", "graph-1")
        launch = await caches.ready(compile_key(newer), "pod-a")
    assert launch.verdict.verdict == "miss"
    assert (torch_misses._value.get(), dtype_misses._value.get()) == (before[0] + 1, before[1] + 1)


def test_a_verdict_says_sizes_in_binary_units_and_an_empty_key_is_no_hit() -> None:
    """What grew is said in KiB/MiB like the upload beside it; a launch that added nothing is a
    hit only when the key holds compiled code."""
    grown = judge({}, {"inductor": (22, 124_115_942)})
    assert grown.describe() == "miss: inductor +22 files (118.4 MiB)"
    assert judge({"inductor": (3, 100)}, {"inductor": (3, 100)}).verdict == "hit"
    assert judge({}, {}).verdict == "uncompiled"


def test_a_verdict_name_this_agent_does_not_know_is_kept_not_refused() -> None:
    """A record written by a newer agent (another verdict name) stays readable after a
    rollback, so its cache is not dropped; a malformed name is still refused."""
    record = {"verdict": "some newer verdict", "grown": {}, "at": 1.0, "client": "pod"}
    assert Verdict.from_json(record).verdict == "some newer verdict"
    for bad in ("", 7, "x" * 33):
        with pytest.raises(ValueError, match="verdict"):
            Verdict.from_json({**record, "verdict": bad})
