"""Issue 15's benchmark targets (prewarm vs s5cmd per scheme, locks, loop, tree memory).

Judged from canned samples: the benchmark run produces the real ones.
"""

from __future__ import annotations

from bench._line_rate import line_rate_targets
from bench._stats import Sample

GiB = 1024**3
MiB = 1024**2


def _cold(seconds: float, cpu_per_gib: float, **extra: object) -> Sample:
    sample = Sample("row", nbytes=2 * GiB, seconds=[seconds])
    sample.extra = {"cpu": {"process_per_gib": cpu_per_gib, "main_thread_per_gib": 0.01}, **extra}
    return sample


def _verdicts(samples: dict[str, Sample], schemes: list[str]) -> dict[str, bool | None]:
    targets = line_rate_targets(samples, schemes=schemes, cold_rows=["processes"], scaling={})
    return {t.name: t.met for t in targets if "at " not in t.name}


def test_cold_pull_must_beat_s5cmd_on_speed_and_cpu_both() -> None:
    """Faster than s5cmd but dearer per GiB misses; the lock is judged over HTTPS only."""
    gil = {"busiest_per_gib": 0.01, "busiest_process": "daemon (1)", "daemon_per_gib": 0.01}
    gil |= {"bound_gib_per_second": 100.0, "rate": 500}
    samples = {
        "s5cmd [http]": _cold(2.0, 0.6),
        "prewarm cold (processes) [http]": _cold(1.9, 0.7, gil=gil),
        "s5cmd [https]": _cold(2.0, 0.9),
        "prewarm cold (processes) [https]": _cold(1.9, 0.8, gil=gil),
    }
    assert _verdicts(samples, ["http", "https"]) == {
        "cold pull vs s5cmd (processes) [http]": False,
        "event-loop thread (processes) [http]": True,
        "cold pull vs s5cmd (processes) [https]": True,
        "event-loop thread (processes) [https]": True,
        "interpreter lock per process (processes) [https]": True,
    }


def test_lock_not_measured_is_not_judged() -> None:
    """A cold row without GIL figures (--no-gil, or py-spy failed) is n/a with the reason."""
    samples = {
        "s5cmd [https]": _cold(2.0, 0.9),
        "prewarm cold (processes) [https]": _cold(1.9, 0.8, gil={"error": "ptrace denied"}),
    }
    targets = line_rate_targets(samples, schemes=["https"], cold_rows=["processes"], scaling={})
    lock = next(t for t in targets if t.name.startswith("interpreter lock"))
    assert (lock.met, lock.note) == (None, "ptrace denied")


def test_tree_memory_at_a_size_is_judged_on_rss_with_pss_beside_it() -> None:
    """Peak RSS summed over the daemon's processes, at 2 GiB, against 256 MiB."""
    point = {"size": 2 * GiB, "tree_rss": 300 * MiB, "tree_pss": 200 * MiB, "vm_hwm": 90 * MiB}
    scaling = {"https": {"plane": "processes", "points": [point]}}
    targets = line_rate_targets({}, schemes=["https"], cold_rows=[], scaling=scaling)
    memory = next(t for t in targets if t.name.startswith("daemon tree peak memory at 2 GiB"))
    assert memory.met is False
    assert memory.measured == "RSS 300 MiB, PSS 200 MiB"
