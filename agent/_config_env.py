"""The PREWARM_* environment as the settings read it: which names exist, and what went wrong.

pydantic-settings ignores a variable that names no setting, so a typo such as
``PREWARM_METRICS_PORT`` (one underscore where nested keys take two) changes
nothing without a word; and it raises its own ``SettingsError`` with a
traceback when a list or table in a variable is not JSON. This module names the
intended variable for the first and writes a sentence for the second.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping

from pydantic import BaseModel

__all__ = [
    "ENV_PREFIX",
    "NESTED_DELIMITER",
    "NOT_SETTINGS",
    "settings_env_names",
    "unknown_env_vars",
]

ENV_PREFIX = "PREWARM_"
NESTED_DELIMITER = "__"

# PREWARM_* variables that are not settings of the daemon, and who reads them.
NOT_SETTINGS = frozenset(
    {
        "PREWARM_CONFIG",  # the config file's path (prewarmd)
        "PREWARM_CLIENT_NAME",  # prewarm exec --name
        "PREWARM_CACHED_ONLY",  # prewarm pull/exec --cached-only
        "PREWARM_AS_REQUESTER",  # prewarm pull/exec --as-requester
        "PREWARM_WAIT_FOR_AGENT",  # prewarm exec/health --wait-for-agent
        "PREWARM_KEY_IGNORE",  # prewarm exec --key-ignore
        "PREWARM_TEST_CRASH_AT",  # tests only: where the daemon kills itself
    }
)


def settings_env_names(model: type[BaseModel], prefix: str = ENV_PREFIX) -> Iterator[str]:
    """Every variable that sets a field of ``model``: tables too, and each key inside them."""
    for name, field in model.model_fields.items():
        env_name = f"{prefix}{name.upper()}"
        yield env_name
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from settings_env_names(annotation, env_name + NESTED_DELIMITER)


def unknown_env_vars(model: type[BaseModel], environ: Mapping[str, str]) -> list[str]:
    """A sentence for each PREWARM_* variable that no setting reads, naming the likely one."""
    known = set(settings_env_names(model)) | NOT_SETTINGS
    sentences = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known:
            continue
        sentences.append(f"{name} is not a prewarm setting and is ignored{_hint(upper, known)}")
    return sentences


def _hint(name: str, known: set[str]) -> str:
    # One underscore where a nested key needs two is the usual slip; try that first.
    doubled = [
        candidate
        for candidate in known
        if NESTED_DELIMITER in candidate and candidate.replace(NESTED_DELIMITER, "_") == name
    ]
    close = doubled or difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
    if close:
        return f"; did you mean {close[0]}? (nested keys take two underscores)"
    return (
        "; the settings are in the README's configuration table (nested keys take two "
        "underscores: PREWARM_S3__REGION)"
    )
