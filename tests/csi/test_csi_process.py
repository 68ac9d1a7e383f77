"""``prewarm-csi`` as the node runs it: a process that serves until SIGTERM, then removes its
socket; a config it cannot use is exit 2 with the reason."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from agent._proto.csi.v1 import csi_pb2, csi_pb2_grpc
from agent.testing._process import read_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the plugin runs as root")


def test_the_plugin_serves_until_sigterm_and_removes_its_socket(tmp_path: Path) -> None:
    """Started with a config file, it answers GetPluginInfo on its endpoint; SIGTERM stops it
    with exit 0 and the socket is gone."""
    endpoint = tmp_path / "plugin" / "csi.sock"
    config = tmp_path / "agent.toml"
    config.write_text(
        f'socket_path = "{tmp_path / "agent.sock"}"\n[csi]\nendpoint = "{endpoint}"\n'
        f'kubelet_dir = "{tmp_path / "kubelet"}"\nstate_dir = "{tmp_path / "state"}"\n'
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "agent.csi", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")},
    )
    try:
        read_until(process, re.compile(rb"CSI node plugin csi.prewarm.io serving"), timeout=60)
        with grpc.insecure_channel(f"unix:{endpoint}") as channel:
            info = csi_pb2_grpc.IdentityStub(channel).GetPluginInfo(
                csi_pb2.GetPluginInfoRequest(), timeout=10
            )
        assert info.name == "csi.prewarm.io"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert not endpoint.exists()
    finally:
        process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()


def test_a_config_naming_an_unknown_tenant_is_exit_2_with_the_reason(tmp_path: Path) -> None:
    """A [[csi.tenants]] entry naming no [[access.sockets]] socket: exit 2, and the message
    names the tenant and the sockets there are."""
    config = tmp_path / "agent.toml"
    config.write_text('[[csi.tenants]]\ntenant = "team-z"\nnamespaces = ["z"]\n')
    done = subprocess.run(
        [sys.executable, "-m", "agent.csi", "--config", str(config)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")},
    )
    assert done.returncode == 2
    assert "'team-z'" in done.stderr
    assert "known: node" in done.stderr
