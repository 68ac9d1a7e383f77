"""agent.client stays importable in a pod that has only grpc and protobuf."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ["pydantic", "aiobotocore", "botocore", "typer", "rich", "torch", "safetensors", "numpy"]


def test_importing_the_client_loads_no_heavy_dependency() -> None:
    """Importing agent.client's main names loads none of the daemon's or torch's dependencies."""
    code = (
        "import json, sys\n"
        "import agent.client\n"
        "from agent.client import Client, AsyncClient, ensure, aensure, load_safetensors\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(heavy))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == []
