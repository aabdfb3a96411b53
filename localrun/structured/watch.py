"""Stop a JSON reply that runs away: a string stuck in a loop, a number or blank run
that goes on.

The grammar bounds what it can (:mod:`localrun.structured.bounds`: numbers; llguidance:
no free whitespace), but a string is any text, and a small model greedy-decoding a
field can loop inside it (``"Paris Paris Paris ..."``, ``"aaaa..."``) until
``max_tokens``. :class:`JsonWatch` follows the reply as it streams, on every engine
(it reads the text the engine produced, not its logits), and reports a
:class:`Runaway` naming the field:

* a string (value or key) whose end repeats one unit back to back, by
  :func:`localrun.structured.repetition.find_cycle`'s rule (the chat loop guard's: a short unit 8
  times and 120 characters, a sentence 5 times);
* a number literal longer than :data:`MAX_NUMBER_CHARS` or a run of more than
  :data:`MAX_BLANKS` blanks between tokens (the grammar refuses both on llguidance;
  OpenVINO's XGrammar leaves: free-form values, long arrays, allow them).

Failed, not closed: the output layer then ends the reply as ``max_tokens`` would have,
only earlier (finish_reason ``"length"``), and the call raises
:class:`RunawayOutputError` naming the field, with the reply so far on
the error. Closing the string instead (forcing its quote) would need the engine's
logits, which OpenVINO does not expose, and would hand back a value that validates
but is the loop itself (the repeats are already streamed and cannot be taken back): a
caller would store ``"Paris Paris Paris ..."`` as a city. The error says what happened
and how to avoid it (sampling, ``repetition_penalty``, ``maxLength``/``enum``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from localrun.errors import IncompleteOutputError
from localrun.structured.repetition import MAX_PERIOD, MIN_CHARS, find_cycle

#: A number literal longer than this is runaway (an int64 is 20 characters, a bounded
#: decimal 26; a schema's own bounds up to 1e90 still fit).
MAX_NUMBER_CHARS = 100
#: Blanks between two tokens (indented JSON at depth 8 is 1 newline and 32 spaces).
MAX_BLANKS = 40
#: The end of a string that is searched for a cycle (the longest span find_cycle
#: compares: MAX_PERIOD characters, 8 times).
WINDOW = MAX_PERIOD * 8
#: A string is searched again once it has grown by this many characters (a loop is
#: caught a few tokens later)...
CHECK_EVERY = 16
#: ...and only when its last PROBE characters occur again within MAX_PERIOD before (one
#: C-level search; every loop passes it, ordinary text almost never).
PROBE = 16

_BLANKS = frozenset(" \t\n\r")
_NUMBER = frozenset("0123456789+-.eE")
_IDENT = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


@dataclass(frozen=True)
class Runaway:
    """What ran away, where (``$.address.city``, ``$.items[2]``) and how."""

    path: str
    detail: str

    def __str__(self) -> str:
        return f"{self.detail} at {self.path}"


class RunawayOutputError(IncompleteOutputError):
    """A value of a JSON reply ran away and localrun ended the reply there, as
    ``max_tokens`` would have later (finish_reason "length"). ``path`` names the value
    (``$.name``); ``completion`` holds what was generated. (Defined here, next to what
    raises it, while localrun/errors.py is at its 600-line limit; an
    :class:`~localrun.errors.IncompleteOutputError`, so whatever catches that catches
    this.)"""

    def __init__(self, completion: object, path: str, detail: str):
        self.path = path
        super().__init__(completion, "length", f"{detail} at {path}")
        self.message = (f"The reply was stopped at {path}: {detail}, a loop that would "
                        f"have run to max_tokens")
        self.args = (self.message,)
        self.hint = ("sample it (temperature > 0) or add repetition_penalty=1.2, reword the "
                     "prompt, or bound the field in the schema (maxLength, enum, pattern)")


class _Frame:
    __slots__ = ("index", "key", "kind", "want_key")

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "{" or "["
        self.key: str | None = None  # the object's current key
        self.want_key = kind == "{"  # the next string is a key
        self.index = 0  # the array's current item


class JsonWatch:
    """Feed it the JSON text as it streams; :meth:`feed` returns the first
    :class:`Runaway` (then it stops looking), or None."""

    def __init__(self) -> None:
        self._stack: list[_Frame] = []
        self._in_string = False
        self._escape = False
        self._is_key = False
        self._tail = ""  # the current string's last WINDOW characters (raw JSON)
        self._length = 0  # ...and its whole length
        self._checked = 0  # its length at the last cycle search
        self._number = 0  # characters of the current number literal
        self._blanks = 0  # blanks since the last token
        self.runaway: Runaway | None = None

    def feed(self, text: str) -> Runaway | None:
        if self.runaway is not None:
            return self.runaway
        i, n = 0, len(text)
        while i < n:
            if self._in_string:
                i = self._string(text, i)
                continue
            ch = text[i]
            i += 1
            if ch in _BLANKS:
                self._number = 0
                self._blanks += 1
                if self._blanks > MAX_BLANKS:
                    return self._stop(f"{self._blanks} blanks in a row")
                continue
            self._blanks = 0
            if ch in _NUMBER:
                self._number += 1
                if self._number > MAX_NUMBER_CHARS:
                    return self._stop(f"a number of more than {MAX_NUMBER_CHARS} "
                                      "characters")
                continue
            self._number = 0
            self._token(ch)
        return None

    # -- lexing ---------------------------------------------------------------------

    def _token(self, ch: str) -> None:
        top = self._stack[-1] if self._stack else None
        if ch == '"':
            self._in_string = True
            self._is_key = top is not None and top.kind == "{" and top.want_key
            self._tail, self._length, self._checked = "", 0, 0
        elif ch in "{[":
            self._stack.append(_Frame(ch))
        elif ch in "}]":
            if self._stack:
                self._stack.pop()
        elif ch == ":" and top is not None and top.kind == "{":
            top.want_key = False
        elif ch == "," and top is not None:
            if top.kind == "{":
                top.want_key = True
            else:
                top.index += 1

    def _string(self, text: str, i: int) -> int:
        """Consume string characters from ``text[i]``; the index after them."""
        start = i
        n = len(text)
        while i < n:
            if self._escape:
                self._escape = False
                i += 1
                continue
            q, b = text.find('"', i), text.find("\\", i)
            if b >= 0 and (q < 0 or b < q):  # an escape: skip it and what it escapes
                self._escape = True
                i = b + 1
                continue
            i = q if q >= 0 else n
            break
        chunk = text[start:i]
        if chunk:
            self._tail = (self._tail + chunk)[-WINDOW:]
            self._length += len(chunk)
            if self._length >= MIN_CHARS and self._length - self._checked >= CHECK_EVERY:
                self._checked = self._length
                cycle = find_cycle(self._tail) if self._recurs() else None
                if cycle is not None:
                    unit = cycle.unit if len(cycle.unit) <= 40 else cycle.unit[:37] + "..."
                    what = "key" if self._is_key else "string"
                    self._stop(f"the {what} repeats {unit!r} {cycle.repeats} times in a row")
                    return len(text)
        if i < n:  # the closing quote
            self._in_string = False
            if self._is_key and self._stack:
                self._stack[-1].key = _unescape(self._tail)
            return i + 1
        return i

    def _recurs(self) -> bool:
        """Whether the string's last PROBE characters occur in the MAX_PERIOD before them:
        a cycle of period p (p <= MAX_PERIOD, its repeats at least p + PROBE long) puts
        them p characters back."""
        tail = self._tail
        n = len(tail)
        return tail.find(tail[n - PROBE:], max(0, n - PROBE - MAX_PERIOD), n - 1) >= 0

    def _stop(self, detail: str) -> Runaway:
        self.runaway = Runaway(self.path(), detail)
        return self.runaway

    def path(self) -> str:
        """Where the text is now, as a JSONPath (``$`` for the top-level value)."""
        parts = ["$"]
        frames = self._stack
        for depth, f in enumerate(frames):
            if f.kind == "[":
                parts.append(f"[{f.index}]")
            elif f.key is not None and not (depth == len(frames) - 1 and f.want_key):
                key = f.key
                parts.append(f".{key}" if key and set(key) <= _IDENT else
                             f"[{json.dumps(key, ensure_ascii=False)}]")
        return "".join(parts)


def _unescape(raw: str) -> str:
    try:
        value = json.loads(f'"{raw}"')
    except ValueError:
        return raw
    return value if isinstance(value, str) else raw
