"""Structured logs: one JSON object per line on stderr (journald keeps them as-is)."""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["configure_logging"]

# Attributes every LogRecord has; anything else was passed with extra= and is logged too.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        document.update(
            {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
        )
        if record.exc_info:
            document["exc"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # botocore and aiohttp are chatty at debug; their warnings still come through.
    for noisy in ("botocore", "aiobotocore", "aiohttp", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, root.level))
