"""Config values that would quietly open the node (issue 11, second pass).

A tenant socket anyone on the node may connect to makes every local user that tenant; an
allowlist pattern that matches every bucket allows any source without the warning an empty
list gives. Both are refused with a ConfigError saying what to write instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent._config import ConfigError, load_settings


def _load(tmp_path: Path, text: str) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(text)
    load_settings(config)


@pytest.mark.parametrize("mode", ["0666", "0662", "0777", "0602"])
def test_a_tenant_socket_others_may_connect_to_is_refused(tmp_path: Path, mode: str) -> None:
    """A tenant socket with the others-write bit (connect permission) is a config error."""
    text = f'[[access.sockets]]\nname = "team-a"\npath = "{tmp_path / "a.sock"}"\nmode = "{mode}"\n'
    with pytest.raises(
        ConfigError, match=r"access\.sockets\[0\]\.mode \(in .*\) = .*any local user"
    ):
        _load(tmp_path, text)


@pytest.mark.parametrize("mode", ["0666", "0777", "0602"])
def test_an_api_socket_others_may_connect_to_is_refused(tmp_path: Path, mode: str) -> None:
    """The node's API socket (evict, pin, list everything) is never world-connectable."""
    with pytest.raises(ConfigError, match=r"socket_mode \(in .*\) = .*any local user"):
        _load(tmp_path, f'socket_mode = "{mode}"\n')


@pytest.mark.parametrize("mode", ["0660", "0600", "0664"])
def test_a_tenant_socket_for_its_owner_and_group_is_accepted(tmp_path: Path, mode: str) -> None:
    """Owner and group modes (0664: others may not connect without write) stay allowed."""
    text = f'[[access.sockets]]\nname = "team-a"\npath = "{tmp_path / "a.sock"}"\nmode = "{mode}"\n'
    _load(tmp_path, text)


@pytest.mark.parametrize(
    "pattern", ["s3://*", "s3://*/", "s3://*/*", "s3://?*", "s3://[a-z0-9]*/*", "s3://**"]
)
@pytest.mark.parametrize("where", ["node", "tenant"])
def test_an_allowlist_pattern_matching_every_bucket_is_refused(
    tmp_path: Path, pattern: str, where: str
) -> None:
    """A source pattern that covers every bucket, in [access] or a tenant's list, is refused."""
    if where == "node":
        text = f'[access]\nsources = ["{pattern}"]\n'
    else:
        text = (
            f'[[access.sockets]]\nname = "t"\npath = "{tmp_path / "t.sock"}"\n'
            f'sources = ["{pattern}"]\n'
        )
    with pytest.raises(ConfigError, match="matches every bucket"):
        _load(tmp_path, text)


@pytest.mark.parametrize(
    "pattern", ["s3://models-prod/*", "s3://models-*/", "s3://models-prod", "s3://m?dels/x/"]
)
def test_allowlist_patterns_naming_buckets_are_accepted(tmp_path: Path, pattern: str) -> None:
    """Patterns that name a bucket, even with a wildcard inside the name, stay allowed."""
    _load(tmp_path, f'[access]\nsources = ["{pattern}"]\n')
