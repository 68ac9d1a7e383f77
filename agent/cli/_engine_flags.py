"""The parts of a compile-cache key that ``prewarm exec`` reads from a vLLM or SGLang command.

vLLM hashes its config (``VllmConfig.compute_hash()``: the model, parallel,
cache, scheduler, LoRA, speculative and compilation configs) into
``torch_compile_cache/<hash>/``; SGLang's compiled graphs depend on the same
kinds of settings. The command is read the way each engine reads it, then
keyed by *meaning*: vLLM's ``FlexibleArgumentParser`` turns ``--a_b`` into
``--a-b``, ``-O3``/``-O=3``/``-O 3`` into ``--optimization-level 3``, and
dotted options (``-O.mode=0``, ``-cc.mode 0``, ``--compilation-config.mode=0``,
``.x+`` appends) into one JSON dict merged with the JSON form; so every
spelling of one setting gives one value. Values are normalised (``half`` is
``float16``; ``1K`` is 1024 and ``1k`` 1000 for lengths; compilation modes
by name or number; the old ``level`` is ``mode``), an engine's default given
explicitly equals leaving it out, and then each setting becomes a key extra
``flag.<setting>``, so that a miss can name the flag that changed.

Pod-local values never enter a key: only the settings listed here are read
(host, port, addresses, logging, the KV-transfer config with its side
channel are not), JSON fields that name hosts, ports or paths are dropped,
and temporary paths inside values become ``<pod-local path>``. ``--key-ignore``
drops more. docs/compile-cache.md lists all of it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "POD_LOCAL_JSON_FIELDS",
    "detect_engine",
    "engine_key_fields",
    "engine_settings",
    "merged_key_fields",
]

FLAG_EXTRA = "flag."
# A key extra holds at most 256 characters; longer values are keyed by their hash.
_MAX_VALUE = 200
POD_LOCAL_PATH = "<pod-local path>"
# Fields inside JSON option values that say where a pod is, not what it compiles.
POD_LOCAL_JSON_FIELDS = frozenset(
    {
        "cache_dir",
        "local_cache_dir",
        "debug_dump_path",
        "host",
        "port",
        "ip",
        "kv_ip",
        "kv_port",
        "address",
        "master_addr",
        "master_port",
        "side_channel_host",
        "side_channel_port",
        "hostname",
        "pod_name",
        "node_name",
    }
)
_TEMP_PREFIXES = ("/tmp/", "/var/tmp/", "/dev/shm/", "/run/")
# vLLM's CompilationMode (vllm/config/compilation.py), by name.
_COMPILATION_MODES = {
    "none": 0,
    "stock_torch_compile": 1,
    "dynamo_trace_once": 2,
    "vllm_compile": 3,
}
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _integer(value: Any) -> Any:
    text = str(value).strip()
    return int(text) if re.fullmatch(r"[+-]?\d+", text) else text


def _human_integer(value: Any) -> Any:
    """vLLM's ``human_readable_int``: ``1k`` is 1000, ``1K`` is 1024, ``25.6k`` is 25600."""
    match = _HUMAN_INT.fullmatch(str(value).strip())
    if match is None:
        return str(value).strip()
    number, suffix = match.groups()
    if suffix in _BINARY:
        return int(number) * _BINARY[suffix] if number.isdigit() else str(value).strip()
    return int(float(number) * _DECIMAL[suffix])


def _dtype(value: Any) -> Any:
    text = str(value).strip().lower()
    return _DTYPE_ALIASES.get(text, text)


def _lower(value: Any) -> Any:
    return str(value).strip().lower()


def _text(value: Any) -> Any:
    return str(value).strip()


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value.strip()
    return value


def _switch(value: Any) -> Any:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true")


@dataclass(frozen=True, slots=True)
class _Setting:
    """One setting by meaning: its name, how a value is normalised, the engine's default."""

    name: str
    convert: Callable[[Any], Any] | None  # None: a switch, no value
    default: Any = None


def _table(rows: Mapping[tuple[str, ...], _Setting]) -> dict[str, _Setting]:
    return {spelling: setting for spellings, setting in rows.items() for spelling in spellings}


_COMPILATION = _Setting("compilation_config", _json, {})
_VLLM = _table(
    {
        ("--tensor-parallel-size", "-tp"): _Setting("tensor_parallel", _integer, 1),
        ("--pipeline-parallel-size", "-pp"): _Setting("pipeline_parallel", _integer, 1),
        ("--data-parallel-size", "-dp"): _Setting("data_parallel", _integer, 1),
        ("--enable-expert-parallel", "-ep"): _Setting("enable_expert_parallel", None, False),
        ("--compilation-config", "-cc", "-O"): _COMPILATION,
        ("--optimization-level",): _Setting("optimization_level", _integer),
        ("--runner",): _Setting("runner", _lower, "auto"),
        ("--convert",): _Setting("convert", _lower, "auto"),
        ("--task",): _Setting("task", _lower, "auto"),
        ("--dtype",): _Setting("dtype", _dtype, "auto"),
        ("--quantization", "-q"): _Setting("quantization", _lower),
        ("--kv-cache-dtype",): _Setting("kv_cache_dtype", _dtype, "auto"),
        ("--max-model-len",): _Setting("max_model_len", _human_integer),
        ("--max-num-batched-tokens",): _Setting("max_num_batched_tokens", _human_integer),
        ("--max-num-seqs",): _Setting("max_num_seqs", _integer),
        ("--cuda-graph-sizes",): _Setting("cuda_graph_sizes", _text),
        ("--max-loras",): _Setting("max_loras", _integer),
        ("--max-lora-rank",): _Setting("max_lora_rank", _integer),
        ("--speculative-config",): _Setting("speculative_config", _json),
        ("--revision",): _Setting("revision", _text),
        ("--hf-overrides",): _Setting("hf_overrides", _json),
        ("--override-generation-config",): _Setting("override_generation_config", _json),
        ("--enable-chunked-prefill",): _Setting("enable_chunked_prefill", None),
        ("--enforce-eager",): _Setting("enforce_eager", None, False),
        ("--enable-lora",): _Setting("enable_lora", None, False),
        ("--enable-prefix-caching",): _Setting("enable_prefix_caching", None),
    }
)
_SGLANG = _table(
    {
        ("--tensor-parallel-size", "--tp-size", "--tp"): _Setting("tensor_parallel", _integer, 1),
        ("--pipeline-parallel-size", "--pp-size"): _Setting("pipeline_parallel", _integer, 1),
        ("--data-parallel-size", "--dp-size", "--dp"): _Setting("data_parallel", _integer, 1),
        ("--expert-parallel-size", "--ep-size", "--ep"): _Setting("expert_parallel", _integer, 1),
        ("--dtype",): _Setting("dtype", _dtype, "auto"),
        ("--quantization",): _Setting("quantization", _lower),
        ("--kv-cache-dtype",): _Setting("kv_cache_dtype", _dtype, "auto"),
        ("--context-length",): _Setting("max_model_len", _integer),
        ("--max-running-requests",): _Setting("max_running_requests", _integer),
        ("--chunked-prefill-size",): _Setting("chunked_prefill_size", _integer),
        ("--max-prefill-tokens",): _Setting("max_prefill_tokens", _integer),
        ("--torch-compile-max-bs",): _Setting("torch_compile_max_bs", _integer),
        ("--cuda-graph-max-bs",): _Setting("cuda_graph_max_bs", _integer),
        ("--cuda-graph-bs",): _Setting("cuda_graph_bs", _text),
        ("--attention-backend",): _Setting("attention_backend", _lower),
        ("--speculative-algorithm",): _Setting("speculative_algorithm", _text),
        ("--revision",): _Setting("revision", _text),
        ("--enable-torch-compile",): _Setting("enable_torch_compile", None, False),
        ("--disable-cuda-graph",): _Setting("disable_cuda_graph", None, False),
        ("--enable-dp-attention",): _Setting("enable_dp_attention", None, False),
        ("--enable-mixed-chunk",): _Setting("enable_mixed_chunk", None, False),
    }
)
_ENGINES: Mapping[str, Mapping[str, _Setting]] = {"vllm": _VLLM, "sglang": _SGLANG}
_PARALLEL_PARTS = ("tensor_parallel", "pipeline_parallel", "data_parallel")


def detect_engine(command: Sequence[str]) -> str | None:
    """``vllm`` or ``sglang`` when ``command`` starts one of them; None otherwise."""
    if not command:
        return None
    if Path(command[0]).name in _ENGINES:
        return Path(command[0]).name
    for index, part in enumerate(command[:-1]):
        if part == "-m":
            engine = command[index + 1].partition(".")[0]
            return engine if engine in _ENGINES else None
    return None


def _dashes(option: str) -> str:
    """vLLM's spelling rule: in ``--name.rest``, underscores of ``name`` become dashes."""
    if not option.startswith("--"):
        return option
    name, dot, rest = option[2:].partition(".")
    return "--" + name.replace("_", "-") + dot + rest


def _vllm_spelling(command: Sequence[str]) -> list[str]:
    """``command`` as vLLM's parser rewrites it before argparse sees it."""
    rewritten: list[str] = []
    for index, part in enumerate(command):
        option, equals, value = part.partition("=")
        if part.startswith("--"):
            rewritten.append(_dashes(option) + equals + value)
        elif part.startswith("-O") and part != "-O" and part[2] != ".":
            rewritten += ["--optimization-level", part[3:] if part[2] == "=" else part[2:]]
        elif part == "-O" and command[index + 1 : index + 2] in (["0"], ["1"], ["2"], ["3"]):
            rewritten.append("--optimization-level")
        else:
            rewritten.append(part)
    return rewritten


def _nested(keys: Sequence[str], value: Any) -> Any:
    for key in reversed(keys):
        value = {key: value}
    return value


def _merge(into: dict[str, Any], update: Mapping[str, Any]) -> None:
    """vLLM's merge of dotted and JSON pieces: dicts recursively, lists appended, else replaced."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] = [*into[key], *value]
        else:
            into[key] = value


def _options(command: Sequence[str], table: Mapping[str, _Setting]) -> Iterator[tuple[str, Any]]:
    """Every ``(spelling, value)`` of ``command``; dotted options as a dict; switches as True."""
    index = 0
    while index < len(command):
        part, index = command[index], index + 1
        if not part.startswith("-") or part == "-":
            continue
        option, equals, value = part.partition("=")
        head, dot, path = option.partition(".")
        if dot and head in table:
            if not equals and index < len(command):
                value, index = command[index], index + 1
            keys = path.removesuffix("+").split(".")
            # ``.x+ 1,2`` appends each item, as its own JSON value (pydantic reads "1" as 1).
            loaded = [_json(item) for item in value.split(",")] if path.endswith("+") else None
            yield head, _nested(keys, _json(value) if loaded is None else loaded)
        elif equals:
            yield option, value
        elif option.startswith("--no-") and "--" + option[5:] in table:
            yield "--" + option[5:], False
        elif option in table and table[option].convert is None:
            yield option, True
        elif index < len(command) and not command[index].startswith("-"):
            yield option, command[index]
            index += 1
        else:
            yield option, True


def _compilation(value: Any) -> Any:
    """A compilation config by meaning: ``level`` is ``mode``; modes by number."""
    if not isinstance(value, dict):
        return value
    config = dict(value)
    if "level" in config and "mode" not in config:
        config["mode"] = config.pop("level")
    mode = config.get("mode")
    if isinstance(mode, str):
        name = mode.strip().lower().removeprefix("compilationmode.")
        config["mode"] = _COMPILATION_MODES.get(name, _integer(name))
    return config


def _pod_neutral(value: Any) -> Any:
    """``value`` without the fields and temporary paths that differ from pod to pod."""
    if isinstance(value, dict):
        return {
            key: _pod_neutral(item)
            for key, item in value.items()
            if str(key).lower() not in POD_LOCAL_JSON_FIELDS
        }
    if isinstance(value, list):
        return [_pod_neutral(item) for item in value]
    if isinstance(value, str) and value.startswith(_TEMP_PREFIXES):
        return POD_LOCAL_PATH
    return value


def _ignored(name: str, ignore: Collection[str]) -> bool:
    return name in ignore or FLAG_EXTRA + name in ignore


def _drop_ignored(value: Any, prefix: str, ignore: Collection[str]) -> Any:
    """``value`` without the dotted fields ``ignore`` names (``compilation_config.x.y``)."""
    if not isinstance(value, dict):
        return value
    return {
        key: _drop_ignored(item, f"{prefix}.{key}", ignore)
        for key, item in value.items()
        if not _ignored(f"{prefix}.{key}", ignore)
    }


def engine_settings(
    engine: str, command: Sequence[str], ignore: Collection[str] = ()
) -> dict[str, Any]:
    """The compile-relevant settings of ``engine``'s ``command``, by meaning, defaults left out.

    ``ignore`` names settings (``max_num_seqs``, ``flag.max_num_seqs``, an
    option's spelling) or dotted fields of JSON settings
    (``compilation_config.pass_config.x``) to leave out as well.
    """
    table = _ENGINES.get(engine)
    if table is None:
        return {}
    spelled = _vllm_spelling(command) if engine == "vllm" else [_dashes(p) for p in command]
    names = {_option_name(name) for name in ignore}
    settings: dict[str, Any] = {}
    for option, raw in _options(spelled, table):
        setting = table.get(option)
        if setting is None or _ignored(setting.name, names):
            continue
        value = raw if setting.convert is None else setting.convert(raw)
        value = _switch(value) if setting.convert is None else value
        if isinstance(value, dict) and isinstance(settings.get(setting.name), dict):
            _merge(settings[setting.name], value)
        else:
            settings[setting.name] = value
    return _normalised(settings, table, names)


def _option_name(text: str) -> str:
    """``--max-num-seqs`` and ``max-num-seqs`` name the setting ``max_num_seqs``."""
    return text.strip().lstrip("-").replace("-", "_")


def _normalised(
    settings: dict[str, Any], table: Mapping[str, _Setting], ignore: Collection[str]
) -> dict[str, Any]:
    defaults = {setting.name: setting.default for setting in table.values()}
    result: dict[str, Any] = {}
    for name, value in settings.items():
        final = _pod_neutral(_compilation(value) if name == _COMPILATION.name else value)
        final = _drop_ignored(final, name, ignore)
        if final != defaults.get(name) and final is not None:
            result[name] = final
    return result


def _extra_value(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    if len(text) > _MAX_VALUE:
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]
    return text.strip('"') if isinstance(value, str) else text


def engine_key_fields(
    engine: str, command: Sequence[str], ignore: Collection[str] = ()
) -> dict[str, str]:
    """Key fields (as ``--compile-key`` gives them) that ``engine``'s ``command`` implies.

    Parallel sizes as ``tensor_parallel``/``pipeline_parallel``/``data_parallel``;
    every other setting as the extra ``flag.<setting>`` (its normalised JSON,
    or its sha256 when long). Empty for an engine this does not know.
    """
    fields: dict[str, str] = {}
    for name, value in sorted(engine_settings(engine, command, ignore).items()):
        if name in _PARALLEL_PARTS:
            fields[name] = str(value)
        else:
            fields[f"extras.{FLAG_EXTRA}{name}"] = _extra_value(value)
    return fields


def merged_key_fields(given: Mapping[str, str], derived: Mapping[str, str]) -> dict[str, str]:
    """``given`` (``--compile-key``) over ``derived`` (the command's flags, the engine's world)."""
    return {**derived, **given}
