"""The checked-in protobuf code is exactly what the proto generates."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_regenerating_the_protobuf_code_changes_nothing(tmp_path: Path) -> None:
    """The checked-in agent/_proto files are byte for byte what scripts/gen_proto.py makes now."""
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_proto.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    checked_in = REPO / "agent" / "_proto"
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    existing = sorted(
        p.relative_to(checked_in)
        for p in checked_in.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert generated == existing, "run `make proto` and commit the result"
    _, mismatch, errors = filecmp.cmpfiles(
        checked_in, tmp_path, [str(p) for p in generated], shallow=False
    )
    assert not errors
    assert not mismatch, f"stale generated files {mismatch}: run `make proto`"
