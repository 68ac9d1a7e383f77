"""s3rver (npm) on loopback: the benchmark's S3-compatible server.

Chosen by measurement (NOTES.md, and ``calibrate`` below): moto's server copies
the whole object on every ranged GET, so ranged reads of big objects measure
moto; s3rver streams ranges from files. It is installed with npm into
``bench/.cache/s3rver`` the first time, at a pinned version.

Bytes served are counted without a proxy in the data path: s3rver is one
Node.js process that writes response bodies with write(2)/writev(2), so the
``wchar`` counter in ``/proc/<pid>/io`` grows by exactly the bytes it sends
(plus headers, and nothing else once it runs ``--silent``). ``calibrate``
checks that against a GET of known size at start-up. Over HTTPS the counter
counts TLS records (a few dozen bytes of framing per 16 KiB record, and the
handshakes), so each scheme gets its own calibration.

With a certificate (``tls=``) the same store is served over HTTPS: several
s3rver processes may serve one store directory (each reads it per request),
so the bench uploads through an HTTP one and reads through both.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Self

from agent.testing._endpoint import LoopbackEndpoint
from agent.testing._process import Startable, StartupFailure, purge_tree, read_until, stop_process

from ._system import cpu_seconds, proc_io
from ._tls import LoopbackCertificate

__all__ = ["S3RVER_VERSION", "S3rver", "S3rverError", "install_s3rver"]

S3RVER_VERSION = "3.7.1"
ACCESS_KEY = "S3RVER"
SECRET_KEY = "S3RVER"
REGION = "us-east-1"

_CACHE = Path(__file__).resolve().parent / ".cache"
_LISTENING = re.compile(rb"listening on [0-9.]+:(\d+)")


class S3rverError(RuntimeError):
    """s3rver could not be installed or started."""


def install_s3rver(cache: Path = _CACHE) -> Path:
    """The s3rver executable, installed with npm into ``cache`` if it is not there."""
    prefix = cache / "s3rver"
    binary = prefix / "node_modules" / ".bin" / "s3rver"
    package = prefix / "node_modules" / "s3rver" / "package.json"
    if binary.exists() and f'"version": "{S3RVER_VERSION}"' in package.read_text():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        raise S3rverError(
            "npm is not installed; the benchmark needs it to install s3rver (apt-get install npm)."
        )
    prefix.mkdir(parents=True, exist_ok=True)
    argv = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund"]
    argv += ["--loglevel=error", f"s3rver@{S3RVER_VERSION}"]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not binary.exists():
        raise S3rverError(f"npm install s3rver@{S3RVER_VERSION} failed:\n{result.stderr}")
    return binary


class S3rver(Startable):
    """One s3rver process on 127.0.0.1 with its store in a temporary directory.

    The store goes on the disk (``/tmp`` or ``directory``), not /dev/shm: the
    objects then live in the page cache once uploaded, and only the agent's
    shm tier uses tmpfs.
    """

    def __init__(
        self, bucket: str, *, directory: Path | None = None, tls: LoopbackCertificate | None = None
    ) -> None:
        self.bucket = bucket
        self.tls = tls
        self._owns_directory = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix="prewarm-bench-s3-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._port = 0
        self.output_tail = b""

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise S3rverError("s3rver is not running.")
        return self._proc.pid

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    @property
    def ca_bundle(self) -> Path | None:
        """The certificate a client must trust (``AWS_CA_BUNDLE``), or None over HTTP."""
        return self.tls.cert if self.tls is not None else None

    @property
    def port(self) -> int:
        """The port it listens on (0 before it starts)."""
        return self._port

    @property
    def endpoint_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._port}"

    def start(self, timeout: float = 60.0) -> Self:
        binary = install_s3rver()
        argv = [str(binary), "-d", str(self.directory), "-a", "127.0.0.1", "-p", "0"]
        # --silent: no per-request log lines (they would count as bytes sent);
        # the "listening on" line that tells the port is printed regardless.
        argv += ["--configure-bucket", self.bucket, "--silent"]
        if self.tls is not None:
            argv += ["--key", str(self.tls.key), "--cert", str(self.tls.cert)]
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            listening = read_until(self._proc, _LISTENING, timeout=timeout)
        except StartupFailure as exc:
            stop_process(self._proc, signal.SIGKILL, timeout=10.0)
            raise S3rverError(f"s3rver {exc.reason}: {exc.output!r}") from exc
        self._port = int(listening.group(1))
        # Anything it prints later (errors) must not fill the pipe and stall it.
        threading.Thread(target=self._drain, args=(self._proc,), daemon=True).start()
        return self

    def stop(self) -> None:
        proc = self._proc
        self._proc = None
        if proc is not None:
            stop_process(proc, timeout=10.0)
            if proc.stdout is not None:
                proc.stdout.close()
        if self._owns_directory:
            purge_tree(self.directory)

    def close(self) -> None:
        """Stop the server (the end of a ``with`` block)."""
        self.stop()

    # -- what clients need -----------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Environment for the agent, s5cmd, boto3 and the streamer to use this server.

        ``AWS_CA_BUNDLE`` is what botocore, s5cmd (the Go SDK) and the
        streamer's CRT client each read for an extra root certificate.
        """
        env = self._endpoint.env() | {
            "AWS_REGION": REGION,
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
        }
        if self.ca_bundle is not None:
            env["AWS_CA_BUNDLE"] = str(self.ca_bundle)
        return env

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server; ``config`` adds botocore Config options.

        Checksums only when an operation requires one: with botocore's default
        an upload goes in ``aws-chunked`` framing with a trailing checksum,
        which s3rver 3.7.1 stores inside the object.
        """
        import boto3.session
        from botocore.config import Config

        options: dict[str, Any] = {
            "s3": {"addressing_style": "path"},
            "request_checksum_calculation": "when_required",
        }
        options.update(config)
        # A session of its own, with the server's keys, not the default session's.
        session = boto3.session.Session(
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY, region_name=REGION
        )
        verify = str(self.ca_bundle) if self.ca_bundle is not None else None
        return session.client(
            "s3", endpoint_url=self.endpoint_url, verify=verify, config=Config(**options)
        )

    @property
    def _endpoint(self) -> LoopbackEndpoint:
        return LoopbackEndpoint(self.endpoint_url, ACCESS_KEY, SECRET_KEY, REGION)

    # -- accounting --------------------------------------------------------------------

    def bytes_sent(self) -> int:
        """Bytes the server has written (to sockets) since it started."""
        return proc_io(self.pid)["wchar"]

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    # -- internals -----------------------------------------------------------------------

    def _drain(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            while chunk := os.read(proc.stdout.fileno(), 65536):
                self.output_tail = (self.output_tail + chunk)[-8192:]
