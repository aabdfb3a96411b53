"""localrun serve through the official ``openai`` client, unchanged but for base_url.

One real llama.cpp model (the embedded SmolLM2-135M GGUF) shared by a module-scoped
server on 127.0.0.1. Replies are compared with the same model called in process:
the server must add nothing and lose nothing.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest

from tests.conftest import requires_llama
from tests.serverutil import MODEL, Running, request, serve, server_fixtures

openai = pytest.importorskip("openai", reason="the openai client is not installed "
                             "(pip install -e '.[dev]')")
pydantic = pytest.importorskip("pydantic")

from localrun.server.config import ServerConfig  # noqa: E402

pytestmark = [requires_llama, pytest.mark.slow]
Q = [{"role": "user", "content": "What is the capital of France?"}]


# the embedding tests load fixture files by path
server_model, srv = server_fixtures(ServerConfig(max_queue=4, allow_local_paths=True))


@pytest.fixture(scope="module")
def client(srv: Running) -> Any:
    return openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)


def test_chat_equals_the_python_api(client: Any, server_model: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=12)
    want = server_model.chat(Q, temperature=0, max_tokens=12)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == want.usage.prompt_tokens
    assert r.usage.completion_tokens == want.usage.completion_tokens
    assert r.usage.total_tokens == want.usage.total_tokens
    assert r.model == MODEL and r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_stream_with_usage_equals_the_reply(client: Any) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": Q, "temperature": 0, "max_tokens": 12}
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage: no usage chunk at all
    plain = list(client.chat.completions.create(**args, stream=True))
    assert all(c.choices for c in plain)


def test_completions_raw_text_equals_the_python_api(client: Any, server_model: Any) -> None:
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0,
                                  max_tokens=8)
    want = server_model.complete("1, 2, 3, 4,", temperature=0, max_tokens=8)
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == want.usage.completion_tokens
    streamed = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0,
                                         max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_parse_with_a_pydantic_model(client: Any) -> None:
    class City(pydantic.BaseModel):
        name: str
        country: str

    r = client.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=60, response_format=City,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}])
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City)
    assert json.loads(r.choices[0].message.content) == parsed.model_dump()


def test_json_object_mode_gives_json(client: Any) -> None:
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=40, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as JSON."}])
    content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    if finish == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut by max_tokens: OpenAI's answer too (finish_reason "length", partial JSON)
        assert finish == "length" and content.lstrip().startswith("{")
        assert r.usage.completion_tokens == 40


def test_json_cut_by_max_tokens_is_a_length_finish(client: Any) -> None:
    class Story(pydantic.BaseModel):
        title: str
        text: str

    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=MODEL, temperature=0, max_tokens=3, response_format=Story,
            messages=[{"role": "user", "content": "Write a story as JSON."}])


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}


def test_tool_choice_required_returns_a_call(client: Any) -> None:
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60, tools=[WEATHER], tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and calls[0].id
    assert set(json.loads(calls[0].function.arguments)) == {"city"}
    # the result goes back as a tool message, the conversation goes on
    follow = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=20, tools=[WEATHER],
        messages=[{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [c.model_dump() for c in calls]},
                  {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C, sunny"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_calls_through_the_stream_helper(client: Any) -> None:
    with client.chat.completions.stream(
            model=MODEL, temperature=0, max_tokens=60, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            messages=[{"role": "user", "content": "Weather in Oslo?"}]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert final.choices[0].finish_reason == "tool_calls"


def test_models_lists_the_loaded_model(client: Any) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids[0] == MODEL
    assert client.models.retrieve(MODEL).id == MODEL


def test_400_names_the_unsupported_field(client: Any) -> None:
    for extra, field in (({"n": 17}, "n"), ({"top_logprobs": 21}, "top_logprobs"),
                         ({"frequency_penalty": 0.5}, "frequency_penalty")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=Q, max_tokens=2, **extra)
        assert e.value.body["param"] == field, e.value.body
        assert field in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=Q, max_tokens=2,
                                       extra_body={"mirostat": 2})
    assert e.value.body["param"] == "mirostat"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=Q, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert e.value.body["param"] == "messages[0].content[0].image_url.url"
    assert "data: URI" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    assert e.value.body["param"] == "messages[0].content[0]"


def test_404_for_an_unknown_model_and_route(srv: Running, client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="./no/such/model.gguf", messages=Q)
    assert e.value.body["code"] == "model_not_found"
    status, _, body = request("POST", srv.url + "/v1/nothing", {})
    assert status == 404 and "No such endpoint" in json.loads(body)["error"]["message"]


def test_embeddings_refused_for_a_chat_model(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="hello")
    assert "text-generation model" in e.value.body["message"]


def test_bad_json_and_huge_bodies(srv: Running) -> None:
    status, _, body = request("POST", srv.v1 + "/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]



def test_request_size_limit() -> None:
    import http.client
    from urllib.parse import urlsplit

    big = b'{"model": "x", "pad": "' + b"a" * 20_000 + b'"}'
    with serve(ServerConfig(max_request_bytes=4096)) as small:
        status, _, body = request("POST", small.v1 + "/chat/completions", big)
        assert status == 413 and "over the limit" in json.loads(body)["error"]["message"]
        # no Content-Length (chunked): counted as it arrives
        u = urlsplit(small.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=iter([big[:3000], big[3000:]]),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        r = conn.getresponse()
        assert r.status == 413 and "over the limit" in json.loads(r.read())["error"]["message"]
        conn.close()


def test_no_traceback_in_any_error(srv: Running) -> None:
    for body in ({"model": MODEL, "messages": "hi"}, {"model": 3, "messages": Q},
                 {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": MODEL, "messages": Q, "stream": "yes"}, []):
        status, _, raw = request("POST", srv.v1 + "/chat/completions", body)
        assert status == 400, raw
        assert "Traceback" not in raw.decode() and "error" in json.loads(raw)


# -- embeddings with a real embedding model -------------------------------------------------

def test_embeddings_base64_match_the_reference(srv: Running, client: Any) -> None:
    from tests.models import test_model

    path = test_model("minilm-gguf")
    ref = json.loads((test_model("minilm-openvino") / "reference.json").read_text())
    r = client.embeddings.create(model=str(path), input=ref["texts"])  # base64 by default
    assert [d.index for d in r.data] == [0, 1]
    for got, want in zip(r.data, ref["embeddings"], strict=True):
        assert len(got.embedding) == 384
        cos = sum(a * b for a, b in zip(got.embedding, want, strict=True))
        assert cos > 0.999, cos  # the PyTorch reference of all-MiniLM-L6-v2
    assert r.usage.prompt_tokens > 0
    # the wire format: little-endian float32, and "float" gives the same numbers
    status, _, body = request("POST", srv.v1 + "/embeddings",
                              {"model": str(path), "input": "hi", "encoding_format": "base64"})
    raw = base64.b64decode(json.loads(body)["data"][0]["embedding"])
    as_b64 = struct.unpack(f"<{len(raw) // 4}f", raw)
    status, _, body = request("POST", srv.v1 + "/embeddings",
                              {"model": str(path), "input": "hi", "encoding_format": "float"})
    as_float = json.loads(body)["data"][0]["embedding"]
    assert status == 200 and len(as_float) == 384
    assert max(abs(a - b) for a, b in zip(as_b64, as_float, strict=True)) < 1e-6
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=str(path), input="hi", dimensions=128)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as e:  # and it cannot chat
        client.chat.completions.create(model=str(path), messages=Q)
    assert "is an embedding model" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # an input over its 512 tokens
        client.embeddings.create(model=str(path), input="word " * 600)
    assert e.value.body["code"] == "context_length_exceeded"


def test_embeddings_on_openvino_match_the_reference(client: Any) -> None:
    pytest.importorskip("openvino_genai", reason="OpenVINO GenAI is not installed "
                        "(pip install -e '.[openvino]')")
    from tests.models import test_model

    folder = test_model("minilm-openvino")
    ref = json.loads((folder / "reference.json").read_text())
    r = client.embeddings.create(model=str(folder), input=ref["texts"])
    for got, want in zip(r.data, ref["embeddings"], strict=True):
        assert sum(a * b for a, b in zip(got.embedding, want, strict=True)) > 0.999
    # OpenVINO's text-generation IR has no embedding head
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=str(test_model("openvino-int4")), input="hi")
    assert "text-generation model" in e.value.body["message"]
