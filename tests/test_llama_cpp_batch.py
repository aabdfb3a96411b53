"""llama.cpp's Batcher (localrun.backends.llama_cpp.batcher) on the real engine and the
SmolLM2 Q8_0 fixture: several sequences in one context give each one's single-path
tokens, join and leave between steps, keep their KV cells for the next prompts, and
free the context on close."""

from __future__ import annotations

import json
import resource
from collections.abc import Iterator
from typing import Any

import pytest

from localrun.backends.base import Footprint, GenerationStats, LoadRequest, Prompt
from localrun.errors import LocalrunError
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.types import CancelToken
from tests.conftest import requires_llama
from tests.models import test_model

pytestmark = requires_llama

CONTEXT = 1024
QUESTIONS = ("What is 2+2?", "What color is the sky on a clear day?", "Name a fruit.",
             "Tell me about Paris.")
#: a system prompt that makes a prompt longer than TILE (64) tokens: fed through llama.cpp's
#: tiled attention kernel, where the short ones go row by row
SYSTEM = ("You are a friendly assistant for a small bakery in Lyon. You answer questions "
          "about bread, cakes, opening hours and orders, briefly and politely. " * 3)


def sampling(**kw: Any) -> ResolvedSampling:
    base: dict[str, Any] = dict(max_tokens=24, temperature=0.0, top_p=1.0, top_k=0,
                                min_p=0.0, repetition_penalty=1.0, seed=0, stop=())
    base.update(kw)
    return ResolvedSampling(**base)


@pytest.fixture(scope="module")
def session() -> Iterator[Any]:
    from localrun.backends.llama_cpp.session import LlamaCppSession

    path = test_model("gguf-q8_0")
    # on the CPU: the exactness below is of llama.cpp's CPU kernels (module docstring)
    s = LlamaCppSession(LoadRequest(path=str(path), format="gguf", context=CONTEXT,
                                    device="cpu", exact=True))
    yield s
    s.close()


@pytest.fixture
def batcher(session: Any) -> Iterator[Any]:
    """Four slots, every step's tokens in one decode (whatever calibrate() would say on
    this machine): the batched path is the one under test."""
    from localrun.backends.llama_cpp.batcher import LlamaCppBatcher

    b = LlamaCppBatcher(session.engine, 4, CONTEXT, together=2)
    yield b
    b.close()


def chat(session: Any, text: str, system: str | None = None) -> Prompt:
    messages = [{"role": "system", "content": system}] if system else []
    return session.encode_chat([*messages, {"role": "user", "content": text}])  # type: ignore


def alone(session: Any, prompt: Prompt, s: ResolvedSampling) -> tuple[str, GenerationStats]:
    """The single path: Session.generate, llama-cpp-python's Llama.generate, from a clean
    context (its own prefix match off: the reference is the prompt computed whole)."""
    session._engine.llm.reset()
    stats = GenerationStats()
    return "".join(session.generate(prompt, s, CancelToken(), stats)), stats


def shared(a: Prompt, b: Prompt) -> int:
    return next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y)


def reused(before: Prompt, prompt: Prompt) -> int:
    """Tokens of ``prompt`` the batcher takes from cells ``before`` left (prompts under
    512 tokens, both over TILE or both under): the common prefix, less the last TILE
    tokens (or the last two, for a prompt shorter than TILE)."""
    n = len(prompt.tokens)
    return min(shared(before, prompt), n - (64 if n >= 64 else 2))


def drain(b: Any, texts: dict[int, str], until: set[int] | None = None,
          max_steps: int = 500) -> list[int]:
    """Step until the sequences ``until`` (default: every one in ``texts``) have ended;
    return the keys in the order they ended."""
    want = set(texts) if until is None else until
    ended: list[int] = []
    for _ in range(max_steps):
        for key, piece in b.step():
            if piece is None:
                assert key not in ended, f"sequence {key} ended twice"
                ended.append(key)
            else:
                assert key not in ended, f"a piece for sequence {key} after its end"
                texts[key] += piece
        if want <= set(ended):
            return ended
    raise AssertionError(f"not done after {max_steps} steps: {want - set(ended)}")


def test_greedy_batch_equals_single_path(session: Any, batcher: Any) -> None:
    prompts = [chat(session, q, SYSTEM if k % 2 else None) for k, q in enumerate(QUESTIONS)]
    assert len(prompts[1].tokens) > 64 > len(prompts[0].tokens)
    want = [alone(session, p, sampling())[0] for p in prompts]
    stats = [GenerationStats() for _ in prompts]
    for k, p in enumerate(prompts):
        batcher.add(k, p, sampling(), stats[k])
    texts = dict.fromkeys(range(len(prompts)), "")
    drain(batcher, texts)
    assert [texts[k] for k in range(len(prompts))] == want
    for k, p in enumerate(prompts):
        assert stats[k].finish_reason in ("stop", "length")
        assert stats[k].prefill_tokens == len(p.tokens)
        assert 0 < stats[k].completion_tokens <= 24
        assert stats[k].started > 0 and stats[k].prefill_seconds > 0
    # one decode step per token after the first (the EOS or the limit ends it)
    assert all(s.decode_tokens == s.completion_tokens - (s.finish_reason == "length")
               for s in stats)


def test_a_decode_each_gives_the_same_tokens(session: Any) -> None:
    """Below ``together`` each sequence gets a decode of its own in a step (calibrate()
    picks that where it is faster): the same tokens, the same figures."""
    from localrun.backends.llama_cpp.batcher import LlamaCppBatcher

    prompts = [chat(session, q) for q in QUESTIONS[:3]]
    s = sampling(max_tokens=12, temperature=0.7, seed=9)
    want = [alone(session, p, s)[0] for p in prompts]
    b = LlamaCppBatcher(session.engine, 4, CONTEXT, together=5)
    try:
        stats = [GenerationStats() for _ in prompts]
        for k, p in enumerate(prompts):
            b.add(k, p, s, stats[k])
        texts = dict.fromkeys(range(3), "")
        drain(b, texts)
    finally:
        b.close()
    assert [texts[k] for k in range(3)] == want
    assert all(st.decode_tokens == st.completion_tokens - (st.finish_reason == "length")
               for st in stats)


def test_calibrate_picks_a_threshold(session: Any) -> None:
    from localrun.backends.llama_cpp.batcher import LlamaCppBatcher

    b = LlamaCppBatcher(session.engine, 4, CONTEXT)
    try:
        assert 2 <= b.together <= 5
        assert 2 <= b.calibrate(repeats=1) <= 5
        # the timing runs left no cells behind
        assert all(b._lc.llama_memory_seq_pos_max(b._mem, i) == -1 for i in range(4))
        stats = GenerationStats()  # and the slots work as before
        b.add(0, chat(session, QUESTIONS[0]), sampling(max_tokens=6), stats)
        drain(b, {0: ""})
        assert stats.completion_tokens > 0
    finally:
        b.close()


def test_each_sequence_its_own_sampling_and_limit(session: Any, batcher: Any) -> None:
    """Seeded sampling with every filter, a penalty, and limits that differ: each
    sequence draws exactly what it draws alone (the same chain, the same seed)."""
    prompts = [chat(session, q) for q in QUESTIONS]
    samplings = [
        sampling(max_tokens=5),
        sampling(temperature=0.9, seed=7, max_tokens=30),
        sampling(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                 seed=3, max_tokens=17),
        sampling(temperature=50.0, top_p=0.05, seed=11, max_tokens=9),
    ]
    want = [alone(session, p, s) for p, s in zip(prompts, samplings, strict=True)]
    stats = [GenerationStats() for _ in prompts]
    for k, (p, s) in enumerate(zip(prompts, samplings, strict=True)):
        batcher.add(k, p, s, stats[k])
    texts = dict.fromkeys(range(4), "")
    drain(batcher, texts)
    for k in range(4):
        text, single = want[k]
        assert texts[k] == text, (k, texts[k], text)
        assert stats[k].finish_reason == single.finish_reason
        assert stats[k].completion_tokens == single.completion_tokens
    assert stats[0].completion_tokens == 5 and stats[0].finish_reason == "length"


def test_cancel_one_mid_flight(session: Any, batcher: Any) -> None:
    prompts = [chat(session, q) for q in QUESTIONS[:3]]
    s = sampling(max_tokens=20, temperature=0.8, seed=5)
    want = [alone(session, p, s)[0] for p in prompts]
    stats = [GenerationStats() for _ in prompts]
    for k, p in enumerate(prompts):
        batcher.add(k, p, s, stats[k])
    texts = dict.fromkeys(range(3), "")
    for _ in range(4):
        for key, piece in batcher.step():
            assert piece is not None
            texts[key] += piece
    batcher.cancel(1)
    batcher.cancel(1)  # twice, and for a key never added: no effect
    batcher.cancel(99)
    first = batcher.step()
    assert (1, None) in first and sum(1 for k, p in first if k == 1) == 1
    for key, piece in first:
        if piece is not None:
            texts[key] += piece
    assert stats[1].completion_tokens == 4 and want[1].startswith(texts[1])
    assert batcher._slots[1].seq is None  # its slot is free for the next sequence...
    late = chat(session, QUESTIONS[3])
    batcher.add(3, late, s, GenerationStats())
    assert batcher._seqs[3].slot == 1  # ...which fills the gap: slots 0-2 stay consecutive
    texts[3] = ""
    drain(batcher, texts, until={0, 2, 3})
    assert (texts[0], texts[2], texts[3]) == (want[0], want[2], alone(session, late, s)[0])


def test_admit_while_others_decode(session: Any, batcher: Any) -> None:
    """A sequence added between steps prefills while the others keep decoding."""
    prompts = [chat(session, q, SYSTEM if k >= 2 else None) for k, q in enumerate(QUESTIONS)]
    s = sampling(max_tokens=16)
    want = [alone(session, p, s)[0] for p in prompts]
    texts = dict.fromkeys(range(4), "")
    stats = [GenerationStats() for _ in prompts]
    batcher.add(0, prompts[0], s, stats[0])
    batcher.add(1, prompts[1], s, stats[1])
    for _ in range(3):
        for key, piece in batcher.step():
            assert piece is not None
            texts[key] += piece
    batcher.add(2, prompts[2], s, stats[2])
    mixed = batcher.step()  # a decode token of 0 and 1, and the prompt of 2
    assert {k for k, p in mixed if p is not None} == {0, 1, 2}
    for key, piece in mixed:
        texts[key] += piece or ""
    batcher.add(3, prompts[3], s, stats[3])
    drain(batcher, texts)
    assert [texts[k] for k in range(4)] == want


def test_prefix_reuse_several_prompts(session: Any, batcher: Any) -> None:
    """Two system prompts in turn, as an agent alternating tools: each finds its cells
    in its own slot and prefills only the new message; the reply is the one without
    reuse."""
    long_a = "You are a careful assistant. You check every fact twice. " * 12
    long_b = "You answer in one short sentence, like a telegram. " * 12
    s = sampling(max_tokens=12)

    def run(key: int, prompt: Prompt) -> tuple[str, GenerationStats]:
        stats = GenerationStats()
        batcher.add(key, prompt, s, stats)
        texts = {key: ""}
        drain(batcher, texts)
        return texts[key], stats

    a1, b1 = chat(session, "Hi.", long_a), chat(session, "Hi.", long_b)
    run(0, a1)
    run(1, b1)
    a2, b2 = chat(session, "Name a color.", long_a), chat(session, "Name a color.", long_b)
    text_a, stats_a = run(2, a2)
    text_b, stats_b = run(3, b2)
    assert len(a2.tokens) - reused(a1, a2) == stats_a.prefill_tokens < len(a2.tokens) // 2
    assert len(b2.tokens) - reused(b1, b2) == stats_b.prefill_tokens < len(b2.tokens) // 2
    assert text_a == alone(session, a2, s)[0]
    assert text_b == alone(session, b2, s)[0]
    # the same prompt again: only its last 64 tokens are fed
    again, stats = run(4, a2)
    assert stats.prefill_tokens == 64 and again == text_a


def single_logits(session: Any, prompt: Prompt) -> Any:
    """The logits the single path draws its first token from, the prompt fed whole."""
    import numpy as np

    session._engine.llm.reset()
    pieces = session.generate(prompt, sampling(max_tokens=2), CancelToken(), GenerationStats())
    next(pieces)  # the prompt is evaluated, its last token's logits are the context's
    row = session._engine.lc.llama_get_logits_ith(session._engine.ctx, -1)
    logits = np.ctypeslib.as_array(row, shape=(session._engine.llm.n_vocab(),)).copy()
    pieces.close()
    return logits


def batch_logits(batcher: Any, key: int, prompt: Prompt) -> tuple[Any, GenerationStats]:
    """The logits the batcher draws the first token of ``prompt`` from, and its stats."""
    import numpy as np

    stats = GenerationStats()
    batcher.add(key, prompt, sampling(max_tokens=1), stats)
    seq = batcher._seqs[key]
    while seq.n_past < len(prompt.tokens):
        batcher.step()  # the last decode of the step that ends the prompt is its own
    row = batcher._lc.llama_get_logits_ith(batcher._ctx, seq.out)
    logits = np.ctypeslib.as_array(row, shape=(batcher._n_vocab,)).copy()
    if key in batcher._seqs:
        drain(batcher, {key: ""})
    return logits, stats


def test_prompt_logits_bit_identical_to_the_single_path(session: Any, batcher: Any) -> None:
    """Every prompt token computed as the single path computes the whole prompt: the
    first token's logits are the same bits, fed whole or after reusing cells, for a
    prompt under 64 tokens (row by row), one of one tiled 512-token piece, and one of a
    tiled piece and a short last piece, with the reused cells ending in either."""
    import numpy as np

    words = "Customers ask about bread, cakes, opening hours and orders. "
    system, n = "", 0
    while not 512 + 8 < n < 512 + 56:  # a short last piece, computed row by row
        system += words
        n = len(chat(session, "Name a color.", system).tokens)
        assert n < 600, "no prompt length in the range"
    cases = [  # (cells first, then the prompt measured)
        (chat(session, "Hi."), chat(session, "Name a fruit.")),
        (chat(session, "Hi.", SYSTEM), chat(session, "Name a fruit.", SYSTEM)),
        (chat(session, "Name a color.", system), chat(session, "Name a tree.", system)),
        (chat(session, "Name a color.", system), chat(session, "Name a fruit.", system[8:])),
    ]
    assert len(cases[0][1].tokens) < 64 < len(cases[1][1].tokens) < 512
    assert shared(*cases[2]) > 512 and shared(*cases[3]) < 64
    key = 0
    for before, prompt in cases:
        fresh, _ = batch_logits(batcher, key, prompt)
        batch_logits(batcher, key + 1, before)
        reused, stats = batch_logits(batcher, key + 2, prompt)
        key += 3
        want = single_logits(session, prompt)
        assert np.array_equal(fresh, want), (key, float(np.abs(fresh - want).max()))
        assert np.array_equal(reused, want), (key, float(np.abs(reused - want).max()))
        assert stats.prefill_tokens < len(prompt.tokens) or shared(before, prompt) < 32


def test_reusable_prefix() -> None:
    from localrun.backends.llama_cpp.reuse import reusable_prefix

    def keep(n: int, common: int, cached: int | None = None) -> int:
        return reusable_prefix(n, common, 512, n if cached is None else cached)

    assert keep(30, 20) == 20  # one short piece: row by row anyway
    assert keep(30, 29) == 28  # two tokens fed, as in the piece computed whole
    assert keep(30, 40) == 28  # (the last token is always fed)
    assert keep(513, 512) == 512  # a piece of one token: one token it is
    assert keep(91, 81) == 27  # a tiled piece: its last 64 tokens recomputed
    assert keep(91, 20) == 20
    assert keep(530, 520) == 520  # in the short last piece [512, 530), row by row
    assert keep(530, 500) == 448  # in the tiled piece [0, 512)
    assert keep(1100, 1030) == 1030  # [1024, 1100) is tiled and keeps 70 tokens
    assert keep(1100, 1050) == 1036
    assert keep(5, 0) == 0
    # only the slot's prompt counts (a reply was decoded a token at a time)...
    assert keep(200, 150, cached=100) == 100
    # ...and only pieces its prompt computed with the kernel this prompt's piece takes
    assert keep(200, 30, cached=32) == 0  # [0, 32) went row by row, [0, 200) is tiled
    assert keep(600, 520, cached=530) == 512  # [512, 530) row by row, [512, 600) tiled
    assert keep(560, 540, cached=530) == 530  # [512, 560) goes row by row too
def test_shared_prefix_copied_from_a_running_sequence(session: Any, batcher: Any) -> None:
    """Two requests with one long system prompt at once: the second copies the first's
    cells into its own slot instead of prefilling them."""
    system = "You are a helpful assistant for a hardware store. " * 10
    p1, p2 = chat(session, "Do you sell nails?", system), chat(session, "Name a tool.", system)
    s = sampling(max_tokens=10)
    want = [alone(session, p, s)[0] for p in (p1, p2)]
    stats = [GenerationStats(), GenerationStats()]
    texts = {0: "", 1: ""}
    batcher.add(0, p1, s, stats[0])
    for key, piece in batcher.step():  # prefilled, and its first token
        texts[key] += piece or ""
    batcher.add(1, p2, s, stats[1])
    assert shared(p1, p2) > 100 and stats[1].prefill_tokens == len(p2.tokens) - reused(p1, p2)
    drain(batcher, texts)
    assert texts == {0: want[0], 1: want[1]}


def test_structured_output_enforced_per_sequence(session: Any, batcher: Any) -> None:
    """A schema-constrained sequence next to a free one: the constrained reply is valid
    JSON and the single path's; the free one is untouched."""
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    constraint = Constraint.json(schema)
    session.check_constraint(constraint)
    p_json = chat(session, "Describe a person as JSON.")
    p_free = chat(session, QUESTIONS[0])
    s_json = sampling(max_tokens=40, constraint=constraint)
    want_json = alone(session, p_json, s_json)[0]
    want_free = alone(session, p_free, sampling())[0]
    stats = [GenerationStats(), GenerationStats()]
    batcher.add(0, p_json, s_json, stats[0])
    batcher.add(1, p_free, sampling(), stats[1])
    texts = {0: "", 1: ""}
    drain(batcher, texts)
    assert texts[0] == want_json and texts[1] == want_free
    value = json.loads(texts[0])
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert stats[0].finish_reason == "stop"


def test_a_grammar_failure_ends_that_sequence_alone(session: Any, batcher: Any) -> None:
    """A matcher that rejects a token fails its own sequence (stats.error, then its end);
    the sequence beside it goes on to the single path's reply."""
    from localrun.errors import GenerationError

    constraint = Constraint.json({"type": "object"})
    session.check_constraint(constraint)
    stats = [GenerationStats(), GenerationStats()]
    batcher.add(0, chat(session, "Give me JSON."), sampling(constraint=constraint), stats[0])
    batcher.add(1, chat(session, QUESTIONS[0]), sampling(), stats[1])

    def reject(token: int) -> None:
        raise GenerationError("llama.cpp", f"the constrained decoder rejected token {token}")

    batcher._seqs[0].mask.consume = reject
    texts = {0: "", 1: ""}
    drain(batcher, texts)
    assert isinstance(stats[0].error, GenerationError) and texts[0] == ""
    assert stats[1].error is None and texts[1] == alone(session, chat(session, QUESTIONS[0]),
                                                        sampling())[0]


def test_close_frees_the_context(session: Any) -> None:
    from localrun.backends.llama_cpp.batcher import LlamaCppBatcher

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    before = rss()
    b = LlamaCppBatcher(session.engine, 8, 2048)  # 8 x 2048 cells x 23 KB: about 360 MiB
    kv = 8 * 2048 * 23040
    assert rss() - before > kv * 0.8
    stats = GenerationStats()
    b.add(0, chat(session, QUESTIONS[0]), sampling(max_tokens=30), stats)
    b.step()
    b.close()
    assert rss() - before < kv * 0.2
    assert b.step() == [(0, None)]  # the sequence in flight ended
    b.close()  # idempotent
    with pytest.raises(LocalrunError, match="closed"):
        b.add(1, chat(session, QUESTIONS[0]), sampling(), GenerationStats())


def test_session_batcher_made_once_and_closed_with_it() -> None:
    from localrun.backends.llama_cpp.session import LlamaCppSession

    s = LlamaCppSession(LoadRequest(path=str(test_model("gguf-q8_0")), format="gguf",
                                    context=512, exact=True))
    try:
        b = s.batcher()
        assert b is not None and s.batcher() is b and s.batch_alone  # lone ones too, now
        assert b.capacity >= 2 and b.n_ctx_seq == 512
    finally:
        s.close()
    assert b._ctx is None
    s.close()


def test_load_max_concurrency_builds_that_many_streams() -> None:
    """``load(max_concurrency=3)``: the batch context holds 3 KV streams of the whole
    context (where memory would allow 8), and Model reports 3 and their bytes (its
    footprint's fixed part, whatever runs); 1 builds no batch context at all (the model
    runs one sequence at a time)."""
    import localrun
    from localrun.backends.llama_cpp.memory import kv_bytes_per_token

    path = str(test_model("gguf-q8_0"))
    with localrun.load(path, backend="llama.cpp", context=512, device="cpu",
                       max_concurrency=3) as m:
        assert m.max_concurrency == 3
        session = m._session
        stream = 512 * kv_bytes_per_token(session.engine)
        est = session.estimate()
        assert est is not None and m.footprint(3) == Footprint(3, est.total_bytes + 3 * stream,
                                                               0, 0)
        assert m.footprint(1).total == m.footprint().total  # held whatever runs
        b = session._batcher
        assert b.capacity == 3
        assert int(session._engine.lc.llama_n_seq_max(b._ctx)) == 3  # the engine's own count
        assert int(session._engine.lc.llama_n_ctx(b._ctx)) == 3 * 512
    with localrun.load(path, backend="llama.cpp", context=512, device="cpu",
                       max_concurrency=1) as m:
        assert m.max_concurrency == 1 and m.footprint(4).slots == 1
        assert m.footprint(4).total == m._session.estimate().total_bytes
        assert getattr(m._session, "_batcher", None) is None
    with pytest.raises(LocalrunError, match="max_concurrency 0"):
        localrun.load(path, max_concurrency=0)


def test_a_limit_after_the_batcher_is_built_caps_what_runs_at_once() -> None:
    """``Model.limit_concurrency`` once the batch context exists: its slots stay (their
    memory is held already), but the driver admits no more than the limit at a time."""
    import localrun

    with localrun.load(str(test_model("gguf-q8_0")), backend="llama.cpp", context=512,
                       device="cpu") as m:
        built = m.max_concurrency  # builds it: as many slots as memory holds
        assert built > 2
        m.limit_concurrency(2)
        batcher = m._session._batcher
        assert m.max_concurrency == 2 and batcher.capacity == built
        real_step, in_flight = batcher.step, []

        def step() -> Any:
            in_flight.append(len(m._driver._flight))
            return real_step()

        batcher.step = step
        out = m.batch(["1, 2, 3,"] * 4, max_tokens=4, temperature=0)
        del batcher.step
    assert len(out) == 4 and max(in_flight) == 2


def test_capacity_fits_the_budget() -> None:
    from localrun.backends.llama_cpp.memory import KV_BUDGET, MAX_CAPACITY, batch_capacity

    assert batch_capacity(1 << 20, None) == MAX_CAPACITY
    assert batch_capacity(KV_BUDGET // 3, None) == 3
    assert batch_capacity(KV_BUDGET // 3, 16 << 30) == 3
    assert batch_capacity(1 << 30, 8 << 30) == 2  # a quarter of what is available
    assert batch_capacity(1 << 30, 4 << 30) == 1  # the session then runs one at a time


def test_common_prefix() -> None:
    from localrun.backends.prefix import common_prefix

    a = list(range(1000))
    assert common_prefix(a, a) == 1000
    assert common_prefix(a, a[:300]) == 300
    assert common_prefix(a, [*a[:700], -1, *a[701:]]) == 700
    assert common_prefix(a, [-1]) == 0 and common_prefix([], a) == 0


def test_model_calls_from_threads_run_together() -> None:
    """Through localrun's driver: calls from several threads at once go through this
    batcher, and each gets the reply it gets alone."""
    import threading

    import localrun
    from localrun.backends.llama_cpp.batcher import LlamaCppBatcher

    with localrun.load(str(test_model("gguf-q8_0")), backend="llama.cpp",
                       context=CONTEXT, device="cpu", exact=True) as model:
        want = [model.chat(q, temperature=0, max_tokens=16).text for q in QUESTIONS]
        got: dict[int, str] = {}
        start = threading.Barrier(len(QUESTIONS))

        def ask(k: int) -> None:
            start.wait()
            got[k] = model.chat(QUESTIONS[k], temperature=0, max_tokens=16).text

        threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(QUESTIONS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [got[k] for k in range(len(QUESTIONS))] == want
        assert isinstance(model._driver._batcher, LlamaCppBatcher)


def test_footprint_says_what_the_batch_context_will_hold_before_it_is_built() -> None:
    """``Model.footprint(n)``: the KV streams the batch context would have (within
    limit_concurrency and the budget) and the bytes of each, asked without building it,
    so that a caller (``localrun serve --max-memory``) sizes it first; once built, what
    it holds is in the fixed part, and what the batcher really allocated (its context's
    own count of cells) is what footprint(n) - footprint(1) said before."""
    import localrun
    from localrun.backends.llama_cpp.memory import kv_bytes_per_token

    path = str(test_model("gguf-q8_0"))
    with localrun.load(path, backend="llama.cpp", context=512, device="cpu") as m:
        session = m._session
        m.limit_concurrency(3)  # (load(max_concurrency=3) would build it at once)
        stream = 512 * kv_bytes_per_token(session.engine)
        one, four = m.footprint(1), m.footprint(4)
        est = session.estimate()
        assert est is not None and est.kv_cache_bytes == stream  # one KV cache: one stream
        assert one == Footprint(1, est.total_bytes, 0, 0)  # no batch context for one
        assert four == Footprint(3, est.total_bytes, stream, 0)  # within the limit
        assert getattr(session, "_batcher", None) is None  # asking built nothing
        m.limit_concurrency(2)
        planned = m.footprint(2)
        assert planned == Footprint(2, est.total_bytes, stream, 0)
        assert m.max_concurrency == 2  # builds it, with 2 streams
        b = session._batcher
        lc = session._engine.lc
        cells = int(lc.llama_n_ctx(b._ctx))  # the engine's own count of its KV cells
        assert cells * kv_bytes_per_token(session.engine) == planned.total - one.total
        assert b.reserved_bytes == planned.total - one.total
        assert m.footprint(2) == Footprint(2, est.total_bytes + 2 * stream, 0, 0)
        assert m.footprint(1).total == planned.total  # held whatever runs now
        assert m.footprint().kept == 0  # its reused cells are in its slots, counted
    with pytest.raises(LocalrunError, match="slots 0"):
        m.footprint(0)


def test_model_has_no_separate_sizing_properties() -> None:
    """One memory contract: ``Model.footprint``; the sizing properties it replaced are
    gone from the public Model and from the Session contract."""
    import localrun
    from localrun.backends.base import Session

    for name in ("batch_slots", "kept_cache_bytes", "batch_reserved_bytes", "batch_alone"):
        assert not hasattr(localrun.Model, name), name
    for name in ("batch_slots", "kept_cache_bytes"):
        assert not hasattr(Session, name), name
    assert callable(localrun.Model.footprint) and callable(Session.footprint)
