"""The daemon's memory with a thousand GETs in flight: ``python -m bench.many_gets``.

A 400 Gbit/s node against S3 keeps ~1,000 GETs in flight (docs/data-planes.md).
This run holds that many open at once on this VM and reports what the daemon and
its range workers hold meanwhile:

- the server: s3rver behind ``s3rver_shaped.js`` on 127.0.0.1, in several
  processes sharing one port (one Node.js process leaves some of a thousand GETs
  unanswered past the agent's first-byte deadline), with a first-byte latency of
  ``--latency-ms`` on every request, so every GET the daemon starts is still
  open when the last one is sent;
- the daemon: fresh, with ``concurrency`` pinned to ``--gets`` and parts of
  ``--chunk`` (a model of ``--size`` has size/chunk parts, more than ``--gets``),
  its worker processes sized by the agent's own rule for that ceiling;
- measured, every 25 ms during the pull: RSS summed over the daemon and its
  workers (PSS every 0.5 s), and the TCP connections open to the server's port
  (``/proc/net/tcp``: the GETs in flight, counted by the kernel, not the agent).

Prints one line per figure; run by hand, results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
import time
from pathlib import Path

from agent.client import Client
from agent.testing._process import purge_tree

from ._agent import running_agent
from ._cli import parse_size
from ._contenders import Context
from ._model import publish_model
from ._shaped_server import ShapedS3rver
from ._shaping import Profile
from ._system import RssSampler, descendants

MiB = 1024**2
GiB = 1024**3
BUCKET = "bench"
# /proc/net/tcp's state for an established connection.
_ESTABLISHED = "01"


def open_connections(port: int) -> int:
    """TCP connections established to ``port`` on this host (the client ends)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                if remote_port == port and fields[3] == _ESTABLISHED:
                    count += 1
    return count


class ConnectionPeak:
    """The most connections open to ``port`` at once, sampled every 25 ms."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="connections", daemon=True)

    def __enter__(self) -> ConnectionPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.025):
            self.peak = max(self.peak, open_connections(self.port))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.many_gets", description=__doc__)
    parser.add_argument("--gets", type=int, default=1000, help="GETs in flight (pinned)")
    parser.add_argument("--size", type=parse_size, default=4 * GiB, help="model size")
    parser.add_argument("--chunk", type=parse_size, default=2 * MiB, help="bytes per GET")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--server-processes", type=int, default=4)
    parser.add_argument("--latency-ms", type=int, default=3000, help="server's first-byte delay")
    args = parser.parse_args()
    if args.size // args.chunk < args.gets:
        parser.error(f"--size / --chunk gives {args.size // args.chunk} parts, fewer than --gets")
    store = Path(tempfile.mkdtemp(prefix="prewarm-bench-many-"))
    scratch = Path(tempfile.mkdtemp(prefix="prewarm-bench-many-", dir="/dev/shm"))
    profile = Profile("many", per_connection=0, link=0, first_byte_ms=args.latency_ms)
    server = ShapedS3rver(BUCKET, None, profile, directory=store, processes=args.server_processes)
    try:
        with server.start():
            print(f"server: {args.server_processes} s3rver processes at {server.endpoint_url}")
            model = publish_model(
                server.client(),
                BUCKET,
                "many",
                total_bytes=args.size,
                shards=args.shards,
                work=scratch,
            )
            ctx = Context(server, args.gets, args.chunk, scratch)
            _pull(ctx, model.uri, model.total_bytes, server)
    finally:
        purge_tree(scratch)
        purge_tree(store)


def _pull(ctx: Context, uri: str, total: int, server: ShapedS3rver) -> None:
    with running_agent(ctx, "processes") as agent, Client(agent.socket_path) as client:
        assert agent.pid is not None
        with RssSampler(agent.pid) as memory, ConnectionPeak(server.port) as connections:
            started = time.perf_counter()
            client.ensure(uri, tier="shm")
            seconds = time.perf_counter() - started
        workers = len(descendants(agent.pid))
        daemon_peak = memory.vm_hwm
    print(f"pulled {total / GiB:.2f} GiB in {seconds:.1f} s, {workers} worker processes")
    print(f"GETs in flight at once (TCP connections to the server): {connections.peak}")
    print(
        f"peak RSS, daemon + workers: {memory.peak_total / MiB:.0f} MiB "
        f"(workers {memory.peak_children / MiB:.0f} MiB; PSS {memory.peak_pss / MiB:.0f} MiB; "
        f"the daemon's own VmHWM {daemon_peak / MiB:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
