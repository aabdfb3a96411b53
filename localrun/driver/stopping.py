"""Stop strings, built once for every engine.

Text is released as soon as it can no longer be the start of a stop string, so
streaming stays token-by-token; the stop string itself never reaches the caller.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    __slots__ = ("_held", "_max", "_stops", "matched")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._max = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None  # the stop string that matched, once one has

    def feed(self, text: str) -> tuple[str, bool]:
        """Add generated text; return (text safe to emit, whether a stop string matched)."""
        if not self._stops:
            return text, False
        buf = self._held + text
        cut = -1
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut, self.matched = i, s
        if cut != -1:
            self._held = ""
            return buf[:cut], True
        # Hold back the longest tail of buf that could still grow into a stop string.
        keep = 0
        for n in range(min(len(buf), self._max - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                keep = n
                break
        self._held = buf[len(buf) - keep :] if keep else ""
        return (buf[: len(buf) - keep] if keep else buf), False

    def flush(self) -> str:
        """Release whatever is held back once generation has ended without a match."""
        out, self._held = self._held, ""
        return out
