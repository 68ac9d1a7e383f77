"""Where a launch went: the engine's own lines read on their way through, counted by the agent.

The log is fed by real child processes (a Python one-liner printing what vLLM 0.16
prints); the agent's side runs in process on the in-memory source. The whole path
(the real ``prewarm exec``, the real daemon, its metrics endpoint) is in
test_compile_launches.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from compile_helpers import BUCKET
from compile_helpers import compile_node as node

from agent._exceptions import InvalidRequest
from agent._vocabulary import check_launch_phases
from agent.cli._launch_phases import LaunchLog, describe_phases
from agent.compile.keys import CompileKeyParts, compile_key
from agent.obs.metrics import ENGINE_LAUNCH_SECONDS
from agent.testing import MemorySource

VLLM_RELAUNCH = (
    "INFO [default_loader.py:294] Loading weights took 1.02 seconds",
    "INFO [gpu_model_runner.py:4222] Model loading took 1.9 GiB memory and 1.400000 seconds",
    "INFO [backends.py:268] Directly load the compiled graph(s) for compile range (1, 8192)",
    "INFO [monitor.py:35] torch.compile takes 5.50 s in total",
    "INFO [core.py:279] init engine (profile, create kv cache, warmup model) took 20.00 seconds",
)


def _run_through(log: LaunchLog, lines: tuple[str, ...], *, stderr_text: str = "") -> None:
    """A child printing ``lines`` on stdout (and ``stderr_text`` on stderr), through ``log``."""
    printed = "\n".join(lines)
    script = f"import sys\nprint({printed!r})\nsys.stderr.write({stderr_text!r})\n"
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    log.start(child)
    assert child.wait(timeout=60) == 0
    log.drain()


def test_vllm_start_up_lines_become_phases_and_pass_through_untouched(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """vLLM's weights, compile (from the cache) and init-engine lines give the phases; the
    rest of ready is start-up; the child's stdout and stderr reach ours byte for byte."""
    log = LaunchLog()
    _run_through(log, VLLM_RELAUNCH, stderr_text="a warning\n")
    phases = log.phases(ready=30.0)
    assert phases == {
        "ready": 30.0,
        "weights": 1.02,
        "compile": 5.5,
        "kv_cache_and_warmup": 14.5,
        "start_and_rest": 8.6,
    }
    assert log.compile_loaded
    out, err = capfd.readouterr()
    assert out == "\n".join(VLLM_RELAUNCH) + "\n"
    assert err == "a warning\n"
    assert describe_phases(phases, compile_loaded=True) == (
        "ready in 30.0 s: weights 1.0 s, compile 5.5 s (loaded from the cache), "
        "KV cache and warm-up 14.5 s, start-up and the rest 8.6 s"
    )


def test_an_engine_that_prints_no_start_up_line_gets_ready_alone(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Output with none of the lines (and one far longer than a line is read) leaves only
    the time to ready, said as such; nothing is lost on the way through."""
    log = LaunchLog()
    long_line = "x" * 100_000
    _run_through(log, ("starting", long_line, "torch.compile takes lots of time"))
    phases = log.phases(ready=12.5)
    assert phases == {"ready": 12.5}
    assert not log.compile_loaded
    out, _ = capfd.readouterr()
    assert long_line in out
    assert describe_phases(phases) == (
        "ready in 12.5 s (the engine printed none of the start-up lines this launcher reads)"
    )


@pytest.mark.parametrize(
    ("phases", "said"),
    [
        ({"weights": -1.0}, "not a duration"),
        ({"weights": float("nan")}, "not a duration"),
        ({"compile": 1e9}, "not a duration"),
        ({"\x1b]8;;evil\x07": 1.0}, "is not a launch phase"),
    ],
)
def test_launch_phases_a_client_sends_are_checked(phases: dict[str, float], said: str) -> None:
    """A phase that is not one, or a value that is no duration, is refused by name."""
    with pytest.raises(InvalidRequest, match=said) as refused:
        check_launch_phases(phases)
    assert "\x1b" not in str(refused.value)


async def test_the_agent_counts_each_phase_for_the_engine_and_refuses_bad_ones(
    tmp_path: Path,
) -> None:
    """A launch reported ready with its phases adds one observation per phase under the
    key's engine; a report with a bad phase is refused before anything is judged."""
    parts = CompileKeyParts(engine="vllm", torch_version="2.13.0", model_key="phases")
    key = compile_key(parts)
    counted = ENGINE_LAUNCH_SECONDS.labels("vllm", "compile")
    before = counted._sum.get()
    async with node(tmp_path, MemorySource(objects={BUCKET: {}})) as caches:
        await caches.ensure(parts, publish_on_ready=True)
        with pytest.raises(InvalidRequest, match="is not a launch phase"):
            await caches.ready(key, "pod-a", launch_phases={"bogus": 1.0})
        await caches.ready(key, "pod-a", launch_phases={"ready": 30.0, "compile": 5.5})
    assert counted._sum.get() == pytest.approx(before + 5.5)
