"""llama.cpp's single path (``LlamaCppSession.generate``) keeps the KV cells of the last
prompt for the next call (issue 15) without changing a reply: every reply, and the
logits its first token is drawn from, are those of the same prompt in a clean context.
On the real engine and the SmolLM2 Q8_0 fixture, on the CPU (whose kernels are not
batch-invariant: localrun.backends.llama_cpp.reuse.reusable_prefix says what that keeps).

Also: once the session's batcher is built, a lone sequence runs through it, with the
single path's reply (``batch_alone``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from localrun.backends.base import GenerationStats, LoadRequest, Prompt
from localrun.sampling import ResolvedSampling
from localrun.types import CancelToken
from tests.conftest import requires_llama
from tests.models import test_model

pytestmark = requires_llama

CONTEXT = 2048
#: makes a prompt longer than TILE (64) tokens, computed by llama.cpp's tiled attention
SYSTEM = ("You are a friendly assistant for a small bakery in Lyon. You answer questions "
          "about bread, cakes, opening hours and orders, briefly and politely. " * 3)


def sampling(max_tokens: int = 24) -> ResolvedSampling:
    return ResolvedSampling(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0,
                            min_p=0.0, repetition_penalty=1.0, seed=0, stop=())


def load() -> Any:
    from localrun.backends.llama_cpp.session import LlamaCppSession

    # one thread: on a busy 2-core machine two wait on each other at every token
    return LlamaCppSession(LoadRequest(path=str(test_model("gguf-q8_0")), format="gguf",
                                       context=CONTEXT, device="cpu", threads=1,
                                       exact=True))


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Any, Any]]:
    """Two sessions of the same model: one keeps its cells between calls, the other is
    cleared before each (the reference: every prompt fed whole)."""
    a, b = load(), load()
    assert a._piece_size == 512  # Llama.eval's n_batch, one ubatch (expected_prefill)
    yield a, b
    a.close()
    b.close()


def chat(session: Any, turns: Sequence[str], system: str | None = None) -> Prompt:
    """A conversation: user and assistant turns alternating, the last one the user's."""
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "assistant" if k % 2 else "user", "content": t}
                 for k, t in enumerate(turns)]
    return session.encode_chat(messages)  # type: ignore[no-any-return]


def run(session: Any, prompt: Prompt, max_tokens: int = 24, *, fresh: bool = False
        ) -> tuple[str, Any, GenerationStats]:
    """Greedy reply, the logits its first token was drawn from, and the stats."""
    import numpy as np

    if fresh:
        session._engine.llm.reset()  # a clean context: the prompt is fed whole
    stats = GenerationStats()
    pieces = session.generate(prompt, sampling(max_tokens), CancelToken(), stats)
    first = next(pieces, "")  # the prompt is fed; its last token's logits are the context's
    row = session._engine.lc.llama_get_logits_ith(session._engine.ctx, -1)
    logits = np.ctypeslib.as_array(row, shape=(session._engine.llm.n_vocab(),)).copy()
    return first + "".join(pieces), logits, stats


def expected_prefill(before: Prompt, prompt: Prompt) -> int:
    """Prompt tokens fed after ``before`` ran: all but the cells reusable_prefix keeps."""
    from localrun.backends.llama_cpp.reuse import reusable_prefix
    from localrun.backends.prefix import common_prefix

    n = len(prompt.tokens)
    held = len(before.tokens)
    return n - reusable_prefix(n, common_prefix(before.tokens, prompt.tokens), 512, held)


def check(pair: tuple[Any, Any], prompt: Prompt, max_tokens: int = 24
          ) -> tuple[str, GenerationStats]:
    """The reply with the cells kept equals the one fed whole, logits bit for bit."""
    import numpy as np

    kept, fresh = pair
    text, logits, stats = run(kept, prompt, max_tokens)
    want, want_logits, want_stats = run(fresh, prompt, max_tokens, fresh=True)
    n = len(prompt.tokens)
    assert np.array_equal(logits, want_logits), (
        n, stats.prefill_tokens, float(np.abs(logits - want_logits).max()))
    assert text == want, (n, stats.prefill_tokens)
    assert want_stats.prefill_tokens == n
    return text, stats


def test_multi_turn_chat_replies_as_fed_whole(pair: tuple[Any, Any]) -> None:
    """A conversation from under 64 tokens to past one 512-token piece: each turn keeps
    the last prompt's cells (not its reply's: decoded a token at a time) where that
    keeps every kernel, and replies as the prompt fed whole."""
    kept, _ = pair
    kept._engine.llm.reset()
    asks = ["Hi.", "Tell me about the sea.", "Why is it salty?", "What lives at the bottom?",
            "How deep is the deepest part?", "Who first went down there?",
            "What did they see?", "Is it dark there?", "Name a fish that lives there.",
            "Thanks. One more: what is a trench?"]
    turns: list[str] = []
    before: Prompt | None = None
    lengths, fed = [], []
    for ask in asks:
        turns.append(ask)
        prompt = chat(kept, turns)
        text, stats = check(pair, prompt, 64)
        n = len(prompt.tokens)
        if before is not None:
            assert stats.prefill_tokens == expected_prefill(before, prompt), n
        lengths.append(n)
        fed.append(stats.prefill_tokens)
        turns.append(text)
        before = prompt
    assert lengths[0] < 64 and lengths[-1] > 512 + 64, lengths
    # cells were kept: in the second half of the conversation, most of each prompt
    half = len(asks) // 2
    assert sum(fed[half:]) < sum(lengths[half:]) // 2, (lengths, fed)


def test_shared_long_system_prompt(pair: tuple[Any, Any]) -> None:
    """Calls that share a system prompt of three 512-token pieces: each after the first
    feeds only about the new question, and replies as fed whole; the same prompt again
    feeds its last 64 tokens."""
    kept, _ = pair
    kept._engine.llm.reset()
    system = ("Customers ask about bread, cakes, opening hours and orders. "
              "The shop opens at seven and closes at seven, except on Sundays. ") * 44
    questions = ["Name a color.", "When does the shop open?", "Is it open on Sunday?"]
    prompts = [chat(kept, [q], system) for q in questions]
    assert all(1024 < len(p.tokens) < 1536 for p in prompts)
    check(pair, prompts[0])
    for before, prompt in itertools.pairwise(prompts):
        _, stats = check(pair, prompt)
        assert stats.prefill_tokens == expected_prefill(before, prompt) < 100
    _, stats = check(pair, prompts[-1])
    assert stats.prefill_tokens == 64


def test_short_prompts_under_64_tokens(pair: tuple[Any, Any]) -> None:
    """Prompts computed row by row: the common prefix is kept (the last token and one
    more are always fed again), and the replies are the prompts' fed whole."""
    kept, _ = pair
    kept._engine.llm.reset()
    prompts = [chat(kept, [q]) for q in ("Hi.", "Name a fruit.", "Name a fruit.", "Why?")]
    assert all(len(p.tokens) < 64 for p in prompts)
    check(pair, prompts[0])
    for before, prompt in itertools.pairwise(prompts):
        _, stats = check(pair, prompt)
        assert stats.prefill_tokens == expected_prefill(before, prompt)
    assert expected_prefill(prompts[1], prompts[2]) == 2


@pytest.mark.parametrize(("system", "ask", "fed"), [
    (SYSTEM, "Name a fruit.", 64),  # 104 tokens, then 106 sharing 96: tiled both
    (SYSTEM[:230], "What is a color?", 65),  # 62 tokens (row by row), then 65 (tiled)
])
def test_replies_llama_cpp_python_changed(pair: tuple[Any, Any], system: str, ask: str,
                                         fed: int) -> None:
    """Cases where llama-cpp-python's own prefix match changed the greedy reply (it fed
    the 10 or so new tokens alone, row by row, where the prompt fed whole computes them
    in a tiled piece: "Aleurunggung, aye, aye aye" against "A fruit is a fruit, it's
    called."). Now the last 64 tokens of the tiled piece are fed again, or all of it
    when the last prompt's piece went row by row."""
    kept, _ = pair
    kept._engine.llm.reset()
    before, prompt = chat(kept, ["Hi."], system), chat(kept, [ask], system)
    check(pair, before)
    _, stats = check(pair, prompt)
    assert stats.prefill_tokens == fed == expected_prefill(before, prompt)


def test_pieces_start_where_a_whole_feed_starts_them(pair: tuple[Any, Any]) -> None:
    """llama-cpp-python feeds what follows the kept cells in n_batch pieces from the
    first token not kept; the session keeps a prefix that ends on a piece boundary, or
    feeds up to the next boundary itself, so that every piece is a whole feed's: a
    prompt whose kept cells end inside its first 512-token piece and that goes on past
    it replies as fed whole."""
    kept, _ = pair
    kept._engine.llm.reset()
    words = "Customers ask about bread, cakes, opening hours and orders. "
    system = words * 40
    before = chat(kept, ["Hi."], system[: len(system) // 2])
    prompt = chat(kept, ["Name a color.", "Red.", "Name a tree."], system)
    assert len(before.tokens) < 512 < len(prompt.tokens)
    check(pair, before)
    _, stats = check(pair, prompt)
    keep = len(prompt.tokens) - stats.prefill_tokens
    assert 0 < keep < 512 and keep % 512, keep


# -- a lone sequence through the batcher, once it is built ------------------------------

def test_lone_sequence_runs_through_the_batcher_once_built() -> None:
    """Until the batcher is built a lone call runs the single path; after, the batcher
    (so that calls arriving meanwhile join it), with the same replies."""
    import localrun

    with localrun.load(str(test_model("gguf-q8_0")), backend="llama.cpp", context=1024,
                       device="cpu", exact=True) as model:
        session = model._session
        asks: list[Any] = ["What is 2+2?", [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": "Name a color."}]]
        want = [model.chat(a, temperature=0, max_tokens=24).text for a in asks]
        assert not session.batch_alone
        assert model.max_concurrency >= 2 and session.batch_alone
        batcher = session.batcher()
        added: list[int] = []
        generated: list[Prompt] = []
        real_add, real_generate = batcher.add, session.generate

        def add(key: int, *rest: Any) -> None:
            added.append(key)
            real_add(key, *rest)

        def generate(prompt: Prompt, *rest: Any) -> Any:
            generated.append(prompt)
            return real_generate(prompt, *rest)

        batcher.add, session.generate = add, generate
        try:
            got = [model.chat(a, temperature=0, max_tokens=24).text for a in asks]
        finally:
            del batcher.add, session.generate
        assert got == want
        assert len(added) == len(asks) and not generated
    assert not session.batch_alone  # closed with its batcher
