"""``prewarm-csi`` (``python -m agent.csi``): the CSI node plugin, until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from agent._config import ConfigError, Settings, load_settings
from agent._exceptions import PrewarmError
from agent.csi.node import serving_csi
from agent.obs.logs import configure_logging

log = logging.getLogger("agent.csi")


async def _serve(settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with serving_csi(settings):
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    """Serve the CSI plugin with the agent's config file ([csi] and [access])."""
    parser = argparse.ArgumentParser(prog="prewarm-csi", description=__doc__)
    parser.add_argument("--config", type=Path, help="the agent's config file")
    parser.add_argument("--endpoint", type=Path, help="the plugin socket (default: [csi].endpoint)")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"prewarm-csi: {exc}", file=sys.stderr)
        return 2
    if args.endpoint is not None:
        settings.csi.endpoint = args.endpoint
    configure_logging(settings.log_level)
    try:
        asyncio.run(_serve(settings))
    except PrewarmError as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
