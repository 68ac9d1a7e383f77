"""Regenerate the checked-in protobuf/gRPC code from proto/.

Usage: python scripts/gen_proto.py [OUT_DIR]

OUT_DIR defaults to agent/_proto. tests/edge/test_generated_code.py runs this into a
temporary directory and fails if the result differs from what is checked in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PROTO_FILES = ["prewarm/v1/prewarm.proto", "csi/v1/csi.proto"]
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out_dir: Path) -> None:
    """Write the generated modules for PROTO_FILES under out_dir."""
    with tempfile.TemporaryDirectory() as raw:
        raw_dir = Path(raw)
        env = dict(os.environ)
        # protoc finds the mypy plugins on PATH; they live next to this interpreter.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"--python_out={raw_dir}",
                f"--grpc_python_out={raw_dir}",
                f"--mypy_out={raw_dir}",
                f"--mypy_grpc_out={raw_dir}",
                *PROTO_FILES,
            ],
            check=True,
            cwd=REPO,
            env=env,
        )
        for proto in PROTO_FILES:
            package_dir = Path(proto).parent
            target = out_dir / package_dir
            target.mkdir(parents=True, exist_ok=True)
            for parent in [out_dir, *(out_dir / p for p in _parents(package_dir))]:
                (parent / "__init__.py").touch()
            for produced in sorted((raw_dir / package_dir).iterdir()):
                if not produced.name.endswith(GENERATED_SUFFIXES):
                    continue
                text = produced.read_text()
                # protoc writes absolute imports ("from prewarm.v1 import x"); the
                # code lives inside the agent package, so make them relative.
                absolute = f"from {'.'.join(package_dir.parts)} import "
                text = text.replace(absolute, "from . import ")
                (target / produced.name).write_text(text)


def _parents(package_dir: Path) -> list[Path]:
    parts = package_dir.parts
    return [Path(*parts[: i + 1]) for i in range(len(parts))]


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "agent" / "_proto"
    if out_dir.exists() and out_dir == REPO / "agent" / "_proto":
        shutil.rmtree(out_dir)
    generate(out_dir)


if __name__ == "__main__":
    main()
