"""The child side of ``S3Server``: moto's S3 app behind a recording middleware.

Run as ``python -m agent.testing._moto_process --port 0``. Once the socket is
listening it prints one JSON line (``{"host": ..., "port": ..., "pid": ...}``)
on stdout, then serves until SIGTERM, SIGINT, or EOF on stdin (the parent died).

Kept apart from ``_s3server`` so ``agent.testing`` never imports moto, and so
``-m`` does not run a module that the package has already imported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from ._s3server import CONTROL_PATH, RecordedRequest

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = ["RecordingMiddleware", "main"]


@dataclasses.dataclass
class _Pending:
    """A request in flight: what arrived, and how far its response has got."""

    arrived: RecordedRequest  # status 0, nothing sent, not complete
    status: int = 0
    bytes_sent: int = 0

    @property
    def seq(self) -> int:
        return self.arrived.seq

    def freeze(self, *, complete: bool) -> RecordedRequest:
        return dataclasses.replace(
            self.arrived, status=self.status, bytes_sent=self.bytes_sent, complete=complete
        )


class RecordingMiddleware:
    """Logs every request to the wrapped app and serves the log on CONTROL_PATH.

    ``GET CONTROL_PATH?settle=S`` returns ``{"requests": [...]}`` in arrival order
    after waiting up to S seconds for requests that arrived before it to finish;
    ``DELETE CONTROL_PATH`` forgets every request that arrived before it.
    """

    def __init__(self, app: WSGIApplication) -> None:
        self._app = app
        self._changed = threading.Condition()
        self._seq = itertools.count()
        self._floor = 0  # requests with a lower seq were cleared
        self._done: list[RecordedRequest] = []
        self._in_flight: dict[int, _Pending] = {}

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == CONTROL_PATH:
            return self._control(environ, start_response)
        pending = self._begin(environ)

        def recording_start_response(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Any:
            pending.status = int(status.split(None, 1)[0])
            write = start_response(status, headers, exc_info)

            def counting_write(data: bytes) -> None:
                write(data)
                pending.bytes_sent += len(data)

            return counting_write

        try:
            body = self._app(environ, recording_start_response)
        except BaseException:
            pending.status = pending.status or 500
            self._finish(pending)
            raise
        return _CountingBody(body, pending, self._finish)

    def _begin(self, environ: WSGIEnvironment) -> _Pending:
        # WSGI hands the path over as latin-1; S3 keys are UTF-8.
        raw_path = str(environ.get("PATH_INFO", ""))
        path = raw_path.encode("latin-1").decode("utf-8", "replace")
        bucket, _, key = path.lstrip("/").partition("/")
        with self._changed:
            arrived = RecordedRequest(
                seq=next(self._seq),
                method=str(environ.get("REQUEST_METHOD", "")),
                bucket=bucket or None,
                key=key or None,
                query=str(environ.get("QUERY_STRING", "")),
                range=environ.get("HTTP_RANGE"),
                if_match=environ.get("HTTP_IF_MATCH"),
                user_agent=str(environ.get("HTTP_USER_AGENT", "")),
                status=0,
                bytes_sent=0,
                complete=False,
            )
            pending = _Pending(arrived)
            self._in_flight[pending.seq] = pending
        return pending

    def _finish(self, pending: _Pending) -> None:
        with self._changed:
            if self._in_flight.pop(pending.seq, None) is None:
                return  # already finished (iteration ended, then close())
            if pending.seq >= self._floor:
                self._done.append(pending.freeze(complete=True))
            self._changed.notify_all()

    def _control(self, environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        method = environ.get("REQUEST_METHOD")
        if method == "DELETE":
            with self._changed:
                self._floor = next(self._seq)
                self._done.clear()
            start_response("204 No Content", [("Content-Length", "0")])
            return []
        if method != "GET":
            start_response("405 Method Not Allowed", [("Content-Length", "0")])
            return []
        params = urllib.parse.parse_qs(str(environ.get("QUERY_STRING", "")))
        settle = float(params.get("settle", ["2.0"])[0])
        with self._changed:
            me = next(self._seq)
            deadline = time.monotonic() + settle
            while any(seq < me for seq in self._in_flight):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            records = [r for r in self._done if r.seq >= self._floor]
            records += [
                p.freeze(complete=False)
                for p in self._in_flight.values()
                if self._floor <= p.seq < me
            ]
        records.sort(key=lambda r: r.seq)
        body = json.dumps({"requests": [r.to_json() for r in records]}).encode()
        start_response(
            "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        )
        return [body]


_SLICE = 1024 * 1024


class _CountingBody:
    """Wraps a WSGI response iterable and counts the bytes the server wrote.

    A chunk counts once the server asks for the next one (it has written the
    previous one by then) or the iteration ends; a write that fails because the
    client went away leaves its chunk uncounted.
    """

    def __init__(
        self,
        body: Iterable[bytes],
        pending: _Pending,
        finish: Any,
    ) -> None:
        self._body = body
        self._pending = pending
        self._finish = finish

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._body:
            # moto hands over a whole object as one chunk; slices show how far
            # a download got before the client went away.
            for start in range(0, len(chunk), _SLICE):
                piece = chunk[start : start + _SLICE]
                yield piece
                self._pending.bytes_sent += len(piece)
        self._finish(self._pending)

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._finish(self._pending)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    # Raised in the main thread, out of serve_forever's select().
    raise SystemExit(0)


def _exit_on_stdin_eof(log_file: str | None) -> None:
    # The parent holds our stdin open; EOF means it closed it or died. Raw
    # reads: a daemon thread blocked inside sys.stdin's buffer holds its lock
    # and aborts interpreter shutdown.
    while os.read(sys.stdin.fileno(), 4096):
        pass
    if log_file:
        # A parent that stops us removes our log itself; one that died cannot.
        with contextlib.suppress(OSError):
            Path(log_file).unlink()
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """Serve moto's S3 on the given port, print the JSON handshake, serve until signalled."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log-file", help="our stderr; removed if the parent dies")
    args = parser.parse_args(argv)

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    class QuietHandler(MotoRequestHandler):  # type: ignore[misc]  # moto is not followed
        # One stderr line per request would bury moto's tracebacks.
        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            pass

    class RememberingDispatcher(DomainDispatcherApplication):  # type: ignore[misc]
        # moto finds a request's backend by listing its package directory (a stat per
        # backend) and trying every service's URL patterns, on every request and under
        # its lock: a sixth of this server's samples in a profile of tests/pull. A host's
        # backend never changes, so each is found once (get_application holds the lock).
        def __init__(self, create_app: Any) -> None:
            super().__init__(create_app)
            self.backend_of: dict[str | None, Any] = {}

        def get_backend_for_host(self, host: str | None) -> Any:
            if host not in self.backend_of:
                self.backend_of[host] = super().get_backend_for_host(host)
            return self.backend_of[host]

    app = RecordingMiddleware(RememberingDispatcher(create_backend_app))
    server = make_server(args.host, args.port, app, threaded=True, request_handler=QuietHandler)
    port = server.server_port
    # moto builds some URLs from MOTO_PORT.
    os.environ["MOTO_PORT"] = str(port)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    sys.stdout.write(json.dumps({"host": args.host, "port": port, "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    # The parent stops reading stdout after the handshake; stray prints go to stderr.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    watcher = threading.Thread(
        target=_exit_on_stdin_eof, args=(args.log_file,), name="stdin-eof", daemon=True
    )
    watcher.start()
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
