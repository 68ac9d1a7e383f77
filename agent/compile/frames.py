"""One zstd frame read for tarfile, refusing input that ends early or goes on after the end."""

from __future__ import annotations

from pathlib import Path
from typing import IO

import zstandard

from agent._exceptions import IntegrityError

__all__ = ["FrameReader"]

# Compressed bytes fed to the decompressor at a time.
_INPUT_BLOCK = 1024


class FrameReader:
    """Decompresses one zstd frame for tarfile, refusing input that ends before the frame.

    zstandard's stream reader returns a short read, not an error, when the
    input stops mid-frame; this reader says so. Input goes in small blocks,
    so even a pathological archive expands by a bounded amount per step.
    """

    def __init__(self, raw: IO[bytes], archive: Path) -> None:
        self._raw = raw
        self._archive = archive
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._buffer = bytearray()
        self._ended = False

    def read(self, amount: int = -1) -> bytes:
        """Up to ``amount`` decompressed bytes (all that are left when negative)."""
        while not self._ended and (amount < 0 or len(self._buffer) < amount):
            block = self._raw.read(_INPUT_BLOCK)
            if not block:
                if not self._frame.eof:
                    raise IntegrityError(
                        f"Compile-cache archive {self._archive.name} ends mid-stream: it is "
                        "truncated.",
                        path=self._archive.name,
                        check="archive",
                    )
                self._ended = True
                break
            self._buffer += self._frame.decompress(block)
            if self._frame.eof:
                if self._frame.unused_data or self._raw.read(1):
                    raise IntegrityError(
                        f"Compile-cache archive {self._archive.name} has data after its end.",
                        path=self._archive.name,
                        check="archive",
                    )
                self._ended = True
        if amount < 0:
            amount = len(self._buffer)
        data = bytes(self._buffer[:amount])
        del self._buffer[:amount]
        return data
