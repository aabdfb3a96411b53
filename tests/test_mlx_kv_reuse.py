"""KV reuse across calls on MLX (issue 15, Deliver 1): a call prefills only what its
prompt adds to the longest prefix a recent call's cache holds, and the reply is the one
it gives without reuse (greedy, repetition penalty, structured output), through the
single path and the batcher alike. The store is bounded (entries and bytes) and never
changed by a caller borrowing from it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from localrun.sampling import ResolvedSampling

pytest.importorskip("mlx_lm", reason="MLX is not installed (pip install -e '.[mlx]')")

N = 6  # reply tokens


# -- the store, on real mlx caches (no model) -------------------------------------------


def kv(n: int, layers: int = 2, fill: float | None = None) -> list[Any]:
    """A prompt cache of ``layers`` KVCaches holding ``n`` positions."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out = []
    for i in range(layers):
        c = KVCache()
        k = mx.full((1, 2, n, 4), fill) if fill is not None else \
            mx.arange(n * 8, dtype=mx.float32).reshape(1, 2, n, 4) + i
        c.update_and_fetch(k, k + 1)
        out.append(c)
    return out


class _Model:
    """make_prompt_cache's view of a model: its layers."""

    layers = (None, None)


def test_common_prefix() -> None:
    from localrun.backends.prefix import common_prefix

    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


def test_borrow_cuts_the_longest_match_and_leaves_the_entry_whole() -> None:
    import mlx.core as mx

    from localrun.backends.mlx.reuse import PrefixCache

    store = PrefixCache(_Model())
    a, b = kv(6), kv(4, fill=9.0)
    store.keep([1, 2, 3, 4, 5, 6], a)
    store.keep([1, 2, 7, 8], b)
    assert len(store) == 2
    cache, n = store.borrow([1, 2, 3, 4, 9, 9, 9])
    assert n == 4 and cache[0].offset == 4
    assert mx.array_equal(cache[1].keys, a[1].keys[..., :4, :])
    before = mx.array(a[0].keys)
    cache[0].update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))  # generate
    assert cache[0].offset == 7
    assert a[0].offset == 6 and mx.array_equal(a[0].keys, before)  # the entry is whole
    # the whole prompt cached: the last token is still left to prefill (its logits)
    assert store.borrow([1, 2, 3, 4, 5, 6])[1] == 5
    fresh, none = store.borrow([5, 5, 5])
    assert none == 0 and fresh[0].offset == 0 and len(fresh) == 2


def test_keep_drops_what_a_longer_entry_holds_and_stays_bounded() -> None:
    from localrun.backends.mlx.reuse import PrefixCache

    store = PrefixCache(_Model(), entries=3, budget=10**9)
    store.keep([1, 2, 3], kv(3))
    store.keep([1, 2, 3, 4, 5], kv(5))  # the next turn holds the first: one entry
    assert len(store) == 1
    store.keep([1, 2], kv(2))  # held by the entry already: nothing new
    assert len(store) == 1
    store.keep([7, 8], kv(3))  # its length is not its cache's: unknown content
    assert len(store) == 1
    for first in (10, 20, 30):
        store.keep([first, 1], kv(2))
    assert len(store) == 3  # the oldest ([1..5]) went first
    assert store.borrow([1, 2, 3, 4, 5, 6])[1] == 0
    one = kv(2)
    small = PrefixCache(_Model(), entries=4, budget=int(sum(c.nbytes for c in one)) + 1)
    small.keep([1, 1], one)
    small.keep([2, 2], kv(2))
    assert len(small) == 1  # over the byte budget: only the newest stays
    assert small.borrow([2, 2, 3])[1] == 2


def test_most_bytes_bounds_what_the_store_keeps() -> None:
    """What serve counts for the store (``most_bytes``): never less than it holds, and
    reached: each entry is at most one context's cache, older ones go past the budget,
    the newest stays whatever its size."""
    from localrun.backends.mlx.reuse import PREFIX_BYTES, PrefixCache

    full = int(sum(c.nbytes for c in kv(256)))  # a whole context (mlx-lm's 256 steps)
    for budget, most in ((10**9, 3 * full), (full + full // 2, full + full // 2),
                         (full // 2, full)):
        store = PrefixCache(_Model(), entries=3, budget=budget)
        assert store.most_bytes(full) == most
        seen = 0
        for first in range(1, 7):
            store.keep([first] * 200, kv(200))
            seen = max(seen, store.nbytes)
            assert store.nbytes <= most
        assert seen > most - full  # within one entry of the bound: it is not loose
    assert PrefixCache(_Model()).most_bytes(None) == PREFIX_BYTES


# -- on the model -----------------------------------------------------------------------


def greedy(max_tokens: int = N, **kw: Any) -> ResolvedSampling:
    base: dict[str, Any] = dict(max_tokens=max_tokens, temperature=0.0, top_p=1.0,
                                top_k=0, min_p=0.0, repetition_penalty=1.0, seed=1, stop=())
    base.update(kw)
    return ResolvedSampling(**base)


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    import localrun
    from tests.models import test_model

    with localrun.load(str(test_model("mlx-4bit")), backend="mlx", context=2048,
                       exact=True) as m:
        yield m


def run(session: Any, prompt: Any, s: ResolvedSampling, *, reuse: bool
        ) -> tuple[str, int]:
    """The reply and the tokens prefilled, with or without the cached prefixes."""
    from localrun.backends.base import GenerationStats
    from localrun.types import CancelToken

    if not reuse:
        session.engine.worker.call(session.engine.prefixes.clear)
    stats = GenerationStats()
    text = "".join(session.generate(prompt, s, CancelToken(), stats))
    return text, stats.prefill_tokens


SYSTEM = ("You are a careful assistant for a shipping company. Answer briefly, name the "
          "port and the ship when you know them, and never invent a tracking number.")


def test_a_chat_turn_prefills_only_the_new_message_and_replies_the_same(model: Any
                                                                       ) -> None:
    session = model._session
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Where is the ship Aurora?"}]
    first = session.encode_chat(messages)
    reply, n1 = run(session, first, greedy(), reuse=False)
    assert n1 == len(first.tokens)
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "And when does it arrive?"}]
    second = session.encode_chat(messages)
    with_reuse, n2 = run(session, second, greedy(), reuse=True)
    without, n3 = run(session, second, greedy(), reuse=False)
    assert with_reuse == without
    assert n3 == len(second.tokens)
    assert n2 < len(second.tokens) - len(first.tokens) + 8, (n2, len(second.tokens))


def test_a_penalty_and_a_schema_see_the_cached_prompt_too(model: Any) -> None:
    """The repetition penalty looks back over the prompt; generate_step passes only the
    tokens it prefills, so the cached ones go in front."""
    from localrun.structured.constraint import Constraint

    session = model._session
    base = [{"role": "system", "content": SYSTEM + " the the the port port port"}]
    ask = [*base, {"role": "user", "content": "Name the port, the port, the port."}]
    prompt = session.encode_chat(ask)
    s = greedy(repetition_penalty=1.5)
    run(session, session.encode_chat([*base, {"role": "user", "content": "Hello"}]),
        greedy(max_tokens=1), reuse=False)  # caches the system prompt
    got, n = run(session, prompt, s, reuse=True)
    assert n < len(prompt.tokens) - 20  # the system prompt came from the cache
    assert got == run(session, prompt, s, reuse=False)[0]
    schema = Constraint.json({"type": "object", "properties": {"port": {"type": "string"}},
                              "required": ["port"]})
    session.check_constraint(schema)
    c = greedy(max_tokens=12, constraint=schema)
    run(session, prompt, greedy(max_tokens=1), reuse=False)
    got, n = run(session, prompt, c, reuse=True)
    assert n == 1 and got == run(session, prompt, c, reuse=False)[0]


def test_the_batcher_and_the_single_path_share_the_cache(model: Any) -> None:
    from localrun.backends.base import GenerationStats

    session = model._session
    prompt = session.encode_chat([{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "Is the Aurora late?"}])
    alone, _ = run(session, prompt, greedy(), reuse=False)  # leaves its cache behind
    b = session.batcher()
    assert b is not None
    stats = GenerationStats()
    b.add(0, prompt, greedy(), stats)
    assert stats.prefill_tokens == 1
    text = ""
    while True:
        events = b.step()
        text += "".join(p for _, p in events if p is not None)
        if (0, None) in events:
            break
    assert text == alone
    again, n = run(session, prompt, greedy(), reuse=True)  # the batcher's cache, back
    assert again == alone and n == 1


def test_serve_counts_the_caches_it_keeps(model: Any) -> None:
    """``Model.footprint``: ``kept`` is the store's bound for this model's context (a few
    whole-context caches within 1 GiB); each sequence at once adds one KV cache of the
    context (``per_slot``: its cache grows with it, nothing reserved up front); ``localrun
    serve`` counts the model as that, at the slots it runs."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed "
                        "(pip install -e '.[serve]')")
    from localrun.backends.mlx.reuse import PREFIX_BYTES, PREFIX_ENTRIES
    from localrun.server.config import ServerConfig
    from localrun.server.sizing import estimate_loaded
    from tests.serverutil import serve

    est = estimate_loaded(model.info, None)
    assert est is not None and est.kv_cache_bytes > 0 and model.info.context_length == 2048
    kept = min(PREFIX_ENTRIES * est.kv_cache_bytes, max(PREFIX_BYTES, est.kv_cache_bytes))
    one, four = model.footprint(1), model.footprint(4)
    assert one.kept == four.kept == kept and one.total == est.total_bytes + kept
    assert four.slots == min(4, model.max_concurrency) and four.per_slot == est.kv_cache_bytes
    assert four.total - one.total == (four.slots - 1) * est.kv_cache_bytes
    with serve(ServerConfig(parallel=1), preload={"m": model}) as s:
        (loaded,) = s.manager.models.values()
        assert loaded.size == est.total_bytes + kept
