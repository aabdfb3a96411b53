"""Structured output never runs away (issue 28 item 4): numbers bounded in the grammar
(int64 integers, decimals of at most 9 fraction digits, a schema's own bounds kept), no
free whitespace between tokens, and a string stuck in a loop stopped with an error
naming the field, on every engine, in the Python API and the server.

The grammar tests use llguidance's matcher on the SmolLM2 tokenizer (no engine); the
loop tests feed :class:`~localrun.structured.watch.JsonWatch` and the output layer a
made-up stream, then drive a real loop on llama.cpp; the issue's City example runs on
the four CPU engines.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import localrun
from localrun.errors import IncompleteOutputError
from localrun.structured.bounds import (
    ANY_DEF,
    ANY_REF,
    FRACTION_DIGITS,
    INT_MAX,
    INT_MIN,
    NUMBER_LIMIT,
    bounded_schema,
)
from localrun.structured.constraint import Constraint, ToolTag
from localrun.structured.output import OutputProcessor, prepare, prepare_chat
from localrun.structured.watch import (
    MAX_BLANKS,
    MAX_NUMBER_CHARS,
    JsonWatch,
    RunawayOutputError,
)
from tests.models import test_model
from tests.test_conformance import _skip_unless_installed

pydantic = pytest.importorskip("pydantic")


class City(pydantic.BaseModel):  # type: ignore[misc, name-defined]
    """The issue's example: greedy SmolLM2-135M wrote its population's 1s until
    max_tokens."""

    name: str
    country: str
    population: int


# -- the bounds, as schema ------------------------------------------------------------------


def test_numbers_get_int64_and_decimal_bounds() -> None:
    out = bounded_schema({"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "o": {"type": ["integer", "null"]},
        "s": {"type": "string"}}})
    props = out["properties"]
    assert props["n"] == {"type": "integer", "minimum": INT_MIN, "maximum": INT_MAX}
    assert props["x"] == {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT,
                          "multipleOf": 10.0 ** -FRACTION_DIGITS}
    assert props["o"]["maximum"] == INT_MAX and props["s"] == {"type": "string"}
    assert "$defs" not in out  # nothing free-form


def test_a_schemas_own_bounds_are_kept() -> None:
    both = {"type": "integer", "minimum": 1, "maximum": 99}
    assert bounded_schema(both) == both
    assert bounded_schema({"type": "integer", "minimum": 5}) == \
        {"type": "integer", "minimum": 5, "maximum": INT_MAX}
    assert bounded_schema({"type": "integer", "exclusiveMaximum": 0}) == \
        {"type": "integer", "exclusiveMaximum": 0, "minimum": INT_MIN}
    # a bound beyond the default: the missing side derives from it (one power past)
    assert bounded_schema({"type": "number", "minimum": 1e20})["maximum"] == 1e21
    assert bounded_schema({"type": "number", "maximum": -1e18})["minimum"] == -10**19
    # its own multipleOf fixes the digits already
    assert bounded_schema({"type": "number", "multipleOf": 0.25})["multipleOf"] == 0.25
    # OpenVINO's layout writes the fraction itself
    assert "multipleOf" not in bounded_schema({"type": "number"}, decimals=False)


def test_free_form_values_become_bounded_json() -> None:
    out = bounded_schema({"type": "object"})  # response_format json_object
    assert out["additionalProperties"] == ANY_REF and ANY_DEF in out["$defs"]
    out = bounded_schema({"type": "object", "properties": {
        "tags": {"type": "array"}, "extra": {"description": "anything"}},
        "$defs": {"Mine": {"type": "integer"}}})
    assert out["properties"]["tags"]["items"] == ANY_REF
    assert out["properties"]["extra"] == ANY_REF
    assert set(out["$defs"]) == {"Mine", ANY_DEF}  # the schema's own defs are kept
    assert out["$defs"]["Mine"]["maximum"] == INT_MAX


# -- the bounds, in the grammar (llguidance, the SmolLM2 tokenizer) --------------------------


@pytest.fixture(scope="module")
def compiler() -> Any:
    from localrun.structured.grammar import GrammarCompiler, tokenizer_from_json

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


def _city(population: str) -> str:
    return '{"name": "Paris", "country": "France", "population": ' + population + "}"


def test_the_city_population_stops_at_int64(compiler: Any) -> None:
    c = Constraint.json(prepare(schema=City).output.schema)  # type: ignore[union-attr]
    assert _allowed(compiler, c, _city("2102650"))
    assert _allowed(compiler, c, _city(str(INT_MAX)))
    assert _allowed(compiler, c, _city("-" + str(-INT_MIN)))
    assert not _allowed(compiler, c, _city(str(INT_MAX + 1)))
    assert not _allowed(compiler, c, _city("1" * 20))  # the issue's reply, cut at 20


def test_numbers_are_finite_decimals(compiler: Any) -> None:
    c = Constraint.json({"type": "number"})
    assert _allowed(compiler, c, "-3.25")
    assert _allowed(compiler, c, "0." + "1" * FRACTION_DIGITS)
    assert not _allowed(compiler, c, "0." + "1" * (FRACTION_DIGITS + 1))
    assert not _allowed(compiler, c, "1.5" + "0" * FRACTION_DIGITS)  # zeros count too
    assert _allowed(compiler, c, str(NUMBER_LIMIT))
    assert not _allowed(compiler, c, str(NUMBER_LIMIT * 10))
    assert not _allowed(compiler, c, "1e400")  # no exponent: no inf


def test_a_schemas_own_bounds_hold_in_the_grammar(compiler: Any) -> None:
    qty = Constraint.json({"type": "integer", "minimum": 1, "maximum": 99})
    assert _allowed(compiler, qty, "99") and _allowed(compiler, qty, "1")
    assert not _allowed(compiler, qty, "100") and not _allowed(compiler, qty, "0")
    temp = Constraint.json({"type": "number", "minimum": -50, "maximum": 60})
    assert _allowed(compiler, temp, "-50") and _allowed(compiler, temp, "59.5")
    assert not _allowed(compiler, temp, "60.5") and not _allowed(compiler, temp, "-51")
    big = Constraint.json({"type": "integer", "minimum": 5})  # one side given
    assert not _allowed(compiler, big, "4") and _allowed(compiler, big, str(INT_MAX))
    assert not _allowed(compiler, big, "9" * 20)
    half = Constraint.json({"type": "number", "multipleOf": 0.5})
    assert _allowed(compiler, half, "2.5") and not _allowed(compiler, half, "2.25")
    assert not _allowed(compiler, half, "1" * 17)


def test_free_form_json_has_bounded_numbers(compiler: Any) -> None:
    c = Constraint.json({"type": "object"})
    assert _allowed(compiler, c, '{"a": [1, {"b": null}], "c": "x", "d": -2.5, "e": true}')
    assert not _allowed(compiler, c, '{"a": ' + "1" * 20 + "}")
    assert not _allowed(compiler, c, '{"a": [0.' + "5" * 12 + "]}")


@pytest.mark.parametrize("blank", [" " * 100, "\n" * 100, "  ", "\n", "\t"])
def test_no_free_whitespace_between_tokens(compiler: Any, blank: str) -> None:
    """Compact JSON: the only blanks are the one space of ", " and ": " (llguidance's
    ``whitespace_flexible: False``), in a reply and in a tool call alike."""
    c = Constraint.json({"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "integer"}}, "b": {"type": "string"}}})
    assert _allowed(compiler, c, '{"a": [1, 2], "b": "x"}')
    for text in ('{"a":' + blank + '[1, 2], "b": "x"}', '{"a": [1,' + blank + '2], "b": "x"}',
                 '{' + blank + '"a": [1, 2], "b": "x"}', '{"a": [1, 2], "b": "x"' + blank + '}'):
        assert not _allowed(compiler, c, text)
    tool = Constraint.json({"type": "object", "properties": {"n": {"type": "integer"}}},
                           tag=ToolTag("<tool_call>", "\n", "\n</tool_call>"))
    assert _allowed(compiler, tool, 'ok<tool_call>\n{"n": 1}\n</tool_call>')
    assert not _allowed(compiler, tool, 'ok<tool_call>\n{"n":' + blank + '1}\n</tool_call>')


# -- loops: the watch and the output layer, on a made-up stream -----------------------------


def _pieces(text: str, size: int = 3) -> Iterator[str]:
    return (text[i:i + size] for i in range(0, len(text), size))


def _watch(text: str) -> Any:
    w = JsonWatch()
    for piece in _pieces(text):
        found = w.feed(piece)
        if found is not None:
            return found
    return None


def test_a_looping_string_is_caught_and_named() -> None:
    found = _watch('{"name": "' + "Paris " * 40)
    assert found is not None and found.path == "$.name"
    assert found.detail.startswith("the string repeats ") and "times in a row" in found.detail
    deep = _watch('{"items": [{"sku": "A"}, {"sku": "B"}, {"sku": "' + "a" * 200)
    assert deep is not None and deep.path == "$.items[2].sku"
    odd = _watch('{"a b": {"k": 1, "x\\"y": "' + "la Femme, " * 30)
    assert odd is not None and odd.path == '$["a b"]["x\\"y"]'
    top = _watch('"' + "ha" * 100)
    assert top is not None and top.path == "$"
    key = _watch('{"ok": 1, "' + "kk" * 100)
    assert key is not None and key.path == "$" and "key" in key.detail


def test_ordinary_values_are_not_loops() -> None:
    assert _watch(json.dumps({
        "rule": "-" * 60, "zeros": "0" * 100, "text": "The quick brown fox jumps. " * 4,
        "story": " ".join(f"Sentence {i} of a long description." for i in range(40)),
        "list": [{"x": 1}] * 50, "matrix": [[0, 0, 0]] * 30})) is None


def test_number_and_blank_runs_are_caught() -> None:
    """What llguidance's grammar refuses, and an OpenVINO XGrammar leaf (a free-form
    value) allows: the watch stops it on every engine."""
    num = _watch('{"a": [1, ' + "7" * (MAX_NUMBER_CHARS + 5))
    assert num is not None and num.path == "$.a[1]" and "number" in num.detail
    ws = _watch('{"a": 1,' + "\n" * (MAX_BLANKS + 5))
    assert ws is not None and "blanks" in ws.detail
    assert _watch('{\n' + "    " * 8 + '"a": ' + "9" * 40 + "}") is None  # indented, long


def test_the_output_layer_ends_a_loop_with_a_typed_error() -> None:
    req = prepare(schema={"type": "object", "properties": {"text": {"type": "string"}}})
    p = OutputProcessor(prepare_chat(req, [{"role": "user", "content": "x"}], None))
    for piece in _pieces('{"text": "' + "58,23" * 40):
        p.feed(piece)
        if p.runaway is not None:
            break
    assert p.runaway is not None and p.runaway.path == "$.text"
    r = p.result("stop")  # the driver ends it as at a stop string
    assert r.finish_reason == "length" and isinstance(r.error, RunawayOutputError)
    assert isinstance(r.error, IncompleteOutputError)  # the server answers it as "length"
    unit = "58,23"  # as the stream ends: some rotation of it
    assert "$.text" in str(r.error)
    assert any(f"repeats '{unit[i:] + unit[:i]}'" in str(r.error) for i in range(len(unit)))
    assert r.error.hint and "repetition_penalty" in r.error.hint


def test_a_looping_tool_argument_is_caught() -> None:
    req = prepare(tools=[{"type": "function", "function": {
        "name": "say", "parameters": {"type": "object",
                                      "properties": {"text": {"type": "string"}}}}}],
                  tool_choice="required")
    template = '{% for m in messages %}{{ m.content }}{% endfor %}'
    p = OutputProcessor(prepare_chat(req, [{"role": "user", "content": "x"}], template))
    for piece in _pieces('{"name": "say", "arguments": {"text": "' + "na " * 80):
        p.feed(piece)
        if p.runaway is not None:
            break
    assert p.runaway is not None and p.runaway.path == "tool_calls[0].arguments.text"


# -- real engines ---------------------------------------------------------------------------

ENGINES = (("llama.cpp", "gguf-q4_1"), ("mlx", "mlx-4bit"), ("openvino", "openvino-int4"),
           ("onnx", "onnx-int4"))


@pytest.fixture(scope="module", params=ENGINES, ids=[b for b, _ in ENGINES])
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    backend, fixture = request.param
    _skip_unless_installed(backend)
    with localrun.load(str(test_model(fixture)), backend=backend, context=2048) as model:
        yield backend, model


@pytest.mark.slow
def test_the_city_example_completes_on_every_engine(engine: tuple[str, Any]) -> None:
    """Before: '"population": 1111...' until max_tokens (120 or 400 alike)."""
    _, model = engine
    c = model.chat("Describe Paris.", schema=City, temperature=0, max_tokens=120)
    assert c.finish_reason == "stop" and c.usage.completion_tokens <= 60, c.text
    assert isinstance(c.parsed, City) and City.model_validate_json(c.text) == c.parsed
    assert -(2**63) <= c.parsed.population < 2**63


LOOP_PROMPT = "List every city in France."
LOOP_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}},
               "required": ["text"]}


@pytest.fixture(scope="module")
def llama() -> Iterator[Any]:
    _skip_unless_installed("llama.cpp")
    with localrun.load(str(test_model("gguf-q4_1")), backend="llama.cpp",
                       context=2048) as model:
        yield model


@pytest.mark.slow
def test_a_real_loop_stops_early_with_the_field_named(llama: Any) -> None:
    """Greedy SmolLM2 answers this with "58,23" over and over inside the string."""
    with pytest.raises(RunawayOutputError, match=r"\$\.text") as e:
        llama.chat(LOOP_PROMPT, schema=LOOP_SCHEMA, temperature=0, max_tokens=400)
    done = e.value.completion
    assert done.finish_reason == "length" and done.usage.completion_tokens < 250
    assert done.text.startswith('{"text": "')
    # streamed: the same text, ended as "length", and join() raises the same error
    stream = llama.stream(LOOP_PROMPT, schema=LOOP_SCHEMA, temperature=0, max_tokens=400)
    chunks = list(stream)
    assert "".join(c.text for c in chunks) == done.text
    assert chunks[-1].finish_reason == "length"
    with pytest.raises(RunawayOutputError):
        stream.join()


@pytest.mark.slow
def test_the_server_answers_both_as_openai_and_ollama_would(llama: Any) -> None:
    """Chat Completions through the openai client: parse() gets its City; the loop is a
    "length" finish (the client's LengthFinishReasonError), long before max_tokens; on
    Ollama's /api/chat too."""
    openai = pytest.importorskip("openai", reason="the openai client is in the dev extra")
    from localrun.server.config import ServerConfig
    from tests.serverutil import MODEL, request, serve

    with serve(ServerConfig(), preload={MODEL: llama}) as srv:
        client = openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.parse(
            model=MODEL, temperature=0, max_tokens=120, response_format=City,
            messages=[{"role": "user", "content": "Describe Paris."}])
        assert isinstance(r.choices[0].message.parsed, City)
        assert r.usage.completion_tokens <= 60
        loop = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=400,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "t", "schema": LOOP_SCHEMA}},
            messages=[{"role": "user", "content": LOOP_PROMPT}])
        assert loop.choices[0].finish_reason == "length"
        assert loop.usage.completion_tokens < 250
        # Ollama's /api/chat: the same end, in its own words
        status, _, body = request("POST", srv.url + "/api/chat", {
            "model": MODEL, "stream": False, "format": LOOP_SCHEMA,
            "options": {"temperature": 0, "num_predict": 400},
            "messages": [{"role": "user", "content": LOOP_PROMPT}]})
        reply = json.loads(body)
        assert status == 200 and reply["done_reason"] == "length", reply
        assert reply["eval_count"] < 250
