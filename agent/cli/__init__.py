"""``prewarm``: the command line for people on the node (``prewarm --help``)."""

from ._app import app

__all__ = ["app", "main"]


def main() -> None:
    """Entry point of the ``prewarm`` script."""
    app(prog_name="prewarm")
