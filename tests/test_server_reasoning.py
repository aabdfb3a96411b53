"""Thinking models through ``localrun serve`` (issue 28 item 1, the server side): the
thinking apart from the answer in every dialect, each dialect's switch, a hard budget,
and the bad values refused naming the field.

The thinking model is the fixture of tests/test_reasoning.py: the embedded SmolLM2-135M
GGUF with Qwen3's template made to open the thinking (``load(chat_template=...)``),
preloaded under :data:`THINKER` beside the plain model (:data:`MODEL`, at another
context: the server keeps one copy per file and context). SmolLM2 never
closes its thinking itself, so a budget is what ends it, and the question keeps it
thinking past 16 tokens. Every reply is compared with the same Model called in process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import requires_llama
from tests.serverutil import MODEL, Running, request, serve

openai = pytest.importorskip("openai", reason="the openai client is not installed "
                             "(pip install -e '.[dev]')")
anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed "
                                "(pip install -e '.[clients]')")
ollama = pytest.importorskip("ollama", reason="the ollama client is not installed "
                             "(pip install -e '.[dev]')")

from localrun.server.config import ServerConfig  # noqa: E402

pytestmark = [requires_llama, pytest.mark.slow]
FIXTURE = Path(__file__).parent / "chat_templates" / "qwen3-think-prefilled.jinja"
THINKER = "thinker"
QUESTION = "List the planets of the solar system."
Q = [{"role": "user", "content": QUESTION}]
BUDGET = 16
N = 40  # max_tokens: thinking (16) and an answer


@pytest.fixture(scope="module")
def models() -> Iterator[tuple[Any, Any]]:
    import localrun
    from tests.models import test_model

    path = str(test_model("gguf-q4_1"))
    with localrun.load(path, backend="llama.cpp", context=2048, threads=1,
                       chat_template=FIXTURE) as thinker, \
            localrun.load(path, backend="llama.cpp", context=1024, threads=1) as plain:
        thinker.complete("1, 2, 3,", max_tokens=2, temperature=0)
        yield thinker, plain


@pytest.fixture(scope="module")
def srv(models: tuple[Any, Any]) -> Iterator[Running]:
    thinker, plain = models
    with serve(ServerConfig(), preload={THINKER: thinker, MODEL: plain}) as s:
        yield s


@pytest.fixture(scope="module")
def budgeted(models: tuple[Any, Any]) -> Any:
    """The thinker's reply in process, thinking cut at the budget."""
    c = models[0].chat(Q, temperature=0, max_tokens=N, thinking_budget=BUDGET)
    assert c.reasoning and c.text and c.usage.reasoning_tokens == BUDGET
    return c


@pytest.fixture(scope="module")
def unthinking(models: tuple[Any, Any]) -> Any:
    c = models[0].chat(Q, temperature=0, max_tokens=12, think=False)
    assert c.reasoning is None and c.text
    return c


def _oa(srv: Running) -> Any:
    return openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)


# -- Chat Completions -------------------------------------------------------------------

def test_chat_completions_reasoning_content_and_budget(srv: Running, budgeted: Any,
                                                       unthinking: Any) -> None:
    client = _oa(srv)
    r = client.chat.completions.create(model=THINKER, messages=Q, temperature=0, max_tokens=N,
                                       extra_body={"thinking_budget": BUDGET})
    msg = r.choices[0].message
    assert (msg.model_extra or {})["reasoning_content"] == budgeted.reasoning
    assert msg.content == budgeted.text and "<think>" not in msg.content
    details = r.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == BUDGET
    assert r.usage.completion_tokens == budgeted.usage.completion_tokens
    # each dialect's switch: vLLM's chat_template_kwargs, DashScope's, an effort of none
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}},
                  {"enable_thinking": False}, {"reasoning_effort": "none"}):
        off = client.chat.completions.create(model=THINKER, messages=Q, temperature=0,
                                             max_tokens=12, extra_body=extra)
        m = off.choices[0].message
        assert "reasoning_content" not in (m.model_extra or {}), extra
        assert m.content == unthinking.text
    # the plain model: no field at all (a client that knows none sees what it always saw)
    _, _, raw = request("POST", srv.v1 + "/chat/completions", {
        "model": MODEL, "messages": Q, "temperature": 0, "max_tokens": 4})
    body = json.loads(raw)
    assert "reasoning_content" not in body["choices"][0]["message"]
    assert "completion_tokens_details" not in body["usage"]


def test_chat_completions_streams_thinking_as_reasoning_content(srv: Running,
                                                                budgeted: Any) -> None:
    client = _oa(srv)
    thought, text = [], []
    usage = None
    for chunk in client.chat.completions.create(
            model=THINKER, messages=Q, temperature=0, max_tokens=N, stream=True,
            stream_options={"include_usage": True}, extra_body={"thinking_budget": BUDGET}):
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = (delta.model_extra or {}).get("reasoning_content")
        assert not (piece and delta.content), "a delta is thinking or answer, never both"
        thought.append(piece or "")
        text.append(delta.content or "")
    assert "".join(thought) == budgeted.reasoning and "".join(text) == budgeted.text
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == BUDGET


def test_an_earlier_turns_reasoning_content_goes_back(srv: Running, models: tuple[Any, Any]
                                                      ) -> None:
    turns = [*Q, {"role": "assistant", "content": "Mercury, Venus.",
                  "reasoning_content": "The user wants planets."},
             {"role": "user", "content": "And the next one?"}]
    status, _, raw = request("POST", srv.v1 + "/chat/completions", {
        "model": THINKER, "messages": turns, "temperature": 0, "max_tokens": 24,
        "thinking_budget": 8})
    assert status == 200, raw
    want = models[0].chat(turns, temperature=0, max_tokens=24, thinking_budget=8)
    body = json.loads(raw)
    assert body["choices"][0]["message"]["content"] == want.text
    assert body["usage"]["prompt_tokens"] == want.usage.prompt_tokens


# -- Ollama -----------------------------------------------------------------------------

def test_ollama_think_and_message_thinking(srv: Running, models: tuple[Any, Any],
                                           unthinking: Any) -> None:
    c = ollama.Client(host=srv.url, timeout=120)
    want = models[0].chat(Q, temperature=0, max_tokens=N)
    r = c.chat(model=THINKER, messages=Q, think=True,
               options={"temperature": 0, "num_predict": N})
    assert r.message.thinking == want.reasoning and r.message.content == want.text
    off = c.chat(model=THINKER, messages=Q, think=False,
                 options={"temperature": 0, "num_predict": 12})
    assert off.message.thinking is None and off.message.content == unthinking.text
    thought, text = [], []
    for part in c.chat(model=THINKER, messages=Q, stream=True, think=True,
                       options={"temperature": 0, "num_predict": N}):
        assert not (part.message.thinking and part.message.content)
        thought.append(part.message.thinking or "")
        text.append(part.message.content or "")
    assert "".join(thought) == want.reasoning and "".join(text) == want.text
    g = c.generate(model=THINKER, prompt=QUESTION, think=False,
                   options={"temperature": 0, "num_predict": 12})
    assert g.thinking is None and g.response == unthinking.text
    g = c.generate(model=THINKER, prompt=QUESTION,
                   options={"temperature": 0, "num_predict": N})
    assert g.thinking == want.reasoning and g.response == want.text
    # an effort level is a budget: "low" (1024 tokens) leaves these 40 to max_tokens
    low = c.chat(model=THINKER, messages=Q, think="low",
                 options={"temperature": 0, "num_predict": N})
    assert low.message.thinking == want.reasoning
    # an earlier turn's thinking goes back to the template
    back = c.chat(model=THINKER, think=False, options={"temperature": 0, "num_predict": 8},
                  messages=[*Q, {"role": "assistant", "content": "Mercury.",
                                 "thinking": "Planets."}, {"role": "user", "content": "More"}])
    assert back.message.content


def test_ollama_show_says_which_model_thinks(srv: Running) -> None:
    c = ollama.Client(host=srv.url, timeout=120)
    assert "thinking" in (c.show(THINKER).capabilities or [])
    assert "thinking" not in (c.show(MODEL).capabilities or [])


# -- Anthropic --------------------------------------------------------------------------

def test_anthropic_thinking_blocks_with_a_budget(srv: Running, budgeted: Any,
                                                 unthinking: Any) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0,
                                 timeout=120)
    greedy = {"temperature": 0}
    r = client.messages.create(model=THINKER, max_tokens=N, messages=Q, extra_body=greedy,
                               thinking={"type": "enabled", "budget_tokens": BUDGET})
    assert [b.type for b in r.content] == ["thinking", "text"]
    thinking, text = r.content
    assert thinking.thinking == budgeted.reasoning and thinking.signature
    assert text.text == budgeted.text
    assert r.usage.output_tokens == budgeted.usage.completion_tokens
    # streamed: thinking deltas, the signature, then the text; the same blocks
    with client.messages.stream(model=THINKER, max_tokens=N, messages=Q, extra_body=greedy,
                                thinking={"type": "enabled", "budget_tokens": BUDGET}) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert kinds[0] == "thinking_delta" and "signature_delta" in kinds
    assert kinds.index("signature_delta") < kinds.index("text_delta")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content]
    # off when disabled, and when not asked (Claude clients expect no thinking blocks)
    for extra in ({"thinking": {"type": "disabled"}}, {}):
        off = client.messages.create(model=THINKER, max_tokens=12, messages=Q,
                                     extra_body=greedy, **extra)
        assert [b.type for b in off.content] == ["text"], extra
        assert off.content[0].text == unthinking.text
    # the thinking block sent back in the assistant turn is accepted
    again = client.messages.create(
        model=THINKER, max_tokens=8, extra_body=greedy, messages=[
            *Q, {"role": "assistant", "content": [b.model_dump() for b in r.content]},
            {"role": "user", "content": "And the next one?"}])
    assert again.content[0].type == "text"


def test_anthropic_count_tokens_counts_the_prompt_the_reply_reads(srv: Running) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0,
                                 timeout=120)
    for thinking in (None, {"type": "enabled", "budget_tokens": 4}):
        extra: dict[str, Any] = {"thinking": thinking} if thinking else {}
        n = client.messages.count_tokens(model=THINKER, messages=Q, **extra)
        r = client.messages.create(model=THINKER, max_tokens=6, messages=Q,
                                   extra_body={"temperature": 0}, **extra)
        assert n.input_tokens == r.usage.input_tokens, thinking


# -- bad values -------------------------------------------------------------------------

def test_bad_thinking_values_are_4xx_naming_the_field(srv: Running) -> None:
    chat = srv.v1 + "/chat/completions"
    base = {"model": THINKER, "messages": Q, "max_tokens": 4}
    for extra, param in (({"thinking_budget": -1}, "thinking_budget"),
                         ({"reasoning_effort": "huge"}, "reasoning_effort"),
                         ({"chat_template_kwargs": {"enable_thinking": "no"}},
                          "chat_template_kwargs.enable_thinking"),
                         ({"chat_template_kwargs": {"thinking": True}},
                          "chat_template_kwargs.thinking")):
        status, _, raw = request("POST", chat, {**base, **extra})
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == param, raw
    # a model that does not think, asked to: the field that asked
    status, _, raw = request("POST", chat, {**base, "model": MODEL, "reasoning_effort": "low"})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "reasoning_effort", raw
    assert "does not think" in error["message"]
    msgs = srv.url + "/v1/messages"
    for thinking, words in (({"type": "enabled", "budget_tokens": -1}, "budget_tokens"),
                            ({"type": "enabled"}, "budget_tokens"),
                            ({"type": "sometimes"}, "thinking.type")):
        status, _, raw = request("POST", msgs, {"model": THINKER, "max_tokens": 4,
                                                "messages": Q, "thinking": thinking})
        body = json.loads(raw)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", raw
        assert words in body["error"]["message"], raw
    # ... in Anthropic's words, found once the model is known (a reply and a count alike)
    for path, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
        status, _, raw = request("POST", srv.url + path, {
            "model": MODEL, "messages": Q, "thinking": {"type": "enabled", "budget_tokens": 16},
            **extra})
        message = json.loads(raw)["error"]["message"]
        assert status == 400 and "'thinking.budget_tokens'" in message, raw
        assert "does not think" in message
    for path, body in (("/api/chat", {"model": THINKER, "messages": Q, "think": "huge"}),
                       ("/api/generate", {"model": THINKER, "prompt": "x", "raw": True,
                                          "think": True})):
        status, _, raw = request("POST", srv.url + path, {**body, "stream": False})
        assert status == 400 and "think" in json.loads(raw)["error"], raw
