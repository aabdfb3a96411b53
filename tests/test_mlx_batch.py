"""MLX through mlx-lm's BatchGenerator (localrun/backends/mlx/batcher.py, issue 15).

Sequences batched together must each give what they give alone through the session's
own ``generate()``: greedy, seeded sampling (each sequence draws from its own key chain,
not mlx's one global stream), repetition penalty, structured output. End-of-sequence
ends a sequence with "stop", the token limit with "length", and a cancelled sequence
leaves the generator. Replies are a few tokens: MLX decodes a few tokens a second on
this shared CPU.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from localrun.backends.base import GenerationStats, LoadRequest, Prompt
from localrun.backends.mlx.batcher import MLXBatcher
from localrun.sampling import ResolvedSampling
from localrun.structured.constraint import Constraint
from localrun.types import CancelToken
from tests.models import test_model

pytest.importorskip("mlx_lm", reason="MLX is not installed (pip install -e '.[mlx]')")

N = 8  # reply tokens per sequence


def sampling(max_tokens: int = N, **kw: Any) -> ResolvedSampling:
    base: dict[str, Any] = dict(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0,
                                min_p=0.0, repetition_penalty=1.0, seed=7, stop=())
    base.update(kw)
    return ResolvedSampling(**base)


@pytest.fixture(scope="module")
def session() -> Iterator[Any]:
    from localrun.backends.mlx.session import BACKEND

    s = BACKEND.load(LoadRequest(str(test_model("mlx-4bit")), "mlx", context=1024))
    yield s
    s.close()


def new_batcher(session: Any, capacity: int = 8) -> MLXBatcher:
    """A batcher over the session's engine, with a prefix store of its own."""
    from localrun.backends.mlx.reuse import PrefixCache

    engine = session.engine
    return MLXBatcher(replace(engine, prefixes=PrefixCache(engine.model)), capacity)


def alone(session: Any, prompt: Prompt, s: ResolvedSampling) -> tuple[str, GenerationStats]:
    stats = GenerationStats()
    return "".join(session.generate(prompt, s, CancelToken(), stats)), stats


def drain(batcher: MLXBatcher, want: set[int], out: dict[int, str] | None = None,
          limit: int = 200) -> dict[int, str]:
    """Step until every key in ``want`` has ended; the text of each."""
    out = {} if out is None else out
    for _ in range(limit):
        for key, piece in batcher.step():
            if piece is None:
                want.discard(key)
            else:
                out[key] = out.get(key, "") + piece
        if not want:
            return out
    raise AssertionError(f"sequences {sorted(want)} never ended")


def test_a_batch_gives_each_sequence_what_it_gives_alone(session: Any) -> None:
    prompts = [session.encode_text(t) for t in
               ("The capital of France is", "Once upon a time, there was",
                "def fibonacci(n):")]
    samplings = [sampling(), sampling(temperature=0.9, top_k=40, top_p=0.95, seed=3),
                 sampling(repetition_penalty=1.3, max_tokens=N - 2)]
    b = new_batcher(session)
    stats = [GenerationStats() for _ in prompts]
    for k, (p, s) in enumerate(zip(prompts, samplings, strict=True)):
        b.add(k, p, s, stats[k])
        assert stats[k].started > 0 and stats[k].prefill_tokens == len(p.tokens)
    got = drain(b, {0, 1, 2})
    b.close()
    for k, (p, s) in enumerate(zip(prompts, samplings, strict=True)):
        text, single = alone(session, p, s)
        assert got[k] == text, (k, got[k], text)
        assert stats[k].finish_reason == single.finish_reason == "length"
        assert stats[k].completion_tokens == s.max_tokens
        assert stats[k].decode_tokens == s.max_tokens - 1 and stats[k].decode_seconds > 0


def test_a_seed_gives_the_same_reply_whatever_runs_beside_it(session: Any) -> None:
    """mlx's mx.random.seed is one global stream: drawn by several sequences in turn, a
    reply would change with its neighbours. Each sequence has its own key chain."""
    p = session.encode_text("My favourite colour is")
    hot = sampling(temperature=1.5, seed=11)
    texts = []
    for neighbours in (0, 2):
        b = new_batcher(session)
        b.add(0, p, hot, GenerationStats())
        for k in range(1, neighbours + 1):
            b.add(k, p, sampling(temperature=1.5, seed=100 + k), GenerationStats())
        texts.append(drain(b, set(range(neighbours + 1)))[0])
        b.close()
    assert texts[0] == texts[1]
    other = new_batcher(session)
    other.add(0, p, sampling(temperature=1.5, seed=12), GenerationStats())
    assert drain(other, {0})[0] != texts[0]  # the seed matters at all
    other.close()


def test_structured_output_is_enforced_per_sequence_and_ends_with_stop(session: Any) -> None:
    constraint = Constraint.json({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                  "required": ["ok"], "additionalProperties": False})
    session.check_constraint(constraint)
    p = session.encode_chat([{"role": "user", "content": "Is water wet? Answer in JSON."}])
    b = new_batcher(session)
    st = [GenerationStats(), GenerationStats()]
    b.add(0, p, sampling(max_tokens=24, constraint=constraint), st[0])
    b.add(1, p, sampling(max_tokens=3), st[1])  # the same prompt, unconstrained
    got = drain(b, {0, 1})
    b.close()
    assert isinstance(json.loads(got[0])["ok"], bool)
    assert st[0].finish_reason == "stop"  # the grammar ends, then only EOS is allowed
    assert st[1].finish_reason == "length" and st[1].completion_tokens == 3
    assert got[0] == alone(session, p, sampling(max_tokens=24, constraint=constraint))[0]


def test_cancel_frees_the_sequence_and_the_others_go_on(session: Any) -> None:
    b = new_batcher(session)
    p = session.encode_text("Once upon a time")
    st = [GenerationStats(), GenerationStats()]
    b.add(0, p, sampling(max_tokens=40), st[0])
    b.add(1, p, sampling(max_tokens=6), st[1])
    out: dict[int, str] = {}
    while not out.get(0):
        for key, piece in b.step():
            assert piece is not None
            out[key] = out.get(key, "") + piece
    uid = b._uids[0]
    b.cancel(0)
    b.cancel(0)  # twice: still one end
    events = b.step()
    assert events.count((0, None)) == 1
    assert st[0].finish_reason is None  # cancelled: neither stop nor length
    assert b._gen.extract_cache([uid]) == {}  # the generator no longer holds it
    drain(b, {1}, out)
    assert st[1].finish_reason == "length" and st[1].completion_tokens == 6
    b.close()
    b.close()  # idempotent


def test_no_room_ends_at_once_and_an_engine_error_leaves_it_usable(session: Any) -> None:
    b = new_batcher(session)
    st = GenerationStats()
    b.add(5, session.encode_text("Hi"), sampling(max_tokens=0), st)
    assert b.step() == [(5, None)] and st.finish_reason == "length"

    p = session.encode_text("The sky is")
    b.add(1, p, sampling(max_tokens=2), GenerationStats())
    gen = b._gen

    def broken() -> Any:
        raise RuntimeError("engine failed")

    gen.next = broken
    with pytest.raises(RuntimeError, match="engine failed"):
        b.step()
    b.cancel(1)  # what the driver does next: nothing left to free
    assert b.step() == []
    st2 = GenerationStats()
    b.add(2, p, sampling(max_tokens=2), st2)
    assert b._gen is not gen  # a fresh generator
    assert drain(b, {2})[2] == alone(session, p, sampling(max_tokens=2))[0]
    b.close()


def test_every_mlx_call_runs_on_the_mlx_thread(session: Any) -> None:
    """The driver steps a batcher from its own scheduler thread; mlx streams are
    thread-local, so the work must hop to the session's mlx worker."""
    from mlx_lm.generate import BatchGenerator

    threads: set[str] = set()
    real = BatchGenerator.next

    def spy(self: Any) -> Any:
        threads.add(threading.current_thread().name)
        return real(self)

    BatchGenerator.next = spy  # type: ignore[method-assign]
    try:
        b = new_batcher(session)
        done: list[str] = []

        def scheduler() -> None:
            b.add(0, session.encode_text("Hello"), sampling(max_tokens=2), GenerationStats())
            done.append(drain(b, {0})[0])
            b.close()

        t = threading.Thread(target=scheduler, name="localrun-engine")
        t.start()
        t.join()
    finally:
        BatchGenerator.next = real  # type: ignore[method-assign]
    assert done and threads == {"localrun-mlx"}


def test_model_batch_runs_through_the_batcher_with_stop_strings(session: Any) -> None:
    """Through the driver: Model.batch sends its items to the session's batcher (the
    scheduler steps it on its own thread), and each reply is the one the item gets alone,
    a stop string (the driver's) cutting it where it would alone."""
    import localrun
    from localrun.backends.mlx.batcher import MLXBatcher

    questions = ["Name a fruit.", "Name a colour.", "Name a river."]
    with localrun.load(str(test_model("mlx-4bit")), backend="mlx", context=1024) as model:
        inner = model._session
        assert inner is not None and inner.batch_alone is False
        steps = 0
        real = MLXBatcher.step

        def counting(self: MLXBatcher) -> list[tuple[int, str | None]]:
            nonlocal steps
            steps += 1
            return real(self)

        MLXBatcher.step = counting  # type: ignore[method-assign]
        try:
            got = model.batch([[{"role": "user", "content": q}] for q in questions],
                              max_tokens=N, temperature=0.0, stop=["."])
        finally:
            MLXBatcher.step = real  # type: ignore[method-assign]
        assert steps >= N  # the items went through the batcher
        for q, c in zip(questions, got, strict=True):
            one = model.chat([{"role": "user", "content": q}], max_tokens=N,
                             temperature=0.0, stop=["."])
            assert (c.text, c.finish_reason) == (one.text, one.finish_reason)
            assert c.usage.completion_tokens == one.usage.completion_tokens
