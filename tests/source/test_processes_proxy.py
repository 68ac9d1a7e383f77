"""The processes data plane through an HTTP proxy, and to an address of the daemon's choosing.

Against the real S3 server (moto, in a process of its own), a real forward proxy
(``HttpProxy``) and, for HTTPS, a TLS front that relays to the server with a
certificate made here. The endpoint is named ``s3.prewarm.invalid``: a name no
resolver answers (RFC 6761), so a GET that reached the server went through the
proxy (whose own ``hosts`` name it) or to the job's address, never anywhere else.
The server ignores the bucket in the Host header, so any endpoint name serves.

Two levels: whole pulls through the agent's puller (the environment's proxy
variables reach the workers), and single jobs sent to a real range-worker
process over its control socket, as the daemon sends them, where a test needs
a job of its own (an ``address``, wrong proxy credentials).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from source_helpers import restored_environment
from test_data_planes import assert_identical, running_agent, sent_by

from agent import SourceUnavailable
from agent._vocabulary import PullOptions
from agent.check.hashes import ChunkHasher
from agent.source.proxies import proxy_for
from agent.source.range_worker import (
    MAX_MESSAGE,
    USER_AGENT,
    GetJob,
    decode,
    encode,
    job_message,
)
from agent.testing import HttpProxy, S3Server, SampleModel, upload_model
from agent.testing._process import SOURCE_ROOT

PROCESSES = PullOptions(data_plane="processes")
NAME = "s3.prewarm.invalid"
BUCKET = "proxied"
BLOB = "blobs/three-mib"
BLOB_BYTES = os.urandom(3 * 1024 * 1024 + 12_345)


# -- the server, its name, its certificate ---------------------------------------------------


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    # The proxy and endpoint variables are the process environment's; give it back.
    with restored_environment():
        yield


@pytest.fixture(scope="module")
def named_s3() -> Iterator[S3Server]:
    """An S3 server of this module's, serving path-style whatever the Host header names."""
    with S3Server(env={"S3_IGNORE_SUBDOMAIN_BUCKETNAME": "true"}) as server:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key=BLOB, Body=BLOB_BYTES)
        yield server


@pytest.fixture(scope="module")
def named_model(
    named_s3: S3Server, small_model_source: tuple[Path, MappingProxyType[str, Any]]
) -> SampleModel:
    """The small model in the named server's bucket."""
    directory, tensors = small_model_source
    return upload_model(named_s3.client(), BUCKET, "models/small", directory, tensors=tensors)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate (and key) for NAME only: no IP address in it."""
    return _certificate(tmp_path_factory.mktemp("tls"), NAME)


def _certificate(directory: Path, name: str) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@dataclasses.dataclass
class Front:
    """A listener on 127.0.0.1 that relays each connection to the S3 server, recording the TLS
    server name each client sent and the Host header of each connection's first request."""

    port: int = 0
    server_names: list[str | None] = dataclasses.field(default_factory=list)
    hosts: list[str] = dataclasses.field(default_factory=list)


@asynccontextmanager
async def front(upstream: S3Server, certificate: tuple[Path, Path] | None) -> AsyncIterator[Front]:
    """A Front in this event loop: TLS with ``certificate``, or plain HTTP without one."""
    seen = Front()
    context = None
    if certificate is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*certificate)
        context.sni_callback = lambda _sock, name, _context: seen.server_names.append(name)
    tasks: set[asyncio.Task[None]] = set()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        origin_reader, origin_writer = await asyncio.open_connection(upstream.host, upstream.port)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.decode("latin-1").split("\r\n"):
                if line.lower().startswith("host:"):
                    seen.hosts.append(line.split(":", 1)[1].strip())
            origin_writer.write(head)
            await asyncio.gather(_pipe(reader, origin_writer), _pipe(origin_reader, writer))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            origin_writer.close()
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(relay, "127.0.0.1", 0, ssl=context)
    seen.port = server.sockets[0].getsockname()[1]
    async with server:
        try:
            yield seen
        finally:
            server.close()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while piece := await reader.read(256 * 1024):
            writer.write(piece)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")


def _use(s3: S3Server, endpoint: str, **variables: str) -> None:
    """Point botocore at ``endpoint`` with ``s3``'s keys; set the proxy ``variables``."""
    os.environ.update(s3.env())
    _no_proxies()
    os.environ.update(variables)
    os.environ["AWS_ENDPOINT_URL"] = endpoint


def _no_proxies() -> None:
    """Unset every proxy variable (the server's request log is read without a proxy)."""
    for name in PROXY_VARIABLES:
        os.environ.pop(name, None)


# -- whole pulls through the agent ------------------------------------------------------------


async def test_an_http_proxy_carries_every_ranged_get_of_a_pull(
    tmp_path: Path, named_s3: S3Server, named_model: SampleModel
) -> None:
    """With HTTP_PROXY set, a pull over http lands byte for byte and every ranged GET the
    workers sent went to the proxy in absolute form, naming the endpoint's host."""
    endpoint = f"http://{NAME}:{named_s3.port}"
    with HttpProxy(hosts={NAME: "127.0.0.1"}) as proxy:
        named_s3.clear_requests()
        _use(named_s3, endpoint, HTTP_PROXY=proxy.url)
        async with running_agent(tmp_path, named_s3, endpoint) as agent:
            result = await agent.ensure(named_model.uri, PROCESSES)
        _no_proxies()
        relayed = [r for r in proxy.served("request") if r.user_agent == USER_AGENT]
    assert_identical(result, named_model)
    gets = [r for r in named_s3.requests(bucket=BUCKET) if r.method == "GET" and r.range]
    assert gets
    assert {sent_by(r.user_agent) for r in gets} == {"processes"}
    assert sorted(r.range or "" for r in relayed) == sorted(r.range or "" for r in gets)
    assert all(r.target.startswith(f"{endpoint}/{BUCKET}/") for r in relayed)
    assert {r.host for r in relayed} == {f"{NAME}:{named_s3.port}"}
    assert {r.status for r in relayed} == {206}


async def test_an_https_pull_goes_through_connect_tunnels_to_the_checked_origin(
    tmp_path: Path, named_s3: S3Server, named_model: SampleModel, certificate: tuple[Path, Path]
) -> None:
    """With HTTPS_PROXY set, a pull over https lands byte for byte through CONNECT tunnels to
    the endpoint, TLS inside them sent to and checked against the endpoint's name."""
    async with front(named_s3, certificate) as tls:
        endpoint = f"https://{NAME}:{tls.port}"
        with HttpProxy(hosts={NAME: "127.0.0.1"}) as proxy:
            named_s3.clear_requests()
            _use(named_s3, endpoint, HTTPS_PROXY=proxy.url, AWS_CA_BUNDLE=str(certificate[0]))
            async with running_agent(tmp_path, named_s3, endpoint) as agent:
                result = await agent.ensure(named_model.uri, PROCESSES)
            _no_proxies()
            tunnels = proxy.served("tunnel")
    assert_identical(result, named_model)
    gets = [r for r in named_s3.requests(bucket=BUCKET) if r.method == "GET" and r.range]
    assert {sent_by(r.user_agent) for r in gets} == {"processes"}
    assert tunnels
    assert {(t.target, t.status) for t in tunnels} == {(f"{NAME}:{tls.port}", 200)}
    assert set(tls.server_names) == {NAME}
    assert proxy.served("request") == []


async def test_a_proxy_that_wants_credentials_gets_them_from_the_proxy_url(
    tmp_path: Path, named_s3: S3Server, named_model: SampleModel
) -> None:
    """The user and password in HTTP_PROXY (percent-encoded there) reach a proxy that
    demands them with every worker's GET, which it then relays: none is refused."""
    endpoint = f"http://{NAME}:{named_s3.port}"
    credentials = ("prewarm", "p@ss:w/rd")
    with HttpProxy(credentials=credentials, hosts={NAME: "127.0.0.1"}) as proxy:
        _use(named_s3, endpoint, HTTP_PROXY=proxy.authorized_url)
        async with running_agent(tmp_path, named_s3, endpoint) as agent:
            result = await agent.ensure(named_model.uri, PROCESSES)
        relayed = [r for r in proxy.served("request") if r.user_agent == USER_AGENT]
        refused = proxy.refused
    assert_identical(result, named_model)
    assert relayed
    assert refused == 0


async def test_no_proxy_naming_the_endpoint_sends_the_gets_around_the_proxy(
    tmp_path: Path, named_s3: S3Server, named_model: SampleModel
) -> None:
    """HTTP_PROXY set and the endpoint named in NO_PROXY: the pull lands and the proxy is
    asked nothing, by the workers or by the daemon's own requests."""
    endpoint = named_s3.endpoint_url
    with HttpProxy() as proxy:
        _use(named_s3, endpoint, HTTP_PROXY=proxy.url, NO_PROXY=f"localhost,{named_s3.host}")
        async with running_agent(tmp_path, named_s3, endpoint) as agent:
            result = await agent.ensure(named_model.uri, PROCESSES)
        served = proxy.served()
    assert_identical(result, named_model)
    assert served == []


# -- which proxy the daemon gives its workers ------------------------------------------------


def test_proxy_for_reads_the_variables_botocore_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTPS_PROXY serves https endpoints and HTTP_PROXY http ones; a proxy without a scheme
    is http://; NO_PROXY by host suffix, by host:port, or * turns the proxy off."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "proxy.internal:3128")
    monkeypatch.setenv("HTTP_PROXY", "http://plain.internal:8080")
    assert proxy_for("https://s3.us-east-1.amazonaws.com") == "http://proxy.internal:3128"
    assert proxy_for("http://minio.internal:9000") == "http://plain.internal:8080"
    monkeypatch.setenv("NO_PROXY", "amazonaws.com,minio.internal:9000")
    assert proxy_for("https://s3.us-east-1.amazonaws.com") is None
    assert proxy_for("http://minio.internal:9000") is None
    assert proxy_for("http://minio.internal:9001") == "http://plain.internal:8080"
    monkeypatch.setenv("NO_PROXY", "*")
    assert proxy_for("http://minio.internal:9001") is None


@pytest.mark.parametrize(
    ("proxy", "says"),
    [
        ("https://user:hunter2@proxy.internal:3128", "not an http:// URL"),
        ("socks5://user:hunter2@proxy.internal:1080", "not an http:// URL"),
        ("http://user:hunter2@proxy.internal:99999", "port that is not 1-65535"),
        ("http://user:hunter2@proxy.internal:0", "port that is not 1-65535"),
        ("http://user:hunter2@proxy.internal:3128/path", "has a path"),
        ("http://user:hunter2@proxy.internal\r\nX-Evil: 1", "control"),
        ("http://user:hunter2@", "names no valid host"),
    ],
)
def test_a_proxy_the_workers_cannot_use_is_refused_without_repeating_its_password(
    proxy: str, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An https:// or SOCKS proxy, a bad port, a path, control characters or no host: the
    daemon refuses it as SourceUnavailable saying what is wrong, and never quotes the password."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", proxy)
    with pytest.raises(SourceUnavailable, match=says) as caught:
        proxy_for("https://s3.us-east-1.amazonaws.com")
    assert "hunter2" not in str(caught.value)
    assert "HTTPS_PROXY" in str(caught.value)


# -- single jobs in a range worker -------------------------------------------------------------


class WorkerProcess:
    """A range-worker process driven over its control socket, as the daemon drives one."""

    def __init__(self, etag: str) -> None:
        self.etag = etag
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-s", "-m", "agent.source.range_worker"]
        with child:
            self.process = subprocess.Popen(
                [*argv, "--control-fd", str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                env={"PATH": os.defpath, "PYTHONPATH": str(SOURCE_ROOT)},
            )
        self.sock = parent
        self._jobs = 0

    def run(
        self, transport: dict[str, object], url: str, path: Path, *, address: str = ""
    ) -> dict[str, Any]:
        """Send the transport settings and one job GETting all of BLOB into ``path``; its end."""
        self._jobs += 1
        job = GetJob(
            id=self._jobs,
            pull=self._jobs,
            url=url,
            etag=self.etag,
            start=0,
            length=len(BLOB_BYTES),
            step=256 * 1024,
            retries=0,
            window=10.0,
            low_speed_limit=1,
            connect_timeout=5.0,
            read_timeout=10.0,
            first_byte_timeout=20.0,
            direct=False,
            address=address,
        )
        socket.send_fds(self.sock, [encode({"tls": transport})], [])
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            socket.send_fds(self.sock, [encode(job_message(job))], [fd])
        finally:
            os.close(fd)
        self.sock.settimeout(30)
        while True:
            data, _fds, _flags, _address = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
            assert data, f"the range worker exited ({self.process.poll()})"
            message = decode(data)
            if job.id in (message.get("done"), message.get("failed")):
                return message

    def close(self) -> None:
        self.sock.close()
        self.process.wait(timeout=10)


@pytest.fixture
def worker(named_s3: S3Server) -> Iterator[WorkerProcess]:
    """A range-worker process of the test's own, for GETs of BLOB at its ETag."""
    etag = named_s3.client().head_object(Bucket=BUCKET, Key=BLOB)["ETag"]
    running = WorkerProcess(str(etag))
    try:
        yield running
    finally:
        running.close()


def _presigned(s3: S3Server, endpoint: str, etag: str) -> str:
    """A GET of BLOB at ``etag`` through ``endpoint``, presigned (SigV4, If-Match signed)."""
    client = dataclasses.replace(s3.endpoint, url=endpoint).client(signature_version="s3v4")
    url: str = client.generate_presigned_url(
        "get_object", Params={"Bucket": BUCKET, "Key": BLOB, "IfMatch": etag}, ExpiresIn=600
    )
    return url


def _digest(data: bytes) -> str:
    hasher = ChunkHasher()
    hasher.update(data)
    return hasher.digest().hex()


def _transport(cafile: Path | None = None, proxy: str | None = None) -> dict[str, object]:
    return {"verify": True, "cafile": str(cafile) if cafile else None, "proxy": proxy}


async def test_a_job_with_an_address_connects_there_and_names_the_urls_host(
    tmp_path: Path, named_s3: S3Server, worker: WorkerProcess
) -> None:
    """A job for an endpoint no resolver knows, with address 127.0.0.1: the worker connects to
    the address and its request's Host header is still the URL's host and port."""
    async with front(named_s3, None) as plain:
        url = _presigned(named_s3, f"http://{NAME}:{plain.port}", worker.etag)
        ending = await asyncio.to_thread(
            worker.run, _transport(), url, tmp_path / "blob", address="127.0.0.1"
        )
    assert ending.get("done"), ending
    assert ending["digest"] == _digest(BLOB_BYTES)
    assert (tmp_path / "blob").read_bytes() == BLOB_BYTES
    assert plain.hosts == [f"{NAME}:{plain.port}"]


async def test_a_job_with_an_address_checks_the_certificate_against_the_urls_host(
    tmp_path: Path, named_s3: S3Server, certificate: tuple[Path, Path], worker: WorkerProcess
) -> None:
    """Over https to address 127.0.0.1, TLS sends the URL's host as the server name and the
    certificate (which names that host and no address) passes the check."""
    async with front(named_s3, certificate) as tls:
        url = _presigned(named_s3, f"https://{NAME}:{tls.port}", worker.etag)
        ending = await asyncio.to_thread(
            worker.run, _transport(certificate[0]), url, tmp_path / "blob", address="127.0.0.1"
        )
    assert ending.get("done"), ending
    assert (tmp_path / "blob").read_bytes() == BLOB_BYTES
    assert tls.server_names == [NAME]
    assert tls.hosts == [f"{NAME}:{tls.port}"]


@pytest.mark.parametrize("way", ["address", "tunnel"])
async def test_a_certificate_for_another_name_fails_the_job(
    way: str, tmp_path: Path, named_s3: S3Server, worker: WorkerProcess
) -> None:
    """Neither the address nor a proxy's tunnel changes whose certificate is checked: one that
    does not name the URL's host fails the job at once, as a connection failure naming the
    certificate."""
    other = _certificate(tmp_path, "other.prewarm.invalid")
    async with contextlib.AsyncExitStack() as stack:
        tls = await stack.enter_async_context(front(named_s3, other))
        url = _presigned(named_s3, f"https://{NAME}:{tls.port}", worker.etag)
        proxy = None
        if way == "tunnel":
            proxy = stack.enter_context(HttpProxy(hosts={NAME: "127.0.0.1"})).url
        ending = await asyncio.to_thread(
            worker.run,
            _transport(other[0], proxy=proxy),
            url,
            tmp_path / "blob",
            address="127.0.0.1" if way == "address" else "",
        )
    assert ending.get("failed"), ending
    assert ending["kind"] == "connect"
    assert "certificate" in ending["message"].lower()
    assert ending["attempts"] == 1


async def test_an_address_that_is_not_an_ip_literal_fails_the_job(
    tmp_path: Path, named_s3: S3Server, worker: WorkerProcess
) -> None:
    """A job's address must be an IP address: a host name (or anything else) is refused
    before any connection, quoted in the failure."""
    url = _presigned(named_s3, f"http://{NAME}:{named_s3.port}", worker.etag)
    ending = await asyncio.to_thread(
        worker.run, _transport(), url, tmp_path / "blob", address="evil.example\r\nX: 1"
    )
    assert ending.get("failed"), ending
    assert ending["kind"] == "internal"
    assert "not an IP address" in ending["message"]


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_proxy_that_refuses_the_credentials_fails_the_job_saying_so(
    scheme: str,
    tmp_path: Path,
    named_s3: S3Server,
    certificate: tuple[Path, Path],
    worker: WorkerProcess,
) -> None:
    """A proxy answering 407 (to a CONNECT over https, to the GET itself over http) fails the
    job at once, saying the proxy did not accept the URL's credentials, never quoting them."""
    async with contextlib.AsyncExitStack() as stack:
        port = named_s3.port
        if scheme == "https":
            port = (await stack.enter_async_context(front(named_s3, certificate))).port
        proxy = stack.enter_context(HttpProxy(credentials=("prewarm", "right")))
        wrong = f"http://prewarm:wrong-password@127.0.0.1:{proxy.port}"
        url = _presigned(named_s3, f"{scheme}://{NAME}:{port}", worker.etag)
        transport = _transport(certificate[0], proxy=wrong)
        ending = await asyncio.to_thread(worker.run, transport, url, tmp_path / "blob")
        refused = proxy.refused
    assert ending.get("failed"), ending
    assert ending["kind"] == "connect"
    assert "did not accept the user and password" in ending["message"]
    assert "wrong-password" not in ending["message"]
    assert ending["attempts"] == 1
    assert refused == 1


async def test_a_proxy_url_the_worker_cannot_use_fails_its_jobs_not_the_worker(
    tmp_path: Path, named_s3: S3Server, worker: WorkerProcess
) -> None:
    """Transport settings naming an https:// proxy: the worker stays up and each job fails
    saying why the proxy cannot be used."""
    url = _presigned(named_s3, f"http://{NAME}:{named_s3.port}", worker.etag)
    transport = _transport(proxy="https://user:secret@proxy.internal:3128")
    ending = await asyncio.to_thread(worker.run, transport, url, tmp_path / "blob")
    assert ending.get("failed"), ending
    assert "not an http:// URL" in ending["message"]
    assert "secret" not in ending["message"]
    assert worker.process.poll() is None


async def test_a_ca_bundle_that_cannot_be_read_fails_https_jobs_and_no_http_job(
    tmp_path: Path, named_s3: S3Server, certificate: tuple[Path, Path], worker: WorkerProcess
) -> None:
    """The worker loads its CAs at its first HTTPS connection, not when the settings come: an
    http:// job needs none and passes with a bundle that is not there, and the https:// job
    after it fails naming the file, the worker still serving."""
    missing = tmp_path / "missing-ca.pem"
    async with front(named_s3, None) as plain, front(named_s3, certificate) as tls:
        http_url = _presigned(named_s3, f"http://{NAME}:{plain.port}", worker.etag)
        https_url = _presigned(named_s3, f"https://{NAME}:{tls.port}", worker.etag)
        served = await asyncio.to_thread(
            worker.run, _transport(missing), http_url, tmp_path / "plain", address="127.0.0.1"
        )
        refused = await asyncio.to_thread(
            worker.run, _transport(missing), https_url, tmp_path / "tls", address="127.0.0.1"
        )
    assert served.get("done"), served
    assert (tmp_path / "plain").read_bytes() == BLOB_BYTES
    assert refused.get("failed"), refused
    assert f"the CA bundle '{missing}' could not be loaded" in refused["message"], refused
