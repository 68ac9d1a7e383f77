"""Every public module lists its public names in __all__, and only names it has."""

from __future__ import annotations

import importlib

import pytest

import agent

PUBLIC_MODULES = ["agent", "agent.client", "agent.testing"]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_names_exist(name: str) -> None:
    """Every name in a public module's __all__ is really defined there."""
    module = importlib.import_module(name)
    missing = [member for member in module.__all__ if not hasattr(module, member)]
    assert not missing


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_name_is_exported(name: str) -> None:
    """Every public agent-defined name a public module holds is listed in its __all__."""
    module = importlib.import_module(name)
    public = {
        member
        for member, value in vars(module).items()
        if not member.startswith("_") and getattr(value, "__module__", "").startswith("agent")
    }
    assert public <= set(module.__all__)


def test_error_tree_has_one_root() -> None:
    """Every error the agent package exports derives from PrewarmError."""
    errors = [getattr(agent, n) for n in agent.__all__ if n != "__version__"]
    assert all(issubclass(e, agent.PrewarmError) for e in errors)
