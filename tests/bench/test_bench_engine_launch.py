"""The engine-launch benchmark reads prewarm exec's own lines: keep the two in step."""

from __future__ import annotations

from bench.engine_launch import Launch, _parse


def test_the_benchmark_reads_exec_key_restore_verdict_and_upload_lines() -> None:
    """exec's key line (restored in S s), verdict line and upload size land in their fields."""
    launch = Launch(1, "restored", "node 2")
    lines = [
        (0.4, "prewarm: s3://models/minilm/: resolve\n"),
        (
            1.0,
            "prewarm: cold pull of s3://models/minilm/ in 0.64 s (resolve 0.05 s, download "
            "0.37 s, verify 0.21 s, publish 0.00 s), 87.4 MiB at 136.6 MiB/s -> /shm/snapshots/f\n",
        ),
        (
            2.3,
            "prewarm: compile cache 205b0ba55b9b (restored in 1.20 s) -> "
            "/var/lib/prewarm/disk/compile/node/205b0ba55b9b0123\n",
        ),
        (45.0, "INFO 12-02 06:00:00 AOTAutograd cache hit for key abc\n"),
        (
            47.0,
            "prewarm: compile cache 205b0ba55b9b: miss: inductor +22 files (118.4 MiB); "
            "uploaded 18.2 MiB to s3://models/compile-1/node/205b0ba55b9b0123/\n",
        ),
    ]
    _parse(launch, lines)
    assert launch.restore_seconds == 1.2
    assert launch.line_times == {"model": 1.0, "compile cache": 2.3, "verdict": 47.0}
    assert launch.uploaded == "18.2 MiB"
    assert launch.verdict_line.startswith("prewarm: compile cache 205b0ba55b9b: miss: ")
    assert launch.engine_lines == [
        "[  45.0 s] INFO 12-02 06:00:00 AOTAutograd cache hit for key abc"
    ]
