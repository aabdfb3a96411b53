"""localrun serve through the official ``ollama`` Python client, pointed at the server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import requires_llama
from tests.serverutil import MODEL, Running, request, serve, server_fixtures

ollama = pytest.importorskip("ollama", reason="the ollama client is not installed "
                             "(pip install -e '.[dev]')")

from localrun import __version__  # noqa: E402
from localrun.server.config import ServerConfig  # noqa: E402

pytestmark = [requires_llama, pytest.mark.slow]
Q = [{"role": "user", "content": "What is the capital of France?"}]


# test_embed and test_num_ctx load fixture files by path
server_model, srv = server_fixtures(ServerConfig(allow_local_paths=True))


@pytest.fixture(scope="module")
def client(srv: Running) -> Any:
    return ollama.Client(host=srv.url, timeout=120)


def test_chat_equals_the_python_api(client: Any, server_model: Any) -> None:
    opts = {"temperature": 0, "num_predict": 12}
    r = client.chat(model=MODEL, messages=Q, options=opts)
    want = server_model.chat(Q, temperature=0, max_tokens=12)
    assert r.message.role == "assistant" and r.message.content == want.text
    assert r.done and r.done_reason == want.finish_reason
    assert r.prompt_eval_count == want.usage.prompt_tokens
    assert r.eval_count == want.usage.completion_tokens
    assert r.total_duration and r.total_duration > 0
    parts = list(client.chat(model=MODEL, messages=Q, options=opts, stream=True))
    assert "".join(p.message.content for p in parts) == want.text
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert parts[-1].eval_count == want.usage.completion_tokens


def test_generate(client: Any, server_model: Any) -> None:
    r = client.generate(model=MODEL, prompt="What is the capital of France?",
                        options={"temperature": 0, "num_predict": 10})
    want = server_model.chat(Q, temperature=0, max_tokens=10)
    assert r.response == want.text and r.done
    raw = client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True,
                          options={"temperature": 0, "num_predict": 6})
    assert raw.response == server_model.complete("1, 2, 3, 4,", temperature=0,
                                                max_tokens=6).text
    streamed = client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, stream=True,
                               options={"temperature": 0, "num_predict": 6})
    assert "".join(p.response for p in streamed) == raw.response


def test_format_schema_gives_matching_json(client: Any) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.chat(model=MODEL, format=schema, options={"temperature": 0, "num_predict": 80},
                    messages=[{"role": "user", "content": "Capital of France, as JSON."}])
    data = json.loads(r.message.content)
    assert set(data) == {"city", "country"} and all(isinstance(v, str) for v in data.values())
    r = client.chat(model=MODEL, format="json", options={"temperature": 0, "num_predict": 60},
                    messages=[{"role": "user", "content": "A colour, as JSON."}])
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)


def test_tools(client: Any, server_model: Any) -> None:
    """Ollama's tool shapes both ways: calls in an assistant turn and the tool's answer
    (by tool_name) reach the model; a reply's calls come back as the client parses them."""
    from localrun.server.protocol.ollama import tool_calls as _tool_calls

    def get_weather(city: str) -> str:
        """Current weather in a city.

        Args:
            city: The city.
        """
        return "sunny"

    r = client.chat(model=MODEL, tools=[get_weather], options={"temperature": 0,
                                                               "num_predict": 20},
                    messages=[{"role": "user", "content": "Weather in Paris?"},
                              {"role": "assistant", "content": "", "tool_calls": [
                                  {"function": {"name": "get_weather",
                                                "arguments": {"city": "Paris"}}}]},
                              {"role": "tool", "tool_name": "get_weather",
                               "content": "18 C and sunny"}])
    assert r.done and r.message.role == "assistant"
    # SmolLM2 never calls a tool unforced, and Ollama's API cannot force one: the reply
    # side is checked on a forced call made in process, through the client's own types
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    c = server_model.chat([{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
                         tool_choice="required", temperature=0, max_tokens=60)
    parsed = ollama.ChatResponse.model_validate(
        {"model": MODEL, "done": True, "message": {"role": "assistant", "content": "",
                                                   "tool_calls": _tool_calls(c)}})
    assert parsed.message.tool_calls and parsed.message.tool_calls[0].function.name == \
        "get_weather"
    assert set(parsed.message.tool_calls[0].function.arguments) == {"city"}


def test_tags_ps_show_version(client: Any, srv: Running) -> None:
    names = [m.model for m in client.list().models]
    assert MODEL in names
    ps = client.ps().models
    assert [m.model for m in ps] == [MODEL]
    assert ps[0].details.format == "gguf" and ps[0].details.quantization_level == "Q4_1"
    shown = client.show(MODEL)
    assert shown.details.format == "gguf" and "completion" in shown.capabilities
    status, _, body = request("GET", srv.url + "/api/version")
    assert status == 200 and json.loads(body) == {"version": __version__}
    with pytest.raises(ollama.ResponseError) as e:
        client.show("no-such-model-here")
    assert e.value.status_code == 404


def test_unsupported_option_is_refused_by_name(client: Any) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=Q, options={"mirostat": 2})
    assert e.value.status_code == 400 and "options.mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=Q, options={"num_predict": 2, "temprature": 0.1})
    assert "options.temprature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "x",
                                            "images": ["aGk="]}])
    assert e.value.status_code == 400 and "not a PNG, JPEG, WebP or GIF image" in e.value.error


def test_embed(client: Any) -> None:
    from tests.models import test_model

    path = str(test_model("minilm-gguf"))
    ref = json.loads((test_model("minilm-openvino") / "reference.json").read_text())
    r = client.embed(model=path, input=ref["texts"])
    assert len(r.embeddings) == 2
    for got, want in zip(r.embeddings, ref["embeddings"], strict=True):
        assert sum(a * b for a, b in zip(got, want, strict=True)) > 0.999
    # keep_alive 0: unloaded as soon as the request is done
    client.embed(model=path, input="bye", keep_alive=0)
    deadline = __import__("time").monotonic() + 10
    while any(m.model == path for m in client.ps().models):
        assert __import__("time").monotonic() < deadline, "keep_alive 0 did not unload"
        __import__("time").sleep(0.1)


def test_num_ctx_loads_the_model_at_that_context(client: Any, srv: Running) -> None:
    from tests.models import test_model

    path = str(test_model("gguf-q4_1"))
    r = client.generate(model=path, prompt="Hi", options={"num_ctx": 512, "num_predict": 2,
                                                          "temperature": 0}, keep_alive=0)
    assert r.done
    status, _, body = request("POST", srv.url + "/api/generate",
                              {"model": path, "prompt": "Hi " * 600, "stream": False,
                               "options": {"num_ctx": 512, "num_predict": 2}})
    assert status == 400 and "context window is 512" in json.loads(body)["error"]


def test_pull_streams_progress_from_the_hub(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Any) -> None:
    from tests.hubserver import BASE, start

    for fake in start(monkeypatch, tmp_path):
        with serve(ServerConfig(backend="llama.cpp", allow_pull=True)) as s:
            c = ollama.Client(host=s.url, timeout=120)
            events = list(c.pull(BASE, stream=True))
            statuses = [e.status for e in events]
            assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
            files = [e for e in events if (e.status or "").startswith("pulling ") and e.total]
            assert files and files[-1].completed == files[-1].total
            assert fake.hub.resolve_requests()  # the bytes came from the (fake) Hub
            assert BASE in [m.model for m in c.list().models]
            assert c.pull(BASE).status == "success"  # not streamed: one answer
            with pytest.raises(ollama.ResponseError) as e:
                c.pull("nobody/no-such-model-GGUF")
            assert e.value.status_code == 404
