"""The prompt caches MLX keeps between calls (KV reuse).

:class:`PrefixCache` keeps the prompt caches (``make_prompt_cache``) of the last few
sequences with the tokens they hold (prompt and reply). A new prompt takes the entry
sharing its longest common prefix, cut to that prefix (a view of the stored keys and
values, or a trimmed copy: the entry stays whole for the next caller), and only the rest
is prefilled: the next turn of a chat prefills the new user message, an agent's repeated
system prompt and tools are prefilled once. Both the single path and the batcher take
and give back entries. Bounded: :data:`PREFIX_ENTRIES` entries, and older ones only
while all stay under :data:`PREFIX_BYTES`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from localrun.backends.prefix import common_prefix

#: Prompt caches kept between calls, most recently used last.
PREFIX_ENTRIES = 4
#: Bytes the kept caches may take together; the most recent one is kept whatever its
#: size (it is what the next turn of a conversation needs).
PREFIX_BYTES = 1 << 30


def cache_length(cache: Sequence[Any]) -> int:
    """Tokens a prompt cache holds (0: it does not say, as a recurrent state)."""
    return max((int(c.size()) for c in cache), default=0)


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: list[Any]
    nbytes: int


class PrefixCache:
    """Prompt caches of recent sequences and the tokens they hold. Used on the mlx
    worker thread only."""

    def __init__(self, model: Any, entries: int = PREFIX_ENTRIES,
                 budget: int = PREFIX_BYTES) -> None:
        self._model = model
        self._max = entries
        self._budget = budget
        self._entries: list[_Entry] = []  # most recently used last

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def most_bytes(self, context_bytes: int | None) -> int:
        """The most the kept caches take together, for a model whose cache of its whole
        context (rounded up to mlx-lm's 256-token steps) is ``context_bytes`` (None:
        unknown, the budget): an entry holds at most that, older entries stay only
        while all fit the budget, and the newest stays whatever its size."""
        if context_bytes is None:
            return self._budget
        return min(self._max * context_bytes, max(self._budget, context_bytes))

    def borrow(self, tokens: Sequence[int]) -> tuple[list[Any], int]:
        """A prompt cache for ``tokens`` and how many of them it already holds (0: a new
        empty cache). At least the last token is left to prefill: its logits give the
        first reply token. The stored entry is not changed."""
        from mlx_lm.models.cache import make_prompt_cache

        best: _Entry | None = None
        n = 0
        for e in self._entries:
            k = common_prefix(e.tokens, tokens)
            if k > n:
                best, n = e, k
        n = min(n, len(tokens) - 1)
        if best is not None and n > 0:
            cache = _prefix_of(best.cache, len(best.tokens), n)
            if cache is not None:
                self._entries.remove(best)
                self._entries.append(best)
                return cache, n
        return make_prompt_cache(self._model), 0

    def keep(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Offer a finished sequence's cache holding ``tokens`` (its prompt and reply).
        A cache whose length does not match is not kept (its content is unknown)."""
        import mlx.core as mx

        held = tuple(tokens)
        if not held or cache_length(cache) != len(held):
            return
        for e in list(self._entries):
            if e.tokens[:len(held)] == held:  # an entry already holds all of it
                self._entries.remove(e)
                self._entries.append(e)
                return
            if held[:len(e.tokens)] == e.tokens:  # the new one holds all of that entry
                self._entries.remove(e)
        # A cache cut out of a batch is a lazy slice of the whole batch's keys: computing
        # it now lets the batch's buffers go.
        mx.eval([c.state for c in cache])
        self._entries.append(_Entry(held, cache, sum(int(c.nbytes) for c in cache)))
        while len(self._entries) > self._max or (
                len(self._entries) > 1 and self.nbytes > self._budget):
            self._entries.pop(0)

    def clear(self) -> None:
        self._entries.clear()


def _prefix_of(cache: list[Any], length: int, n: int) -> list[Any] | None:
    """A new cache holding the first ``n`` of the ``length`` tokens of ``cache``, which
    stays as it is; None where the cache cannot be cut (a recurrent or rotated one)."""
    from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, trim_prompt_cache

    if all(type(c) is KVCache for c in cache):
        new_kv: Any = KVCache  # untyped in mlx-lm
        out = []
        for c in cache:
            part = new_kv()
            # A slice is a new array: the generator's writes into it (it grows the
            # buffer on the first token) leave the stored keys alone.
            part.keys = c.keys[..., :n, :]
            part.values = c.values[..., :n, :]
            part.offset = n
            out.append(part)
        return out
    if n == length or can_trim_prompt_cache(cache):
        dup = copy.deepcopy(cache)
        if length > n:
            trim_prompt_cache(dup, length - n)
        return dup
    return None
