"""Bad input is the client's mistake, never the server's (issue 24, item 7; item 9's empty
model name): a 400 in the dialect's shape and a server that goes on answering; in the
library a LocalrunError; in the CLI one line and a hint, never "this is a bug"."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from localrun.errors import LocalrunError
from localrun.server.config import ServerConfig
from tests.conftest import localrun_cmd
from tests.serverutil import MODEL, Running, request, server_fixtures
from tests.test_gguf import deep_array_gguf

server_model, srv = server_fixtures(ServerConfig())

LONG_NAME = "a" * 300  # a file name longer than any file system takes (ENAMETOOLONG)
SURROGATE = '"a\\ud800b"'  # JSON text: a lone surrogate escape, no Unicode character
DIGITS = "1" * 5000  # past Python's 4300-digit int limit


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _deep_schema(levels: int) -> str:
    """A JSON Schema whose objects nest ``levels`` deep (two JSON levels each)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' \
        + "}}" * levels


def _openai_chat(content: str = '"hi"', model: str = json.dumps(MODEL), extra: str = "") -> str:
    return (f'{{"model": {model}, "max_tokens": 2, "messages": [{{"role": "user", '
            f'"content": {content}}}]{extra}}}')


def _openai_completion(prompt: str = '"hi"', model: str = json.dumps(MODEL),
                       extra: str = "") -> str:
    return f'{{"model": {model}, "max_tokens": 2, "prompt": {prompt}{extra}}}'


def _ollama_chat(content: str = '"hi"', model: str = json.dumps(MODEL), extra: str = "") -> str:
    return (f'{{"model": {model}, "stream": false, "options": {{"num_predict": 2}}, '
            f'"messages": [{{"role": "user", "content": {content}}}]{extra}}}')


def _ollama_generate(prompt: str = '"hi"', model: str = json.dumps(MODEL),
                     extra: str = "") -> str:
    return (f'{{"model": {model}, "stream": false, "options": {{"num_predict": 2}}, '
            f'"prompt": {prompt}{extra}}}')


#: (name, route, raw JSON body, a word the error names) for every bad input of item 7
CASES: list[tuple[str, str, str, str]] = [
    ("long-name", "/v1/chat/completions", _openai_chat(model=json.dumps(LONG_NAME)),
     "too long"),
    ("long-name", "/v1/completions", _openai_completion(model=json.dumps(LONG_NAME)),
     "too long"),
    ("long-name", "/api/chat", _ollama_chat(model=json.dumps(LONG_NAME)), "too long"),
    ("long-name", "/api/generate", _ollama_generate(model=json.dumps(LONG_NAME)), "too long"),
    ("long-name", "/api/show", json.dumps({"model": LONG_NAME}), "not found"),
    ("surrogate", "/v1/chat/completions", _openai_chat(SURROGATE), "messages[0].content"),
    ("surrogate", "/v1/completions", _openai_completion(SURROGATE), "prompt"),
    ("surrogate", "/api/chat", _ollama_chat(SURROGATE), "messages[0].content"),
    ("surrogate", "/api/generate", _ollama_generate(SURROGATE), "prompt"),
    ("surrogate", "/v1/embeddings", f'{{"model": "m", "input": [{SURROGATE}]}}', "input[0]"),
    ("nested", "/v1/chat/completions", _openai_chat(_nested(1100)), "nested"),
    ("nested", "/v1/completions", _openai_completion(_nested(5000)), "nested"),
    ("nested", "/api/chat", _ollama_chat(_nested(1100)), "nested"),
    ("nested", "/api/generate", _ollama_generate(_nested(100_000)), "nested"),
    ("schema", "/v1/chat/completions", _openai_chat(extra=', "response_format": {"type": '
     f'"json_schema", "json_schema": {{"name": "x", "schema": {_deep_schema(500)}}}}}'),
     "nested"),
    ("schema", "/api/chat", _ollama_chat(extra=f', "format": {_deep_schema(500)}'), "nested"),
    # within the body's limit, past the schema's: refused by the library's own check
    ("schema-50", "/v1/chat/completions", _openai_chat(extra=', "response_format": {"type": '
     f'"json_schema", "json_schema": {{"name": "x", "schema": {_deep_schema(50)}}}}}'),
     "nested"),
    ("schema-50", "/api/generate", _ollama_generate(extra=f', "format": {_deep_schema(50)}'),
     "nested"),
    ("digits", "/v1/chat/completions", _openai_chat(extra=f', "seed": {DIGITS}'), "digits"),
    ("digits", "/v1/completions", _openai_completion(extra=f', "max_tokens": {DIGITS}'),
     "digits"),
    ("digits", "/api/chat", _ollama_chat(extra=f', "keep_alive": {DIGITS}'), "digits"),
    ("digits", "/api/generate", _ollama_generate(extra=f', "x": [-{DIGITS}]'), "digits"),
]


@pytest.mark.parametrize(("kind", "route", "body", "named"), CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_input_is_a_400_in_the_dialects_shape(srv: Running, kind: str, route: str,
                                                  body: str, named: str) -> None:
    status, _, raw = request("POST", srv.url + route, body.encode("utf-8"))
    answer = json.loads(raw)
    # /api/show answers every name it cannot read as one it does not have
    assert status == (404 if route == "/api/show" else 400), (status, raw[:300])
    if route.startswith("/api/"):
        assert set(answer) == {"error"} and isinstance(answer["error"], str)
        message = answer["error"]
    else:
        err = answer["error"]
        assert err["type"] == "invalid_request_error" and set(err) == {
            "message", "type", "param", "code"}
        message = err["message"]
    assert named in message, message
    assert "Traceback" not in message and len(message) < 600
    # the server is still up and still serves
    assert request("GET", srv.url + "/health")[0] == 200


def test_the_server_still_answers_after_all_of_them(srv: Running) -> None:
    for _, route, body, _ in CASES:
        request("POST", srv.url + route, body.encode("utf-8"))
    status, _, raw = request("POST", srv.url + "/v1/chat/completions",
                             {"model": MODEL, "max_tokens": 2, "temperature": 0,
                              "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200, raw[:300]
    assert request("GET", srv.url + "/health")[0] == 200


def test_a_surrogate_pair_is_text_and_runs(srv: Running) -> None:
    """The check refuses lone halves only: an escaped pair (an emoji) is a character."""
    body = _openai_chat('"\\ud83d\\ude00 hi"')
    status, _, raw = request("POST", srv.url + "/v1/chat/completions", body.encode())
    assert status == 200, raw[:300]


def test_the_body_reader_names_its_limits() -> None:
    """The limits are stated in the message (a client can fix the request)."""
    from localrun.server.errors import APIError
    from localrun.server.params import MAX_DEPTH, MAX_INT_DIGITS, parse_body

    assert parse_body(_openai_chat(_nested(MAX_DEPTH - 4)).encode())  # within the limit
    with pytest.raises(APIError, match=f"nested more than {MAX_DEPTH} levels"):
        parse_body(_openai_chat(_nested(MAX_DEPTH)).encode())
    with pytest.raises(APIError, match=f"5000 digits.*{MAX_INT_DIGITS}"):
        parse_body(_openai_chat(extra=f', "seed": {DIGITS}').encode())
    assert parse_body(b'{"seed": 18446744073709551615}') == {"seed": 2**64 - 1}
    with pytest.raises(APIError, match=r"'messages\[0\]\.content'.*surrogate") as info:
        parse_body(_openai_chat(SURROGATE).encode())
    assert info.value.param == "messages[0].content"
    with pytest.raises(APIError, match=r"a key of 'metadata'"):
        parse_body(b'{"metadata": {"a\\udfffb": 1}}')


# -- the library ------------------------------------------------------------------------


@pytest.mark.parametrize("name", [LONG_NAME, "x/" * 3000 + "m.gguf", "~no-such-user-x/m.gguf"])
def test_unusable_names_are_localrun_errors(name: str) -> None:
    from localrun.naming.refs import local_path, parse_ref

    with pytest.raises(LocalrunError, match="model name"):
        parse_ref(name)
    with pytest.raises(LocalrunError, match="model name"):
        local_path(name)


@pytest.mark.parametrize("name", ["", "   "])
def test_an_empty_name_names_nothing(name: str) -> None:
    """Not the current folder (Path("") is ".")."""
    from localrun.naming.refs import local_path, parse_ref

    with pytest.raises(LocalrunError, match="empty"):
        local_path(name)
    with pytest.raises(LocalrunError, match="empty"):
        parse_ref(name)


def test_a_schema_nested_too_deep_names_the_depth() -> None:
    from localrun.structured.schema import MAX_SCHEMA_DEPTH, output_spec

    deep: dict[str, Any] = {"type": "string"}
    for _ in range(500):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(LocalrunError, match=f"nested deeper than {MAX_SCHEMA_DEPTH}"):
        output_spec(schema=deep)
    with pytest.raises(LocalrunError, match="nested deeper"):
        output_spec({"type": "json_schema", "json_schema": {"name": "d", "schema": deep}})
    from localrun.structured.functions import normalize_tools

    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    with pytest.raises(LocalrunError, match=f"tools\\[0\\].*nested deeper than {MAX_SCHEMA_DEPTH}"):
        normalize_tools([tool])
    fine: dict[str, Any] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH // 2 - 1):
        fine = {"type": "object", "properties": {"a": fine}}
    assert output_spec(schema=fine) is not None


def test_lone_surrogates_in_python_calls_are_localrun_errors(llama_model: Any) -> None:
    m = llama_model
    with pytest.raises(LocalrunError, match=r"message 0.*surrogate"):
        m.chat([{"role": "user", "content": "a\ud800b"}], max_tokens=2)
    with pytest.raises(LocalrunError, match="surrogate"):
        m.complete("a\udc80b", max_tokens=2)
    with pytest.raises(LocalrunError, match="surrogate"):
        m.batch(["fine", "a\ud800b"], max_tokens=2)
    assert m.chat("\U0001F600 hi", max_tokens=2, temperature=0).text is not None


# -- the CLI ------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*localrun_cmd(), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _one_line_error(r: subprocess.CompletedProcess[str], *words: str) -> str:
    assert r.returncode != 0, r.stderr
    assert "bug" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: "), r.stderr
    assert lines[1].strip().startswith("hint: "), r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    return lines[0]


def test_cli_plan_with_a_binary_file_as_hardware(default_gguf: Path, tmp_path: Path) -> None:
    line = _one_line_error(_cli("plan", "smollm2:135m", "--no-hub", "--hardware",
                                str(default_gguf)), "localrun doctor --json")
    assert "not a hardware profile" in line.lower() and default_gguf.name in line
    text = tmp_path / "notes.txt"
    text.write_text("my laptop: 16 GB\n", encoding="utf-8")
    line = _one_line_error(_cli("plan", "smollm2:135m", "--no-hub", "--hardware", str(text)),
                           "localrun doctor --json")
    assert "not a hardware profile" in line.lower() and "notes.txt" in line
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    line = _one_line_error(_cli("plan", "smollm2:135m", "--no-hub", "--hardware", str(deep)),
                           "localrun doctor --json")
    assert "deep.json" in line


def test_cli_plan_with_a_deeply_nested_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "deep.gguf"
    bad.write_bytes(deep_array_gguf(5000))
    _one_line_error(_cli("plan", str(bad), "--no-hub"), "nested", "deep.gguf")


@pytest.mark.parametrize("args", [["pull", ""], ["plan", "", "--no-hub"], ["pull", "  "],
                                  ["plan", "a" * 300, "--no-hub"]])
def test_cli_empty_or_unusable_model_names(args: list[str]) -> None:
    line = _one_line_error(_cli(*args))
    assert "Cannot use model file ." not in line
    assert "empty" in line or "too long" in line
