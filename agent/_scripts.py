"""The ``prewarmd`` and ``prewarm`` console scripts, which say which extra they need.

Every install of the distribution gets both scripts, but its base is the pod's
client (grpcio and protobuf): the daemon's dependencies come with the
``daemon`` extra and the command's with ``cli``. Run without them, a script
names the extra to install instead of dying in an import traceback.
"""

from __future__ import annotations

import sys
from typing import NoReturn

__all__ = ["DISTRIBUTION", "prewarm", "prewarm_csi", "prewarmd"]

DISTRIBUTION = "prewarm-agent"

# Top-level modules each extra provides (see pyproject.toml); a missing one of these is
# an install without the extra, anything else missing is a bug and keeps its traceback.
_CLI_MODULES = frozenset({"typer", "click", "rich", "grpc_health", "watchfiles"})
_DAEMON_MODULES = _CLI_MODULES | {
    "aiobotocore",
    "botocore",
    "aiohttp",
    "grpc_reflection",
    "prometheus_client",
    "pydantic",
    "pydantic_settings",
    "xxhash",
    "zstandard",
}


def prewarmd() -> NoReturn:
    """Entry point of ``prewarmd``: the node agent."""
    try:
        from agent._daemon import exit_with, main
    except ModuleNotFoundError as exc:
        _missing_extra(exc, "prewarmd", "daemon", _DAEMON_MODULES)
    exit_with(main())


def prewarm_csi() -> NoReturn:
    """Entry point of ``prewarm-csi``: the CSI node plugin (the daemon's extra)."""
    try:
        from agent.csi.__main__ import main
    except ModuleNotFoundError as exc:
        _missing_extra(exc, "prewarm-csi", "daemon", _DAEMON_MODULES)
    sys.exit(main())


def prewarm() -> NoReturn:
    """Entry point of ``prewarm``: the command line for pods and people on the node."""
    try:
        from agent.cli import main
    except ModuleNotFoundError as exc:
        _missing_extra(exc, "prewarm", "cli", _CLI_MODULES)
    main()
    sys.exit(0)


def _missing_extra(
    exc: ModuleNotFoundError, script: str, extra: str, provided: frozenset[str]
) -> NoReturn:
    if (exc.name or "").partition(".")[0] not in provided:
        raise exc
    sys.stderr.write(
        f"{script}: this install has no {exc.name} ({script} needs the {extra!r} extra): "
        f"pip install '{DISTRIBUTION}[{extra}]', or install the wheel with it "
        f"('dist/prewarm_agent-<version>-py3-none-any.whl[{extra}]').\n"
    )
    sys.exit(2)
