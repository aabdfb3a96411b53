"""The OpenAI Agents SDK (``openai-agents``) with its DEFAULT model class,
``OpenAIResponsesModel`` — the Responses API — pointed at ``localrun serve`` as its users
point it at any server: ``set_default_openai_client(AsyncOpenAI(base_url=...))``, tracing
off. An agent with one function tool runs through ``Runner.run``: the model calls the
tool (forced on the first turn with ``tool_choice="required"``; the SDK's
``reset_tool_choice`` lifts it after the call), the SDK runs it and sends its output
back in the next request, and the model's answer ends the loop (issue 27).

Greedy decoding (temperature 0) on the embedded SmolLM2-135M GGUF: the run is the same
every time. The SDK stays stateless here (no ``previous_response_id``): each turn sends
the whole conversation, items the server made included (ids, statuses, output_text parts).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import requires_llama
from tests.serverutil import MODEL, Running, server_fixtures

agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed "
                             "(pip install -e '.[clients]')")
openai = pytest.importorskip("openai")

from localrun.server.config import ServerConfig  # noqa: E402

pytestmark = [requires_llama, pytest.mark.slow]

server_model, srv = server_fixtures(ServerConfig())


@pytest.fixture(scope="module", autouse=True)
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("localrun-home")
    old = os.environ.get("LOCALRUN_HOME")
    os.environ["LOCALRUN_HOME"] = str(path)
    yield path
    if old is None:
        os.environ.pop("LOCALRUN_HOME", None)
    else:
        os.environ["LOCALRUN_HOME"] = old


def _agent(url: str, called: list[str]) -> Any:
    """The agent, its client set as the SDK's default (tracing off)."""
    from agents import (
        Agent,
        ModelSettings,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"18 C and sunny in {city}"

    set_tracing_disabled(True)
    set_default_openai_client(openai.AsyncOpenAI(base_url=url, api_key="unused",
                                                 max_retries=0, timeout=120),
                              use_for_tracing=False)
    return Agent(name="weather", model=MODEL, tools=[get_weather],
                 instructions="You answer questions about the weather. Use the tool.",
                 model_settings=ModelSettings(temperature=0, max_tokens=40,
                                              tool_choice="required"))


def test_an_agent_with_a_function_tool_runs_to_its_final_output(srv: Running) -> None:
    from agents import Runner
    from agents.items import ToolCallItem, ToolCallOutputItem
    from agents.models.openai_responses import OpenAIResponsesModel

    called: list[str] = []
    agent = _agent(srv.v1, called)

    async def run() -> Any:
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    # the SDK's default model class spoke the Responses API
    assert isinstance(agents.models.openai_provider.OpenAIProvider().get_model(MODEL),
                      OpenAIResponsesModel)
    assert len(called) == 1 and called[0]  # the tool ran once, with a city
    kinds = [type(i) for i in result.new_items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem], kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) == 2  # a tool call, then the answer
    first, last = result.raw_responses
    assert first.usage.input_tokens > 0 and last.usage.input_tokens > first.usage.input_tokens
    assert [o.type for o in last.output] == ["message"]


def test_the_same_run_streamed(srv: Running) -> None:
    """``Runner.run_streamed``: the SDK reads the typed event stream (it checks each
    item's identity from added to done to completed) and ends with the same answer."""
    from agents import Runner

    called: list[str] = []
    agent = _agent(srv.v1, called)

    async def run() -> tuple[Any, list[str], Any]:  # one loop: the client's pool is its
        result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        kinds = [e.type async for e in result.stream_events()]
        whole = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        return result, kinds, whole

    result, kinds, whole = asyncio.run(run())
    assert called == ["Paris", "Paris"] and "raw_response_event" in kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert result.final_output == whole.final_output
