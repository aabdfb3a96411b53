"""Thinking models, one contract on every engine (issue 28 item 1, the library side).

The reply's thinking comes apart from its answer (``Completion.reasoning``, chunks whose
``kind`` is "reasoning"), ``think=False`` turns it off, a thinking budget is hard (at N
tokens localrun writes the model's own end marker and the answer follows), and tool calls
after the thinking parse, constrained or not.

No small thinking model can be had offline, so the fixture is built: the embedded
SmolLM2-135M with Qwen3's chat template, changed to open the thinking in the generation
prompt (``tests/chat_templates/qwen3-think-prefilled.jinja``), given through
``load(chat_template=)``. SmolLM2 shares Qwen's ChatML tokens; it never writes
``</think>`` itself, so a budget is what ends its thinking, and a long question keeps it
thinking past 16 tokens on all four CPU engines. What a real model does that SmolLM2
does not (close the thinking itself, split the marker across tokens, open it itself) is
driven through a scripted engine, over the same driver.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import localrun
from localrun.backends.base import Batcher, GenerationStats, Prompt, Session
from localrun.batch import BatchError, BatchItem
from localrun.errors import ChatTemplateError, InvalidSamplingError
from localrun.reasoning import (
    EFFORT_BUDGETS,
    FORMATS,
    ThinkingUnavailableError,
    detect,
    reasoning_request,
)
from localrun.sampling import ResolvedSampling
from localrun.templates import render_chat
from localrun.types import CancelToken, ModelInfo
from tests.models import test_model
from tests.test_conformance import _skip_unless_installed

TEMPLATES = Path(__file__).parent / "chat_templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")
FIXTURE = TEMPLATES / "qwen3-think-prefilled.jinja"
PREFILLED = FIXTURE.read_text(encoding="utf-8")
#: DeepSeek-R1's way, reduced to ChatML: no switch, the generation prompt opens the thinking
R1 = ("{% for m in messages %}{% set c = m['content'] %}{% if '</think>' in c %}"
      "{% set c = c.split('</think>')[-1] %}{% endif %}"
      "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}")
#: DeepSeek-V3.1's switch (off unless asked), reduced to ChatML
V31 = ("{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
       "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
       "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
       "{{ '<|im_start|>assistant\n' }}{% if thinking %}{{ '<think>' }}{% else %}"
       "{{ '</think>' }}{% endif %}{% endif %}")
#: Qwen3's switch with Llama 3's marker-less JSON calls (parsed as written, unconstrained)
LLAMA_THINKER = ("{% if tools %}{{ 'Tools: \"parameters\": dictionary of argument names' }}"
                 "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + "
                 "m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and "
                 "enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% else %}"
                 "{{ '<think>\n' }}{% endif %}{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


# -- formats and options ---------------------------------------------------------------------


def test_formats_come_from_the_template() -> None:
    import json

    assert detect(QWEN3) is FORMATS["qwen3"] and detect(PREFILLED) is FORMATS["qwen3"]
    assert detect(R1) is FORMATS["deepseek-r1"] and detect(V31) is FORMATS["deepseek-v3.1"]
    others = json.loads((TEMPLATES / "templates.json").read_text(encoding="utf-8"))
    assert others and all(detect(t["chat_template"]) is None for t in others.values())
    assert detect(None) is None and detect("") is None
    for fmt in FORMATS.values():  # every row is whole: markers and what localrun writes
        assert fmt.start and fmt.end and fmt.close.strip() == fmt.end
        assert fmt.empty.startswith(fmt.start) and fmt.end in fmt.empty


def test_options_are_checked_and_efforts_are_budgets() -> None:
    assert reasoning_request() is None
    assert reasoning_request(think=False).think is False  # type: ignore[union-attr]
    r = reasoning_request(thinking_budget=16)
    assert r is not None and (r.think, r.budget) == (True, 16)
    r = reasoning_request(thinking_budget=0)
    assert r is not None and r.think is False  # a budget of 0: no thinking
    for effort, budget in EFFORT_BUDGETS.items():
        r = reasoning_request(reasoning_effort=effort)
        assert r is not None and r.budget == (budget or None) and r.think is (budget != 0)
    r = reasoning_request(reasoning_effort="low", thinking_budget=7)
    assert r is not None and r.budget == 7  # the budget given wins over the effort's
    bad: list[tuple[dict[str, Any], str]] = [
        ({"thinking_budget": -1}, "thinking_budget"),
        ({"thinking_budget": 1.5}, "thinking_budget"),
        ({"thinking_budget": True}, "thinking_budget"),
        ({"reasoning_effort": "huge"}, "reasoning_effort"),
        ({"think": "yes"}, "think"),
        ({"think": False, "thinking_budget": 16}, "think"),
        ({"think": True, "reasoning_effort": "none"}, "think"),
    ]
    for kwargs, option in bad:
        with pytest.raises(InvalidSamplingError) as e:
            reasoning_request(**kwargs)
        assert e.value.option == option, kwargs
    with pytest.raises(InvalidSamplingError, match=r"thinking_budget: -1 .*>= 0"):
        reasoning_request(thinking_budget=-1)


# -- the driver, over a scripted engine --------------------------------------------------------


class Thinker(Session):
    """A scripted engine with a chat template: ``generate`` says the reply whose key the
    prompt ends with, one piece per token, and records each prompt and sampling."""

    def __init__(self, template: str | None, replies: dict[str, Sequence[str]],
                 context: int = 512, batching: bool = False) -> None:
        self.chat_template = template
        self.replies = replies
        self.calls: list[tuple[str, ResolvedSampling]] = []
        self.batching = batching
        self.batch_alone = batching  # every sequence through the batcher
        self._batcher: ScriptBatcher | None = None
        self.info = ModelInfo(backend="scripted", engine_version="0", format="gguf",
                              quantization=None, path="scripted", context_length=context)

    def _prompt(self, text: str) -> Prompt:
        return Prompt(list(range(len(text.split()) + 1)), text)

    def encode_chat(self, messages: Sequence[Any]) -> Prompt:
        return self._prompt(render_chat(self.chat_template, messages))

    def encode_text(self, text: str) -> Prompt:
        return self._prompt(text)

    def encode_rendered(self, text: str) -> Prompt:
        return self._prompt(text)

    def check_constraint(self, constraint: Any) -> None:
        """It writes what the scripts say: valid calls where one is due."""

    def generate(self, prompt: Prompt, sampling: ResolvedSampling, cancel: CancelToken,
                 stats: GenerationStats) -> Iterator[str]:
        text = prompt.text or ""
        self.calls.append((text, sampling))
        script = next(v for k, v in self.replies.items() if text.endswith(k))
        for n, piece in enumerate(script, 1):
            if n > sampling.max_tokens:
                stats.finish_reason = "length"
                return
            stats.completion_tokens = n
            yield piece
        stats.finish_reason = "stop"

    def batcher(self) -> Batcher | None:
        if not self.batching:
            return None
        if self._batcher is None:
            self._batcher = ScriptBatcher(self)
        return self._batcher


class ScriptBatcher(Batcher):
    """The scripted engine's sequences, one piece each per step."""

    capacity = 4

    def __init__(self, engine: Thinker) -> None:
        self.engine = engine
        self.running: dict[int, Iterator[str]] = {}
        self.cancelled: set[int] = set()

    def add(self, key: int, prompt: Prompt, sampling: ResolvedSampling,
            stats: GenerationStats) -> None:
        stats.started = time.perf_counter()
        self.running[key] = self.engine.generate(prompt, sampling, CancelToken(), stats)

    def cancel(self, key: int) -> None:
        self.cancelled.add(key)

    def step(self) -> list[tuple[int, str | None]]:
        out: list[tuple[int, str | None]] = []
        for key, pieces in list(self.running.items()):
            piece = None if key in self.cancelled else next(pieces, None)
            if piece is None:
                pieces.close()  # type: ignore[attr-defined]
                del self.running[key]
                self.cancelled.discard(key)
            out.append((key, piece))
        return out


OPEN = "<|im_start|>assistant\n<think>\n"  # the prefilled template's generation prompt
CLOSED = "\n</think>\n\n"  # what localrun writes at a budget
THINKS_AND_ANSWERS = ["Let", " me", " think", ".", "\n", "</think>", "\n\n", "It", " is",
                      " 4", "."]


def test_the_thinking_comes_apart_from_the_answer() -> None:
    """A model that closes its thinking itself: one generation, split as it streams."""
    engine = Thinker(PREFILLED, {OPEN: THINKS_AND_ANSWERS})
    model = localrun.Model(engine)
    assert model.reasoning == "qwen3"
    stream = model.stream("What is 2+2?", max_tokens=50)
    chunks = list(stream)
    c = stream.completion
    assert c is not None and (c.reasoning, c.text, c.finish_reason) == \
        ("Let me think.", "It is 4.", "stop")
    assert (c.usage.completion_tokens, c.usage.reasoning_tokens) == (11, 6)
    assert len(engine.calls) == 1
    kinds = [ch.kind for ch in chunks if ch.reasoning or ch.text]
    assert kinds == sorted(kinds, key=lambda k: k == "text")  # the thinking comes first
    assert not any(ch.reasoning and ch.text for ch in chunks)
    assert "".join(ch.reasoning for ch in chunks) == c.reasoning
    assert "".join(ch.text for ch in chunks) == c.text
    assert c.to_dict()["reasoning"] == c.reasoning
    assert c.to_dict()["usage"]["reasoning_tokens"] == 6


def test_markers_split_across_pieces_and_a_model_that_opens_them_itself() -> None:
    split = ["Hmm", ", ok", "</th", "ink", ">\n", "\nHi"]
    assert localrun.Model(Thinker(PREFILLED, {OPEN: split})).chat("x").reasoning == "Hmm, ok"
    # Qwen3's own template leaves the opening to the model
    opens = ["\n", "<th", "ink>", "\nPlan", ".\n</think>", "\n\nHi", "!"]
    c = localrun.Model(Thinker(QWEN3, {"assistant\n": opens})).chat("x")
    assert (c.reasoning, c.text, c.usage.reasoning_tokens) == ("Plan.", "Hi!", 5)
    # ... or does not open them: no thinking, the text as it came
    plain = localrun.Model(Thinker(QWEN3, {"assistant\n": ["<", "b>Hi</b>"]})).chat("x")
    assert (plain.reasoning, plain.text, plain.usage.reasoning_tokens) == (None, "<b>Hi</b>", 0)
    # a reply that ends while still thinking is all thinking
    cut = localrun.Model(Thinker(PREFILLED, {OPEN: ["Still", " going", "\n"]})).chat("x")
    assert (cut.reasoning, cut.text, cut.usage.reasoning_tokens) == ("Still going", "", 3)


def test_a_budget_closes_the_thinking_and_the_answer_follows() -> None:
    engine = Thinker(PREFILLED, {CLOSED: ["\n", "Four", "."], OPEN: ["a"] * 40})
    model = localrun.Model(engine)
    stream = model.stream("What is 2+2?", thinking_budget=4, max_tokens=20)
    chunks = list(stream)
    c = stream.completion
    assert c is not None and (c.reasoning, c.text, c.finish_reason) == ("aaaa", "Four.", "stop")
    assert (c.usage.reasoning_tokens, c.usage.completion_tokens) == (4, 7)
    (first, s1), (second, s2) = engine.calls
    assert second == first + "aaaa" + CLOSED  # the model's own marker, then its answer
    assert (s1.max_tokens, s2.max_tokens) == (20, 16)  # max_tokens counts the thinking
    assert [ch.kind for ch in chunks if ch.reasoning or ch.text] == \
        ["reasoning"] * 4 + ["text"] * 2
    # where the budget leaves no room, the reply ends with its thinking
    full = model.chat("What is 2+2?", thinking_budget=4, max_tokens=4)
    assert (full.reasoning, full.text, full.finish_reason) == ("aaaa", "", "length")
    assert full.usage.completion_tokens == 4 and len(engine.calls) == 3


def test_a_budget_cut_drops_a_half_written_end_marker() -> None:
    engine = Thinker(PREFILLED, {CLOSED: ["Ok"], OPEN: ["Plan", " it", "\n</", "th"]})
    c = localrun.Model(engine).chat("x", thinking_budget=3)
    assert (c.reasoning, c.text) == ("Plan it", "Ok")
    assert engine.calls[1][0].endswith(OPEN + "Plan it" + CLOSED)


def test_think_false_uses_the_switch_or_writes_an_empty_block() -> None:
    empty = "<think>\n\n</think>\n\n"
    for template in (PREFILLED, R1, QWEN3):
        engine = Thinker(template, {empty: ["Hi"], OPEN: ["thinking"]})
        c = localrun.Model(engine).chat("x", think=False)
        assert (c.reasoning, c.text, c.usage.reasoning_tokens) == (None, "Hi", 0)
        assert engine.calls[0][0].endswith("<|im_start|>assistant\n" + empty), template
    # a budget of 0 and the effort "none" are the same
    engine = Thinker(R1, {empty: ["Hi"]})
    for kw in ({"thinking_budget": 0}, {"reasoning_effort": "none"}):
        assert localrun.Model(engine).chat("x", **kw).reasoning is None
    # DeepSeek-V3.1 thinks only when asked: its switch
    engine = Thinker(V31, {"</think>": ["Hi"], "<think>": ["Hm", "</think>", "Hi"]})
    model = localrun.Model(engine)
    assert model.chat("x").reasoning is None
    on = model.chat("x", think=True)
    assert (on.reasoning, on.text) == ("Hm", "Hi")


def test_stop_strings_apply_to_the_answer_only() -> None:
    engine = Thinker(PREFILLED, {OPEN: ["I", " stop", " here", "</think>", "Go", " stop",
                                        " now"]})
    c = localrun.Model(engine).chat("x", stop=["stop"])
    assert (c.reasoning, c.text, c.finish_reason) == ("I stop here", "Go ", "stop")


def test_a_constrained_answer_runs_in_its_own_phase() -> None:
    """A forced tool call after thinking: the thinking runs free, the grammar and the
    call's opening marker apply to the answer phase alone."""
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    engine = Thinker(PREFILLED, {"</think>\n\n<tool_call>\n": [call],
                                 OPEN: ["Need", " weather", "</think>", "\n\nignored"]})
    c = localrun.Model(engine).chat("Weather in Paris?", tools=[WEATHER],
                                    tool_choice="required")
    assert c.reasoning == "Need weather" and c.finish_reason == "tool_calls"
    assert [t.arguments for t in c.tool_calls] == ['{"city": "Paris"}']
    (p1, s1), (p2, s2) = engine.calls
    assert s1.constraint is None and s2.constraint is not None
    assert p2 == p1 + "Need weather</think>\n\n<tool_call>\n"
    assert c.usage.reasoning_tokens == 3 and c.usage.completion_tokens == 4
    # a budget cut the same way: the close, then the call's marker
    engine = Thinker(PREFILLED, {CLOSED + "<tool_call>\n": [call], OPEN: ["Hm"] * 9})
    c = localrun.Model(engine).chat("x", tools=[WEATHER], tool_choice="required",
                                    thinking_budget=2)
    assert c.reasoning == "HmHm" and len(c.tool_calls) == 1
    # a schema too
    engine = Thinker(PREFILLED, {"</think>\n\n": ['{"a": 1}'], OPEN: ["So", "</think>"]})
    c = localrun.Model(engine).chat("x", schema={"type": "object"})
    assert (c.reasoning, c.parsed) == ("So", {"a": 1})
    assert engine.calls[1][1].constraint is not None


def test_a_call_written_after_the_thinking_parses_unconstrained() -> None:
    """Llama 3's JSON calls have no opening marker, so nothing constrains them: the
    answer is read in the same generation and its call parsed as written."""
    engine = Thinker(LLAMA_THINKER, {OPEN: [
        "Use", " the", " tool", "</think>", "\n\n",
        '{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}']})
    model = localrun.Model(engine)
    stream = model.stream("Weather in Oslo?", tools=[WEATHER])
    deltas = [d for ch in stream for d in ch.tool_calls]
    c = stream.completion
    assert c is not None and len(engine.calls) == 1 and engine.calls[0][1].constraint is None
    assert c.reasoning == "Use the tool" and c.finish_reason == "tool_calls"
    assert [(t.name, t.parsed) for t in c.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert deltas and deltas[0].name == "get_weather"


def test_the_engine_thread_runs_both_phases() -> None:
    """Through a Batcher: a stream fed on its consumer's thread, and a batch fed on the
    engine thread, each go on from the budget in a second sequence."""
    replies = {CLOSED: ["\n", "Four", "."], OPEN: ["a"] * 40}
    engine = Thinker(PREFILLED, replies, batching=True)
    model = localrun.Model(engine)
    alone = localrun.Model(Thinker(PREFILLED, replies)).chat("q", thinking_budget=5,
                                                              max_tokens=30)
    streamed = model.chat("q", thinking_budget=5, max_tokens=30)
    batch = model.batch(["q", "q", "q"], thinking_budget=5, max_tokens=30)
    for c in (streamed, *batch):
        assert (c.reasoning, c.text, c.usage) == (alone.reasoning, alone.text, alone.usage)
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(
        model.chat("q", thinking_budget=3, max_tokens=30))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [(c.reasoning, c.text) for c in results] == [("aaa", "Four.")] * 3


def test_asking_a_model_that_does_not_think_to_think_is_refused() -> None:
    plain = localrun.Model(Thinker(None, {"": ["Hi"]}))
    assert plain.reasoning is None
    assert plain.chat("x", think=False).reasoning is None  # nothing to switch off
    for kw in ({"think": True}, {"thinking_budget": 8}, {"reasoning_effort": "low"}):
        with pytest.raises(ThinkingUnavailableError) as e:
            plain.chat("x", **kw)
        assert e.value.option == next(iter(kw)) and "does not think" in e.value.message
    thinker = localrun.Model(Thinker(PREFILLED, {"": ["Hi"]}))
    with pytest.raises(ThinkingUnavailableError, match="raw prompt"):
        thinker.complete("x", thinking_budget=8)
    with pytest.raises(BatchError) as batch:  # an item's own error, as for any option
        thinker.batch([BatchItem("x", raw=True), "y"], think=True)
    assert isinstance(batch.value.errors[0], ThinkingUnavailableError)
    assert list(batch.value.errors) == [0]
    with pytest.raises(InvalidSamplingError, match="thinking_budget"):
        thinker.chat("x", thinking_budget=-1)
    # nothing was generated for any refused call: only the batch's good item ran
    assert [p for p, _ in thinker._session.calls] == [  # type: ignore[union-attr]
        "<|im_start|>user\ny<|im_end|>\n" + OPEN]


def test_an_earlier_turns_thinking_goes_back_to_the_template() -> None:
    """Qwen3's template shows the thinking of the turn being built (between tool calls):
    ``reasoning_content`` on an assistant message reaches it."""
    engine = Thinker(QWEN3, {"assistant\n": ["Done."]})
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need the tool.",
         "tool_calls": [{"id": "a", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"}]
    localrun.Model(engine).chat(messages, tools=[WEATHER], tool_choice="none")
    assert "<think>\nI need the tool.\n</think>\n\n<tool_call>" in engine.calls[0][0]
    with pytest.raises(localrun.LocalrunError, match="reasoning_content must be a string"):
        localrun.Model(engine).chat([{"role": "assistant", "content": "x",
                                      "reasoning_content": 3}])


def test_the_catalog_names_the_format_where_the_template_may_not() -> None:
    from localrun.naming.catalog import entries

    named = {alias: e.reasoning for alias, e in entries().items() if e.reasoning}
    assert set(named.values()) <= set(FORMATS)
    assert {alias.split(":")[0] for alias in named} == {"qwen3", "deepseek-r1"}
    # a template that says nothing about thinking: the catalog's format is used
    engine = Thinker("{{ '<|im_start|>assistant\n' }}",
                     {"<think>\n\n</think>\n\n": ["Hi"], "": ["<think>", "Hm</think>Hi"]})
    model = localrun.Model(engine, reasoning="deepseek-r1")
    assert model.reasoning == "deepseek-r1"
    assert (model.chat("x").reasoning, model.chat("x", think=False).reasoning) == ("Hm", None)
    # a template the caller gives says all there is
    assert localrun.Model(engine, reasoning="qwen3", chat_template="{{ 'x' }}").reasoning \
        is None


def test_a_chat_template_given_at_load_renders_every_conversation(tmp_path: Path) -> None:
    from localrun.api import read_template

    assert read_template(FIXTURE) == PREFILLED == read_template(str(FIXTURE))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        read_template("{% if %}")
    with pytest.raises(localrun.LocalrunError, match="Cannot read the chat template"):
        read_template(tmp_path / "missing.jinja")
    engine = Thinker(None, {OPEN: ["Hm", "</think>", "Hi"], "": ["plain"]})
    assert localrun.Model(engine).chat("x").text == "plain"
    model = localrun.Model(engine, chat_template=PREFILLED)
    assert model.reasoning == "qwen3" and model.chat("x").reasoning == "Hm"


# -- real engines, with the fixture -------------------------------------------------------------

ENGINES = (("llama.cpp", "gguf-q4_1"), ("openvino", "openvino-int4"), ("onnx", "onnx-int4"),
           ("mlx", "mlx-4bit"))
#: Long enough a question that SmolLM2 is still thinking at 16 tokens on every engine.
QUESTION = "List the planets of the solar system."
BUDGET = 16


@pytest.fixture(scope="module", params=ENGINES, ids=[b for b, _ in ENGINES])
def thinker(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    backend, fixture = request.param
    _skip_unless_installed(backend)
    with localrun.load(str(test_model(fixture)), backend=backend, context=2048,
                       chat_template=FIXTURE, exact=True) as model:
        yield backend, model


class Prompts:
    """The prompts the engine is given, whichever way the driver runs it
    (``Session.generate``, or its Batcher's ``add``)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.batcher = session.batcher()
        self.seen: list[Any] = []

    def __enter__(self) -> Prompts:
        real, add = self.session.generate, self.batcher and self.batcher.add

        def generate(prompt: Any, *rest: Any) -> Any:
            self.seen.append(prompt)
            return real(prompt, *rest)

        def added(key: int, prompt: Any, *rest: Any) -> Any:
            self.seen.append(prompt)
            return add(key, prompt, *rest)

        self.session.generate = generate
        if self.batcher is not None:
            self.batcher.add = added
        return self

    def __exit__(self, *exc: object) -> None:
        del self.session.generate
        if self.batcher is not None:
            del self.batcher.add


@pytest.mark.slow
def test_reasoning_apart_and_a_budget_of_16_on_a_real_engine(thinker: tuple[str, Any]
                                                             ) -> None:
    _, model = thinker
    n = 40
    assert model.reasoning == "qwen3"
    free = model.chat(QUESTION, temperature=0, max_tokens=n)
    assert free.reasoning and free.usage.reasoning_tokens > BUDGET
    assert "<think>" not in free.reasoning + free.text
    scored = "logprobs" in model._session.features  # one entry per token, both phases
    with Prompts(model._session) as seen:
        c = model.chat(QUESTION, temperature=0, max_tokens=n, thinking_budget=BUDGET,
                       **({"logprobs": True} if scored else {}))
    if scored:
        assert c.logprobs is not None
        assert len(c.logprobs) == c.usage.completion_tokens + (c.finish_reason == "stop")
    assert c.usage.reasoning_tokens == BUDGET and c.text and free.reasoning.startswith(
        c.reasoning[:10])
    # what the model saw: its 16 tokens of thinking, then the end marker localrun wrote
    first, second = seen.seen
    assert second.text.startswith(first.text) and second.text.endswith(CLOSED)
    thought = second.text[len(first.text):-len(CLOSED)]
    assert thought.strip() == c.reasoning  # as the model wrote it (its blanks kept)
    marker = model.count_tokens(first.text + thought + CLOSED) - \
        model.count_tokens(first.text + thought)
    assert len(second.tokens) - len(first.tokens) <= BUDGET + marker
    # the marker localrun wrote is the prompt's, not the answer's (a small model may copy
    # it later in its answer: its own text)
    assert c.usage.completion_tokens <= n and not c.text.startswith("</think>")


@pytest.mark.slow
def test_streams_think_off_and_tool_calls_on_a_real_engine(thinker: tuple[str, Any]
                                                           ) -> None:
    _, model = thinker
    n = 30
    stream = model.stream(QUESTION, temperature=0, max_tokens=n, thinking_budget=8)
    chunks = list(stream)
    c = stream.completion
    assert c is not None and c.reasoning and c.text
    assert not any(ch.reasoning and ch.text for ch in chunks)
    assert "".join(ch.reasoning for ch in chunks) == c.reasoning
    assert "".join(ch.text for ch in chunks) == c.text
    off = model.chat(QUESTION, temperature=0, max_tokens=8, think=False)
    assert off.reasoning is None and off.usage.reasoning_tokens == 0 and off.text
    call = model.chat("What is the weather in Paris?", tools=[WEATHER], temperature=0,
                      tool_choice="required", max_tokens=60, thinking_budget=8)
    assert call.reasoning and call.usage.reasoning_tokens == 8
    assert call.finish_reason == "tool_calls" and call.tool_calls[0].parsed == {"city": "Paris"}


@pytest.mark.slow
def test_a_batch_thinks_as_single_calls_do(thinker: tuple[str, Any]) -> None:
    _, model = thinker
    questions = [QUESTION, "Name three colours of the rainbow and say why."]
    alone = [model.chat(q, temperature=0, max_tokens=30, thinking_budget=BUDGET)
             for q in questions]
    batch = model.batch(questions, temperature=0, max_tokens=30, thinking_budget=BUDGET)
    for a, b in zip(alone, batch, strict=True):
        assert b.usage.reasoning_tokens <= BUDGET and b.reasoning == a.reasoning
        assert b.usage == a.usage


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_think_flags(default_gguf: Path) -> None:
    """run: the thinking on stderr, the answer on stdout; --no-think; bad values are one
    line and a non-zero exit, before any model loads."""
    import subprocess

    from tests.conftest import localrun_cmd

    base = [*localrun_cmd(), "run", str(default_gguf), QUESTION, "-t", "0", "-n", "30"]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *extra], capture_output=True, text=True, timeout=300)

    think = run("--chat-template", str(FIXTURE), "--thinking-budget", "8")
    assert think.returncode == 0, think.stderr
    assert think.stderr.strip() and think.stdout.strip()
    assert "</think>" not in think.stdout + think.stderr
    js = run("--chat-template", str(FIXTURE), "--thinking-budget", "8", "--json")
    import json

    out = json.loads(js.stdout)
    assert out["usage"]["reasoning_tokens"] == 8 and out["reasoning"] == think.stderr.strip()
    assert out["text"].strip() == think.stdout.strip()
    off = run("--chat-template", str(FIXTURE), "--no-think", "--json")
    assert "reasoning" not in json.loads(off.stdout)
    chat = subprocess.run([*localrun_cmd(), "chat", str(default_gguf), "-t", "0", "-n", "30",
                           "--chat-template", str(FIXTURE), "--thinking-budget", "8"],
                          input=QUESTION, capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0 and chat.stdout.strip() == think.stdout.strip()
    assert chat.stderr.startswith(think.stderr.strip())  # the thinking, then the note
    for extra, code, words in (
            (("--thinking-budget", "-1"), 2, "--thinking-budget"),
            (("--reasoning-effort", "huge"), 1, "reasoning_effort"),
            (("--think",), 1, "does not think"),
            (("--chat-template", "/nonexistent.jinja"), 1, "Cannot read the chat template")):
        bad = run(*extra)
        assert bad.returncode == code and words in bad.stderr, (extra, bad.stderr)
        assert "Traceback" not in bad.stderr
