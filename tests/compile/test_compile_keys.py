"""Compile-cache keys: normalised parts hash to one key; any real difference to another."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from agent._exceptions import InvalidRequest
from agent.client import detect_key_parts
from agent.compile.keys import CompileKeyParts, compile_key, engine_env, normalise_parts

BASE = CompileKeyParts(
    engine="vllm",
    engine_version="0.11.0",
    torch_version="2.13.0+cu128",
    triton_version="3.5.0",
    cuda_version="12.8",
    gpu_name="NVIDIA H100 80GB HBM3",
    model_key="3f" * 16,
    tensor_parallel=8,
    config_hash="abc",
    extras={"dtype": "bfloat16", "python": "3.11.9"},
)


def test_spelling_differences_give_the_same_key() -> None:
    """Case, spacing, extras order and unset parallelism do not change the key."""
    sloppy = replace(
        BASE,
        engine=" vLLM ",
        gpu_name="NVIDIA  H100 80GB   HBM3 ",
        extras={"python": "3.11.9", "dtype": " bfloat16"},
        pipeline_parallel=0,
        data_parallel=0,
    )
    assert compile_key(sloppy) == compile_key(BASE)


@pytest.mark.parametrize(
    "change",
    [
        {"torch_version": "2.13.1+cu128"},
        {"triton_version": "3.5.1"},
        {"gpu_name": "NVIDIA H200"},
        {"tensor_parallel": 4},
        {"model_key": "00" * 16},
        {"extras": {"dtype": "float16", "python": "3.11.9"}},
        {"engine": "sglang"},
    ],
)
def test_any_real_difference_gives_another_key(change: dict[str, object]) -> None:
    """Any change of version, GPU, parallelism, model, extras or engine gives another key."""
    assert compile_key(replace(BASE, **change)) != compile_key(BASE)  # type: ignore[arg-type]


def test_torch_version_is_required() -> None:
    """A blank torch_version is refused: the key would match incompatible caches."""
    with pytest.raises(InvalidRequest, match="torch_version is required"):
        compile_key(replace(BASE, torch_version=" "))


def test_unknown_engine_is_refused() -> None:
    """An engine the agent does not know is refused by name."""
    with pytest.raises(InvalidRequest, match="Unknown engine 'tensorrt'"):
        normalise_parts(replace(BASE, engine="tensorrt"))


@pytest.mark.parametrize("text", ["a\x1b[31mb", "a\u202eb", "a\x00b", "a\x85b", "a\nb"])
def test_control_and_bidi_characters_in_an_extra_are_refused(text: str) -> None:
    """An extra with a control, C1 or bidi character is refused as the API refuses it: parts
    read back from S3 (manifests, the index of keys by model) reach logs and terminals."""
    with pytest.raises(InvalidRequest, match="is refused"):
        normalise_parts(CompileKeyParts(torch_version="2.13.0", extras={"flag.x": text}))


def test_a_bidi_override_in_a_gpu_name_is_refused_while_whitespace_collapses() -> None:
    """The GPU name's runs of whitespace become one space; a bidi override is refused."""
    spaced = normalise_parts(CompileKeyParts(torch_version="2.13.0", gpu_name="NVIDIA\n  H100"))
    assert spaced.gpu_name == "NVIDIA H100"
    with pytest.raises(InvalidRequest, match="is refused"):
        normalise_parts(CompileKeyParts(torch_version="2.13.0", gpu_name="H100\u202e"))


def test_plain_torch_defaults_its_engine_version_to_torch() -> None:
    """Plain torch parts take torch's version as the engine version."""
    parts = normalise_parts(CompileKeyParts(torch_version="2.13.0"))
    assert (parts.engine, parts.engine_version) == ("torch", "2.13.0")


def test_each_engine_gets_its_own_variables() -> None:
    """Each engine's env points its own cache variables into the key directory."""
    directory = Path("/cache/compile/k")
    vllm = engine_env("vllm", directory, "a" * 32)
    sglang = engine_env("sglang", directory, "a" * 32)
    assert vllm["VLLM_CACHE_ROOT"] == "/cache/compile/k/vllm"
    assert sglang["SGLANG_CACHE_DIR"] == "/cache/compile/k/sglang"
    assert "VLLM_CACHE_ROOT" not in engine_env("torch", directory, "a" * 32)
    assert sglang["TORCHINDUCTOR_CACHE_DIR"] == "/cache/compile/k/inductor"


def test_detected_parts_on_the_cpu_name_torch_and_the_cpu() -> None:
    """Detection on a CPU-only host names the installed torch and "cpu", and yields a usable key."""
    import torch

    parts = detect_key_parts(model_key="m", extras={"dtype": "float32"})
    assert parts.torch_version == torch.__version__
    assert parts.gpu_name == "cpu"
    assert parts.extras["dtype"] == "float32"
    assert "python" in parts.extras
    assert compile_key(parts)  # complete enough to key
