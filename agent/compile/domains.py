"""Compile domains: whose compile caches are whose, on this node's disk and in S3.

A compile cache is code engines load, so it never crosses a trust domain
unless the admin says so. Requests on a tenant's socket use that tenant's
domain (its ``compile_domain``, by default its name); the node's API socket
and the daemon's own callers (prefetch manifests) use ``node``. A key lives at
``<disk root>/compile/<domain>/<key>/`` and under ``<uri>/<domain>/<key>/`` in
S3, so two tenants asking for the same key parts get two directories and two
prefixes; tenant sockets given the same ``compile_domain`` share theirs.

On disk, each domain belongs to a group: its tenant socket's ``group`` (the
group its pods need to reach the socket), the API socket's ``socket_group``
for ``node``, the daemon's own group when that is empty::

    compile/                  0711 agent            any user may pass, none may list
    compile/<domain>/         0710 agent:<group>    only the domain's group may pass
    compile/<domain>/<key>/   2770 agent:<group>    the domain's pods write; setgid, so
                                                    whatever they make there is the group's
    compile/<domain>/.meta/ .tmp/ .trash/   0700 agent

Another tenant's pods (another group) cannot reach the directory, and an
upload packs only files of the domain's group with one link (a file made in
the key directory always is; one moved or hard-linked in from elsewhere keeps
its own group). Pods running as root pass every permission: for them the
mounts are the boundary (each pod mounts its own domain's directory only).
"""

from __future__ import annotations

import grp
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from agent._config import ConfigError, Settings
from agent._exceptions import InvalidRequest
from agent._fs import remove_tree
from agent.compile.signing import Signing, Trust, load_signing_key, load_trusted_keys

__all__ = [
    "DOMAIN_DIR_MODE",
    "KEY_DIR_MODE",
    "NODE_DOMAIN",
    "NODE_SCOPE",
    "PRIVATE_DIR_MODE",
    "ROOT_MODE",
    "CacheRef",
    "DomainSpec",
    "Scope",
    "domain_signing",
    "domain_specs",
    "prepare_compile_root",
]

log = logging.getLogger(__name__)

NODE_DOMAIN = "node"
ROOT_MODE = 0o711
DOMAIN_DIR_MODE = 0o710
KEY_DIR_MODE = 0o2770
PRIVATE_DIR_MODE = 0o700
_KEY = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True, order=True)
class CacheRef:
    """One compile cache: a key within a domain. Written ``<domain>/<key>``."""

    domain: str
    key: str

    def __str__(self) -> str:
        return f"{self.domain}/{self.key}"

    @classmethod
    def parse(cls, text: str) -> CacheRef:
        """The ref ``str()`` wrote; InvalidRequest for anything else."""
        domain, _, key = text.partition("/")
        if not domain or not _KEY.fullmatch(key):
            raise InvalidRequest(f"{text[:80]!r} is not <domain>/<32 hex digits>.")
        return cls(domain, key)


@dataclass(frozen=True, slots=True)
class Scope:
    """What one caller may see and make: its own domain, or every domain (the node's socket)."""

    domain: str
    everything: bool = False

    def sees(self, domain: str) -> bool:
        """Whether callers of this scope may see and use ``domain``'s caches."""
        return self.everything or domain == self.domain


NODE_SCOPE = Scope(NODE_DOMAIN, everything=True)


@dataclass(frozen=True, slots=True)
class DomainSpec:
    """A domain and the group whose pods may write its compile caches."""

    name: str
    gid: int


def domain_specs(settings: Settings) -> dict[str, DomainSpec]:
    """The node's domain and each tenant socket's, with the gid of its group.

    ConfigError when a group does not exist, or when a tenant shares the node's
    domain under another group than the API socket's.
    """
    groups = {NODE_DOMAIN: settings.socket_group}
    for entry in settings.access.sockets:
        shared = groups.setdefault(entry.domain, entry.group)
        if shared != entry.group:  # tenants among themselves are checked with the settings
            raise ConfigError(
                f"[[access.sockets]] {entry.name!r} shares compile domain {entry.domain!r} "
                f"with the node's API socket, but its group ({entry.group!r}) is not "
                f"socket_group ({shared!r}); give it the same group, or a domain of its own."
            )
    return {name: DomainSpec(name, _gid(group)) for name, group in groups.items()}


def domain_signing(settings: Settings) -> dict[str, Signing]:
    """Each domain's signing key and the keys its restores trust: a tenant socket's own
    (``compile_signing_key``, ``compile_trusted_keys``) or else ``[compile_cache]``'s.

    ConfigError when a key file is unsafe or not a key, or when sockets sharing a
    domain name different keys for it.
    """
    node = settings.compile_cache
    chosen: dict[str, tuple[Path | None, tuple[Path, ...]]] = {
        NODE_DOMAIN: (node.signing_key, tuple(node.trusted_keys))
    }
    for entry in settings.access.sockets:
        trusted = (
            node.trusted_keys if entry.compile_trusted_keys is None else entry.compile_trusted_keys
        )
        mine = (entry.compile_signing_key or node.signing_key, tuple(trusted))
        if chosen.setdefault(entry.domain, mine) != mine:
            raise ConfigError(
                f"[[access.sockets]] {entry.name!r} shares compile domain {entry.domain!r} with "
                "another socket but names other signing or trusted keys; give them the same."
            )
    return {
        domain: Signing(
            domain,
            load_signing_key(key) if key is not None else None,
            Trust(load_trusted_keys(trusted), accept_unsigned=node.accept_unsigned),
        )
        for domain, (key, trusted) in chosen.items()
    }


def _gid(group: str) -> int:
    if not group:
        return os.getegid()
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(
            f"group {group!r} (of a socket's compile domain) does not exist; create it "
            f"(groupadd {group}) or leave the group empty."
        ) from None


def prepare_compile_root(root: Path, domains: list[str]) -> list[str]:
    """Make ``root`` (0711) and remove whatever in it belongs to no domain; returns what went.

    That is the layout from before domains (``<key>/``, ``.meta/``...: caches every
    tenant could write, so none is kept) and the domains of tenants no longer
    configured. The root is inside the disk tier's root, which only the agent may
    write, so nothing in it can have been swapped for a link.
    """
    root.mkdir(mode=ROOT_MODE, exist_ok=True)
    info = root.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise ConfigError(f"{root} is not a directory of the agent's; remove it and restart.")
    root.chmod(ROOT_MODE)
    removed = sorted(entry.name for entry in os.scandir(root) if entry.name not in domains)
    for name in removed:
        remove_tree(root / name)
    return removed
