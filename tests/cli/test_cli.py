"""The ``prewarm`` command against the real daemon and S3 server.

Each command runs in this process (``cli_helpers``: the typer app, over the daemon's real
Unix socket, with file descriptors 1 and 2 kept as a process's output); the entry point
itself, ``python -m agent.cli``, runs as a real process for ``--version`` and for a
refused request's exit status.
"""

from __future__ import annotations

import io
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
from rich.console import Console
from rich.progress import Progress
from typer.testing import CliRunner

from agent import __version__
from agent._vocabulary import human_bytes
from agent.cli import _render as render
from agent.cli import app
from agent.client import Client
from agent.testing import AgentProcess, SampleModel

_NUMBER = r"\d+(?:\.\d+)?"


def prewarm(*args: str, socket: Path) -> Ran:
    """``prewarm ARGS`` on ``socket``, in this process."""
    return prewarm_in_process(*args, socket=socket)


def prewarm_process(*args: str, socket: Path) -> subprocess.CompletedProcess[str]:
    """``python -m agent.cli ARGS`` on ``socket``: a real interpreter, as the script runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env["PREWARM_SOCKET_PATH"] = str(socket)
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def prewarm_json(*args: str, socket: Path) -> Any:
    done = prewarm(*args, "--json", socket=socket)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_pull_prints_phase_timings_then_a_hit(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`prewarm pull` prints the cold pull's phase timings and path, then a one-line hit with the
    same path.
    """
    cold = prewarm("pull", small_model.uri, socket=agent_daemon.socket_path)
    assert cold.returncode == 0, cold.stderr
    match = re.fullmatch(
        rf"cold pull of {re.escape(small_model.uri)} in {_NUMBER} s "
        rf"\(resolve {_NUMBER} s, download {_NUMBER} s, verify {_NUMBER} s, "
        rf"publish {_NUMBER} s\), {_NUMBER} MiB at {_NUMBER} [KMG]iB/s -> (?P<path>\S+)\n",
        cold.stdout,
    )
    assert match, cold.stdout
    path = Path(match["path"])
    assert path.is_relative_to(agent_daemon.shm_root)
    assert sorted(p.name for p in path.iterdir()) == sorted(
        k.rsplit("/", 1)[-1] for k in small_model.keys
    )

    warm = prewarm("pull", small_model.uri, socket=agent_daemon.socket_path)
    assert warm.returncode == 0, warm.stderr
    assert re.fullmatch(
        rf"hit: {re.escape(small_model.uri)} in {_NUMBER} s -> {re.escape(str(path))}\n",
        warm.stdout,
    )


def test_pull_json_honours_tier_and_include(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`pull --json --tier disk --include` lands on disk and keeps only the matching files."""
    handle = prewarm_json(
        "pull",
        small_model.uri,
        "--tier",
        "disk",
        "--include",
        "*.json",
        socket=agent_daemon.socket_path,
    )
    assert handle["tier"] == "disk"
    assert handle["hit"] is False
    assert Path(handle["path"]).is_relative_to(agent_daemon.disk_root)
    assert handle["files"]
    assert all(f["path"].endswith(".json") for f in handle["files"])


def test_ls_json_lists_the_pulled_model(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`ls --json` is empty at first, then lists the pulled model's key, URI, tier and sizes."""
    assert prewarm_json("ls", socket=agent_daemon.socket_path) == []
    handle = prewarm_json("pull", small_model.uri, socket=agent_daemon.socket_path)
    [model] = prewarm_json("ls", socket=agent_daemon.socket_path)
    assert model["key"] == handle["key"]
    assert model["uri"] == small_model.uri
    assert model["tier"] == "shm"
    assert model["total_bytes"] == small_model.total_bytes
    assert model["file_count"] == len(small_model.keys)


def test_ls_shows_a_table_with_the_short_key(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`ls` prints a table whose rows start with the 12-character key, URI, filters and tier."""
    handle = prewarm_json("pull", small_model.uri, socket=agent_daemon.socket_path)
    listing = prewarm("ls", socket=agent_daemon.socket_path)
    assert listing.returncode == 0, listing.stderr
    header, row = listing.stdout.splitlines()
    assert header.split()[:4] == ["key", "uri", "filters", "tier"]
    assert row.split()[:4] == [handle["key"][:12], small_model.uri, "-", "shm"]


def test_ls_tells_apart_snapshots_of_one_uri_with_other_filters(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """Two snapshots of one URI pulled with different globs are two rows showing their filters."""
    sock = agent_daemon.socket_path
    whole = prewarm_json("pull", small_model.uri, socket=sock)
    some = prewarm_json(
        "pull", small_model.uri, "--include", "*.json", "--exclude", "*index*", socket=sock
    )
    listing = prewarm("ls", socket=sock)
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line.split()[2:4] for line in listing.stdout.splitlines()[1:]}
    assert rows == {whole["key"][:12]: ["-", "shm"], some["key"][:12]: ["+*.json", "-*index*"]}


def test_show_finds_a_model_by_key_prefix(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`show` accepts a key prefix and lists the model's key, path and files."""
    handle = prewarm_json("pull", small_model.uri, socket=agent_daemon.socket_path)
    shown = prewarm("show", handle["key"][:10], socket=agent_daemon.socket_path)
    assert shown.returncode == 0, shown.stderr
    assert handle["key"] in shown.stdout
    assert handle["path"] in shown.stdout
    for key in small_model.keys:
        assert key.removeprefix(small_model.prefix) in shown.stdout


def test_evict_removes_the_model(agent_daemon: AgentProcess, small_model: SampleModel) -> None:
    """`evict` by key prefix reports what it evicted and removes the directory."""
    handle = prewarm_json("pull", small_model.uri, socket=agent_daemon.socket_path)
    evicted = prewarm("evict", handle["key"][:10], socket=agent_daemon.socket_path)
    assert evicted.returncode == 0, evicted.stderr
    assert evicted.stdout.startswith(f"evicted 1 snapshot of {small_model.uri}")
    assert prewarm_json("ls", socket=agent_daemon.socket_path) == []
    assert not Path(handle["path"]).exists()


def test_status_json_reports_version_tiers_and_models(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`status --json` reports the version, default tier, model count and each tier's root."""
    prewarm_json("pull", small_model.uri, socket=agent_daemon.socket_path)
    status = prewarm_json("status", socket=agent_daemon.socket_path)
    assert status["version"] == __version__
    assert status["default_tier"] == "shm"
    assert status["model_count"] == 1
    assert status["pulls"] == []
    roots = {t["tier"]: (t["root"], t["model_count"]) for t in status["tiers"]}
    assert roots == {
        "shm": (str(agent_daemon.shm_root), 1),
        "disk": (str(agent_daemon.disk_root), 0),
    }


def test_bad_uri_exits_2_with_the_agents_message(agent_daemon: AgentProcess) -> None:
    """A bad URI exits 2 with the agent's message on stderr and no traceback, from a real
    interpreter (the status a shell sees)."""
    done = prewarm_process("pull", "http://example.com/model", socket=agent_daemon.socket_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("error: ")
    assert "is not an S3 URI" in done.stderr
    assert "Traceback" not in done.stderr


def test_unknown_model_exits_1(agent_daemon: AgentProcess, bucket: str) -> None:
    """An unknown model exits 1 with a one-line error and no traceback."""
    done = prewarm("show", f"s3://{bucket}/nothing/", socket=agent_daemon.socket_path)
    assert done.returncode == 1
    assert done.stderr.startswith("error: ")
    assert "Traceback" not in done.stderr


def test_missing_socket_exits_3_and_says_how_to_fix_it(tmp_path: Path) -> None:
    """No agent on the socket exits 3 and says how to start one."""
    missing = tmp_path / "agent.sock"
    done = prewarm("status", "--socket", str(missing), socket=tmp_path / "ignored.sock")
    assert done.returncode == 3
    assert done.stderr.startswith(f"error: cannot reach the prewarm agent at {missing}: ")
    assert "systemctl start prewarmd" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [["ls"], ["compile", "ls"]], ids=["main", "compile"])
def test_every_app_reports_errors_escaped_with_the_same_status(
    tmp_path: Path, command: list[str]
) -> None:
    """The main and the compile app share one handler: exit 3, the message escaped on stderr."""
    # An OSC 8 hyperlink sequence, as a directory name: the message quotes the path.
    hostile = tmp_path / "\x1b]8;;evil.example\x1b\\" / "agent.sock"
    done = prewarm(*command, "--socket", str(hostile), socket=tmp_path / "ignored.sock")
    assert done.returncode == 3
    assert done.stderr.startswith("error: cannot reach the prewarm agent at ")
    assert "\x1b" not in done.stderr
    assert "\\x1b]8;;evil.example\\x1b" in done.stderr


@pytest.mark.parametrize(
    ("command", "hints"),
    [
        (["pull"], ["the agent's"] * 4 + ["/run/prewarm/agent.sock"]),
        (["exec"], ["the agent's", "/run/prewarm/agent.sock"]),
        (["gc"], ["both"]),
    ],
    ids=["pull", "exec", "gc"],
)
def test_option_help_shows_its_default_hint(command: list[str], hints: list[str]) -> None:
    """A "(default: ...)" hint in an option's help reaches --help (rich ate "[default: ...]")."""
    shown = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "400"}).output
    for hint in set(hints):
        assert shown.count(f"(default: {hint})") == hints.count(hint), hint


def test_version_flag_prints_the_version() -> None:
    """`python -m agent.cli --version` prints the package version and exits 0 without an
    agent."""
    done = prewarm_process("--version", socket=Path("/nonexistent"))
    assert done.returncode == 0
    assert done.stdout == f"prewarm {__version__}\n"


# --- leases, pins, eviction, garbage collection, verification ------------------------------


def test_pull_pin_shows_in_ls_and_unpin_clears_it(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`pull --pin` shows as pinned in `ls`; `unpin` clears it and `pin` sets it again."""
    sock = agent_daemon.socket_path
    handle = prewarm_json("pull", small_model.uri, "--pin", socket=sock)
    [model] = prewarm_json("ls", socket=sock)
    assert model["pinned"] is True
    assert model["leases"] == []
    header, row = prewarm("ls", socket=sock).stdout.splitlines()
    assert header.split()[-2:] == ["leases", "pin"]
    assert row.split()[-2:] == ["0", "pinned"]

    unpinned = prewarm("unpin", handle["key"][:10], socket=sock)
    assert unpinned.returncode == 0, unpinned.stderr
    assert unpinned.stdout == f"unpinned {small_model.uri} ({handle['key'][:12]})\n"
    assert prewarm_json("ls", socket=sock)[0]["pinned"] is False
    assert prewarm_json("pin", small_model.uri, socket=sock)["pinned"] is True


def test_evict_of_a_pinned_model_needs_force(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`evict` refuses a pinned model (exit 1) and `evict --force` removes it."""
    sock = agent_daemon.socket_path
    handle = prewarm_json("pull", small_model.uri, "--pin", socket=sock)
    refused = prewarm("evict", handle["key"], socket=sock)
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: ")
    forced = prewarm_json("evict", handle["key"], "--force", socket=sock)
    assert [m["key"] for m in forced["evicted"]] == [handle["key"]]
    assert prewarm_json("ls", socket=sock) == []


def test_show_lists_a_lease_held_by_this_process(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`show` and `ls` list a held lease with this process's pid and uid; gone once released."""
    sock = agent_daemon.socket_path
    with Client(sock) as client, client.leased(small_model.uri, client_name="ns/pod") as handle:
        assert handle.lease is not None
        shown = prewarm("show", handle.key, socket=sock)
        [model] = prewarm_json("ls", socket=sock)
    assert shown.returncode == 0, shown.stderr
    [row] = [line for line in shown.stdout.splitlines() if " ns/pod " in line]
    # Lease ids are capabilities: the agent may show them only to their holder ("-").
    assert row.split()[0] in (handle.lease.id[:8], "-")
    assert row.split()[1:4] == ["ns/pod", str(os.getpid()), str(os.getuid())]
    assert row.split()[-1] == "held"
    [lease] = model["leases"]
    assert (lease["pid"], lease["held"], lease["expires"]) == (os.getpid(), True, None)
    # The block has exited: the lease is gone.
    assert prewarm_json("ls", socket=sock)[0]["leases"] == []


def test_gc_with_room_to_spare_collects_nothing(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`gc` under the watermarks collects nothing, in text and JSON, and keeps the model."""
    sock = agent_daemon.socket_path
    prewarm_json("pull", small_model.uri, socket=sock)
    done = prewarm("gc", socket=sock)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "nothing to collect\n"
    assert prewarm_json("gc", "--tier", "disk", socket=sock) == {"evicted": [], "bytes_freed": 0}
    assert len(prewarm_json("ls", socket=sock)) == 1


def test_verify_passes_an_intact_model(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`verify` of an intact model prints ok and the totals, exit 0."""
    sock = agent_daemon.socket_path
    handle = prewarm_json("pull", small_model.uri, socket=sock)
    done = prewarm("verify", handle["key"][:10], socket=sock)
    assert done.returncode == 0, done.stderr
    first, totals = done.stdout.splitlines()
    assert first.split()[:3] == ["ok", handle["key"][:12], small_model.uri]
    assert totals == "1 ok, 0 failed"


def test_verify_reports_a_changed_file_and_exits_1(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`verify` finds a flipped byte: --report-only keeps the model, a plain verify evicts it; both
    exit 1.
    """
    sock = agent_daemon.socket_path
    handle = prewarm_json("pull", small_model.uri, socket=sock)
    victim = Path(handle["path"]) / handle["files"][0]["path"]
    victim.chmod(0o644)
    with victim.open("r+b") as file:  # same size, one byte flipped
        first = file.read(1)
        file.seek(0)
        file.write(bytes([first[0] ^ 0xFF]))

    report = prewarm("verify", "--all", "--report-only", socket=sock)
    assert report.returncode == 1
    lines = report.stdout.splitlines()
    assert lines[0].startswith(f"FAILED  {handle['key'][:12]}  {small_model.uri}")
    assert lines[0].endswith("kept")
    assert lines[1].startswith(f"  {handle['files'][0]['path']}: hash: ")
    assert lines[-1] == "0 ok, 1 failed"
    assert victim.exists()

    evicted = prewarm("verify", small_model.uri, "--json", socket=sock)
    assert evicted.returncode == 1
    [result] = json.loads(evicted.stdout)
    assert (result["ok"], result["evicted"]) == (False, True)
    assert result["problems"][0]["check"] == "hash"
    assert prewarm_json("ls", socket=sock) == []


def test_verify_needs_a_model_or_all_in_the_commands_own_words(
    agent_daemon: AgentProcess,
) -> None:
    """`verify` with neither a model nor --all, or with both, exits 2 naming --all (not the
    client's all=True)."""
    neither = prewarm("verify", socket=agent_daemon.socket_path)
    both = prewarm("verify", "s3://b/m/", "--all", socket=agent_daemon.socket_path)
    assert (neither.returncode, both.returncode) == (2, 2)
    assert neither.stderr == (
        "error: give one model to verify (a URI or a key) or --all, e.g. `prewarm verify --all`.\n"
    )
    assert both.stderr.endswith("or --all, not both.\n")
    assert "all=True" not in neither.stderr + both.stderr


def test_a_16_kib_uri_exits_2_with_a_short_message(agent_daemon: AgentProcess) -> None:
    """A 16 KiB URI exits 2 (invalid request) naming the limit, not 1 from an oversized status."""
    done = prewarm("pull", "s3://bucket/" + "a" * 16384, socket=agent_daemon.socket_path)
    assert done.returncode == 2, done.stderr
    assert "over the limit of 1100 bytes" in done.stderr
    assert len(done.stderr) < 400


def test_cached_only_pull_with_s3_up_says_cached_only_not_unreachable(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`pull --cached-only` with S3 up says the answer is from the cache without asking S3; it
    never claims S3 was unreachable."""
    sock = agent_daemon.socket_path
    assert prewarm("pull", small_model.uri, socket=sock).returncode == 0
    done = prewarm("pull", small_model.uri, "--cached-only", socket=sock)
    assert done.returncode == 0, done.stderr
    assert "(cached only: the newest cached snapshot, S3 not asked" in done.stdout
    assert "unreachable" not in done.stdout


def test_sizes_and_speeds_share_one_unit_system() -> None:
    """The summary's rate and the progress bar's speed are binary (MiB/s) like the sizes beside
    them, never decimal MB/s next to MiB."""
    size = int(87.4 * 1024**2)
    assert (human_bytes(size), render.rate(size, 0.5)) == ("87.4 MiB", "174.8 MiB/s")
    progress = Progress(console=Console(file=io.StringIO()))
    task_id = progress.add_task("download", total=size)
    task = progress.tasks[0]
    assert task.id == task_id
    task.finished_speed = 3 * 1024**3
    assert render.BinarySpeedColumn().render(task).plain == "3.0 GiB/s"


def test_a_whole_bucket_uri_is_refused_naming_the_opt_in(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """`pull s3://bucket` (no prefix) exits 2 before any S3 call, naming the prefix form and
    access.whole_buckets; nothing is pulled."""
    done = prewarm("pull", f"s3://{small_model.bucket}", socket=agent_daemon.socket_path)
    assert done.returncode == 2, done.stderr
    assert f"s3://{small_model.bucket}/ names a whole bucket (no prefix)" in done.stderr
    assert f'access.whole_buckets = ["{small_model.bucket}"]' in done.stderr
    assert prewarm_json("ls", socket=agent_daemon.socket_path) == []


def test_a_bucket_named_in_whole_buckets_may_be_pulled_whole(
    start_agent: AgentFactory, small_model: SampleModel
) -> None:
    """With the bucket in access.whole_buckets, s3://bucket pulls everything in it as one model."""
    agent = start_agent(f'[access]\nwhole_buckets = ["{small_model.bucket}"]\n')
    handle = prewarm_json("pull", f"s3://{small_model.bucket}", socket=agent.socket_path)
    assert handle["uri"] == f"s3://{small_model.bucket}/"
    assert len(handle["files"]) == len(small_model.keys)
