"""The command ``prewarm exec`` runs in tests: a small PyTorch program on the cached model.

argv: MODEL_DIR ORIGINALS_DIR. Loads every tensor from MODEL_DIR with
``agent.client.load_safetensors`` and compares it with the originals (read with
the safetensors library from the directory the model was uploaded from). Prints
``tensors match`` or ``tensors differ``, then reads one line from stdin: the exit
status to end with (1 whatever the line if the tensors differ).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from agent.client import load_safetensors


def main() -> int:
    model_dir, originals_dir = Path(sys.argv[1]), Path(sys.argv[2])
    loaded = load_safetensors(model_dir)
    originals: dict[str, np.ndarray] = {}
    for path in sorted(originals_dir.glob("*.safetensors")):
        originals.update(load_file(path))
    match = loaded.keys() == originals.keys() and all(
        np.array_equal(loaded[name].numpy(), array) for name, array in originals.items()
    )
    print("tensors match" if match else "tensors differ", flush=True)
    requested = int(sys.stdin.readline() or 0)
    return requested if match else 1


if __name__ == "__main__":
    sys.exit(main())
