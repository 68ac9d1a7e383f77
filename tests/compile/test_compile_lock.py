"""The node's compile lock: one pod compiles a key, the others wait for it or its cache."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from agent_helpers import AgentFactory

from agent.client import AsyncClient, CompileKeyParts, CompileLockGrant

PARTS = CompileKeyParts(torch_version="2.13.0", model_key="lock-test")
REPO = Path(__file__).resolve().parents[2]
WAIT = 30.0


async def _take(
    client: AsyncClient, name: str, waiting: asyncio.Event, release: asyncio.Event
) -> CompileLockGrant:
    """Take the lock as ``name``, hold it until ``release`` is set, return the grant."""
    async with client.compile_lock(
        PARTS, client_name=name, on_wait=lambda holder: waiting.set()
    ) as grant:
        await release.wait()
    return grant


async def test_the_second_pod_waits_until_the_first_lets_go(start_agent: AgentFactory) -> None:
    """A second pod asking for the lock waits, then gets it exclusively when the first lets go."""
    agent = start_agent()
    async with AsyncClient(agent.socket_path) as first, AsyncClient(agent.socket_path) as second:
        async with first.compile_lock(PARTS, client_name="pod-1") as held:
            assert (held.waited, held.warm, held.exclusive) == (False, False, True)
            waiting, release = asyncio.Event(), asyncio.Event()
            waiter = asyncio.create_task(_take(second, "pod-2", waiting, release))
            async with asyncio.timeout(WAIT):
                await waiting.wait()
            assert not waiter.done()
        release.set()  # pod-2 lets go as soon as it has the lock
        async with asyncio.timeout(WAIT):
            grant = await waiter
    assert (grant.waited, grant.waited_for, grant.exclusive) == (True, "pod-1", True)


async def test_a_killed_holder_passes_the_lock_on(start_agent: AgentFactory) -> None:
    """A holder killed with SIGKILL loses the lock; the waiting pod gets it."""
    agent = start_agent()
    script = textwrap.dedent(
        """
        import sys
        from agent.client import Client, CompileKeyParts
        parts = CompileKeyParts(torch_version="2.13.0", model_key="lock-test")
        with Client(sys.argv[1]).compile_lock(parts, client_name="doomed"):
            print("granted", flush=True)
            sys.stdin.read()  # hold until killed
        """
    )
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        str(agent.socket_path),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert holder.stdout is not None
    assert holder.stdin is not None
    try:
        async with asyncio.timeout(WAIT):
            assert await holder.stdout.readline() == b"granted\n"
        async with AsyncClient(agent.socket_path) as client:
            waiting, release = asyncio.Event(), asyncio.Event()
            release.set()
            waiter = asyncio.create_task(_take(client, "pod-2", waiting, release))
            async with asyncio.timeout(WAIT):
                await waiting.wait()
            holder.send_signal(signal.SIGKILL)
            async with asyncio.timeout(WAIT):
                grant = await waiter
        assert (grant.waited_for, grant.exclusive) == ("doomed", True)
    finally:
        if holder.returncode is None:
            holder.kill()
        holder.stdin.close()
        await holder.wait()


async def test_waiters_go_once_the_cache_has_settled_with_artifacts(
    start_agent: AgentFactory,
) -> None:
    """Waiters go (warm, shared) once the cache settles with artifacts, the holder still in."""
    agent = start_agent("[compile_cache]\nquiet_seconds = 0.5\n")
    async with AsyncClient(agent.socket_path) as first, AsyncClient(agent.socket_path) as second:
        handle = await first.compile_cache(PARTS)
        async with first.compile_lock(PARTS, client_name="pod-1"):
            waiting, release = asyncio.Event(), asyncio.Event()
            release.set()
            waiter = asyncio.create_task(_take(second, "pod-2", waiting, release))
            async with asyncio.timeout(WAIT):
                await waiting.wait()
            kernel = handle.path / "inductor" / "ab" / "kernel.so"
            kernel.parent.mkdir(parents=True)
            kernel.write_bytes(b"\x7fELF" + bytes(1000))
            async with asyncio.timeout(WAIT):
                grant = await waiter  # while pod-1 still holds the lock
    assert (grant.warm, grant.exclusive, grant.waited_for) == (True, False, "pod-1")


async def test_a_held_lock_does_not_hold_up_the_agent_stopping(start_agent: AgentFactory) -> None:
    """A held lock stream does not keep the daemon from stopping within its grace."""
    agent = start_agent("shutdown_grace_seconds = 60\n")
    async with (
        AsyncClient(agent.socket_path) as client,
        client.compile_lock(PARTS, client_name="pod-1"),
    ):
        started = time.monotonic()
        code = await asyncio.to_thread(agent.stop)
        stopped_in = time.monotonic() - started
    assert code == 0
    assert stopped_in < 20  # far below the 60 s grace the lock's stream would otherwise get
