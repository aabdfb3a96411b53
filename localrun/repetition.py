"""Spot a reply stuck repeating a short cycle ("la Femme, la Femme, la Femme, ...").

Small models loop: once a phrase repeats a few times, its probability climbs until it
is all the model says, up to the token limit. The interactive chat uses
:func:`find_cycle` on the text streamed so far to stop such a reply early; the Python
API never does (it returns what the model generates).

A cycle counts only when it repeats many times and is long in characters: a rule of
``-`` under a heading or "ha ha ha" is text; 12 times ``la Femme, `` is a loop.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The longest repeating unit looked for, in characters (a sentence).
MAX_PERIOD = 100
#: The unit must repeat at least this many times back to back (a few identical lines in
#: a row, such as the rows of a small zero matrix, are text)...
MIN_REPEATS = 8
#: ...and the repeats must cover at least this many characters.
MIN_CHARS = 120


@dataclass(frozen=True)
class Cycle:
    """The end of a text is ``unit`` repeated ``repeats`` times, back to back."""

    unit: str
    repeats: int


def find_cycle(text: str, *, max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS,
               min_chars: int = MIN_CHARS) -> Cycle | None:
    """The shortest unit that the end of ``text`` repeats enough to be a loop, or None.

    For each period ``p`` up to ``max_period``, the last ``n * p`` characters must be
    one unit of ``p`` characters ``n`` times over, where ``n`` is the larger of
    ``min_repeats`` and ``ceil(min_chars / p)``. Cost: O(max_period * (min_chars +
    max_period * min_repeats)) character comparisons whatever the length of ``text``,
    so it can run after every streamed chunk.
    """
    if max_period < 1 or min_repeats < 2:
        raise ValueError("max_period must be >= 1 and min_repeats >= 2")
    for p in range(1, max_period + 1):
        need = max(min_repeats, -(-min_chars // p))
        span = need * p
        if span > len(text):
            continue
        tail = text[-span:]
        # A string of length span has period p iff it equals itself shifted by p.
        if tail[p:] != tail[:-p]:
            continue
        unit = tail[-p:]
        repeats = need
        while (repeats + 1) * p <= len(text) and \
                text[-(repeats + 1) * p:-repeats * p] == unit:
            repeats += 1
        return Cycle(unit, repeats)
    return None


def strip_cycle(text: str, cycle: Cycle) -> str:
    """``text`` with the repeats of ``cycle`` at its end cut down to one."""
    return text[: len(text) - (cycle.repeats - 1) * len(cycle.unit)]
