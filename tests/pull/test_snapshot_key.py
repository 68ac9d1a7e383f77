"""The snapshot key changes exactly when the bytes a client would get can change."""

from __future__ import annotations

from agent._snapshot import SourceObject, check_globs, select_objects, snapshot_key
from agent._uri import parse_uri

URI = parse_uri("s3://models/llama/")
OBJECTS = [
    SourceObject("llama/a.safetensors", "a.safetensors", 10, '"e1"'),
    SourceObject("llama/b.safetensors", "b.safetensors", 20, '"e2"'),
    SourceObject("llama/config.json", "config.json", 3, '"e3"'),
]


def test_key_is_stable_and_independent_of_listing_order() -> None:
    """The key is a 32-character digest that ignores the order S3 lists objects in."""
    assert snapshot_key(URI, (), (), OBJECTS) == snapshot_key(URI, (), (), OBJECTS[::-1])
    assert len(snapshot_key(URI, (), (), OBJECTS)) == 32


def test_changed_etag_gives_a_new_key() -> None:
    """An object replaced in place (new ETag, same size) changes the key."""
    changed = [*OBJECTS[:2], SourceObject("llama/config.json", "config.json", 3, '"e4"')]
    assert snapshot_key(URI, (), (), OBJECTS) != snapshot_key(URI, (), (), changed)


def test_changed_size_gives_a_new_key() -> None:
    """An object whose size changed (same ETag) changes the key."""
    changed = [*OBJECTS[:2], SourceObject("llama/config.json", "config.json", 4, '"e3"')]
    assert snapshot_key(URI, (), (), OBJECTS) != snapshot_key(URI, (), (), changed)


def test_filters_and_uri_are_part_of_the_key() -> None:
    """Include globs, exclude globs and the URI each change the key."""
    base = snapshot_key(URI, (), (), OBJECTS)
    assert snapshot_key(URI, ("*.json",), (), OBJECTS) != base
    assert snapshot_key(URI, (), ("*.json",), OBJECTS) != base
    assert snapshot_key(parse_uri("s3://models/other/"), (), (), OBJECTS) != base


def test_select_objects_applies_include_then_exclude() -> None:
    """Objects are kept when an include glob matches and no exclude glob does."""
    picked = select_objects(OBJECTS, ["*.safetensors"], ["b.*"])
    assert [o.relative_path for o in picked] == ["a.safetensors"]


def test_globs_are_canonical_so_equal_requests_share_a_key() -> None:
    """Globs are deduplicated and sorted, so equal filter sets give one key."""
    assert check_globs(["b", "a", "b"], what="Include") == ("a", "b")
