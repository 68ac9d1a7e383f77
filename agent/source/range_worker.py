"""One worker process of the processes data plane: presigned ranged GETs into staging files.

Why a process: over HTTPS, Python's ``SSLSocket`` hands back one TLS record
(at most 16 KiB) per read and takes the interpreter lock again for each, and
every thread of a process shares that one lock: a process's GETs hold it
0.32-0.43 s per GiB, which caps one process at 2.4-3.1 GiB/s whatever its
cores (docs/benchmarks.md).
Each worker has an interpreter, and a lock, of its own.

What a worker does, and no more: the daemon (agent.source.process_plane) sends
it jobs over a ``SOCK_SEQPACKET`` socket, each a GET presigned by botocore
(``If-Match`` signed in) with the staging file's descriptor attached
(``SCM_RIGHTS``). A worker thread sends the GET with ``http.client`` on a
connection it keeps, reads the body from the socket into its own buffer,
hashes it (``ChunkHasher``) and writes it at its offset with ``pwrite``; it
reports the bytes written about ten times a second and the range's digest at
the end. The worker holds no S3 credentials, opens no path, and imports nothing of the
daemon but the content hash and the retry rules (agent.source.pacing), so it stays
small (about 17 MiB resident).

Where a GET goes: the daemon's transport settings (sent once, when the worker
starts: how to verify S3's certificate, and the HTTP proxy the environment names
for the endpoint, if any) and the job's ``address``. Through a proxy, an HTTPS GET
goes through a CONNECT tunnel (TLS with the origin inside it, its certificate
checked against the URL's host) and an HTTP GET is sent to the proxy in absolute
form; the proxy URL's user and password, if any, go as Proxy-Authorization (Basic).
Without a proxy, a job with an ``address`` (an IP literal: one of the endpoint's
DNS answers, chosen by the daemon) connects there instead of resolving the URL's
host, while the Host header, the TLS server name and the certificate check stay
the URL's host.

Retries follow the other planes: a transient answer (5xx, throttling) or a body
that breaks off is tried again with full-jitter backoff, asking only for the
bytes after the last good one, at most ``retries`` extra times; a watchdog
thread cuts a body slower than the low-speed limit. On ``stop`` the worker
cuts every body of that pull, drops its queued jobs, and answers ``stopped``
only once none of its threads can write into that pull's files again.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import http.client
import ipaddress
import json
import mmap
import os
import re
import socket
import ssl
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from agent.check.hashes import ChunkHasher
from agent.source.pacing import (
    THROTTLE_RETRIES_PER_RETRY,
    Attempts,
    Body,
    Stopped,
    WriteGate,
    is_throttling,
    is_transient_answer,
    slow_body_reason,
)

__all__ = ["HEARTBEAT_SECONDS", "USER_AGENT", "GetJob", "Proxy", "decode", "encode", "main"]

# O_DIRECT writes need block-aligned offsets, lengths and memory: 4 KiB covers both
# 512-byte and 4 KiB logical blocks.
DIRECT_ALIGNMENT = 4096
# How often a worker tells the daemon how many bytes its jobs wrote.
PROGRESS_SECONDS = 0.1
# How often a worker says it is alive, bytes or not: the daemon kills one that falls
# silent with ranges in hand (stopped, or stuck outside Python), and hands them on.
HEARTBEAT_SECONDS = 1.0
# Sent with every GET, so a server's log tells this plane apart from the others.
USER_AGENT = "prewarm-processes"
MAX_MESSAGE = 64 * 1024
# An error answer's body is read for its code only, never more than this.
_MAX_ERROR_BODY = 64 * 1024
_CODE = re.compile(rb"<Code>([^<]{1,128})</Code>")
# OSError covers resets, timeouts and TLS errors; ValueError a read on a socket shut down
# under it; HTTPException a malformed or missing answer.
_BROKEN_OFF = (http.client.HTTPException, OSError, ValueError)
# A proxy URL longer than this is refused, not parsed.
_MAX_PROXY_URL = 2048
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9_.])?")
# http.client's message when a proxy answers CONNECT with anything but 200.
_TUNNEL_REFUSED = re.compile(r"Tunnel connection failed: (\d{3})")
# What a proxy's refusal of a tunnel means: worth another attempt (it could not reach S3
# just now) or not (it wants credentials, or its rules forbid the endpoint).
_TUNNEL_TRANSIENT = frozenset({502, 503, 504})


@dataclass(frozen=True, slots=True)
class GetJob:
    """One range: GET ``url`` for bytes [start, start + length) and write them at ``start``."""

    id: int
    pull: int
    url: str
    etag: str
    start: int
    length: int
    step: int  # bytes per read and write
    retries: int
    window: float  # the low-speed rule: at least low_speed_limit bytes/s per window
    low_speed_limit: int
    connect_timeout: float
    read_timeout: float
    first_byte_timeout: float  # longest S3 may leave the range's GETs unanswered, in all
    direct: bool  # write around the page cache (O_DIRECT): the disk tier
    # An IP to connect to instead of resolving the URL's host (the daemon spreads GETs over
    # the endpoint's addresses); empty: resolve. Host header and TLS name stay the URL's.
    # Ignored through a proxy, which resolves the host itself.
    address: str = ""

    @property
    def where(self) -> str:
        """The job's byte span, as messages name it."""
        return f"bytes {self.start}-{self.start + self.length - 1}"


def encode(message: dict[str, Any]) -> bytes:
    """One control message as bytes (JSON); ValueError over MAX_MESSAGE."""
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"a range-worker message of {len(data)} bytes is over {MAX_MESSAGE}")
    return data


def decode(data: bytes) -> dict[str, Any]:
    """One control message from bytes; TypeError unless it is a JSON object."""
    message = json.loads(data)
    if not isinstance(message, dict):
        raise TypeError("a range-worker message is not an object")
    return message


def job_message(job: GetJob) -> dict[str, Any]:
    return {"get": asdict(job)}


def _shown(value: object) -> str:
    """A value from outside, as an error message may quote it: escaped, at most 100 chars."""
    text = repr(value)
    return text if len(text) <= 100 else f"{text[:97]}..."


@dataclass(frozen=True, slots=True)
class Proxy:
    """The HTTP proxy a worker sends its GETs through, and the credentials it presents."""

    host: str
    port: int
    authorization: str = field(default="", repr=False)  # Proxy-Authorization; empty: none

    @classmethod
    def parse(cls, url: object) -> Proxy:
        """The proxy ``url`` names: ``http://[user[:password]@]host[:port]`` (port 80 unsaid).

        ValueError saying what is wrong with it, never quoting its credentials.
        """
        if not isinstance(url, str) or not url:
            raise ValueError(f"the proxy URL is not a non-empty string but {_shown(url)}")
        if len(url) > _MAX_PROXY_URL:
            raise ValueError(f"the proxy URL is {len(url)} characters long, over {_MAX_PROXY_URL}")
        if not url.isascii() or not url.isprintable() or " " in url:
            raise ValueError("the proxy URL has a space, a control or a non-ASCII character")
        parts = urllib.parse.urlsplit(url)
        where = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
        if parts.scheme.lower() != "http":
            raise ValueError(
                f"the proxy {_shown(where)} is not an http:// URL (range workers speak plain "
                "HTTP to a proxy, and TLS to S3 inside its CONNECT tunnel)"
            )
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"the proxy URL {_shown(where)} has a path, query or fragment")
        try:
            port = 80 if parts.port is None else parts.port
        except ValueError:
            port = 0
        if not 0 < port < 65536:
            raise ValueError(f"the proxy URL {_shown(where)} has a port that is not 1-65535")
        host = parts.hostname or ""
        if not _valid_host(host):
            raise ValueError(f"the proxy URL {_shown(where)} names no valid host")
        authorization = ""
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
            authorization = f"Basic {token}"
        return cls(host, port, authorization)

    @property
    def where(self) -> str:
        """The proxy as messages name it, without its credentials."""
        return f"http://{_bracketed(self.host)}:{self.port}"

    def headers(self) -> dict[str, str]:
        """The headers that present the credentials to the proxy (none without them)."""
        return {"Proxy-Authorization": self.authorization} if self.authorization else {}


def _valid_host(host: str) -> bool:
    """Whether ``host`` (as urlsplit gives it: no brackets) is an IP literal or a DNS name."""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
        return True
    return bool(_HOST_NAME.fullmatch(host))


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# A kept connection's key: scheme, the URL's host and port, the address it connects to.
_ConnectionKey = tuple[str, str, int, str]


@dataclass(frozen=True, slots=True)
class _Route:
    """Where a job's GETs go: the connection they take (its key) and what they ask there."""

    connection_key: _ConnectionKey
    target: str  # the request target: origin-form, or absolute-form to a proxy
    host: str  # the Host header: the URL's host (and port, unless the scheme's default)


def _route(job: GetJob, proxy: Proxy | None) -> _Route:
    """The route of ``job``'s GETs, directly or through ``proxy``.

    Final when the job's URL or address cannot be used (a bug in the daemon, or
    an endpoint this worker cannot reach through a proxy).
    """
    url = urllib.parse.urlsplit(job.url)
    host = url.hostname or ""
    if url.scheme not in ("http", "https") or not _valid_host(host):
        # Never the whole URL: it is presigned, so anyone holding it may send it.
        where = f"{url.scheme}://{url.netloc.rpartition('@')[2]}"
        failure = f"the job's URL has no http(s) scheme or no valid host: {_shown(where)}"
        raise Final({"kind": "internal", "message": failure})
    default = 443 if url.scheme == "https" else 80
    try:
        port = url.port or default
    except ValueError:
        raise Final({"kind": "internal", "message": "the job's URL has a bad port"}) from None
    authority = _bracketed(host) if port == default else f"{_bracketed(host)}:{port}"
    origin_form = f"{url.path or '/'}?{url.query}" if url.query else url.path or "/"
    if proxy is not None:
        if url.scheme == "https" and ":" in host and sys.version_info < (3, 12):
            failure = (
                f"the endpoint {host} is an IPv6 literal, which this Python's http.client "
                f"cannot name in a CONNECT through the proxy {proxy.where}; give S3 a DNS name"
            )
            raise Final({"kind": "connect", "message": failure})
        # A CONNECT tunnel carries origin-form requests; a plain proxy takes absolute form.
        target = origin_form if url.scheme == "https" else f"http://{authority}{origin_form}"
        return _Route((url.scheme, host, port, ""), target, authority)
    if job.address:
        try:
            ipaddress.ip_address(job.address)
        except ValueError:
            failure = f"the job's address is not an IP address: {_shown(job.address)}"
            raise Final({"kind": "internal", "message": failure}) from None
    return _Route((url.scheme, host, port, job.address), origin_form, authority)


class Transient(Exception):
    """Worth another attempt: the answer was transient or the body broke off."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(report.get("message") or report.get("code") or "transient failure")
        self.report = report


class Final(Exception):
    """Not worth another attempt: report it and stop the job."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(report.get("message") or report.get("code") or "failure")
        self.report = report


Connections = dict[_ConnectionKey, http.client.HTTPConnection]


class ProgressReport:
    """Bytes written per job, sent to the daemon at most every PROGRESS_SECONDS, in one message.

    However many bytes move, the daemon's event loop hears from a worker about ten
    times a second: a message per piece or per ``io_block`` would cost it time in
    proportion to the node's bandwidth. A job's last bytes go with its end
    (``finish``), sent under the same lock, so no count ever arrives after its job.
    """

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}
        self._due = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, job: int, count: int) -> None:
        with self._lock:
            self._pending[job] = self._pending.get(job, 0) + count
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
                self._thread.start()
        self._due.set()

    def finish(self, job: int, message: dict[str, Any]) -> None:
        """Send ``message`` (a job's end) with the job's bytes not reported yet."""
        with self._lock:
            self._send(message | {"bytes": self._pending.pop(job, 0)})

    def _run(self) -> None:
        while True:
            self._due.wait()
            time.sleep(PROGRESS_SECONDS)
            with self._lock:
                self._due.clear()
                batch, self._pending = self._pending, {}
                if batch:
                    self._send({"progress": {str(job): count for job, count in batch.items()}})


@dataclass(slots=True)
class JobRun:
    """One job under way in a worker thread: how far it got, and the hash of what it wrote."""

    job: GetJob
    fd: int
    buffer: memoryview
    gate: WriteGate
    connections: Connections
    # The same file opened with O_DIRECT (the disk tier), or None: the page cache then.
    direct_fd: int | None = None
    hasher: ChunkHasher = field(default_factory=ChunkHasher)
    done: int = 0
    silent: float = 0.0  # seconds this range's GETs waited for an answer that never came

    @property
    def answer_timeout(self) -> float:
        """How long the next GET may wait for S3's answer: the read timeout, within what is
        left of the first-byte deadline."""
        left = self.job.first_byte_timeout - self.silent
        return max(0.5, min(self.job.read_timeout, left))

    def write(self, piece: memoryview, progress: ProgressReport) -> None:
        """Hash a piece, write it at its place, and count it for the next progress report.

        With O_DIRECT, the whole blocks go straight to the disk and only an
        unaligned tail (a file's last bytes) through the page cache.
        """
        self.hasher.update(piece)
        position = self.job.start + self.done
        direct = 0
        if self.direct_fd is not None and position % DIRECT_ALIGNMENT == 0:
            direct = len(piece) - len(piece) % DIRECT_ALIGNMENT
        try:
            if direct:
                _write_all(self.direct_fd, piece[:direct], position)
            if direct < len(piece):
                _write_all(self.fd, piece[direct:], position + direct)
        except OSError as exc:
            failure = {"kind": "write", "errno": exc.errno or 0, "message": exc.strerror or ""}
            raise Final(failure) from None
        self.done += len(piece)
        progress.add(self.job.id, len(piece))


def _write_all(fd: int | None, data: memoryview, position: int) -> None:
    assert fd is not None
    written = os.pwrite(fd, data, position)
    while written < len(data):
        written += os.pwrite(fd, data[written:], position + written)


def open_direct(fd: int) -> int | None:
    """The file of ``fd`` opened again with O_DIRECT, or None where its filesystem has none.

    Through /proc/self/fd, so the new description is of the same file (no path
    is looked up), and the daemon's own descriptor keeps the page cache.
    """
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return None  # tmpfs, or a filesystem without direct I/O: the page cache it is


class RangeWorker:
    """The worker's state: its control socket, queued jobs, threads and pulls."""

    def __init__(self, control: socket.socket) -> None:
        self._control = control
        self._send_lock = threading.Lock()
        self._jobs: list[tuple[GetJob, int]] = []
        self._jobs_ready = threading.Condition()
        self._idle_threads = 0
        self._pulls: dict[int, WriteGate] = {}
        self._windows: dict[Body, tuple[float, int, WriteGate]] = {}
        self._windows_lock = threading.Lock()
        # Made at the first HTTPS connection, from the daemon's "tls" settings (the
        # system's CAs if none came): loading CAs costs about 55 ms of CPU, which an
        # http:// endpoint never needs. The lock: job threads make it, the control
        # thread replaces the settings.
        self._tls_settings: dict[str, Any] = {}
        self._tls: ssl.SSLContext | None = None
        self._tls_lock = threading.Lock()
        self._proxy: Proxy | None = None
        # Why the proxy the daemon named cannot be used: every job fails saying so.
        self._proxy_problem: str | None = None
        self._watchdog: threading.Thread | None = None
        self._progress = ProgressReport(self.send)

    # -- the control socket --------------------------------------------------------------

    def serve(self) -> None:
        """Take messages until the daemon closes the socket."""
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()
        while True:
            data, fds, _flags, _address = socket.recv_fds(self._control, MAX_MESSAGE, 4)
            if not data:
                for fd in fds:
                    os.close(fd)
                return
            self._handle(decode(data), fds)

    def send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            self._control.send(encode(message))

    def _beat(self) -> None:
        """Say "alive" every HEARTBEAT_SECONDS until the daemon's socket is gone."""
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            try:
                self.send({"alive": 1})
            except OSError:
                return

    def _handle(self, message: dict[str, Any], fds: list[int]) -> None:
        if "get" in message:
            job = GetJob(**message["get"])
            [fd] = fds
            self._queue(job, fd)
        elif "stop" in message:
            self._stop(int(message["stop"]))
        elif "tls" in message:
            self._set_transport(message)
        else:
            for fd in fds:
                os.close(fd)
            raise ValueError(f"unknown range-worker message {sorted(message)}")

    def _set_transport(self, message: dict[str, Any]) -> None:
        """Take the transport settings: ``{"tls": {"verify", "cafile", "proxy"}}``.

        The proxy (a URL, or None for none) may also come beside ``tls``, where
        it wins. A proxy URL that cannot be used is kept as the reason every job
        fails, rather than ending the worker.
        """
        settings = dict(message["tls"])
        with self._tls_lock:
            self._tls_settings, self._tls = settings, None
        proxy = message.get("proxy", settings.get("proxy"))
        self._proxy, self._proxy_problem = None, None
        if proxy is not None:
            try:
                self._proxy = Proxy.parse(proxy)
            except ValueError as exc:
                self._proxy_problem = f"the proxy cannot be used: {exc}"

    def _context(self) -> ssl.SSLContext:
        """The TLS context of the daemon's transport settings (the defaults if none came)."""
        with self._tls_lock:
            if self._tls is None:
                cafile = self._tls_settings.get("cafile")
                try:
                    self._tls = _tls_context(self._tls_settings)
                except OSError as exc:  # ssl.SSLError included: a file that is not PEM
                    where = f"the CA bundle {cafile!r}" if cafile else "the system's CAs"
                    raise OSError(f"{where} could not be loaded: {exc}") from exc
            return self._tls

    def _queue(self, job: GetJob, fd: int) -> None:
        gate = self._pulls.setdefault(job.pull, WriteGate())
        if gate.stopped.is_set():
            os.close(fd)
            return
        with self._jobs_ready:
            self._jobs.append((job, fd))
            if self._idle_threads:
                self._jobs_ready.notify()
                return
        threading.Thread(target=self._run_jobs, name=f"range-{job.id}", daemon=True).start()

    def _stop(self, pull: int) -> None:
        """Cut the pull's bodies, drop its queued jobs, and say so once nothing writes."""
        gate = self._pulls.setdefault(pull, WriteGate())
        gate.stop("the pull stopped")
        with self._jobs_ready:
            dropped = [fd for job, fd in self._jobs if job.pull == pull]
            self._jobs = [(job, fd) for job, fd in self._jobs if job.pull != pull]
        for fd in dropped:
            os.close(fd)

        def settle() -> None:
            gate.wait_idle()
            self._pulls.pop(pull, None)
            self.send({"stopped": pull})

        threading.Thread(target=settle, name=f"stop-{pull}", daemon=True).start()

    # -- worker threads --------------------------------------------------------------------

    def _run_jobs(self) -> None:
        """A worker thread: one buffer and its own connections, jobs until none is left."""
        # mmap: page-aligned memory, as O_DIRECT writes need.
        buffer = memoryview(mmap.mmap(-1, mmap.PAGESIZE))
        connections: Connections = {}
        try:
            while (taken := self._take_job()) is not None:
                job, fd = taken
                if len(buffer) < job.step:
                    buffer = memoryview(mmap.mmap(-1, job.step))
                try:
                    self._run(job, fd, buffer[: job.step], connections)
                except Exception as exc:  # a bug here must fail the pull, never hang it
                    failure = {"kind": "internal", "message": f"{type(exc).__name__}: {exc}"}
                    self._progress.finish(job.id, {"failed": job.id, "attempts": 1} | failure)
                finally:
                    os.close(fd)
        finally:
            for connection in connections.values():
                connection.close()

    def _take_job(self) -> tuple[GetJob, int] | None:
        with self._jobs_ready:
            self._idle_threads += 1
            try:
                # An idle thread keeps its connections for the next job a while, then ends.
                self._jobs_ready.wait_for(lambda: bool(self._jobs), timeout=60)
                return self._jobs.pop(0) if self._jobs else None
            finally:
                self._idle_threads -= 1

    def _run(self, job: GetJob, fd: int, buffer: memoryview, connections: Connections) -> None:
        """Write one range, resuming after the last good byte on retry; report how it ended."""
        gate = self._pulls.setdefault(job.pull, WriteGate())
        direct_fd = open_direct(fd) if job.direct else None
        run = JobRun(job, fd, buffer, gate, connections, direct_fd)
        try:
            self._attempts(run)
        finally:
            if direct_fd is not None:
                os.close(direct_fd)

    def _end(self, job: GetJob, failure: dict[str, Any]) -> None:
        """Report that ``job`` failed (with its bytes not reported yet)."""
        self._progress.finish(job.id, {"failed": job.id} | failure)

    def _attempts(self, run: JobRun) -> None:
        """Try the range until it is written, the retries are spent, or the pull stops."""
        job, gate = run.job, run.gate
        attempts = Attempts(job.retries)
        throttled = Attempts(THROTTLE_RETRIES_PER_RETRY * job.retries)
        try:
            while run.done < job.length:
                try:
                    self._get(run)
                except Transient as exc:
                    throttling = self._after_failure(run, exc.report)
                    tried = attempts.failures + throttled.failures + 1
                    if run.silent >= job.first_byte_timeout - 0.5:
                        silence = {"kind": "silent", "waited": run.silent}
                        self._end(job, {"attempts": tried} | silence)
                        return
                    delay = (throttled if throttling else attempts).next_delay()
                    if delay is None:
                        self._end(job, {"attempts": tried} | exc.report)
                        return
                    if gate.stopped.wait(delay):
                        return
        except Stopped:
            return
        except Final as exc:
            tried = attempts.failures + throttled.failures + 1
            self._end(job, {"attempts": tried} | exc.report)
            return
        self._progress.finish(job.id, {"done": job.id, "digest": run.hasher.digest().hex()})

    def _after_failure(self, run: JobRun, report: dict[str, Any]) -> bool:
        """What a transient failure tells beyond this range; whether S3 was throttling.

        S3 asked the node to slow down: the daemon's limit of GETs in flight hears
        it, and the attempt counts against the throttling budget, not the range's retries.
        The job's address is unreachable: the next attempts resolve the name instead.
        """
        run.silent += float(report.get("waited", 0.0))
        if report.get("kind") == "connect" and run.job.address:
            run.job = dataclasses.replace(run.job, address="")
        status, code = int(report.get("status", 0)), str(report.get("code", ""))
        if report.get("kind") != "answer" or not is_throttling(status, code):
            return False
        self.send({"throttled": run.job.id, "code": code or str(status)})
        return True

    def _get(self, run: JobRun) -> None:
        """One GET for the rest of the range, advancing ``run.done`` past every good byte."""
        if run.gate.stopped.is_set():
            raise Stopped
        job, gate = run.job, run.gate
        wanted = job.length - run.done
        connection, sock, response = self._request(run, wanted)
        body = Body(sock, time.monotonic())
        gate.enter(body)
        self._watch(body, job, gate)
        try:
            got = _read_body(
                response,
                sock,
                body,
                run.buffer,
                wanted=wanted,
                write=lambda p: run.write(p, self._progress),
            )
        except _BROKEN_OFF as exc:
            connection.close()
            if gate.stopped.is_set():
                raise Stopped from None
            reason = body.cut_reason or f"{type(exc).__name__}: {exc}"
            raise Transient({"kind": "broken", "message": reason}) from None
        finally:
            self._unwatch(body)
            gate.leave(body)
        if got < wanted:
            connection.close()
            if gate.stopped.is_set():
                raise Stopped
            reason = body.cut_reason or f"the body ended {wanted - got} bytes short"
            raise Transient({"kind": "broken", "message": reason})
        response.close()  # the whole body was read: the connection serves the next GET
        if response.will_close:
            connection.close()
            for key in [p for p, c in run.connections.items() if c is connection]:
                del run.connections[key]

    def _request(
        self, run: JobRun, wanted: int
    ) -> tuple[http.client.HTTPConnection, socket.socket, http.client.HTTPResponse]:
        """Send the GET and judge S3's answer; a connection kept from before gets one redo."""
        job, connections = run.job, run.connections
        start = job.start + run.done
        if self._proxy_problem is not None:
            raise Final({"kind": "connect", "message": self._proxy_problem})
        way = _route(job, self._proxy)
        headers = {
            "Host": way.host,
            "Range": f"bytes={start}-{start + wanted - 1}",
            "If-Match": job.etag,
            "User-Agent": USER_AGENT,
        }
        if self._proxy is not None and way.connection_key[0] == "http":
            headers |= self._proxy.headers()  # to the proxy itself, which takes the GET
        key = way.connection_key
        connection, sock, response = self._exchange(key, run, way.target, headers)
        if response.status == 407 and self._proxy is not None:
            connection.close()
            connections.pop(key, None)
            raise Final({"kind": "connect", "message": _proxy_refusal(self._proxy, 407)})
        if response.status in (200, 206):
            length = response.getheader("Content-Length")
            if length is None or int(length) != wanted:
                connection.close()
                connections.pop(key, None)
                raise Transient(
                    {"kind": "broken", "message": f"S3 answered {length} bytes; expected {wanted}"}
                )
            return connection, sock, response
        code = _error_code(response)
        connection.close()
        connections.pop(key, None)
        report = {"kind": "answer", "status": response.status, "code": code}
        if is_transient_answer(response.status, code):
            raise Transient(report)
        raise Final(report)

    def _exchange(
        self, key: _ConnectionKey, run: JobRun, target: str, headers: dict[str, str]
    ) -> tuple[http.client.HTTPConnection, socket.socket, http.client.HTTPResponse]:
        """Send the request and read the answer's head; a kept connection gets one redo.

        An answer that does not come within ``run.answer_timeout`` is a transient
        failure that says how long it waited, counted against the first-byte deadline.
        """
        job, connections = run.job, run.connections
        reused = key in connections
        while True:
            connection = connections.get(key)
            if connection is None or connection.sock is None:
                connection = self._connect(key, job, connections)
            # Taken now: http.client lets go of a connection the server will close.
            sock = connection.sock
            assert sock is not None
            # S3's answer must come within the read timeout (the body is read without one).
            waiting = run.answer_timeout
            sock.settimeout(waiting)
            try:
                connection.request("GET", target, headers=headers)
                return connection, sock, connection.getresponse()
            except TimeoutError:
                connection.close()
                connections.pop(key, None)
                silence = {"kind": "silent", "message": "no answer", "waited": waiting}
                raise Transient(silence) from None
            except _BROKEN_OFF as exc:
                connection.close()
                connections.pop(key, None)
                if not reused:
                    failure = {"kind": "connect", "message": f"{type(exc).__name__}: {exc}"}
                    raise Transient(failure) from None
                reused = False  # the server closed a kept connection while it sat idle

    def _connect(
        self, key: _ConnectionKey, job: GetJob, connections: Connections
    ) -> http.client.HTTPConnection:
        """A new connection for ``key``, kept in ``connections``; Transient or Final if none.

        A certificate that fails the check, or a proxy that refuses the tunnel for
        good (credentials, its rules), is final; anything else is worth a retry.
        """
        try:
            connection = self._open(key, job)
        except ssl.SSLCertVerificationError as exc:
            raise Final({"kind": "connect", "message": f"{type(exc).__name__}: {exc}"}) from None
        except _BROKEN_OFF as exc:
            failure = {"kind": "connect", "message": f"{type(exc).__name__}: {exc}"}
            refused = _TUNNEL_REFUSED.search(str(exc)) if self._proxy is not None else None
            if refused is None:
                raise Transient(failure) from None
            assert self._proxy is not None
            status = int(refused.group(1))
            failure["message"] = _proxy_refusal(self._proxy, status, key)
            if status in _TUNNEL_TRANSIENT:
                raise Transient(failure) from None
            raise Final(failure) from None
        assert connection.sock is not None
        connection.sock.settimeout(job.read_timeout)
        connections[key] = connection
        return connection

    def _open(self, key: _ConnectionKey, job: GetJob) -> http.client.HTTPConnection:
        """Connect for ``key``: through the proxy, to the job's address, or to the URL's host.

        Whichever way, TLS is with the URL's host: its name is the server name
        sent and the one the certificate must carry.
        """
        scheme, host, port, address = key
        timeout, proxy = job.connect_timeout, self._proxy
        connection: http.client.HTTPConnection
        if proxy is not None and scheme == "https":
            connection = http.client.HTTPSConnection(
                proxy.host, proxy.port, timeout=timeout, context=self._context()
            )
            tunnel = {"Host": f"{_bracketed(host)}:{port}"} | proxy.headers()
            connection.set_tunnel(host, port, headers=tunnel)
            connection.connect()  # CONNECT, then TLS with ``host`` inside the tunnel
            return connection
        if proxy is not None:
            connection = http.client.HTTPConnection(proxy.host, proxy.port, timeout=timeout)
            connection.connect()
            return connection
        # Connected here, not by http.client: to ``address`` when the job names one.
        raw = socket.create_connection((address or host, port), timeout)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if scheme != "https":
                connection = http.client.HTTPConnection(host, port, timeout=timeout)
                connection.sock = raw
                return connection
            tls = self._context()
            sock = tls.wrap_socket(raw, server_hostname=host)
        except BaseException:
            raw.close()
            raise
        connection = http.client.HTTPSConnection(host, port, timeout=timeout, context=tls)
        connection.sock = sock
        return connection

    # -- the low-speed watchdog ------------------------------------------------------------

    def _watch(self, body: Body, job: GetJob, gate: WriteGate) -> None:
        with self._windows_lock:
            self._windows[body] = (job.window, job.low_speed_limit, gate)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch_speed, daemon=True)
                self._watchdog.start()

    def _unwatch(self, body: Body) -> None:
        with self._windows_lock:
            self._windows.pop(body, None)

    def _watch_speed(self) -> None:
        """Cut every body that moved fewer than its low-speed limit's bytes over a window."""
        while True:
            with self._windows_lock:
                watched = list(self._windows.items())
            shortest = min((window for window, _, _ in self._windows.values()), default=1.0)
            time.sleep(max(0.05, shortest / 4))
            now = time.monotonic()
            for body, (window, limit, gate) in watched:
                reason = slow_body_reason(body, now, window=window, limit=limit)
                if reason is not None:
                    gate.cut(body, reason)


def _read_body(
    response: http.client.HTTPResponse,
    sock: socket.socket,
    body: Body,
    buffer: memoryview,
    *,
    wanted: int,
    write: Callable[[memoryview], None],
) -> int:
    """Read ``wanted`` body bytes in buffer-sized pieces, handing each full one to ``write``.

    The first bytes may already sit in http.client's buffered reader (read with
    the headers); the rest come straight from the socket, one ``recv_into`` per
    TLS record, without http.client's three Python layers per record. A body
    that breaks off loses at most the piece it was filling.
    """
    got = 0
    assert response.fp is not None
    # Bytes http.client read with the head go first; the buffer is written only when full
    # (or at the end of the body), so writes stay aligned for O_DIRECT.
    filled = response.fp.readinto1(buffer[: min(len(buffer), wanted)])
    body.received = filled
    # Blocking, one wake-up per TLS record: with a timeout, each record costs a
    # poll and more trips through the interpreter lock. A stalled body is cut by
    # the low-speed watchdog, which shuts the socket down.
    sock.settimeout(None)
    receive = sock.recv_into
    while got < wanted:
        room = min(len(buffer), wanted - got)
        while filled < room:
            count = receive(buffer[filled:room])
            if not count:
                break
            filled += count
            body.received += count
        if filled < room:
            break  # the body ended early: the caller judges why, and resumes after ``got``
        write(buffer[:room])
        got += room
        filled = 0
    response.length = 0  # read past http.client: tell it the body is done
    return got


def _proxy_refusal(proxy: Proxy, status: int, key: _ConnectionKey | None = None) -> str:
    """What a proxy's refusal (its HTTP status) means, for the daemon's message."""
    asked = f"a tunnel to {_bracketed(key[1])}:{key[2]}" if key else "a GET"
    why = f"the proxy {proxy.where} refused {asked} with HTTP {status}"
    if status == 407:
        if proxy.authorization:
            return f"{why}: it did not accept the user and password in the proxy URL"
        return f"{why}: it wants credentials (http://user:password@host:port in the proxy URL)"
    return why


def _error_code(response: http.client.HTTPResponse) -> str:
    """S3's error code from an error answer's XML body (its HTTP status when it has none)."""
    with contextlib.suppress(*_BROKEN_OFF):
        match = _CODE.search(response.read(_MAX_ERROR_BODY))
        if match:
            return match.group(1).decode("ascii", "replace")
    return str(response.status)


def _tls_context(settings: dict[str, Any]) -> ssl.SSLContext:
    """Verify S3's certificate as botocore would: its CA bundle, or not at all if told so."""
    if not settings.get("verify", True):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=settings.get("cafile") or None)


def main(argv: list[str] | None = None) -> int:
    """Run a range worker on the control socket the daemon passed; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m agent.source.range_worker")
    parser.add_argument("--control-fd", type=int, required=True)
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    try:
        RangeWorker(control).serve()
    finally:
        # Threads still blocked on S3 after the daemon went away write nothing more.
        os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
