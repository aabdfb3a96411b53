"""Prompts exact in tokens for the model's own tokenizer, a fresh first word each."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from localrun.errors import BenchError

if TYPE_CHECKING:
    from localrun.api import Model

#: Plain, common words; random sequences of them rarely make a model stop early.
_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend "
    "father power hour game line end member law car city community name president team "
    "minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air "
    "teacher force education foot boy age policy music market sense nation plan college "
    "interest death experience effect class control care field development role effort rate "
    "heart drug show leader light voice wife police mind price report decision son view "
    "relationship town road arm difference value building action model season society tax "
    "director position player record paper space ground form event official matter center "
    "couple site project activity star table need court oil situation cost industry figure "
    "street image phone data picture practice piece land product doctor wall patient worker "
    "news test movie north love support technology step baby computer type attention film "
    "tree source organization hair window evidence population truth song river stone cloud "
    "garden bridge island forest mountain "
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

FILLERS: tuple[str, ...] = (" the", " a", " of", " and", " to", " in", ".", ",", " is", " it")


def synthetic_words(seed: int, n: int) -> list[str]:
    """n words; the first depends only on ``seed`` so neighbouring seeds differ at once."""
    rng = random.Random(seed)
    return [WORDS[seed % len(WORDS)]] + [rng.choice(WORDS) for _ in range(n - 1)]


def exact_prompt(count_tokens: Callable[[str], int], n_tokens: int, *, seed: int,
                 head: str = "") -> str:
    """Text that is exactly ``n_tokens`` tokens for ``count_tokens`` (BOS included).

    ``head`` starts every prompt (a shared prefix); words seeded by ``seed`` follow. The
    word count is found by bisection, then single-token fillers close the gap.
    """
    def text_of(k: int) -> str:
        body = " ".join(words[:k])
        return f"{head} {body}" if head and body else (head or body)

    words = synthetic_words(seed, 2 * n_tokens + 8)
    lo, hi = 0, len(words)
    if count_tokens(text_of(0)) > n_tokens:
        raise BenchError(f"Cannot build a {n_tokens}-token prompt: the model's tokenizer "
                         f"needs {count_tokens(text_of(0))} tokens for the shortest one",
                         hint="ask for more prompt tokens (--prompt-tokens)")
    while lo < hi:  # largest k whose text fits in n_tokens
        mid = (lo + hi + 1) // 2
        if count_tokens(text_of(mid)) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    text = text_of(lo)
    have = count_tokens(text)
    while have < n_tokens:
        for filler in FILLERS:
            n = count_tokens(text + filler)
            if have < n <= n_tokens:
                text, have = text + filler, n
                break
        else:
            break
    if have != n_tokens:
        raise BenchError(f"Cannot build a prompt of exactly {n_tokens} tokens for this "
                         f"tokenizer (closest: {have})",
                         hint="try a slightly different --prompt-tokens value")
    return text


class Prompts:
    """Exact-length prompts with a fresh first word each, for one loaded model."""

    def __init__(self, model: Model) -> None:
        self._count = model.count_tokens
        self._seed = 0

    def make(self, n_tokens: int, head: str = "") -> str:
        self._seed += 1
        return exact_prompt(self._count, n_tokens, seed=self._seed, head=head)
