"""``prewarm`` run in the test's own process, and the list of its commands.

Most CLI tests are about what a command says and which status it ends with, not
about the process it runs in: they call the typer app here (typer's CliRunner)
against the real daemon over its real Unix socket, and save an interpreter's
start per command. What a real process would also have written past
``sys.stdout`` and ``sys.stderr`` is kept: file descriptors 1 and 2 are captured
too, so grpc's C core logging on stderr and the output of a command ``prewarm
exec`` runs count as the process's own output. Tests about the process itself
(signals, another user, the entry point) still run ``python -m agent.cli``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup
from typer.testing import CliRunner

from agent.cli import app

__all__ = [
    "Ran",
    "app_command",
    "argv_of",
    "every_command",
    "prewarm_in_process",
    "run_every_command",
]

# What `prewarm exec` sets up for the life of its process, restored after each call here.
_EXEC_LOGGERS = ("agent.client.leases",)


@dataclass(frozen=True)
class Ran:
    """One ``prewarm`` command's exit status and output, as a process would have left them."""

    returncode: int
    stdout: str
    stderr: str


def prewarm_in_process(
    *args: str, socket: Path | None = None, env: Mapping[str, str] | None = None
) -> Ran:
    """``prewarm ARGS`` in this process: no PREWARM_* variable but ``env``'s (and
    PREWARM_SOCKET_PATH=``socket`` when given), an empty stdin, as ``python -m agent.cli``
    would run it. An exception the CLI does not turn into a status (a bug, a traceback in
    a real process) is raised here."""
    overrides: dict[str, str | None] = {k: None for k in os.environ if k.startswith("PREWARM_")}
    if socket is not None:
        overrides["PREWARM_SOCKET_PATH"] = str(socket)
    overrides.update(env or {})
    with (
        _loggers_kept(_EXEC_LOGGERS),
        _descriptor_captured(1) as out,
        _descriptor_captured(2) as err,
        CliRunner().isolation(env=overrides) as (stdout, stderr, _),
    ):
        try:
            # What app(prog_name="prewarm") in agent.cli.main calls, the command built once.
            app_command().main(args=list(args), prog_name="prewarm")
            code = 0
        except SystemExit as exc:
            code = _status(exc.code)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            said = _text(stdout.getvalue()), _text(stderr.getvalue())
    return Ran(code, said[0] + out.text, said[1] + err.text)


def _status(code: object) -> int:
    """The exit status the interpreter gives ``sys.exit(code)``."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _text(data: bytes) -> str:
    return data.decode(errors="backslashreplace")


@functools.cache
def app_command() -> TyperGroup:
    """The app as the click command ``agent.cli.main`` runs (building it takes ~0.3 s)."""
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    return group


class _Captured:
    """What reached one file descriptor inside the block (``text``, set once it ended)."""

    text = ""


@contextlib.contextmanager
def _descriptor_captured(fd: int) -> Iterator[_Captured]:
    """File descriptor ``fd`` pointed at a file of its own inside the block."""
    captured = _Captured()
    (sys.stdout if fd == 1 else sys.stderr).flush()
    with tempfile.TemporaryFile() as file:
        saved = os.dup(fd)
        os.dup2(file.fileno(), fd)
        try:
            yield captured
        finally:
            os.dup2(saved, fd)
            os.close(saved)
        file.seek(0)
        captured.text = _text(file.read())


@contextlib.contextmanager
def _loggers_kept(names: Sequence[str]) -> Iterator[None]:
    """The named loggers' handlers and propagation as they were before the block."""
    loggers = [logging.getLogger(name) for name in names]
    saved = [(logger.handlers[:], logger.propagate) for logger in loggers]
    try:
        yield
    finally:
        for logger, (handlers, propagate) in zip(loggers, saved, strict=True):
            logger.handlers[:] = handlers
            logger.propagate = propagate


# --- every command of the app -------------------------------------------------------------

# A value each argument accepts before any call: a URI where one is asked for, a whole
# compile-cache key (it is a snapshot key prefix too) elsewhere, a command for `exec`.
_URI = "s3://models/llama/"
_KEY = "0123456789abcdef0123456789abcdef"
_COMMAND = "true"


def _leaves(command: object, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    if isinstance(command, TyperGroup):
        for name, sub in sorted(command.commands.items()):
            yield from _leaves(sub, (*path, name))
    else:
        yield path


def _command(path: Sequence[str]) -> TyperCommand:
    command: object = app_command()
    for name in path:
        assert isinstance(command, TyperGroup)
        command = command.commands[name]
    assert isinstance(command, TyperCommand)
    return command


def every_command() -> list[tuple[str, ...]]:
    """Every leaf command of ``prewarm``, as its words: ("ls",), ("compile", "push")..."""
    return list(_leaves(app_command(), ()))


def argv_of(path: Sequence[str], socket_path: Path) -> list[str]:
    """``PATH --socket SOCKET -- ARGS``, each argument given a value it accepts."""
    values: list[str] = []
    for parameter in _command(path).params:
        if not isinstance(parameter, TyperArgument):
            continue
        if parameter.nargs == -1:
            values.append(_COMMAND)
        else:
            values.append(_URI if parameter.name == "uri" else _KEY)
    return [*path, "--socket", str(socket_path), "--", *values]


def run_every_command(socket_path: Path) -> dict[str, tuple[int, str]]:
    """Each command's (exit status, stderr) on ``socket_path``, one after another in this
    process; PREWARM_WAIT_FOR_AGENT=0, or `exec` would wait a minute for a missing socket."""
    ran: dict[str, tuple[int, str]] = {}
    for path in every_command():
        done = prewarm_in_process(*argv_of(path, socket_path), env={"PREWARM_WAIT_FOR_AGENT": "0"})
        ran[" ".join(path)] = (done.returncode, done.stderr)
    return ran
