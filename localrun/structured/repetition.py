"""Spot a reply stuck repeating itself ("la Femme, la Femme, ...", or one sentence over
and over).

Small models loop: once a phrase or a sentence repeats a few times, its probability
climbs until it is all the model says, up to the token limit. The interactive chat uses
:func:`find_cycle` on the text streamed so far to stop such a reply early; the Python
API never does (it returns what the model generates).

A cycle counts only when it repeats back to back, character for character, enough times
for its length (:func:`repeats_needed`): a rule of ``-`` under a heading, "ha ha ha" or
the four rows of a small zero matrix are text; 12 times ``la Femme, `` is a loop, and so
is one whole sentence said five times in a row. Lists, tables and code repeat their
structure, not their characters, and are not cycles.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The longest repeating unit looked for, in characters: a sentence or two (a 20-token
#: sentence is about 100 characters).
MAX_PERIOD = 400
#: A short unit (up to LONG_UNIT characters) must repeat at least this many times back
#: to back (a few identical lines in a row, such as the rows of a small zero matrix,
#: are text)...
MIN_REPEATS = 8
#: ...and its repeats must cover at least this many characters.
MIN_CHARS = 120
#: Units longer than this are sentences, not phrases:
LONG_UNIT = 40
#: a sentence said this many times in a row is a loop (no text repeats a whole sentence
#: five times over; a model stuck on one does so up to its token limit),
LONG_MIN_REPEATS = 5
#: provided at least this share of it is letters (the rows of a wide zero matrix or a
#: table rule are long too, and keep the short units' rule).
LONG_MIN_LETTERS = 0.5
#: Characters compared at the end before a whole span is: almost every period fails here,
#: so a call costs about MAX_PERIOD short comparisons on ordinary text.
PROBE = 16


@dataclass(frozen=True)
class Cycle:
    """The end of a text is ``unit`` repeated ``repeats`` times, back to back."""

    unit: str
    repeats: int


def repeats_needed(period: int, *, min_repeats: int = MIN_REPEATS,
                   min_chars: int = MIN_CHARS) -> int:
    """Back-to-back repeats a unit of ``period`` characters needs to count as a loop
    (for a long unit, when it is mostly letters: :func:`find_cycle`)."""
    short = max(min_repeats, -(-min_chars // period))
    return min(short, LONG_MIN_REPEATS) if period > LONG_UNIT else short


def _wordy(unit: str) -> bool:
    return sum(ch.isalpha() for ch in unit) >= LONG_MIN_LETTERS * len(unit)


def find_cycle(text: str, *, max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS,
               min_chars: int = MIN_CHARS) -> Cycle | None:
    """The shortest unit that the end of ``text`` repeats enough to be a loop, or None.

    For each period ``p`` up to ``max_period``, the last ``n * p`` characters must be
    one unit of ``p`` characters ``n`` times over, where ``n`` is
    :func:`repeats_needed` (``min_repeats`` and ``min_chars`` set the short units'
    rule). Cost: at most O(max_period² * LONG_MIN_REPEATS) character comparisons
    whatever the length of ``text`` (in practice about ``max_period`` comparisons of
    :data:`PROBE` characters), so it can run after every streamed token.
    """
    if max_period < 1 or min_repeats < 2:
        raise ValueError("max_period must be >= 1 and min_repeats >= 2")
    n = len(text)
    for p in range(1, min(max_period, n // 2) + 1):
        need = repeats_needed(p, min_repeats=min_repeats, min_chars=min_chars)
        span = need * p
        if span > n:
            continue
        k = min(PROBE, p)
        if text[n - k:] != text[n - p - k:n - p]:
            continue
        tail = text[-span:]
        # A string of length span has period p iff it equals itself shifted by p.
        if tail[p:] != tail[:-p]:
            continue
        unit = tail[-p:]
        if need < min_repeats and not _wordy(unit):
            need = max(min_repeats, -(-min_chars // p))  # not a sentence: the short rule
            if need * p > n or text[-need * p:][p:] != text[-need * p:][:-p]:
                continue
        repeats = need
        while (repeats + 1) * p <= n and text[n - (repeats + 1) * p:n - repeats * p] == unit:
            repeats += 1
        return Cycle(unit, repeats)
    return None


def strip_cycle(text: str, cycle: Cycle) -> str:
    """``text`` with the repeats of ``cycle`` at its end cut down to one."""
    return text[: len(text) - (cycle.repeats - 1) * len(cycle.unit)]
