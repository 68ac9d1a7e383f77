"""``prewarm compile`` (and ``prewarm exec --compile-key``) against the real daemon and S3
server.

The commands run in this process (``cli_helpers``: the typer app over the daemon's real Unix
socket, file descriptors 1 and 2 kept as a process's output; exec's command is a real child);
``compile push`` without a compile URI runs as a real process, for the status a shell sees.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import AgentFactory
from cli_helpers import Ran, prewarm_in_process

from agent.client import Client
from agent.testing import SampleModel, unsealed


def prewarm(*args: str, socket: Path) -> Ran:
    """``prewarm compile ARGS`` on ``socket``, in this process."""
    return prewarm_in_process("compile", *args, socket=socket)


def prewarm_process(*args: str, socket: Path) -> subprocess.CompletedProcess[str]:
    """``python -m agent.cli compile ARGS`` on ``socket``: a real interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env["PREWARM_SOCKET_PATH"] = str(socket)
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "compile", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _ok(done: Ran) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_ls_show_push_evict_pull(start_agent: AgentFactory, bucket: str) -> None:
    """`prewarm compile` ls, show, push (twice: second skipped), evict and pull, by key prefix."""
    agent = start_agent(f'[compile_cache]\nuri = "s3://{bucket}/cc"\nquiet_seconds = 60\n')
    socket = agent.socket_path
    with Client(socket) as client:
        handle = client.compile_cache(torch_version="2.13.0", gpu_name="NVIDIA H100", model_key="m")
    (handle.path / "inductor" / "kernel.so").write_bytes(b"\x7fELF" + bytes(4096))
    short = handle.key[:10]

    listed = json.loads(_ok(prewarm("ls", "--json", socket=socket)))
    assert [c["key"] for c in listed] == [handle.key]
    assert listed[0]["parts"]["gpu_name"] == "NVIDIA H100"
    shown = _ok(prewarm("show", short, socket=socket))
    assert str(handle.path) in shown
    assert "NVIDIA H100" in shown

    pushed = _ok(prewarm("push", short, socket=socket))
    assert re.fullmatch(
        rf"uploaded \d+ B \(sha256:[0-9a-f]{{64}}\) to s3://{bucket}/cc/node/{handle.key}/\n",
        pushed,
    ), pushed
    assert _ok(prewarm("push", short, socket=socket)) == (
        "not uploaded: unchanged since the last upload or restore\n"
    )
    assert _ok(prewarm("evict", short, socket=socket)).startswith(
        f"evicted compile cache {handle.key[:12]}"
    )
    assert _ok(prewarm("ls", socket=socket)) == "no compile caches\n"
    assert not handle.path.exists()

    pulled = _ok(prewarm("pull", handle.key, socket=socket))
    assert pulled.startswith(f"restored {handle.key} in ")
    assert (handle.path / "inductor" / "kernel.so").read_bytes()[:4] == b"\x7fELF"

    missing = prewarm("show", "0123456789", socket=socket)
    assert missing.returncode == 1
    assert "No compile cache has a key starting with 0123456789" in missing.stderr


def test_push_pull_and_compact_without_a_compile_uri_all_exit_1_naming_it(
    start_agent: AgentFactory,
) -> None:
    """With no compile_cache.uri on the agent, `compile push`, `pull` and `compact` of a key on
    the node each exit 1 (push once exited 0, as if skipped: it runs as a real process) with a
    line naming the setting."""
    agent = start_agent()
    with Client(agent.socket_path) as client:
        handle = client.compile_cache(torch_version="2.13.0", model_key="m")
    for command in ("push", "pull", "compact"):
        run = prewarm_process if command == "push" else prewarm
        done = run(command, handle.key, socket=agent.socket_path)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert done.stderr.startswith("error: compile_cache.uri is not set; "), command
        assert done.stderr.count("\n") == 1, (command, done.stderr)
        assert done.stdout == "", command


def _exec(*args: str, socket: Path) -> Ran:
    """``prewarm exec ARGS`` on ``socket``, in this process; its command is a real child."""
    return prewarm_in_process("exec", *args, socket=socket)


@pytest.mark.slow  # asks the command's interpreter for its versions (it imports torch)
def test_exec_gives_the_command_the_compile_cache_of_its_key_parts(
    start_agent: AgentFactory, small_model: SampleModel
) -> None:
    """`prewarm exec --compile-key` runs the command with the env of the keyed compile cache."""
    import torch

    agent = start_agent()
    done = _exec(
        small_model.uri,
        *("--compile-key", "engine=sglang", "--compile-key", "tensor_parallel=2"),
        *("--compile-key", "extras.dtype=fp32", "--"),
        *(sys.executable, "-c", "import os; print(os.environ['SGLANG_CACHE_DIR'])"),
        socket=agent.socket_path,
    )
    assert done.returncode == 0, done.stderr
    with Client(agent.socket_path) as client:
        (cache,) = client.list_compile_caches()
        model = client.get(small_model.uri)
    assert done.stdout == f"{cache.path / 'sglang'}\n"
    assert f"prewarm: compile cache {cache.key[:12]} (new: " in done.stderr
    assert cache.parts.model_key == model.key
    assert cache.parts.torch_version == torch.__version__  # asked of the command's Python
    assert (cache.parts.tensor_parallel, cache.parts.extras["dtype"]) == (2, "fp32")


def test_exec_refuses_a_bad_key_part_before_running_anything(
    start_agent: AgentFactory, small_model: SampleModel
) -> None:
    """`prewarm exec` rejects a malformed key part (exit 2) before pulling or running anything."""
    agent = start_agent()
    done = _exec(
        small_model.uri,
        "--compile-key",
        "tensor_parallel=eight",
        "--",
        "true",
        socket=agent.socket_path,
    )
    assert done.returncode == 2
    assert "tensor_parallel must be a whole number, not 'eight'" in done.stderr
    with Client(agent.socket_path) as client:
        assert client.list_models() == []


def test_why_names_the_nearest_key_of_the_model_and_the_parts_that_differ(
    start_agent: AgentFactory,
) -> None:
    """`prewarm compile why KEY` compares a key with the closest other key of its model."""
    agent = start_agent()
    with Client(agent.socket_path) as client:
        old = client.compile_cache(torch_version="2.12.0", model_key="m", tensor_parallel=2)
        client.compile_cache(torch_version="2.13.0", model_key="other-model")
        new = client.compile_cache(torch_version="2.13.0", model_key="m", tensor_parallel=2)
    said = _ok(prewarm("why", new.key[:10], socket=agent.socket_path))
    assert said.splitlines() == [
        f"{new.key[:12]}: nearest cached key {old.key[:12]}, differs in",
        "  engine_version 2.12.0 -> 2.13.0",
        "  torch_version 2.12.0 -> 2.13.0",
        "note: compile_cache.uri is not set: only this node's keys were compared",
    ]
    document = json.loads(_ok(prewarm("why", new.key, "--json", socket=agent.socket_path)))
    assert (document["nearest"], document["location"]) == (old.key, "node")
    assert {"part": "torch_version", "cached": "2.12.0", "wanted": "2.13.0"} in document["changes"]


@pytest.mark.slow  # two agents, one after the other
def test_why_finds_a_key_another_node_uploaded_and_compact_makes_its_archives_one(
    start_agent: AgentFactory, bucket: str, s3_client: Any
) -> None:
    """On node 2, `compile why` names node 1's key from S3 (not on node 2), who signed it and
    the part that differs; `compile compact` on node 2 makes node 1's three archives of that
    key one."""
    config = f'[compile_cache]\nuri = "s3://{bucket}/cc"\nquiet_seconds = 3600\n'
    first = start_agent(config)
    with Client(first.socket_path) as client:
        old = client.compile_cache(torch_version="2.12.0", model_key="m")
        for number in range(3):
            (old.path / "inductor" / f"kernel-{number}.so").write_bytes(os.urandom(2000))
            assert client.push_compile_cache(old.key).uploaded
    first.close()
    second = start_agent(config)
    with Client(second.socket_path) as client:
        new = client.compile_cache(torch_version="2.13.0", model_key="m", skip_restore=True)
    said = _ok(prewarm("why", new.key[:10], socket=second.socket_path))
    assert said.splitlines() == [
        f"{new.key[:12]}: nearest key in S3 {old.key[:12]} (signed by test-nodes), differs in",
        "  engine_version 2.12.0 -> 2.13.0",
        "  torch_version 2.12.0 -> 2.13.0",
    ]
    document = json.loads(_ok(prewarm("why", new.key, "--json", socket=second.socket_path)))
    assert (document["location"], document["signed_by"]) == ("s3", "test-nodes")

    compacted = _ok(prewarm("compact", old.key, socket=second.socket_path))
    assert re.fullmatch(
        rf"compacted 3 archives into one \([\d.]+ (B|KiB)\) at s3://{bucket}/cc/node/{old.key}/\n",
        compacted,
    ), compacted
    manifest = s3_client.get_object(Bucket=bucket, Key=f"cc/node/{old.key}/manifest.json")
    assert len(unsealed(manifest["Body"].read())["archives"]) == 1
    again = json.loads(_ok(prewarm("compact", old.key, "--json", socket=second.socket_path)))
    assert (again["compacted"], again["skipped_reason"]) == (False, "it has one archive already")


def test_a_tenants_key_parts_reach_the_terminal_as_literal_text(
    start_agent: AgentFactory,
) -> None:
    """Key parts holding rich markup (``[/bold]``, ``[link=...]``) are listed and shown as the
    literal text they are: exit 0 (not a MarkupError), no OSC 8 link, no style applied."""
    agent = start_agent()
    socket = agent.socket_path
    with Client(socket) as client:
        handle = client.compile_cache(
            torch_version="2.13.0",
            model_key="[/bold]",
            gpu_name="[bold red]GPU",
            extras={"note": "[link=http://evil]click[/link]"},
        )
    listed = _ok(prewarm("ls", socket=socket))
    shown = _ok(prewarm("show", handle.key[:10], socket=socket))
    for out in (listed, shown):
        assert "\x1b" not in out
        assert "[/bold]" in out
        assert "[bold red]GPU" in out
    assert "[link=http://evil]click[/link]" in shown
