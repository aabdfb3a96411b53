"""Keys typed while a chat reply streams: not echoed into the reply, kept for the prompt.

A terminal in its usual (canonical) mode echoes every key at once, so keys typed during
a reply land in the middle of it, and the line they form is then lost (readline starts
a fresh line; Ctrl-C flushes it). While a reply streams, :class:`TypeAhead` turns echo
and line editing off (keeping Ctrl-C, and keeping what was typed when it is pressed);
afterwards it reads what was typed, applies the editing keys (Backspace, Ctrl-U, Ctrl-W)
and restores the terminal, on every way out. :func:`prefill` puts the text on the next
input line, where it can be edited and sent with Enter; without readline it is dropped.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from types import TracebackType
from typing import Any

#: Escape sequences (arrow keys, function keys): no text.
_ESCAPE = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|O.|.)?", re.DOTALL)


def edited(typed: str) -> str:
    """The line ``typed`` leaves once its editing keys are applied; Enter and Tab become
    spaces (the text is put back on one line, not sent), other control keys go."""
    out: list[str] = []
    for ch in _ESCAPE.sub("", typed):
        if ch in "\x7f\b":
            if out:
                out.pop()
        elif ch == "\x15":  # Ctrl-U: the line so far
            out.clear()
        elif ch == "\x17":  # Ctrl-W: the word before the cursor
            while out and out[-1] == " ":
                out.pop()
            while out and out[-1] != " ":
                out.pop()
        elif ch in "\r\n\t":
            out.append(" ")
        elif ch >= " ":
            out.append(ch)
    return "".join(out).strip()


class TypeAhead:
    """``with TypeAhead(fd) as keys:`` around a streamed reply; ``keys.text`` afterwards.

    Does nothing (``text`` stays "") where ``fd`` is not a terminal or the platform has
    no termios.
    """

    def __init__(self, fd: int | None = None) -> None:
        self.fd = sys.stdin.fileno() if fd is None else fd
        self.text = ""
        self._saved: list[Any] | None = None

    def __enter__(self) -> TypeAhead:
        try:
            import termios
        except ImportError:
            return self
        if not os.isatty(self.fd):
            return self
        try:
            saved = termios.tcgetattr(self.fd)
            quiet = [*saved[:6], list(saved[6])]
            # No echo, no line editing (so the keys can be read without Enter), and no
            # flush of what was typed when Ctrl-C stops the reply.
            quiet[3] = (quiet[3] & ~(termios.ECHO | termios.ICANON)) | termios.NOFLSH
            quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 0, 0
            termios.tcsetattr(self.fd, termios.TCSANOW, quiet)
        except (termios.error, OSError):
            return self
        self._saved = saved
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._saved is None:
            return
        import termios

        typed = b""
        try:
            while len(typed) < 1 << 16:
                part = os.read(self.fd, 4096)  # VMIN 0: returns b"" once nothing is left
                if not part:
                    break
                typed += part
        except OSError:
            pass
        finally:
            with contextlib.suppress(termios.error, OSError):
                termios.tcsetattr(self.fd, termios.TCSANOW, self._saved)
            self._saved = None
        self.text = edited(typed.decode("utf-8", "replace"))


def prefill(text: str) -> bool:
    """Start the next ``input()`` line with ``text`` (readline only); False when it
    cannot, and the text is dropped."""
    if not text:
        return True
    try:
        import readline
    except ImportError:
        return False
    pending = [text]

    def hook() -> None:
        if pending:
            readline.insert_text(pending.pop())

    readline.set_startup_hook(hook)
    return True


def clear_prefill() -> None:
    """Stop :func:`prefill`'s hook (after the line it was for has been read)."""
    try:
        import readline
    except ImportError:
        return
    readline.set_startup_hook(None)
