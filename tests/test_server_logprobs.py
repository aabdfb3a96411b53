"""Log probabilities, echo, token-array prompts, lists of prompts, ``n`` and
``parallel_tool_calls`` through ``localrun serve`` (issue 28 items 2 and 3, the server
side), with the official ``openai`` client where it has the field.

One real llama.cpp model (the embedded SmolLM2-135M GGUF) shared by a module-scoped
server; every value is compared with the same Model called in process (the server adds
nothing and loses nothing: its choices are the library's Completions, its logprobs the
library's :func:`~localrun.types.chat_logprobs` / :func:`~localrun.types.completion_logprobs`).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import requires_llama
from tests.serverutil import MODEL, Running, request, server_fixtures

openai = pytest.importorskip("openai", reason="the openai client is not installed "
                             "(pip install -e '.[dev]')")

from localrun.server.config import ServerConfig  # noqa: E402
from localrun.types import chat_logprobs, completion_logprobs  # noqa: E402

pytestmark = [requires_llama, pytest.mark.slow]
Q = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

server_model, srv = server_fixtures(ServerConfig())


@pytest.fixture(scope="module")
def client(srv: Running) -> Any:
    return openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)


def _close(a: Any, b: Any) -> None:
    """Two logprob structures alike: the same tokens, values within float noise."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _close(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _close(x, y)
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-4)
    else:
        assert a == b


def test_chat_logprobs_and_top_logprobs(client: Any, server_model: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=5)
    want = server_model.chat(Q, temperature=0, max_tokens=8, logprobs=True, top_logprobs=5)
    got = r.choices[0].logprobs.model_dump()
    _close(got, {**chat_logprobs(want.logprobs), "refusal": None})
    content = got["content"]
    assert "".join(e["token"] for e in content) == r.choices[0].message.content
    assert all(len(e["top_logprobs"]) == 5 for e in content)
    assert all(e["logprob"] <= 0 for e in content)
    # streamed: each delta's tokens, together the same
    pieces = []
    for chunk in client.chat.completions.create(model=MODEL, messages=Q, temperature=0,
                                                max_tokens=8, logprobs=True, top_logprobs=5,
                                                stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            pieces += chunk.choices[0].logprobs.model_dump()["content"]
    _close(pieces, content)
    # not asked: null, as before
    plain = client.chat.completions.create(model=MODEL, messages=Q, temperature=0,
                                           max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_echo_and_offsets(client: Any, server_model: Any) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4,
                                  logprobs=3, echo=True)
    want = server_model.complete(PROMPT, temperature=0, max_tokens=4, logprobs=True,
                                 top_logprobs=3, echo=True)
    choice = r.choices[0]
    assert choice.text == PROMPT + want.text
    lp = choice.logprobs.model_dump()
    _close(lp, completion_logprobs([*want.prompt_logprobs, *want.logprobs]))
    assert lp["token_logprobs"][0] is None and lp["text_offset"][0] == 0
    n_prompt = len(want.prompt_logprobs)
    assert "".join(lp["tokens"][:n_prompt]) == PROMPT
    # without echo: the reply's tokens, offsets after the prompt
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4,
                                  logprobs=0)
    lp = r.choices[0].logprobs.model_dump()
    assert r.choices[0].text == want.text and lp["text_offset"][0] == len(PROMPT)
    chosen = server_model.complete(PROMPT, temperature=0, max_tokens=4, logprobs=True)
    _close(lp, completion_logprobs(chosen.logprobs, text_offset=len(PROMPT)))
    assert all(len(top) == 1 for top in lp["top_logprobs"])  # logprobs 0: the chosen one
    # streamed: the same tokens and offsets, piece by piece
    tokens, offsets = [], []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                           max_tokens=4, logprobs=0, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == lp["tokens"] and offsets == lp["text_offset"]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(srv: Running,
                                                        server_model: Any) -> None:
    status, _, raw = request("POST", srv.v1 + "/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    want = server_model.complete(PROMPT, max_tokens=0, echo=True, logprobs=True,
                                 top_logprobs=1)
    assert choice["text"] == PROMPT
    _close(choice["logprobs"], completion_logprobs(want.prompt_logprobs))
    # streamed, the echo comes whole with its log probabilities
    status, _, raw = request("POST", srv.v1 + "/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1,
        "stream": True})
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == PROMPT
    _close(events[0]["choices"][0]["logprobs"], completion_logprobs(want.prompt_logprobs))
    assert raw.decode().rstrip().endswith("data: [DONE]")


def test_token_arrays_and_lists_of_prompts(srv: Running, server_model: Any) -> None:
    """lm-evaluation-harness's requests: token ids, several prompts in one request, each
    its own choice (``index``), batched through the driver."""
    ids = server_model._session.encode_text(PROMPT).tokens
    prompts = [PROMPT, "One, two, three,", "Paris is a city in"]
    status, _, raw = request("POST", srv.v1 + "/completions", {
        "model": MODEL, "prompt": list(ids), "temperature": 0, "max_tokens": 4})
    assert status == 200, raw
    by_ids = json.loads(raw)["choices"][0]["text"]
    assert by_ids == server_model.complete(list(ids), temperature=0, max_tokens=4).text
    status, _, raw = request("POST", srv.v1 + "/completions", {
        "model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 4})
    body = json.loads(raw)
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2], raw
    alone = [server_model.complete(p, temperature=0, max_tokens=4) for p in prompts]
    assert [c["text"] for c in body["choices"]] == [c.text for c in alone]
    assert body["usage"]["prompt_tokens"] == sum(c.usage.prompt_tokens for c in alone)
    assert body["usage"]["completion_tokens"] == sum(c.usage.completion_tokens for c in alone)
    # token arrays, several, with echo and logprobs: what lm-eval sends
    many = [list(server_model._session.encode_text(p).tokens) for p in prompts]
    status, _, raw = request("POST", srv.v1 + "/completions", {
        "model": MODEL, "prompt": many, "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "echo": True, "seed": 1234})
    choices = json.loads(raw)["choices"]
    for ids_, choice in zip(many, choices, strict=True):
        want = server_model.complete(ids_, temperature=0, max_tokens=1, logprobs=True,
                                     top_logprobs=1, echo=True)
        _close(choice["logprobs"], completion_logprobs([*want.prompt_logprobs,
                                                        *want.logprobs]))
        assert len(choice["logprobs"]["tokens"]) == len(ids_) + 1


def test_n_choices_each_with_its_own_seed(client: Any, srv: Running) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": Q, "max_tokens": 6,
                            "temperature": 1.0, "seed": 7}
    r = client.chat.completions.create(n=3, **args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    one = client.chat.completions.create(**args)
    assert r.choices[0].message.content == one.choices[0].message.content
    assert len({c.message.content for c in r.choices}) > 1  # sampled independently
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # one prompt, read once
    assert r.usage.completion_tokens >= 3  # every choice's tokens
    # streamed: each choice whole under its index, then [DONE]
    got: dict[int, str] = {}
    finished = set()
    for chunk in client.chat.completions.create(n=3, stream=True, **args):
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert got == {c.index: c.message.content for c in r.choices} and finished == {0, 1, 2}
    # the legacy endpoint: n per prompt, prompt-major
    status, _, raw = request("POST", srv.v1 + "/completions", {
        "model": MODEL, "prompt": [PROMPT, "One, two,"], "n": 2, "max_tokens": 3,
        "temperature": 0})
    choices = json.loads(raw)["choices"]
    assert status == 200 and [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"] != choices[2]["text"] == choices[3]["text"]


def test_parallel_tool_calls_false_is_accepted(client: Any) -> None:
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False,
        messages=[{"role": "user", "content": "Weather in Paris and in Oslo?"}])
    calls = r.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    assert json.loads(calls[0].function.arguments).keys() == {"city"}


def test_bad_values_are_400s_naming_the_field(srv: Running) -> None:
    chat = {"model": MODEL, "messages": Q, "max_tokens": 2}
    text = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    cases = [
        ("/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/chat/completions", {**chat, "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("/chat/completions", {**chat, "n": 17}, "n"),
        ("/chat/completions", {**chat, "n": 0}, "n"),
        ("/completions", {**text, "logprobs": 21}, "logprobs"),
        ("/completions", {**text, "n": 17}, "n"),
        ("/completions", {**text, "prompt": [PROMPT] * 65}, "prompt"),
        ("/completions", {**text, "prompt": [PROMPT] * 8, "n": 9}, "n"),
        ("/completions", {**text, "prompt": [PROMPT, ""]}, "prompt[1]"),
        ("/completions", {**text, "prompt": [[1, 2], []]}, "prompt[1]"),
        ("/completions", {**text, "prompt": []}, "prompt"),
        ("/completions", {**text, "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ("/completions", {**text, "echo": True, "max_tokens": -1}, "max_tokens"),
        ("/completions", {**text, "prompt": [1, 10**9]}, None),  # not a token of this model
        ("/completions", {**text, "best_of": 2}, "best_of"),
    ]
    for path, body, param in cases:
        status, _, raw = request("POST", srv.v1 + path, body)
        error = json.loads(raw)["error"]
        assert status == 400, (body, raw)
        assert error["param"] == param, (body, error)
        if param:
            assert param.split("[")[0] in error["message"], error
    status, _, raw = request("POST", srv.v1 + "/completions", {**text, "prompt": [1, 10**9]})
    assert "1000000000" in json.loads(raw)["error"]["message"]


def test_ollama_logprobs(srv: Running, server_model: Any) -> None:
    status, _, raw = request("POST", srv.url + "/api/generate", {
        "model": MODEL, "prompt": PROMPT, "raw": True, "stream": False, "logprobs": True,
        "top_logprobs": 2, "options": {"temperature": 0, "num_predict": 4}})
    assert status == 200, raw
    body = json.loads(raw)
    want = server_model.complete(PROMPT, temperature=0, max_tokens=4, logprobs=True,
                                 top_logprobs=2)
    _close(body["logprobs"], chat_logprobs(want.logprobs)["content"])
    assert "".join(e["token"] for e in body["logprobs"]) == body["response"]


def test_anthropic_disable_parallel_tool_use(srv: Running) -> None:
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not "
                                    "installed (pip install -e '.[clients]')")
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0,
                                 timeout=120)
    weather = {"name": "get_weather", "description": "Current weather in a city.",
               "input_schema": WEATHER["function"]["parameters"]}
    r = client.messages.create(
        model=MODEL, max_tokens=60, tools=[weather], extra_body={"temperature": 0},
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather in Paris and in Oslo?"}])
    calls = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(calls) == 1


def test_an_engine_without_the_option_is_a_400_naming_it() -> None:
    """OpenVINO GenAI reports the chosen tokens' log probabilities but not the most
    likely ones, echo or token ids: a request for them is a 400 naming the field as the
    endpoint spells it (legacy Completions' ``logprobs: k``), before any token."""
    import importlib.util

    if importlib.util.find_spec("openvino_genai") is None:
        pytest.skip("OpenVINO GenAI is not installed (pip install -e '.[openvino]')")
    import localrun
    from tests.models import test_model
    from tests.serverutil import serve

    with localrun.load(str(test_model("openvino-int4")), backend="openvino",
                       context=512, exact=True) as model, serve(preload={"ov": model}) as s:
        if "top" in model._session.features:
            pytest.skip("this OpenVINO GenAI reports the most likely tokens too")
        for path, body, param in (
                ("/completions", {"prompt": PROMPT, "logprobs": 2}, "logprobs"),
                ("/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0}, "echo"),
                ("/chat/completions", {"messages": Q, "logprobs": True, "top_logprobs": 2},
                 "top_logprobs")):
            status, _, raw = request("POST", s.v1 + path, {"model": "ov", "max_tokens": 2,
                                                           **body})
            error = json.loads(raw)["error"]
            assert status == 400 and error["param"] == param, raw
            assert error["code"] == "unsupported_parameter" and "openvino" in error["message"]
        ok = model.complete(PROMPT, max_tokens=2, logprobs=True)  # what it does report
        assert ok.logprobs


def test_n_choices_of_a_preset_answer_as_the_preset(srv: Running, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Any) -> None:
    """A preset's system prompt and sampling apply to each of its several choices, as
    to its one reply."""
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))
    status, _, raw = request("POST", srv.url + "/api/create", {
        "model": "terse", "from": MODEL, "system": "Reply with one word only.",
        "parameters": {"temperature": 0}, "stream": False})
    assert status == 200, raw
    ask = {"model": "terse", "messages": Q, "max_tokens": 6}
    _, _, one = request("POST", srv.v1 + "/chat/completions", ask)
    _, _, two = request("POST", srv.v1 + "/chat/completions", {**ask, "n": 2})
    want = json.loads(one)["choices"][0]["message"]["content"]
    assert [c["message"]["content"] for c in json.loads(two)["choices"]] == [want, want]
    _, _, plain = request("POST", srv.v1 + "/chat/completions", {
        **ask, "model": MODEL, "temperature": 0})
    assert json.loads(plain)["choices"][0]["message"]["content"] != want  # the prompt told
