"""The shaped bench's pure logic: profiles, the tc tree it builds, s5cmd's shape, log lines.

Nothing here needs root or a namespace: the bench itself is run by hand.
"""

from __future__ import annotations

import pytest

from bench._shaped_runs import daemon_log_lines, s5cmd_shape, seed_streams
from bench._shaping import (
    BUCKETS,
    MB,
    PROFILES,
    Profile,
    leaf_classid,
    parse_profiles,
    port_bucket,
    tc_batch,
)
from bench.shaped import log_message

PROFILE = Profile("p", per_connection=3 * MB, link=300 * MB)


def test_all_names_every_profile_in_table_order() -> None:
    """``--profiles all`` runs every profile of the table, in the table's order."""
    assert [p.name for p in parse_profiles("all")] == list(PROFILES)


def test_profiles_come_back_in_table_order_whatever_the_order_asked() -> None:
    """Asked names are returned in the table's order, each once."""
    assert [p.name for p in parse_profiles("3mbps, 20mbps,3mbps")] == ["20mbps", "3mbps"]


def test_an_unknown_profile_is_refused() -> None:
    """A name not in the table is a ValueError naming it, not a silent skip."""
    with pytest.raises(ValueError, match="nope"):
        parse_profiles("20mbps,nope")


def test_the_slowdown_profile_limits_gets_and_the_others_do_not() -> None:
    """Only ``slowdown`` has a GET rate limit; every profile has a first-byte latency."""
    assert {p.name for p in PROFILES.values() if p.get_rate} == {"slowdown"}
    assert all(p.first_byte_ms > 0 for p in PROFILES.values())


def test_streams_needed_is_link_over_per_connection_rounded_up() -> None:
    """3 MB/s per connection on a 300 MB/s link takes 100 streams; 20 MB/s takes 15."""
    assert PROFILES["3mbps"].streams_needed == 100
    assert PROFILES["20mbps"].streams_needed == 15


def test_leaf_shares_add_up_to_no_more_than_the_link() -> None:
    """The 256 leaves' guaranteed rates sum to at most the link, so the parent caps the total."""
    for profile in PROFILES.values():
        assert profile.leaf_rate * BUCKETS <= profile.link
        assert profile.leaf_rate <= profile.per_connection


def test_tc_batch_has_a_root_a_link_class_and_one_leaf_and_bucket_each() -> None:
    """One qdisc, one link class, 256 leaves, a 256-bucket table, 256 bucket filters, one hash."""
    lines = tc_batch("veth0", PROFILE)
    assert lines[0].startswith("qdisc add dev veth0 root handle 1: htb")
    assert (
        lines[1]
        == "class add dev veth0 parent 1: classid 1:1 htb rate 2400000000bit ceil 2400000000bit"
    )
    leaves = [line for line in lines if line.startswith("class add dev veth0 parent 1:1 ")]
    buckets = [line for line in lines if " ht 100:" in line]
    assert len(leaves) == BUCKETS
    assert len(buckets) == BUCKETS
    assert sum("divisor 256" in line for line in lines) == 1
    assert len(lines) == 2 + BUCKETS + 1 + BUCKETS + 1


def test_each_leaf_is_capped_at_the_per_connection_rate() -> None:
    """Every leaf's ceil is the per-connection rate, in bits per second."""
    leaves = [line for line in tc_batch("d", PROFILE) if "parent 1:1 " in line]
    assert all(line.split(" ceil ")[1].startswith("24000000bit") for line in leaves)


def test_each_bucket_filter_points_at_its_own_leaf() -> None:
    """Bucket ``ab`` of table 100 sends to class ``1:1ab``: no two buckets share a leaf."""
    filters = [line for line in tc_batch("d", PROFILE) if " ht 100:" in line]
    targets = [line.rsplit("flowid ", 1)[1] for line in filters]
    assert targets == [leaf_classid(b) for b in range(BUCKETS)]
    assert "ht 100:ab: " in filters[0xAB]
    assert filters[0xAB].endswith("flowid 1:1ab")


def test_the_hash_filter_keys_tcp_ports_of_an_optionless_header() -> None:
    """The linking filter matches TCP with IHL 5 and hashes the port word at offset 20."""
    (link,) = [line for line in tc_batch("d", PROFILE) if " link 100:" in line]
    assert "match ip protocol 6 0xff" in link
    assert "match u8 0x05 0x0f at 0" in link
    assert "hashkey mask 0x000001fe at 20" in link


def test_consecutive_even_client_ports_land_in_distinct_buckets() -> None:
    """Linux hands connect() even ports: 256 consecutive even ports fill all 256 buckets."""
    assert {port_bucket(40000 + 2 * i) for i in range(BUCKETS)} == set(range(BUCKETS))


def test_leaf_classid_refuses_a_bucket_outside_the_table() -> None:
    """There is no leaf for bucket 256."""
    with pytest.raises(ValueError, match="256"):
        leaf_classid(BUCKETS)


def test_s5cmd_shape_gives_one_worker_per_file_and_splits_the_connections() -> None:
    """7 files at 128 connections: 7 workers of 19 parts each (133, the nearest above)."""
    assert s5cmd_shape(7, 128) == (7, 19)
    assert s5cmd_shape(300, 128) == (128, 1)


def test_seed_streams_is_one_per_4_gb_at_least_one() -> None:
    """The seed's tuning: ceil(size_GB / 4) streams, never zero."""
    assert seed_streams(1024**3) == 1
    assert seed_streams(4 * 1024**3) == 2
    assert seed_streams(67 * 1000**3) == 17


def test_daemon_log_lines_keep_concurrency_and_slowdown_lines_only() -> None:
    """Lines naming SlowDown, concurrency or GETs in flight are kept; the rest are not."""
    text = "\n".join(
        ["started", "retrying after SlowDown", "concurrency 64 -> 96", "96 GETs in flight", "done"]
    )
    count, lines = daemon_log_lines(text)
    assert count == 3
    assert lines == ["retrying after SlowDown", "concurrency 64 -> 96", "96 GETs in flight"]


def test_daemon_log_lines_elide_the_middle_of_a_long_log() -> None:
    """Past the limit, the first and last halves are kept around a count of the rest."""
    text = "\n".join(f"concurrency {i}" for i in range(100))
    count, lines = daemon_log_lines(text, limit=4)
    assert count == 100
    assert lines == [
        "concurrency 0",
        "concurrency 1",
        "… 96 more …",
        "concurrency 98",
        "concurrency 99",
    ]


def test_log_message_shortens_a_json_record_and_leaves_text_alone() -> None:
    """A JSON log record prints as time, level, logger and message; plain text as it is."""
    record = '{"ts": "T", "level": "info", "logger": "agent.pull", "msg": "64 GETs in flight"}'
    assert log_message(record) == "T info agent.pull: 64 GETs in flight"
    assert log_message("plain concurrency line") == "plain concurrency line"
