"""``load_safetensors``: a snapshot's weights as torch tensors, mapped, not copied.

The safetensors format is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, data_offsets relative to the data section), then the
data section. ``agent.check.safetensors`` validates the header (the same check the
agent runs before publishing) before anything is mapped. Each tensor here is a
view of a private copy-on-write mapping of its file: reading costs page faults
against the page cache (or /dev/shm), and writing to a tensor copies only the
touched page, never the file.

torch is imported only when this function runs, so pods that never call it do
not pay for it.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.check.safetensors import SafetensorsHeader, read_header

from ._exceptions import IntegrityError, NotFound, SafetensorsError
from ._models import ModelHandle

if TYPE_CHECKING:
    import torch

__all__ = ["load_safetensors"]

# safetensors dtype -> torch attribute; a torch without the attribute cannot load it.
# The header parser knows more dtypes (C64, and F4/F6, which pack several elements
# per byte and have no one-to-one torch dtype); this loader refuses those by name.
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
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}


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
    files raises ``SafetensorsError``. Without torch installed (the pods' base install is
    grpcio and protobuf only), ``ModuleNotFoundError`` names the extra that brings it.
    """
    try:
        import torch
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "load_safetensors needs torch, which this install lacks: pip install "
            "'prewarm-agent[torch]' (or install torch yourself; the client uses the one "
            "it finds)",
            name=exc.name,
        ) from exc

    root = handle_or_dir.path if isinstance(handle_or_dir, ModelHandle) else Path(handle_or_dir)
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in _safetensors_files(root):
        for name, tensor in _map_file(path, torch).items():
            if name in origin:
                raise SafetensorsError(
                    f"Tensor {name!r} is in both {origin[name]} and {path}; "
                    "load the files one at a time to choose.",
                    path=str(path),
                    check="duplicate-tensor",
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
        raise SafetensorsError(
            f"There is no *.safetensors file under {root}.", path=str(root), check="no-safetensors"
        )
    return files


def _map_file(path: Path, torch: Any) -> dict[str, torch.Tensor]:
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        try:
            # Validated before mapping: every tensor below lies inside the file
            # and no two share bytes, so frombuffer cannot read past the end.
            header = read_header(file.fileno(), size=size, path=str(path))
        except IntegrityError as exc:
            raise SafetensorsError(str(exc), path=exc.path, check=exc.check) from exc
        dtypes = _torch_dtypes(path, header, torch)
        # ACCESS_COPY: a private mapping, so torch gets a writable buffer (no
        # warning) and a write to a tensor never reaches the file. The mapping
        # holds its own reference to the file; closing ours is fine.
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in header.tensors.items():
        count = math.prod(spec.shape)
        if count == 0:
            # torch.frombuffer refuses count=0; an empty tensor shares nothing anyway.
            tensors[name] = torch.empty(spec.shape, dtype=dtypes[name])
        else:
            # The tensor's storage keeps a reference to `mapped`, which unmaps
            # only when the last tensor of this file is gone. Never close it
            # here: mmap.close() would succeed and leave the tensors dangling.
            tensors[name] = torch.frombuffer(
                mapped, dtype=dtypes[name], count=count, offset=header.data_start + spec.begin
            ).reshape(spec.shape)
    return tensors


def _torch_dtypes(path: Path, header: SafetensorsHeader, torch: Any) -> dict[str, torch.dtype]:
    dtypes: dict[str, torch.dtype] = {}
    for name, spec in header.tensors.items():
        where = f"{path}: tensor {name!r}"
        if spec.dtype not in _DTYPES:
            raise SafetensorsError(
                f"{where} has dtype {spec.dtype!r}, which load_safetensors cannot map to a "
                f"torch dtype (it maps: {', '.join(_DTYPES)}).",
                path=str(path),
                check="dtype",
            )
        dtype = getattr(torch, _DTYPES[spec.dtype], None)
        if dtype is None:
            raise SafetensorsError(
                f"{where} has dtype {spec.dtype}, which torch {torch.__version__} does not have.",
                path=str(path),
                check="dtype",
            )
        dtypes[name] = dtype
    return dtypes
