"""Synthetic safetensors models, generated on disk and uploaded to the bench server."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.testing import make_safetensors_model
from agent.testing._process import purge_tree

__all__ = ["BenchModel", "publish_model"]

MiB = 1024**2


@dataclass(frozen=True)
class BenchModel:
    """A model in the bench bucket: its URI and its objects (key, size)."""

    name: str
    bucket: str
    prefix: str  # ends with "/"
    objects: tuple[tuple[str, int], ...]

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.objects)

    @property
    def file_count(self) -> int:
        return len(self.objects)

    @property
    def shard_keys(self) -> list[str]:
        return [key for key, _ in self.objects if key.endswith(".safetensors")]


def publish_model(
    client: Any, bucket: str, name: str, *, total_bytes: int, shards: int, work: Path
) -> BenchModel:
    """Generate a ``shards``-shard model of about ``total_bytes`` and upload it.

    Each file goes up in one PUT: s3rver writes a single PUT straight to its
    store, while a multipart upload is written twice (parts, then the whole).
    The local copy is removed once uploaded.
    """
    from boto3.s3.transfer import TransferConfig

    directory = work / name
    make_safetensors_model(directory, total_bytes=total_bytes, shards=shards)
    gc.collect()  # the generator returned every tensor; give that memory back now
    config = TransferConfig(multipart_threshold=64 * 1024**3, max_concurrency=4)
    prefix = f"models/{name}/"
    objects: list[tuple[str, int]] = []
    try:
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            key = prefix + path.relative_to(directory).as_posix()
            client.upload_file(str(path), bucket, key, Config=config)
            objects.append((key, path.stat().st_size))
    finally:
        purge_tree(directory)
    return BenchModel(name=name, bucket=bucket, prefix=prefix, objects=tuple(objects))
