"""Keys typed while a chat reply streams (issue 25, item 5): not echoed, kept for the next
line, the terminal restored on every way out. On a real pseudo-terminal; the whole chat
is driven in tests/test_cli.py::test_chat_interactive_session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from localrun.cli._typeahead import TypeAhead, edited

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="termios: POSIX terminals")


@pytest.mark.parametrize(("typed", "line"), [
    ("hello", "hello"),
    ("helo\x7flo", "hello"),  # Backspace (DEL)
    ("wrong\x15right", "right"),  # Ctrl-U: the line so far
    ("one two\x17three", "one three"),  # Ctrl-W: the word before
    ("up\x1b[Aand\x1b[D away", "upand away"),  # arrow keys are not text
    ("first line\nsecond\tline\n", "first line second line"),  # one line, not sent
    ("\x04\x01ok\x07", "ok"),  # other control keys go
    ("naïve café", "naïve café"),
])
def test_edited(typed: str, line: str) -> None:
    assert edited(typed) == line


@pytest.fixture
def pty_pair() -> Iterator[tuple[int, int]]:
    import pty

    master, slave = pty.openpty()
    yield master, slave
    os.close(master)
    os.close(slave)


def _modes(fd: int) -> tuple[bool, bool]:
    import termios

    lflag = termios.tcgetattr(fd)[3]
    return bool(lflag & termios.ECHO), bool(lflag & termios.ICANON)


def test_keys_are_not_echoed_and_come_back(pty_pair: tuple[int, int]) -> None:
    import select

    master, slave = pty_pair
    assert _modes(slave) == (True, True)
    with TypeAhead(slave) as keys:
        assert _modes(slave) == (False, False)
        os.write(master, b"next questiom\x7fn?")
        select.select([slave], [], [], 5)
    assert keys.text == "next question?"
    assert _modes(slave) == (True, True)
    ready, _, _ = select.select([master], [], [], 0.2)
    assert not ready, "the keys were echoed"


def test_the_terminal_is_restored_when_the_reply_is_interrupted(
        pty_pair: tuple[int, int]) -> None:
    master, slave = pty_pair
    with pytest.raises(KeyboardInterrupt), TypeAhead(slave):
        os.write(master, b"abc")
        raise KeyboardInterrupt
    assert _modes(slave) == (True, True)


def test_not_a_terminal_is_left_alone() -> None:
    r, w = os.pipe()
    try:
        os.write(w, b"piped")
        with TypeAhead(r) as keys:
            pass
        assert keys.text == "" and os.read(r, 10) == b"piped"
    finally:
        os.close(r)
        os.close(w)
