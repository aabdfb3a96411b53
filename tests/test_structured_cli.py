"""``--schema FILE`` and ``--json-object`` on run, chat and generate (issue 13), as a user
runs them: real processes, the embedded SmolLM2-135M on llama.cpp.

``run --json`` already prints the Completion as JSON, so the JSON-reply flag is
``--json-object`` (OpenAI's ``response_format={"type": "json_object"}``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import localrun_cmd, requires_llama

FLAGS = ("--backend", "llama.cpp", "--context", "1024", "-t", "0")
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"]}


def cli(*args: str, stdin: str | None = None, timeout: float = 300
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*localrun_cmd(), *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture()
def person(tmp_path: Path) -> Path:
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON), encoding="utf-8")
    return path


@requires_llama
def test_run_schema_prints_json_that_validates(person: Path, default_gguf: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    r = cli("run", str(default_gguf), "Ann is 31. Give her name and age.", "--schema",
            str(person), *FLAGS, "-n", "40")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    jsonschema.validate(data, PERSON)
    r = cli("run", str(default_gguf), "Ann is 31.", "--schema", str(person), "--json",
            *FLAGS, "-n", "40")
    out: dict[str, Any] = json.loads(r.stdout)
    assert out["parsed"] == json.loads(out["text"]) and out["finish_reason"] == "stop"


@requires_llama
def test_run_json_object_and_cut_short_reply(person: Path, default_gguf: Path) -> None:
    r = cli("run", str(default_gguf), "Describe a cat.", "--json-object", *FLAGS, "-n", "8")
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout), dict)
    r = cli("run", str(default_gguf), "Ann is 31.", "--schema", str(person), *FLAGS, "-n", "3")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert any("before its JSON was complete" in ln for ln in lines), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not JSON"),
    ('{"type": "array", "uniqueItems": true}', "uniqueItems"),
])
def test_bad_schema_files_fail_before_loading(tmp_path: Path, content: str, message: str
                                              ) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content, encoding="utf-8")
    # a model that does not exist: the flag must fail first
    r = cli("run", str(tmp_path / "no-such.gguf"), "hi", "--schema", str(bad))
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr
    r = cli("run", "x", "hi", "--schema", str(tmp_path / "missing.json"))
    assert r.returncode == 1 and "Cannot read --schema" in r.stderr
    r = cli("run", "x", "hi", "--schema", str(bad), "--json-object")
    assert r.returncode == 1 and "--json-object" in r.stderr


@requires_llama
def test_chat_and_generate_take_the_schema(person: Path, default_gguf: Path,
                                           tmp_path: Path) -> None:
    r = cli("chat", str(default_gguf), "--schema", str(person), *FLAGS, "-n", "40",
            stdin="Ann is 31.")
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)) == {"name", "age"}
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in
                           enumerate(["Ann is 31.", "Bob is 40."])), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    r = cli("generate", str(default_gguf), "-i", str(inp), "-o", str(out), "--schema",
            str(person), "--no-progress", *FLAGS, "-n", "40")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 2 and all(set(json.loads(row["text"])) == {"name", "age"}
                                  for row in rows)
