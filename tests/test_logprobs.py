"""Log probabilities, echo and token-id prompts (issue 28 item 2) in the Python API.

README: "``logprobs=True`` / ``top_logprobs=k`` (<= 20) give each chosen token's log
probability under the model's own distribution on llama.cpp, ONNX Runtime GenAI and
MLX; ``complete(..., echo=True)`` scores the prompt".

The llama.cpp cases check the reported values against the raw logits of an independent
``llama_cpp.Llama`` with ``logits_all=True`` over the same tokens (same flash-attention
setting, so the same kernels: equal to float32 rounding). ONNX and MLX run their
SmolLM2-135M fixtures; replies are kept short (MLX decodes ~5 tokens/s on a 2-core CPU).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator, Sequence
from operator import itemgetter
from typing import Any

import pytest

import localrun
from localrun.backends.base import GenerationStats, Prompt, Session
from localrun.backends.logprobs import Scorer
from localrun.batch import BatchItem
from localrun.errors import InvalidSamplingError, LocalrunError, UnsupportedFeatureError
from localrun.sampling import make_sampling
from localrun.types import (
    ModelInfo,
    TokenLogprob,
    TopLogprob,
    chat_logprobs,
    completion_logprobs,
)
from tests.conftest import requires_llama
from tests.models import test_model

PROMPT = "The history of the printing press begins"
CONTEXT = 1024


def lm_eval_parse(out: dict[str, Any], ctxlens: Sequence[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's ``LocalCompletionsAPI.parse_logprobs`` (openai_completions.py),
    line for line: the continuation is ``token_logprobs[ctxlen:-1]`` (the last entry is
    the one generated token), greedy when each equals the best of its ``top_logprobs``."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens,
                              strict=True):
        assert ctxlen > 0
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = True
        for tok, top in zip(tokens_logprobs, top_logprobs, strict=True):
            if tok != max(top.values()):
                is_greedy = False
                break
        res.append((logprobs, is_greedy))
    return res


def as_legacy(completions: Sequence[Any]) -> dict[str, Any]:
    """What ``/v1/completions`` answers for them with echo (the server phase's mapping)."""
    return {"choices": [{"index": i, "logprobs": completion_logprobs(
        [*c.prompt_logprobs, *(c.logprobs or ())])} for i, c in enumerate(completions)]}


# -- options and shapes (no engine) ---------------------------------------------------------


@pytest.mark.parametrize(("options", "field", "words"), [
    ({"top_logprobs": 21}, "top_logprobs", "0 to 20"),
    ({"top_logprobs": -1}, "top_logprobs", "0 to 20"),
    ({"top_logprobs": 2.0}, "top_logprobs", "0 to 20"),
    ({"top_logprobs": True}, "top_logprobs", "0 to 20"),
    ({"logprobs": "yes"}, "logprobs", "True or False"),
    ({"echo": 1}, "echo", "True or False"),
    ({"max_tokens": 0}, "max_tokens", "echo=True"),
    ({"max_tokens": -1}, "max_tokens", ">= 1"),
    ({"logprobs": False, "top_logprobs": 3}, "top_logprobs", "logprobs=False"),
])
def test_bad_logprob_options_name_the_field_and_the_limit(
        options: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(InvalidSamplingError) as e:
        make_sampling(**options)
    assert e.value.option == field
    assert field in str(e.value) and words in str(e.value)


def test_logprob_options_resolve() -> None:
    from localrun.sampling import resolve

    assert resolve(make_sampling()).logprobs is None
    assert resolve(make_sampling(logprobs=True)).logprobs == 0
    assert resolve(make_sampling(top_logprobs=5)).logprobs == 5  # implies logprobs
    assert resolve(make_sampling(logprobs=True, top_logprobs=20)).logprobs == 20
    scoring = resolve(make_sampling(echo=True, max_tokens=0))
    assert scoring.echo and scoring.max_tokens == 0 and scoring.logprobs is None


def _entry(token: str, tid: int, lp: float | None, top: Sequence[tuple[str, int, float]] = ()
           ) -> TokenLogprob:
    return TokenLogprob(token, token.encode(), tid, lp,
                        tuple(TopLogprob(t, t.encode(), i, v) for t, i, v in top))


def test_openai_shapes_follow_from_the_entries() -> None:
    entries = [_entry("The", 1, None),
               _entry(" cat", 2, -1.5, [(" dog", 3, -0.5), (" cat", 2, -1.5)]),
               _entry("é", 4, -0.25, [("é", 4, -0.25), ("é", 5, -3.0)])]
    legacy = completion_logprobs(entries)
    assert legacy == {"tokens": ["The", " cat", "é"],
                      "token_logprobs": [None, -1.5, -0.25],
                      "top_logprobs": [None, {" dog": -0.5, " cat": -1.5}, {"é": -0.25}],
                      "text_offset": [0, 3, 7]}
    assert completion_logprobs(entries[1:], text_offset=3)["text_offset"] == [3, 7]
    chat = chat_logprobs(entries)["content"]
    assert [c["token"] for c in chat] == [" cat", "é"]  # no logprob, no entry
    assert chat[1] == {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9],
                       "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [195, 169]},
                                        {"token": "é", "logprob": -3.0, "bytes": [195, 169]}]}
    # the chosen token is in legacy's dict even when it is not among the top ones
    only = completion_logprobs([_entry(" x", 9, -4.0, [(" y", 8, -0.1)])])
    assert only["top_logprobs"] == [{" y": -0.1, " x": -4.0}]


def test_scorer_math() -> None:
    import numpy as np

    row = np.array([0.0, 2.0, 2.0, -1.0, 5.0], dtype=np.float32)
    scorer = Scorer(lambda t: f"<{t}>".encode())
    e = scorer.entry(row, 2, top=3)
    ref = row.astype(np.float64) - math.log(np.exp(row.astype(np.float64)).sum())
    assert e.logprob == pytest.approx(ref[2], abs=1e-6)
    assert [t.id for t in e.top_logprobs] == [4, 1, 2]  # best first, by id among equals
    assert e.top_logprobs[2].logprob == e.logprob  # the same float: lm-eval's is_greedy
    assert sum(math.exp(t.logprob) for t in scorer.entry(row, 0, top=5).top_logprobs) \
        == pytest.approx(1.0, abs=1e-6)
    assert e.token == "<2>" and e.bytes == b"<2>"


# -- the driver, over a scripted session (no engine) -------------------------------------------


class Scripted(Session):
    """Generates ``script`` (token ids; EOS_ID ends it) with made-up logits, appending
    entries as an engine does; records whether generate() ran."""

    EOS_ID = 0

    def __init__(self, script: Sequence[int], features: frozenset[str] = frozenset(
            {"logprobs", "top", "echo", "tokens"})) -> None:
        self.script = list(script)
        self.features = features
        self.generated = 0
        self.scorer = Scorer(lambda t: b"" if t == self.EOS_ID else f"t{t} ".encode())
        self.info = ModelInfo(backend="scripted", engine_version="0", format="gguf",
                              quantization=None, path="scripted", context_length=256)

    def row(self, token: int) -> Any:
        import numpy as np

        row = np.zeros(32, dtype=np.float32)
        row[token] = 3.0
        return row

    def encode_chat(self, messages: Sequence[Any]) -> Prompt:
        return Prompt([1, 2], "chat")

    def encode_text(self, text: str) -> Prompt:
        return Prompt([1 + len(w) for w in text.split()], text)

    def encode_ids(self, tokens: Sequence[int]) -> Prompt:
        return Prompt(list(tokens))

    def prompt_logprobs(self, prompt: Prompt, top: int) -> list[TokenLogprob]:
        t = list(prompt.tokens)
        return [self.scorer.first(t[0]), *(self.scorer.entry(self.row(x), x, top)
                                           for x in t[1:])]

    def generate(self, prompt: Prompt, sampling: Any, cancel: Any, stats: GenerationStats
                 ) -> Iterator[str]:
        self.generated += 1
        for n, token in enumerate(self.script[:sampling.max_tokens + 1], 1):
            if stats.logprobs is not None:
                stats.logprobs.append(self.scorer.entry(self.row(token), token,
                                                        sampling.logprobs))
            if token == self.EOS_ID:
                stats.finish_reason = "stop"
                return
            stats.completion_tokens = n
            yield f"t{token} "
            if n >= sampling.max_tokens:
                stats.finish_reason = "length"
                return


@pytest.mark.parametrize(("options", "option"), [
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"echo": True}, "echo"),
])
def test_an_engine_without_logprobs_refuses_before_generating(
        options: dict[str, Any], option: str) -> None:
    session = Scripted([5, 6], features=frozenset({"logprobs"} if option != "logprobs"
                                                  else ()))
    model = localrun.Model(session)
    with pytest.raises(UnsupportedFeatureError) as e:
        model.complete("a b", max_tokens=2, **options)
    assert e.value.option == option and e.value.backend == "scripted"
    assert f"{option} is not available on scripted" in str(e.value)
    assert "backend='llama.cpp' or 'onnx' or 'mlx'" in (e.value.hint or "")
    assert ("'openvino'" in (e.value.hint or "")) == (option == "logprobs")
    assert session.generated == 0
    with pytest.raises(UnsupportedFeatureError, match="token-id prompt"):
        localrun.Model(Scripted([5], features=frozenset())).complete([3, 4], max_tokens=1)


def test_the_end_of_sequence_token_has_its_entry() -> None:
    """A reply that ends on EOS keeps its entry (text ""), as vLLM reports it: so
    lm-eval's ``[ctxlen:-1]`` of a max_tokens=1 echo drops the generated token, not the
    continuation's last one, even when the model's next token is EOS."""
    model = localrun.Model(Scripted([Scripted.EOS_ID]))
    c = model.complete([7, 8, 9], max_tokens=1, echo=True, logprobs=True, top_logprobs=1,
                       temperature=0)
    assert c.finish_reason == "stop" and c.usage.completion_tokens == 0 and c.text == ""
    assert [e.id for e in c.logprobs or ()] == [Scripted.EOS_ID]
    assert c.logprobs is not None and c.logprobs[0].token == ""
    [(score, greedy)] = lm_eval_parse(as_legacy([c]), [1])
    assert score == pytest.approx(sum(e.logprob or 0 for e in c.prompt_logprobs[1:]))
    assert greedy


def test_entries_follow_the_reply_and_its_chunks() -> None:
    model = localrun.Model(Scripted([5, 6, 7, 8, 9]))
    # a stop string ends the reply inside token 7's text: entries up to that token
    c = model.complete("a", max_tokens=5, logprobs=True, stop=["t7"])
    assert c.text == "t5 t6 " and [e.id for e in c.logprobs or ()] == [5, 6, 7]
    stream = model.stream("a", raw=True, max_tokens=4, logprobs=True, top_logprobs=2)
    chunks = list(stream)
    assert stream.completion is not None
    got = [e for ch in chunks for e in ch.logprobs]
    assert got == list(stream.completion.logprobs or ())
    assert [e.id for e in got] == [5, 6, 7, 8]
    assert all(len(e.top_logprobs) == 2 for e in got)
    # not asked: nothing, anywhere
    plain = list(model.stream("a", raw=True, max_tokens=2))
    assert all(ch.logprobs == () for ch in plain)
    assert model.complete("a", max_tokens=2).logprobs is None


def test_echo_alone_scores_without_generating() -> None:
    session = Scripted([5, 6])
    model = localrun.Model(session)
    c = model.complete([3, 4, 5], max_tokens=0, echo=True, top_logprobs=1)
    assert session.generated == 0 and c.finish_reason == "length" and c.text == ""
    assert c.usage.prompt_tokens == 3 and c.usage.completion_tokens == 0
    assert [e.id for e in c.prompt_logprobs or ()] == [3, 4, 5]
    assert c.prompt_logprobs is not None and c.prompt_logprobs[0].logprob is None
    assert c.logprobs == ()  # asked for (top_logprobs), none generated
    d = c.to_dict()
    assert d["prompt_logprobs"][1]["bytes"] == list(b"t4 ") and d["logprobs"] == []
    assert "logprobs" not in model.complete([3, 4], max_tokens=0, echo=True).to_dict()


def test_bad_prompts_and_echo_on_a_conversation() -> None:
    model = localrun.Model(Scripted([5]))
    with pytest.raises(LocalrunError, match="raw prompt"):
        model.chat("hi", echo=True)
    with pytest.raises(LocalrunError, match="non-empty list of token ids"):
        model.complete([])
    with pytest.raises(LocalrunError, match="non-empty list of token ids"):
        model.complete([True, False])
    with pytest.raises(LocalrunError, match="raw prompt"):
        model.batch([BatchItem("hi", sampling={"echo": True})])


# -- llama.cpp ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(default_gguf: Any) -> Iterator[Any]:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llama-cpp]')")
    with localrun.load(str(default_gguf), backend="llama.cpp", context=CONTEXT,
                       exact=True) as m:
        yield m


@pytest.fixture(scope="module")
def raw_llama(llama: Any) -> Any:
    """An independent llama.cpp context over the same file and kernels (flash attention
    as the session has it) that keeps every position's logits."""
    import llama_cpp

    from localrun.backends.llama_cpp.devices import engine_constants

    kw = engine_constants(llama_cpp, llama._session.placement.kwargs)
    llm = llama_cpp.Llama(llama.info.path, n_ctx=CONTEXT, logits_all=True, verbose=False,
                          **kw)
    yield llm
    llm.close()


def log_softmax_rows(llm: Any, tokens: Sequence[int]) -> Any:
    """Row i: ln p(next token | tokens[:i + 1]) over the whole vocabulary (float64)."""
    import numpy as np

    llm.reset()
    llm.eval(list(tokens))
    rows = np.array(llm.scores[:len(tokens)], dtype=np.float64)
    rows -= rows.max(axis=1, keepdims=True)
    rows -= np.log(np.exp(rows).sum(axis=1, keepdims=True))
    return rows


@requires_llama
def test_llama_logprobs_are_the_full_vocabulary_log_softmax(llama: Any, raw_llama: Any
                                                            ) -> None:
    """Each reported value is ln softmax(raw logits) over all 49152 tokens (so their
    probabilities sum to 1 over the vocabulary), and the 20 alternatives are the 20 best."""
    import numpy as np

    c = llama.complete(PROMPT, max_tokens=10, temperature=0, logprobs=True, top_logprobs=20)
    ids = list(llama._session.encode_text(PROMPT).tokens)
    gen = [e.id for e in c.logprobs]
    rows = log_softmax_rows(raw_llama, ids + gen)
    for i, e in enumerate(c.logprobs):
        row = rows[len(ids) - 1 + i]
        assert np.exp(row).sum() == pytest.approx(1.0, abs=1e-9)
        assert e.logprob == pytest.approx(row[e.id], abs=1e-5)
        best = np.argsort(-row, kind="stable")[:20]
        assert [t.id for t in e.top_logprobs] == best.tolist()
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(row[best], abs=1e-5)
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-6


@requires_llama
def test_llama_greedy_chooses_the_most_likely_token(llama: Any) -> None:
    c = llama.complete(PROMPT, max_tokens=16, temperature=0, logprobs=True, top_logprobs=5)
    assert c.logprobs is not None
    assert len(c.logprobs) == c.usage.completion_tokens + (c.finish_reason == "stop")
    for e in c.logprobs:
        assert e.id == e.top_logprobs[0].id and e.logprob == e.top_logprobs[0].logprob
    # the entries' texts are the reply's
    assert "".join(e.token for e in c.logprobs) == c.text
    assert b"".join(e.bytes for e in c.logprobs).decode() == c.text


@requires_llama
def test_llama_echo_equals_teacher_forcing(llama: Any, raw_llama: Any) -> None:
    """The prompt's logprobs from one forward pass equal, token for token, those a
    generation run reported for the same tokens (its reply fed back as a prompt); and the
    raw logits' log-softmax. Echo then generates as without it."""
    g = llama.complete(PROMPT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    ids = list(llama._session.encode_text(PROMPT).tokens)
    gen = [e.id for e in g.logprobs]
    e = llama.complete(ids + gen, max_tokens=0, echo=True, top_logprobs=3)
    assert [x.id for x in e.prompt_logprobs] == ids + gen
    first = e.prompt_logprobs[0]
    assert first.logprob is None and first.top_logprobs == ()
    for forced, generated in zip(e.prompt_logprobs[len(ids):], g.logprobs, strict=True):
        assert forced.logprob == pytest.approx(generated.logprob, abs=1e-5)
        assert [t.id for t in forced.top_logprobs] == [t.id for t in generated.top_logprobs]
    rows = log_softmax_rows(raw_llama, ids + gen)
    for i, x in enumerate(e.prompt_logprobs[1:]):
        assert x.logprob == pytest.approx(rows[i, x.id], abs=1e-5)
    again = llama.complete(PROMPT, max_tokens=12, temperature=0, echo=True)
    assert again.text == g.text and again.logprobs is None
    assert [x.id for x in again.prompt_logprobs or ()] == ids


@requires_llama
def test_llama_sampled_logprobs_are_the_raw_models(llama: Any, raw_llama: Any) -> None:
    """At a temperature, with a repetition penalty and top_k, the values are still the
    raw model's: the first position's equal the greedy call's, bit for bit, and each is
    the raw log-softmax at its position, not the tempered one."""
    import numpy as np

    greedy = llama.complete(PROMPT, max_tokens=1, temperature=0, logprobs=True,
                            top_logprobs=5)
    hot = llama.complete(PROMPT, max_tokens=6, temperature=1.7, top_k=40, seed=7,
                         repetition_penalty=1.3, logprobs=True, top_logprobs=5)
    assert hot.logprobs is not None and greedy.logprobs is not None
    assert hot.logprobs[0].top_logprobs == greedy.logprobs[0].top_logprobs
    ids = list(llama._session.encode_text(PROMPT).tokens)
    rows = log_softmax_rows(raw_llama, ids + [e.id for e in hot.logprobs])
    tempered = False
    for i, e in enumerate(hot.logprobs):
        row = rows[len(ids) - 1 + i]
        assert e.logprob == pytest.approx(row[e.id], abs=1e-5)
        t = row / 1.7
        t -= np.log(np.exp(t - t.max()).sum()) + t.max()
        tempered |= abs(t[e.id] - row[e.id]) > 0.1
    assert tempered  # the check can tell them apart


@requires_llama
def test_llama_batched_path_reports_what_the_single_path_does(llama: Any) -> None:
    """Several sequences through the llama.cpp batcher (the engine thread) get the
    entries a call alone gets, EOS entries included."""
    prompts = [PROMPT, "One, two, three,", "My favourite colour is"]
    alone = [llama.complete(p, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
             for p in prompts]
    together = llama.batch([BatchItem(p, raw=True) for p in prompts], max_tokens=8,
                           temperature=0, logprobs=True, top_logprobs=2)
    assert llama.max_concurrency > 1  # they ran through the batcher
    for a, b in zip(alone, together, strict=True):
        assert b.text == a.text and b.logprobs is not None and a.logprobs is not None
        assert [e.id for e in b.logprobs] == [e.id for e in a.logprobs]
        assert [e.logprob for e in b.logprobs] == pytest.approx(
            [e.logprob for e in a.logprobs], abs=1e-4)
        assert [t.id for e in b.logprobs for t in e.top_logprobs] == \
            [t.id for e in a.logprobs for t in e.top_logprobs]


@requires_llama
def test_llama_token_id_prompts(llama: Any) -> None:
    ids = list(llama._session.encode_text(PROMPT).tokens)
    assert llama.complete(ids, max_tokens=6, temperature=0).text == \
        llama.complete(PROMPT, max_tokens=6, temperature=0).text
    import numpy as np

    assert llama.complete(np.array(ids), max_tokens=2, temperature=0).usage.prompt_tokens \
        == len(ids)
    with pytest.raises(LocalrunError, match=r"Token id 49152 at position 1 .*0 to 49151"):
        llama.complete([ids[0], 49152], max_tokens=1)
    with pytest.raises(LocalrunError, match="Token id -3 at position 0"):
        llama.complete([-3, 5], max_tokens=1)


@requires_llama
def test_lm_eval_loglikelihood_requests(llama: Any) -> None:
    """lm-evaluation-harness's ``local-completions`` loglikelihood request, as it sends
    it (token ids, ``max_tokens=1, echo=True, logprobs=1, temperature=0``, a batch of
    them), parsed as it parses the answer: the continuation's summed logprob and
    is_greedy. A multiple-choice question picks the right answer."""
    ctx = list(llama._session.encode_text("The capital of France is").tokens)
    choices = [" Paris", " London", " Berlin"]
    conts = [llama._session.encode_ids(
        llama._session._engine.llm.tokenize(c.encode(), add_bos=False)).tokens for c in choices]
    requests = [ctx + list(c) for c in conts]
    out = llama.batch([BatchItem(r, raw=True) for r in requests], max_tokens=1, echo=True,
                      logprobs=True, top_logprobs=1, temperature=0, seed=1234)
    scores = lm_eval_parse(as_legacy(out), [len(ctx)] * len(requests))
    for (score, greedy), c, cont in zip(scores, out, conts, strict=True):
        assert c.logprobs is not None and len(c.logprobs) == 1  # the one generated token
        mine = c.prompt_logprobs[len(ctx):]
        assert [e.id for e in mine] == list(cont)
        assert score == pytest.approx(sum(e.logprob or 0 for e in mine))
        assert greedy == all(e.id == e.top_logprobs[0].id for e in mine)
    assert max(range(3), key=lambda i: scores[i][0]) == 0  # " Paris"
    assert scores[0][1]  # and it is the greedy continuation


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def check_raw_under_a_schema(model: Any) -> None:
    """Under a schema the reply is constrained, but the values are the raw model's: the
    first position's alternatives are the unconstrained call's, and the forced first
    token (``{"``), which the model alone finds unlikely, keeps its low logprob."""
    free = model.complete("The capital of France is", max_tokens=1, temperature=0,
                          logprobs=True, top_logprobs=3)
    forced = model.complete("The capital of France is", max_tokens=12, temperature=0,
                            logprobs=True, top_logprobs=3, schema=CITY)
    assert forced.parsed == {"city": "Paris"}
    assert forced.logprobs is not None and free.logprobs is not None
    first = forced.logprobs[0]
    assert [t.id for t in first.top_logprobs] == [t.id for t in free.logprobs[0].top_logprobs]
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(
        [t.logprob for t in free.logprobs[0].top_logprobs], abs=1e-4)
    assert first.id not in [t.id for t in first.top_logprobs] and (first.logprob or 0) < -5


@requires_llama
def test_llama_logprobs_under_a_schema_are_the_raw_models(llama: Any) -> None:
    check_raw_under_a_schema(llama)


# -- ONNX Runtime GenAI and MLX ---------------------------------------------------------------

#: (backend, fixture, module, how far a decode step's logprobs may be from a prefill's)
#: ONNX Runtime's int4 matmul takes another kernel for one row than for a tile of rows
#: (onnx_genai.py's docstring: logits apart by up to 0.7); mlx's are the same here.
ENGINES = [("onnx", "onnx-int4", "onnxruntime_genai", 0.3), ("mlx", "mlx-4bit", "mlx_lm", 1e-4)]


@pytest.fixture(scope="module", params=ENGINES, ids=[e[0] for e in ENGINES])
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[Any, float]]:
    backend, fixture, module, tol = request.param
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[{backend}]')")
    with localrun.load(str(test_model(fixture)), backend=backend, context=CONTEXT,
                       exact=True) as m:
        yield m, tol


def test_engine_greedy_and_echo(engine: tuple[Any, float]) -> None:
    """Greedy picks the most likely token; echo over prompt + reply gives the reply's
    logprobs again (teacher forcing), within the engine's kernel difference."""
    model, tol = engine
    g = model.complete(PROMPT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5)
    assert g.logprobs is not None
    for e in g.logprobs:
        assert e.id == e.top_logprobs[0].id and e.logprob == e.top_logprobs[0].logprob
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-6
    assert "".join(e.token for e in g.logprobs) == g.text
    ids = list(model._session.encode_text(PROMPT).tokens)
    gen = [e.id for e in g.logprobs]
    echo = model.complete(ids + gen, max_tokens=0, echo=True, top_logprobs=5)
    assert [e.id for e in echo.prompt_logprobs] == ids + gen
    assert echo.prompt_logprobs[0].logprob is None
    for forced, generated in zip(echo.prompt_logprobs[len(ids):], g.logprobs, strict=True):
        assert forced.logprob == pytest.approx(generated.logprob, abs=tol)
    # token ids in, the same reply out; echo leaves the reply as it was
    assert model.complete(ids, max_tokens=6, temperature=0).text == g.text
    assert model.complete(PROMPT, max_tokens=6, temperature=0, echo=True).text == g.text


def test_engine_sampled_logprobs_are_the_raw_models(engine: tuple[Any, float]) -> None:
    """The first position's values at a temperature, with a repetition penalty (a logits
    processor on MLX), equal greedy's: the raw distribution, not the tempered one."""
    model, _ = engine
    greedy = model.complete(PROMPT, max_tokens=1, temperature=0, logprobs=True,
                            top_logprobs=5)
    hot = model.complete(PROMPT, max_tokens=3, temperature=1.7, seed=3,
                         repetition_penalty=1.3, logprobs=True, top_logprobs=5)
    assert hot.logprobs is not None and greedy.logprobs is not None
    assert [t.id for t in hot.logprobs[0].top_logprobs] == \
        [t.id for t in greedy.logprobs[0].top_logprobs]
    assert [t.logprob for t in hot.logprobs[0].top_logprobs] == pytest.approx(
        [t.logprob for t in greedy.logprobs[0].top_logprobs], abs=1e-4)


def test_engine_logprobs_under_a_schema_are_the_raw_models(engine: tuple[Any, float]
                                                           ) -> None:
    check_raw_under_a_schema(engine[0])


def test_engine_batch(engine: tuple[Any, float]) -> None:
    """In a batch (MLX: its BatchGenerator; ONNX: in turn) each item reports what it
    does alone."""
    model, tol = engine
    prompts = [PROMPT, "One, two, three,"]
    alone = [model.complete(p, max_tokens=4, temperature=0, logprobs=True) for p in prompts]
    together = model.batch([BatchItem(p, raw=True) for p in prompts], max_tokens=4,
                           temperature=0, logprobs=True)
    for a, b in zip(alone, together, strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        assert [e.id for e in b.logprobs] == [e.id for e in a.logprobs]
        assert [e.logprob for e in b.logprobs] == pytest.approx(
            [e.logprob for e in a.logprobs], abs=max(tol, 0.02))


# -- OpenVINO GenAI: the chosen token's only ---------------------------------------------------


@pytest.fixture(scope="module")
def openvino() -> Iterator[Any]:
    if importlib.util.find_spec("openvino_genai") is None:
        pytest.skip("openvino-genai is not installed (pip install -e '.[openvino]')")
    with localrun.load(str(test_model("openvino-int4")), backend="openvino",
                       context=CONTEXT, exact=True) as m:
        if "logprobs" not in m._session.features:
            pytest.skip(f"OpenVINO GenAI {m.info.engine_version} reports processed "
                        "logprobs (raw ones from 2026.2)")
        yield m


def test_openvino_reports_the_chosen_tokens_raw_logprob(openvino: Any) -> None:
    """Its ContinuousBatchingPipeline gives each chosen token's log probability under
    the raw model (2026.2+): at temperature 0.3 with a repetition penalty the first
    token's equals the greedy call's (a tempered one would be near 0)."""
    g = openvino.complete(PROMPT, max_tokens=6, temperature=0, logprobs=True)
    assert g.logprobs is not None
    assert len(g.logprobs) == g.usage.completion_tokens + (g.finish_reason == "stop")
    assert "".join(e.token for e in g.logprobs) == g.text
    assert all(e.logprob is not None and e.logprob <= 0 and not e.top_logprobs
               for e in g.logprobs)
    h = openvino.complete(PROMPT, max_tokens=2, temperature=0.3, seed=1,
                          repetition_penalty=1.3, logprobs=True)
    assert h.logprobs is not None and h.logprobs[0].id == g.logprobs[0].id
    assert h.logprobs[0].logprob == pytest.approx(g.logprobs[0].logprob, abs=1e-4)
    assert (g.logprobs[0].logprob or 0) < -0.2  # so a tempered value would differ


@pytest.mark.parametrize(("prompt", "options", "option"), [
    (PROMPT, {"top_logprobs": 2}, "top_logprobs"),
    (PROMPT, {"echo": True}, "echo"),
    ([1, 2, 3], {}, "a token-id prompt"),
])
def test_openvino_refuses_what_it_cannot_report(openvino: Any, prompt: Any,
                                                options: dict[str, Any], option: str) -> None:
    with pytest.raises(UnsupportedFeatureError) as e:
        openvino.complete(prompt, max_tokens=2, **options)
    assert e.value.option == option and e.value.backend == "openvino"
