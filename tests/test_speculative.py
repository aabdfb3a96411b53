"""Speculative decoding (issue 30): prompt lookup and draft models on the real engines,
the auto policy's decisions, the options' checks and the catalog's drafts.

The equality tests compare a reply with speculation against the same reply without it
(greedy, and a seeded sample), in exact mode (rounds stop where llama.cpp's one-token
kernels part from a batch's: localrun/backends/llama_cpp/speculative.py), and check that
speculation really ran (drafts were made and kept)."""

from __future__ import annotations

from typing import Any

import pytest

import localrun
from localrun.backends.ngram import NgramDrafter, resume
from localrun.backends.speculative import (
    EXPLORE_EVERY,
    Governor,
    History,
    IncompatibleDraftError,
)
from localrun.errors import (
    InvalidSamplingError,
    LocalrunError,
    UnsupportedFeatureError,
)
from localrun.sampling import make_sampling
from tests.models import test_model

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried "
    "a small brass lamp, a notebook bound in green leather, and a thermos of black tea. "
    "At the top he trimmed the wick, polished the great lens with a soft cloth, and "
    "wrote the time, the wind and the state of the sea in his notebook. Ships passed "
    "far out on the horizon, their lights moving slowly from north to south."
)
COPY = [{"role": "user", "content": "Copy this text exactly, changing nothing:\n\n"
         + PASSAGE}]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 96}


def exact(model: localrun.Model) -> localrun.Model:
    """Exact mode for the model's speculation (rounds stop at llama.cpp's split-KV
    boundary). ``load(exact=True)`` sets it once issue 30's exact mode lands."""
    session: Any = model._session
    session._speculation.exact = True
    return model


# -- the n-gram drafter and the auto policy (no engine) -----------------------------------

def test_ngram_drafter_continues_a_passage_seen_before() -> None:
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    drafter = NgramDrafter([1, 2, *text, 3, 4])
    drafter.extend([5, 6, 7])  # the passage starts again
    assert drafter.draft(4) == [8, 9, 10, 11]
    assert NgramDrafter([1, 2, 3]).draft(4) == []  # nothing seen twice: no draft


def _counts(drafter: NgramDrafter) -> list[Any]:
    """Every count in order (a tie's draft is the follower counted first)."""
    return [(gram, list(after.items())) for gram, after in drafter._seen.items()]


def test_ngram_resume_counts_only_what_the_next_turn_adds_as_a_fresh_count_would() -> None:
    turn = [1, 2, 3, 1, 2, 4, 5, 1, 2, 3, 6]
    drafter = NgramDrafter(turn[:7])
    assert resume(drafter, turn) is drafter  # the next turn: extended
    assert drafter.tokens == turn and _counts(drafter) == _counts(NgramDrafter(turn))
    edited = [1, 2, 3, 1, 2, 7, 1, 2, 4, 9]  # a reply tokenized otherwise: cut back first
    assert resume(drafter, edited) is drafter
    assert drafter.tokens == edited and _counts(drafter) == _counts(NgramDrafter(edited))
    assert _counts(resume(None, edited)) == _counts(NgramDrafter(edited))


def test_auto_stops_drafting_when_a_batch_costs_more_than_it_gains() -> None:
    h = History()
    h.plain(0.010)
    for n in [*range(2, 10)] * 3:  # a size counts from its third sample
        h.batch(n, 0.040)  # a verify batch costs 4 one-token steps (Q8_0 here)
    gov = Governor("auto", h, 8)
    gov.record(3, 1)
    assert gov.length(8, 10) == 0
    assert Governor("prompt-lookup", h, 8).length(8, 10) == 8  # asked by name: always
    explored = [gov.length(8, 10) for _ in range(EXPLORE_EVERY)]
    assert explored.count(0) == EXPLORE_EVERY - 1  # one exploring round in 128 tokens


def test_auto_drafts_where_a_batch_is_cheap_and_drafts_are_kept() -> None:
    h = History()
    h.plain(0.010)
    for n in [*range(2, 10)] * 3:
        h.batch(n, 0.010 + 0.001 * n)
    h.batch(9, 0.5)  # a sample taken while the machine was busy: the least one counts
    gov = Governor("auto", h, 8)
    gov.record(8, 8)
    assert gov.length(8, 10) == 8
    exact_mode = Governor("prompt-lookup", h, 8, limit=255)  # rows up to position 255
    assert [exact_mode.length(8, p) for p in (240, 250, 255)] == [8, 5, 0]


def test_speculative_values_outside_the_modes_get_the_list() -> None:
    with pytest.raises(InvalidSamplingError, match="'off', 'auto', 'prompt-lookup', 'draft'"):
        localrun.load(None, speculative="fast")
    with pytest.raises(InvalidSamplingError, match="'prompt-lookup'"):
        make_sampling(speculative="ngram")


# -- llama.cpp ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q41() -> localrun.Model:
    model = localrun.load(str(test_model("gguf-q4_1")), backend="llama.cpp", context=1024)
    yield model
    model.close()


#: greedy, and seeded sampling
SAMPLINGS: list[dict[str, Any]] = [GREEDY, {"temperature": 0.8, "seed": 7, "max_tokens": 96}]


def lookup_equals_plain(model: localrun.Model, sampling: dict[str, Any]
                        ) -> tuple[localrun.Completion, localrun.Completion]:
    """COPY without speculation and with prompt lookup: the same text, the drafts
    counted on the second only. Returns both replies."""
    plain = model.chat(COPY, speculative="off", **sampling)
    spec = model.chat(COPY, speculative="prompt-lookup", **sampling)
    assert spec.text == plain.text
    assert plain.timings.drafted_tokens == 0
    t = spec.timings
    assert t.drafted_tokens > 0 and 0 < t.accepted_tokens <= t.drafted_tokens, t
    return plain, spec


def test_llama_prompt_lookup_greedy_and_seeded_equal_plain_decoding_in_exact_mode(
        q41: localrun.Model) -> None:
    exact(q41)
    for sampling in SAMPLINGS:
        lookup_equals_plain(q41, sampling)


def test_llama_fast_mode_speculates_past_the_exact_limit() -> None:
    model = localrun.load(str(test_model("gguf-q4_1")), backend="llama.cpp", context=1024)
    try:
        long_copy = [{"role": "user", "content": "Copy this text:\n\n" + "\n\n".join(
            [PASSAGE] * 3)}]
        fast = model.chat(long_copy, speculative="prompt-lookup", temperature=0.0,
                          max_tokens=200)
        slow = exact(model).chat(long_copy, speculative="prompt-lookup", temperature=0.0,
                                 max_tokens=200)
        assert fast.usage.prompt_tokens > 256  # every round past the limit in exact mode
        assert fast.timings.accepted_tokens > 0
        assert slow.timings.drafted_tokens == 0
    finally:
        model.close()


def test_llama_auto_reports_drafts_and_replies_the_same_greedily(q41: localrun.Model) -> None:
    exact(q41)
    plain = q41.chat(COPY, speculative="off", **GREEDY)
    auto = q41.chat(COPY, **GREEDY)  # auto, the default
    assert auto.text == plain.text
    assert auto.timings.accepted_tokens <= auto.timings.drafted_tokens


def test_llama_next_chat_turn_counts_only_its_new_tokens_ngrams(q41: localrun.Model) -> None:
    # counting a whole 600-token prompt's n-grams took 1-4 ms of every turn's time to
    # first token; a chat's next turn now extends the last turn's counts
    session: Any = q41._session
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    first = q41.chat(messages, speculative="prompt-lookup", **GREEDY)
    counted = session._speculation.ngrams
    assert counted is not None and len(counted.tokens) > first.usage.prompt_tokens
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "Why is it salty?"}]
    q41.chat(messages, speculative="prompt-lookup", **GREEDY)
    assert session._speculation.ngrams is counted
    prompt = list(session.encode_chat(messages).tokens)
    assert counted.tokens[:len(prompt)] == prompt
    fresh = NgramDrafter(prompt)
    fresh.extend(counted.tokens[len(prompt):])
    assert _counts(counted) == _counts(fresh)


def test_llama_draft_model_equals_plain_decoding_and_is_counted() -> None:
    target = test_model("gguf-q8_0")
    model = localrun.load(str(target), backend="llama.cpp", context=1024,
                          draft_model=str(test_model("gguf-q4_1")), speculative="draft")
    try:
        exact(model)
        plain = model.chat(COPY, speculative="off", **GREEDY)
        spec = model.chat(COPY, **GREEDY)
        assert spec.text == plain.text
        assert spec.timings.accepted_tokens > 0, spec.timings
    finally:
        model.close()


def test_auto_with_a_draft_model_still_takes_the_prompts_ngram_drafts() -> None:
    """A draft model loaded does not keep auto from the prompt's n-gram drafts, which
    cost nothing to make: on a copying task auto drafts (and keeps) from the prompt on
    the F32 file, where the Q4_1 draft model's steps cost too much to win (before: auto
    weighed only the draft model and stayed off, 1.00x against prompt lookup's 2.9x)."""
    model = localrun.load(str(test_model("gguf-f32")), backend="llama.cpp", context=1024,
                          draft_model=str(test_model("gguf-q4_1")))
    try:
        exact(model)
        plain = model.chat(COPY, speculative="off", **GREEDY)
        for _ in range(2):  # the first request measures the costs; both must draft
            auto = model.chat(COPY, **GREEDY)  # auto, the default
            assert auto.text == plain.text
            assert auto.timings.accepted_tokens >= auto.timings.drafted_tokens // 2 > 0, \
                auto.timings
    finally:
        model.close()


def test_llama_batcher_speculates_a_lone_sequence_and_replies_the_same() -> None:
    """A model that batches (max_concurrency > 1: every call runs in the batcher, as in
    `localrun serve`) drafts from the prompt there too: greedy and seeded replies equal
    plain decoding's in exact mode, drafts are counted; two copies at once (decoded
    together) reply as each does alone."""
    model = localrun.load(str(test_model("gguf-q4_1")), backend="llama.cpp", context=1024,
                          max_concurrency=2, exact=True)
    try:
        session: Any = model._session
        assert session._batcher is not None and session.batch_alone
        replies = []
        for sampling in SAMPLINGS:
            plain, spec = lookup_equals_plain(model, sampling)
            assert spec.usage.completion_tokens == plain.usage.completion_tokens
            replies.append(plain.text)
        both = model.batch([COPY, COPY], speculative="prompt-lookup", **GREEDY)
        assert [c.text for c in both] == [replies[0]] * 2
    finally:
        model.close()


def test_a_draft_with_another_vocabulary_is_refused_at_load() -> None:
    with pytest.raises(IncompatibleDraftError, match="vocabulary has 30,522 tokens"):
        localrun.load(str(test_model("gguf-q4_1")), backend="llama.cpp",
                      draft_model=str(test_model("minilm-gguf")))


def test_draft_mode_without_a_draft_model_says_what_to_pass() -> None:
    with pytest.raises(LocalrunError, match="needs a draft model") as e:
        localrun.load(str(test_model("gguf-q4_1")), backend="llama.cpp", speculative="draft")
    assert "draft_model=" in (e.value.hint or "")


def test_an_engine_without_speculation_refuses_an_explicit_mode() -> None:
    with pytest.raises(UnsupportedFeatureError, match=r"llama\.cpp"):
        localrun.load(str(test_model("onnx-int4")), backend="onnx",
                      speculative="prompt-lookup")


# -- OpenVINO GenAI and MLX: their own speculative paths ------------------------------------

def test_openvino_prompt_lookup_greedy_equals_plain() -> None:
    path = str(test_model("openvino-int4"))
    plain_model = localrun.load(path, backend="openvino")
    try:
        plain = plain_model.chat(COPY, **GREEDY)
    finally:
        plain_model.close()
    model = localrun.load(path, backend="openvino", speculative="prompt-lookup")
    try:
        assert model.chat(COPY, **GREEDY).text == plain.text
    finally:
        model.close()


def test_mlx_draft_model_greedy_equals_plain_and_counts_drafts() -> None:
    path = str(test_model("mlx-4bit"))
    model = localrun.load(path, backend="mlx", draft_model=path)
    try:
        plain = model.chat(COPY, speculative="off", **GREEDY)
        spec = model.chat(COPY, speculative="draft", **GREEDY)
        assert spec.text == plain.text
        assert spec.timings.accepted_tokens > 0, spec.timings
    finally:
        model.close()


# -- the catalog's drafts and the plan -------------------------------------------------------

def test_every_catalog_draft_is_a_smaller_alias_of_the_catalog() -> None:
    from localrun.hub.variants import model_size
    from localrun.naming.catalog import entries

    cat = entries()
    drafts = {a: e.draft for a, e in cat.items() if e.draft}
    assert len(drafts) >= 10
    for alias, draft in drafts.items():
        assert draft in cat, alias
        assert cat[draft].draft is None
        size = model_size(cat[alias].base) or cat[alias].params_b
        small = model_size(cat[draft].base) or cat[draft].params_b
        assert size and small and small < size / 2, (alias, draft)


def test_plan_shows_the_catalog_draft_with_its_memory() -> None:
    from localrun.hardware import HardwareProfile

    p = localrun.plan("qwen2.5:7b", hardware=HardwareProfile.find("epyc-cpu"),
                      installed={"llama.cpp": "0.3.36"}, hub=False)
    assert p.draft is not None and p.draft["model"] == "qwen2.5:0.5b"
    mem = p.draft["memory"]
    assert mem is not None and 0 < mem["weights_bytes"] < 1 * 2**30


# -- localrun bench --speculative ------------------------------------------------------------

def test_bench_compares_speculative_modes() -> None:
    from localrun.bench import BenchConfig, run_bench

    report = run_bench(BenchConfig(models=(str(test_model("gguf-q4_1")),),
                                   backend="llama.cpp", prompt_tokens=(64,), gen_tokens=24,
                                   concurrency=(1,), runs=1, warmup=0,
                                   speculative=("off", "auto")))
    rows = report.results[0].workloads
    assert [w.speculative for w in rows] == ["off", "auto"]
    assert rows[0].acceptance is None  # off drafts nothing
    assert all(w.decode_tokens_per_s for w in rows)
