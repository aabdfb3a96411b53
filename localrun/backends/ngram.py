"""Prompt lookup: draft tokens from n-grams of the prompt and the reply so far, with no
second model (llama.cpp's ``common_ngram_cache``, as ``llama-lookup`` drafts with it).

Every n-gram of 1 to :data:`NGRAM_MAX` tokens seen in the sequence maps to the tokens
that followed it and how often. A draft extends the sequence one token at a time: the
longest n-gram ending at the draft's end that has been seen decides the next token (its
most frequent follower), if it was seen often enough and that follower is frequent
enough (:data:`MIN_SAMPLES`, :data:`MIN_PERCENT`: llama.cpp's "lax" thresholds for the
context cache). Pure Python; a few dictionary lookups per token.
"""

from __future__ import annotations

from collections.abc import Sequence

from localrun.backends.prefix import common_prefix

#: n-gram sizes looked up, as llama.cpp's LLAMA_NGRAM_MIN/MAX
NGRAM_MIN, NGRAM_MAX = 1, 4
#: per n-gram size (1..4): how often it must have been seen, and the share its most
#: frequent follower must have, for that follower to be drafted (draft_min_*_lax)
MIN_SAMPLES = (2, 2, 1, 1)
MIN_PERCENT = (66, 50, 50, 50)


class NgramDrafter:
    """The n-gram counts of one sequence; :meth:`extend` as tokens come, :meth:`draft`
    for the tokens likely to follow."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        #: n-gram (a tuple) -> {following token: count}
        self._seen: dict[tuple[int, ...], dict[int, int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the sequence and count the n-grams they end."""
        seq, seen = self.tokens, self._seen
        for token in tokens:
            end = len(seq)
            for size in range(NGRAM_MIN, min(NGRAM_MAX, end) + 1):
                gram = tuple(seq[end - size:end])
                counts = seen.get(gram)
                if counts is None:
                    seen[gram] = {token: 1}
                else:
                    counts[token] = counts.get(token, 0) + 1
            seq.append(token)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens of the sequence: the counts of the n-grams the
        others ended go (as though they had never been extended)."""
        seq, seen = self.tokens, self._seen
        while len(seq) > n:
            token = seq.pop()
            end = len(seq)
            for size in range(NGRAM_MIN, min(NGRAM_MAX, end) + 1):
                gram = tuple(seq[end - size:end])
                counts = seen[gram]
                if counts[token] > 1:
                    counts[token] -= 1
                elif len(counts) > 1:
                    del counts[token]
                else:
                    del seen[gram]

    def draft(self, n: int) -> list[int]:
        """Up to ``n`` tokens likely to follow the sequence (none where no n-gram at its
        end has a frequent enough follower)."""
        out: list[int] = []
        seq, seen = self.tokens, self._seen
        while len(out) < n:
            tail = (seq[-NGRAM_MAX:] + out)[-NGRAM_MAX:] if out else seq[-NGRAM_MAX:]
            token = None
            for size in range(min(NGRAM_MAX, len(tail)), NGRAM_MIN - 1, -1):
                counts = seen.get(tuple(tail[len(tail) - size:]))
                if not counts:
                    continue
                best, best_n = max(counts.items(), key=lambda kv: kv[1])
                total = sum(counts.values())
                if total < MIN_SAMPLES[size - 1] or 100 * best_n < MIN_PERCENT[size - 1] * total:
                    continue
                token = best
                break
            if token is None:
                break
            out.append(token)
        return out



def resume(drafter: NgramDrafter | None, tokens: Sequence[int]) -> NgramDrafter:
    """A drafter of ``tokens``: ``drafter`` cut back to the prefix it shares with
    ``tokens`` and extended by the rest (the next turn of a chat starts with the last
    prompt and its reply: only the new message is counted), else a new one. Either way
    its counts are those of ``NgramDrafter(tokens)``."""
    if drafter is None:
        return NgramDrafter(tokens)
    common = common_prefix(drafter.tokens, tokens)
    drafter.truncate(common)
    drafter.extend(tokens[common:])
    return drafter
