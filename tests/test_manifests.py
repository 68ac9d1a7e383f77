"""Prefetch manifests: parsing with line numbers; the real daemon acting on a watched directory."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from agent_helpers import AgentFactory

from agent.client import Client, ModelInfo
from agent.prefetch.manifests import CompileSpec, ManifestError, read_manifest
from agent.testing import AgentProcess, SampleModel

T = TypeVar("T")


def wait_until(check: Callable[[], T | None], what: str, timeout: float = 30.0) -> T:
    """Poll observable state (the agent's answers) until ``check`` returns something."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def write_atomically(path: Path, text: str) -> None:
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(text)
    staged.replace(path)


def cached(agent: AgentProcess, uri: str) -> ModelInfo | None:
    with Client(agent.socket_path) as client:
        return next((m for m in client.list_models() if m.uri == uri), None)


def cached_with_pin(agent: AgentProcess, uri: str, *, pinned: bool) -> ModelInfo | None:
    """The cached snapshot of ``uri`` once its pin is ``pinned``, else None."""
    model = cached(agent, uri)
    return model if model is not None and model.pinned == pinned else None


def log_lines(agent: AgentProcess) -> list[dict[str, object]]:
    return [json.loads(line) for line in agent.log_text().splitlines() if line[:1] == "{"]


# -- the file format --------------------------------------------------------------------


def test_a_manifest_lists_normalised_entries_with_their_lines(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(
        "# two models\n"
        "[[model]]\n"
        'uri = "s3://models/llama"\n'
        'tier = "disk"\n'
        "pin = true\n"
        'include = ["*.safetensors", "*.json", "*.json"]\n'
        "\n"
        "[model.compile]\n"
        'engine = "vllm"\n'
        'torch_version = "2.13.0"\n'
        "tensor_parallel = 8\n"
        "\n"
        "[[model]]\n"
        'uri = "s3://models/qwen/"\n'
    )
    first, second = read_manifest(path)
    assert (first.uri, first.tier, first.pin, first.line) == ("s3://models/llama/", "disk", True, 2)
    assert first.include == ("*.json", "*.safetensors")
    assert first.compile == CompileSpec(engine="vllm", torch_version="2.13.0", tensor_parallel=8)
    assert (second.uri, second.tier, second.pin, second.line) == (
        "s3://models/qwen/",
        None,
        False,
        13,
    )
    assert second.compile is None


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        ('[[model]]\nuri = "s3://models/a/"\npinned = true\n', 3, "unknown key"),
        (
            '[[model]]\nuri = "s3://models/a/"\n\n'
            '[[model]]\nuri = "s3://models/b/"\ntier = "nvme"\n',
            6,
            "'shm' or 'disk'",
        ),
        (
            '[[model]]\nuri = "s3://models/a/"\n[[model]]\nuri = "https://models/b/"\n',
            4,
            "not an S3 URI",
        ),
        (
            '[[model]]\nuri = "s3://models/a/"\n'
            '[model.compile]\nengine = "vllm"\ntensor_parallel = "eight"\n',
            5,
            "integer",
        ),
        ('[[model]]\ntier = "shm"\n', 1, "required key missing"),
        (
            '[[model]]\nuri = "s3://models/a/"\n\n[model.compile]\nengine = "vllm"\n',
            4,
            "torch_version is required",
        ),
        ('[[model]]\nuri = "s3://models/a/"\ninclude = [""]\n', 3, "empty"),
        ('[[model]]\nuri = "s3://models/a/\n', 2, "not valid TOML"),
    ],
    ids=[
        "unknown-key",
        "bad-tier",
        "bad-uri",
        "bad-compile-part",
        "missing-uri",
        "compile-without-torch-version",
        "empty-glob",
        "toml-syntax",
    ],
)
def test_a_bad_manifest_is_reported_with_its_line(
    tmp_path: Path, text: str, line: int, says: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ManifestError) as caught:
        read_manifest(path)
    assert caught.value.line == line
    assert caught.value.path == path
    assert says in str(caught.value)
    assert f"{path}, line {line}" in str(caught.value)


# -- the daemon acting on the directory ----------------------------------------------------


@pytest.fixture
def manifest_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "models.d"
    directory.mkdir()
    return directory


def manifests_config(directory: Path) -> str:
    return f'[manifests]\ndirectory = "{directory}"\n'


def test_a_manifest_dropped_into_the_directory_is_prefetched_and_pinned(
    start_agent: AgentFactory, manifest_dir: Path, small_model: SampleModel
) -> None:
    agent = start_agent(manifests_config(manifest_dir))
    assert cached(agent, small_model.uri) is None
    write_atomically(
        manifest_dir / "llama.toml",
        f'[[model]]\nuri = "{small_model.uri}"\ntier = "disk"\npin = true\n',
    )
    model = wait_until(
        lambda: cached_with_pin(agent, small_model.uri, pinned=True),
        "the manifest's model to be cached and pinned",
    )
    assert model.tier == "disk"
    assert model.total_bytes == small_model.total_bytes


def test_removing_a_manifest_unpins_what_it_pinned(
    start_agent: AgentFactory, manifest_dir: Path, small_model: SampleModel
) -> None:
    manifest = manifest_dir / "llama.toml"
    manifest.write_text(f'[[model]]\nuri = "{small_model.uri}"\npin = true\n')
    agent = start_agent(manifests_config(manifest_dir))
    wait_until(lambda: cached_with_pin(agent, small_model.uri, pinned=True), "the pin")
    manifest.unlink()
    model = wait_until(lambda: cached_with_pin(agent, small_model.uri, pinned=False), "the unpin")
    assert model.uri == small_model.uri  # unpinned, not evicted


def test_an_entry_removed_while_the_agent_was_down_is_unpinned_at_start(
    start_agent: AgentFactory, manifest_dir: Path, small_model: SampleModel
) -> None:
    manifest = manifest_dir / "llama.toml"
    manifest.write_text(f'[[model]]\nuri = "{small_model.uri}"\npin = true\n')
    agent = start_agent(manifests_config(manifest_dir))
    wait_until(lambda: cached_with_pin(agent, small_model.uri, pinned=True), "the pin")
    agent.stop()
    manifest.unlink()
    agent.start()
    wait_until(lambda: cached_with_pin(agent, small_model.uri, pinned=False), "the unpin")


def test_a_pin_made_by_hand_survives_the_manifest_going_away(
    start_agent: AgentFactory, manifest_dir: Path, small_model: SampleModel
) -> None:
    agent = start_agent(manifests_config(manifest_dir))
    with Client(agent.socket_path) as client:
        client.ensure(small_model.uri, pin=True)
    manifest = manifest_dir / "llama.toml"
    write_atomically(manifest, f'[[model]]\nuri = "{small_model.uri}"\npin = true\n')
    wait_until(
        lambda: any("already pinned by hand" in str(line["msg"]) for line in log_lines(agent)),
        "the manifest to see the pin",
    )
    manifest.unlink()
    # Every change re-reads the whole directory, so once a file written after
    # the removal has been reported, the removal has been acted on too.
    marker = str(manifest_dir / "marker.toml")
    write_atomically(manifest_dir / "marker.toml", "not toml")
    wait_until(
        lambda: any(line.get("file") == marker for line in log_lines(agent)),
        "the directory to be read again",
    )
    model = cached(agent, small_model.uri)
    assert model is not None
    assert model.pinned


def test_a_malformed_manifest_is_logged_with_its_line_and_does_not_stop_the_agent(
    start_agent: AgentFactory, manifest_dir: Path, small_model: SampleModel
) -> None:
    (manifest_dir / "a-broken.toml").write_text(
        f'[[model]]\nuri = "{small_model.uri}"\ntier = "shm"\npin = yes\n'
    )
    agent = start_agent(manifests_config(manifest_dir))
    write_atomically(
        manifest_dir / "b-unknown-key.toml", f'[[model]]\nuri = "{small_model.uri}"\npinn = true\n'
    )
    write_atomically(manifest_dir / "c-good.toml", f'[[model]]\nuri = "{small_model.uri}"\n')
    wait_until(lambda: cached(agent, small_model.uri), "the good manifest's model")

    def reported(name: str) -> dict[str, object] | None:
        return next(
            (
                line
                for line in log_lines(agent)
                if line["level"] == "error" and line.get("file") == str(manifest_dir / name)
            ),
            None,
        )

    broken = wait_until(lambda: reported("a-broken.toml"), "the report of a-broken.toml")
    unknown = wait_until(lambda: reported("b-unknown-key.toml"), "the report of the unknown key")
    assert broken["line"] == 4
    assert "not valid TOML" in str(broken["msg"])
    assert unknown["line"] == 3
    assert "pinn" in str(unknown["msg"])
    assert agent.running
    with Client(agent.socket_path) as client:
        assert client.status().model_count == 1
        [model] = client.list_models()
    assert not model.pinned  # the broken files' entries were ignored
