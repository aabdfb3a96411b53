"""Turn errors into one line plus a hint. The only place errors become text."""

from __future__ import annotations

import os
import sys

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
