"""Why a key missed, when the nearest key was uploaded by another node and is not on this one.

Every upload lists its key under its model in S3 (agent.compile.model_index);
a miss on another node compares with those keys too. In process, two nodes'
compile caches sharing MemorySource as S3.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from dataclasses import replace
from pathlib import Path
from typing import Any

from compile_helpers import BUCKET
from compile_helpers import compile_node as node

from agent._uri import ModelUri
from agent.compile.cache import COMPILE_MISS_PARTS
from agent.compile.keys import CompileKeyParts, compile_key, parts_to_dict
from agent.compile.model_index import ENTRY_MAX_BYTES, model_id
from agent.source.interface import ListedObject
from agent.source.s3_errors import SourceUnreachable
from agent.testing import MemorySource

UPLOADED = CompileKeyParts(
    engine="vllm",
    engine_version="0.16.0",
    torch_version="2.10.0",
    model_key="minilm",
    extras={"flag.max_num_batched_tokens": "8192"},
)
# The same model and engine with one flag changed: one part differs.
WANTED = replace(UPLOADED, extras={"flag.max_num_batched_tokens": "16384"})
INDEX = f"cc/node/by-model/{model_id(UPLOADED)}/"


async def _upload(root: Path, source: MemorySource, parts: CompileKeyParts) -> str:
    """Another node compiles ``parts``' key and uploads it; its key."""
    async with node(root, source) as other:
        path = (await other.ensure(parts)).info.path
        (path / "inductor" / "kernel.so").write_bytes(b"\x7fELF kernel")
        assert (await other.push(compile_key(parts))).uploaded
    return compile_key(parts)


async def test_a_key_uploaded_by_another_node_is_named_with_the_part_that_differs(
    tmp_path: Path,
) -> None:
    """A new key on node 2 is explained by node 1's upload: its key, "s3", the changed flag,
    and the trusted key that signed its index entry."""
    source = MemorySource(objects={BUCKET: {}})
    uploaded = await _upload(tmp_path / "one", source, UPLOADED)
    assert f"{INDEX}{uploaded}.json" in source.objects[BUCKET]

    async with node(tmp_path / "two", source) as second:
        wanted = await second.ensure(WANTED)
        why = await second.explain(wanted.info.key)
    assert why.s3_note == ""
    assert why.nearest is not None
    assert (why.nearest.key, why.nearest.location) == (uploaded, "s3")
    assert [c.describe() for c in why.nearest.changes] == [
        "extras.flag.max_num_batched_tokens 8192 -> 16384"
    ]
    assert why.nearest.signed_by == "test-nodes"
    assert why.nearest.describe().startswith(
        f"nearest key in S3 {uploaded[:12]} (signed by test-nodes) differs in "
    )


async def test_an_unsigned_entry_a_domain_accepts_is_named_unsigned(tmp_path: Path) -> None:
    """During a migration (accept_unsigned, no signing key on the uploader) the nearest key
    in S3 is still named, and said to be unsigned rather than given a signer."""
    source = MemorySource(objects={BUCKET: {}})
    unsigned: dict[str, Any] = {"signing_key": None, "trusted_keys": [], "accept_unsigned": True}
    async with node(tmp_path / "one", source, **unsigned) as other:
        path = (await other.ensure(UPLOADED)).info.path
        (path / "inductor" / "kernel.so").write_bytes(b"\x7fELF kernel")
        assert (await other.push(compile_key(UPLOADED))).uploaded
    async with node(tmp_path / "two", source, **unsigned) as second:
        wanted = await second.ensure(WANTED)
        why = await second.explain(wanted.info.key)
    assert why.nearest is not None
    assert (why.nearest.key, why.nearest.signed_by) == (compile_key(UPLOADED), "")
    assert f"key in S3 {compile_key(UPLOADED)[:12]} (unsigned) differs in" in why.nearest.describe()


async def test_a_miss_reported_ready_names_the_s3_key_and_counts_the_part(
    tmp_path: Path,
) -> None:
    """CompileReady on a miss carries the nearest key in S3, and the metric counts its part."""
    source = MemorySource(objects={BUCKET: {}})
    uploaded = await _upload(tmp_path / "one", source, UPLOADED)
    counted = COMPILE_MISS_PARTS.labels("vllm", "extras.flag.max_num_batched_tokens")
    before = counted._value.get()
    async with node(tmp_path / "two", source) as second:
        path = (await second.ensure(WANTED)).info.path
        (path / "vllm" / "graph.py").write_text("compiled")
        ready = await second.ready(compile_key(WANTED))
    assert ready.verdict.verdict == "miss"
    assert ready.nearest is not None
    assert (ready.nearest.key, ready.nearest.location) == (uploaded, "s3")
    assert counted._value.get() == before + 1


async def test_a_key_on_the_node_wins_a_tie_with_one_only_in_s3(tmp_path: Path) -> None:
    """Two keys equally near, one cached here and one only in S3: the node's is named."""
    source = MemorySource(objects={BUCKET: {}})
    await _upload(tmp_path / "one", source, UPLOADED)
    local = replace(UPLOADED, extras={"flag.max_num_batched_tokens": "4096"})
    async with node(tmp_path / "two", source) as second:
        await second.ensure(local)
        wanted = await second.ensure(WANTED)
        why = await second.explain(wanted.info.key)
    assert why.nearest is not None
    assert (why.nearest.key, why.nearest.location) == (compile_key(local), "node")


async def test_planted_index_entries_are_skipped_and_the_real_one_is_named(
    tmp_path: Path,
) -> None:
    """Entries whose parts hash to another key, that are too big, not JSON or nested past what
    json parses, or with a name outside the pattern, are never named and never fail the
    answer; the honest entry still is."""
    source = MemorySource(objects={BUCKET: {}})
    uploaded = await _upload(tmp_path / "one", source, UPLOADED)
    near_lie = CompileKeyParts(**{**parts_to_dict(WANTED), "torch_version": "9.9"})
    lie = json.dumps({"format": 1, "key": "0" * 32, "parts": parts_to_dict(near_lie)})
    source.put(BUCKET, f"{INDEX}{'0' * 32}.json", lie.encode())  # hashes to another key
    source.put(BUCKET, f"{INDEX}{'1' * 32}.json", b"{" + b" " * ENTRY_MAX_BYTES)
    source.put(BUCKET, f"{INDEX}{'2' * 32}.json", b"not json")
    source.put(BUCKET, f"{INDEX}{'3' * 32}.json", b"[" * 60_000)  # too deep for json
    source.put(BUCKET, f"{INDEX}../../escape.json", b"{}")
    async with node(tmp_path / "two", source) as second:
        wanted = await second.ensure(WANTED)
        why = await second.explain(wanted.info.key)
    assert why.nearest is not None
    assert why.nearest.key == uploaded


class _UnreachableListing(MemorySource):
    """S3 that refuses connections when listed (as a down endpoint does)."""

    async def list_pages(self, uri: ModelUri) -> AsyncGenerator[list[ListedObject], None]:
        """Refuse at once, as S3Source does when the endpoint refuses the connection."""
        raise SourceUnreachable(f"cannot reach the endpoint to list {uri}")
        yield []  # pragma: no cover (makes this an async generator)


async def test_s3_that_cannot_be_listed_leaves_the_nodes_keys_and_a_note(tmp_path: Path) -> None:
    """With S3 unreachable the answer still names the node's nearest key, and says S3 was not
    searched and why."""
    source = _UnreachableListing(objects={BUCKET: {}})
    async with node(tmp_path / "two", source) as second:
        await second.ensure(UPLOADED, skip_restore=True)
        wanted = await second.ensure(WANTED, skip_restore=True)
        why = await second.explain(wanted.info.key)
    assert why.nearest is not None
    assert (why.nearest.key, why.nearest.location) == (compile_key(UPLOADED), "node")
    assert why.s3_note.startswith("S3 could not be searched (cannot reach the endpoint")
    assert why.s3_note.endswith("only this node's keys were compared")


async def test_asking_why_again_and_again_lists_s3_once(tmp_path: Path) -> None:
    """A flood of why-questions about one model costs one S3 listing and one GET per key while
    the answer is kept."""
    source = MemorySource(objects={BUCKET: {}})
    await _upload(tmp_path / "one", source, UPLOADED)
    async with node(tmp_path / "two", source) as second:
        wanted = await second.ensure(WANTED)
        pages, reads = source.listing_pages, len(source.whole_reads)
        for _ in range(50):
            why = await second.explain(wanted.info.key)
            assert why.nearest is not None
        assert (source.listing_pages - pages, len(source.whole_reads) - reads) == (1, 1)


class _SilentListing(MemorySource):
    """S3 that accepts the listing and never answers it."""

    listings = 0

    async def list_pages(self, uri: ModelUri) -> AsyncGenerator[list[ListedObject], None]:
        """Wait forever (until cancelled), as a stuck connection does."""
        self.listings += 1
        await asyncio.Event().wait()
        yield []  # pragma: no cover


async def test_s3_that_never_answers_costs_one_timeout_per_model_and_says_so(
    tmp_path: Path,
) -> None:
    """A listing that never answers is given up after why_timeout_seconds, the node's nearest
    key is named, and the next questions reuse that answer instead of waiting again."""
    source = _SilentListing(objects={BUCKET: {}})
    async with node(tmp_path / "two", source, why_timeout_seconds=0.2) as second:
        await second.ensure(UPLOADED, skip_restore=True)
        wanted = await second.ensure(WANTED, skip_restore=True)
        first = await second.explain(wanted.info.key)
        for _ in range(3):
            again = await second.explain(wanted.info.key)
    assert first.nearest is not None
    assert first.nearest.location == "node"
    assert first.s3_note.startswith("S3 did not answer within 0.2 s")
    assert again.s3_note == first.s3_note
    assert source.listings == 1
