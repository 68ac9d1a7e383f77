"""Sample models in the Hugging Face layout, and uploading them to S3.

``make_safetensors_model`` writes real safetensors shards (through the
``safetensors`` library, not a hand-rolled header) with Llama-style tensor
names, a ``config.json``, a ``tokenizer.json`` and the shard index, and returns
the tensors so a test can compare what it loads with what was written.
Generation is cheap: uniform float32 noise is about 2.5 GB/s here, so a 256 MiB
model takes a fraction of a second.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["SampleModel", "make_safetensors_model", "upload_directory", "upload_model"]

# Per layer (one layer per shard): name suffix, dtype, share of the shard's bytes.
# Attention in float16 and the MLP in float32, so both dtypes cross the wire.
_LAYER_TENSORS: tuple[tuple[str, str, float], ...] = (
    ("self_attn.q_proj.weight", "float16", 0.12),
    ("self_attn.k_proj.weight", "float16", 0.04),
    ("self_attn.v_proj.weight", "float16", 0.04),
    ("self_attn.o_proj.weight", "float16", 0.12),
    ("mlp.gate_proj.weight", "float32", 0.22),
    ("mlp.up_proj.weight", "float32", 0.22),
    ("mlp.down_proj.weight", "float32", 0.0),  # takes what is left
)
_EMBEDDING_SHARE = 0.10  # embed_tokens in the first shard, lm_head in the last


@dataclass(frozen=True)
class SampleModel:
    """A generated model uploaded to S3: where it is, and what it holds."""

    uri: str
    bucket: str
    prefix: str
    source_dir: Path
    keys: list[str]
    tensors: Mapping[str, NDArray[Any]] = field(repr=False)

    @property
    def total_bytes(self) -> int:
        """Bytes of every file uploaded (shards, index, config, tokenizer)."""
        return sum((self.source_dir / key[len(self.prefix) :]).stat().st_size for key in self.keys)


def make_safetensors_model(
    directory: Path, *, total_bytes: int, shards: int, seed: int = 0
) -> dict[str, NDArray[Any]]:
    """Write a sharded safetensors model of about ``total_bytes`` into ``directory``.

    Files: ``model-0000i-of-0000N.safetensors`` (one decoder layer each, plus the
    embeddings in the first and the head in the last), ``model.safetensors.index.json``,
    ``config.json`` and ``tokenizer.json``. The same seed gives the same bytes.
    Returns every tensor by name.
    """
    import numpy as np
    from safetensors.numpy import save_file

    if shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}.")
    if total_bytes < shards * 64 * 1024:
        raise ValueError(f"total_bytes must be at least 64 KiB per shard, not {total_bytes}.")
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_shard = total_bytes // shards
    # Wide enough to look like a hidden size, narrow enough for small models.
    hidden = 1024 if per_shard >= 16 * 1024**2 else 256
    everything: dict[str, NDArray[Any]] = {}
    weight_map: dict[str, str] = {}
    for index in range(shards):
        filename = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        shard = _layer_tensors(rng, index, shards=shards, budget=per_shard, hidden=hidden)
        save_file(shard, directory / filename, metadata={"format": "pt"})
        everything.update(shard)
        weight_map.update(dict.fromkeys(shard, filename))

    tensor_bytes = sum(int(t.nbytes) for t in everything.values())
    index_doc = {"metadata": {"total_size": tensor_bytes}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2))
    (directory / "config.json").write_text(json.dumps(_config(hidden, shards), indent=2))
    (directory / "tokenizer.json").write_text(json.dumps(_tokenizer(), indent=2))
    return everything


def _layer_tensors(
    rng: np.random.Generator, index: int, *, shards: int, budget: int, hidden: int
) -> dict[str, NDArray[Any]]:
    import numpy as np

    tensors: dict[str, NDArray[Any]] = {}
    remaining = budget
    norm_bytes = 2 * hidden * 4
    remaining -= norm_bytes

    def add(name: str, dtype: str, nbytes: int) -> None:
        nonlocal remaining
        row_bytes = hidden * np.dtype(dtype).itemsize
        rows = max(1, nbytes // row_bytes)
        tensors[name] = _weights(rng, (rows, hidden), dtype)
        remaining -= rows * row_bytes

    if index == 0:
        add("model.embed_tokens.weight", "float32", int(budget * _EMBEDDING_SHARE))
    if index == shards - 1:
        add("lm_head.weight", "float32", int(budget * _EMBEDDING_SHARE))
        tensors["model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    layer = f"model.layers.{index}"
    tensors[f"{layer}.input_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
    tensors[f"{layer}.post_attention_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
    for suffix, dtype, share in _LAYER_TENSORS:
        add(f"{layer}.{suffix}", dtype, int(budget * share) if share else remaining)
    return tensors


def _weights(rng: np.random.Generator, shape: tuple[int, int], dtype: str) -> NDArray[Any]:
    import numpy as np

    # Uniform noise in [-0.05, 0.05): no NaNs (so array_equal works), and ten
    # times faster to draw than normal noise.
    values = rng.random(shape, dtype=np.float32)
    values -= 0.5
    values *= 0.1
    return values if dtype == "float32" else values.astype(dtype)


def _config(hidden: int, layers: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": hidden * 4,
        "num_hidden_layers": layers,
        "num_attention_heads": max(1, hidden // 64),
        "torch_dtype": "float32",
        "vocab_size": 32000,
    }


def _tokenizer() -> dict[str, Any]:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {chr(c): c - 94 for c in range(97, 123)}
    return {
        "version": "1.0",
        "added_tokens": [
            {"id": 1, "content": "<s>", "special": True},
            {"id": 2, "content": "</s>", "special": True},
        ],
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "unk_token": "<unk>"},
    }


def upload_directory(client: Any, bucket: str, prefix: str, directory: Path) -> list[str]:
    """Upload every file under ``directory`` to ``s3://bucket/prefix/...``; returns the keys.

    Uses boto3's managed transfer, so files over its multipart threshold (8 MiB)
    get multipart ETags (``"<md5 of md5s>-N"``), as they would on real S3.
    """
    base = prefix.strip("/")
    keys: list[str] = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory).as_posix()
        key = f"{base}/{relative}" if base else relative
        client.upload_file(str(path), bucket, key)
        keys.append(key)
    return keys


def upload_model(
    client: Any,
    bucket: str,
    prefix: str,
    directory: Path,
    *,
    tensors: Mapping[str, NDArray[Any]],
) -> SampleModel:
    """Upload a model made by make_safetensors_model and describe it."""
    base = prefix.strip("/")
    keys = upload_directory(client, bucket, base, directory)
    return SampleModel(
        uri=f"s3://{bucket}/{base}/" if base else f"s3://{bucket}/",
        bucket=bucket,
        prefix=f"{base}/" if base else "",
        source_dir=directory,
        keys=keys,
        tensors=tensors,
    )
