"""Both clients are built from one description per call: same methods, real signatures."""

from __future__ import annotations

import inspect

import pytest

from agent.client import AsyncClient, Client, InvalidRequest

PUBLIC = sorted(
    name
    for name, value in vars(Client).items()
    if not name.startswith("_") and inspect.isfunction(value)
)
# Methods that give a block something held open rather than an answer.
HELD = {"leased", "compile_lock"}


def test_both_clients_offer_the_same_methods() -> None:
    """AsyncClient has every public method of Client, and nothing more."""
    async_public = sorted(
        name
        for name, value in vars(AsyncClient).items()
        if not name.startswith("_") and inspect.isfunction(value)
    )
    assert async_public == PUBLIC
    assert {"ensure", "leased", "get", "compile_cache", "compile_lock"} <= set(PUBLIC)


@pytest.mark.parametrize("name", PUBLIC)
def test_methods_show_their_own_parameters_and_docstring(name: str) -> None:
    """help() and inspect see each method's real parameters and docstring, alike on both."""
    sync, asynchronous = getattr(Client, name), getattr(AsyncClient, name)
    assert inspect.signature(sync) == inspect.signature(asynchronous)
    assert next(iter(inspect.signature(sync).parameters)) == "self"
    assert sync.__qualname__ == f"Client.{name}"
    assert asynchronous.__qualname__ == f"AsyncClient.{name}"
    assert sync.__doc__
    assert sync.__doc__ == asynchronous.__doc__


def test_bound_method_signature_starts_after_self() -> None:
    """A bound method's signature starts at its first real parameter, not one past it."""
    client = Client("/nonexistent/agent.sock")
    assert list(inspect.signature(client.ensure).parameters)[:2] == ["uri", "tier"]
    assert list(inspect.signature(client.get).parameters) == ["ref"]


@pytest.mark.parametrize("name", PUBLIC)
def test_async_methods_are_coroutine_functions_unless_they_hold_a_block(name: str) -> None:
    """Awaited AsyncClient methods are coroutine functions; leased and compile_lock are not."""
    assert inspect.iscoroutinefunction(getattr(AsyncClient, name)) == (name not in HELD)
    assert not inspect.iscoroutinefunction(getattr(Client, name))


def test_bad_arguments_are_refused_before_any_connection() -> None:
    """Argument checks run while the call is built, so no agent is needed to get them."""
    with Client("/nonexistent/agent.sock") as client:
        with pytest.raises(InvalidRequest, match="sequence of glob patterns"):
            client.ensure("s3://b/m/", include="*.json")
        with pytest.raises(InvalidRequest, match="either one model"):
            client.verify()
        with pytest.raises(InvalidRequest, match="Unknown compile key part"):
            client.compile_cache(torch_versio="2.4")
