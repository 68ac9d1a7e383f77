"""Structured logs: one JSON object per line on stderr (journald keeps them as-is).

Lines logged while a request is handled carry that request's fields (``uri``,
``key``, ``peer``, ``client``, ``method``): the API binds them with
``bind_request`` in the request's own context (grpc.aio runs each RPC in its
own contextvars.Context), and ``RequestContextFilter`` copies them onto every
record, so a module deep below the API never has to pass them along. Fields a
call gives explicitly with ``extra=`` win over the bound ones.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["RequestContextFilter", "bind_request", "configure_logging", "request_fields"]

# Attributes every LogRecord has; anything else was passed with extra= and is logged too.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message"}

_EMPTY: Mapping[str, str] = MappingProxyType({})
_REQUEST: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "prewarm_request", default=_EMPTY
)


def bind_request(**fields: str) -> None:
    """Add fields to every log line of the current request (empty values are skipped).

    Binds in the current context: the rest of the request (and tasks it
    creates, which copy the context) sees them; other requests do not.
    """
    new = {name: value for name, value in fields.items() if value}
    if new:
        _REQUEST.set(MappingProxyType({**_REQUEST.get(), **new}))


def request_fields() -> Mapping[str, str]:
    """The fields bound to the current request so far."""
    return _REQUEST.get()


class RequestContextFilter(logging.Filter):
    """Copies the current request's bound fields onto each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Add the bound fields a record does not set itself; never drops a record."""
        for name, value in _REQUEST.get().items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


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
    """Send every logger's records to stderr as JSON lines, at ``level`` and above."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    # On the handler, not a logger: records from every logger pass through it.
    handler.addFilter(RequestContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # botocore and aiohttp are chatty at debug, and watchfiles logs every change
    # at info; their warnings still come through.
    for noisy in ("botocore", "aiobotocore", "aiohttp", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, root.level))
    logging.getLogger("watchfiles").setLevel(max(logging.WARNING, root.level))
