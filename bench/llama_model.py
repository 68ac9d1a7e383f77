"""A random-weight Llama model of a chosen size, for launching a real engine on it.

    .venv/bin/python -m bench.llama_model OUT_DIR --size-gib 1.9

writes what ``vllm serve OUT_DIR`` (``LlamaForCausalLM``) and ``transformers``
load: ``config.json`` and ``generation_config.json``, the weights in bf16 in
``--shards`` safetensors shards (``model-00001-of-00004.safetensors``...) with
``model.safetensors.index.json``, and a word-level tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``)
whose vocabulary is ``<unk>``, ``<s>``, ``</s>`` and ``w3`` ... ``w<vocab-1>``,
one token per whitespace-separated word. Nothing comes from the network.

The shape is TinyLlama's (hidden 2048, MLP 5632, 32 query and 4 key/value heads,
vocabulary 32000, untied embeddings); the number of layers is what brings the
weights nearest ``--size-gib``. The output is the same, byte for byte, for the
same options: every tensor is drawn from numpy's PCG64 seeded with ``--seed``
and the tensor's name (normal, standard deviation 0.02; norms are ones), and
rounded to bf16. The weights are noise, so the text is noise too, but it is the
same noise for every launch of the same engine: a launch that loads or runs the
model wrongly gives other tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GiB = 1024**3
HIDDEN = 2048
INTERMEDIATE = 5632
HEADS = 32
KV_HEADS = 4
VOCAB = 32000
MAX_POSITIONS = 2048
STD = 0.02
SPECIAL = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: unknown, begin, end
_CHUNK = 1 << 24  # elements drawn at a time: 64 MiB of float32


@dataclass(frozen=True)
class Tensor:
    """One weight: its name in the checkpoint (what vLLM's Llama loader maps) and shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return 2 * self.elements  # bf16


def layer_count(size_gib: float) -> int:
    """The number of decoder layers that brings the bf16 weights nearest ``size_gib``."""
    fixed = sum(t.nbytes for t in _tensors(0))
    per_layer = sum(t.nbytes for t in _layer(0))
    return max(1, round((size_gib * GiB - fixed) / per_layer))


def _layer(index: int) -> list[Tensor]:
    """One decoder layer's weights, named as Hugging Face's Llama checkpoints name them."""
    head_dim = HIDDEN // HEADS
    p = f"model.layers.{index}."
    return [
        Tensor(p + "input_layernorm.weight", (HIDDEN,)),
        Tensor(p + "self_attn.q_proj.weight", (HEADS * head_dim, HIDDEN)),
        Tensor(p + "self_attn.k_proj.weight", (KV_HEADS * head_dim, HIDDEN)),
        Tensor(p + "self_attn.v_proj.weight", (KV_HEADS * head_dim, HIDDEN)),
        Tensor(p + "self_attn.o_proj.weight", (HIDDEN, HEADS * head_dim)),
        Tensor(p + "post_attention_layernorm.weight", (HIDDEN,)),
        Tensor(p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
        Tensor(p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
        Tensor(p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
    ]


def _tensors(layers: int) -> list[Tensor]:
    """Every weight of a ``layers``-layer model, in checkpoint order."""
    tensors = [Tensor("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for index in range(layers):
        tensors += _layer(index)
    tensors += [Tensor("model.norm.weight", (HIDDEN,)), Tensor("lm_head.weight", (VOCAB, HIDDEN))]
    return tensors


def _shards(tensors: list[Tensor], count: int) -> list[list[Tensor]]:
    """``tensors`` in order, cut into ``count`` runs of about equal bytes (none empty)."""
    count = max(1, min(count, len(tensors)))
    total = sum(t.nbytes for t in tensors)
    shards: list[list[Tensor]] = [[] for _ in range(count)]
    done = 0
    for position, tensor in enumerate(tensors):
        # The shard this tensor's first byte falls in, leaving one tensor for each later shard.
        index = min(done * count // total, count - 1)
        index = max(index, count - (len(tensors) - position))
        shards[index].append(tensor)
        done += tensor.nbytes
    return [shard for shard in shards if shard]


def _bf16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (ties to even), as uint16 bit patterns."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype("<u2")


def _values(tensor: Tensor, seed: int) -> Iterator[bytes]:
    """The tensor's bf16 bytes, little-endian, in pieces of at most ``_CHUNK`` elements."""
    if tensor.name.endswith("norm.weight"):
        yield _bf16(np.ones(tensor.elements, dtype=np.float32)).tobytes()
        return
    rng = np.random.default_rng([seed, zlib.crc32(tensor.name.encode())])
    left = tensor.elements
    while left:
        n = min(left, _CHUNK)
        yield _bf16(rng.standard_normal(n, dtype=np.float32) * np.float32(STD)).tobytes()
        left -= n


def _write_shard(path: Path, tensors: list[Tensor], seed: int) -> int:
    """One safetensors file: an 8-byte header length, the JSON header, then the data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        end = offset + tensor.nbytes
        header[tensor.name] = {
            "dtype": "BF16",
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for tensor in tensors:
            for piece in _values(tensor, seed):
                out.write(piece)
    return offset


def _config(layers: int) -> dict[str, object]:
    """``config.json`` for transformers' and vLLM's ``LlamaForCausalLM``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": STD,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": VOCAB,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _tokenizer() -> dict[str, object]:
    """A ``tokenizers`` word-level tokenizer: one token per whitespace-separated word."""
    vocab = {token: index for index, token in enumerate(SPECIAL)}
    vocab |= {f"w{index}": index for index in range(len(SPECIAL), VOCAB)}
    added = [
        {
            "id": index,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for index, token in enumerate(SPECIAL)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        # Decoded words are joined with a space (WordPiece's decoder without '##' pieces).
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def _tokenizer_config() -> dict[str, object]:
    """``tokenizer_config.json``: transformers' fast tokenizer over ``tokenizer.json``."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        # The messages' contents one after another: vLLM's server renders a chat
        # template at start and logs an error without one.
        "chat_template": "{% for message in messages %}{{ message['content'] }} {% endfor %}",
    }


@dataclass(frozen=True)
class Written:
    """What ``write_model`` wrote: decoder layers, safetensors files, weight bytes."""

    layers: int
    shards: int
    weight_bytes: int


def write_model(out: Path, *, size_gib: float, shards: int = 4, seed: int = 0) -> Written:
    """Write the model into ``out`` (created; files of the same names replaced)."""
    out.mkdir(parents=True, exist_ok=True)
    layers = layer_count(size_gib)
    tensors = _tensors(layers)
    groups = _shards(tensors, shards)
    weight_map: dict[str, str] = {}
    total = 0
    for number, group in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        total += _write_shard(out / name, group, seed)
        weight_map |= {tensor.name: name for tensor in group}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    files: dict[str, object] = {
        "model.safetensors.index.json": index,
        "config.json": _config(layers),
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False},
        "tokenizer.json": _tokenizer(),
        "tokenizer_config.json": _tokenizer_config(),
        "special_tokens_map.json": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    }
    for name, document in files.items():
        (out / name).write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    return Written(layers=layers, shards=len(groups), weight_bytes=total)


def main(argv: Sequence[str] | None = None) -> int:
    """Write the model and say what was written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--size-gib", type=float, default=1.9, help="weights in GiB (bf16)")
    parser.add_argument("--shards", type=int, default=4, help="safetensors files")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    args = parser.parse_args(argv)
    if args.size_gib <= 0 or args.shards < 1:
        parser.error("--size-gib must be positive and --shards at least 1")
    started = time.monotonic()
    written = write_model(args.out, size_gib=args.size_gib, shards=args.shards, seed=args.seed)
    print(
        f"wrote {args.out}: LlamaForCausalLM, {written.layers} layers, "
        f"{written.weight_bytes / GiB:.3f} GiB of bf16 weights "
        f"({written.weight_bytes // 2:,} parameters) in {written.shards} shards, "
        f"seed {args.seed}, in {time.monotonic() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
