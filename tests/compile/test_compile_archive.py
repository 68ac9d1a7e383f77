"""Compile-cache archives: what is packed, and what unpacking refuses."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import zstandard
from agent_helpers import tree_digest

from agent._exceptions import IntegrityError
from agent.compile.archive import content_digest, pack, unpack

NO_LIMIT = 1 << 40


def _cache_dir(root: Path) -> Path:
    """A directory shaped like inductor's and Triton's, with the junk they leave around."""
    directory = root / "cache"
    (directory / "inductor" / "fxgraph" / "ab").mkdir(parents=True)
    (directory / "inductor" / "fxgraph" / "ab" / "entry").write_bytes(b"graph" * 1000)
    kernel = directory / "inductor" / "cq" / "kernel.so"
    kernel.parent.mkdir()
    kernel.write_bytes(bytes(range(256)) * 40)
    kernel.chmod(0o755)
    (directory / "inductor" / "cq" / "alias.so").symlink_to("kernel.so")
    # Not artifacts: locks, atomic-write temporaries, Triton's temp dirs, byte code.
    (directory / "inductor" / "locks").mkdir()
    (directory / "inductor" / "locks" / "cq.lock").write_text("")
    (directory / "inductor" / "cq" / ".123.456.tmp").write_text("half")
    (directory / "triton" / "tmp.pid_7_abc").mkdir(parents=True)
    (directory / "triton" / "tmp.pid_7_abc" / "k.cubin").write_text("partial")
    (directory / "inductor" / "__pycache__").mkdir()
    (directory / "inductor" / "__pycache__" / "x.pyc").write_text("pyc")
    return directory


def _archive(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return zstandard.ZstdCompressor().compress(raw.getvalue())


def test_a_packed_directory_unpacks_to_the_same_artifacts_elsewhere(tmp_path: Path) -> None:
    """Pack then unpack keeps the artifacts (modes) and drops links, locks and temporaries."""
    source = _cache_dir(tmp_path)
    archive = tmp_path / "c.tar.zst"
    packed = pack(source, archive)
    dest = tmp_path / "restored"
    dest.mkdir()
    unpacked = unpack(archive, dest, expected_digest=packed.digest, max_bytes=NO_LIMIT)
    assert unpacked.digest == packed.digest == content_digest(source).digest
    assert sorted(tree_digest(dest)) == [
        "inductor/cq/kernel.so",
        "inductor/fxgraph/ab/entry",
    ]
    assert (dest / "inductor" / "cq" / "kernel.so").stat().st_mode & 0o111
    assert not (dest / "inductor" / "cq" / "alias.so").exists()


def test_lock_and_temporary_files_do_not_change_the_digest(tmp_path: Path) -> None:
    """The content digest ignores locks and temporary files but changes with a new artifact."""
    source = _cache_dir(tmp_path)
    before = content_digest(source).digest
    (source / "inductor" / "locks" / "another.lock").write_text("")
    (source / "triton" / "tmpab12cd34").write_text("tempfile")
    assert content_digest(source).digest == before
    (source / "inductor" / "cq" / "new.so").write_text("new kernel")
    assert content_digest(source).digest != before


@pytest.mark.parametrize("cut", ["half", "last byte"])
def test_a_truncated_archive_is_refused(tmp_path: Path, cut: str) -> None:
    """An archive cut short is refused as broken or of the wrong digest."""
    archive = tmp_path / "c.tar.zst"
    packed = pack(_cache_dir(tmp_path), archive)
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2] if cut == "half" else data[:-1])
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(IntegrityError) as caught:
        unpack(archive, dest, expected_digest=packed.digest, max_bytes=NO_LIMIT)
    assert caught.value.check in ("archive", "digest")


def test_an_archive_with_other_content_than_its_pointer_says_is_refused(tmp_path: Path) -> None:
    """An archive whose content does not match the pointer's digest is refused."""
    archive = tmp_path / "c.tar.zst"
    pack(_cache_dir(tmp_path), archive)
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(IntegrityError, match="truncated or corrupt") as caught:
        unpack(archive, dest, expected_digest="sha256:" + "0" * 64, max_bytes=NO_LIMIT)
    assert caught.value.check == "digest"


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


@pytest.mark.parametrize(
    ("member", "why"),
    [
        (_member("/etc/cron.d/evil"), "absolute"),
        (_member("inductor/../../evil"), "'..'"),
        (_member("inductor/out", tarfile.SYMTYPE, "../../etc"), "symbolic link"),
        (_member("inductor/abs", tarfile.SYMTYPE, "/etc/passwd"), "symbolic link"),
        (_member("inductor/in", tarfile.SYMTYPE, "sibling"), "symbolic link"),
        (_member("inductor/" + "n" * 256), "over 255 bytes"),
        (_member("inductor/" + "é" * 128), "over 255 bytes"),
        (_member("/".join(["d" * 200] * 21)), "over 4096 bytes"),
        (_member("inductor/hard", tarfile.LNKTYPE, "inductor/x"), "hard link"),
        (_member("inductor/null", tarfile.CHRTYPE), "device"),
        (_member("inductor/fifo", tarfile.FIFOTYPE), "device, FIFO"),
    ],
)
def test_unsafe_members_are_refused(tmp_path: Path, member: tarfile.TarInfo, why: str) -> None:
    """Absolute paths, "..", any link, over-long names and devices are refused; nothing escapes."""
    archive = tmp_path / "evil.tar.zst"
    archive.write_bytes(_archive([(member, b"x")]))
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(IntegrityError, match=why) as caught:
        unpack(archive, dest, expected_digest="sha256:x", max_bytes=NO_LIMIT)
    assert caught.value.check == "unsafe-archive"
    assert not any(tmp_path.glob("evil*/**"))
    assert not (tmp_path.parent / "evil").exists()


def test_nothing_is_written_through_a_link_inside_the_archive(tmp_path: Path) -> None:
    """A link the archive itself makes is refused before anything can be written through it."""
    archive = tmp_path / "evil.tar.zst"
    archive.write_bytes(
        _archive(
            [
                (_member("sub", tarfile.DIRTYPE), b""),
                (_member("link", tarfile.SYMTYPE, "sub"), b""),
                (_member("link/file"), b"through the link"),
            ]
        )
    )
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(IntegrityError, match="member 'link' is a symbolic link"):
        unpack(archive, dest, expected_digest="sha256:x", max_bytes=NO_LIMIT)
    assert not (dest / "sub" / "file").exists()


def test_an_archive_bigger_than_the_room_left_is_refused(tmp_path: Path) -> None:
    """Unpacking stops with a size error once the content outgrows the room it is given."""
    archive = tmp_path / "c.tar.zst"
    packed = pack(_cache_dir(tmp_path), archive)
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(IntegrityError) as caught:
        unpack(archive, dest, expected_digest=packed.digest, max_bytes=1000)
    assert caught.value.check == "size"
