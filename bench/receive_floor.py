"""What receiving bytes costs Python here, no HTTP, no daemon: ``python -m bench.receive_floor``.

The loopback target (prewarm's tree at no more CPU per GiB than s5cmd) asks
how much of a range worker's CPU is Python and how much is the kernel's. This
run takes HTTP, S3, the daemon and hashing rules away and keeps only what any
receiver on this machine must do: read ``--streams`` TCP connections on
loopback, hash each piece with xxh3 (as the workers do) and write it at its
offset in a file on /dev/shm. The senders are forked processes that
``sendfile`` a file of random bytes, so they cost next to nothing and never
make the receiver wait.

Each receiver design is run in turn, ``--rounds`` times alternated:

- ``threads``: a blocking thread per stream, ``recv_into`` a buffer of
  ``--step`` and ``pwrite`` it (what a range worker does per GET);
- ``epoll``: one thread reading every stream that is ready per wake-up
  (non-blocking sockets, ``selectors.EpollSelector``), same buffers and writes;
- ``mmap``: one stream received straight into a shared mapping of the file
  (no ``pwrite`` copy, a page fault per page instead) beside ``threads`` with
  one stream.

It prints MiB/s and the receiver's CPU-s per GiB (user and system, from
``getrusage``), the figure to hold against s5cmd's whole tree in
``python -m bench``. Run by hand; results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

_GIB = 1 << 30
_MIB = 1 << 20


@dataclass
class _Stream:
    """One connection and the slice of the file it fills."""

    conn: socket.socket
    base: int
    length: int
    buffer: memoryview
    got: int = 0
    filled: int = 0
    hasher: xxhash.xxh3_128 = field(default_factory=xxhash.xxh3_128)

    def flush(self, fd: int) -> None:
        """Hash and write what the buffer holds, at the stream's place in the file."""
        piece = self.buffer[: self.filled]
        self.hasher.update(piece)
        os.pwrite(fd, piece, self.base + self.got)
        self.got += self.filled
        self.filled = 0

    @property
    def room(self) -> int:
        return min(len(self.buffer), self.length - self.got)


@dataclass(frozen=True)
class _Result:
    design: str
    streams: int
    seconds: float
    user: float
    system: float

    def line(self, size: int) -> str:
        gib = size / _GIB
        return (
            f"{self.design:8s} {self.streams:4d} streams: {size / self.seconds / _MIB:6.0f} MiB/s, "
            f"{(self.user + self.system) / gib:.3f} CPU-s/GiB "
            f"(user {self.user / gib:.3f}, system {self.system / gib:.3f})"
        )


def _source_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    with path.open("wb") as out:
        for _ in range(size // (16 * _MIB)):
            out.write(os.urandom(16 * _MIB))


def _start_senders(source: Path, size: int, streams: int) -> tuple[list[socket.socket], list[int]]:
    """Forked senders, one connection each, ``sendfile``-ing their slice of ``source``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(streams)
    part = size // streams
    children = []
    for index in range(streams):
        child = os.fork()
        if child == 0:  # the sender: no Python work per byte
            sock = socket.create_connection(listener.getsockname())
            fd = os.open(source, os.O_RDONLY)
            offset, end = index * part, (index + 1) * part
            while offset < end:
                offset += os.sendfile(sock.fileno(), fd, offset, end - offset)
            sock.close()
            os._exit(0)
        children.append(child)
    accepted = [listener.accept()[0] for _ in range(streams)]
    listener.close()
    return accepted, children


def _receive_blocking(stream: _Stream, fd: int) -> None:
    while stream.got < stream.length:
        room = stream.room
        while stream.filled < room:
            count = stream.conn.recv_into(stream.buffer[stream.filled : room])
            if not count:
                stream.flush(fd)
                return
            stream.filled += count
        stream.flush(fd)


def _threads(streams: list[_Stream], fd: int) -> None:
    threads = [threading.Thread(target=_receive_blocking, args=(s, fd)) for s in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _epoll(streams: list[_Stream], fd: int) -> None:
    selector = selectors.EpollSelector()
    for each in streams:
        each.conn.setblocking(False)
        selector.register(each.conn, selectors.EVENT_READ, each)
    open_streams = len(streams)
    while open_streams:
        for key, _events in selector.select():
            stream: _Stream = key.data
            if _drain_ready(stream, fd):
                selector.unregister(stream.conn)
                open_streams -= 1


def _drain_ready(stream: _Stream, fd: int) -> bool:
    """Read what one ready socket holds; True once its slice is complete or it closed."""
    while True:
        room = stream.room
        try:
            count = stream.conn.recv_into(stream.buffer[stream.filled : room])
        except BlockingIOError:
            return False
        stream.filled += count
        if stream.filled == room or not count:
            stream.flush(fd)
        if not count or stream.got >= stream.length:
            return True


def _mmap(streams: list[_Stream], fd: int) -> None:
    """One stream into a shared mapping of the file itself: no pwrite copy."""
    (stream,) = streams
    mapping = mmap.mmap(fd, stream.length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(mapping)
    step = len(stream.buffer)
    while stream.got < stream.length:
        start = stream.got
        end = min(stream.length, start + step)
        while stream.got < end:
            count = stream.conn.recv_into(view[stream.got : end])
            if not count:
                break
            stream.got += count
        stream.hasher.update(view[start : stream.got])
        if stream.got < end:
            break
    view.release()
    mapping.close()


_DESIGNS: dict[str, Callable[[list[_Stream], int], None]] = {
    "threads": _threads,
    "epoll": _epoll,
    "mmap": _mmap,
}


def _run(design: str, source: Path, size: int, *, streams: int, step: int) -> _Result:
    conns, children = _start_senders(source, size, streams)
    target = source.with_name(source.name + ".copy")
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        part = size // streams
        work = [
            _Stream(conn, index * part, part, memoryview(mmap.mmap(-1, step)))
            for index, conn in enumerate(conns)
        ]
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        _DESIGNS[design](work, fd)
        seconds = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        received = sum(s.got for s in work)
        if received != part * streams:
            raise SystemExit(f"{design}: received {received} bytes of {part * streams}")
    finally:
        os.close(fd)
        target.unlink()
        for conn in conns:
            conn.close()
        for child in children:
            os.waitpid(child, 0)
    return _Result(
        design, streams, seconds, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.receive_floor", description=__doc__)
    parser.add_argument("--size-gib", type=int, default=2, help="bytes received per run (GiB)")
    parser.add_argument("--streams", default="16,64", help="comma-separated stream counts")
    parser.add_argument("--step", type=int, default=1024, help="receive buffer per stream (KiB)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each design, alternated")
    args = parser.parse_args(argv)
    size, step = args.size_gib * _GIB, args.step * 1024
    source = Path("/dev/shm") / f"prewarm-receive-floor-{os.getpid()}"
    _source_file(source, size)
    try:
        for _round in range(args.rounds):
            for count in (int(n) for n in args.streams.split(",")):
                for design in ("threads", "epoll"):
                    result = _run(design, source, size, streams=count, step=step)
                    print(result.line(size), flush=True)
            for design in ("threads", "mmap"):
                print(_run(design, source, size, streams=1, step=step).line(size), flush=True)
    finally:
        source.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
