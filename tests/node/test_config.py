"""Settings: file < environment, clear errors, --print-config round-trips."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from agent_helpers import ProcessFactory

from agent._config import (
    NOT_SETTINGS,
    ConfigError,
    Settings,
    load_settings,
    render_toml,
    settings_env_names,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("PREWARM_"):
            monkeypatch.delenv(name)


def test_defaults_when_no_file_exists(tmp_path: Path) -> None:
    """With no config file the documented defaults apply."""
    settings = load_settings(None)
    assert settings.socket_path == Path("/run/prewarm/agent.sock")
    assert settings.socket_mode == 0o660
    assert settings.tiers.shm_root == Path("/dev/shm/prewarm")
    assert settings.default_tier == "shm"


def test_file_values_are_read(tmp_path: Path) -> None:
    """Values in the TOML file are read, sizes like "8MiB" parsed to bytes."""
    config = tmp_path / "agent.toml"
    config.write_text('default_tier = "disk"\n[s3]\nconcurrency = 4\nchunk_size = "8MiB"\n')
    settings = load_settings(config)
    assert settings.default_tier == "disk"
    assert settings.s3.concurrency == 4
    assert settings.s3.chunk_size == 8 * 1024**2


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PREWARM_* variables override single keys of the file and leave the rest of a table alone."""
    config = tmp_path / "agent.toml"
    config.write_text('socket_mode = "0600"\n[s3]\nconcurrency = 4\nregion = "eu-west-1"\n')
    monkeypatch.setenv("PREWARM_S3__CONCURRENCY", "9")
    monkeypatch.setenv("PREWARM_SOCKET_MODE", "0640")
    settings = load_settings(config)
    assert settings.s3.concurrency == 9
    assert settings.s3.region == "eu-west-1"  # untouched keys of the table survive
    assert settings.socket_mode == 0o640


def test_config_path_can_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$PREWARM_CONFIG names the config file when no path is given."""
    config = tmp_path / "other.toml"
    config.write_text('log_level = "debug"\n')
    monkeypatch.setenv("PREWARM_CONFIG", str(config))
    assert load_settings().log_level == "debug"


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    """An explicitly named config file that is missing is a ConfigError."""
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_invalid_value_names_the_field(tmp_path: Path) -> None:
    """Invalid values are reported with the dotted names of every bad field."""
    config = tmp_path / "agent.toml"
    config.write_text('default_tier = "ram"\n[s3]\nconcurrency = 0\n')
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    assert "default_tier" in str(info.value)
    assert "s3.concurrency" in str(info.value)


def test_unknown_key_is_an_error(tmp_path: Path) -> None:
    """A misspelt key is an error naming it, not silently ignored."""
    config = tmp_path / "agent.toml"
    config.write_text("sokcet_path = '/tmp/x'\n")
    with pytest.raises(ConfigError, match="sokcet_path"):
        load_settings(config)


def test_broken_toml_is_an_error(tmp_path: Path) -> None:
    """A file that is not valid TOML is a ConfigError saying it cannot be read."""
    config = tmp_path / "agent.toml"
    config.write_text("[s3\n")
    with pytest.raises(ConfigError, match="Cannot read config file"):
        load_settings(config)


def test_rendered_config_loads_back_to_the_same_settings(tmp_path: Path) -> None:
    """render_toml's output loads back to equal settings."""
    config = tmp_path / "agent.toml"
    config.write_text('[s3]\nendpoint_url = "http://127.0.0.1:9000"\nconcurrency = 3\n')
    settings = load_settings(config)
    rendered = tmp_path / "rendered.toml"
    rendered.write_text(render_toml(settings))
    assert load_settings(rendered) == settings


def test_prewarmd_print_config_shows_effective_values(tmp_path: Path) -> None:
    """`prewarmd --print-config` prints the merged file and environment values."""
    config = tmp_path / "agent.toml"
    config.write_text("[s3]\nconcurrency = 7\n")
    result = subprocess.run(
        [sys.executable, "-m", "agent", "--config", str(config), "--print-config"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "PREWARM_TIERS__DISK_ROOT": "/nvme/prewarm"},
    )
    assert "concurrency = 7" in result.stdout
    assert 'disk_root = "/nvme/prewarm"' in result.stdout


def test_prewarmd_reports_a_bad_config_and_exits_2(tmp_path: Path) -> None:
    """`prewarmd` with an invalid config exits 2 naming the field."""
    config = tmp_path / "agent.toml"
    config.write_text("default_tier = 3\n")
    result = subprocess.run(
        [sys.executable, "-m", "agent", "--config", str(config), "--print-config"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "default_tier" in result.stderr


def test_a_tenant_named_node_is_refused(tmp_path: Path) -> None:
    """A tenant socket may not take the name of the node's own API socket (it owns its leases)."""
    config = tmp_path / "agent.toml"
    config.write_text('[[access.sockets]]\nname = "node"\npath = "/run/prewarm/t.sock"\n')
    with pytest.raises(ConfigError, match="own API socket"):
        load_settings(config)


def print_config(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``prewarmd --print-config`` on an empty config file with only ``env`` set."""
    config = tmp_path / "agent.toml"
    config.write_text("")
    return subprocess.run(
        [sys.executable, "-m", "agent", "--config", str(config), "--print-config"],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", **env},
    )


@pytest.mark.parametrize(
    ("value", "sources"),
    [
        ("s3://models/*", ["s3://models/*"]),
        ("s3://models-prod/*, s3://shared/llama/", ["s3://models-prod/*", "s3://shared/llama/"]),
        ('["s3://models/*"]', ["s3://models/*"]),
    ],
)
def test_access_sources_from_the_environment_take_one_a_list_or_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, sources: list[str]
) -> None:
    """PREWARM_ACCESS__SOURCES takes a single pattern, comma-separated ones, or a JSON list."""
    config = tmp_path / "agent.toml"
    config.write_text("")
    monkeypatch.setenv("PREWARM_ACCESS__SOURCES", value)
    assert load_settings(config).access.sources == sources


def test_a_table_in_the_environment_that_is_not_json_exits_2_saying_to_write_json(
    tmp_path: Path,
) -> None:
    """A PREWARM_* table that is not JSON is one sentence naming the variable and JSON, exit 2,
    not pydantic-settings' traceback."""
    result = print_config(tmp_path, PREWARM_ACCESS__SOCKETS="team-a")
    assert result.returncode == 2
    assert result.stderr.startswith(
        "prewarmd: Cannot read the PREWARM_* environment (PREWARM_ACCESS__SOCKETS): a list or a "
        "table in a PREWARM_* variable is written as JSON"
    )
    assert "Traceback" not in result.stderr


def test_a_prewarm_variable_that_names_no_setting_is_warned_about_with_the_likely_one(
    tmp_path: Path,
) -> None:
    """PREWARM_METRICS_PORT (one underscore short) changes nothing, so prewarmd warns naming
    PREWARM_METRICS__PORT; the CLI's own variables are not warned about."""
    result = print_config(
        tmp_path, PREWARM_METRICS_PORT="9464", PREWARM_CACHED_ONLY="1", PREWARM_S3__REGION="x"
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == (
        "prewarmd: warning: PREWARM_METRICS_PORT is not a prewarm setting and is ignored; did "
        "you mean PREWARM_METRICS__PORT? (nested keys take two underscores)\n"
    )
    assert "port = 0" in result.stdout


def test_the_daemon_logs_a_warning_for_a_prewarm_variable_it_ignores(
    start_agent_process: ProcessFactory,
) -> None:
    """The running daemon logs the same warning at start, where journalctl shows it."""
    agent = start_agent_process(env={"PREWARM_METRICS_PORT": "9464"})
    assert "did you mean PREWARM_METRICS__PORT?" in agent.log_text()


def test_every_prewarm_variable_the_code_reads_is_a_setting_or_known() -> None:
    """The PREWARM_* names in agent/ are settings or in NOT_SETTINGS: prewarmd never warns about
    a variable that prewarm itself reads."""
    known = set(settings_env_names(Settings)) | NOT_SETTINGS
    used = {
        name
        for path in (REPO / "agent").rglob("*.py")
        for name in re.findall(r"PREWARM_[A-Z0-9_]*[A-Z0-9]", path.read_text())
    }
    quoted_typo = {"PREWARM_METRICS_PORT"}  # agent/_config.py's comment on typos quotes it
    assert used - known - quoted_typo == set()


def test_whole_buckets_take_bare_bucket_names(tmp_path: Path) -> None:
    """access.whole_buckets refuses a URI where a bucket name belongs, naming the form."""
    config = tmp_path / "agent.toml"
    config.write_text('[access]\nwhole_buckets = ["s3://models"]\n')
    with pytest.raises(ConfigError, match="write the bare name"):
        load_settings(config)


# -- errors in the project's words --------------------------------------------------------


def _refusal(config: Path, text: str) -> str:
    config.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    return str(info.value)


@pytest.mark.parametrize(
    ("removed", "named"),
    [
        ("read_timeout_seconds = 20", "first_byte_timeout_seconds"),
        ("request_timeout_ms = 3000", "s3.low_speed_seconds"),
        ("max_attempts = 5", "s3.retries"),
        ("range_retries = 5", "s3.retries"),
        ("io_block = '4MiB'", "fixed at 4 MiB"),
    ],
)
def test_a_removed_setting_in_the_file_is_refused_naming_what_replaced_it(
    tmp_path: Path, removed: str, named: str
) -> None:
    """Each removed [s3] setting is refused at load with its replacement named, never ignored."""
    config = tmp_path / "agent.toml"
    message = _refusal(config, f"[s3]\n{removed}\n")
    key = removed.split(" ", maxsplit=1)[0]
    assert f"s3.{key} (in {config}) is not a setting: it was removed;" in message
    assert named in message
    assert "Extra inputs" not in message


def test_a_removed_setting_in_the_environment_is_refused_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PREWARM_S3__REQUEST_TIMEOUT_MS is refused naming the variable and its replacement."""
    monkeypatch.setenv("PREWARM_S3__REQUEST_TIMEOUT_MS", "3000")
    message = _refusal(tmp_path / "agent.toml", "")
    assert "s3.request_timeout_ms (from PREWARM_S3__REQUEST_TIMEOUT_MS)" in message
    assert "s3.low_speed_seconds" in message


def test_a_typo_in_the_file_gets_a_did_you_mean(tmp_path: Path) -> None:
    """A misspelt key in a table is named with the setting it probably meant."""
    config = tmp_path / "agent.toml"
    message = _refusal(config, "[s3]\nregoin = 'us-east-1'\n[[access.sockets]]\nnmae = 'a'\n")
    assert f"s3.regoin (in {config}) is not a setting: did you mean s3.region?" in message
    assert "access.sockets[0].nmae" in message
    assert "did you mean access.sockets[0].name?" in message


def test_an_unknown_key_with_no_likely_name_lists_what_its_table_takes(tmp_path: Path) -> None:
    """A key nothing resembles is answered with the keys its table does take."""
    message = _refusal(tmp_path / "agent.toml", "[metrics]\nzzz = 1\n")
    assert "metrics.zzz" in message
    assert "metrics takes address, port" in message


def test_a_bad_value_says_what_it_must_be_without_pydantic_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A setting that takes 'auto' or a number says so, with the value given and its source;
    no union member names ("constrained-int") or pydantic phrases reach the operator."""
    monkeypatch.setenv("PREWARM_S3__CONCURRENCY", "lots")
    config = tmp_path / "agent.toml"
    message = _refusal(config, "[tiers]\nhigh_watermark = 2\n[s3]\ntarget_gbps = 0\n")
    assert (
        "s3.concurrency (from PREWARM_S3__CONCURRENCY) = 'lots': must be a whole number or 'auto'"
        in message
    )
    assert f"tiers.high_watermark (in {config}) = 2: must be at most 1" in message
    assert f"s3.target_gbps (in {config}) = 0: must be more than 0 or 'auto'" in message
    for pydantic_words in ("constrained", "literal[", "Input should", "Extra inputs"):
        assert pydantic_words not in message


def test_a_value_with_control_characters_is_shown_harmless(tmp_path: Path) -> None:
    """A hostile value in the file reaches the message without its escape sequences."""
    message = _refusal(tmp_path / "agent.toml", 'default_tier = "\\u001b]8;;x\\u0007ram"\n')
    assert "\x1b" not in message
    assert "\x07" not in message
    assert "default_tier" in message
