"""systemd integration: the sd_notify client, the real daemon's notifications, the unit files.

The daemon runs as a real subprocess with ``NOTIFY_SOCKET`` pointing at a
``NotifySocket`` (systemd's end of the protocol); the unit, tmpfiles.d and
sysusers.d files are checked with systemd's own tools where they are installed
(CI installs them, see .ci/run).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent._config import Settings
from agent.client import Client
from agent.obs.sdnotify import SystemdNotifier
from agent.testing import (
    AgentProcess,
    NotifyMessage,
    NotifySocket,
    S3Server,
    SampleModel,
    make_safetensors_model,
    upload_model,
)

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "prewarmd.service"
TMPFILES = REPO / "systemd" / "prewarm.tmpfiles"
SYSUSERS = REPO / "systemd" / "prewarm.sysusers"
MiB = 1024 * 1024


def unit_directives(text: str) -> dict[str, list[str]]:
    """``Section.Key`` -> every value it is given, in order (systemd allows repeats)."""
    directives: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        directives.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return directives


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|ms)?", value)
    assert match, f"unexpected time span {value!r}"
    number, unit = float(match[1]), match[2] or "s"
    return number * {"s": 1.0, "sec": 1.0, "min": 60.0, "ms": 0.001}[unit]


def systemd_tool(name: str) -> str:
    """The tool's path; skipped where it is missing, except in CI, which installs it."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing; .ci/run should have installed systemd's tools")
        pytest.skip(f"{name} is not installed")
    return path


def unit_for(prewarmd: Path, tmp_path: Path) -> Path:
    """The repository's unit with ExecStart at ``prewarmd``, as install.sh writes it."""
    unit = tmp_path / "prewarmd.service"
    unit.write_text(UNIT.read_text().replace("/opt/prewarm/", f"{prewarmd.parents[1]}/"))
    return unit


# -- the sd_notify client ------------------------------------------------------------------


def test_notifier_without_notify_socket_is_inert() -> None:
    """Without NOTIFY_SOCKET the notifier is disabled, has no watchdog and its calls do nothing."""
    notifier = SystemdNotifier.from_environment({"WATCHDOG_USEC": "1000000"})
    assert not notifier.enabled
    assert notifier.watchdog_seconds is None
    notifier.ready("ignored")  # a no-op, not an error


def test_notifier_reaches_an_abstract_socket() -> None:
    """An abstract NOTIFY_SOCKET (@name) receives READY=1 with the status in one datagram."""
    with NotifySocket(abstract=True) as systemd:
        assert systemd.address.startswith("@")
        SystemdNotifier.from_environment(systemd.env()).ready("serving")
        message = systemd.wait_for(lambda m: "READY=1" in m)
    assert message.lines == ("READY=1", "STATUS=serving")


def test_notifier_ignores_a_watchdog_meant_for_another_process() -> None:
    """WATCHDOG_USEC applies only when WATCHDOG_PID is absent or names this process."""
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "3000000"}
    assert SystemdNotifier.from_environment(env).watchdog_seconds == 3.0
    mine = SystemdNotifier.from_environment(env | {"WATCHDOG_PID": str(os.getpid())})
    assert mine.watchdog_seconds == 3.0
    other = SystemdNotifier.from_environment(env | {"WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_seconds is None


def test_notifier_sends_a_status_only_when_it_changes() -> None:
    """A repeated STATUS is not sent again; STOPPING=1 carries its own status."""
    with NotifySocket() as systemd:
        notifier = SystemdNotifier.from_environment(systemd.env())
        for text in ("one", "one", "two"):
            notifier.status(text)
        notifier.stopping("done")
        systemd.wait_for(lambda m: "STOPPING=1" in m)
    assert [m.lines for m in systemd.messages] == [
        ("STATUS=one",),
        ("STATUS=two",),
        ("STOPPING=1", "STATUS=done"),
    ]


def test_notifier_logs_once_and_carries_on_when_nobody_listens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NOTIFY_SOCKET nobody listens on is logged once and otherwise ignored."""
    notifier = SystemdNotifier.from_environment({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    with caplog.at_level(logging.WARNING, logger="agent.obs.sdnotify"):
        notifier.ready("a")
        notifier.status("b")
    assert [r.getMessage() for r in caplog.records if "cannot notify" in r.getMessage()] == [
        f"cannot notify systemd on {tmp_path / 'gone.sock'} "
        "([Errno 2] No such file or directory); carrying on without it"
    ]


async def test_heartbeat_pings_the_watchdog_at_half_its_interval() -> None:
    """The heartbeat sends WATCHDOG=1 every half watchdog interval, never sooner, with the status
    first.
    """
    with NotifySocket() as systemd:
        notifier = SystemdNotifier.from_environment(systemd.env(watchdog_usec=400_000))
        async with notifier.heartbeat(lambda: "fine"):
            pings = await asyncio.to_thread(_wait_for_pings, systemd, 4)
    gaps = [later.received - earlier.received for earlier, later in itertools.pairwise(pings)]
    # 0.2 s apart (half of 0.4 s); a loaded CI machine may be late, never early.
    assert all(gap >= 0.15 for gap in gaps), gaps
    assert systemd.messages[1].lines == ("STATUS=fine",)


def _wait_for_pings(systemd: NotifySocket, count: int) -> list[NotifyMessage]:
    systemd.wait_for(lambda _: len(_pings(systemd.messages)) >= count)
    return _pings(systemd.messages)


def _pings(messages: list[NotifyMessage]) -> list[NotifyMessage]:
    return [m for m in messages if "WATCHDOG=1" in m]


# -- the real daemon -----------------------------------------------------------------------


def _notifying_agent(
    s3: S3Server, systemd: NotifySocket, config: str = "", watchdog_usec: int | None = None
) -> AgentProcess:
    return AgentProcess(env=s3.env() | systemd.env(watchdog_usec=watchdog_usec), config=config)


def _index(messages: list[NotifyMessage], line: str) -> int:
    return next(i for i, m in enumerate(messages) if line in m)


def test_daemon_is_ready_only_once_both_sockets_are_bound(s3_server: S3Server) -> None:
    """The daemon says READY=1 only after the API and lease sockets accept connections, with its
    status lines.
    """
    with NotifySocket() as systemd, _notifying_agent(s3_server, systemd) as agent:
        lease_socket = agent.socket_path.parent / "lease.sock"

        def bound_when_ready(message: NotifyMessage) -> bool:
            if "READY=1" not in message:
                return False
            for path in (agent.socket_path, lease_socket):
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.connect(str(path))  # raises if READY came before the bind
            return True

        ready = systemd.wait_for(bound_when_ready)
        first = systemd.messages[0]
    assert first.get("STATUS") == (
        f"Reconciling the cache in {agent.shm_root} and {agent.disk_root}"
    )
    assert ready.get("STATUS") == (
        f"Serving on {agent.socket_path}: 0 models cached (0.0 GiB), 0 pulls in flight"
    )
    assert not _pings(systemd.messages)  # no WatchdogSec=, no pings


def test_daemon_pings_the_watchdog_after_ready(s3_server: S3Server) -> None:
    """With WatchdogSec set, the daemon's watchdog pings begin only after READY=1."""
    with NotifySocket() as systemd, _notifying_agent(s3_server, systemd, watchdog_usec=300_000):
        pings = _wait_for_pings(systemd, 3)
        ready_at = _index(systemd.messages, "READY=1")
    assert pings[0].received >= systemd.messages[ready_at].received
    assert _index(systemd.messages, "WATCHDOG=1") > ready_at


def test_daemon_status_counts_cached_models(s3_server: S3Server, small_model: SampleModel) -> None:
    """The daemon's STATUS line counts a model once it is cached."""
    with (
        NotifySocket() as systemd,
        _notifying_agent(s3_server, systemd, watchdog_usec=200_000) as agent,
    ):
        with Client(agent.socket_path) as client:
            client.ensure(small_model.uri)
        # The pull's last moments may show "1 pull in flight" too; the settled line must come.
        settled = f"Serving on {agent.socket_path}: 1 model cached (0.0 GiB), 0 pulls in flight"
        systemd.wait_for(lambda m: m.get("STATUS") == settled)
        ready = systemd.messages[_index(systemd.messages, "READY=1")]
    assert ready.get("STATUS") == (
        f"Serving on {agent.socket_path}: 0 models cached (0.0 GiB), 0 pulls in flight"
    )


@pytest.mark.slow
def test_sigterm_mid_pull_says_stopping_and_exits_within_the_units_stop_timeout(
    stoppable_s3: S3Server, tmp_path: Path
) -> None:
    """SIGTERM during a hung pull says STOPPING=1, keeps the pull resumable and exits well within
    TimeoutStopSec.
    """
    source = tmp_path / "model"
    tensors = make_safetensors_model(source, total_bytes=16 * MiB, shards=2)
    s3 = stoppable_s3.client()
    s3.create_bucket(Bucket="models")
    model = upload_model(s3, "models", "m", source, tensors=tensors)
    grace = 1.0
    config = f'shutdown_grace_seconds = {grace}\n[s3]\nchunk_size = "1MiB"\nconcurrency = 1\n'
    with NotifySocket() as systemd, _notifying_agent(stoppable_s3, systemd, config) as agent:
        moving = threading.Event()

        def pull() -> None:
            try:
                Client(agent.socket_path).ensure(
                    model.uri, progress=lambda p: moving.set() if p.bytes_done else None
                )
            except Exception:
                moving.set()

        puller = threading.Thread(target=pull)
        puller.start()
        assert moving.wait(timeout=60)
        stoppable_s3_pid = stoppable_s3.pid
        assert stoppable_s3_pid is not None
        os.kill(stoppable_s3_pid, signal.SIGSTOP)  # the pull hangs mid-range, as on a bad link
        try:
            started = time.monotonic()
            assert agent.stop() == 0
            took = time.monotonic() - started
        finally:
            os.kill(stoppable_s3_pid, signal.SIGCONT)
        puller.join()
        staging = list((agent.shm_root / "staging").iterdir())
        journal_kept = [(path / "journal").is_file() for path in staging]
    messages = systemd.messages
    assert _index(messages, "READY=1") < _index(messages, "STOPPING=1")
    assert messages[_index(messages, "STOPPING=1")].get("STATUS") == (
        "Stopping: draining requests for up to 1 s; 1 pull in flight will stay resumable"
    )
    assert journal_kept == [True]  # resumable
    # What the stop takes beyond the grace must fit in the unit's margin over the default grace.
    directives = unit_directives(UNIT.read_text())
    margin = seconds(directives["Service.TimeoutStopSec"][-1]) - Settings().shutdown_grace_seconds
    assert took - grace < margin / 2, f"stop took {took:.1f} s"


# -- the unit files ------------------------------------------------------------------------


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """The unit as installed passes systemd-analyze verify without a warning."""
    tool = systemd_tool("systemd-analyze")
    unit = unit_for(Path(sys.executable).with_name("prewarmd"), tmp_path)
    result = subprocess.run(
        [tool, "verify", str(unit)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_unit_sandbox_exposure_stays_below_two(tmp_path: Path) -> None:
    """systemd-analyze security rates the unit's exposure below 2.0."""
    tool = systemd_tool("systemd-analyze")
    unit = unit_for(Path(sys.executable).with_name("prewarmd"), tmp_path)
    # --offline needs systemd >= 250; 20 is 2.0 on the 0-10 scale systemd prints.
    result = subprocess.run(
        [tool, "security", "--offline=true", "--threshold=20", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    if "--offline" in result.stderr and "unrecognized" in result.stderr:
        pytest.skip("this systemd-analyze has no --offline")
    assert result.returncode == 0, result.stdout[-2000:]


def test_unit_is_a_hardened_notify_service() -> None:
    """The unit is Type=notify with a watchdog, no capabilities, a strict sandbox and the default
    roots writable.
    """
    directives = unit_directives(UNIT.read_text())

    def one(key: str) -> str:
        assert len(directives[f"Service.{key}"]) == 1, key
        return directives[f"Service.{key}"][0]

    assert one("Type") == "notify"
    assert one("Restart") == "on-failure"
    assert one("RuntimeDirectory") == one("StateDirectory") == "prewarm"
    assert one("User") == one("Group") == "prewarm"
    assert seconds(one("WatchdogSec")) > 0
    assert one("ProtectSystem") == "strict"
    assert one("ProtectHome") == one("PrivateTmp") == one("NoNewPrivileges") == "yes"
    assert one("CapabilityBoundingSet") == one("AmbientCapabilities") == ""
    assert one("RestrictAddressFamilies").split() == ["AF_UNIX", "AF_INET", "AF_INET6"]
    defaults = Settings.model_construct()  # what the packaged config leaves at default
    writable = set(one("ReadWritePaths").split())
    assert {
        str(defaults.tiers.shm_root),
        str(defaults.tiers.disk_root),
        str(defaults.socket_path.parent),
    } <= writable
    assert seconds(one("TimeoutStopSec")) >= Settings().shutdown_grace_seconds + 20


def test_tmpfiles_and_sysusers_create_the_cache_roots_for_the_prewarm_user(
    tmp_path: Path,
) -> None:
    """sysusers.d creates the prewarm user (gid 2929) and tmpfiles.d its roots, owned by it: the
    socket directory 0755, the tier roots traverse-only (0711).
    """
    sysusers = systemd_tool("systemd-sysusers")
    tmpfiles = systemd_tool("systemd-tmpfiles")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    subprocess.run([sysusers, f"--root={root}", str(SYSUSERS)], check=True, capture_output=True)
    uid = _id_of("prewarm", root / "etc" / "passwd")
    gid = _id_of("prewarm", root / "etc" / "group")
    result = subprocess.run(
        [tmpfiles, "--create", f"--root={root}", str(TMPFILES)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for directory, mode in (
        ("dev/shm/prewarm", 0o711),
        ("var/lib/prewarm", 0o711),
        ("run/prewarm", 0o755),
    ):
        info = (root / directory).stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o7777) == (uid, gid, mode), directory
    assert gid == 2929  # fixed, so pods can name it in supplementalGroups


def _id_of(name: str, database: Path) -> int:
    """The uid or gid of ``name`` in an /etc/passwd or /etc/group file."""
    entry = next(line for line in database.read_text().splitlines() if line.startswith(f"{name}:"))
    return int(entry.split(":")[2])
