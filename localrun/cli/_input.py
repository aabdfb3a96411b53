"""Text a person hands the CLI (stdin, arguments, typed lines) must be UTF-8.

Bytes that are not UTF-8 arrive in two ways: read strictly they raise
UnicodeDecodeError; read the way Python reads argv (and stdin in the C locale, with
``surrogateescape``) they become lone surrogates ("caf\\udce9") that only fail later,
deep in a tokenizer, as UnicodeEncodeError. Both become one error here that names the
byte, where it is, and how to convert the text.
"""

from __future__ import annotations

import sys

from localrun.errors import LocalrunError

#: How to turn the most common non-UTF-8 text (Latin-1 / Windows-1252) into UTF-8.
CONVERT = "iconv -f latin1 -t utf-8"


def bad_byte_message(source: str, data: bytes, start: int) -> str:
    """``<source> is not UTF-8 text: byte 0xE9 at offset 3 (in b'caf\\xe9')``."""
    lo = max(0, start - 12)
    return (f"{source} is not UTF-8 text: byte 0x{data[start]:02X} at offset {start} "
            f"(in {data[lo:start + 4]!r})")


def decode(data: bytes, source: str, hint: str) -> str:
    """``data`` as UTF-8 text, or a LocalrunError naming the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LocalrunError(bad_byte_message(source, data, e.start), hint=hint) from None


def read_stdin(hint: str) -> str:
    """All of stdin as UTF-8 text, read as bytes so no locale setting can garble it."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text-only stream (an embedding program's): already decoded
        text = sys.stdin.read()
        check_text("stdin", text, hint)
        return text
    return decode(buffer.read(), "The text on stdin", hint)


def check_text(source: str, text: str, hint: str) -> None:
    """Refuse text holding lone surrogates, i.e. bytes that were not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        try:
            data = text.encode("utf-8", "surrogateescape")
            start = len(text[: e.start].encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:  # a surrogate that no byte produced (e.g. from JSON)
            raise LocalrunError(
                f"{source} holds {text[e.start]!r} at character {e.start}, which is not "
                "a Unicode character (a lone surrogate)", hint=hint) from None
        raise LocalrunError(bad_byte_message(source, data, start), hint=hint) from None


def unicode_error_message(exc: UnicodeError) -> str | None:
    """The one line for a stray UnicodeError caused by non-UTF-8 input, or None."""
    if isinstance(exc, UnicodeEncodeError) and "surrogate" in exc.reason:
        bad = exc.object[exc.start: exc.end]
        return (f"the input holds {bad!r}: bytes that are not UTF-8 text "
                "(from an argument, stdin or a file)")
    return None
