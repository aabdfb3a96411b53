"""OpenVINO GenAI: KV reuse across calls, and the batcher's text path (issue 15).

On the CPU every sequence runs through the session's ContinuousBatchingPipeline with
prefix caching (localrun/backends/openvino/batcher.py). What must hold:

- a prompt that starts like an earlier one prefills only the rest: counted in engine
  steps (a step prefills at most MAX_BATCHED_TOKENS), not timed;
- greedy replies with the cache warm are the replies with it cold, token for token, at
  localrun's f32 compute on the CPU. In bf16 (the plugin's own default on AVX-512 BF16
  and AMX CPUs) they were not: reused keys and values, computed in other steps of other
  shapes, round differently, so replies (and one seed's samples) changed between a
  prompt's first call and later ones, as with batching;
- several prefixes stay cached (an agent alternating system prompts): the cache holds
  the model's context, as memory planning counts it;
- a batch's text comes from one detokenizer call per window length and step, not one
  per token.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from localrun.errors import LocalrunError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("openvino_genai") is None,
    reason="openvino-genai is not installed (pip install -e '.[openvino]')")

#: ~1,300 tokens: two prefill steps of MAX_BATCHED_TOKENS (1024) when nothing is cached
SYSTEM = " ".join(f"Rule {i}: answer plainly and keep to the facts." for i in range(100))
TURNS = ("Tell me about the sea.", "Why is it salty?", "What lives at the bottom?")
GREEDY: dict[str, Any] = {"temperature": 0.0}


def _path() -> str:
    from tests.models import test_model

    return str(test_model("openvino-int4"))


def _load(**options: Any) -> Any:
    import localrun

    return localrun.load(_path(), backend="openvino", **{"exact": True, **options})


@pytest.fixture(scope="module")
def f32_pair() -> Iterator[tuple[Any, Any]]:
    """(localrun's default: prefix caching on, f32 on the CPU; prefix caching off)."""
    warm = _load()
    try:
        cold = _load(PREFIX_CACHING=False)
        try:
            yield warm, cold
        finally:
            cold.close()
    finally:
        warm.close()


def steps_of(model: Any, call: Callable[[], Any]) -> tuple[int, int, Any]:
    """How many engine steps ``call`` took in all and up to its first token (the
    prefill), and what it returned."""
    batcher = model._session.batcher()
    real = batcher.step
    count, first = 0, 0

    def step() -> Any:
        nonlocal count, first
        count += 1
        events = real()
        if not first and any(piece for _, piece in events):
            first = count
        return events

    batcher.step = step
    try:
        result = call()
    finally:
        del batcher.step
    return count, first, result


def ask(model: Any, system: str, question: str) -> tuple[int, Any]:
    """(prefill steps, the reply) for a system prompt and a question."""
    _, prefill, reply = steps_of(model, lambda: model.chat(
        [{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=8, **GREEDY))
    return prefill, reply


def test_replies_with_a_warm_cache_are_the_replies_with_a_cold_one(
        f32_pair: tuple[Any, Any]) -> None:
    """A chat whose every turn reuses the last one's KV, and a long system prompt asked
    twice, alternated with another: each reply is the cold pipeline's, and the warm one
    prefilled the repeated prefix in fewer steps."""
    warm, cold = f32_pair
    messages: list[dict[str, str]] = [{"role": "system", "content": "Answer briefly."}]
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        w = warm.chat(messages, max_tokens=24, **GREEDY)
        c = cold.chat(messages, max_tokens=24, **GREEDY)
        assert (w.text, w.usage, w.finish_reason) == (c.text, c.usage, c.finish_reason)
        messages.append({"role": "assistant", "content": w.text})

    asks = [(SYSTEM, "Name a fruit."), (SYSTEM, "What do bees make?"),
            (SYSTEM.upper(), "Name a fruit."),
            (SYSTEM, "Name a fruit.")]  # the last: the very same prompt again
    warm_steps, cold_steps = [], []
    for system, question in asks:
        ws, w = ask(warm, system, question)
        cs, c = ask(cold, system, question)
        assert (w.text, w.usage) == (c.text, c.usage), question
        warm_steps.append(ws)
        cold_steps.append(cs)
    assert all(n >= 2 for n in cold_steps), cold_steps  # prefilled whole: 1024 a step
    # the first sight of each system prompt is prefilled whole; every later call starts
    # from the cached prefix, the alternated prompt's blocks notwithstanding
    assert warm_steps[0] == cold_steps[0] and warm_steps[2] == cold_steps[2], warm_steps
    assert [warm_steps[i] for i in (1, 3)] == [1, 1], warm_steps


def test_the_kv_cache_holds_one_context(f32_pair: tuple[Any, Any]) -> None:
    """The pipeline's KV cache is the context's worth of blocks (what memory planning
    counts), fixed: prefixes stay cached in what the sequences in flight leave."""
    from localrun.backends.openvino.engine import KV_BLOCK_TOKENS, kv_blocks

    warm, _ = f32_pair
    warm.chat("Hi", max_tokens=1, **GREEDY)  # the cache is there from the first step on
    session = warm._session
    ctx = session.info.context_length
    assert session.load_properties["KV_CACHE_PRECISION"] == "f32"
    per_token = 11_520 * 4  # SmolLM2-135M: 30 layers x 3 KV heads x 64 x (K, V); f32
    size = session._pipe.get_metrics().kv_cache_size_in_bytes
    assert size == kv_blocks(ctx, "CPU") * KV_BLOCK_TOKENS["CPU"] * per_token
    assert ctx * per_token <= size <= (ctx + 2 * KV_BLOCK_TOKENS["CPU"]) * per_token


def test_the_single_sequence_pipeline_on_request(f32_pair: tuple[Any, Any]) -> None:
    """ATTENTION_BACKEND="SDPA" loads LLMPipeline (as on the NPU): no batcher, no reuse,
    calls in turn; its greedy replies are the paged pipeline's (both f32)."""
    paged, _ = f32_pair
    sdpa = _load(ATTENTION_BACKEND="SDPA")
    try:
        assert sdpa._session.batcher() is None and not sdpa._session.batch_alone
        assert paged._session.batch_alone
        for q in ("What is the capital of France?", "Write a word with an accent: café."):
            a = sdpa.chat(q, max_tokens=24, **GREEDY)
            b = paged.chat(q, max_tokens=24, **GREEDY)
            assert (a.text, a.usage, a.finish_reason) == (b.text, b.usage, b.finish_reason)
    finally:
        sdpa.close()


def test_precision_options() -> None:
    """f32 on the CPU with exact=True, keys and values too; bf16 on request (where the CPU
    has it) with a bf16 cache, and an f32 cache with bf16 compute refused before the
    model loads (paged attention takes none)."""
    from localrun.backends.openvino.devices import cpu_precision

    with pytest.raises(LocalrunError, match="f32 compute") as e:
        _load(KV_CACHE_PRECISION="f32", INFERENCE_PRECISION_HINT="bf16")
    assert "INFERENCE_PRECISION_HINT" in (e.value.hint or "")
    if cpu_precision(None) != "bf16":
        pytest.skip("this CPU does not compute in bf16 (no AVX-512 BF16 or AMX)")
    with _load(INFERENCE_PRECISION_HINT="bf16") as m:
        assert m._session.load_properties["KV_CACHE_PRECISION"] == "bf16"
        assert "Paris" in m.chat("What is the capital of France?", max_tokens=12,
                                 **GREEDY).text


# -- text: the batch detokenizer ----------------------------------------------------------

TEXT = ("Grüße aus Köln! 世界は広い。 Emoji: 🙂🚀 naïve café, déjà vu — "
        "and then a long plain English sentence to run past several windows.")


def test_detokenizer_pieces_join_to_the_text() -> None:
    """Three sequences at different points of the same text, one decode call per
    window length and round: each one's pieces join to its whole text (the detokenizer
    drops an incomplete character's bytes, and a window that restarted mid-character
    lost "界" of "世界"), a token that ends mid-character gives "" until the character
    is whole, and the pieces are the ones a sequence gets alone."""
    import openvino_genai as og

    from localrun.backends.openvino.text import DETOKENIZE_WINDOW, Detokenizer, TextWindow

    tok = og.Tokenizer(_path())
    ids = [int(t) for t in tok.encode(TEXT, add_special_tokens=False).input_ids.data[0]]
    calls: list[int] = []

    def decode_many(lists: list[list[int]]) -> list[str]:
        calls.append(len(lists))
        assert len({len(x) for x in lists}) == 1  # never padded
        out: list[str] = tok.decode(lists)
        return out

    starts = (0, 3, 11)
    detok = Detokenizer(decode_many)
    windows = [TextWindow() for _ in starts]
    pieces: list[list[str]] = [[] for _ in starts]
    for r in range(len(ids)):
        live = [i for i, s in enumerate(starts) if s + r < len(ids)]
        got = detok.pieces([(windows[i], ids[starts[i] + r]) for i in live])
        for i, piece in zip(live, got, strict=True):
            pieces[i].append(piece)
    assert max(calls) >= 2  # windows of one length went together
    for i, s in enumerate(starts):
        assert "".join(pieces[i]) == tok.decode(ids[s:]), s
    assert "" in pieces[0]  # the emoji's bytes
    alone_detok, alone = Detokenizer(lambda ls: list(tok.decode(ls))), TextWindow()
    assert [alone_detok.pieces([(alone, t)])[0] for t in ids] == pieces[0]
    assert len(ids) > DETOKENIZE_WINDOW


def test_a_batch_decodes_text_once_per_step_not_per_token(f32_pair: tuple[Any, Any]
                                                           ) -> None:
    """8 sequences admitted together: their text takes about one decode call a step
    (two when some restart their window), where a call per token took 8."""
    model, _ = f32_pair
    batcher = model._session.batcher()
    real = batcher._detok._decode
    try:
        calls = 0

        def counted(lists: list[list[int]]) -> list[str]:
            nonlocal calls
            calls += 1
            out: list[str] = real(lists)
            return out

        batcher._detok._decode = counted
        prompts = [f"Write a sentence about the number {i}." for i in range(8)]
        steps, _, out = steps_of(model, lambda: model.batch(
            prompts, max_tokens=16, max_concurrency=8, **GREEDY))
        tokens = sum(c.usage.completion_tokens for c in out)
        assert tokens >= 64, [c.text for c in out]
        assert calls <= 2 * steps and 3 * calls < tokens, (calls, steps, tokens)
    finally:
        batcher._detok._decode = real
