"""The typed protocol layer (issue 27 items 1 and 4): a malformed request is refused before
any model loads, in every dialect; the shapes' errors name the field; the one block
assembly; each path's error shape; the edges (404 names the endpoints, HEAD /health, the
access log's reasons, /openapi.json behind the key, /v1/models lists each id once)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from localrun.server.config import ServerConfig
from tests.conftest import requires_llama
from tests.serverutil import request, serve

pydantic = pytest.importorskip("pydantic")

from localrun.server.errors import APIError  # noqa: E402
from localrun.server.manager import ModelManager  # noqa: E402
from localrun.server.metrics import Metrics  # noqa: E402
from localrun.server.protocol import anthropic as an  # noqa: E402
from localrun.server.protocol import ollama as ol  # noqa: E402
from localrun.server.protocol import openai as oa  # noqa: E402
from localrun.server.protocol.blocks import Blocks, blocks_of  # noqa: E402
from localrun.server.protocol.common import from_validation  # noqa: E402
from localrun.structured.calls import ToolCall, ToolCallDelta  # noqa: E402
from localrun.types import Chunk, Completion, Timings, Usage  # noqa: E402

Q = [{"role": "user", "content": "Hi"}]
BAD_SCHEMA = {"type": "strin"}  # llguidance cannot compile it: the engine would refuse it


def _refusal(shape: type[Any], body: dict[str, Any]) -> APIError:
    with pytest.raises(pydantic.ValidationError) as e:
        shape.model_validate(body)
    return from_validation(e.value, body)


# -- refused before any model loads ------------------------------------------------------

def _bad_requests(model: str) -> list[tuple[str, dict[str, Any], str]]:
    fn = {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}
    anth = {"name": "f", "input_schema": BAD_SCHEMA}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}
    return [
        ("/v1/chat/completions", {"model": model, "messages": Q, "tools": [fn]}, "tools"),
        ("/v1/chat/completions", {"model": model, "messages": Q, "response_format": rf},
         "response_format"),
        ("/v1/chat/completions", {"model": model, "messages": Q, "tools": [fn],
                                  "tool_choice": {"type": "function",
                                                  "function": {"name": "g"}}}, "tool_choice"),
        ("/api/chat", {"model": model, "messages": Q, "tools": [fn]}, "tools"),
        ("/api/chat", {"model": model, "messages": Q, "format": BAD_SCHEMA}, "format"),
        ("/api/generate", {"model": model, "prompt": "Hi", "format": BAD_SCHEMA}, "format"),
        ("/v1/messages", {"model": model, "max_tokens": 4, "messages": Q, "tools": [anth]},
         "tools"),
        ("/v1/messages", {"model": model, "max_tokens": 4, "messages": Q, "output_config": {
            "format": {"type": "json_schema", "schema": BAD_SCHEMA}}}, "output_config.format"),
        ("/v1/messages/count_tokens", {"model": model, "messages": Q, "tools": [anth]},
         "tools"),
    ]


@pytest.mark.parametrize("name", ["path", "alias"])
def test_a_bad_tool_schema_is_refused_before_any_model_loads(name: str) -> None:
    """For a model not loaded yet (a local file the server may load, or a catalog alias):
    400 naming the field, and the manager's loaders never called, nothing loaded."""
    from tests.models import test_model

    model = str(test_model("gguf-q4_1")) if name == "path" else "qwen2.5:0.5b"
    calls: list[str] = []

    def loader(name: str, *args: Any) -> Any:
        calls.append(name)
        raise AssertionError("a malformed request loaded a model")

    config = ServerConfig(allow_local_paths=True)
    manager = ModelManager(config, Metrics(), loader=loader, embed_loader=loader)
    with serve(config, manager=manager) as s:
        for route, body, field in _bad_requests(model):
            status, _, raw = request("POST", s.url + route, body)
            assert status == 400, (route, field, raw[:300])
            text = raw.decode()
            assert field in text and "Traceback" not in text, (route, text)
            if route.startswith("/v1/chat"):
                assert json.loads(raw)["error"]["param"] == field
            if route.startswith("/v1/messages"):
                assert json.loads(raw)["type"] == "error"
    assert calls == [] and manager.models == {}


# -- shapes --------------------------------------------------------------------------------

def test_shapes_name_the_field_in_their_errors() -> None:
    e = _refusal(oa.ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": 3}]})
    assert e.param == "messages[0].content" and e.code == "invalid_type"
    assert "expected a valid string or a valid list, got 3" in e.message
    e = _refusal(oa.ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]})
    assert e.param == "messages[0].content[1]" and "takes text and image_url parts" in e.message
    e = _refusal(oa.ChatCompletionRequest, {"model": "m", "messages": Q, "stream": "yes"})
    assert e.param == "stream" and "valid boolean" in e.message  # no "yes" -> True
    e = _refusal(oa.ChatCompletionRequest, {"model": "m", "messages": Q,
                                            "logit_bias": {"1": 5}})
    assert e.param == "logit_bias" and e.code == "unsupported_parameter"
    e = _refusal(oa.ChatCompletionRequest, {"messages": Q})
    assert e.message == "Missing required parameter 'model'"
    e = _refusal(ol.ChatRequest, {"model": "m", "messages": Q,
                                  "options": {"temprature": 0.1}})
    assert e.param == "options.temprature" and "does not implement" in e.message
    e = _refusal(ol.ChatRequest, {"model": "m", "messages": Q, "options": {"mirostat": 2}})
    assert e.param == "options.mirostat" and "no mirostat sampling" in e.message
    e = _refusal(an.MessagesRequest, {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}],
        "max_tokens": 4})
    assert e.param == "messages[0].content[0].content[0]" and "images" in e.message
    # accepted: null for an unknown field, an integral float, fields with no effect
    ok = oa.ChatCompletionRequest.model_validate({
        "model": "m", "messages": Q, "max_tokens": 2.0, "whatever": None, "user": "u",
        "prompt_cache_key": "k"})
    assert ok.max_tokens == 2 and isinstance(ok.max_tokens, int)
    an.MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": Q,
                                       "metadata": {"user_id": "u"},
                                       "system": [{"type": "text", "text": "s",
                                                   "cache_control": {"type": "ephemeral"}}]})


def test_anthropic_turns_become_the_librarys_messages() -> None:
    req = an.MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "system": "S",
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                {"type": "text", "text": "And tomorrow?"}]}],
        "tools": [{"name": "w", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"}, "stop_sequences": ["END"], "top_k": 5})
    gen = req.generation()
    assert gen.messages == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"}]
    assert gen.structured["tool_choice"] == "required"
    assert gen.sampling == {"max_tokens": 4, "top_k": 5, "stop": ("END",)}


def test_blocks_number_text_and_calls_in_the_order_they_begin() -> None:
    b = Blocks()
    events = [*b.feed(Chunk("Let me check.")),
              *b.feed(Chunk("", tool_calls=(ToolCallDelta(0, "c1", "w"),))),
              *b.feed(Chunk("", tool_calls=(ToolCallDelta(0, arguments='{"a":'),))),
              *b.feed(Chunk("", tool_calls=(ToolCallDelta(0, arguments=" 1}"),))),
              *b.feed(Chunk("Done.")), *b.close()]
    assert [(e.kind, e.index, e.block) for e in events] == [
        ("start", 0, "text"), ("delta", 0, "text"), ("stop", 0, "text"),
        ("start", 1, "tool_call"), ("delta", 1, "tool_call"), ("delta", 1, "tool_call"),
        ("stop", 1, "tool_call"), ("start", 2, "text"), ("delta", 2, "text"),
        ("stop", 2, "text")]
    assert events[6].text == '{"a": 1}' and events[3].call_id == "c1"
    c = Completion("hi", "tool_calls", Usage(1, 2), Timings(),
                   (ToolCall("c1", "w", '{"a": 1}'),))
    whole = blocks_of(c)
    assert [b.kind for b in whole] == ["text", "tool_call"] and whole[1].input == {"a": 1}


def test_each_path_answers_in_its_dialects_shape() -> None:
    e = APIError(401, "no key")
    assert e.body_for("/v1/messages") == {"type": "error", "error": {
        "type": "authentication_error", "message": "no key"}}
    assert e.body_for("/v1/messages/count_tokens")["error"]["type"] == "authentication_error"
    assert e.body_for("/api/chat") == {"error": "no key"}
    assert e.body_for("/v1/chat/completions")["error"]["type"] == "authentication_error"
    kinds = {s: APIError(s, "x").anthropic_body()["error"]["type"]
             for s in (400, 403, 404, 413, 415, 429, 500, 503)}
    assert kinds == {400: "invalid_request_error", 403: "permission_error",
                     404: "not_found_error", 413: "request_too_large",
                     415: "invalid_request_error", 429: "rate_limit_error",
                     500: "api_error", 503: "overloaded_error"}


# -- the edges -------------------------------------------------------------------------------

def test_unknown_endpoints_head_health_and_the_access_log(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    with caplog.at_level(logging.INFO, logger="localrun.server.access"), \
            serve(ServerConfig()) as s:
        status, _, raw = request("POST", s.url + "/v1/nothing", {})
        message = json.loads(raw)["error"]["message"]
        assert status == 404 and "No such endpoint: POST /v1/nothing" in message
        for route in ("POST /v1/chat/completions", "POST /v1/messages", "POST /api/chat",
                      "GET /health", "GET /openapi.json"):
            assert route in message, message
        status, _, raw = request("POST", s.url + "/v1/messages/nothing", {})
        assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error"
        assert request("HEAD", s.url + "/health")[0] == 200
        assert request("HEAD", s.url + "/")[0] == 200
        status, _, _ = request("POST", s.url + "/v1/chat/completions",
                               {"model": "m", "messages": Q, "bad\nfield": 1})
        assert status == 400
    lines = [r.getMessage() for r in caplog.records if r.name == "localrun.server.access"]
    refused = [ln for ln in lines if '"POST /v1/chat/completions" 400' in ln]
    assert len(refused) == 1 and refused[0].isprintable(), lines
    assert "error=\"Unsupported parameter 'bad\\nfield'" in refused[0]
    assert any('/v1/nothing" 404' in ln and 'error="No such endpoint' in ln for ln in lines)


def test_openapi_is_served_behind_the_key_and_describes_every_route() -> None:
    from localrun.server.protocol.spec import OPERATIONS

    with serve(ServerConfig(api_key="k")) as s:
        assert request("GET", s.url + "/openapi.json")[0] == 401
        assert request("GET", s.url + "/health")[0] == 200
        status, _, raw = request("GET", s.url + "/openapi.json", headers={"x-api-key": "k"})
    assert status == 200
    doc = json.loads(raw)
    assert doc["openapi"].startswith("3.")
    for op in OPERATIONS:
        assert op.method.lower() in doc["paths"][op.path], op
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    assert {"model", "messages", "tools", "response_format"} <= set(schema["properties"])
    assert set(schema["required"]) == {"model", "messages"}
    messages = doc["paths"]["/v1/messages"]["post"]["responses"]["200"]["content"]
    assert set(messages) == {"application/json", "text/event-stream"}


@requires_llama
@pytest.mark.slow
def test_models_lists_a_model_loaded_at_two_contexts_once() -> None:
    from tests.models import test_model

    path = str(test_model("gguf-q4_1"))
    with serve(ServerConfig(allow_local_paths=True)) as s:
        for ctx in (512, 1024):
            status, _, raw = request("POST", s.url + "/api/generate", {
                "model": path, "prompt": "", "options": {"num_ctx": ctx}})
            assert status == 200, raw[:300]
        assert len(s.manager.models) == 2
        status, _, raw = request("GET", s.v1 + "/models")
    entries = [m for m in json.loads(raw)["data"] if m["id"] == path]
    assert len(entries) == 1, entries
    assert entries[0]["contexts"] == [512, 1024] and entries[0]["context_length"] == 1024
