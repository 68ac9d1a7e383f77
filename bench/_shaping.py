"""What S3 looks like to one node: the shaped bench's profiles, and the tc tree that enforces them.

A profile names what real S3 does to a client: each connection capped (one GET
gets tens of MB/s), the node's link capped, a first-byte latency, and
optionally a request-rate limit per prefix past which S3 answers 503 SlowDown.

The caps are an htb tree on the egress of the server's side of the veth pair
(what the server sends is what a pull receives):

- a root qdisc, one parent class at the link rate (rate = ceil = link);
- 256 leaf classes, each with a guaranteed share of the link (``link / 256``,
  or the per-connection rate if that is lower) and a ceiling at the
  per-connection rate. htb lets a class send at its own ``rate`` whatever its
  parent says, and only *borrowing* above it is bounded by the parent: leaves
  at ``rate = ceil = per-connection`` would never be held to the link rate.
  With the shares summing to the link, the parent's ceiling is the link's;
- a u32 hash table of 256 buckets keyed on the client's TCP port (in the
  server's packets, the destination port), each bucket pointing at one leaf.
  Linux gives ``connect()`` even ports first, so the key is bits 1-8 of the
  port (mask ``0x000001fe`` on the ports' 32-bit word at offset 20 of an IP
  header without options) rather than the low 8 bits, half of which would
  never be used. Two connections whose ports share those bits share a leaf.

Everything here is pure (argv and text): ``bench._netns`` runs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BUCKETS",
    "PORT_HASH_MASK",
    "PROFILES",
    "Profile",
    "leaf_classid",
    "parse_profiles",
    "port_bucket",
    "tc_batch",
]

MB = 1000**2
BUCKETS = 256
# The 32-bit word at offset 20 of an IPv4 header without options is the TCP
# source and destination ports; the destination port is its low 16 bits.
PORT_WORD_OFFSET = 20
PORT_HASH_MASK = 0x000001FE
HASH_TABLE = 0x100
LINK_CLASS = 1
LEAF_BASE = 0x100


@dataclass(frozen=True)
class Profile:
    """How S3 treats a node: per-connection and link rates (bytes/s), latency, GET rate limit."""

    name: str
    per_connection: int
    link: int
    first_byte_ms: int = 20
    # GET/HEAD requests per second per bucket and first path segment; 0: no limit.
    get_rate: float = 0.0
    # How many requests the limit lets through at once before it refuses.
    get_burst: int = 0
    about: str = ""

    @property
    def streams_needed(self) -> int:
        """Connections it takes to fill the link at the per-connection rate."""
        return math.ceil(self.link / self.per_connection)

    @property
    def leaf_rate(self) -> int:
        """Each leaf's guaranteed share: an equal part of the link, never above its ceiling."""
        return min(self.per_connection, self.link // BUCKETS)

    def describe(self) -> str:
        text = (
            f"{self.per_connection / MB:g} MB/s per connection, {self.link / MB:g} MB/s link "
            f"({self.streams_needed} streams), {self.first_byte_ms} ms to first byte"
        )
        if self.get_rate:
            text += f", GET limit {self.get_rate:g}/s per prefix (burst {self.get_burst})"
        return text


PROFILES: dict[str, Profile] = {
    profile.name: profile
    for profile in (
        Profile("20mbps", per_connection=20 * MB, link=300 * MB, about="S3 at 20 MB/s a GET"),
        Profile("3mbps", per_connection=3 * MB, link=300 * MB, about="S3 at 3 MB/s a GET"),
        # At 20 GETs/s, parts of 8 MiB carry at most 168 MB/s: a client that
        # fills this link with small parts, or opens 128 GETs at once, is
        # refused as S3 refuses one that outruns a prefix's partition.
        Profile(
            "slowdown",
            per_connection=20 * MB,
            link=300 * MB,
            get_rate=20.0,
            get_burst=20,
            about="20mbps with SlowDown 503s past 20 GETs/s per prefix",
        ),
    )
}
QUICK_PROFILES = ("20mbps", "3mbps")


def parse_profiles(text: str) -> list[Profile]:
    """``"all"`` or comma-separated names -> profiles in table order; ValueError otherwise."""
    asked = [item.strip() for item in text.split(",") if item.strip()]
    if not asked:
        raise ValueError(f"no profile given; choose from all,{','.join(PROFILES)}")
    if "all" in asked:
        return list(PROFILES.values())
    if unknown := sorted(set(asked) - set(PROFILES)):
        raise ValueError(f"unknown profiles {unknown}; choose from all,{','.join(PROFILES)}")
    return [profile for name, profile in PROFILES.items() if name in asked]


def leaf_classid(bucket: int) -> str:
    """The htb leaf of one hash bucket, in tc's hex notation (``1:1ab``)."""
    if not 0 <= bucket < BUCKETS:
        raise ValueError(f"bucket {bucket} is outside 0..{BUCKETS - 1}")
    return f"1:{LEAF_BASE + bucket:x}"


def port_bucket(port: int) -> int:
    """The bucket u32 puts a connection in from its client port (what the kernel computes)."""
    shift = (PORT_HASH_MASK & -PORT_HASH_MASK).bit_length() - 1
    return ((port & PORT_HASH_MASK) >> shift) % BUCKETS


def _bits(rate: int) -> str:
    return f"{rate * 8}bit"


def tc_batch(dev: str, profile: Profile) -> list[str]:
    """The lines of a ``tc -batch`` file that shape what ``dev`` sends as ``profile`` says."""
    link = _bits(profile.link)
    lines = [
        f"qdisc add dev {dev} root handle 1: htb r2q 100",
        f"class add dev {dev} parent 1: classid 1:{LINK_CLASS} htb rate {link} ceil {link}",
    ]
    share, ceiling = _bits(profile.leaf_rate), _bits(profile.per_connection)
    for bucket in range(BUCKETS):
        lines.append(
            f"class add dev {dev} parent 1:{LINK_CLASS} classid {leaf_classid(bucket)} "
            f"htb rate {share} ceil {ceiling} quantum 60000"
        )
    table = f"{HASH_TABLE:x}"
    lines.append(
        f"filter add dev {dev} parent 1: prio 1 handle {table}: protocol ip u32 divisor 256"
    )
    for bucket in range(BUCKETS):
        lines.append(
            f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht {table}:{bucket:x}: "
            f"match u32 0 0 flowid {leaf_classid(bucket)}"
        )
    lines.append(
        f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht 800:: "
        # TCP, and a 20-byte IP header (IHL 5), so the ports are where the key says.
        "match ip protocol 6 0xff match u8 0x05 0x0f at 0 "
        f"hashkey mask 0x{PORT_HASH_MASK:08x} at {PORT_WORD_OFFSET} link {table}:"
    )
    return lines


def describe_tree(profiles: Sequence[Profile]) -> list[str]:
    """One line per profile, for the report's header."""
    return [f"{p.name}: {p.describe()}" for p in profiles]
