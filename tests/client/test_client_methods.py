"""Client and AsyncClient are written out method by method: the same methods, alike."""

from __future__ import annotations

import inspect

import pytest

from agent.client import AsyncClient, Client, EnsureOptions, InvalidRequest, LeasedOptions

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
    """help() and inspect see the same parameters and docstring for a method on both clients."""
    sync, asynchronous = getattr(Client, name), getattr(AsyncClient, name)
    # Only the parameters: one returns a value, the other an awaitable of it.
    assert inspect.signature(sync).parameters == inspect.signature(asynchronous).parameters
    assert next(iter(inspect.signature(sync).parameters)) == "self"
    assert sync.__qualname__ == f"Client.{name}"
    assert asynchronous.__qualname__ == f"AsyncClient.{name}"
    assert sync.__doc__
    assert sync.__doc__ == asynchronous.__doc__


def test_bound_method_signature_starts_after_self() -> None:
    """A bound method's signature starts at its first real parameter, not one past it."""
    client = Client("/nonexistent/agent.sock")
    assert list(inspect.signature(client.ensure).parameters) == ["uri", "options"]
    assert list(inspect.signature(client.get).parameters) == ["ref"]


def test_ensure_options_are_typed_keywords() -> None:
    """ensure takes its options as keywords typed by EnsureOptions; leased all of them but lease."""
    assert "tier" in EnsureOptions.__optional_keys__
    assert "lease" in EnsureOptions.__optional_keys__
    assert LeasedOptions.__optional_keys__ == EnsureOptions.__optional_keys__ - {"lease"}
    kinds = {p.name: p.kind for p in inspect.signature(Client.ensure).parameters.values()}
    assert kinds["options"] is inspect.Parameter.VAR_KEYWORD


def test_a_misspelt_option_fails_as_on_a_written_out_signature() -> None:
    """An unknown keyword is a TypeError before any connection, not silently dropped."""
    with Client("/nonexistent/agent.sock") as client:
        with pytest.raises(TypeError, match="unexpected keyword argument 'teir'"):
            client.ensure("s3://b/m/", teir="shm")  # type: ignore[call-arg]
        with (
            pytest.raises(TypeError, match="unexpected keyword argument 'lease'"),
            client.leased("s3://b/m/", lease=False),  # type: ignore[call-arg]
        ):
            pass


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
