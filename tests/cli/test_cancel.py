"""Cancelling a pull end to end: `prewarm cancel`, Ctrl-C on `prewarm pull` and `prewarm exec`,
the tenant sockets, and what a joiner's summary says.

The real daemon (in this process, on real Unix sockets) pulls through a FaultProxy whose stall
holds the model's GETs, with moto's S3 server behind it. Nothing waits with a sleep: the proxy
reports the stalled GET, a client's first progress event says it waits on the pull, and the
agent's log says when a `prewarm` command has joined one.

`prewarm` runs as a real process where a signal is the point (Ctrl-C on `pull` and `exec`),
in this process (``cli_helpers``) elsewhere.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from agent_helpers import tree_digest, when_logged
from cli_helpers import prewarm_in_process

from agent.cli import _render as render
from agent.client import (
    AccessDenied,
    Cancelled,
    Client,
    ModelHandle,
    NotFound,
    PhaseTimings,
    Progress,
)
from agent.testing import Fault, FaultProxy, InProcessAgent, S3Server, SampleModel
from agent.testing._process import purge_tree

# A stalled GET is given up on after a second and retried: enough retries that the stall
# outlasts each test, whose pull completes once the stall is lifted.
_S3 = "[s3]\nlow_speed_seconds = 1\nretries = 20\n\n"
_NUMBER = r"\d+(?:\.\d+)?"
_SIZE = rf"{_NUMBER} (?:B|KiB|MiB|GiB)"


@dataclass
class HeldPulls:
    """The agent, the proxy stalling the model's GETs, and two tenant sockets: team-a may
    pull the model's bucket, team-b only another one."""

    agent: InProcessAgent
    proxy: FaultProxy
    model: SampleModel
    team_a: Path
    team_b: Path
    pool: ThreadPoolExecutor


@pytest.fixture
def held(s3_server: S3Server, small_model: SampleModel) -> Iterator[HeldPulls]:
    """The agent pulling through a proxy that stalls every GET of the small model."""
    sockets = Path(tempfile.mkdtemp(prefix="pw-cx-", dir="/tmp"))
    config = _S3 + "".join(
        f'[[access.sockets]]\nname = "{name}"\npath = "{sockets / name}.sock"\n'
        f'sources = ["s3://{bucket}/*"]\n\n'
        for name, bucket in (("team-a", small_model.bucket), ("team-b", "another-bucket"))
    )
    try:
        with FaultProxy(s3_server.endpoint_url) as proxy, ThreadPoolExecutor(2) as pool:
            proxy.add(Fault.stall(key=f"/{small_model.bucket}/{small_model.prefix}", times=None))
            env = s3_server.env() | {"AWS_ENDPOINT_URL": proxy.endpoint_url}
            with InProcessAgent(env=env, config=config) as agent:
                yield HeldPulls(
                    agent,
                    proxy,
                    small_model,
                    sockets / "team-a.sock",
                    sockets / "team-b.sock",
                    pool,
                )
    finally:
        purge_tree(sockets)


def _waiting(held: HeldPulls, socket: Path) -> Future[ModelHandle]:
    """An ensure of the model over ``socket``, once it waits on the model's pull."""
    joined = threading.Event()

    def seen(progress: Progress) -> None:
        if progress.key:  # the pull's own progress (the edge's first event names no key)
            joined.set()

    def ensure() -> ModelHandle:
        with Client(socket) as client:
            return client.ensure(held.model.uri, progress=seen)

    waiter = held.pool.submit(ensure)
    assert joined.wait(60), "the request never reached the pull"
    return waiter


def _prewarm_in_process(held: HeldPulls, *args: str) -> tuple[int, str, str]:
    """`prewarm ARGS` on the agent's own (node) socket, in this process: status and output."""
    done = prewarm_in_process(*args, socket=held.agent.socket_path)
    return done.returncode, done.stdout, done.stderr


def _prewarm(held: HeldPulls, *args: str) -> subprocess.Popen[str]:
    """A `prewarm ARGS` process on the agent's own (node) socket."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env["PREWARM_SOCKET_PATH"] = str(held.agent.socket_path)
    return subprocess.Popen(
        [sys.executable, "-c", _WITH_CTRL_C, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# `python -m agent.cli` with Ctrl-C's handler in place: a shell without job control starts
# `make test &` with SIGINT ignored, a child inherits that, and Python then keeps ignoring it.
_WITH_CTRL_C = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'prewarm'; runpy.run_module('agent.cli', run_name='__main__')"
)


def _finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=120)
    return process.returncode, stdout, stderr


def _logged(held: HeldPulls, words: str) -> None:
    """Wait until the agent's log holds ``words`` (a `prewarm` process started or joined)."""
    when_logged(held.agent, lambda: True if words in held.agent.log_text() else None, words)


def test_prewarm_cancel_stops_a_pull_its_waiter_hears_why_and_a_new_pull_completes(
    held: HeldPulls,
) -> None:
    """`prewarm cancel URI` on the node socket stops the pull and says what stays in staging;
    the waiting client gets Cancelled saying asking again resumes; nothing was published;
    `prewarm status` counts the staging left; the next pull publishes the model whole."""
    waiter = _waiting(held, held.agent.socket_path)
    code, stdout, stderr = _prewarm_in_process(held, "cancel", held.model.uri)
    assert code == 0, stderr
    assert re.fullmatch(
        rf"cancelled the pull of {re.escape(held.model.uri)} \([0-9a-f]{{12}}\); {_SIZE} of "
        rf"{_SIZE} kept in staging, a later pull resumes from them\n",
        stdout,
    ), stdout
    with pytest.raises(Cancelled, match=r"was cancelled .* ask again and the pull resumes"):
        waiter.result(timeout=60)
    with Client(held.agent.socket_path) as client:
        assert client.list_models() == []
        assert client.status().pulls == ()
    code, stdout, _ = _prewarm_in_process(held, "status")
    assert "kept in staging by 1 stopped pull; pulling the same snapshot again resumes" in stdout
    held.proxy.clear()
    with Client(held.agent.socket_path) as client:
        handle = client.ensure(held.model.uri)
    assert tree_digest(handle.path) == tree_digest(held.model.source_dir)


def test_a_tenant_cancels_a_pull_of_a_source_it_may_pull(held: HeldPulls) -> None:
    """Over its own socket, a tenant allowed the model's bucket stops the pull its request
    waits on; that request gets Cancelled."""
    waiter = _waiting(held, held.team_a)
    with Client(held.team_a) as tenant:
        [pull] = tenant.cancel_pull(held.model.uri)
    assert pull.cancelled
    assert pull.uri == held.model.uri
    with pytest.raises(Cancelled):
        waiter.result(timeout=60)


def test_a_tenant_may_not_cancel_what_it_may_not_pull_and_nothing_pulled_is_not_found(
    held: HeldPulls,
) -> None:
    """A tenant whose sources leave the model out is PERMISSION_DENIED; a URI nothing pulls
    is NOT_FOUND saying where pulls are listed; the pull goes on and completes."""
    waiter = _waiting(held, held.agent.socket_path)
    with Client(held.team_b) as tenant, pytest.raises(AccessDenied, match="not among the sources"):
        tenant.cancel_pull(held.model.uri)
    nothing = f"s3://{held.model.bucket}/models/never-pulled/"
    with Client(held.agent.socket_path) as client:
        with pytest.raises(NotFound, match="`prewarm status` lists the pulls in flight"):
            client.cancel_pull(nothing)
        assert [p.uri for p in client.status().pulls] == [held.model.uri]
    held.proxy.clear()
    assert not waiter.result(timeout=120).hit


def test_evict_force_of_a_model_being_pulled_says_to_use_prewarm_cancel(held: HeldPulls) -> None:
    """`prewarm evict --force` on a model being pulled exits 1 naming `prewarm cancel`."""
    waiter = _waiting(held, held.agent.socket_path)
    code, _, stderr = _prewarm_in_process(held, "evict", "--force", held.model.uri)
    assert code == 1
    assert "being pulled right now" in stderr
    assert "`prewarm cancel " in stderr
    held.proxy.clear()
    waiter.result(timeout=120)


def test_ctrl_c_on_prewarm_pull_cancels_the_pull_nobody_else_waits_on(held: HeldPulls) -> None:
    """SIGINT to a `prewarm pull` waiting on its own pull stops that pull: exit 130, and a
    line saying it was cancelled and how much stays in staging for a later pull."""
    pulling = _prewarm(held, "pull", held.model.uri)
    held.proxy.wait_injected("stall")  # its request started the pull and waits on it
    pulling.send_signal(signal.SIGINT)
    code, _, stderr = _finish(pulling)
    assert code == 130, stderr
    assert re.fullmatch(
        rf"interrupted: cancelled the pull of {re.escape(held.model.uri)} \([0-9a-f]{{12}}\); "
        rf"{_SIZE} of {_SIZE} kept in staging, a later pull resumes from them\n",
        stderr,
    ), stderr
    with Client(held.agent.socket_path) as client:
        assert client.status().pulls == ()


def test_ctrl_c_on_prewarm_pull_leaves_a_pull_another_client_waits_on(held: HeldPulls) -> None:
    """SIGINT to a `prewarm pull` whose pull another client also waits on leaves the pull
    running: exit 130 saying so; the other client gets the model."""
    pulling = _prewarm(held, "pull", held.model.uri)
    held.proxy.wait_injected("stall")
    other = _waiting(held, held.agent.socket_path)
    pulling.send_signal(signal.SIGINT)
    code, _, stderr = _finish(pulling)
    assert code == 130, stderr
    assert stderr == (
        f"interrupted: the pull of {held.model.uri} goes on: another client waits for it\n"
    )
    held.proxy.clear()
    assert Path(other.result(timeout=120).path).is_dir()


def test_ctrl_c_on_prewarm_exec_waiting_for_its_pull_cancels_it(held: HeldPulls) -> None:
    """SIGINT to `prewarm exec` while it waits for its model's pull stops that pull: exit
    130, the line prefixed as exec's are, and the command never runs."""
    waiting = _prewarm(held, "exec", held.model.uri, "--", "false")
    held.proxy.wait_injected("stall")
    waiting.send_signal(signal.SIGINT)
    code, _, stderr = _finish(waiting)
    assert code == 130, stderr
    assert f"prewarm: interrupted: cancelled the pull of {held.model.uri} (" in stderr


def test_a_prewarm_pull_that_joins_a_pull_in_progress_says_so(held: HeldPulls) -> None:
    """`prewarm pull` of a model another client is already pulling says it joined a pull in
    progress, with its own wait and the pull's own figures, never "cold pull"."""
    first = _waiting(held, held.agent.socket_path)

    def lift_the_stall_once_joined() -> None:
        _logged(held, "joining pull of")
        held.proxy.clear()

    lifted = held.pool.submit(lift_the_stall_once_joined)
    code, stdout, stderr = _prewarm_in_process(held, "pull", held.model.uri)
    lifted.result(timeout=60)
    assert code == 0, stderr
    assert re.fullmatch(
        rf"joined a pull of {re.escape(held.model.uri)} in progress: waited ({_NUMBER}) s for "
        rf"it \(resolve {_NUMBER} s, wait ({_NUMBER}) s\); the pull took {_NUMBER} s "
        rf"\(download {_NUMBER} s, verify {_NUMBER} s, publish {_NUMBER} s\), {_SIZE} at "
        rf"{_SIZE}/s -> \S+\n",
        stdout,
    ), stdout
    first.result(timeout=60)


def test_a_joiners_summary_keeps_its_own_wait_apart_from_the_pulls_figures() -> None:
    """The issue's case: a request that waited 19.10 s on a pull whose download took 26.72 s
    is summarised as a joined pull with its own wait, the 26.72 s given as the pull's."""
    handle = ModelHandle(
        uri="s3://models/llama/",
        key="0" * 32,
        path=Path("/dev/shm/prewarm/snapshots/x"),
        tier="shm",
        hit=False,
        files=(),
        total_bytes=8 * 1024**3,
        timings=PhaseTimings(
            resolve=0.05, wait=19.05, download=26.72, verify=1.00, publish=0.18, total=19.10
        ),
        resolved_offline=False,
        joined=True,
    )
    assert render.pull_summary(handle).plain == (
        "joined a pull of s3://models/llama/ in progress: waited 19.10 s for it "
        "(resolve 0.05 s, wait 19.05 s); the pull took 27.90 s (download 26.72 s, "
        "verify 1.00 s, publish 0.18 s), 8.0 GiB at 293.6 MiB/s -> /dev/shm/prewarm/snapshots/x"
    )
