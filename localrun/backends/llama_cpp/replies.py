"""The token ids of recent replies, so that a chat's next turn feeds them as generated.

A reply's text does not always tokenize back into the tokens that produced it (BPE picks
one split of a text; sampling may have taken another). A chat's next prompt carries
the reply as text, so its tokens would part from the cells the reply left in the cache
at the first such token, and everything after it (most of the reply, at times) is
prefilled again — llama-server and Ollama pay that too. Fast mode remembers each
finished sequence's text (prompt and reply) with its token ids: a prompt that starts
with one of those texts takes its ids and tokenizes only the rest, where the rest starts
with a special token (the template's end of turn), so no token straddles the seam. Not
in exact mode: a prompt's tokens there must not depend on what ran before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

#: Sequences remembered (the most recent): about one per conversation a server runs at once.
MOST = 16


class Replies:
    """Texts the model read and wrote, each with the token ids it had for them."""

    def __init__(self, most: int = MOST) -> None:
        self.most = most
        self._seen: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def remember(self, text: str, tokens: list[int]) -> None:
        if not text or not tokens:
            return
        self._seen[text] = tuple(tokens)
        self._seen.move_to_end(text)
        while len(self._seen) > self.most:
            self._seen.popitem(last=False)

    def tokenize(self, text: str, tokenize_rest: Callable[[str], list[int]],
                 is_special: Callable[[int], bool]) -> list[int] | None:
        """``text``'s tokens with the longest remembered text it starts with taken as it
        was generated, the rest from ``tokenize_rest``; None where no remembered text
        starts it or the rest does not start with a special token."""
        best = max((seen for seen in self._seen if text.startswith(seen)), key=len,
                   default=None)
        if best is None:
            return None
        head = self._seen[best]
        rest = text[len(best):]
        tail = tokenize_rest(rest) if rest else []
        if tail and not is_special(tail[0]):
            return None
        self._seen.move_to_end(best)
        return [*head, *tail]
