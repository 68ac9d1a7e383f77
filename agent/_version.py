"""The version of the installed distribution, ``prewarm-agent``.

setuptools-scm derives it from the git tag (``v0.2.0`` → ``0.2.0``; commits after
a tag → ``0.2.1.devN+g<hash>``) when the distribution is built or installed, and
from ``fallback_version`` in pyproject.toml for a tree without git (a copied
checkout, a container build). Reading it from the installed metadata, rather
than a file setuptools-scm writes, keeps an editable install's ``--version``
equal to what pip installed, with nothing generated inside the package.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["DISTRIBUTION", "UNKNOWN_VERSION", "__version__"]

DISTRIBUTION = "prewarm-agent"

# Imported from a checkout that was never installed (PYTHONPATH=.): no metadata
# to read, and a made-up release number would be a lie. "0+unknown" sorts below
# every release.
UNKNOWN_VERSION = "0+unknown"


def _installed_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return UNKNOWN_VERSION


__version__ = _installed_version()
