"""LangChain's OpenAI chat model against ``localrun serve`` (issue 28 item 3): what it
sends by default for structured output and tools — ``parallel_tool_calls: false`` on
every ``with_structured_output(method="function_calling")`` and on
``bind_tools(..., parallel_tool_calls=False)`` — is accepted and enforced.

One real llama.cpp model (the embedded SmolLM2-135M GGUF) on a module-scoped server;
``langchain-openai`` unchanged but for ``base_url``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import requires_llama
from tests.serverutil import MODEL, Running, server_fixtures

langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not "
                                       "installed (pip install -e '.[clients]')")
pydantic = pytest.importorskip("pydantic")

from localrun.server.config import ServerConfig  # noqa: E402

pytestmark = [requires_llama, pytest.mark.slow]

server_model, srv = server_fixtures(ServerConfig())


class City(pydantic.BaseModel):
    """A city and its country."""

    name: str
    country: str


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"18 C in {city}"


def _chat(srv: Running, **kwargs: Any) -> Any:
    return langchain_openai.ChatOpenAI(base_url=srv.v1, api_key="unused", model=MODEL,
                                       temperature=0, max_retries=0, timeout=120, **kwargs)


def test_with_structured_output_function_calling(srv: Running, server_model: Any) -> None:
    sent: list[dict[str, Any]] = []

    def seen(request: Any) -> None:  # the body LangChain sends, as the server reads it
        sent.append(json.loads(request.content))

    import httpx

    llm = _chat(srv, max_tokens=60, http_client=httpx.Client(event_hooks={"request": [seen]}))
    city = llm.with_structured_output(City, method="function_calling").invoke(
        "The capital of France, as a city and its country.")
    assert isinstance(city, City) and city.name and city.country
    assert sent[-1]["parallel_tool_calls"] is False  # what made it a 400 before
    assert sent[-1]["tool_choice"]["function"]["name"] == "City"


def test_bind_tools_without_parallel_calls(srv: Running) -> None:
    llm = _chat(srv, max_tokens=60).bind_tools([get_weather], parallel_tool_calls=False,
                                               tool_choice="get_weather")
    msg = llm.invoke("What is the weather in Paris and in Oslo?")
    assert len(msg.tool_calls) == 1  # one call at most, as asked
    call = msg.tool_calls[0]
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    auto = _chat(srv, max_tokens=60).bind_tools([get_weather], parallel_tool_calls=False)
    reply = auto.invoke("What is the weather in Paris and in Oslo?")
    assert len(reply.tool_calls) <= 1
