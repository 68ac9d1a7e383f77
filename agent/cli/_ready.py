"""When is the engine ``prewarm exec`` started ready? Its health URL answers, or a file appears.

The compile cache of a launch is published only once the engine is ready, so
a launch that crashes while compiling never uploads its half-made artifacts.
``ReadyWatch`` waits for the signal in a thread while the child runs; the
callback it runs on ready reports the verdict and the upload. A child that
exits with status 0 before any signal counts as ready (a batch job that
compiled, ran and finished); any other exit before ready publishes nothing.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from watchfiles import watch

from agent.client import InvalidRequest

__all__ = [
    "ReadyWatch",
    "check_ready_url",
    "ready_waiter",
    "wait_for_file",
    "wait_for_url",
]

# Bounded backoff between GETs of the health URL: an engine loading for minutes
# is asked about every 5 s, one that is ready fast is seen within a quarter second.
FIRST_DELAY = 0.25
MAX_DELAY = 5.0
REQUEST_TIMEOUT = 5.0

ReadyWaiter = Callable[[threading.Event], bool]


def check_ready_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host; InvalidRequest says what is wrong."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InvalidRequest(
            f"--ready-url {url!r} is not an http(s) URL; give the engine's health endpoint, "
            "e.g. --ready-url http://127.0.0.1:8000/health."
        )
    return url


def wait_for_url(url: str) -> ReadyWaiter:
    """Waits until a GET of ``url`` answers 2xx (True), or the stop event is set (False)."""

    def wait(stop: threading.Event) -> bool:
        delay = FIRST_DELAY
        while not stop.is_set():
            try:
                with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT) as answer:
                    if 200 <= answer.status < 300:
                        return True
            except (urllib.error.URLError, OSError, ValueError):
                pass  # not listening yet, or not ready (urllib raises on 4xx/5xx)
            if stop.wait(delay):
                return False
            delay = min(MAX_DELAY, delay * 2)
        return False

    return wait


def wait_for_file(path: Path) -> ReadyWaiter:
    """Waits (inotify, through watchfiles) until ``path`` exists (True), or stop (False)."""

    def wait(stop: threading.Event) -> bool:
        if path.exists():
            return True
        for _ in watch(path.parent, stop_event=stop, recursive=False, debounce=50, step=50):
            if path.exists():
                return True
        return path.exists() and not stop.is_set()

    return wait


class ReadyWatch:
    """Runs ``on_ready`` once: when ``wait`` says ready, or when the child exits with 0."""

    def __init__(self, wait: ReadyWaiter, on_ready: Callable[[], None]) -> None:
        self._wait = wait
        self._on_ready = on_ready
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._fired = False
        self._thread = threading.Thread(target=self._run, name="prewarm ready", daemon=True)

    def start(self) -> None:
        """Start waiting for readiness, on a thread of its own, as the child starts."""
        self._thread.start()

    def _run(self) -> None:
        if self._wait(self._stop):
            self._fire()

    def _fire(self) -> None:
        with self._lock:
            if self._fired:
                return
            self._fired = True
        self._on_ready()

    def child_exited(self, returncode: int) -> bool:
        """Stop waiting; True when the launch was (or now counts as) ready."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if not self._fired and returncode == 0:
            self._fire()
        return self._fired


def ready_waiter(url: str | None, file: Path | None) -> ReadyWaiter | None:
    """How to wait for the engine to be ready; None without --ready-url/--ready-file."""
    if url and file:
        raise InvalidRequest("give --ready-url or --ready-file, not both.")
    if url:
        return wait_for_url(check_ready_url(url))
    if file is not None:
        if not file.parent.is_dir():
            raise InvalidRequest(
                f"--ready-file {file}: its directory {file.parent} does not exist; create it "
                "before the launch (the file itself is made by the engine)."
            )
        return wait_for_file(file)
    return None
