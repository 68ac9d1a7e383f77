"""The key parts ``prewarm exec`` reads from a vLLM or SGLang command line, by meaning."""

from __future__ import annotations

import pytest

from agent.cli._engine_flags import detect_engine, engine_key_fields, merged_key_fields

SERVE = ["vllm", "serve", "{model}"]
SGLANG = ["python", "-m", "sglang.launch_server", "--model-path", "{model}"]


def _vllm(*flags: str, ignore: frozenset[str] = frozenset()) -> dict[str, str]:
    return engine_key_fields("vllm", [*SERVE, *flags], ignore)


def _sglang(*flags: str) -> dict[str, str]:
    return engine_key_fields("sglang", [*SGLANG, *flags])


# Spellings vLLM's own parser reads as the same settings.
SAME_MEANING = [
    (["--max-num-batched-tokens", "8192"], ["--max_num_batched_tokens=8192"]),
    (["-O3"], ["-O", "3"]),
    (["-O=3"], ["--optimization-level", "3"]),
    (["--compilation-config", '{"b": 1, "a": 2}'], ['--compilation-config={"a":2,"b":1}']),
    (["-O.mode=0"], ["--compilation-config", '{"mode":0}']),
    (["-cc", '{"mode":0}'], ["--compilation-config.mode", "0"]),
    (["-cc.mode=0"], ["--compilation_config.mode", "0"]),
    (["-cc", '{"level": 3}'], ["-cc.mode", "VLLM_COMPILE"]),
    (["-cc.mode=3", "-cc.backend=inductor"], ["-cc", '{"backend":"inductor","mode":3}']),
    (
        ["-cc.cudagraph_capture_sizes+", "1,2", "-cc.cudagraph_capture_sizes+=4"],
        ["-cc", '{"cudagraph_capture_sizes":[1,2,4]}'],
    ),
    (["--compilation-config", "{}"], []),
    (["--dtype", "half"], ["--dtype=float16"]),
    (["--dtype", "auto"], []),
    (["--kv-cache-dtype", "auto"], []),
    (["--runner", "auto"], []),
    (["--no-enforce-eager"], []),
    (["--max-model-len", "1K"], ["--max-model-len", "1024"]),
    (["--max-model-len", "32k"], ["--max-model-len=32000"]),
    (["--quantization", "FP8"], ["-q", "fp8"]),
    (["-tp", "2"], ["--tensor_parallel_size=2"]),
    (["-tp", "1"], []),
    (["--enable-expert-parallel"], ["-ep"]),
    (["--dtype", "bfloat16", "--port", "8000"], ["--host", "0.0.0.0", "--dtype=bfloat16"]),
    (["--enforce-eager", "--dtype", "half"], ["--dtype", "half", "--enforce-eager"]),
]
# Spellings that mean different things: never one key.
DIFFERENT_MEANING = [
    (["--max-num-batched-tokens", "8192"], ["--max-num-batched-tokens", "16384"]),
    (["-O3"], ["-O0"]),
    (["-O3"], ["-O.mode=3"]),
    (["--dtype", "bfloat16"], ["--dtype", "float16"]),
    ([], ["--enforce-eager"]),
    ([], ["-cc", '{"mode":0}']),
    ([], ["--compilation-config.mode", "0"]),
    (["-cc.mode=0"], ["-cc.mode=3"]),
    (["--compilation-config", '{"level": 3}'], ["--compilation-config", '{"level": 1}']),
    ([], ["--runner", "generate"]),
    (["--runner", "generate"], ["--runner", "pooling"]),
    (["--kv-cache-dtype", "fp8"], []),
    (["--max-model-len", "1k"], ["--max-model-len", "1K"]),
    (["--enable-prefix-caching"], ["--no-enable-prefix-caching"]),
    ([], ["--enable-prefix-caching"]),
    ([], ["--quantization", "awq"]),
    ([], ["--enable-expert-parallel"]),
    (["-tp", "2"], ["-tp", "4"]),
    (["-pp", "2"], ["-dp", "2"]),
]


@pytest.mark.parametrize(("one", "other"), SAME_MEANING)
def test_vllm_spellings_with_one_meaning_give_one_key(one: list[str], other: list[str]) -> None:
    """JSON and dotted compilation config, -O forms, aliases, defaults, order: one key."""
    assert _vllm(*one) == _vllm(*other)


@pytest.mark.parametrize(("one", "other"), DIFFERENT_MEANING)
def test_vllm_settings_with_different_meanings_never_share_a_key(
    one: list[str], other: list[str]
) -> None:
    """Compilation off, another runner, batched tokens, dtype, lengths, parallelism: new key."""
    assert _vllm(*one) != _vllm(*other)


@pytest.mark.parametrize(
    ("one", "other", "same"),
    [
        (["--tp-size", "4"], ["--tensor-parallel-size", "4"], True),
        (["--dtype", "half"], ["--dtype", "float16"], True),
        (["--ep-size", "1"], [], True),
        (["--context-length", "4096"], ["--context-length", "8192"], False),
        (["--chunked-prefill-size", "4096"], ["--chunked-prefill-size", "8192"], False),
        ([], ["--enable-torch-compile"], False),
        (["--ep", "2"], ["--ep", "4"], False),
        (["--quantization", "fp8"], [], False),
    ],
)
def test_sglang_settings_are_keyed_by_meaning(one: list[str], other: list[str], same: bool) -> None:
    """SGLang's aliases and defaults share a key; its graph-changing settings do not."""
    assert (_sglang(*one) == _sglang(*other)) is same


def test_a_changed_setting_is_named_in_the_key_parts() -> None:
    """Each setting is its own extra, so a miss can say which one changed."""
    assert _vllm("--max-num-batched-tokens", "8192", "-cc.mode=0") == {
        "extras.flag.max_num_batched_tokens": "8192",
        "extras.flag.compilation_config": '{"mode":0}',
    }


def test_parallel_sizes_become_the_keys_own_parts() -> None:
    """-tp/-pp/-dp (vLLM) and --tp-size/--dp-size (SGLang) fill the parallel key parts."""
    assert _vllm("-tp", "8", "--pipeline-parallel-size=2") == {
        "tensor_parallel": "8",
        "pipeline_parallel": "2",
    }
    assert _sglang("--tp-size", "4", "--dp-size", "2") == {
        "tensor_parallel": "4",
        "data_parallel": "2",
    }


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (["--host", "10.0.0.1", "--port", "8000"], ["--host", "10.0.0.2", "--port", "8001"]),
        (
            ["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_ip":"10.0.0.1"}'],
            ["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_ip":"10.0.0.2"}'],
        ),
        (
            ["-cc", '{"mode":3,"cache_dir":"/tmp/pod-a","debug_dump_path":"/tmp/a"}'],
            ["-cc.mode=3", "-cc.cache_dir=/tmp/pod-b"],
        ),
        (
            ["--speculative-config", '{"method":"eagle","model":"/tmp/tmpa1b2/draft"}'],
            ["--speculative-config", '{"method":"eagle","model":"/tmp/tmpz9y8/draft"}'],
        ),
        (
            ["--served-model-name", "pod-a", "--data-parallel-address", "10.0.0.1"],
            ["--served-model-name", "pod-b", "--data-parallel-address", "10.0.0.9"],
        ),
    ],
)
def test_pod_local_values_never_enter_a_key(one: list[str], other: list[str]) -> None:
    """Hosts, ports, side-channel addresses, names and temporary paths leave the key alone."""
    assert _vllm("-cc.mode=3", *one) == _vllm("-cc.mode=3", *other)


def test_key_ignore_leaves_out_a_setting_or_a_field_of_one() -> None:
    """--key-ignore takes a setting (by name, extra or option) or a dotted JSON field."""
    flags = ("--max-num-seqs", "8", "-cc", '{"mode":3,"custom_ops":["none"]}')
    for ignored in ("max_num_seqs", "flag.max_num_seqs", "--max-num-seqs"):
        assert _vllm(*flags, ignore=frozenset({ignored})) == {
            "extras.flag.compilation_config": '{"custom_ops":["none"],"mode":3}'
        }
    assert _vllm(*flags, ignore=frozenset({"compilation_config.custom_ops"})) == {
        "extras.flag.compilation_config": '{"mode":3}',
        "extras.flag.max_num_seqs": "8",
    }


def test_a_long_setting_is_keyed_by_its_hash() -> None:
    """A value too long for a key extra becomes its sha256, still one per meaning."""
    sizes = ",".join(str(size) for size in range(1, 200))
    fields = _vllm("-cc.cudagraph_capture_sizes+", sizes)
    assert fields["extras.flag.compilation_config"].startswith("sha256:")
    assert fields != _vllm("-cc.cudagraph_capture_sizes+", sizes + ",512")


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


def test_given_parts_win_over_derived_ones() -> None:
    """--compile-key values are kept over the command's flags and the engine's world."""
    derived = {"tensor_parallel": "8", "extras.flag.dtype": "float16", "torch_version": "2.10"}
    merged = merged_key_fields({"tensor_parallel": "4", "config_hash": "mine"}, derived)
    assert merged == {
        "tensor_parallel": "4",
        "config_hash": "mine",
        "extras.flag.dtype": "float16",
        "torch_version": "2.10",
    }
