"""Compile-cache restores are safe against hostile archives and hostile key directories.

Issue 11, defect 3: links in archives, extraction that outlives a timed-out
restore, a planted ``inductor`` link, over-long member names and archives
bigger than the room left. In process: real directories, S3 played by
MemorySource.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path

import pytest
import zstandard
from compile_helpers import BUCKET, compile_node

from agent._exceptions import IntegrityError, NoSpace
from agent.compile.archive import content_digest, pack
from agent.compile.cache import CompileCaches
from agent.compile.keys import CompileKeyParts, compile_key
from agent.testing import MemorySource

PARTS = CompileKeyParts(torch_version="2.13.0", model_key="restore-safety")
KEY = compile_key(PARTS)


def node(
    root: Path, source: MemorySource, *, budget: str = "100MiB", restore_timeout: float = 120.0
) -> contextlib.AbstractAsyncContextManager[CompileCaches]:
    """One node's compile caches under ``root``, sharing ``source``; uploads only on request.

    It accepts unsigned caches: these archives stand for what a trusted (or, during a
    migration, accepted) uploader could still send, which the archive checks stop.
    """
    return compile_node(
        root,
        source,
        budget=budget,
        restore_timeout_seconds=restore_timeout,
        accept_unsigned=True,
    )


@pytest.fixture
def source() -> MemorySource:
    """The object store the nodes of a test share, with the bucket made."""
    return MemorySource(objects={BUCKET: {}})


def _publish_archive(source: MemorySource, members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
    """Put a hand-made archive and a pointer naming it in S3, as a hostile uploader could."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    archive = zstandard.ZstdCompressor().compress(raw.getvalue())
    name = "archives/0000000000000000-1-evil.tar.zst"
    source.put(BUCKET, f"cc/node/{KEY}/{name}", archive)
    pointer = {
        "format": 1,
        "key": KEY,
        "archive": name,
        "digest": "sha256:" + "0" * 64,
        "archive_bytes": len(archive),
        "content_bytes": sum(len(data) for _, data in members),
        "file_count": len(members),
        "uploaded": 1.0,
        "uploader": "evil",
        "parts": {},
    }
    source.put(BUCKET, f"cc/node/{KEY}/pointer.json", json.dumps(pointer).encode())


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, b""


def _scratch(root: Path) -> list[Path]:
    return list((root / "disk" / "compile" / "node" / ".tmp").iterdir())


def _outside_paths(env: dict[str, str], directory: Path) -> list[str]:
    """The env vars naming a path that is a link or resolves outside ``directory``."""
    real = os.path.realpath(directory) + os.sep
    return [
        name
        for name, value in env.items()
        if value.startswith(str(directory))
        and (Path(value).is_symlink() or not os.path.realpath(value).startswith(real))
    ]


def _not_directories(paths: Iterable[str]) -> list[str]:
    return [path for path in paths if not Path(path).is_dir()]


def test_pack_never_packs_links_inward_or_outward(tmp_path: Path) -> None:
    """Links in a key directory (inside, outside, chained) are skipped by pack and the digest."""
    directory = tmp_path / "cache"
    (directory / "inductor").mkdir(parents=True)
    (directory / "inductor" / "kernel.so").write_bytes(b"k" * 100)
    (directory / "inductor" / "alias.so").symlink_to("kernel.so")
    (directory / "inductor" / "hop").symlink_to("alias.so")
    (directory / "inductor" / "out").symlink_to("/etc")
    archive = tmp_path / "c.tar.zst"
    packed = pack(directory, archive)
    assert packed.file_count == content_digest(directory).file_count == 1
    plain = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(archive.read_bytes())).read()
    with tarfile.open(fileobj=io.BytesIO(plain)) as tar:
        assert [(m.name, m.isreg()) for m in tar.getmembers()] == [("inductor/kernel.so", True)]


async def test_a_link_chain_in_an_archive_is_refused_naming_the_member(
    tmp_path: Path, source: MemorySource
) -> None:
    """Links resolving through links are refused (DATA_LOSS naming the member); pod starts empty."""
    _publish_archive(
        source,
        [_link("inductor/a", "b"), _link("inductor/b", "../../../../etc"), _link("triton", "a")],
    )
    async with node(tmp_path, source) as caches:
        handed = await caches.ensure(PARTS)
        assert not handed.restored
        assert "member 'inductor/a' is a symbolic link" in handed.restore_note
        assert content_digest(handed.info.path).file_count == 0
        assert _outside_paths(handed.env, handed.info.path) == []
        with pytest.raises(IntegrityError, match="symbolic link") as caught:
            await caches.pull(KEY)
    assert caught.value.status == "DATA_LOSS"
    assert not _scratch(tmp_path)


async def test_a_member_name_over_255_bytes_is_data_loss_not_enametoolong(
    tmp_path: Path, source: MemorySource
) -> None:
    """An over-long member name is a refused archive (DATA_LOSS), never an OSError."""
    _publish_archive(source, [(tarfile.TarInfo("inductor/" + "x" * 300), b"data")])
    async with node(tmp_path, source) as caches:
        with pytest.raises(IntegrityError, match="over 255 bytes") as caught:
            await caches.pull(KEY)
        assert caught.value.status == "DATA_LOSS"
        handed = await caches.ensure(PARTS)
    assert not handed.restored
    assert "over 255 bytes" in handed.restore_note


@pytest.mark.parametrize("planted", ["dangling", "outside", "file"])
async def test_a_planted_link_where_a_sub_cache_belongs_is_replaced_by_a_directory(
    tmp_path: Path, source: MemorySource, planted: str
) -> None:
    """A pod's link (dangling or outward) or file at ``inductor`` is replaced; env stays inside."""
    outside = tmp_path / "victim"
    outside.mkdir()
    async with node(tmp_path, source) as caches:
        first = await caches.ensure(PARTS, skip_restore=True)
        inductor = first.info.path / "inductor"
        inductor.rmdir()
        if planted == "dangling":
            inductor.symlink_to(tmp_path / "nowhere")
        elif planted == "outside":
            inductor.symlink_to(outside)
        else:
            inductor.write_text("not a directory")
        again = await caches.ensure(PARTS)
    assert _outside_paths(again.env, again.info.path) == []
    assert again.env["TORCHINDUCTOR_CACHE_DIR"] == str(inductor)
    assert inductor.is_dir()
    assert not list(outside.iterdir())


async def test_an_archive_too_big_for_the_budget_is_refused_before_any_download(
    tmp_path: Path, source: MemorySource
) -> None:
    """Archive plus content over the room left is RESOURCE_EXHAUSTED with no GET of the archive."""
    async with node(tmp_path / "a", source, budget="100MiB") as first:
        directory = (await first.ensure(PARTS)).info.path
        (directory / "inductor" / "big.bin").write_bytes(os.urandom(6 * 1024 * 1024))
        assert (await first.push(KEY)).uploaded
    source.reads.clear()
    async with node(tmp_path / "b", source, budget="10MiB") as second:
        handed = await second.ensure(PARTS)
        assert not handed.restored
        assert "within its budget" in handed.restore_note
        with pytest.raises(NoSpace) as caught:
            await second.pull(KEY)
    assert caught.value.status == "RESOURCE_EXHAUSTED"
    assert not [read for read in source.reads if "/archives/" in read.key]


async def test_a_timed_out_restore_stops_its_extraction_and_leaves_nothing_in_tmp(
    tmp_path: Path, source: MemorySource
) -> None:
    """After a restore times out, no worker thread keeps writing into ``.tmp/``."""
    members = [(tarfile.TarInfo(f"inductor/d{n // 500}/f{n}"), b"x") for n in range(20_000)]
    _publish_archive(source, members)
    async with node(tmp_path, source, restore_timeout=0.3) as caches:
        handed = await caches.ensure(PARTS)
    assert "took longer than 0.3 s" in handed.restore_note
    # Wait for every worker thread the restore started: a stray extraction would finish here.
    await asyncio.get_running_loop().shutdown_default_executor()
    assert not _scratch(tmp_path)


@pytest.mark.parametrize("engine", ["torch", "vllm", "sglang"])
async def test_every_cache_variable_points_at_a_real_directory_inside_the_key(
    tmp_path: Path, source: MemorySource, engine: str
) -> None:
    """Inductor, Triton, extensions, FlashInfer, DeepGEMM, CUDA and engine roots: all inside."""
    parts = CompileKeyParts(engine=engine, torch_version="2.13.0", model_key="every-variable")
    async with node(tmp_path, source) as caches:
        handed = await caches.ensure(parts, skip_restore=True)
    expected = {
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
        "TORCH_EXTENSIONS_DIR",
        "FLASHINFER_WORKSPACE_BASE",
        "DG_JIT_CACHE_DIR",
        "CUDA_CACHE_PATH",
    }
    expected |= {"vllm": {"VLLM_CACHE_ROOT"}, "sglang": {"SGLANG_CACHE_DIR"}}.get(engine, set())
    assert expected <= set(handed.env)
    paths = {name: value for name, value in handed.env.items() if value.startswith("/")}
    assert expected <= set(paths)
    assert _outside_paths(handed.env, handed.info.path) == []
    assert _not_directories(paths.values()) == []
    assert int(handed.env["CUDA_CACHE_MAXSIZE"]) >= 256 * 1024 * 1024
