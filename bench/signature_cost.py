"""What verifying a model signature adds to a cold pull: ``python -m bench.signature_cost``.

Generates a safetensors model (2 GiB by default) in /dev/shm, signs it with an EC key
through model-signing as a publisher would, then times, side by side in one run: the
verification the agent runs before publishing (``SignatureRule.verify``), and prewarm's own
content hash of the same files (xxh3 in chunks, what every pull already computes). Prints
one line per measurement and the best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from agent.check.hashes import hash_file
from agent.check.signatures import SignatureRule
from agent.testing import make_publisher_keys, make_safetensors_model, sign_model

GiB = 1024**3
CHUNK = 64 * 1024**2


def _best(label: str, repeats: int, run: object) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
        print(f"{label}: {times[-1]:.2f} s", flush=True)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.signature_cost")
    parser.add_argument("--size", type=float, default=2.0, help="model size in GiB")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prewarm-sigcost-", dir="/dev/shm"))
    try:
        model = work / "model"
        make_safetensors_model(model, total_bytes=int(args.size * GiB), shards=args.shards)
        key, pub = make_publisher_keys(work)
        sign_model(model, key)
        rule = SignatureRule(("s3://any/",), "key", pub, (), "model.sig")
        files = [p for p in model.iterdir() if p.name != "model.sig"]
        size = sum(p.stat().st_size for p in files)
        verify = _best("verify signature", args.repeats, lambda: rule.verify(model))
        xxh3 = _best(
            "xxh3 content hash", args.repeats, lambda: [hash_file(p, CHUNK) for p in files]
        )
        gib = size / GiB
        print(
            f"{gib:.2f} GiB in {len(files)} files: signature verification {verify:.2f} s "
            f"({gib / verify:.2f} GiB/s), prewarm's own xxh3 pass {xxh3:.2f} s "
            f"({gib / xxh3:.2f} GiB/s)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
