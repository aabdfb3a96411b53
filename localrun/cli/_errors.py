"""Turn errors into one line plus a hint. The only place errors become text."""

from __future__ import annotations

import os
import sys
from typing import Any

import typer

from localrun.errors import LocalrunError

DEBUG_ENV = "LOCALRUN_DEBUG"


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0", "false", "no")


def report(exc: BaseException) -> int:
    """Print ``exc`` for a person; return the exit code."""
    if isinstance(exc, LocalrunError):
        sys.stderr.write(f"error: {exc.message}\n")
        if exc.hint:
            sys.stderr.write(f"  hint: {exc.hint}\n")
        return exc.exit_code
    if isinstance(exc, UnicodeError):
        from localrun.cli._input import CONVERT, unicode_error_message

        line = unicode_error_message(exc)
        if line is not None:  # the user's bytes, wherever they surfaced: not a bug
            sys.stderr.write(f"error: {line}\n  hint: convert the text to UTF-8 first, "
                             f"e.g. {CONVERT} FILE\n")
            return 1
    sys.stderr.write(f"error: unexpected {type(exc).__name__}: {exc}\n"
                     f"  hint: this is a bug in localrun; run again with {DEBUG_ENV}=1 "
                     "to see the traceback and report it\n")
    return 70


#: click's error for a command line it could not parse (typer's copy of click from 0.22,
#: click itself before): the base class of typer.BadParameter.
CLICK_ERROR: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def is_usage_error(exc: BaseException) -> bool:
    return isinstance(exc, CLICK_ERROR)


def usage_error(exc: Any) -> int:
    """A command line click could not parse (an unknown flag, a missing argument, a bad
    value): one line, and where the command's flags are listed; click's exit code (2).
    With no arguments at all, the help has been printed already: nothing to add."""
    if type(exc).__name__ == "NoArgsIsHelpError":
        return int(exc.exit_code)
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    path = ctx.command_path if ctx is not None else "localrun"
    sys.stderr.write(f"error: {message}\n  hint: {path} --help lists its "
                     f"{'commands' if path == 'localrun' else 'arguments and flags'}\n")
    return int(exc.exit_code)
