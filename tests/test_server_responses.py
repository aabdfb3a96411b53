"""localrun serve's Responses API (issue 27 item 2) through the official ``openai`` client,
unchanged but for base_url: ``responses.create`` / ``stream`` / ``parse``, function and
custom tool calls, stored responses (``previous_response_id`` across a restart,
GET/DELETE/input_items, one API key's responses hidden from another), what Codex and the
Agents SDK send by default, and malformed requests (OpenAI's error shape, a 4xx naming the
field, nothing stored, nothing loaded).

One real llama.cpp model (the embedded SmolLM2-135M GGUF) shared by a module-scoped
server on 127.0.0.1; replies are compared with the same model called in process. Stored
responses go to a temporary LOCALRUN_HOME.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import requires_llama
from tests.serverutil import MODEL, Running, request, serve, server_fixtures

openai = pytest.importorskip("openai", reason="the openai client is not installed "
                             "(pip install -e '.[clients]')")
pydantic = pytest.importorskip("pydantic")

from localrun.server.config import ServerConfig  # noqa: E402

pytestmark = [requires_llama, pytest.mark.slow]
ASK = "What is the capital of France?"
Q = [{"role": "user", "content": ASK}]
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}

server_model, srv = server_fixtures(ServerConfig())


@pytest.fixture(scope="module", autouse=True)
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Stored responses in a folder of this module's own (the store opens lazily)."""
    path = tmp_path_factory.mktemp("localrun-home")
    old = os.environ.get("LOCALRUN_HOME")
    os.environ["LOCALRUN_HOME"] = str(path)
    yield path
    if old is None:
        os.environ.pop("LOCALRUN_HOME", None)
    else:
        os.environ["LOCALRUN_HOME"] = old


def _client(url: str, key: str = "unused") -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(srv: Running) -> Any:
    return _client(srv.url)


def _stored(home: Path) -> int:
    path = home / "responses.sqlite3"
    if not path.exists():
        return 0
    with sqlite3.connect(path) as con:
        return int(con.execute("SELECT COUNT(*) FROM responses").fetchone()[0])


def test_create_with_a_string_equals_the_python_api(client: Any, server_model: Any) -> None:
    r = client.responses.create(model=MODEL, input=ASK, temperature=0, max_output_tokens=12)
    want = server_model.chat(Q, temperature=0, max_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert [i.type for i in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output_text == want.text and r.output[0].content[0].type == "output_text"
    cut = want.finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == (
        "max_output_tokens" if cut else None)
    assert r.usage.input_tokens == want.usage.prompt_tokens
    assert r.usage.output_tokens == want.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.store is True and r.max_output_tokens == 12 and r.temperature == 0


def test_items_and_instructions_are_the_same_prompt(client: Any, server_model: Any) -> None:
    system = "You answer in one word."
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    r = client.responses.create(model=MODEL, input=items, instructions=system, temperature=0,
                                max_output_tokens=8)
    want = server_model.chat([{"role": "system", "content": system}, *Q], temperature=0,
                             max_tokens=8)
    assert r.output_text == want.text and r.instructions == system
    assert r.usage.input_tokens == want.usage.prompt_tokens
    # a developer message is a system turn too; "type": "message" may be given or not
    dev = client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, input=[
        {"type": "message", "role": "developer", "content": system}, *Q])
    assert dev.output_text == want.text


def test_stream_events_in_order_assemble_to_the_reply(client: Any) -> None:
    args: dict[str, Any] = {"model": MODEL, "input": ASK, "temperature": 0,
                            "max_output_tokens": 12}
    whole = client.responses.create(**args)
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response() if whole.status == "completed" else None
    kinds = [e.type for e in events]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", last]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output_text == whole.output_text and done.usage == whole.usage
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {done.output[0].id}
    if final is not None:
        assert final.output_text == whole.output_text and final.id == done.id


def test_parse_with_a_pydantic_model(client: Any) -> None:
    class City(pydantic.BaseModel):
        name: str
        country: str

    r = client.responses.parse(model=MODEL, input="The capital of France, as JSON.",
                               text_format=City, temperature=0, max_output_tokens=60)
    assert isinstance(r.output_parsed, City), r.output_text
    assert r.text.format.type == "json_schema" and r.text.format.name == "City"
    # json_object: the reply is a JSON object
    r = client.responses.create(model=MODEL, input="Describe Paris as JSON.", temperature=0,
                                max_output_tokens=60, text={"format": {"type": "json_object"}})
    assert r.status == "incomplete" or isinstance(json.loads(r.output_text), dict)


def test_a_function_call_round_trip(client: Any, server_model: Any) -> None:
    ask = "What is the weather in Paris?"
    r = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, temperature=0, max_output_tokens=60)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"} and call.status == "completed"
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required"
    # the result goes back on the stored conversation; the answer follows
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
        temperature=0, max_output_tokens=20,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "18 C and sunny"}])
    assert [i.type for i in follow.output] == ["message"] and follow.output_text
    assert follow.previous_response_id == r.id
    # the same conversation, sent whole (stateless, as the Agents SDK sends it)
    again = client.responses.create(
        model=MODEL, tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=20,
        store=False, input=[{"role": "user", "content": ask}, call.model_dump(),
                            {"type": "function_call_output", "call_id": call.call_id,
                             "output": "18 C and sunny"}])
    assert again.output_text == follow.output_text
    assert again.usage.input_tokens == follow.usage.input_tokens
    want = server_model.chat([
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C and sunny"}],
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in (
            "name", "description", "parameters", "strict")}}], tool_choice="none",
        temperature=0, max_tokens=20)
    assert follow.output_text == want.text
    assert follow.usage.input_tokens == want.usage.prompt_tokens


def test_streamed_function_call_arguments(client: Any) -> None:
    with client.responses.stream(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 temperature=0, max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    deltas = "".join(e.delta for e in events if e.type ==
                     "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    call = final.output[0]
    assert call.type == "function_call" and deltas == done.arguments == call.arguments
    assert set(json.loads(call.arguments)) == {"city"}
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]


def test_a_custom_tool_is_a_function_of_one_string(client: Any) -> None:
    """Codex's freeform tools: {"type": "custom", "format": {grammar}}. The call comes
    back as a custom_tool_call whose input is the string; a regex grammar is enforced."""
    patch = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
             "format": {"type": "grammar", "syntax": "lark",
                        "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}}
    code = {"type": "custom", "name": "set_code", "description": "Set a 4-digit code.",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{4}"}}
    r = client.responses.create(model=MODEL, input="Set the code.", tools=[patch, code],
                                tool_choice={"type": "custom", "name": "set_code"},
                                temperature=0, max_output_tokens=40)
    call = r.output[0]
    assert call.type == "custom_tool_call" and call.name == "set_code"
    assert len(call.input) == 4 and call.input.isdigit(), call.input
    assert r.tools[0].type == "custom" and r.tools[0].format.syntax == "lark"
    with client.responses.stream(model=MODEL, input="Set the code.", tools=[patch, code],
                                 tool_choice={"type": "custom", "name": "set_code"},
                                 temperature=0, max_output_tokens=40) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" not in kinds
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    assert done.input == call.input == "".join(
        e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    # sent back (stateless) with its output, the conversation goes on
    follow = client.responses.create(model=MODEL, tools=[patch, code], store=False,
                                     temperature=0, max_output_tokens=8, input=[
        {"role": "user", "content": "Set the code."}, call.model_dump(),
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "done"}])
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > \
        r.usage.input_tokens


def test_max_output_tokens_makes_it_incomplete(client: Any) -> None:
    r = client.responses.create(model=MODEL, input="Count from 1 to 50.", temperature=0,
                                max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3
    events = list(client.responses.create(model=MODEL, input="Count from 1 to 50.",
                                          temperature=0, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].content[0].text == r.output_text


def test_stored_responses_get_delete_input_items(client: Any, home: Path) -> None:
    r = client.responses.create(model=MODEL, temperature=0, max_output_tokens=4, input=[
        {"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
        {"role": "user", "content": [{"type": "input_text", "text": "Three"}]}])
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    page = client.responses.input_items.list(r.id)
    texts = [i.content[0].text for i in page.data]
    assert texts == ["Three", "Two", "One"]  # newest first, as OpenAI lists them
    assert all(i.id and i.type == "message" for i in page.data)
    assert page.data[1].content[0].type == "output_text"
    asc = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in asc.data] == ["One", "Two"] and asc.has_more
    after = client.responses.input_items.list(r.id, order="asc", after=asc.data[-1].id)
    assert [i.content[0].text for i in after.data] == ["Three"] and not after.has_more
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_items.list(r.id, limit=1000)
    assert e.value.body["param"] == "limit"
    before = _stored(home)
    deleted = client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    assert _stored(home) == before - 1
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["message"] == f"Response with id '{r.id}' not found."
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=r.id, input="Four")
    assert e.value.body["param"] == "previous_response_id"
    # store: false keeps nothing
    n = _stored(home)
    r = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    assert r.store is False and _stored(home) == n
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_another_api_key_cannot_see_a_response(srv: Running) -> None:
    alice, bob = _client(srv.url, "alice-key"), _client(srv.url, "bob-key")
    r = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    for call in (lambda: bob.responses.retrieve(r.id), lambda: bob.responses.delete(r.id),
                 lambda: bob.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as e:
        bob.responses.create(model=MODEL, previous_response_id=r.id, input="Go on")
    assert e.value.body["code"] == "previous_response_not_found"
    assert alice.responses.retrieve(r.id).id == r.id  # bob's delete deleted nothing
    # the key alone decides: x-api-key is the same owner as Bearer
    status, _, raw = request("GET", f"{srv.v1}/responses/{r.id}",
                             headers={"x-api-key": "alice-key"})
    assert status == 200 and json.loads(raw)["id"] == r.id


def test_previous_response_id_across_a_restart(server_model: Any, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path))
    config = ServerConfig(api_key="sekret")
    with serve(config, preload={MODEL: server_model}) as s:
        first = _client(s.url, "sekret").responses.create(
            model=MODEL, input=ASK, instructions="Answer briefly.", temperature=0,
            max_output_tokens=10)
    assert (tmp_path / "responses.sqlite3").exists()
    with serve(config, preload={MODEL: server_model}) as s:  # a new server, the same home
        client = _client(s.url, "sekret")
        assert client.responses.retrieve(first.id).output_text == first.output_text
        r = client.responses.create(model=MODEL, previous_response_id=first.id, temperature=0,
                                    input="And of Italy?", max_output_tokens=10)
    # the stored conversation, without the earlier instructions (OpenAI's rule)
    want = server_model.chat([*Q, {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "And of Italy?"}],
                             temperature=0, max_tokens=10)
    assert r.output_text == want.text and r.previous_response_id == first.id
    assert r.usage.input_tokens == want.usage.prompt_tokens
    # a server started with another key sees none of them
    with serve(ServerConfig(api_key="other"), preload={MODEL: server_model}) as s, \
            pytest.raises(openai.NotFoundError):
        _client(s.url, "other").responses.retrieve(first.id)


def test_what_codex_and_the_agents_sdk_send_is_accepted(srv: Running) -> None:
    """Codex's request (instructions, developer and user items, a function and a custom
    tool, tool_choice auto, reasoning, include, prompt_cache_key, store false, stream) and
    the Agents SDK's fields: accepted, the stream completes."""
    body = {
        "model": MODEL, "instructions": "You are a coding agent.", "stream": True,
        "input": [{"type": "message", "role": "developer",
                   "content": [{"type": "input_text", "text": "<permissions>none</permissions>"}]},
                  {"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "Say hi."}]},
                  {"type": "reasoning", "id": "rs_1", "summary": [],
                   "encrypted_content": "opaque"}],
        "tools": [{"type": "function", "name": "shell", "description": "Run a command.",
                   "strict": False, "parameters": {"type": "object", "properties": {
                       "command": {"type": "array", "items": {"type": "string"}}},
                       "required": ["command"]}},
                  {"type": "custom", "name": "apply_patch", "description": "Edit files.",
                   "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1",
        "text": {"verbosity": "medium"}, "client_metadata": {"x": "y"},
        "truncation": "disabled", "user": "u", "metadata": {"k": "v"},
        "service_tier": "auto", "temperature": 0, "max_output_tokens": 8,
        "stream_options": {"include_obfuscation": False}, "safety_identifier": "s"}
    status, _, raw = request("POST", srv.v1 + "/responses", body)
    assert status == 200, raw[:500]
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ")]
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    assert events[-1]["response"]["metadata"] == {"k": "v"}


def test_bad_requests_are_4xx_naming_the_field_and_store_nothing(client: Any,
                                                                 home: Path) -> None:
    before = _stored(home)
    image = {"type": "input_image", "image_url": "data:image/png;base64,aGk="}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"input": [{"role": "user", "content": [image]}]}, "message 0, image 1",
         "not a PNG, JPEG, WebP or GIF image"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]",
         "item references"),
        ({"input": [{"type": "file_search_call", "id": "x"}]}, "input[0]", "function_call"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"temperature": "hot"}, "temperature", "valid number"),
        ({"temperature": -1}, "temperature", "temperature"),
        ({"extra_body": {"mirostat": 2}}, "mirostat", "does not implement"),
        ({"tools": [{**WEATHER, "parameters": {"type": "strin"}}]}, "tools", "get_weather"),
        ({"text": {"format": {"type": "json_schema", "name": "x",
                              "schema": {"type": "strin"}}}}, "text.format", "schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
         "needs 'schema'"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
         "tool_choice", "nope"),
        ({"tool_choice": "required"}, "tool_choice", "without tools"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []},
          "tools": [WEATHER]}, "tool_choice", "allowed_tools"),
        ({"extra_body": {"background": True}}, "background", "not supported"),
        ({"extra_body": {"conversation": "conv_1"}}, "conversation", "previous_response_id"),
        ({"include": ["message.output_text.logprobs"]}, "include", "log probabilities"),
        ({"service_tier": "priority"}, "service_tier", "one tier"),
        ({"input": None}, "input", "Missing required parameter"),
        ({"previous_response_id": "resp_nothing"}, "previous_response_id", "not found"),
    ]
    for extra, field, words in cases:
        args: dict[str, Any] = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**args)
        body = e.value.body
        assert body["type"] == "invalid_request_error", body
        assert field in body["message"] or field == body["param"], (field, body)
        assert words in body["message"], (words, body)
    for kind in ("web_search", "web_search_preview", "file_search", "computer_use_preview",
                 "code_interpreter", "image_generation", "mcp", "local_shell"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="Hi", tools=[{"type": kind}])
        body = e.value.body
        assert body["param"] == "tools[0]" and body["code"] == "unsupported_parameter", body
        assert kind in body["message"] and "function tools" in body["message"], body
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="no-such-model-here", input="Hi")
    assert _stored(home) == before  # nothing refused was stored
    status, _, raw = request("GET", client.base_url.__str__() + "responses/x?stream=true")
    assert status == 400 and json.loads(raw)["error"]["param"] == "stream"


def test_a_bad_request_loads_nothing() -> None:
    """A model not loaded yet: a malformed Responses request is a 400 and no loader runs."""
    calls: list[str] = []

    def loader(name: str, *args: Any) -> Any:
        calls.append(name)
        raise AssertionError("a malformed request loaded a model")

    from localrun.server.manager import ModelManager
    from localrun.server.metrics import Metrics

    config = ServerConfig()
    manager = ModelManager(config, Metrics(), loader=loader, embed_loader=loader)
    bad = [{"tools": [{**WEATHER, "parameters": {"type": "strin"}}]},
           {"tools": [{"type": "web_search"}]},
           {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
           {"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
           {"previous_response_id": "resp_missing"}]
    with serve(config, manager=manager) as s:
        for extra in bad:
            status, _, raw = request("POST", s.v1 + "/responses",
                                     {"model": "qwen2.5:0.5b", "input": "Hi", **extra})
            assert status == 400, (extra, raw[:300])
            assert json.loads(raw)["error"]["type"] == "invalid_request_error"
    assert calls == [] and manager.models == {}


def test_an_unusable_store_is_a_503_before_any_load(server_model: Any, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LOCALRUN_HOME", str(blocker / "home"))
    with serve(ServerConfig(), preload={MODEL: server_model}) as s:
        client = _client(s.url)
        with pytest.raises(openai.InternalServerError) as e:
            client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "store_unavailable"
        assert "store: false" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError):  # a malformed one is a 400 all the same
            client.responses.create(model=MODEL, input="Hi", tools=[
                {**WEATHER, "parameters": {"type": "strin"}}])
        r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
        assert r.status in ("completed", "incomplete")


def test_a_failure_mid_stream_is_an_error_event_then_failed(server_model: Any) -> None:
    long_reply = {"type": "json_schema", "name": "numbers", "schema": {
        "type": "array", "items": {"type": "integer"}, "minItems": 500}}
    with serve(ServerConfig(request_timeout=1.0), preload={MODEL: server_model}) as s:
        status, _, raw = request("POST", s.v1 + "/responses", {
            "model": MODEL, "input": "Numbers.", "stream": True, "store": False,
            "max_output_tokens": 4000, "text": {"format": long_reply}})
        if status == 200:  # it began: its last events are error, then response.failed
            events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                      if line.startswith("data: ")]
            error, failed = events[-2], events[-1]
            assert error["type"] == "error" and "timed out after 1 s" in error["message"]
            assert error["error"]["message"] == error["message"] and error["code"] == "timeout"
            assert failed["type"] == "response.failed"
            assert failed["response"]["status"] == "failed"
            assert failed["response"]["error"]["code"] == "timeout"
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            with pytest.raises(openai.APIError) as e:  # the client raises it
                for _ in _client(s.url).responses.create(
                        model=MODEL, input="Numbers.", stream=True, store=False,
                        max_output_tokens=4000, text={"format": long_reply}):
                    pass
            assert "timed out" in str(e.value)
        else:
            assert status == 504, raw[:300]
        r = _client(s.url).responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        assert r.usage.output_tokens > 0


def test_reasoning_effort_bounds_a_thinking_models_thinking() -> None:
    """A thinking model (SmolLM2 with Qwen3's template opening the thinking, as
    tests/test_reasoning.py builds it): ``reasoning.effort`` "none" is no thinking at all;
    unset, it thinks (counted in reasoning_tokens, not returned). A model that does not
    think ignores the effort (test_what_codex_and_the_agents_sdk_send_is_accepted)."""
    import localrun
    from tests.models import test_model

    template = Path(__file__).parent / "chat_templates" / "qwen3-think-prefilled.jinja"
    with localrun.load(str(test_model("gguf-q4_1")), backend="llama.cpp", context=2048,
                       threads=1, chat_template=template) as model, \
            serve(ServerConfig(), preload={"thinker": model}) as s:
        client = _client(s.url)
        args: dict[str, Any] = {"model": "thinker", "input": "List the planets.",
                                "temperature": 0, "max_output_tokens": 12, "store": False}
        thinks = client.responses.create(**args)
        details = thinks.usage.output_tokens_details
        assert details.reasoning_tokens > 0 and "<think>" not in thinks.output_text
        plain = client.responses.create(**args, reasoning={"effort": "none"})
        assert plain.usage.output_tokens_details.reasoning_tokens == 0 and plain.output_text
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**args, reasoning={"effort": "extreme"})
        assert e.value.body["param"] == "reasoning.effort"


def test_parallel_tool_calls_reaches_the_library(client: Any) -> None:
    """true: a required call may be several; false: one at most, enforced by the grammar;
    left out, the library's default (a required call is one). Streamed, each call is its
    own output item."""
    ask = "Weather in Paris, Rome, Oslo and Berlin?"
    args: dict[str, Any] = {"model": MODEL, "input": ask, "tools": [WEATHER],
                            "tool_choice": "required", "temperature": 0,
                            "max_output_tokens": 120, "store": False,
                            "parallel_tool_calls": True}
    several = client.responses.create(**args)
    cities = [json.loads(i.arguments)["city"] for i in several.output]
    assert len(cities) > 1 and several.parallel_tool_calls is True, several.output
    one = client.responses.create(**{**args, "parallel_tool_calls": False})
    assert [i.type for i in one.output] == ["function_call"] and not one.parallel_tool_calls
    unset = client.responses.create(**{**args, "parallel_tool_calls": None})
    assert [i.type for i in unset.output] == ["function_call"] and unset.parallel_tool_calls
    # (the blank text between the calls is no item, as in the whole answer)
    events = list(client.responses.create(**args, stream=True))
    final = events[-1].response
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.output_index for e in added] == list(range(len(cities)))
    assert [json.loads(i.arguments)["city"] for i in final.output] == cities
    assert final.status == several.status
    assert len({i.call_id for i in final.output}) == len(cities)
