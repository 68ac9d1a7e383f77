"""The name a published snapshot's directory has: a capability, not its key.

A snapshot key can be worked out by anyone who may list the model's bucket
(it hashes the URI, the filters and each object's size and ETag), and a local
user can try names in ``snapshots/`` without listing it. So the directory is
named by an HMAC of the key under a key of the root's own: 128 bits nobody
can compute without the root's secret. The API hands the path to the callers
it allows; ``snapshots/`` itself is traverse-only, so the path is the only way
in. Being a function of the key, the name is stable across restarts, and
reconcile can tell which staging pull a directory without a manifest belongs to.

The root's secret is its journal key (``agent.store.roots``), used here under
a purpose of its own. If the key is replaced, every name changes: reconcile
then finds no snapshot where its manifest says and drops it, which costs a
download, never a wrong byte.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["NAME_LENGTH", "SnapshotNames"]

# Hex digits: 128 bits.
NAME_LENGTH = 32
_PURPOSE = b"prewarm: names of published snapshot directories"


class SnapshotNames:
    """Directory names of one root's snapshots, keyed by the root's secret."""

    def __init__(self, secret: bytes) -> None:
        """Names derived from ``secret``, the root's own key."""
        self._key = hmac.new(secret, _PURPOSE, hashlib.sha256).digest()

    def of(self, key: str) -> str:
        """The directory name of snapshot ``key``."""
        return hmac.new(self._key, key.encode(), hashlib.sha256).hexdigest()[:NAME_LENGTH]
