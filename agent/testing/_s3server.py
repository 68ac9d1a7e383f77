"""A real S3-compatible server on loopback, in its own process, that records every request.

The server is moto's (the same WSGI app as ``moto_server``) behind a recording
middleware; see ``_moto_process`` for the child side. It runs in a subprocess so
a test can stop or kill it like a real outage, and so its request threads never
compete with the test for the GIL.

The parent learns the port from one JSON line the child prints once its socket
is listening, so there is nothing to sleep on. The child exits when its stdin
reaches EOF, which happens when this process dies, so a crashed test run leaves
no server behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from ._endpoint import LoopbackEndpoint, fresh_session
from ._process import (
    Startable,
    StartupFailure,
    log_tail,
    read_log,
    read_until,
    source_env,
    stop_process,
)

__all__ = ["CONTROL_PATH", "RecordedRequest", "S3Server", "S3ServerError"]

# S3 bucket names cannot contain "_", so no S3 request can ever land here.
CONTROL_PATH = "/_prewarm/requests"

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

# Anonymous requests a test may make to set up buckets, objects and users.
_IAM_SETUP_REQUESTS = 300

_HANDSHAKE = re.compile(rb"\A([^\n]*)\n")


class S3ServerError(RuntimeError):
    """The test S3 server could not be started or answered its control path badly."""


@dataclass(frozen=True)
class RecordedRequest:
    """One HTTP request the server handled, as the recording middleware saw it.

    ``bucket`` and ``key`` come from the path (path-style addressing); ``bucket``
    is None for service-level requests such as ListBuckets, ``key`` is None for
    bucket-level ones. ``bytes_sent`` counts response body bytes the server
    actually handed to the socket, so a download cut short shows how far it got.
    ``complete`` is False for a request still running when the log was read.
    """

    seq: int
    method: str
    bucket: str | None
    key: str | None
    query: str
    range: str | None
    if_match: str | None
    user_agent: str
    status: int
    bytes_sent: int
    complete: bool

    @property
    def query_params(self) -> dict[str, str]:
        """The query string as a dict (last value wins; valueless flags map to "")."""
        return dict(urllib.parse.parse_qsl(self.query, keep_blank_values=True))

    def to_json(self) -> dict[str, Any]:
        """The record as the control path's JSON object."""
        return {
            "seq": self.seq,
            "method": self.method,
            "bucket": self.bucket,
            "key": self.key,
            "query": self.query,
            "range": self.range,
            "if_match": self.if_match,
            "user_agent": self.user_agent,
            "status": self.status,
            "bytes_sent": self.bytes_sent,
            "complete": self.complete,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RecordedRequest:
        """A record from the control path's JSON object."""
        return cls(
            seq=int(data["seq"]),
            method=str(data["method"]),
            bucket=data["bucket"],
            key=data["key"],
            query=str(data["query"]),
            range=data["range"],
            if_match=data["if_match"],
            user_agent=str(data["user_agent"]),
            status=int(data["status"]),
            bytes_sent=int(data["bytes_sent"]),
            complete=bool(data["complete"]),
        )


class S3Server(Startable):
    """moto's S3 server in a subprocess on 127.0.0.1, with a request log.

    ``with S3Server() as s3:`` starts it and stops it. State (buckets, objects)
    lives in the child's memory: it is gone after ``stop()``. A ``start()`` after
    ``stop()`` binds the same port again, so clients configured for the old
    endpoint see an outage end, but against an empty server.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        iam: bool = False,
    ) -> None:
        # env: extra variables for the server process.
        self._extra_env = dict(env or {})
        # iam: moto checks every request's signature and IAM policy once the set-up
        # allowance is spent (see enforce_iam); until then requests are anonymous.
        if iam:
            self._extra_env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(_IAM_SETUP_REQUESTS)
        self._iam = iam
        self._host = host
        self._port = port
        self._startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path: Path | None = None

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> Self:
        """Start the server process and return once it listens (its handshake line)."""
        if self.running:
            raise S3ServerError(f"The S3 server is already running at {self.endpoint_url}.")
        fd, log_name = tempfile.mkstemp(prefix="prewarm-s3-", suffix=".log")
        os.close(fd)
        self._log_path = Path(log_name)
        env = source_env(os.environ) | self._extra_env
        argv = [sys.executable, "-m", "agent.testing._moto_process", "--host", self._host]
        argv += ["--port", str(self._port), "--log-file", log_name]
        # The child appends; we read the log by path, so our offset never moves its.
        with self._log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env
            )
        try:
            ready = self._handshake(self._proc)
        except BaseException:
            self._terminate(signal.SIGKILL, timeout=10.0)
            raise
        self._port = int(ready["port"])
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM) and wait for it to exit; idempotent."""
        self._terminate(signal.SIGTERM, timeout=timeout)

    def kill(self) -> None:
        """Kill the server (SIGKILL) and wait for it to exit; idempotent."""
        self._terminate(signal.SIGKILL, timeout=10.0)

    def close(self) -> None:
        """Stop the server (the end of a ``with`` block)."""
        self.stop()

    @property
    def running(self) -> bool:
        """True while the server process has not exited."""
        return self._proc is not None and self._proc.poll() is None

    # -- where it is ---------------------------------------------------------------

    @property
    def host(self) -> str:
        """The address the server listens on."""
        return self._host

    @property
    def port(self) -> int:
        """The port the server listens on, once started."""
        if self._port == 0:
            raise S3ServerError("The S3 server has no port until start() has been called.")
        return self._port

    @property
    def endpoint_url(self) -> str:
        """The URL to give an S3 client."""
        return f"http://{self._host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server process's id; None when it is not started."""
        return None if self._proc is None else self._proc.pid

    @property
    def endpoint(self) -> LoopbackEndpoint:
        """The endpoint with this server's credentials."""
        return LoopbackEndpoint(self.endpoint_url, ACCESS_KEY, SECRET_KEY, REGION)

    def env(self) -> dict[str, str]:
        """The environment a process (the agent, the CLI) needs to use this server."""
        return self.endpoint.env()

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server; ``config`` adds botocore Config options."""
        options: dict[str, Any] = {"retries": {"max_attempts": 2, "mode": "standard"}}
        return self.endpoint.client(**(options | config))

    # -- IAM (servers started with iam=True) -----------------------------------------

    def create_user(self, name: str, buckets: Sequence[str]) -> LoopbackEndpoint:
        """An IAM user allowed every S3 action on ``buckets`` only ("*": all); its endpoint.

        Call before ``enforce_iam``: creating users is part of the set-up allowance.
        """
        if not self._iam:
            raise S3ServerError("create_user needs S3Server(iam=True).")
        resources = [arn for b in buckets for arn in (f"arn:aws:s3:::{b}", f"arn:aws:s3:::{b}/*")]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": resources}],
        }
        iam = self._iam_client()
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return LoopbackEndpoint(self.endpoint_url, key["AccessKeyId"], key["SecretAccessKey"])

    def enforce_iam(self) -> None:
        """Spend what is left of the set-up allowance: from now on every request is checked.

        moto counts anonymous requests; the shared test keys belong to no IAM
        user, so the first request they get refused marks the end of it.
        """
        import botocore.exceptions

        client = self.client(retries={"max_attempts": 1, "mode": "standard"})
        for _ in range(_IAM_SETUP_REQUESTS + 1):
            try:
                client.list_buckets()
            except botocore.exceptions.ClientError:
                return
        raise S3ServerError("moto kept answering anonymous requests: is iam=True in effect?")

    def _iam_client(self) -> Any:
        session = fresh_session(ACCESS_KEY, SECRET_KEY, REGION)
        return session.client("iam", endpoint_url=self.endpoint_url)

    # -- the request log -------------------------------------------------------------

    def requests(self, *, bucket: str | None = None, settle: float = 2.0) -> list[RecordedRequest]:
        """Requests since the last clear, in arrival order; ``bucket`` filters.

        A response can reach the client a moment before the server thread that
        sent it records it, so the server first waits up to ``settle`` seconds
        for every earlier request to finish; any still running are returned
        with ``complete=False``.
        """
        query = urllib.parse.urlencode({"settle": settle})
        data = self._control("GET", f"{CONTROL_PATH}?{query}", timeout=settle + 10.0)
        records = [RecordedRequest.from_json(item) for item in data["requests"]]
        if bucket is not None:
            records = [r for r in records if r.bucket == bucket]
        return records

    def clear_requests(self) -> None:
        """Forget every request that arrived before this call."""
        self._control("DELETE", CONTROL_PATH, timeout=10.0)

    def log_text(self) -> str:
        """The server process's stderr (moto's tracebacks land here)."""
        return read_log(self._log_path)

    # -- internals -------------------------------------------------------------------

    def _control(self, method: str, path: str, *, timeout: float) -> dict[str, Any]:
        request = urllib.request.Request(self.endpoint_url + path, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = response.read()
        except OSError as exc:
            raise S3ServerError(
                f"The S3 server's control path {method} {path} failed: {exc}."
            ) from exc
        return dict(json.loads(body)) if body else {}

    def _handshake(self, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        assert proc.stdout is not None
        with proc.stdout:
            try:
                line = read_until(proc, _HANDSHAKE, timeout=self._startup_timeout).group(1)
            except StartupFailure as exc:
                raise S3ServerError(f"The S3 server {exc.reason}.\n{self._log_tail()}") from exc
        try:
            return dict(json.loads(line))
        except ValueError as exc:
            raise S3ServerError(
                f"The S3 server printed {line!r} instead of its JSON handshake."
            ) from exc

    def _terminate(self, sig: signal.Signals, *, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        stop_process(proc, sig, timeout=timeout)
        if proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        self._proc = None
        if self._log_path is not None:
            self._log_path.unlink(missing_ok=True)
            self._log_path = None

    def _log_tail(self, limit: int = 8000) -> str:
        return log_tail(
            self.log_text(),
            heading="--- S3 server stderr ---",
            empty="(the server wrote nothing to stderr)",
            limit=limit,
        )
