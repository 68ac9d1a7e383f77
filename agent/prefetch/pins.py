"""The pins manifests made, kept in a small JSON file beside the disk tier.

Remembering them lets the watcher undo a pin whose entry was removed while
the agent was down, and tells a manifest's pin apart from one a person made
by hand (which a manifest never undoes).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from agent._fs import write_json_atomic
from agent.prefetch.schema import Identity

__all__ = ["load_pins", "save_pins"]

log = logging.getLogger(__name__)

STATE_FORMAT = 1


def load_pins(path: Path) -> dict[Identity, str]:
    """Snapshot key each manifest entry pinned; empty (and a warning) when unreadable."""
    try:
        document = json.loads(path.read_text())
        if document.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown format {document.get('format')!r}")
        return {
            (pin["uri"], tuple(pin["include"]), tuple(pin["exclude"])): str(pin["key"])
            for pin in document["pins"]
        }
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning(
            "ignoring unreadable manifest state %s (%s); pins made by manifests before are "
            "not undone automatically",
            path,
            exc,
        )
        return {}


def save_pins(path: Path, pinned: Mapping[Identity, str]) -> None:
    """Replace the state file at once, so a crash leaves the old or the new pins."""
    document = {
        "format": STATE_FORMAT,
        "pins": [
            {"uri": uri, "include": list(include), "exclude": list(exclude), "key": key}
            for (uri, include, exclude), key in sorted(pinned.items())
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, document)
