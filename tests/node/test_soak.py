"""A soak: many clients mixing hits, misses, evictions, cancellations and leases, tight budget.

The daemon runs as a subprocess so its RSS and open descriptors can be read
from /proc. Every client checks what a lease promises: while it holds a lease,
every file of the snapshot exists and holds the bytes S3 holds.

The same assertions at any length: `make test` soaks for --soak-seconds' short
default (10 s), `make soak` for a minute before a release.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.client import Client, PrewarmError
from agent.testing import AgentProcess, S3Server

MiB = 1024 * 1024
MODELS = 6
MODEL_MIB = 5
CLIENTS = 48
# Leased reads per minute of soak the clients must get through (a stalled daemon gets few).
LEASED_PER_MINUTE = 100

# Room for about three models: every few misses evict something.
TIGHT_BUDGET = """
[tiers]
shm_budget = "16MiB"
shm_reserve = "0"
high_watermark = 0.9
low_watermark = 0.6
fallback = false
"""


@dataclass
class Tally:
    """What the clients saw, added up under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: Counter[str] = field(default_factory=Counter)
    missing_under_lease: list[str] = field(default_factory=list)
    corrupt_reads: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def add(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1


def _process_footprint(pid: int) -> tuple[int, int]:
    """The daemon's resident set (bytes) and open descriptors, from /proc."""
    rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return rss_pages * os.sysconf("SC_PAGE_SIZE"), sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())


def _upload_models(s3: S3Server, bucket: str) -> dict[str, dict[str, str]]:
    """MODELS one-file models of MODEL_MIB MiB; uri -> file name -> sha256."""
    client = s3.client()
    expected: dict[str, dict[str, str]] = {}
    for index in range(MODELS):
        body = random.Random(index).randbytes(MODEL_MIB * MiB)
        client.put_object(Bucket=bucket, Key=f"soak/m{index}/weights.bin", Body=body)
        expected[f"s3://{bucket}/soak/m{index}/"] = {
            "weights.bin": hashlib.sha256(body).hexdigest()
        }
    return expected


def _leased_read(
    client: Client, uri: str, digests: dict[str, str], *, tally: Tally, rng: random.Random
) -> None:
    """Hold a lease, read every file while holding it, check its bytes."""
    with client.leased(uri, tier="shm", client_name="soak") as handle:
        for name, digest in digests.items():
            path = Path(handle.path) / name
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                with tally.lock:
                    tally.missing_under_lease.append(f"{uri} {path}")
                continue
            if hashlib.sha256(data).hexdigest() != digest:
                with tally.lock:
                    tally.corrupt_reads.append(f"{uri} {path}")
        time.sleep(rng.uniform(0.0, 0.05))  # the pod uses the model a moment, lease held
    tally.add("leased")


def _one_client(
    socket_path: Path,
    expected: dict[str, dict[str, str]],
    *,
    deadline: float,
    seed: int,
    tally: Tally,
) -> None:
    """Loop until the deadline: leased reads, plain ensures, and pulls cut short."""
    rng = random.Random(seed)
    uris = sorted(expected)
    while time.monotonic() < deadline:
        uri = rng.choice(uris)
        roll = rng.random()
        try:
            if roll < 0.6:
                with Client(socket_path, timeout=30) as client:
                    _leased_read(client, uri, expected[uri], tally=tally, rng=rng)
            elif roll < 0.85:
                with Client(socket_path, timeout=30) as client:
                    client.ensure(uri, tier="shm")
                tally.add("ensured")
            else:
                # A client that gives up mid-call: the agent must cancel cleanly.
                with Client(socket_path, timeout=rng.uniform(0.001, 0.05)) as client:
                    client.ensure(uri, tier="shm")
                tally.add("ensured")
        except PrewarmError as exc:
            # Under this budget a pull may find no room (every model leased), and a
            # client whose timeout fired sees its own deadline: both are answers.
            tally.add(type(exc).__name__)
        except Exception as exc:  # anything else is a defect the test reports
            with tally.lock:
                tally.unexpected.append(f"{type(exc).__name__}: {exc}")


def _run_clients(target: Callable[[int], None], count: int, *, seconds: float) -> None:
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 120)
        assert not thread.is_alive(), "a soak client hung"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_48_clients_never_lose_a_leased_file_and_stay_flat(
    start_agent_process: Callable[..., AgentProcess],
    s3_server: S3Server,
    bucket: str,
    soak_seconds: float,
) -> None:
    """48 clients, tight budget, --soak-seconds long (make soak: 60 s): no leased file missing
    or corrupt, no unexpected error, leased reads keep coming; RSS and fds flat."""
    expected = _upload_models(s3_server, bucket)
    agent = start_agent_process(TIGHT_BUDGET)
    assert agent.pid is not None
    tally = Tally()
    # The first seconds grow caches, pools and threads to their working size; the
    # footprint is measured after that, then after a whole soak.
    warm_up_seconds = min(8.0, soak_seconds / 2)

    def warm_up(seed: int) -> None:
        deadline = time.monotonic() + warm_up_seconds
        _one_client(agent.socket_path, expected, deadline=deadline, seed=seed, tally=tally)

    _run_clients(warm_up, CLIENTS, seconds=warm_up_seconds)
    rss_before, fds_before = _process_footprint(agent.pid)

    deadline = time.monotonic() + soak_seconds

    def soak(seed: int) -> None:
        _one_client(agent.socket_path, expected, deadline=deadline, seed=1000 + seed, tally=tally)

    _run_clients(soak, CLIENTS, seconds=soak_seconds)
    rss_after, fds_after = _process_footprint(agent.pid)

    print(
        f"soak of {soak_seconds:g} s: {dict(tally.outcomes)}; "
        f"RSS {rss_before / MiB:.1f} -> {rss_after / MiB:.1f} MiB; fds {fds_before} -> {fds_after}"
    )
    assert tally.unexpected == []
    assert tally.missing_under_lease == [], f"{len(tally.missing_under_lease)} missing"
    assert tally.corrupt_reads == []
    assert tally.outcomes["leased"] > LEASED_PER_MINUTE * soak_seconds / 60, tally.outcomes
    assert agent.running
    assert rss_after <= rss_before * 1.25 + 8 * MiB, (rss_before, rss_after)
    assert fds_after <= fds_before + 16, (fds_before, fds_after)
