"""The README's quick start, as a newcomer would run it: their own config, their own daemon.

The config is taken from the README's "Run your own daemon" block as written,
with only what a reader fills in filled in: their home and user name, their
bucket, and (here) the S3 endpoint the commented ``[s3]`` lines point at.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.client import Client, wait_for_agent
from agent.testing import S3Server, SampleModel
from agent.testing._process import purge_tree

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def quick_start_config() -> str:
    """The TOML between ``<<CONFIG`` and ``CONFIG`` in the README's quick start."""
    found = re.search(r"<<CONFIG\n(.*?)\nCONFIG\n", README.read_text(), re.S)
    assert found, "the README's quick start has no <<CONFIG block"
    return found[1]


@pytest.fixture
def reader_home(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A home directory and a user name; the shm root the config names is removed after."""
    user = f"readme-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "home"
    (home / "prewarm").mkdir(parents=True)
    yield home, user
    purge_tree(Path(f"/dev/shm/prewarm-{user}"))


def test_the_quick_start_config_runs_a_daemon_that_serves_a_model(
    reader_home: tuple[Path, str], s3_server: S3Server, small_model: SampleModel
) -> None:
    """prewarmd on the README's config, as the user who wrote it, serves a model on the socket the
    config names and stops on SIGTERM."""
    home, user = reader_home
    filled_in = {
        "$HOME": str(home),
        "$USER": user,
        "s3://my-models/": f"s3://{small_model.bucket}/",
        "# [s3]": "[s3]",
        '# endpoint_url = "http://127.0.0.1:9000"': f'endpoint_url = "{s3_server.endpoint_url}"',
        '# addressing_style = "path"': 'addressing_style = "path"',
    }
    text = quick_start_config()
    for placeholder, value in filled_in.items():
        assert placeholder in text, placeholder
        text = text.replace(placeholder, value)
    config = home / "prewarm" / "agent.toml"
    config.write_text(text)
    env = {k: v for k, v in s3_server.env().items() if not k.startswith("PREWARM_")}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "agent", "--config", str(config)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        socket = home / "prewarm" / "agent.sock"
        wait_for_agent(socket, 30)
        with Client(socket) as client:
            handle = client.ensure(small_model.uri)
        assert handle.path.is_relative_to(f"/dev/shm/prewarm-{user}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        _, stderr = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, stderr
