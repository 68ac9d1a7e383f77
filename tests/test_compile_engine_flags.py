"""The key parts ``prewarm exec`` reads from a vLLM or SGLang command line."""

from __future__ import annotations

import pytest

from agent.cli._engine_flags import detect_engine, engine_key_fields, merged_key_fields

SERVE = ["vllm", "serve", "/models/llama"]


def _vllm(*flags: str) -> dict[str, str]:
    return engine_key_fields("vllm", [*SERVE, *flags])


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (["--max-num-batched-tokens", "8192"], ["--max_num_batched_tokens=8192"]),
        (["-O3"], ["-O", "3"]),
        (["--compilation-config", '{"b": 1, "a": 2}'], ['--compilation-config={"a":2,"b":1}']),
        (["--dtype", "bfloat16", "--port", "8000"], ["--host", "0.0.0.0", "--dtype=bfloat16"]),
        (["--enforce-eager", "--dtype", "half"], ["--dtype", "half", "--enforce-eager"]),
    ],
)
def test_launches_vllm_compiles_the_same_way_get_the_same_key_fields(
    one: list[str], other: list[str]
) -> None:
    """Spelling, order and flags that change no graph (port, host) do not change the key."""
    assert _vllm(*one) == _vllm(*other)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (["--max-num-batched-tokens", "8192"], ["--max-num-batched-tokens", "4096"]),
        (["-O3"], ["-O0"]),
        (["--dtype", "bfloat16"], ["--dtype", "float16"]),
        ([], ["--enforce-eager"]),
        (["--compilation-config", '{"level": 3}'], ["--compilation-config", '{"level": 1}']),
        (["--kv-cache-dtype", "fp8"], []),
    ],
)
def test_launches_vllm_compiles_differently_get_different_key_fields(
    one: list[str], other: list[str]
) -> None:
    """A graph-changing flag (batched tokens, -O level, dtype, eager, kv dtype) changes the key."""
    assert _vllm(*one) != _vllm(*other)


def test_parallel_sizes_become_the_keys_own_parts() -> None:
    """-tp/-pp/-dp (vLLM) and --tp-size/--dp-size (SGLang) fill the parallel key parts."""
    assert _vllm("-tp", "8", "--pipeline-parallel-size=2") == {
        "tensor_parallel": "8",
        "pipeline_parallel": "2",
    }
    sglang = ["python", "-m", "sglang.launch_server", "--tp-size", "4", "--dp-size", "2"]
    assert engine_key_fields("sglang", sglang) == {"tensor_parallel": "4", "data_parallel": "2"}


def test_a_switch_does_not_swallow_the_positional_after_it() -> None:
    """``--enforce-eager /models/x`` is a switch and a path, not a flag with a value."""
    assert _vllm("--enforce-eager") == engine_key_fields(
        "vllm", ["vllm", "serve", "--enforce-eager", "/models/llama"]
    )


def test_the_engine_is_detected_from_the_command() -> None:
    """``vllm serve`` and ``python -m sglang.launch_server`` name their engine; others none."""
    assert detect_engine(["/usr/bin/vllm", "serve", "m"]) == "vllm"
    assert detect_engine(["python", "-m", "vllm.entrypoints.openai.api_server"]) == "vllm"
    assert detect_engine(["python3", "-m", "sglang.launch_server"]) == "sglang"
    assert detect_engine(["python", "train.py"]) is None
    assert engine_key_fields("torch", ["python", "--dtype", "x"]) == {}


def test_given_parts_win_and_a_given_config_hash_keeps_the_derived_one_beside_it() -> None:
    """--compile-key values are kept; a derived flag hash then goes to extras.engine_flags."""
    derived = {"tensor_parallel": "8", "config_hash": "engine-flags:1"}
    merged = merged_key_fields({"tensor_parallel": "4", "config_hash": "mine"}, derived)
    assert merged == {
        "tensor_parallel": "4",
        "config_hash": "mine",
        "extras.engine_flags": "engine-flags:1",
    }
