"""KV reuse across calls on ONNX Runtime GenAI (issue 15, Deliver 1): a session keeps one
og.Generator, and a call prefills only what its prompt adds to the rows the previous
prompt left; the reply is the one a fresh generator gives (greedy: token for token;
seeded sampling: the same text), whatever ran before, after a closed or cancelled
stream, and for a prompt that shares nothing.

The fresh reference is the engine's own loop (a new og.Generator, greedy search,
``generate_next_token``), which is what localrun ran before the Generator was kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from localrun.backends.base import GenerationStats, Prompt
from localrun.backends.prefix import common_prefix
from localrun.sampling import ResolvedSampling
from localrun.types import CancelToken
from tests.models import test_model

pytest.importorskip("onnxruntime_genai",
                    reason="ONNX Runtime GenAI is not installed (pip install -e '.[onnx]')")

CONTEXT = 4096
SYSTEM = "You are a helpful assistant. Answer in a few plain sentences."
#: onnx_genai.ROW_TILE: the int4 matmul's row tile on CPU (the reuse rule's unit)
ROW_TILE = 128
TURNS = ["Tell me about the sea.", "Why is it salty?", "What lives at the bottom?",
         "Say hello."]


def sampling(max_tokens: int = 24, temperature: float = 0.0, seed: int = 0,
             **kw: Any) -> ResolvedSampling:
    opts: dict[str, Any] = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    opts.update(kw)
    return ResolvedSampling(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=(),
                            **opts)


@pytest.fixture(scope="module")
def path() -> str:
    return str(test_model("onnx-int4"))


@pytest.fixture(scope="module")
def session(path: str) -> Iterator[Any]:
    from localrun.backends.base import LoadRequest
    from localrun.backends.onnx.session import BACKEND

    s = BACKEND.load(LoadRequest(path, "onnx", context=CONTEXT, exact=True))
    yield s
    s.close()


@pytest.fixture(scope="module")
def engine(path: str) -> Any:
    """The engine's own greedy loop on a new Generator per call: the fresh reference."""
    import onnxruntime_genai as og

    model = og.Model(path)
    eos = 2  # SmolLM2's <|im_end|>, its only EOS

    def greedy(tokens: list[int], n: int) -> list[int]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(tokens) + n, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(tokens)
        out: list[int] = []
        while len(out) < n:
            gen.generate_next_token()
            t = int(gen.get_next_tokens()[0])
            if t == eos:
                break
            out.append(t)
        return out

    return greedy


def run(session: Any, prompt: Prompt, s: ResolvedSampling, take: int | None = None
        ) -> tuple[str, GenerationStats]:
    """The reply's text and stats; ``take`` pieces only, then the stream is closed."""
    stats = GenerationStats()
    pieces = session.generate(prompt, s, CancelToken(), stats)
    out = []
    for piece in pieces:
        out.append(piece)
        if take is not None and len(out) >= take:
            break
    pieces.close()
    return "".join(out), stats


def text_of(session: Any, tokens: list[int]) -> str:
    return str(session._tok.decode(tokens))


def chat(session: Any, messages: list[dict[str, str]]) -> Prompt:
    return session.encode_chat(messages)  # type: ignore[no-any-return]


def long_text(session: Any, n: int, seed: int = 0) -> list[int]:
    """A raw-text prompt of exactly ``n`` tokens (no chat template)."""
    words = ["river", "stone", "harbour", "lantern", "copper", "meadow", "signal", "orchard",
             "basalt", "violet", "engine", "quarry"]
    text = " ".join(words[(i * 7 + seed) % len(words)] + str(i % 13) for i in range(n))
    return list(session.encode_text(text).tokens)[:n]


# -- what is prefilled ------------------------------------------------------------------


def test_a_turn_prefills_only_what_the_conversation_adds(session: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn 2 runs the previous reply and the new message, not the system prompt and
    turn 1 again (before the Generator was kept: the whole prompt, every turn). No
    settling here (it would reuse the reply's rows too, when it had the time)."""
    monkeypatch.setattr(session, "_settle_delay", None)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    first = chat(session, messages)
    reply, stats1 = run(session, first, sampling(16))
    assert stats1.prefill_tokens <= len(first.tokens)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": TURNS[1]}]
    second = chat(session, messages)
    assert list(second.tokens[:len(first.tokens)]) == list(first.tokens)
    _, stats2 = run(session, second, sampling(8))
    added = len(second.tokens) - len(first.tokens)
    assert stats2.prefill_tokens < len(second.tokens)
    # the new part (and up to 2 rows more, or one tile where the prompt is 1 mod 128,
    # to run every row as a fresh prefill does)
    most = added + (ROW_TILE if len(second.tokens) % ROW_TILE == 1 else 2)
    assert added <= stats2.prefill_tokens <= most, (stats2.prefill_tokens, added)


def test_a_shared_long_system_prompt_is_prefilled_once(session: Any, engine: Any) -> None:
    """An agent's second call with the same long system prompt prefills only its own
    question; the kept Generator grows past its first size (1024 tokens) on the way,
    and the replies are the fresh ones."""
    system = text_of(session, long_text(session, 700))
    prompts = [chat(session, [{"role": "system", "content": system},
                              {"role": "user", "content": q}])
               for q in ("Summarise the text above.", "Which word comes first?")]
    for i, p in enumerate(prompts):
        # the first asks for 400 tokens (the Generator must hold 1100) and takes 8
        text, stats = run(session, p, sampling(400 if i == 0 else 8), take=8)
        assert text == text_of(session, engine(list(p.tokens), 8))
    a, b = (list(p.tokens) for p in prompts)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared > 650
    assert stats.prefill_tokens <= len(prompts[1].tokens) - shared + 2 < 40
    assert session._gen_tokens >= 2048  # grown: the first call needed 700 + 400 tokens


# -- the same replies with and without reuse ---------------------------------------------


def test_greedy_multi_turn_equals_fresh_after_another_conversation(path: str) -> None:
    """Through the Model API: a Model that first ran a different conversation sharing
    the system prompt answers every turn of a conversation as a fresh Model does."""
    import localrun

    greedy: dict[str, Any] = {"temperature": 0.0, "max_tokens": 32}
    with localrun.load(path, backend="onnx", context=CONTEXT, exact=True) as reused:
        reused.chat([{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "Name three birds."}], **greedy)
        messages = [{"role": "system", "content": SYSTEM}]
        finishes = set()
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            got = reused.chat(messages, **greedy)
            with localrun.load(path, backend="onnx", context=CONTEXT, exact=True) as fresh:
                want = fresh.chat(messages, **greedy)
            assert got.text == want.text, (turn, got.text, want.text)
            assert got.usage.prompt_tokens == want.usage.prompt_tokens
            finishes.add(got.finish_reason)
            messages.append({"role": "assistant", "content": got.text})
    assert finishes == {"stop", "length"}  # a reply that ended at EOS was reused after too


@pytest.mark.parametrize("lengths", [
    (300, 129), (129, 130), (130, 257), (257, 385), (200, 201), (384, 386), (20, 1),
    (600, 300), (140, 270), (270, 140)])
def test_greedy_equals_fresh_at_the_row_tile_edges(session: Any, engine: Any,
                                                   lengths: tuple[int, int]) -> None:
    """The second prompt shares the first's first tokens; its reply is the fresh one
    where a one-row tile would make the rows differ (prompt lengths 1 mod 128, a rest
    of 1 mod 128), and the call prefills less than the whole prompt where it can."""
    tokens = long_text(session, max(lengths))
    first, second = tokens[:lengths[0]], tokens[:lengths[1]]
    run(session, Prompt(first), sampling(3))
    text, stats = run(session, Prompt(second), sampling(12))
    assert text == text_of(session, engine(second, 12))
    if len(second) > len(first) and len(second) % ROW_TILE != 1:
        assert stats.prefill_tokens <= len(second) - len(first) + 2


def test_seeded_sampling_is_the_same_on_a_reused_and_a_fresh_generator(path: str,
                                                                        session: Any) -> None:
    """Each call samples with its own options and seed, kept Generator or not; the
    filters and the penalty on (localrun samples every token from the logits)."""
    from localrun.backends.base import LoadRequest
    from localrun.backends.onnx.session import BACKEND

    prompt = chat(session, [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "Write a short poem about rain."}])
    options = [dict(temperature=1.0, top_p=0.9), dict(temperature=0.8, top_k=40, min_p=0.05,
                                                      repetition_penalty=1.2),
               dict(temperature=1.5)]
    run(session, chat(session, [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": "Hi."}]), sampling(8, 1.0, seed=3))
    reused = [run(session, prompt, sampling(20, seed=7, **o))[0] for o in options]
    again = [run(session, prompt, sampling(20, seed=7, **o))[0] for o in options]
    fresh = BACKEND.load(LoadRequest(path, "onnx", context=CONTEXT, exact=True))
    try:
        want = [run(fresh, prompt, sampling(20, seed=7, **o))[0] for o in options]
        other = run(fresh, prompt, sampling(20, seed=8, **options[0]))[0]
    finally:
        fresh.close()
    assert reused == want == again
    assert other != want[0]
    assert len(set(want)) == len(want)  # the options mattered


# -- streams that stop early, and prompts that share nothing -------------------------------


@pytest.mark.parametrize("how", ["closed", "cancelled"])
def test_a_stopped_stream_leaves_the_generator_reusable(session: Any, engine: Any,
                                                        how: str) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    first = chat(session, messages)
    if how == "closed":
        partial, _ = run(session, first, sampling(64), take=3)
    else:
        cancel = CancelToken()
        stats = GenerationStats()
        pieces = []
        for piece in session.generate(first, sampling(64), cancel, stats):
            pieces.append(piece)
            if len(pieces) == 3:
                cancel.cancel()
        assert len(pieces) == 3 and stats.finish_reason == "length"
        partial = "".join(pieces)
    assert partial
    messages += [{"role": "assistant", "content": partial}, {"role": "user", "content": "Go on."}]
    second = chat(session, messages)
    text, stats = run(session, second, sampling(16))
    assert text == text_of(session, engine(list(second.tokens), 16))
    assert stats.prefill_tokens < len(second.tokens) - len(first.tokens) + 2


def test_a_prompt_that_shares_nothing(session: Any, engine: Any) -> None:
    run(session, chat(session, [{"role": "user", "content": TURNS[0]}]), sampling(4))
    tokens = long_text(session, 90, seed=5)
    text, stats = run(session, Prompt(tokens), sampling(12))
    assert stats.prefill_tokens == len(tokens)
    assert text == text_of(session, engine(tokens, 12))


def test_a_stream_left_open_fails_once_a_newer_call_took_the_generator(session: Any) -> None:
    from localrun.errors import GenerationError

    old = session.generate(Prompt(long_text(session, 30)), sampling(16), CancelToken(),
                           GenerationStats())
    next(old)
    run(session, Prompt(long_text(session, 40, seed=3)), sampling(4))
    with pytest.raises(GenerationError, match="newer call"):
        next(old)


def test_close_frees_the_kept_generator(path: str) -> None:
    from localrun.backends.base import LoadRequest
    from localrun.backends.onnx.session import BACKEND

    s = BACKEND.load(LoadRequest(path, "onnx", context=CONTEXT, exact=True))
    run(s, Prompt(long_text(s, 20)), sampling(4))
    assert s._gen is not None
    s.close()
    s.close()  # idempotent
    assert s._gen is None and s._model is None


# -- settling: the previous reply's rows recomputed as a prefill between calls -------------


def load(path: str) -> Any:
    from localrun.backends.base import LoadRequest
    from localrun.backends.onnx.session import BACKEND

    return BACKEND.load(LoadRequest(path, "onnx", context=CONTEXT, exact=True))


def test_settled_reply_rows_are_reused_and_the_replies_stay_fresh(path: str,
                                                                   engine: Any) -> None:
    """A conversation with replies of up to 150 tokens (over the 128-row tiles): once a
    reply's rows are settled (the test waits for it, as a user reading the reply does),
    the next turn prefills only what comes after the reply, and every reply is the one
    a fresh generator gives (before settling: each turn prefilled the previous reply)."""
    s = load(path)
    try:
        messages = [{"role": "system", "content": SYSTEM}]
        asks = ["Write a long story about a lighthouse keeper.", "Continue the story.",
                "Now tell me about the sea near the lighthouse.", "Say hello."]
        held: list[int] = []  # the previous prompt + reply tokens
        replies = []
        for i, ask in enumerate(asks):
            messages.append({"role": "user", "content": ask})
            prompt = chat(s, messages)
            tokens = list(prompt.tokens)
            text, stats = run(s, prompt, sampling(150))
            want = engine(tokens, 150)
            assert text == text_of(s, want), (i, text, text_of(s, want))
            if i:
                shared = common_prefix(held, tokens)
                assert shared == len(held)  # the reply's ids come back in the next prompt
                most = len(tokens) - shared + (ROW_TILE if len(tokens) % ROW_TILE == 1 else 2)
                assert stats.prefill_tokens <= most, (i, stats.prefill_tokens, most)
                assert stats.prefill_tokens < len(tokens) - len(held) + replies[-1] // 4
            assert s._settled.wait(60), "the settle did not end"
            settle = s._last_settle
            assert settle is not None and not settle.failed
            assert settle.done == settle.total == len(tokens) + len(want) + (len(want) < 150)
            held = tokens + want
            replies.append(len(want))
            messages.append({"role": "assistant", "content": text})
        assert sum(replies[:-1]) >= 200 and max(replies) > 100, replies
    finally:
        s.close()


def slow_settle(monkeypatch: pytest.MonkeyPatch, s: Any) -> None:
    """Settle at once, in pieces of 2 rows: a 240-token reply takes ~120 pieces."""
    from localrun.backends.onnx import session as onnx_genai

    monkeypatch.setattr(onnx_genai, "SETTLE_FIRST_ROWS", 2)
    monkeypatch.setattr(onnx_genai, "SETTLE_MIN_ROWS", 2)
    monkeypatch.setattr(onnx_genai, "SETTLE_MAX_ROWS", 2)
    s._settle_delay = 0.0


def settling(s: Any) -> Any:
    """The settle running now, once it has settled a piece."""
    import time

    deadline = time.monotonic() + 60
    while (s._last_settle is None or s._last_settle.pieces == 0) and time.monotonic() < deadline:
        time.sleep(0.001)
    settle = s._last_settle
    assert settle is not None and settle.pieces > 0 and settle.thread.is_alive()
    return settle


def test_a_call_during_a_settle_waits_for_one_piece_and_uses_it(
        path: str, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that comes mid-settle stops it after the piece running (not the whole
    settle), reuses the rows settled so far, and gives the fresh reply."""
    s = load(path)
    try:
        slow_settle(monkeypatch, s)
        first = long_text(s, 60)
        reply = engine(first, 240)
        assert len(reply) == 240
        text, _ = run(s, Prompt(first), sampling(240))
        assert text == text_of(s, reply)
        second = first + reply + long_text(s, 20, seed=9)
        settle = settling(s)
        before = settle.done
        text, stats = run(s, Prompt(second), sampling(12))
        assert not settle.thread.is_alive()
        # it ran a few more 2-row pieces at most (a few calls' time), not the 240 rows
        assert len(first) < settle.done <= before + 12, (before, settle.done, settle.total)
        assert len(second) - settle.done <= stats.prefill_tokens <= len(second) - settle.done + 1
        assert text == text_of(s, engine(second, 12))
    finally:
        s.close()


def test_close_during_a_settle(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    s = load(path)
    slow_settle(monkeypatch, s)
    run(s, Prompt(long_text(s, 60)), sampling(240))
    settle = settling(s)
    s.close()
    assert not settle.thread.is_alive() and not settle.failed
    assert settle.done < settle.total - 100
    assert s._gen is None and s._settled.is_set()


class FailingSettle:
    """The kept og.Generator, whose ``append_tokens`` fails off the caller's thread."""

    def __init__(self, gen: Any) -> None:
        self.gen = gen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.gen, name)

    def append_tokens(self, tokens: Any) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("injected failure")
        self.gen.append_tokens(tokens)


def test_a_failed_settle_raises_nothing_and_the_next_call_starts_cold(path: str,
                                                                      engine: Any) -> None:
    s = load(path)
    try:
        first = long_text(s, 40)
        run(s, Prompt(first), sampling(4))
        s._gen = FailingSettle(s._gen)
        s._settle_delay = 0.0
        run(s, Prompt(first), sampling(30))
        assert s._settled.wait(60) and s._last_settle.failed and s._broken
        second = long_text(s, 70)
        text, stats = run(s, Prompt(second), sampling(12))
        assert stats.prefill_tokens == len(second)  # a new Generator: nothing reused
        assert not isinstance(s._gen, FailingSettle)
        assert text == text_of(s, engine(second, 12))
    finally:
        s.close()


# -- localrun's sampler (no model) --------------------------------------------------------


def test_the_sampler_draws_from_the_filtered_distribution() -> None:
    """Frequencies over many seeded draws match softmax(score / T) over what top_k keeps,
    and the same seed draws the same tokens."""
    np = pytest.importorskip("numpy")
    from localrun.backends.logits_sampler import LogitsSampler

    scores = np.array([2.0, 1.5, 1.5, 0.3, -1.0, 4.0, -np.inf, 0.0], dtype=np.float32)
    s = sampling(temperature=0.7, top_k=5, seed=11)
    kept = np.argsort(-scores, kind="stable")[:5]
    p = np.zeros(scores.shape[0])
    p[kept] = np.exp((scores[kept] - scores.max()) / 0.7)
    p /= p.sum()
    draws = 20000
    sampler = LogitsSampler(s, np.array([], dtype=np.int32))
    counts = np.bincount([sampler.choose(scores.copy()) for _ in range(draws)],
                         minlength=scores.shape[0])
    sigma = np.sqrt(draws * p * (1 - p)) + 1
    assert (np.abs(counts - draws * p) < 5 * sigma).all(), (counts, draws * p)
    def draw(seed: int) -> list[int]:
        one = LogitsSampler(sampling(temperature=1.0, seed=seed), np.array([], dtype=np.int32))
        return [one.choose(scores.copy()) for _ in range(50)]

    assert draw(5) == draw(5) != draw(6)


def test_a_draw_over_many_blocks_keeps_the_distribution_and_the_mask() -> None:
    """Over a whole vocabulary (a block at a time, logits_sampler.BLOCK): masked tokens
    never come, and each kept token comes as often as softmax(score / T) says."""
    np = pytest.importorskip("numpy")
    from localrun.backends.logits_sampler import BLOCK, LogitsSampler

    rng = np.random.default_rng(4)
    scores = (rng.standard_normal(5 * BLOCK + 77) * 2).astype(np.float32)
    scores[rng.random(scores.shape[0]) < 0.3] = -np.inf  # a structured-output mask
    best = np.argsort(-scores)[:3]
    scores[best] += 6.0  # a few likely tokens, as a model's logits have, in any block
    p = np.exp(np.float64(scores - scores.max()) / 1.3)
    p /= p.sum()
    draws = 6000
    sampler = LogitsSampler(sampling(temperature=1.3, seed=2), np.array([], dtype=np.int32))
    got = np.array([sampler.choose(scores.copy()) for _ in range(draws)])
    assert np.isfinite(scores[got]).all()
    counts = np.bincount(got, minlength=scores.shape[0])
    sigma = np.sqrt(draws * p[best] * (1 - p[best])) + 1
    want = draws * p[best]
    assert (np.abs(counts[best] - want) < 5 * sigma).all(), (counts[best], want)


def test_the_penalty_covers_the_prompt_and_the_reply() -> None:
    np = pytest.importorskip("numpy")
    from localrun.backends.logits_sampler import LogitsSampler

    scores = np.array([1.6, 3.0, 2.9, -0.5], dtype=np.float32)
    sampler = LogitsSampler(sampling(repetition_penalty=2.0), np.array([1], dtype=np.int32))
    assert sampler.choose(scores.copy()) == 2  # 3.0 / 2 < 2.9: token 1 is in the prompt
    assert sampler.choose(scores.copy()) == 0  # 2.9 / 2 < 1.6: token 2 is in the reply now


def test_reusable_rows() -> None:
    """The rule itself: common prefix less one; a one-row last tile only where a fresh
    prefill has one."""
    from localrun.backends.onnx.reuse import reusable

    assert reusable([], [1, 2, 3]) == 0
    assert reusable([1, 2, 3], [1, 2, 3]) == 1  # the same prompt: 2 rows run (not 1)
    assert reusable([1, 2, 3, 4], [1, 2, 3, 4, 5, 6]) == 4
    assert reusable([9], [1, 2, 3]) == 0
    tokens = list(range(1000))
    assert reusable(tokens[:300], tokens[:385]) == 256  # 385 = 1 mod 128: tiles as fresh
    assert reusable(tokens[:100], tokens[:229]) == 99  # a rest of 129 would end alone
    assert reusable(tokens[:100], tokens[:230]) == 100
    assert reusable(tokens[:100], tokens[:129]) == 0


def test_the_settle_option_turns_settling_off(path: str) -> None:
    """``options={"SETTLE": False}``: no thread recomputes a reply after it ends (the next
    turn prefills the previous reply again, as before settling); a wrong kind of value
    is refused with the option's own description."""
    import time

    from localrun.backends.base import LoadRequest
    from localrun.backends.onnx.session import BACKEND, SETTLE_DELAY
    from localrun.errors import InvalidOptionError

    s = BACKEND.load(LoadRequest(path, "onnx", context=CONTEXT, exact=True,
                                 options={"SETTLE": False}))
    try:
        run(s, chat(s, [{"role": "user", "content": TURNS[0]}]), sampling(16))
        time.sleep(SETTLE_DELAY * 4)
        assert s._last_settle is None
    finally:
        s.close()
    with pytest.raises(InvalidOptionError, match="SETTLE"):
        BACKEND.load(LoadRequest(path, "onnx", context=CONTEXT, options={"SETTLE": "maybe"}))
