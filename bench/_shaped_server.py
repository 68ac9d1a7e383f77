"""s3rver behind ``s3rver_shaped.js`` (latency, SlowDown), in the bench's namespace or on loopback.

The same store and credentials as the loopback bench's ``S3rver`` (this is a
subclass: every contender takes it where it takes that one), started with
``ip netns exec`` so that it listens on the namespace's address and every byte
it sends crosses the shaped veth. ``ip netns exec`` execs node in place, so
the child's pid is the server's, and ``/proc/<pid>/io`` counts what it sends
as before. Without a namespace it listens on 127.0.0.1, and ``processes`` runs
several server processes on one port (bench.many_gets: a thousand GETs in flight).
"""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import threading
import urllib.request
from pathlib import Path
from typing import Any, Self

from agent.testing._process import StartupFailure, read_until, stop_process

from ._netns import NAMESPACE_ADDRESS, Namespace
from ._s3rver import _LISTENING, S3rver, S3rverError, install_s3rver
from ._shaping import Profile
from ._tls import LoopbackCertificate

__all__ = ["LAUNCHER", "ShapedS3rver"]

LAUNCHER = Path(__file__).resolve().parent / "s3rver_shaped.js"


class ShapedS3rver(S3rver):
    """s3rver in ``namespace`` on its address (None: on 127.0.0.1), with ``profile``'s
    latency and GET limit, in ``processes`` server processes sharing one port."""

    def __init__(
        self,
        bucket: str,
        namespace: Namespace | None,
        profile: Profile,
        *,
        directory: Path,
        tls: LoopbackCertificate | None = None,
        processes: int = 1,
    ) -> None:
        super().__init__(bucket, directory=directory, tls=tls)
        self.namespace = namespace
        self.profile = profile
        self.processes = processes

    @property
    def address(self) -> str:
        return NAMESPACE_ADDRESS if self.namespace is not None else "127.0.0.1"

    @property
    def endpoint_url(self) -> str:
        return f"{self.scheme}://{self.address}:{self._port}"

    def start(self, timeout: float = 60.0) -> Self:
        binary = install_s3rver()
        modules = binary.parent.parent  # node_modules
        argv = ["node", str(LAUNCHER), "--modules", str(modules)]
        argv += ["-d", str(self.directory), "-a", self.address, "-p", "0"]
        argv += ["--bucket", self.bucket, "--latency-ms", str(self.profile.first_byte_ms)]
        if self.profile.get_rate:
            argv += ["--get-rate", str(self.profile.get_rate)]
            argv += ["--get-burst", str(self.profile.get_burst)]
        if self.tls is not None:
            argv += ["--key", str(self.tls.key), "--cert", str(self.tls.cert)]
        if self.processes > 1:
            argv += ["--processes", str(self.processes)]
        self._proc = subprocess.Popen(
            self.namespace.wrap(argv) if self.namespace is not None else argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            listening = read_until(self._proc, _LISTENING, timeout=timeout)
        except StartupFailure as exc:
            stop_process(self._proc, signal.SIGKILL, timeout=10.0)
            raise S3rverError(f"shaped s3rver {exc.reason}: {exc.output!r}") from exc
        self._port = int(listening.group(1))
        threading.Thread(target=self._drain, args=(self._proc,), daemon=True).start()
        return self

    def stats(self) -> dict[str, Any]:
        """The launcher's counters: requests, object reads, 503 SlowDowns sent."""
        context = None
        if self.ca_bundle is not None:
            context = ssl.create_default_context(cafile=str(self.ca_bundle))
        # Straight to the namespace's address: no proxy from the environment.
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        )
        with opener.open(f"{self.endpoint_url}/__bench/stats", timeout=10.0) as response:
            stats: dict[str, Any] = json.loads(response.read())
        return stats
