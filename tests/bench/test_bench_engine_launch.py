"""The engine-launch benchmark reads prewarm exec's own lines: keep the two in step."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import pytest

from bench.engine_launch import (
    DEFAULT_ROWS,
    STREAMER,
    Launch,
    Pod,
    Setup,
    _command,
    _new_pod,
    _parse,
    _pod_env,
    _report,
    against_warm_restart,
    engine_default_caches,
    find_vllm,
    main,
    parse_rows,
)


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


def _setup(scratch: Path, device: str = "cpu") -> Setup:
    """The run's shared settings, with an S3 server that only hands out its variables."""

    class _S3:
        def env(self) -> dict[str, str]:
            return {"AWS_ENDPOINT_URL": "http://127.0.0.1:1"}

    return Setup(
        prewarm=["prewarm"],
        vllm=Path("/venv/bin/vllm"),
        s3=cast(Any, _S3()),
        scratch=scratch,
        timeout=600.0,
        log_dir=None,
        uri="s3://models/llama/",
        runner="generate",
        engine_args=("--block-size", "16"),
        tokens=8,
        prompt="w11",
        streamer_env={"RUNAI_STREAMER_CONCURRENCY": "1"},
        device=device,
        kv_cache_gib=1 if device == "cpu" else None,
        gpu_memory_utilization=0.85,
    )


def test_rows_refuse_a_warm_restart_without_seed_and_a_relaunch_without_first() -> None:
    """seed-warm needs seed in the set, isa-check and streamer-copy need first; unknown names
    are refused; the default rows pass as they are."""
    assert parse_rows(",".join(DEFAULT_ROWS)) == DEFAULT_ROWS
    assert "seed-warm" in DEFAULT_ROWS
    assert "isa-check" in DEFAULT_ROWS
    assert "streamer-copy" not in DEFAULT_ROWS
    assert parse_rows(" seed , seed-warm ") == ("seed", "seed-warm")
    with pytest.raises(ValueError, match="seed-warm needs seed"):
        parse_rows("seed-warm,first")
    with pytest.raises(ValueError, match="isa-check, streamer-copy need first"):
        parse_rows("seed,isa-check,streamer-copy")
    with pytest.raises(ValueError, match="unknown warm"):
        parse_rows("seed,warm")


def test_a_bad_set_of_rows_or_a_cpu_option_on_cuda_stops_before_anything_starts(
    tmp_path: Path,
) -> None:
    """The command line's refusals exit 2 from the parser, before vLLM is looked for."""
    base = ["--model-dir", str(tmp_path), "--vllm", str(tmp_path / "no-vllm")]
    with pytest.raises(SystemExit) as refused:
        main([*base, "--rows", "seed-warm"])
    assert refused.value.code == 2
    with pytest.raises(SystemExit) as refused:
        main([*base, "--device", "cuda", "--kv-cache-gib", "2"])
    assert refused.value.code == 2


def test_a_missing_vllm_on_cuda_says_to_install_a_cuda_build_beforehand(tmp_path: Path) -> None:
    """No vLLM at the path given: the message says the GPU machine has no network and how
    to install one; a name found on PATH (or a path) is returned as a path."""
    with pytest.raises(SystemExit) as missing:
        find_vllm(str(tmp_path / "vllm"), "cuda")
    message = str(missing.value.code)
    assert "no network" in message
    assert "'vllm[runai]==0.16.0'" in message
    assert str(tmp_path / "vllm") in message
    assert find_vllm(sys.executable, "cpu") == Path(sys.executable)


def test_the_warm_restart_runs_the_seed_recipe_and_streamer_copy_loads_the_node_copy(
    tmp_path: Path,
) -> None:
    """seed-warm is the seed's own command line; streamer-copy puts the streamer after
    {model} in prewarm exec's engine command; neither adds anything on the CPU."""
    setup = _setup(tmp_path)
    seed = _command(setup, Launch(1, "seed", "no agent"), 8000)
    assert _command(setup, Launch(1, "seed-warm", "no agent"), 8000) == seed
    assert seed[:5] == ["/venv/bin/vllm", "serve", "s3://models/llama/", *STREAMER]
    copy = _command(setup, Launch(1, "streamer-copy", "node 1"), 8000)
    engine = copy[copy.index("--") + 1 :]
    assert engine[:5] == ["/venv/bin/vllm", "serve", "{model}", *STREAMER]
    relaunch = _command(setup, Launch(1, "relaunch", "node 1"), 8000)
    assert "--load-format" not in relaunch
    assert "--gpu-memory-utilization" not in relaunch


def test_on_cuda_every_launch_gets_the_gpu_memory_share_and_no_cpu_kv_cache(
    tmp_path: Path,
) -> None:
    """--device cuda: --gpu-memory-utilization before the arguments given (so they can
    override it), and no VLLM_CPU_KVCACHE_SPACE in the pod's environment."""
    cuda = _setup(tmp_path, "cuda")
    argv = _command(cuda, Launch(1, "seed", "no agent"), 8000)
    share = argv.index("--gpu-memory-utilization")
    assert argv[share + 1] == "0.85"
    assert share < argv.index("--block-size")
    pod = Pod(home=tmp_path / "h", tmp=tmp_path / "t", cache=tmp_path / "c")
    assert "VLLM_CPU_KVCACHE_SPACE" not in _pod_env(cuda, None, pod)
    assert _pod_env(_setup(tmp_path), None, pod)["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_the_warm_restart_is_a_new_pod_given_the_seed_pods_compile_caches(
    tmp_path: Path,
) -> None:
    """seed-warm: fresh HOME and TMPDIR, the seed pod's VLLM_CACHE_ROOT, and inductor's and
    Triton's caches where the seed pod's engine left them by default."""
    seed, none = _new_pod(tmp_path, 1, "seed")
    assert none == {}
    inductor = seed.tmp / "torchinductor_someone"
    inductor.mkdir()
    (seed.home / ".triton" / "cache").mkdir(parents=True)
    warm, caches = _new_pod(tmp_path, 1, "seed-warm")
    assert warm.cache == seed.cache
    assert warm.home != seed.home
    assert warm.tmp != seed.tmp
    assert warm.home.is_dir()
    assert warm.tmp.is_dir()
    assert caches == {
        "TORCHINDUCTOR_CACHE_DIR": str(inductor),
        "TRITON_CACHE_DIR": str(seed.home / ".triton" / "cache"),
    }
    # A seed pod that wrote no Triton cache: TRITON_CACHE_DIR stays unset.
    other, _ = _new_pod(tmp_path, 2, "seed")
    assert engine_default_caches(other) == {}


def test_the_report_holds_prewarms_relaunches_against_the_engines_warm_restart() -> None:
    """relaunch and isa-check each get a line against seed-warm of the same set; nothing
    without a seed-warm that was ready; the device heads the report."""
    launches = [
        Launch(1, "seed", "no agent", ready_seconds=300.0),
        Launch(1, "seed-warm", "no agent", ready_seconds=200.0),
        Launch(1, "first", "node 1", ready_seconds=250.0),
        Launch(1, "relaunch", "node 1", ready_seconds=150.0),
        Launch(1, "isa-check", "node 1", ready_seconds=100.0),
        Launch(2, "seed", "no agent", ready_seconds=300.0),
        Launch(2, "seed-warm", "no agent"),
        Launch(2, "relaunch", "node 1", ready_seconds=150.0),
    ]
    assert against_warm_restart(launches) == [
        "set 1: relaunch through prewarm exec 150.0 s vs the engine's own warm restart "
        "200.0 s (75 % of it)",
        "set 1: isa-check through prewarm exec 100.0 s vs the engine's own warm restart "
        "200.0 s (50 % of it)",
    ]
    report = _report(launches, "**device: cuda**, vLLM /venv/bin/vllm")
    assert report.startswith("**device: cuda**, vLLM /venv/bin/vllm\n")
    assert "- set 1: relaunch through prewarm exec 150.0 s" in report
