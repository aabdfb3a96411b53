"""localrun serve through the official ``anthropic`` client, unchanged but for base_url.

One real llama.cpp model (the embedded SmolLM2-135M GGUF) shared by a module-scoped
server on 127.0.0.1; replies are compared with the same model called in process. The
client's ``messages.create`` has no sampling arguments in this SDK version: greedy
decoding goes in ``extra_body``, as a client sends any field its SDK does not list.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import requires_llama
from tests.serverutil import MODEL, Running, request, serve, server_fixtures

anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed "
                                "(pip install -e '.[clients]')")

from localrun.server.config import ServerConfig  # noqa: E402

pytestmark = [requires_llama, pytest.mark.slow]
Q = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}

server_model, srv = server_fixtures(ServerConfig())


@pytest.fixture(scope="module")
def client(srv: Running) -> Any:
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)


def test_create_equals_the_python_api(client: Any, server_model: Any) -> None:
    r = client.messages.create(model=MODEL, max_tokens=12, messages=Q, extra_body=GREEDY)
    want = server_model.chat(Q, temperature=0, max_tokens=12)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want.text
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.finish_reason]
    assert r.usage.input_tokens == want.usage.prompt_tokens
    assert r.usage.output_tokens == want.usage.completion_tokens


def test_system_as_a_string_or_blocks_is_the_same_prompt(client: Any, server_model: Any
                                                         ) -> None:
    system = "You answer in one word."
    as_text = client.messages.create(model=MODEL, max_tokens=8, messages=Q, system=system,
                                     extra_body=GREEDY)
    as_blocks = client.messages.create(model=MODEL, max_tokens=8, messages=Q, extra_body=GREEDY,
                                       system=[{"type": "text", "text": system,
                                                "cache_control": {"type": "ephemeral"}}])
    want = server_model.chat([{"role": "system", "content": system}, *Q], temperature=0,
                             max_tokens=8)
    assert as_text.content[0].text == as_blocks.content[0].text == want.text
    assert as_text.usage.input_tokens == want.usage.prompt_tokens


def test_stream_assembles_to_the_reply(client: Any) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=Q, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=12, messages=Q,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the raw events, in Anthropic's order
    events = list(client.messages.create(model=MODEL, max_tokens=12, messages=Q, stream=True,
                                         extra_body=GREEDY))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens  # known at once
    assert events[0].message.content == [] and events[0].message.stop_reason is None


def test_stop_sequences_end_the_reply_and_say_which(client: Any, server_model: Any) -> None:
    free = server_model.chat(Q, temperature=0, max_tokens=16).text
    word = free.split()[2]  # a word the greedy reply reaches
    r = client.messages.create(model=MODEL, max_tokens=16, messages=Q, extra_body=GREEDY,
                               stop_sequences=[word, "never-said"])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert r.content[0].text == free[:free.index(word)]
    with client.messages.stream(model=MODEL, max_tokens=16, messages=Q, extra_body=GREEDY,
                                stop_sequences=[word]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word


def test_tool_use_then_tool_result_round_trip(client: Any) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.messages.create(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER],
                               tool_choice={"type": "any"}, extra_body=GREEDY)
    assert r.stop_reason == "tool_use"
    calls = [b for b in r.content if b.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and calls[0].id
    assert isinstance(calls[0].input, dict) and set(calls[0].input) == {"city"}
    # the call goes back as the assistant turn, its result as a tool_result block
    follow = client.messages.create(
        model=MODEL, max_tokens=20, tools=[WEATHER], extra_body=GREEDY, messages=[
            *ask, {"role": "assistant", "content": [b.model_dump() for b in r.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                          "content": "18 C and sunny"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_streamed_tool_use_sends_input_json_deltas(client: Any) -> None:
    with client.messages.stream(
            model=MODEL, max_tokens=60, tools=[WEATHER], extra_body=GREEDY,
            tool_choice={"type": "tool", "name": "get_weather"},
            messages=[{"role": "user", "content": "Weather in Oslo?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert deltas and all(e.delta.type == "input_json_delta" for e in deltas)
    call = next(b for b in final.content if b.type == "tool_use")
    assert call.name == "get_weather" and set(call.input) == {"city"}
    assert json.loads("".join(e.delta.partial_json for e in deltas)) == call.input
    assert final.stop_reason == "tool_use"


def test_a_final_assistant_message_is_a_prefill_the_reply_continues(client: Any,
                                                                    server_model: Any
                                                                    ) -> None:
    """Anthropic's prefill: the reply continues the final assistant message (the text
    after it, not a new turn), as the Python API does; count_tokens counts the prefill;
    the stream carries the same text; a prefill with tools is a 400 that says why."""
    msgs = [*Q, {"role": "assistant", "content": [{"type": "text",
                                                   "text": "The capital of France is"}]}]
    lib = [*Q, {"role": "assistant", "content": "The capital of France is"}]
    r = client.messages.create(model=MODEL, max_tokens=6, messages=msgs, extra_body=GREEDY)
    want = server_model.chat(lib, temperature=0, max_tokens=6)
    assert r.content[0].text == want.text and "Paris" in want.text.split(".")[0]
    assert not want.text.startswith("The capital")
    assert r.usage.input_tokens == want.usage.prompt_tokens \
        == server_model.count_prompt_tokens(lib) > server_model.count_prompt_tokens(Q)
    assert client.messages.count_tokens(model=MODEL, messages=msgs).input_tokens \
        == want.usage.prompt_tokens
    with client.messages.stream(model=MODEL, max_tokens=6, messages=msgs,
                                extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == want.text
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=6, messages=msgs, tools=[WEATHER],
                               extra_body=GREEDY)
    assert "prefill" in str(e.value) and "user message" in str(e.value)


def test_count_tokens_is_the_prompt_a_reply_reads(client: Any) -> None:
    n = client.messages.count_tokens(model=MODEL, messages=Q)
    r = client.messages.create(model=MODEL, max_tokens=2, messages=Q, extra_body=GREEDY)
    assert n.input_tokens == r.usage.input_tokens > 0
    with_tools = client.messages.count_tokens(model=MODEL, messages=Q, tools=[WEATHER])
    r = client.messages.create(model=MODEL, max_tokens=2, messages=Q, tools=[WEATHER],
                               extra_body=GREEDY)
    assert with_tools.input_tokens == r.usage.input_tokens > n.input_tokens


def test_bad_requests_are_400s_naming_the_field(client: Any) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "aGk="}}
    cases = [
        ({"messages": [{"role": "user", "content": [image]}]},
         "message 0, image 1", "not a PNG, JPEG, WebP or GIF image"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"extra_body": {"mirostat": 2}}, "mirostat", "does not implement"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]",
         "server tools"),
        ({"tools": [{**WEATHER, "input_schema": {"type": "strin"}}]}, "tools", "get_weather"),
        ({"extra_body": {"thinking": {"type": "enabled", "budget_tokens": -1}}},
         "thinking.budget_tokens", "greater than or equal to 0"),
    ]
    for extra, field, words in cases:
        args: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": Q, **extra}
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**args)
        body = e.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert field in body["error"]["message"] and words in body["error"]["message"], body
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model-here", max_tokens=4, messages=Q)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_errors_the_middleware_answers_are_in_anthropics_shape(srv: Running) -> None:
    url = srv.url + "/v1/messages"
    status, _, raw = request("POST", url, b"hello", headers={"Content-Type": "text/plain",
                                                             "Origin": "http://evil.test"})
    assert status == 403 and json.loads(raw)["error"]["type"] == "permission_error"
    status, _, raw = request("POST", url, b"x=1", headers={
        "Content-Type": "application/x-www-form-urlencoded", "User-Agent": "Mozilla/5.0"})
    body = json.loads(raw)
    assert status == 415 and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error"
    status, _, raw = request("POST", url, b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(raw)["error"]["message"]


def test_the_api_key_as_x_api_key_or_bearer(server_model: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    key = "sekret-key"
    with serve(ServerConfig(api_key=key), preload={MODEL: server_model}) as s:
        def make(**kw: Any) -> Any:
            return anthropic.Anthropic(base_url=s.url, max_retries=0, timeout=60, **kw)

        args = {"model": MODEL, "max_tokens": 2, "messages": Q}
        # Anthropic's own header, as Claude Code and older SDKs send it
        ok = make(api_key=None, default_headers={"x-api-key": key}).messages.create(**args)
        assert ok.usage.output_tokens > 0
        assert make(api_key=key).messages.create(**args).usage.output_tokens > 0  # Bearer
        with pytest.raises(anthropic.AuthenticationError) as e:
            make(api_key="wrong").messages.create(**args)
        assert e.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError) as e:
            make(api_key=None, default_headers={"Authorization": anthropic.Omit()}
                 ).messages.count_tokens(model=MODEL, messages=Q)
        assert "Missing API key" in e.value.body["error"]["message"]
        assert "x-api-key" in e.value.body["error"]["message"]


def test_a_failure_mid_stream_is_an_error_event(server_model: Any) -> None:
    """The request timeout after the stream began: its last event is Anthropic's
    ``error`` (the client raises it), and the server goes on serving."""
    long_reply = {"type": "json_schema", "schema": {
        "type": "array", "items": {"type": "integer"}, "minItems": 500}}
    with serve(ServerConfig(request_timeout=1.0), preload={MODEL: server_model}) as s:
        client = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0,
                                     timeout=60)
        kinds: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as e:
            for event in client.messages.create(
                    model=MODEL, max_tokens=4000, stream=True, messages=Q,
                    extra_body={**GREEDY, "output_config": {"format": long_reply}}):
                kinds.append(event.type)
        body = e.value.body
        assert body["type"] == "error" and body["error"]["type"] == "timeout_error", body
        assert "timed out after 1 s" in body["error"]["message"]
        if kinds:  # it failed after the stream began (else: a 504 before any event)
            assert kinds[0] == "message_start" and "message_stop" not in kinds
        r = client.messages.create(model=MODEL, max_tokens=2, messages=Q)
        assert r.usage.output_tokens > 0
