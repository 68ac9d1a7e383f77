"""Which keys of a model S3 holds: one small entry per uploaded key, grouped by model.

A miss names the nearest key of the same model (agent.compile.why). The keys
on this node are in its index; keys another node uploaded are only in S3,
and their parts sit inside manifests that list every file (megabytes each).
So every upload also writes, once per key, a small entry under its model::

    <prefix>/by-model/<model id>/<key>.json   {"format": 1, "key": ..., "parts": {...}}

where the model id is a digest of the engine and ``model_key`` (the parts a
nearest key must share). Finding the keys of a model is one listing of that
prefix and one small GET per key, capped. An entry is a hint, never trusted:
one that is too big, unreadable, or whose parts do not hash to the key it is
named after is skipped (and logged). An entry that passes is self-consistent,
not authentic: whoever may write the domain's prefix (who can plant archives,
code the engines load, anyway) can also plant or hide entries. Keys uploaded by
agents before this index existed get their entry when new files of theirs are
uploaded.

A lookup is at most one listing page's worth of names (``MAX_KEYS_READ``) and
one GET each, bounded by a timeout; lookups run one at a time per domain, and
a model's answer (a failure too) is kept for ``ANSWER_TTL_SECONDS``: a pod
asking why, again and again, costs S3 nothing more, and an S3 that does not
answer costs one timeout per model per TTL. (A key this node uploads is cached
here, and so compared as the node's.)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent._exceptions import Conflict, InvalidRequest, PrewarmError, quoted
from agent._uri import ModelUri
from agent.compile.keys import (
    CompileKeyParts,
    compile_key,
    normalise_parts,
    parts_from_dict,
    parts_to_dict,
)
from agent.compile.signing import UNCHECKED, Signing
from agent.source.interface import ObjectSource

__all__ = ["ENTRY_MAX_BYTES", "MAX_KEYS_READ", "KeysFound", "RemoteKeyIndex", "model_id"]

log = logging.getLogger(__name__)

INDEX_DIRECTORY = "by-model"
ENTRY_FORMAT = 1
# Key parts are capped at 64 extras of 256 bytes each on the API: far below this.
ENTRY_MAX_BYTES = 64 * 1024
# Keys of one model read per lookup (one GET each): a model with more keys than this
# in S3 is compared with the first this many of them, in key order.
MAX_KEYS_READ = 64
_CONCURRENT_READS = 8
# How long a model's keys, as listed (or the failure to list them), answer again
# without asking S3; and the bytes of entries kept, all models together.
ANSWER_TTL_SECONDS = 30.0
_ANSWER_BYTES_KEPT = 4 * 1024 * 1024
_ENTRY_NAME = re.compile(r"([0-9a-f]{32})\.json")


def model_id(parts: CompileKeyParts) -> str:
    """The digest that groups a model's keys: its engine and model key, normalised."""
    canonical = normalise_parts(parts)
    named = f"{canonical.engine}\0{canonical.model_key}".encode()
    return hashlib.sha256(named).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class KeysFound:
    """A model's keys in S3 as one lookup found them, and what it could not do ("" if all)."""

    keys: tuple[tuple[str, CompileKeyParts], ...]
    note: str = ""
    # Bytes of the entries read, for the bound on what is kept.
    size: int = 0
    # Who signed each key's entry (the trusted key's name; "" for an accepted unsigned one).
    signers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Entry:
    """One index entry as read and verified."""

    key: str
    parts: CompileKeyParts
    signer: str
    size: int


class RemoteKeyIndex:
    """The ``by-model`` entries under one compile domain's prefix in S3."""

    def __init__(
        self,
        source: ObjectSource,
        uri: ModelUri,
        *,
        timeout: float = 5.0,
        signing: Signing = UNCHECKED,
    ) -> None:
        self._source = source
        self._uri = uri
        self._timeout = timeout
        self._signing = signing
        self._lookup = asyncio.Lock()
        # model id -> (when looked up, what was found), oldest first.
        self._answers: OrderedDict[str, tuple[float, KeysFound]] = OrderedDict()

    def _directory(self, parts: CompileKeyParts) -> str:
        return f"{self._uri.prefix}{INDEX_DIRECTORY}/{model_id(parts)}/"

    async def add(self, key: str, parts: CompileKeyParts) -> None:
        """Write ``key``'s entry unless one is there (entries never change: keys are hashes)."""
        canonical = normalise_parts(parts)
        body = json.dumps(
            {"format": ENTRY_FORMAT, "key": key, "parts": parts_to_dict(canonical)},
            sort_keys=True,
        ).encode()
        name = f"{self._directory(canonical)}{key}.json"
        sealed = self._signing.seal(self._relative(name), body)
        try:
            await self._put(name, sealed, if_absent=True)
        except Conflict:
            # Already there: the same entry, unless someone planted one this domain does not
            # trust there first, which the signed one replaces.
            if await self._entry(name, key) is None:
                await self._put(name, sealed, if_absent=False)

    async def _put(self, name: str, body: bytes, *, if_absent: bool) -> None:
        await self._source.put_object(
            self._uri.bucket, name, body, content_type="application/json", if_absent=if_absent
        )

    def _relative(self, name: str) -> str:
        """An object's name under the domain's prefix: the place its signature names."""
        return name.removeprefix(self._uri.prefix)

    async def keys_like(self, parts: CompileKeyParts) -> KeysFound:
        """The keys S3 holds of ``parts``' model and engine, with their parts (at most
        ``MAX_KEYS_READ``; entries that cannot be trusted are left out), within the timeout.

        Never raises for S3's sake: what went wrong is the answer's ``note``.
        """
        model = model_id(parts)
        started = time.monotonic()
        try:
            async with asyncio.timeout(self._timeout), self._lookup:
                kept = self._answers.get(model)
                if kept is not None and time.monotonic() - kept[0] < ANSWER_TTL_SECONDS:
                    return kept[1]
                found = await self._read_model(parts)
        except TimeoutError:
            waited = time.monotonic() - started
            found = KeysFound((), f"S3 did not answer within {waited:.1f} s")
        except PrewarmError as exc:
            found = KeysFound((), f"S3 could not be searched ({exc})")
        self._keep(model, found)
        return found

    def _keep(self, model: str, found: KeysFound) -> None:
        """Keep ``found`` for the TTL; drop expired answers, then the oldest past the bound."""
        now = time.monotonic()
        self._answers[model] = (now, found)
        self._answers.move_to_end(model)
        for stale in [m for m, (at, _) in self._answers.items() if now - at >= ANSWER_TTL_SECONDS]:
            del self._answers[stale]
        while sum(f.size for _, f in self._answers.values()) > _ANSWER_BYTES_KEPT:
            self._answers.popitem(last=False)

    async def _read_model(self, parts: CompileKeyParts) -> KeysFound:
        """One listing of the model's entries and a GET of each (capped), read now."""
        directory = self._directory(parts)
        names: list[str] = []
        listed = 0
        pages = self._source.list_pages(ModelUri(self._uri.bucket, directory))
        async with contextlib.aclosing(pages):
            async for page in pages:
                # Counted whatever they are: a listing of big or odd names ends as soon.
                listed += len(page)
                names += [item.key for item in page if item.size <= ENTRY_MAX_BYTES]
                if listed >= MAX_KEYS_READ:
                    break
        keys = [m[1] for n in names if (m := _ENTRY_NAME.fullmatch(n.removeprefix(directory)))]
        gate = asyncio.Semaphore(_CONCURRENT_READS)

        async def read(key: str) -> _Entry | None:
            async with gate:
                return await self._entry(f"{directory}{key}.json", key)

        async with asyncio.TaskGroup() as group:
            reads = [group.create_task(read(key)) for key in sorted(keys)[:MAX_KEYS_READ]]
        found = [entry for entry in (r.result() for r in reads) if entry is not None]
        note = (
            f"S3 lists {MAX_KEYS_READ} or more entries of this model; the first "
            f"{MAX_KEYS_READ} were read"
            if listed >= MAX_KEYS_READ
            else ""
        )
        return KeysFound(
            tuple((entry.key, entry.parts) for entry in found),
            note,
            sum(entry.size for entry in found),
            {entry.key: entry.signer for entry in found},
        )

    async def _entry(self, name: str, key: str) -> _Entry | None:
        """One entry's parts (and size), or None (logged) when it is gone or untrustworthy."""
        try:
            stored = await self._source.get_object(
                self._uri.bucket, name, max_bytes=ENTRY_MAX_BYTES
            )
            if stored is None:
                return None
            opened = self._signing.open(self._relative(name), stored.data)
            document = json.loads(opened.document)
            if not isinstance(document, dict) or document.get("format") != ENTRY_FORMAT:
                raise InvalidRequest("not an index entry of a format this agent reads")
            if not isinstance(document.get("parts"), dict):
                raise InvalidRequest("it holds no key parts")
            parts = normalise_parts(parts_from_dict(document["parts"]))
            if compile_key(parts) != key:
                raise InvalidRequest("its parts hash to another key")
        # Bytes from S3 that anyone with write access to the prefix chose: one entry that
        # does not parse (too deep for json, not UTF-8, wrong types), or that S3 failed to
        # send, is skipped and logged, never fatal to the lookup.
        except (PrewarmError, AttributeError, RecursionError, TypeError, ValueError) as exc:
            log.warning(
                "skipped compile-cache index entry s3://%s/%s: %s",
                self._uri.bucket,
                name,
                quoted(str(exc) or type(exc).__name__),
            )
            return None
        return _Entry(key, parts, opened.signer, len(stored.data))
