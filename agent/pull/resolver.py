"""Resolution: a URI and its filters, listed now, become a Snapshot with a content key."""

from __future__ import annotations

from collections.abc import Sequence

from agent._exceptions import InvalidRequest, NotFound
from agent._snapshot import Snapshot, SourceObject, select_objects, snapshot_key
from agent._uri import ModelUri, safe_relative_path
from agent.source.interface import ObjectSource

__all__ = ["resolve"]


async def resolve(
    source: ObjectSource, uri: ModelUri, include: tuple[str, ...], exclude: tuple[str, ...]
) -> Snapshot:
    """List the prefix and pin down exactly which bytes make this snapshot."""
    listed = await source.list_objects(uri)
    objects = [
        SourceObject(
            key=item.key,
            relative_path=safe_relative_path(uri, item.key),
            size=item.size,
            etag=item.etag,
            checksum_algorithm=item.checksum_algorithm,
        )
        for item in listed
        # Zero-byte keys ending in "/" are folder markers made by consoles, not files.
        if not (item.key.endswith("/") and item.size == 0)
    ]
    if not objects:
        raise NotFound(
            f"No objects under {uri}. Check the prefix: it names a directory, "
            "e.g. s3://bucket/models/llama-3-8b/."
        )
    selected = sorted(select_objects(objects, include, exclude), key=lambda o: o.relative_path)
    if not selected:
        raise NotFound(
            f"{len(objects)} objects under {uri}, but none passes the include/exclude "
            f"filters {list(include)} / {list(exclude)}. Loosen the filters."
        )
    _check_no_clashes(uri, selected)
    return Snapshot(
        uri=uri,
        include=include,
        exclude=exclude,
        objects=tuple(selected),
        key=snapshot_key(uri, include, exclude, selected),
    )


def _check_no_clashes(uri: ModelUri, objects: Sequence[SourceObject]) -> None:
    """Refuse listings where one object's path is another's directory ("a" and "a/b")."""
    paths = {obj.relative_path for obj in objects}
    for obj in objects:
        parts = obj.relative_path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in paths:
                raise InvalidRequest(
                    f"Under {uri}, {parent!r} is both a file and the directory of "
                    f"{obj.relative_path!r}; a local directory cannot hold both. Exclude one."
                )
