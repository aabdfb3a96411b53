"""`localrun ps` and `localrun stop NAME` against a real `localrun serve` (issue 31 item 1).

The server runs in this process on 127.0.0.1 (tests/serverutil.py) with the embedded
SmolLM2-135M pinned (as if named on serve's command line) and loads a second model, the
Q8_0 fixture, by path on request, as a client would; the commands run as real processes.
`stop` unloads the second (the server then no longer lists it) and says so when the server
keeps the pinned one; no server and a bad key are one line and a hint, and the key never
shows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localrun.control import server_url
from tests.conftest import localrun_cmd, requires_llama

serverutil = pytest.importorskip("tests.serverutil", reason="the serve extra is not installed")

KEY = "s3cret-k3y-never-printed"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("LOCALRUN_API_KEY", "LOCALRUN_HOST", "LOCALRUN_DEBUG")}
    return subprocess.run([*localrun_cmd(), *args], capture_output=True, text=True,
                          timeout=120, env={**base, "COLUMNS": "200", **(env or {})})


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1]


def listed(url: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    status, _, body = serverutil.request("GET", url + "/api/ps", headers=headers)
    assert status == 200, body
    return list(json.loads(body)["models"])


@pytest.fixture(scope="module")
def srv(llama_model: Any) -> Iterator[Any]:
    from localrun.server.config import ServerConfig

    config = ServerConfig(backend="llama.cpp", allow_local_paths=True, keep_alive=600.0)
    with serverutil.serve(config, preload={"smollm2:135m": llama_model}) as s:
        yield s


@requires_llama
def test_ps_shows_the_loaded_models_and_stop_unloads_one(srv: Any) -> None:
    from tests.models import test_model

    q8 = str(test_model("gguf-q8_0"))
    status, _, body = serverutil.request("POST", srv.url + "/api/generate",
                                         {"model": q8, "keep_alive": "10m"})
    assert status == 200, body  # Ollama's load: a request with no prompt
    port = port_of(srv.url)

    r = cli("ps", "--port", port)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["name", "engine", "device", "memory", "context", "unloads",
                                "busy"]
    row = next(line for line in lines if line.lstrip().startswith(q8))
    assert row.split()[1:3] == ["llama.cpp", "cpu"] and "in 10 min" in row and "idle" in row
    pinned = next(line for line in lines if line.lstrip().startswith("smollm2:135m"))
    assert "never" in pinned and "2048" in pinned

    r = cli("ps", "--json", env={"LOCALRUN_HOST": f"127.0.0.1:{port}"})
    assert r.returncode == 0, r.stderr
    rows = {d["name"]: d for d in map(json.loads, r.stdout.splitlines())}
    assert set(rows) == {q8, "smollm2:135m"}
    mine = rows[q8]
    assert (mine["backend"], mine["device"], mine["format"], mine["quantization"]) == (
        "llama.cpp", "cpu", "gguf", "Q8_0")
    assert mine["size"] > 100 * 2**20 and mine["context_length"] >= 2048
    assert 500 < mine["expires_in"] <= 600 and rows["smollm2:135m"]["expires_in"] is None

    before = len(srv.manager.models)
    r = cli("stop", q8, "--port", port, "--json")
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout)
    assert (done["unloaded"], done["outcome"]) == (True, "unloaded")
    assert done["freed_bytes"] == mine["size"]
    assert [m["name"] for m in listed(srv.url)] == ["smollm2:135m"]
    assert len(srv.manager.models) == before - 1  # the server let go of it

    r = cli("stop", q8, "--port", port)  # not loaded any more
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines()[0] == (f"error: No model named {q8!r} is loaded at "
                                        f"{srv.url} (loaded: smollm2:135m)")


@requires_llama
def test_stop_says_when_the_server_keeps_a_pinned_model(srv: Any) -> None:
    r = cli("stop", "smollm2:135m", "--port", port_of(srv.url))
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert lines == [
        "error: smollm2:135m stays loaded: it was named on localrun serve's command line, "
        "and those models stay until the server stops",
        "  hint: restart localrun serve without it to free its memory"]
    assert "smollm2:135m" in [m["name"] for m in listed(srv.url)]
    r = cli("stop", "smollm2:135m", "--port", port_of(srv.url), "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["outcome"] == "pinned"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_server_is_one_line_and_the_hint_to_start_one() -> None:
    port = _free_port()
    for args, env in (((("ps", "--port", str(port))), None),
                      (("stop", "x"), {"LOCALRUN_HOST": f"http://127.0.0.1:{port}"})):
        r = cli(*args, env=env)
        assert r.returncode == 1 and r.stdout == "", r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 2 and "Traceback" not in r.stderr
        assert lines[0] == (f"error: No localrun server at http://127.0.0.1:{port} "
                            "(Connection refused)")
        assert lines[1].lstrip().startswith("hint: start one: localrun serve")


def test_a_server_with_a_key_asks_for_it_and_the_key_never_shows(tmp_path: Path) -> None:
    from localrun.server.config import ServerConfig

    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    with serverutil.serve(ServerConfig(api_key=KEY)) as s:
        port = port_of(s.url)
        r = cli("ps", "--port", port)
        assert r.returncode == 1
        assert r.stderr.startswith(f"error: {s.url} needs an API key")
        assert "hint: set LOCALRUN_API_KEY" in r.stderr and "--api-key-file" in r.stderr
        r = cli("ps", "--port", port, env={"LOCALRUN_API_KEY": "wrong-key-also-secret"})
        assert r.returncode == 1
        assert r.stderr.startswith(f"error: {s.url} refused the API key sent")
        assert "wrong-key-also-secret" not in r.stderr + r.stdout
        r = cli("ps", "--port", port, "--api-key-file", str(key_file), "--json")
        assert (r.returncode, r.stdout) == (0, ""), r.stderr
        r = cli("ps", "--port", port, env={"LOCALRUN_API_KEY": KEY})
        assert r.returncode == 0 and "No models loaded at" in r.stderr
        assert KEY not in r.stdout + r.stderr


@pytest.mark.parametrize(("host", "port", "env", "url"), [
    (None, None, None, "http://127.0.0.1:8799"),
    (None, 9000, None, "http://127.0.0.1:9000"),
    (None, None, "0.0.0.0", "http://127.0.0.1:8799"),
    (None, None, ":9001", "http://127.0.0.1:9001"),
    (None, None, "box.lan:11", "http://box.lan:11"),
    (None, None, "https://llm.example.com/", "https://llm.example.com:443"),
    (None, None, "http://[::1]:7", "http://[::1]:7"),
    ("10.0.0.2", None, "box.lan:11", "http://10.0.0.2:8799"),
    ("[::1]:5", 6, None, "http://[::1]:6"),
])
def test_the_address_reads_as_ollama_host_does(monkeypatch: pytest.MonkeyPatch,
                                               host: str | None, port: int | None,
                                               env: str | None, url: str) -> None:
    if env is None:
        monkeypatch.delenv("LOCALRUN_HOST", raising=False)
    else:
        monkeypatch.setenv("LOCALRUN_HOST", env)
    assert server_url(host, port) == url
