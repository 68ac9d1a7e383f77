"""``load_safetensors``: a snapshot's weights as torch tensors, mapped, not copied.

The safetensors format is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, data_offsets relative to the data section), then the
data section. Each tensor here is a view of a private copy-on-write mapping of
its file: reading costs page faults against the page cache (or /dev/shm), and
writing to a tensor copies only the touched page, never the file.

torch is imported only when this function runs, so pods that never call it do
not pay for it.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent._exceptions import NotFound, PrewarmError

from ._types import ModelHandle

if TYPE_CHECKING:
    import torch

__all__ = ["SafetensorsError", "load_safetensors"]

# safetensors dtype -> torch attribute; a torch without the attribute cannot load it.
_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
# The safetensors library refuses larger headers too; a bigger length field is
# a corrupt or foreign file, not a model with that many tensors.
_MAX_HEADER_BYTES = 100_000_000


class SafetensorsError(PrewarmError):
    """A file is not valid safetensors, or the files of one model clash."""


def load_safetensors(
    handle_or_dir: ModelHandle | str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Map every ``*.safetensors`` file of a model into tensors, by tensor name.

    ``handle_or_dir`` is a ``ModelHandle`` from ``ensure``, a model directory
    (searched recursively, files in sorted order), or one ``.safetensors`` file.
    On the CPU no byte is copied: each tensor's storage is the file's mapping,
    which lives as long as any tensor of that file does. For another device the
    tensors are copied there with ``.to(device)``. The same tensor name in two
    files raises ``SafetensorsError``.
    """
    import torch

    root = handle_or_dir.path if isinstance(handle_or_dir, ModelHandle) else Path(handle_or_dir)
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in _safetensors_files(root):
        for name, tensor in _map_file(path, torch).items():
            if name in origin:
                raise SafetensorsError(
                    f"Tensor {name!r} is in both {origin[name]} and {path}; "
                    "load the files one at a time to choose."
                )
            origin[name] = path
            tensors[name] = tensor
    if torch.device(device).type != "cpu":
        return {name: tensor.to(device) for name, tensor in tensors.items()}
    return tensors


def _safetensors_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise NotFound(f"{root} does not exist; pass a model directory or a .safetensors file.")
    files = sorted(p for p in root.rglob("*.safetensors") if p.is_file())
    if not files:
        raise SafetensorsError(f"There is no *.safetensors file under {root}.")
    return files


def _map_file(path: Path, torch: Any) -> dict[str, torch.Tensor]:
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size < 8:
            raise SafetensorsError(
                f"{path} is {size} bytes long, too short for a safetensors file "
                "(it is truncated or not safetensors)."
            )
        # ACCESS_COPY: a private mapping, so torch gets a writable buffer (no
        # warning) and a write to a tensor never reaches the file. The mapping
        # holds its own reference to the file; closing ours is fine.
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    header_len = int.from_bytes(mapped[:8], "little")
    if header_len > size - 8 or header_len > _MAX_HEADER_BYTES:
        raise SafetensorsError(
            f"{path}: the header length field says {header_len} bytes but the file holds "
            f"{size - 8} after it (the file is truncated or not safetensors)."
        )
    try:
        header = json.loads(mapped[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{path}: the header is not valid JSON ({exc}).") from exc
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is not a JSON object.")

    data_start = 8 + header_len
    data_size = size - data_start
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _check_entry(path, name, entry, data_size, torch)
        count = math.prod(shape)
        if end - begin != count * dtype.itemsize:
            raise SafetensorsError(
                f"{path}: tensor {name!r} has {end - begin} bytes of data but its shape "
                f"{shape} and dtype {entry['dtype']} need {count * dtype.itemsize}."
            )
        if count == 0:
            # torch.frombuffer refuses count=0; an empty tensor shares nothing anyway.
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            # The tensor's storage keeps a reference to `mapped`, which unmaps
            # only when the last tensor of this file is gone. Never close it
            # here: mmap.close() would succeed and leave the tensors dangling.
            tensors[name] = torch.frombuffer(
                mapped, dtype=dtype, count=count, offset=data_start + begin
            ).reshape(shape)
    return tensors


def _check_entry(
    path: Path, name: str, entry: object, data_size: int, torch: Any
) -> tuple[torch.dtype, list[int], int, int]:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise SafetensorsError(f"{where} is described by {entry!r}, not a JSON object.")
    dtype_name = entry.get("dtype")
    if dtype_name not in _DTYPES:
        raise SafetensorsError(
            f"{where} has dtype {dtype_name!r}, which this loader does not know "
            f"(known: {', '.join(_DTYPES)})."
        )
    dtype = getattr(torch, _DTYPES[dtype_name], None)
    if dtype is None:
        raise SafetensorsError(
            f"{where} has dtype {dtype_name}, which torch {torch.__version__} does not have."
        )
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise SafetensorsError(f"{where} has shape {shape!r}, not a list of sizes >= 0.")
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or not offsets[0] <= offsets[1] <= data_size
    ):
        raise SafetensorsError(
            f"{where} has data_offsets {offsets!r}, outside the {data_size}-byte data "
            "section (the file is truncated or corrupt)."
        )
    return dtype, shape, offsets[0], offsets[1]


def _is_count(value: object) -> bool:
    # bool is an int subclass; `true` is not a size.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
