"""Structured output and tool calling without an engine (issue 13): request shapes,
tools from Python functions, formats read from real chat templates, the tool-call
parsers on real output strings, streamed deltas, and llguidance grammars on the
SmolLM2 tokenizer. The engines themselves: tests/test_structured_engines.py.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypedDict

import pytest

from localrun.errors import (
    InvalidToolError,
    LocalrunError,
    StructuredOutputError,
    UnsupportedSchemaError,
)
from localrun.structured.calls import ToolCall, ToolCallDelta
from localrun.structured.constraint import Constraint, ToolTag
from localrun.structured.formats import (
    FALLBACK,
    FORMATS,
    call_schema,
    detect_format,
    fallback_messages,
    forced_prefill,
    native_messages,
    tool_constraint,
)
from localrun.structured.functions import (
    function_tool,
    normalize_tool_choice,
    normalize_tools,
    parse_docstring,
)
from localrun.structured.output import OutputProcessor, prepare, prepare_chat
from localrun.structured.parsers import ToolCallParser, parse_tool_calls
from localrun.structured.schema import closed_objects, output_spec
from localrun.templates import normalize_messages, render_chat

TEMPLATES: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).parent / "chat_templates" / "templates.json").read_text(encoding="utf-8"))


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """Get the current weather in a city.

    Args:
        city: The city, e.g. "Oslo".
        unit: The temperature unit.
    """
    return f"21 degrees {unit} in {city}"


# -- response_format / schema -------------------------------------------------------------


def test_response_format_shapes() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    closed = {**schema, "additionalProperties": False}
    assert output_spec() is None and output_spec({"type": "text"}) is None
    assert output_spec({"type": "json_object"}).schema == {"type": "object"}  # type: ignore
    assert output_spec({"type": "json_object", "schema": schema}).schema == closed  # type: ignore
    spec = output_spec({"type": "json_schema",
                        "json_schema": {"name": "thing", "schema": schema, "strict": True}})
    assert spec is not None and spec.schema == closed and spec.name == "thing"
    assert output_spec(schema=schema).schema == closed  # type: ignore[union-attr]
    for bad in ({"type": "xml"}, {"type": "json_schema"}, "json", 3):
        with pytest.raises(InvalidToolError):
            output_spec(bad)
    with pytest.raises(InvalidToolError, match="not both"):
        output_spec({"type": "json_object"}, schema)


def test_pydantic_schema_parses_into_the_model() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):  # type: ignore[name-defined, misc]
        name: str
        age: int

    spec = output_spec(schema=Person)
    assert spec is not None and spec.model is Person
    assert spec.schema["additionalProperties"] is False  # pydantic leaves objects open
    assert spec.parse('{"name": "Ann", "age": 31}') == Person(name="Ann", age=31)
    with pytest.raises(StructuredOutputError, match="Person"):
        spec.parse('{"name": "Ann", "age": "old"}')


def test_closed_objects_reach_nested_and_referenced_objects() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}},
              "$defs": {"B": {"type": "object", "properties": {"x": {}}}},
              "anyOf": [{"properties": {"y": {}}}], "items": {"properties": {"z": {}}}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["$defs"]["B"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False
    assert out["items"]["additionalProperties"] is False
    # what the schema says wins; an object without properties stays open
    assert closed_objects({"type": "object"}) == {"type": "object"}
    kept = {"properties": {}, "additionalProperties": {"type": "string"}}
    assert closed_objects(kept) == kept


def test_prepare_refuses_what_cannot_be_enforced() -> None:
    assert prepare() is None
    with pytest.raises(UnsupportedSchemaError, match="uniqueItems"):
        prepare(schema={"type": "array", "uniqueItems": True})
    with pytest.raises(UnsupportedSchemaError, match="look-around"):
        prepare(schema={"type": "string", "pattern": "(?=a)b"})
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}
    with pytest.raises(UnsupportedSchemaError, match="tool 'f'"):
        prepare(tools=[bad_tool])
    prepare(tools=[bad_tool], tool_choice="none")  # not called: not enforced
    with pytest.raises(InvalidToolError, match="both a tool call"):
        prepare(schema={"type": "object"}, tools=[get_weather])
    assert prepare(schema={"type": "object"}, tools=[get_weather], tool_choice="none")
    with pytest.raises(InvalidToolError, match="without tools"):
        prepare(tool_choice="required")
    err = UnsupportedSchemaError("the schema", "Unimplemented keys: [\"uniqueItems\"]")
    assert isinstance(err, LocalrunError) and err.hint


# -- tools ----------------------------------------------------------------------------------


def test_function_tool_from_signature_hints_and_docstring() -> None:
    tool = function_tool(get_weather)
    assert tool.name == "get_weather" and tool.function is get_weather
    assert tool.description == "Get the current weather in a city."
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": 'The city, e.g. "Oslo".'},
            "unit": {"enum": ["celsius", "fahrenheit"], "description": "The temperature unit.",
                     "default": "celsius"},
        },
        "required": ["city"],
        "additionalProperties": False,
    }


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(TypedDict):
    x: float
    y: float


@dataclass
class Box:
    width: int
    label: str = "box"


def test_type_hints_map_to_json_schema() -> None:
    def f(a: int, b: float | None, c: list[str], d: dict[str, int], e: tuple[int, str],
          g: Color, h: Point, i: Box, j: Annotated[str, "a note"], k: Any = None,
          *args: Any, **kw: Any) -> None:
        """Do things.

        More text that is not the summary.
        """

    props = function_tool(f).parameters["properties"]
    assert props["a"] == {"type": "integer"}
    assert props["b"] == {"anyOf": [{"type": "number"}, {"type": "null"}]}
    assert props["c"] == {"type": "array", "items": {"type": "string"}}
    assert props["d"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert props["e"]["prefixItems"] == [{"type": "integer"}, {"type": "string"}]
    assert props["g"] == {"enum": ["red", "blue"]}
    assert props["h"]["required"] == ["x", "y"]
    assert props["i"]["required"] == ["width"]
    assert props["j"] == {"type": "string", "description": "a note"}
    assert props["k"] == {"default": None}
    assert "args" not in props and "kw" not in props
    assert function_tool(f).description == "Do things."

    def bad(x: set[bytes]) -> None: ...

    with pytest.raises(InvalidToolError, match="parameter x"):
        function_tool(bad)


@pytest.mark.parametrize("doc", [
    "Add.\n\nArgs:\n    a (int): First one.\n    b: Second\n        one.\n",
    "Add.\n\n:param a: First one.\n:param int b: Second one.\n:returns: the sum\n",
    "Add.\n\nParameters\n----------\na : int\n    First one.\nb : int\n    Second one.\n",
])
def test_docstring_styles(doc: str) -> None:
    desc, params = parse_docstring(doc)
    assert desc == "Add."
    assert params == {"a": "First one.", "b": "Second one."}


def test_tool_shapes_and_choice() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Lookup(pydantic.BaseModel):  # type: ignore[name-defined, misc]
        """Look a word up."""

        word: str

    flat = {"name": "search", "description": "Search.", "parameters": {"type": "object"}}
    tools = normalize_tools([get_weather, Lookup, flat,
                             {"type": "function", "function": {"name": "noop"}}])
    assert [t.name for t in tools] == ["get_weather", "Lookup", "search", "noop"]
    assert tools[1].description == "Look a word up." and tools[1].model is Lookup
    assert tools[1].parse_arguments('{"word": "cat"}') == Lookup(word="cat")
    assert tools[0].to_openai()["function"]["name"] == "get_weather"
    assert normalize_tool_choice(None, tools) == "auto"
    assert normalize_tool_choice(None, ()) == "none"
    assert normalize_tool_choice({"type": "function", "function": {"name": "search"}},
                                 tools) == "search"
    assert normalize_tool_choice({"type": "function", "name": "noop"}, tools) == "noop"
    assert normalize_tool_choice(get_weather, tools) == "get_weather"
    with pytest.raises(InvalidToolError, match="not among the tools"):
        normalize_tool_choice("nope", tools)
    with pytest.raises(InvalidToolError, match="share the name"):
        normalize_tools([get_weather, get_weather])
    for bad in ("get_weather", [{"type": "retrieval"}], [{"name": "has space"}], [3]):
        with pytest.raises(InvalidToolError):
            normalize_tools(bad)


# -- formats and templates ------------------------------------------------------------------


@pytest.mark.parametrize("model, fmt", [
    ("qwen2.5", "hermes"), ("hermes-2-pro", "hermes"), ("llama3.1", "llama3_json"),
    ("mistral-nemo", "mistral"), ("mistral-7b-v0.3", "mistral"),
])
def test_format_is_read_from_the_template(model: str, fmt: str) -> None:
    found = detect_format(TEMPLATES[model]["chat_template"])
    assert found.name == fmt and found.native


def test_templates_without_tools_get_the_fallback() -> None:
    smollm2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
               "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}")
    assert detect_format(smollm2) == FALLBACK and not FALLBACK.native
    assert detect_format(None) == FALLBACK
    # renders tools, but in a format localrun cannot parse: the fallback too
    assert detect_format("{% for t in tools %}{{ t }}{% endfor %}") == FALLBACK
    assert detect_format("{{ '[func_name1(params_name1=params_value1)]' }}{{ tools }}"
                         ).name == "pythonic"


@pytest.mark.parametrize("model", sorted(TEMPLATES))
def test_tools_render_as_transformers_renders_them(model: str) -> None:
    """The five templates (tools, tool calls and tool results in the conversation) give
    exactly the text transformers gives (huggingface.js' reference renderings)."""
    case = TEMPLATES[model]
    data = case["data"]
    out = render_chat(case["chat_template"], data["messages"],
                      bos_token=data.get("bos_token") or "",
                      eos_token=data.get("eos_token") or "",
                      add_generation_prompt=data.get("add_generation_prompt", False),
                      tools=data.get("tools"))
    assert out == case["target"]


def test_native_messages_follow_the_template_conventions() -> None:
    """OpenAI-shaped turns (arguments as a JSON string, any call id) become what the
    templates take: arguments as a dict, the tool's name on its result, and 9-character
    ids for Mistral; Mistral-Nemo's template then renders the round trip."""
    call = ToolCall("call_abcdefghijklmnopqrstuvwx", "get_weather", '{"city": "Oslo"}')
    msgs = normalize_messages([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call.id, "content": {"temp": 21}},
    ])
    out = native_messages(msgs, FORMATS["mistral"])
    calls = out[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"city": "Oslo"}
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()
    assert out[2]["tool_call_id"] == calls[0]["id"] and out[2]["name"] == "get_weather"
    assert out[2]["content"] == '{"temp": 21}'
    text = render_chat(TEMPLATES["mistral-nemo"]["chat_template"], out, bos_token="<s>",
                       eos_token="</s>", tools=[function_tool(get_weather).to_openai()])
    assert f'"name": "get_weather", "arguments": {{"city": "Oslo"}}, "id": "{calls[0]["id"]}"' \
        in text
    assert f'[TOOL_RESULTS]{{"content": {{"temp": 21}}, "call_id": "{calls[0]["id"]}"}}' \
        in text


def test_fallback_messages_describe_tools_and_fold_tool_turns() -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Oslo"}')
    msgs = normalize_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call.to_dict()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ])
    out = fallback_messages(msgs, normalize_tools([get_weather]))
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Oslo"}}\n</tool_call>')
    assert out[3]["content"].count("<tool_response>") == 2
    assert '"content": "21 C"' in out[3]["content"]


def test_messages_are_checked() -> None:
    with pytest.raises(LocalrunError, match="Message 0"):
        normalize_messages([{"role": "assistant", "content": None}])
    with pytest.raises(LocalrunError, match="tool_call_id must be a string"):
        normalize_messages([{"role": "tool", "content": "x", "tool_call_id": 3}])
    with pytest.raises(LocalrunError, match="tool call"):
        normalize_messages([{"role": "assistant", "content": "", "tool_calls": [{"x": 1}]}])


def test_plan_for_each_tool_choice() -> None:
    template = TEMPLATES["qwen2.5"]["chat_template"]
    msgs = normalize_messages("Weather in Oslo?")
    auto = prepare_chat(prepare(tools=[get_weather]), msgs, template)
    assert auto.render_here and auto.template_tools and auto.prefill == ""
    assert auto.constraint is not None and auto.constraint.tag == ToolTag(
        "<tool_call>", "\n", "\n</tool_call>")
    forced = prepare_chat(prepare(tools=[get_weather], tool_choice="required"), msgs, template)
    assert forced.prefill == "<tool_call>\n" and forced.constraint is not None
    assert forced.constraint.tag is None
    assert forced.constraint.schema_dict["properties"]["name"] == {"const": "get_weather"}
    none = prepare_chat(prepare(tools=[get_weather], tool_choice="none"), msgs, template)
    assert none.constraint is None and none.template_tools is None and none.fmt is None
    fallback = prepare_chat(prepare(tools=[get_weather], tool_choice="get_weather"), msgs, None)
    assert not fallback.render_here and fallback.prefill == "<tool_call>\n"
    assert fallback.messages[0]["role"] == "system"
    llama = prepare_chat(prepare(tools=[get_weather]), msgs, TEMPLATES["llama3.1"]["chat_template"])
    assert llama.constraint is None  # no marker: "auto" is parsed, not constrained
    schema = prepare_chat(prepare(schema={"type": "object"}), msgs, template)
    assert schema.constraint == Constraint.json({"type": "object"}, "JSON Schema 'schema'")


def test_call_schema_keeps_refs_resolvable() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):  # type: ignore[name-defined, misc]
        sku: str

    class Order(pydantic.BaseModel):  # type: ignore[name-defined, misc]
        items: list[Item]

    tools = normalize_tools([Order, get_weather])
    schema = call_schema(FORMATS["mistral"], tools, "required")
    assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
    assert "t0_Item" in schema["$defs"]
    args = schema["items"]["anyOf"][0]["properties"]["arguments"]
    assert args["properties"]["items"]["items"] == {"$ref": "#/$defs/t0_Item"}
    from localrun.structured.grammar import check_schema

    check_schema(schema)  # every $ref resolves from the root
    named = call_schema(FORMATS["mistral"], tools, "get_weather")
    assert named["maxItems"] == 1 and "anyOf" not in named["items"]
    assert forced_prefill(FORMATS["mistral"]) == "[TOOL_CALLS]"
    assert forced_prefill(FORMATS["llama3_json"]) == ""
    assert tool_constraint(FORMATS["hermes"], tools, "none") is None


# -- parsers on real output strings ----------------------------------------------------------

#: Replies as the models write them (from the models' documentation and the parsers'
#: test suites in vLLM and llama.cpp), with what they must parse to.
REAL_OUTPUTS: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    # Qwen2.5 (Qwen's function-calling guide): two calls in one turn
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
     '"San Francisco, CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date",'
     ' "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n'
     '</tool_call>', "",
     [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
      ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]),
    # Hermes 2 Pro: arguments before the name, as its template asks
    ("hermes", 'Let me look that up.\n<tool_call>\n{"arguments": {"symbol": "TSLA"}, '
     '"name": "get_stock_fundamentals"}\n</tool_call>', "Let me look that up.",
     [("get_stock_fundamentals", {"symbol": "TSLA"})]),
    # Hermes 3 writing the arguments as a JSON string
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
     '\n</tool_call>', "", [("get_weather", {"city": "Oslo"})]),
    # Llama 3.1 (its model card): JSON with "parameters"
    ("llama3_json", '{"name": "get_current_conditions", "parameters": {"location": '
     '"San Francisco, CA", "unit": "Fahrenheit"}}', "",
     [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "", [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", "The capital of France is Paris.", "The capital of France is Paris.", []),
    # Llama 3.2 / Llama 4 pythonic
    ("pythonic", '[get_weather(city="San Francisco", metric="celsius"), '
     'get_time(zone="PST", dst=True, offset=-8)]', "",
     [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
      ("get_time", {"zone": "PST", "dst": True, "offset": -8})]),
    ("pythonic", "<|python_start|>[lookup(word='cat')]<|python_end|>", "",
     [("lookup", {"word": "cat"})]),
    # Mistral 7B v0.3 / Nemo: one array after [TOOL_CALLS]
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": '
     '"Paris, France", "format": "celsius"}}]', "",
     [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": '
     '{"x": [1, {"y": "}]"}]}}]', "", [("a", {}), ("b", {"x": [1, {"y": "}]"}]})]),
    # Mistral Small 3.2 (tekken v11): name[ARGS]{...}
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "",
     [("get_weather", {"city": "Paris"})]),
    ("hermes", "No tool needed: 4.", "No tool needed: 4.", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}', '<tool_call>\n{"name": "f", '
     '"arguments": {"a": 1}', []),  # cut short: not a call, its text stays
]


@pytest.mark.parametrize("fmt, text, content, calls", REAL_OUTPUTS,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(REAL_OUTPUTS)])
def test_parsers_on_real_outputs(fmt: str, text: str, content: str,
                                 calls: list[tuple[str, dict[str, Any]]]) -> None:
    got_content, got = parse_tool_calls(text, FORMATS[fmt])
    assert got_content.strip() == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.parsed == json.loads(c.arguments) for c in got)
    if fmt == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got)
    else:
        assert all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("fmt, text, content, calls", REAL_OUTPUTS,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(REAL_OUTPUTS)])
def test_streamed_deltas_reassemble_to_the_whole(fmt: str, text: str, content: str,
                                                 calls: list[Any]) -> None:
    """Fed one character at a time (the worst split an engine can make), the parser
    gives the same content and calls; each call's first delta has its index, id and
    name, and its argument fragments concatenate to the call's JSON arguments."""
    whole_content, whole = parse_tool_calls(text, FORMATS[fmt])
    parser = ToolCallParser(FORMATS[fmt])
    out, deltas = "", []
    for ch in text:
        c, d = parser.feed(ch)
        out, deltas = out + c, deltas + d
    c, d = parser.finish()
    out, deltas = out + c, deltas + d
    assert out == whole_content
    assert [(k.name, k.arguments) for k in parser.calls] == [(k.name, k.arguments) for k in whole]
    by_index: dict[int, list[ToolCallDelta]] = {}
    for delta in deltas:
        by_index.setdefault(delta.index, []).append(delta)
    # a call cut short streams deltas before it fails (documented): only then an extra index
    cut_short = not calls and "<tool_call>" in text
    assert sorted(by_index) == list(range(len(whole) + (1 if cut_short else 0)))
    for i, call in enumerate(parser.calls):
        first, *rest = by_index[i]
        assert (first.id, first.name, first.arguments) == (call.id, call.name, "")
        assert all(d.id is None and d.name is None for d in rest)
        assert "".join(d.arguments for d in rest) == call.arguments
        json.loads(call.arguments)


def test_marker_prefix_is_held_back_until_it_is_known() -> None:
    parser = ToolCallParser(FORMATS["hermes"])
    assert parser.feed("Sure <tool") == ("Sure ", [])  # "<tool" may start "<tool_call>"
    assert parser.feed("s are fun") == ("<tools are fun", [])
    assert parser.finish() == ("", [])


def test_delta_and_call_dicts_are_openai_shaped() -> None:
    assert ToolCallDelta(0, "call_1", "f").to_dict() == {
        "index": 0, "id": "call_1", "type": "function",
        "function": {"arguments": "", "name": "f"}}
    assert ToolCallDelta(0, arguments='{"a"').to_dict() == {
        "index": 0, "function": {"arguments": '{"a"'}}
    assert ToolCall("c", "f", "{}").to_dict() == {
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_output_processor_results() -> None:
    msgs = normalize_messages("hi")
    plan = prepare_chat(prepare(schema={"type": "object", "properties": {"a": {}}}), msgs, None)
    p = OutputProcessor(plan)
    p.feed('{"a": 1}')
    p.finish()
    assert p.result("stop").parsed == {"a": 1}
    p = OutputProcessor(plan)
    p.feed('{"a": ')
    p.finish()
    cut = p.result("length")
    assert cut.parsed is None and cut.error is not None and cut.error.reason == "length"
    assert p.result("cancelled").error is None
    forced = prepare_chat(prepare(tools=[get_weather], tool_choice="required"), msgs, None)
    p = OutputProcessor(forced)
    content, deltas = p.feed('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert content == "" and deltas[0].name == "get_weather"
    p.finish()
    r = p.result("stop")
    assert r.finish_reason == "tool_calls" and r.tool_calls[0].parsed == {"city": "Oslo"}
    p = OutputProcessor(forced)
    p.feed('{"name": "get_weather", "argu')
    content, _ = p.finish()
    assert content == '{"name": "get_weather", "argu'  # not the prompt's "<tool_call>"
    assert p.result("length").error is not None


# -- llguidance on the real tokenizer ---------------------------------------------------------


@pytest.fixture(scope="module")
def compiler() -> Any:
    from localrun.structured.grammar import GrammarCompiler, tokenizer_from_json
    from tests.models import test_model

    folder = test_model("hf")
    tok = tokenizer_from_json((folder / "tokenizer.json").read_text(encoding="utf-8"), [2])
    return GrammarCompiler(tok)


def _allowed(compiler: Any, constraint: Constraint, text: str) -> bool:
    """Whether the grammar lets the model write ``text`` then end the reply (EOS)."""
    mask = compiler.mask(constraint, "test")
    for t in compiler.tokenizer.tokenize_str(text):
        if not mask.allowed()[t]:
            return False
        mask.consume(t)
    return bool(mask.allowed()[2])


def test_json_grammar_allows_exactly_the_schema(compiler: Any) -> None:
    person = Constraint.json(closed_objects({
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                         "role": {"enum": ["admin", "user"]}},
        "required": ["name", "role"]}))
    assert _allowed(compiler, person, '{"name": "Ann", "role": "admin"}')
    assert not _allowed(compiler, person, '{"name": "Ann", "role": "root"}')
    assert not _allowed(compiler, person, '{"name": "Annabelle", "role": "user"}')
    assert not _allowed(compiler, person, '{"name": "Ann"}')
    assert not _allowed(compiler, person, '{"name": "Ann", "role": "user", "x": 1}')
    # compact layout only: no free whitespace to wander into
    assert not _allowed(compiler, person, '{\n"name": "Ann", "role": "user"}')


def test_auto_tool_grammar_constrains_only_after_the_marker(compiler: Any) -> None:
    tools = normalize_tools([get_weather])
    c = tool_constraint(FALLBACK, tools, "auto")
    assert c is not None
    assert _allowed(compiler, c, "It is sunny, no tool needed.")
    assert _allowed(compiler, c, 'Checking.<tool_call>\n{"name": "get_weather", "arguments": '
                    '{"city": "Oslo"}}\n</tool_call>')
    assert not _allowed(compiler, c, '<tool_call>\n{"name": "get_time", "arguments": {}}')
    assert not _allowed(compiler, c, '<tool_call>\n{"name": "get_weather", "arguments": '
                        '{"town": "Oslo"}}')


def test_special_token_markers_are_matched_as_tokens(compiler: Any) -> None:
    from localrun.structured.grammar import constraint_grammar, special_token

    tok = compiler.tokenizer
    assert special_token(tok, "<|im_start|>") == 1
    assert special_token(tok, "<tool_call>") is None  # plain text for SmolLM2
    c = Constraint.json({"type": "object"}, tag=ToolTag("<|im_start|>", "", ""))
    assert "<[1]>" in constraint_grammar(c, tok)


def test_masks_pad_to_the_engines_width(compiler: Any) -> None:
    import numpy as np

    from localrun.structured.grammar import GrammarCompiler

    wide = GrammarCompiler(compiler.tokenizer, compiler.tokenizer.vocab_size + 64)
    mask = wide.mask(Constraint.json({"type": "boolean"}), "test")
    allowed = mask.allowed()
    assert allowed.shape == (compiler.tokenizer.vocab_size + 64,) and not allowed[-64:].any()
    logits = np.zeros(allowed.shape[0], dtype=np.float32)
    out = mask.apply(logits)
    assert np.isneginf(out[~allowed]).all() and (out[allowed] == 0).all()
    with pytest.raises(LocalrunError, match="rejected token"):
        mask.consume(int(np.flatnonzero(~allowed)[0]))


def test_unsupported_schema_names_the_engine(compiler: Any) -> None:
    from localrun.structured.grammar import LazyGrammar

    lazy = LazyGrammar("onnx", lambda: compiler.tokenizer)
    with pytest.raises(UnsupportedSchemaError, match="on onnx") as e:
        lazy.check(Constraint.json({"type": "array", "contains": {"type": "integer"}}))
    assert e.value.backend == "onnx"
