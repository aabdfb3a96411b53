"""``parallel_tool_calls`` (issue 28 item 3): accepted wherever tools are passed and
enforced. False: at most one call, by the grammar where calls are constrained (a forced
call is one call; with "auto" the first call ends the reply) and by keeping only the
first where calls are parsed as written. True: ``tool_choice="required"`` may make
several calls (OpenAI's "required" with parallel calls). Unset: "auto" may make several,
"required" one (llama-server's default).

The real-engine case: after a turn in which the assistant called ``get_weather`` once
per city, asked about two more cities, SmolLM2-135M writes a second call after the
first when its grammar lets it (seen on all four CPU engines): two calls with
``parallel_tool_calls=True``, one with False.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import localrun
from localrun.errors import InvalidToolError
from localrun.structured.constraint import Constraint
from localrun.structured.formats import FALLBACK, FORMATS, call_schema, tool_constraint
from localrun.structured.functions import normalize_tools
from localrun.structured.output import OutputProcessor, prepare, prepare_chat
from tests.models import test_model
from tests.test_conformance import _skip_unless_installed

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

#: The assistant called the tool once per city before; now two cities again.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Rome and in Berlin?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        {"id": "b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}}]},
    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "b", "content": "rain"},
    {"role": "assistant", "content": "Rome is sunny and Berlin has rain."},
    {"role": "user", "content": "What is the weather in Paris and in London?"},
]


# -- the option and the grammar -------------------------------------------------------------


@pytest.mark.parametrize("value", ["no", 0, 1, [False]])
def test_a_value_that_is_not_a_bool_is_refused(value: Any) -> None:
    with pytest.raises(InvalidToolError, match="parallel_tool_calls must be True or False"):
        prepare(tools=[TOOL], parallel_tool_calls=value)


def test_the_request_carries_it() -> None:
    assert prepare(tools=[TOOL]).parallel is None  # type: ignore[union-attr]
    assert prepare(tools=[TOOL], parallel_tool_calls=False).parallel is False  # type: ignore[union-attr]
    # a schema alone takes it too (LangChain sends it with every structured call)
    assert prepare(schema={"type": "object"}, parallel_tool_calls=False) is not None


def test_constraints_by_choice_and_parallel() -> None:
    tools = normalize_tools([TOOL])
    hermes = FORMATS["hermes"]
    auto = tool_constraint(hermes, tools, "auto")
    assert auto is not None and auto.tag is not None and not auto.tag.single
    auto_one = tool_constraint(hermes, tools, "auto", parallel=False)
    assert auto_one is not None and auto_one.tag is not None and auto_one.tag.single
    for parallel in (None, False):  # a forced call is one call
        forced = tool_constraint(hermes, tools, "required", parallel)
        assert forced is not None and forced.repeat is None and forced.tag is None
    several = tool_constraint(hermes, tools, "required", parallel=True)
    assert several is not None and several.repeat is not None
    assert (several.repeat.trigger, several.repeat.end) == ("<tool_call>", "\n</tool_call>")
    # a named tool is called once, whatever parallel says
    named = tool_constraint(hermes, tools, "get_weather", parallel=True)
    assert named is not None and named.repeat is None
    # Mistral's array of calls: one item at most when not parallel
    mistral = FORMATS["mistral"]
    assert "maxItems" not in call_schema(mistral, tools, "required")
    assert call_schema(mistral, tools, "required", parallel=False)["maxItems"] == 1


@pytest.fixture(scope="module")
def compiler() -> Any:
    """llguidance over SmolLM2's tokenizer (EOS id 2)."""
    pytest.importorskip("llguidance")
    from localrun.structured.grammar import GrammarCompiler, tokenizer_from_json

    folder = test_model("hf")
    tok = tokenizer_from_json((folder / "tokenizer.json").read_text(encoding="utf-8"), [2])
    return GrammarCompiler(tok)


def _accepts(compiler: Any, constraint: Constraint, text: str) -> bool:
    """Whether the grammar lets the model write ``text`` and then end the reply."""
    mask = compiler.mask(constraint, "test")
    for t in compiler.tokenizer.tokenize_str(text):
        if not mask.allowed()[t]:
            return False
        mask.consume(t)
    return bool(mask.allowed()[2])


def test_grammars_allow_one_call_or_several(compiler: Any) -> None:
    tools = normalize_tools([TOOL])
    hermes = FORMATS["hermes"]
    one = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    two = one + '\n</tool_call>\n<tool_call>\n' + one.replace("Paris", "London")
    several = tool_constraint(hermes, tools, "required", parallel=True)
    forced = tool_constraint(hermes, tools, "required", parallel=False)
    assert several is not None and forced is not None
    assert _accepts(compiler, several, one) and _accepts(compiler, several, two)
    assert _accepts(compiler, several, two + "\n</tool_call>")
    assert _accepts(compiler, forced, one) and not _accepts(compiler, forced, two)
    text = "Sure.<tool_call>\n" + one + "\n</tool_call>"
    auto = tool_constraint(hermes, tools, "auto")
    auto_one = tool_constraint(hermes, tools, "auto", parallel=False)
    assert auto is not None and auto_one is not None
    assert _accepts(compiler, auto, text + text) and _accepts(compiler, auto_one, text)
    assert not _accepts(compiler, auto_one, text + text)  # the first call ends the reply
    assert not _accepts(compiler, auto_one, text + " More text.")


# -- the parse path (calls written without a constraint) ---------------------------------------


def _process(text: str, parallel: bool | None, pieces: int = 7
             ) -> tuple[OutputProcessor, list[Any], bool]:
    request = prepare(tools=[TOOL], parallel_tool_calls=parallel)
    plan = prepare_chat(request, [{"role": "user", "content": "?"}], None)
    processor = OutputProcessor(plan)
    deltas: list[Any] = []
    halted_early = False
    for i in range(0, len(text), pieces):
        _, d = processor.feed(text[i:i + pieces])
        deltas += d
        if processor.halt and i + pieces < len(text):
            halted_early = True
            break
    deltas += processor.finish()[1]
    return processor, deltas, halted_early


TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "London"}}\n</tool_call>')


def test_the_parse_path_keeps_only_the_first_call() -> None:
    assert prepare_chat(prepare(tools=[TOOL]), [{"role": "user", "content": "?"}],
                     None).fmt == FALLBACK
    processor, deltas, halted = _process(TWO_CALLS, parallel=False)
    result = processor.result("stop")
    assert [json.loads(c.arguments) for c in result.tool_calls] == [{"city": "Paris"}]
    assert {d.index for d in deltas} == {0}  # the second call never streams
    assert halted  # the driver ends the reply once the one call is complete
    processor, deltas, halted = _process(TWO_CALLS, parallel=None)
    assert len(processor.result("stop").tool_calls) == 2 and not halted
    assert {d.index for d in deltas} == {0, 1}


def test_marker_less_calls_parsed_whole_keep_the_first() -> None:
    """Llama 3's JSON calls have no marker: parsed once the reply is complete."""
    request = prepare(tools=[TOOL], parallel_tool_calls=False)
    plan = prepare_chat(request, [{"role": "user", "content": "?"}], None)
    plan = type(plan)(plan.messages, plan.template_tools, plan.render_here, plan.prefill,
                      None, FORMATS["llama3_json"], request)
    processor = OutputProcessor(plan)
    text = ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_weather", "parameters": {"city": "London"}}')
    _, deltas = processor.feed(text)
    deltas += processor.finish()[1]
    calls = processor.result("stop").tool_calls
    assert [c.arguments for c in calls] == ['{"city": "Paris"}']
    assert {d.index for d in deltas} == {0}


# -- real engines ----------------------------------------------------------------------------

ENGINES = (("llama.cpp", "gguf-q4_1"), ("openvino", "openvino-int4"), ("onnx", "onnx-int4"),
           ("mlx", "mlx-4bit"))


@pytest.fixture(scope="module", params=ENGINES, ids=[b for b, _ in ENGINES])
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    backend, fixture = request.param
    _skip_unless_installed(backend)
    with localrun.load(str(test_model(fixture)), backend=backend, context=2048) as model:
        yield backend, model


def _cities(c: Any) -> list[str]:
    assert all(t.name == "get_weather" for t in c.tool_calls)
    return [json.loads(t.arguments)["city"] for t in c.tool_calls]


@pytest.mark.slow
def test_two_calls_when_parallel_one_when_not(engine: tuple[str, Any]) -> None:
    backend, model = engine
    # two calls take 55 tokens; MLX decodes ~5 tokens/s here and its 4-bit model goes on
    # calling after London
    kw: dict[str, Any] = {"tools": [TOOL], "tool_choice": "required", "temperature": 0,
                          "max_tokens": 56 if backend == "mlx" else 80}
    both = model.chat(CONVERSATION, parallel_tool_calls=True, **kw)
    assert _cities(both)[:2] == ["Paris", "London"], both
    one = model.chat(CONVERSATION, parallel_tool_calls=False, **kw)
    assert one.finish_reason == "tool_calls" and _cities(one) == ["Paris"]
    assert one.usage.completion_tokens < both.usage.completion_tokens
    unset = model.chat(CONVERSATION, **kw)  # a forced call is one call unless asked
    assert _cities(unset) == ["Paris"]
    if backend == "mlx":
        return
    # streamed: the second call's deltas never come
    stream = model.stream(CONVERSATION, parallel_tool_calls=False, **kw)
    deltas = [d for chunk in stream for d in chunk.tool_calls]
    assert {d.index for d in deltas} == {0} and stream.completion is not None
    assert _cities(stream.completion) == ["Paris"]
    # and in a batch, where it applies to every item
    batch = model.batch([CONVERSATION, CONVERSATION], parallel_tool_calls=False, **kw)
    assert [_cities(c) for c in batch] == [["Paris"], ["Paris"]]
