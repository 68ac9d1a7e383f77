"""Why a key missed: the nearest cached key of the same model and the parts that differ."""

from __future__ import annotations

from agent.compile.keys import CompileKeyParts, compile_key
from agent.compile.why import PartChange, nearest_key, part_changes

BASE = CompileKeyParts(
    engine="vllm",
    engine_version="0.16.0",
    torch_version="2.10.0",
    model_key="minilm",
    extras={"flag.max_num_batched_tokens": "8192"},
)


def _with(**changes: object) -> CompileKeyParts:
    fields = {
        "engine": BASE.engine,
        "engine_version": BASE.engine_version,
        "torch_version": BASE.torch_version,
        "model_key": BASE.model_key,
        "extras": dict(BASE.extras),
        **changes,
    }
    return CompileKeyParts(**fields)  # type: ignore[arg-type]


def test_the_parts_that_differ_are_named_with_both_values() -> None:
    """A changed torch and a changed flag are each named, cached value first."""
    wanted = _with(torch_version="2.13.0", extras={"flag.max_num_batched_tokens": "16384"})
    assert part_changes(BASE, wanted) == (
        PartChange("extras.flag.max_num_batched_tokens", "8192", "16384"),
        PartChange("torch_version", "2.10.0", "2.13.0"),
    )
    assert PartChange("torch_version", "2.10.0", "2.13.0").describe() == (
        "torch_version 2.10.0 -> 2.13.0"
    )


def test_spelling_is_never_a_difference() -> None:
    """Parts are compared normalised: case, whitespace and an unset size of 1 are the same."""
    assert part_changes(BASE, _with(engine=" vLLM ", tensor_parallel=0)) == ()


def test_the_nearest_key_is_the_one_of_the_same_model_with_fewest_differences() -> None:
    """Another model, the key itself and farther keys are passed over."""
    wanted = _with(torch_version="2.13.0")
    one_off = _with()
    two_off = _with(extras={"flag.max_num_batched_tokens": "4096"}, engine_version="0.15.0")
    other_model = _with(model_key="llama", torch_version="2.13.0")
    cached = [
        (compile_key(two_off), two_off),
        (compile_key(other_model), other_model),
        (compile_key(wanted), wanted),
        (compile_key(one_off), one_off),
    ]
    nearest = nearest_key(wanted, cached, own_key=compile_key(wanted))
    assert nearest is not None
    assert nearest.key == compile_key(one_off)
    assert nearest.describe() == (
        f"nearest cached key {compile_key(one_off)[:12]} differs in torch_version 2.10.0 -> 2.13.0"
    )


def test_no_key_of_the_same_model_means_no_nearest() -> None:
    """A model never cached on the node has nothing to compare with."""
    other = _with(model_key="llama")
    assert nearest_key(BASE, [(compile_key(other), other)]) is None
