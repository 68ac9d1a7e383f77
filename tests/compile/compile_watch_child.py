"""Compile caches at the inotify watch limit, run by test_compile_watch_limits in a child.

argv: ROOT LIMIT. Run inside a user namespace of its own (``unshare -U -r``), where it
lowers ``/proc/sys/user/max_inotify_watches`` to LIMIT: the limit counts for this
namespace only, so the rest of the machine keeps its watches. Then, as the issue's attack
did: one pod fills its key directory with twice LIMIT directories (each one a watch),
after which another pod's new key gets its artifacts. Prints one JSON line: whether the
victim's artifacts (written once its key had settled empty, as a compile's are)
were uploaded within 30 s, the agent's error lines, and the watch-limit metric.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

from compile_helpers import ManifestWrites
from store_helpers import open_store

from agent._config import CompileCacheSettings, Settings, TierSettings
from agent.compile.cache import CompileCaches
from agent.compile.keys import CompileKeyParts
from agent.obs.metrics import REGISTRY
from agent.testing import shared_keys

BUCKET = "caches"
ATTACKER = CompileKeyParts(torch_version="2.13.0", model_key="attacker")
VICTIM = CompileKeyParts(torch_version="2.13.0", model_key="victim")


class Log(logging.Handler):
    """The agent's error lines, and an event per key whose settled directory held nothing."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.errors: list[str] = []
        self.settled_empty: dict[str, asyncio.Event] = {}

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if record.levelno >= logging.ERROR:
            self.errors.append(line)
        if line.endswith("not uploaded: no artifacts yet"):
            for key, event in self.settled_empty.items():
                if key in line:
                    event.set()


async def main(root: Path, limit: int) -> dict[str, object]:
    log = Log()
    logging.getLogger().addHandler(log)
    logging.getLogger("agent.compile").setLevel(logging.DEBUG)
    source = ManifestWrites(objects={BUCKET: {}})
    store = await open_store(root)
    keys = shared_keys()
    settings = Settings(
        tiers=TierSettings(shm_root=root / "shm", disk_root=root / "disk"),
        compile_cache=CompileCacheSettings(
            uri=f"s3://{BUCKET}/cc",
            quiet_seconds=0.5,
            signing_key=keys.private,
            trusted_keys=[keys.trusted],
        ),
    )
    async with CompileCaches(settings, store, source) as caches:
        attacker = await caches.ensure(ATTACKER)
        for number in range(2 * limit):
            (attacker.info.path / "inductor" / f"d{number}").mkdir()
        victim = await caches.ensure(VICTIM)
        # As a real compile does: the key settles empty first, its kernels come later.
        settled = log.settled_empty.setdefault(victim.info.key, asyncio.Event())
        try:
            async with asyncio.timeout(60):
                await settled.wait()
            kernel = victim.info.path / "inductor" / "ab" / "kernel.so"
            kernel.parent.mkdir()
            kernel.write_bytes(b"compiled" * 1024)
            async with asyncio.timeout(30):
                await source.manifests(1)
        except TimeoutError:
            pass
    return {
        "victim_uploaded": f"cc/node/{victim.info.key}/manifest.json" in source.objects[BUCKET],
        "errors": log.errors,
        "watch_limit_metric": REGISTRY.get_sample_value("prewarm_compile_watch_limit_total"),
    }


if __name__ == "__main__":
    watch_limit = int(sys.argv[2])
    Path("/proc/sys/user/max_inotify_watches").write_text(f"{watch_limit}\n")
    print(json.dumps(asyncio.run(main(Path(sys.argv[1]), watch_limit))))
