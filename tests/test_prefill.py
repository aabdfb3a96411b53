"""An assistant prefill (a conversation that ends with an assistant message) on the real
llama.cpp engine: what it cannot be combined with is refused before anything runs, in
the Python API and as a 400 from the OpenAI and Ollama routes, and the routes continue
it as the Python API does. Every engine's continuation: tests/test_conformance.py;
Anthropic's prefill: tests/test_server_anthropic.py."""

from __future__ import annotations

from typing import Any

import pytest

import localrun
from localrun.errors import UnsupportedFeatureError
from tests.conftest import requires_llama
from tests.test_reasoning import R1

Q: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
PREFILLED: list[Any] = [*Q, {"role": "assistant", "content": "The capital of France is"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}}


@requires_llama
def test_a_prefill_with_a_schema_or_tools_is_refused(llama_model: Any) -> None:
    for kw in ({"schema": PERSON},
               {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                   "type": "object", "properties": {}}}}]}):
        with pytest.raises(localrun.LocalrunError, match="prefill") as e:
            llama_model.chat(PREFILLED, max_tokens=4, **kw)
        assert "user message" in str(e.value)
        with pytest.raises(localrun.LocalrunError, match="prefill"):
            llama_model.count_prompt_tokens(PREFILLED, **kw)


@requires_llama
def test_a_prefill_to_a_thinking_model_is_refused(default_gguf: Any) -> None:
    with localrun.load(str(default_gguf), chat_template=R1, context=1024) as m, \
            pytest.raises(localrun.LocalrunError, match="thinking model"):
        m.chat(PREFILLED, max_tokens=4)


@requires_llama
def test_the_openai_and_ollama_clients_continue_a_prefill(llama_model: Any) -> None:
    """The official ``openai`` and ``ollama`` clients against localrun serve: the reply
    continues the final assistant message as the Python API does; with a schema it is a
    400 that says why."""
    pytest.importorskip("tests.serverutil", reason="the serve extra is not installed "
                        "(pip install -e '.[serve]')")
    openai = pytest.importorskip("openai", reason="the openai client is not installed "
                                 "(pip install -e '.[clients]')")
    ollama = pytest.importorskip("ollama", reason="the ollama client is not installed "
                                 "(pip install -e '.[clients]')")
    from localrun.server.config import ServerConfig
    from tests.serverutil import MODEL, serve

    want = llama_model.chat(PREFILLED, temperature=0, max_tokens=6)
    assert "Paris" in want.text and not want.text.startswith("The capital")
    with serve(ServerConfig(), preload={MODEL: llama_model}) as s:
        client = openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=120)
        out = client.chat.completions.create(model=MODEL, messages=PREFILLED, max_tokens=6,
                                             temperature=0)
        assert out.choices[0].message.content == want.text
        assert out.usage is not None and out.usage.prompt_tokens == want.usage.prompt_tokens
        reply = ollama.Client(host=s.url, timeout=120).chat(
            model=MODEL, messages=PREFILLED, options={"num_predict": 6, "temperature": 0})
        assert reply.message.content == want.text
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=PREFILLED, max_tokens=6,
                                           response_format={"type": "json_object"})
        assert "prefill" in str(e.value)


def test_a_remote_server_refuses_a_prefill_it_would_render_itself() -> None:
    """``remote`` (and ``vllm``, a RemoteSession) sends the messages for the server to
    render: it refuses a prefill with the engines that take one, and sends nothing."""
    from tests.fake_openai import FakeOpenAI

    fake = FakeOpenAI(["org/model"], max_model_len=64).start()
    try:
        with localrun.load("org/model", backend="remote", base_url=fake.url) as m:
            with pytest.raises(UnsupportedFeatureError, match="prefill") as e:
                m.chat(PREFILLED, max_tokens=4)
            assert "llama.cpp" in (e.value.hint or "")
    finally:
        fake.stop()
