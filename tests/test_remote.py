"""Backend "remote": localrun's Model API over an OpenAI-compatible server.

Most cases run against tests/fake_openai.py, a stand-in that answers as vLLM does (SSE,
usage chunk, stop strings, OpenAI-shaped errors); one runs against `localrun serve`
serving the SmolLM2 GGUF fixture, so the answer there comes from a real model.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

import localrun
from localrun.backends.remote.session import normalize_base_url, request_body
from localrun.errors import (
    ContextOverflowError,
    LocalrunError,
    RemoteAuthError,
    RemoteError,
    RemoteModelNotFoundError,
    TokenCountUnavailableError,
)
from tests.fake_openai import FakeOpenAI

MODEL = "org/model"


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI([MODEL], max_model_len=64).start()
    yield server
    server.stop()


def load(fake: FakeOpenAI, name: str = MODEL, **kw: object) -> localrun.Model:
    return localrun.load(name, backend="remote", base_url=fake.url, **kw)


def test_greedy_answer_usage_and_info(fake: FakeOpenAI) -> None:
    with load(fake) as m:
        c = m.chat([{"role": "user", "content": "alpha beta gamma"}], temperature=0)
        assert c.text == "alpha beta gamma"
        assert c.finish_reason == "stop"
        # the server's own counts: 3 words of prompt, 3 of reply
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (3, 3)
        assert m.info.backend == "remote" and m.info.name == MODEL
        assert m.info.context_length == 64 and m.info.engine_version == "vllm"
    sent = fake.requests[-1]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["temperature"] == 0 and sent["messages"][-1]["content"] == "alpha beta gamma"


def test_base_url_with_or_without_v1() -> None:
    assert normalize_base_url("http://h:8000") == "http://h:8000/v1"
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000/v1"
    with pytest.raises(LocalrunError, match="Invalid base URL"):
        normalize_base_url("h:8000")


def test_max_tokens_and_stop_strings(fake: FakeOpenAI) -> None:
    with load(fake) as m:
        c = m.chat([{"role": "user", "content": "a b c d e f"}], temperature=0, max_tokens=2)
        assert (c.text, c.finish_reason, c.usage.completion_tokens) == ("a b", "length", 2)
        c = m.chat([{"role": "user", "content": "a b c d e f"}], temperature=0,
                   stop=[" d"])
        assert (c.text, c.finish_reason) == ("a b c", "stop")
        assert fake.requests[-1]["stop"] == [" d"]


def test_stream_with_usage_and_raw_completion(fake: FakeOpenAI) -> None:
    with load(fake) as m:
        chunks = list(m.stream([{"role": "user", "content": "one two three four"}],
                               temperature=0))
        assert "".join(ch.text for ch in chunks) == "one two three four"
        assert len([ch for ch in chunks if ch.text]) == 4
        last = chunks[-1]
        assert last.finish_reason == "stop" and last.usage is not None
        assert last.usage.completion_tokens == 4 and last.usage.prompt_tokens == 4
        c = m.complete("x y z", temperature=0)
        assert c.text == "x y z"
        assert "prompt" in fake.requests[-1] and "messages" not in fake.requests[-1]


def test_seed_and_sampling_fields(fake: FakeOpenAI) -> None:
    with load(fake) as m:
        msgs = [{"role": "user", "content": "p q r s t u v"}]
        a = m.chat(msgs, temperature=0.8, seed=7, max_tokens=6)
        b = m.chat(msgs, temperature=0.8, seed=7, max_tokens=6)
        assert a.text == b.text
        m.chat(msgs, temperature=0.5, top_k=5, min_p=0.1, repetition_penalty=1.2, seed=1,
               top_p=0.9, max_tokens=3)
    body = fake.requests[-1]
    assert (body["top_k"], body["min_p"], body["repetition_penalty"], body["top_p"],
            body["seed"], body["max_tokens"]) == (5, 0.1, 1.2, 0.9, 1, 3)
    # neutral values of the vLLM extras are not sent (a strict OpenAI server refuses them)
    assert not {"top_k", "min_p", "repetition_penalty"} & set(fake.requests[0])


def test_connection_refused_is_typed_with_hint() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(RemoteError) as e:
        localrun.load(MODEL, backend="remote", base_url=f"http://127.0.0.1:{port}")
    assert e.value.status is None and "Cannot reach" in str(e.value)
    assert e.value.hint is not None and f"curl http://127.0.0.1:{port}/v1/models" in e.value.hint


def test_missing_base_url_says_what_to_pass() -> None:
    with pytest.raises(LocalrunError, match="needs the server's address") as e:
        localrun.load(MODEL, backend="remote")
    assert "--base-url" in str(e.value.hint)


def test_401_without_the_key() -> None:
    server = FakeOpenAI([MODEL], api_key="sekrit").start()
    try:
        with pytest.raises(RemoteAuthError) as e:
            load(server)
        assert e.value.status == 401 and "--api-key" in str(e.value.hint)
        with load(server, api_key="sekrit") as m:
            assert m.chat([{"role": "user", "content": "ok"}], temperature=0).text == "ok"
    finally:
        server.stop()


def test_unknown_model_lists_the_served_ones(fake: FakeOpenAI) -> None:
    with pytest.raises(RemoteModelNotFoundError) as e:
        load(fake, "org/other")
    assert e.value.served == [MODEL] and MODEL in str(e.value)
    # no name: the only model the server has
    with localrun.load(None, backend="remote", base_url=fake.url) as m:
        assert m.info.name == MODEL


def test_404_and_500_during_a_request(fake: FakeOpenAI) -> None:
    with load(fake) as m:
        fake.models.append("x")
        fake.models.remove(MODEL)  # the server stopped serving it after the load
        with pytest.raises(RemoteModelNotFoundError, match="does not exist"):
            m.chat([{"role": "user", "content": "hi"}])
        fake.models.append(MODEL)
        with pytest.raises(RemoteError, match="answered 500: EngineCore") as e:
            m.chat([{"role": "user", "content": "crash now"}])
        assert e.value.status == 500
        # the model stays usable after an error
        assert m.chat([{"role": "user", "content": "fine"}], temperature=0).text == "fine"


def test_server_context_overflow_is_context_overflow_error(fake: FakeOpenAI) -> None:
    with load(fake) as m:
        with pytest.raises(ContextOverflowError) as e:
            m.chat([{"role": "user", "content": "w " * 70}], max_tokens=10)
        assert (e.value.prompt_tokens, e.value.context) == (70, 64)
        # a prompt that fits with a max_tokens that does not: the reply stops at the
        # context's end, as on the local engines (the default max_tokens is 1024 here)
        c = m.chat([{"role": "user", "content": "w " * 60}], temperature=0.5, seed=1)
        assert (c.finish_reason, c.usage.completion_tokens) == ("length", 4)
        assert fake.requests[-1]["max_tokens"] == 4


def cancel_after(stream: localrun.Stream, n: int) -> list[localrun.Chunk]:
    """The chunks of ``stream``, cancelled once ``n`` have come."""
    got = []
    for ch in stream:
        got.append(ch)
        if len(got) == n:
            stream.cancel()
    return got


def disconnects(server: FakeOpenAI, within: float = 10.0) -> int:
    """The clients the server saw go, once it has seen one (or ``within`` seconds)."""
    deadline = time.monotonic() + within
    while not server.disconnects and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.disconnects


def test_cancel_closes_the_connection() -> None:
    server = FakeOpenAI([MODEL], max_model_len=4096, token_delay=0.05).start()
    try:
        with load(server) as m:
            got = cancel_after(m.stream([{"role": "user", "content": "w " * 200}],
                                        temperature=0, max_tokens=200), 3)
            assert got[-1].finish_reason == "cancelled"
            assert len(got) < 10
        assert disconnects(server) == 1  # the server saw the client go, and stops
    finally:
        server.stop()


def test_request_body_leaves_neutral_extras_out() -> None:
    from localrun.backends.remote.session import RemotePrompt, ServerTokens
    from localrun.sampling import ResolvedSampling

    s = ResolvedSampling(max_tokens=5, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                         repetition_penalty=1.0, seed=None, stop=())
    body = request_body("m", RemotePrompt(ServerTokens(), "hi", None), s)
    assert body["prompt"] == "hi" and "seed" not in body and "stop" not in body
    assert "top_k" not in body and "min_p" not in body


def test_against_localrun_serve() -> None:
    """`remote` pointed at a real `localrun serve` serving the SmolLM2 GGUF fixture: the
    same greedy answer, usage and stop handling as the model loaded here."""
    serverutil = pytest.importorskip("tests.serverutil")
    from tests.conftest import HAVE_LLAMA
    from tests.models import test_model

    if not HAVE_LLAMA:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llama-cpp]')")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    with localrun.load(str(test_model("gguf-q4_1")), backend="llama.cpp", context=2048,
                       threads=1) as local:
        want = local.chat(msgs, temperature=0, max_tokens=12)
        with serverutil.serve(preload={"smol": local}) as srv:
            with localrun.load("smol", backend="remote", base_url=srv.url) as m:
                assert m.info.context_length == 2048
                c = m.chat(msgs, temperature=0, max_tokens=12)
                chunks = list(m.stream(msgs, temperature=0, max_tokens=12, stop=["Paris"]))
                # JSON Schema: sent as response_format, enforced by the server's engine
                schema = {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}
                js = m.chat(msgs, temperature=0, max_tokens=40, schema=schema)
                assert isinstance(js.parsed, dict) and set(js.parsed) == {"city"}
                # tools: the server's own support (localrun serve constrains a forced
                # call); its streamed deltas become ToolCallDelta, the calls ToolCall
                tools = [{"type": "function", "function": {
                    "name": "capital", "description": "The capital of a country",
                    "parameters": {"type": "object", "properties": {
                        "country": {"type": "string"}}, "required": ["country"]}}}]
                tc = list(m.stream(msgs, tools=tools, tool_choice="capital", temperature=0,
                                   max_tokens=40))
                want_tc = local.chat(msgs, tools=tools, tool_choice="capital", temperature=0,
                                     max_tokens=40)
                with pytest.raises(TokenCountUnavailableError):
                    m.count_tokens("Paris")  # localrun serve has no /tokenize
            with pytest.raises(RemoteModelNotFoundError):
                localrun.load("nope", backend="remote", base_url=srv.url).chat(msgs)
    assert c.text == want.text and c.usage == want.usage and c.finish_reason == "length"
    assert chunks[-1].usage == want.usage.__class__(want.usage.prompt_tokens,
                                                     chunks[-1].usage.completion_tokens)
    assert "".join(ch.text for ch in chunks) == want.text.split("Paris")[0]
    deltas = [d for ch in tc for d in ch.tool_calls]
    assert deltas[0].name == "capital" and tc[-1].finish_reason == "tool_calls"
    assert "".join(d.arguments for d in deltas) == want_tc.tool_calls[0].arguments


def test_cli_run_with_base_url(fake: FakeOpenAI) -> None:
    """`localrun run MODEL --base-url URL` answers through the server; a server that is
    not there is one line with the next step, exit code 1, no traceback."""
    from tests.test_cli import cli

    r = cli("run", MODEL, "--base-url", fake.url, "--temperature", "0", "red green blue")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "red green blue"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = cli("run", MODEL, "--base-url", f"http://127.0.0.1:{port}", "hi")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"Cannot reach http://127.0.0.1:{port}/v1" in r.stderr
    r = cli("run", MODEL, "--base-url", fake.url, "--backend", "llama.cpp", "hi")
    assert r.returncode != 0 and "--backend remote" in r.stderr


def test_schema_goes_as_response_format(fake: FakeOpenAI) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    from localrun.errors import StructuredOutputError

    with load(fake) as m, pytest.raises(StructuredOutputError):
        # the stand-in ignores the schema and echoes words: localrun's own check of the
        # reply against the schema fails, as it must for a server that did not enforce it
        m.chat([{"role": "user", "content": "not json"}], schema=schema, temperature=0)
    fmt = fake.requests[-1]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"]["properties"] == schema["properties"]


def test_batch_runs_as_concurrent_requests() -> None:
    """16 items through Model.batch: concurrent requests the server batches (vLLM's
    continuous batching), each answer its own, in input order."""
    server = FakeOpenAI([MODEL], max_model_len=256, token_delay=0.05).start()
    try:
        with load(server) as m:
            items = [[{"role": "user", "content": f"w{i} a b c"}] for i in range(16)]
            results = m.batch(items, temperature=0, max_concurrency=8)
        assert [r.text for r in results] == [f"w{i} a b c" for i in range(16)]
        assert all(r.usage.completion_tokens == 4 for r in results)
        assert 2 <= server.most_active <= 8
    finally:
        server.stop()


# -- concurrency and cancellation (Session.batcher: one request per sequence) -------------


def _collect(m: localrun.Model, words: str, out: list[str], i: int) -> None:
    out[i] = "".join(ch.text for ch in m.stream([{"role": "user", "content": words}],
                                                temperature=0, max_tokens=64))


def test_streams_from_several_threads_run_at_once() -> None:
    """Model.stream() from six threads: six requests in flight together (the driver's
    scheduler sends them through the session's batcher), not one after another."""
    server = FakeOpenAI([MODEL], max_model_len=256, token_delay=0.05).start()
    try:
        with load(server) as m:
            out = [""] * 6
            words = [" ".join(f"w{i}x{j}" for j in range(16)) for i in range(6)]
            threads = [threading.Thread(target=_collect, args=(m, words[i], out, i))
                       for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert out == words
        assert server.most_active >= 4  # one at a time would be 1
    finally:
        server.stop()


def test_cancelling_one_stream_leaves_the_others() -> None:
    server = FakeOpenAI([MODEL], max_model_len=256, token_delay=0.05).start()
    try:
        with load(server) as m:
            out = [""] * 3
            words = " ".join(f"v{j}" for j in range(12))
            threads = [threading.Thread(target=_collect, args=(m, words, out, i))
                       for i in range(3)]
            for t in threads:
                t.start()
            got = cancel_after(m.stream([{"role": "user", "content": "c " * 100}],
                                        temperature=0, max_tokens=100), 2)
            for t in threads:
                t.join(60)
        assert got[-1].finish_reason == "cancelled" and len(got) < 10
        assert out == [words] * 3
        assert disconnects(server) == 1
    finally:
        server.stop()


def test_cancel_shuts_a_waiting_request_down() -> None:
    """A request the server holds (queued behind others: no event for 20 s): cancelling
    it ends the stream at once, and the server sees the connection close then, not when
    it would next have written."""
    server = FakeOpenAI([MODEL], max_model_len=256, first_delay=20).start()
    try:
        with load(server) as m:
            stream = m.stream([{"role": "user", "content": "a b c"}], temperature=0)
            threading.Timer(0.5, stream.cancel).start()
            t0 = time.monotonic()
            chunks = list(stream)
            assert chunks[-1].finish_reason == "cancelled"
            assert time.monotonic() - t0 < 5
            assert disconnects(server, within=5) == 1
            server.first_delay = 0  # the Model stays usable
            assert m.chat([{"role": "user", "content": "ok then"}], temperature=0).text == \
                "ok then"
    finally:
        server.stop()


# -- tools: the server's own tool support ---------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} of a place",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                   "required": ["q"]}}} for name in ("weather", "time")]


def test_tool_calls_stream_back_as_tool_call_deltas(fake: FakeOpenAI) -> None:
    """tools/tool_choice go to the server as OpenAI's fields; its streamed tool-call
    deltas come back as ToolCallDelta (argument fragments as they came) and the whole
    calls as Completion.tool_calls."""
    msgs = [{"role": "user", "content": "weather and time in Oslo"}]
    with load(fake) as m:
        chunks = list(m.stream(msgs, tools=TOOLS, temperature=0))
        body = fake.requests[-1]
        # strict: the server constrains the arguments to the schema, as localrun does
        assert body["tools"] == [{"type": "function", "function": {**t["function"],
                                                                   "strict": True}}
                                 for t in TOOLS]
        assert body["tool_choice"] == "auto"
        assert "response_format" not in body
        deltas = [d for ch in chunks for d in ch.tool_calls]
        assert [(d.index, d.name) for d in deltas if d.name] == [(0, "weather"), (1, "time")]
        for i in (0, 1):
            assert "".join(d.arguments for d in deltas if d.index == i) == '{"q": "Oslo"}'
        assert len([d for d in deltas if d.index == 0]) > 2  # fragments, not one piece
        assert "".join(ch.text for ch in chunks).strip() == "Checking."
        assert chunks[-1].finish_reason == "tool_calls"
        c = m.chat(msgs, tools=TOOLS, temperature=0)
        assert [(t.name, t.parsed) for t in c.tool_calls] == [("weather", {"q": "Oslo"}),
                                                             ("time", {"q": "Oslo"})]
        assert c.text == "Checking." and c.finish_reason == "tool_calls"


def test_forced_tool_choice_goes_as_the_servers(fake: FakeOpenAI) -> None:
    msgs = [{"role": "user", "content": "anything at all"}]
    with load(fake) as m:
        c = m.chat(msgs, tools=TOOLS, tool_choice="time", temperature=0)
        assert fake.requests[-1]["tool_choice"] == {"type": "function",
                                                    "function": {"name": "time"}}
        assert [(t.name, t.parsed) for t in c.tool_calls] == [("time", {"q": "all"})]
        c = m.chat(msgs, tools=TOOLS, tool_choice="required", temperature=0)
        assert fake.requests[-1]["tool_choice"] == "required"
        assert [t.name for t in c.tool_calls] == ["weather"]
        # "none": no tools sent, a plain reply
        c = m.chat(msgs, tools=TOOLS, tool_choice="none", temperature=0)
        assert "tools" not in fake.requests[-1] and c.text == "anything at all"


def test_tool_turns_go_back_in_openais_shape(fake: FakeOpenAI) -> None:
    with load(fake) as m:
        first = m.chat([{"role": "user", "content": "weather in Rome"}], tools=TOOLS,
                       temperature=0)
        call = first.tool_calls[0]
        msgs = [{"role": "user", "content": "weather in Rome"},
                {"role": "assistant", "content": None, "tool_calls": [call.to_dict()]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
                {"role": "user", "content": "thanks"}]
        c = m.chat(msgs, tools=TOOLS, temperature=0)
    sent = fake.requests[-1]["messages"]
    assert sent[1]["tool_calls"] == [{"id": call.id, "type": "function", "function": {
        "name": "weather", "arguments": '{"q": "Rome"}'}}]
    assert sent[2]["role"] == "tool" and sent[2]["tool_call_id"] == call.id
    assert sent[2]["content"] == "sunny" and c.text == "Checking." and not c.tool_calls


def test_auto_tools_on_a_server_without_a_parser_says_how() -> None:
    server = FakeOpenAI([MODEL], auto_tools=False).start()
    try:
        with load(server) as m:
            with pytest.raises(RemoteError) as e:
                m.chat([{"role": "user", "content": "weather"}], tools=TOOLS)
            assert e.value.status == 400 and "--tool-call-parser" in str(e.value.hint)
            c = m.chat([{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="weather")
            assert c.tool_calls[0].name == "weather"
    finally:
        server.stop()


def test_count_tokens_asks_the_servers_tokenizer() -> None:
    server = FakeOpenAI([MODEL]).start()
    bare = FakeOpenAI([MODEL], tokenize=False).start()
    try:
        with load(server) as m:
            assert m.count_tokens("one two three four") == 4
            assert server.requests[-1] == {"model": MODEL, "prompt": "one two three four"}
        with load(bare) as m, pytest.raises(TokenCountUnavailableError) as e:
            m.count_tokens("one two")
        assert e.value.status == 404 and "/tokenize" in str(e.value)
        assert e.value.hint is not None and "count_tokens" in e.value.hint
    finally:
        server.stop()
        bare.stop()


def test_localrun_serve_in_front_of_a_remote_runs_requests_together() -> None:
    """`localrun serve --parallel 4` serving a `remote` Model: the requests it admits
    together reach the server behind it together (the session's batcher, whose capacity
    is Model.max_concurrency), not in turn."""
    serverutil = pytest.importorskip("tests.serverutil")
    from localrun.server.config import ServerConfig

    upstream = FakeOpenAI([MODEL], max_model_len=256, token_delay=0.05).start()
    try:
        words = [" ".join(f"s{i}y{j}" for j in range(12)) for i in range(4)]
        out: list[str] = [""] * 4
        with load(upstream) as m, \
                serverutil.serve(ServerConfig(parallel=4), preload={"up": m}) as srv:

            def ask(i: int) -> None:
                _, _, body = serverutil.request("POST", srv.v1 + "/chat/completions", {
                    "model": "up", "temperature": 0,
                    "messages": [{"role": "user", "content": words[i]}]})
                out[i] = json.loads(body)["choices"][0]["message"]["content"]

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert out == words
        assert upstream.most_active >= 3
    finally:
        upstream.stop()
