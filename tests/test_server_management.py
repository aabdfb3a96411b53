"""Managing models on a running server (issue 31 phase 2), against the real server and
engine (llama.cpp, the embedded SmolLM2-135M, served in this process on 127.0.0.1).

- A preset is its model plus per-request defaults: its requests share its model's copy
  (loads are counted: one copy where the context is the same), and each request gets its
  own system prompt, whichever came first and whether the preset or the model was named
  on serve's command line (prompt token counts against the library's own count).
- Ollama's ``/api/create`` → ``/api/copy`` → ``/api/delete`` with the official ``ollama``
  client, each visible in ``/api/tags``; bad input refused with the reason.
- Loading and unloading ahead of a request: Ollama's way (no prompt / no messages,
  ``keep_alive`` 0) for presets too, and ``POST /models/load``/``/models/unload``
  (llama-server's router mode, also under ``/v1``): memory goes down (``/api/ps``),
  pinned models stay (409), names that would download need ``--allow-pull``.
- ``/api/delete`` of a pulled model follows ``localrun rm``'s rules and deletes only what
  localrun pulled under that name (the stand-in Hub, tests/hubserver.py), behind
  ``--allow-delete`` or an API key.
- ``localrun serve PRESET`` with ``LOCALRUN_HOST``; ``localrun ps`` shows it pinned.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localrun.naming import presets
from tests.conftest import localrun_cmd, requires_llama

serverutil = pytest.importorskip("tests.serverutil", reason="the serve extra is not "
                                 "installed (pip install -e '.[serve]')")

from localrun.server.config import ServerConfig  # noqa: E402
from localrun.server.manager import ModelManager, _load_chat  # noqa: E402
from localrun.server.metrics import Metrics  # noqa: E402
from tests.serverutil import WAIT, request, serve  # noqa: E402

BASE = "smollm2:135m"  # the embedded model (installed in place: no download)
SYSTEM = ("You are Captain Hook, a pirate who answers every question in exactly one "
          "short sentence, always mentioning the sea.")
USER = {"role": "user", "content": "Where is the gold?"}
CONFIG = ServerConfig(backend="llama.cpp", parallel=1, context=2048)


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private localrun home (presets.json) and Hugging Face cache, offline."""
    h = tmp_path / "home"
    monkeypatch.setenv("LOCALRUN_HOME", str(h))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return h


@pytest.fixture(scope="module")
def counts(llama_model: Any) -> dict[str, int]:
    """The library's own prompt token counts: the user turn alone, and opened by the
    preset's system prompt."""
    sys_turn = {"role": "system", "content": SYSTEM}
    return {"plain": llama_model.count_prompt_tokens([USER]),
            "hook": llama_model.count_prompt_tokens([sys_turn, USER])}


def counting() -> tuple[list[tuple[str, int | None]], ModelManager]:
    """A manager whose loads (the real loader) are counted."""
    loads: list[tuple[str, int | None]] = []

    def load(name: str, config: Any, context: int | None, target: Any = None) -> Any:
        loads.append((name, context))
        return _load_chat(name, config, context, target)

    return loads, ModelManager(CONFIG, Metrics(), loader=load)


def ollama_tokens(url: str, model: str, **options: Any) -> dict[str, Any]:
    status, _, raw = request("POST", url + "/api/chat", {
        "model": model, "messages": [USER], "stream": False,
        "options": {"num_predict": 1, "temperature": 0, **options}})
    assert status == 200, raw[:400]
    out: dict[str, Any] = json.loads(raw)
    assert out["model"] == model
    return out


def openai_tokens(url: str, model: str) -> int:
    status, _, raw = request("POST", url + "/v1/chat/completions", {
        "model": model, "messages": [USER], "max_tokens": 1, "temperature": 0})
    assert status == 200, raw[:400]
    out = json.loads(raw)
    assert out["model"] == model
    return int(out["usage"]["prompt_tokens"])


def ps(url: str) -> list[dict[str, Any]]:
    status, _, raw = request("GET", url + "/api/ps")
    assert status == 200, raw
    return list(json.loads(raw)["models"])


def save_hook(name: str = "hook", **kw: Any) -> None:
    presets.save(presets.make(name, BASE, system=SYSTEM, **kw))


# -- the preset is its model + per-request defaults ---------------------------------------

@requires_llama
def test_a_preset_after_its_model_gets_its_own_system_prompt(home: Path,
                                                             counts: dict[str, int]) -> None:
    """The bug: base first, then the preset was answered by the base's copy without its
    system prompt. Now the one copy serves both, each as itself, in both APIs."""
    save_hook()
    loads, manager = counting()
    with serve(CONFIG, manager=manager) as s:
        assert ollama_tokens(s.url, BASE)["prompt_eval_count"] == counts["plain"]
        assert ollama_tokens(s.url, "hook")["prompt_eval_count"] == counts["hook"]
        assert openai_tokens(s.url, "hook") == counts["hook"]
        assert openai_tokens(s.url, BASE) == counts["plain"]
        assert len(loads) == 1 and len(s.manager.models) == 1, loads
        (entry,) = ps(s.url)
        assert (entry["name"], entry["presets"], entry["pinned"]) == (BASE, ["hook"], False)


@requires_llama
def test_an_exact_preset_never_runs_on_its_models_fast_copy(home: Path,
                                                            counts: dict[str, int]) -> None:
    """A preset saved with ``exact`` asked for after its model's fast copy is loaded gets
    an exact copy of its own (the bug: it shared the fast one); the model's requests may
    run on either (an exact copy is correct for them)."""
    save_hook(exact=True)
    loads, manager = counting()
    with serve(CONFIG, manager=manager) as s:
        assert openai_tokens(s.url, BASE) == counts["plain"]
        assert openai_tokens(s.url, "hook") == counts["hook"]
        assert ollama_tokens(s.url, BASE)["prompt_eval_count"] == counts["plain"]
        assert ollama_tokens(s.url, "hook")["prompt_eval_count"] == counts["hook"]
        assert len(loads) == 2 and len(s.manager.models) == 2, loads
        assert sorted(m.info.exact for m in s.manager.models.values()) == [False, True]


@requires_llama
def test_a_model_after_its_preset_gets_no_system_prompt(home: Path,
                                                        counts: dict[str, int]) -> None:
    save_hook()
    loads, manager = counting()
    with serve(CONFIG, manager=manager) as s:
        assert openai_tokens(s.url, "hook") == counts["hook"]
        assert openai_tokens(s.url, BASE) == counts["plain"]
        assert ollama_tokens(s.url, BASE)["prompt_eval_count"] == counts["plain"]
        assert ollama_tokens(s.url, "hook")["prompt_eval_count"] == counts["hook"]
        assert loads == [(BASE, None)], loads  # the model, by its own name, once


@requires_llama
def test_serve_preset_pins_its_model_and_each_name_is_itself(home: Path,
                                                             counts: dict[str, int]) -> None:
    """``localrun serve hook``: the model loads once, pinned; a request for the model
    gets no system prompt, one for the preset gets its own."""
    save_hook()
    loads, manager = counting()
    (pinned,) = manager.preload(("hook",))
    with serve(CONFIG, manager=manager) as s:
        assert ollama_tokens(s.url, BASE)["prompt_eval_count"] == counts["plain"]
        assert openai_tokens(s.url, "hook") == counts["hook"]
        assert openai_tokens(s.url, BASE) == counts["plain"]
        assert len(loads) == 1 and list(s.manager.models.values()) == [pinned]
        (entry,) = ps(s.url)
        assert (entry["name"], entry["presets"], entry["pinned"]) == (BASE, ["hook"], True)
        assert entry["expires_at"].startswith("2318-")


@requires_llama
def test_a_presets_context_and_defaults_reach_the_engine(home: Path,
                                                         counts: dict[str, int]) -> None:
    """A preset with a context of its own is another copy at that context (the context
    is part of the copy's key, as num_ctx is); one without shares the model's. Its
    sampling values are the defaults (max_tokens 3); the request's own win."""
    save_hook("hook1k", context=1024, sampling={"max_tokens": 3, "temperature": 0})
    save_hook("hook")
    loads, manager = counting()
    with serve(CONFIG, manager=manager) as s:
        out = ollama_tokens(s.url, "hook1k", num_predict=None)
        assert out["prompt_eval_count"] == counts["hook"] and out["eval_count"] == 3
        assert ollama_tokens(s.url, "hook1k", num_predict=5)["eval_count"] == 5
        assert openai_tokens(s.url, "hook1k") == counts["hook"]
        assert ollama_tokens(s.url, "hook")["prompt_eval_count"] == counts["hook"]
        assert openai_tokens(s.url, BASE) == counts["plain"]
        assert loads == [(BASE, 1024), (BASE, None)], loads
        by_context = {m["context_length"]: m for m in ps(s.url)}
        assert set(by_context) == {1024, 2048}
        assert by_context[1024]["presets"] == ["hook1k"]
        assert by_context[2048]["presets"] == ["hook"]


# -- /api/create, /api/copy, /api/delete ----------------------------------------------------

def tags(url: str) -> dict[str, dict[str, Any]]:
    status, _, raw = request("GET", url + "/api/tags")
    assert status == 200, raw
    return {m["name"]: m for m in json.loads(raw)["models"]}


@requires_llama
def test_create_copy_delete_round_trip_with_the_ollama_client(
        home: Path, counts: dict[str, int]) -> None:
    ollama = pytest.importorskip("ollama", reason="the ollama client is not installed "
                                 "(pip install -e '.[clients]')")
    loads, manager = counting()
    with serve(CONFIG, manager=manager) as s:
        c = ollama.Client(host=s.url, timeout=WAIT)
        done = c.create(model="hook", from_=BASE, system=SYSTEM,
                        parameters={"temperature": 0, "num_ctx": 1024, "stop": ["###"]})
        assert done.status == "success"
        made = presets.get("hook")
        assert made is not None and made.context == 1024
        listed = tags(s.url)
        assert listed["hook"]["details"]["parent_model"] == BASE
        shown = c.show("hook")
        assert f"FROM {BASE}" in (shown.modelfile or "") and "SYSTEM" in shown.modelfile
        params = (shown.parameters or "").splitlines()
        assert [p.split() for p in params] == [["temperature", "0.0"], ["stop", '"###"'],
                                               ["num_ctx", "1024"]], params
        assert c.copy("hook", "hook2").status == "success"
        assert {"hook", "hook2"} <= set(tags(s.url))
        reply = c.chat(model="hook2", messages=[USER], options={"num_predict": 1})
        assert reply.prompt_eval_count == counts["hook"]
        assert loads == [(BASE, 1024)]
        assert c.delete("hook").status == "success"
        now = tags(s.url)
        assert "hook" not in now and "hook2" in now
        # streamed, as Ollama streams it: status lines ending in success
        lines = [p.status for p in c.create(model="hook3", from_="hook2", stream=True)]
        assert lines[-1] == "success" and len(lines) >= 2
        copied = presets.get("hook3")
        assert copied is not None and copied.system == SYSTEM  # from a preset: copied
        # a model (not a preset) copied: a new preset that runs it
        assert c.copy(BASE, "tiny").status == "success"
        tiny = presets.get("tiny")
        assert tiny is not None and tiny.model == BASE and "tiny" in tags(s.url)
        got, _, raw = request("GET", s.url + "/v1/models")
        assert got == 200, raw
        ids = {m["id"]: m for m in json.loads(raw)["data"]}
        assert ids["tiny"]["preset"] is True and ids["tiny"]["from"] == BASE
        for name in ("hook2", "hook3", "tiny"):
            assert c.delete(name).status == "success"
        assert presets.all_presets() == []
        with pytest.raises(ollama.ResponseError) as e:
            c.delete("hook")
        assert e.value.status_code == 403  # not a preset: model files, not allowed here


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"model": "qwen2.5:0.5b", "from": BASE}, 400, "catalog alias"),
    ({"model": "org/mine", "from": BASE}, 400, "Hub repo id"),
    ({"model": "x", "from": "/etc"}, 403, "local paths"),
    ({"model": "x"}, 400, "'from'"),
    ({"model": "x", "from": BASE, "parameters": {"mirostat": 1}}, 400,
     "parameters.mirostat"),
    ({"model": "x", "from": BASE, "parameters": {"temperature": -1}}, 400, "temperature"),
    ({"model": "x", "from": BASE, "parameters": {"num_ctx": 8}}, 400, "num_ctx"),
    ({"model": "x", "from": BASE, "adapters": {"a.gguf": "sha256:0"}}, 400, "LoRA"),
    ({"model": "x", "from": BASE, "template": "{{ .Prompt }}"}, 400, "chat template"),
    ({"model": "x", "modelfile": "FROM smollm2:135m\nTEMPLATE x"}, 400, "line 2"),
    ({"model": "x", "from": BASE, "messages": [USER, {"role": "system", "content": "s"}]},
     400, "messages[1].role"),
])
def test_create_refuses_bad_input_with_the_reason(home: Path, body: dict[str, Any],
                                                  status: int, needle: str) -> None:
    with serve(ServerConfig()) as s:
        got, _, raw = request("POST", s.url + "/api/create", body)
        assert got == status, raw
        error = json.loads(raw)["error"]
        assert needle in error and "Traceback" not in error, error
        assert not (home / "presets.json").exists()


def test_create_takes_the_older_modelfile_request(home: Path) -> None:
    with serve(ServerConfig()) as s:
        got, _, raw = request("POST", s.url + "/api/create", {
            "name": "reviewer", "stream": False, "modelfile":
            'FROM smollm2:135m\nSYSTEM """\nYou review code.\n"""\nPARAMETER num_ctx 4096\n'
            "MESSAGE user hi\nMESSAGE assistant - hello", "parameters": {"temperature": 0}})
        assert got == 200 and json.loads(raw) == {"status": "success"}, raw
        p = presets.get("reviewer")
        assert p is not None and (p.model, p.system, p.context) == (BASE, "You review code.",
                                                                    4096)
        assert p.sampling == {"temperature": 0.0}
        assert p.messages == (("user", "hi"), ("assistant", "- hello"))
        got, _, raw = request("POST", s.url + "/api/copy",
                              {"source": "reviewer", "destination": "reviewer"})
        assert got == 400, raw
        got, _, raw = request("POST", s.url + "/api/copy",
                              {"source": "nowhere", "destination": "y"})
        assert got == 404 and "not found" in json.loads(raw)["error"], raw


# -- loading and unloading ahead of a request -----------------------------------------------

@requires_llama
@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_load_and_unload_endpoints(home: Path, prefix: str) -> None:
    save_hook()
    loads, manager = counting()
    with serve(CONFIG, manager=manager) as s:
        got, _, raw = request("POST", f"{s.url}{prefix}/models/load",
                              {"model": "hook", "keep_alive": "10m"})
        assert got == 200, raw
        out = json.loads(raw)
        assert (out["success"], out["status"], out["pinned"]) == (True, "loaded", False)
        (entry,) = ps(s.url)
        assert entry["presets"] == ["hook"] and entry["size"] > 50 * 2**20
        got, _, raw = request("POST", f"{s.url}{prefix}/models/unload", {"model": "hook"})
        assert got == 200, raw
        out = json.loads(raw)
        assert out["status"] == "unloaded" and out["freed_bytes"] == entry["size"]
        assert ps(s.url) == [] and s.manager.models == {}  # the memory is given back
        got, _, raw = request("POST", f"{s.url}{prefix}/models/unload", {"model": BASE})
        assert got == 200 and json.loads(raw)["status"] == "not loaded", raw
        # names that would download: refused as a request for them is
        presets.save(presets.make("remote", "qwen2.5:0.5b"))
        for name in ("qwen2.5:0.5b", "remote"):
            got, _, raw = request("POST", f"{s.url}{prefix}/models/load", {"model": name})
            assert got == 403, raw
            error = json.loads(raw)["error"]
            assert error["code"] == "pull_not_allowed" and "--allow-pull" in error["message"]
        got, _, raw = request("POST", f"{s.url}{prefix}/models/load", {"model": "/etc"})
        assert got == 403 and json.loads(raw)["error"]["code"] == "local_paths_not_allowed"
        assert len(loads) == 1


@requires_llama
def test_unload_refuses_a_pinned_model(home: Path, llama_model: Any) -> None:
    save_hook()
    with serve(CONFIG, preload={BASE: llama_model}) as s:
        for name in (BASE, "hook"):
            got, _, raw = request("POST", s.url + "/models/unload", {"model": name})
            assert got == 409, raw
            error = json.loads(raw)["error"]
            assert error["code"] == "model_pinned" and "command line" in error["message"]
        (entry,) = ps(s.url)
        assert entry["pinned"] is True and entry["name"] == BASE


@requires_llama
def test_ollamas_load_and_unload_for_a_preset(home: Path) -> None:
    """No prompt (or no messages) loads, keep_alive 0 unloads; done_reason "unload"
    only when something was unloaded."""
    save_hook()
    loads, manager = counting()
    with serve(CONFIG, manager=manager) as s:
        cases: list[tuple[str, dict[str, Any]]] = [
            ("/api/generate", {}), ("/api/chat", {"messages": []}), ("/api/chat", {})]
        for route, empty in cases:
            got, _, raw = request("POST", s.url + route, {"model": "hook", **empty})
            assert got == 200 and json.loads(raw)["done_reason"] == "load", raw
            assert [m["presets"] for m in ps(s.url)] == [["hook"]]
            got, _, raw = request("POST", s.url + route,
                                  {"model": "hook", "keep_alive": 0, **empty})
            assert got == 200 and json.loads(raw)["done_reason"] == "unload", raw
            assert ps(s.url) == []
            got, _, raw = request("POST", s.url + route,
                                  {"model": "hook", "keep_alive": 0, **empty})
            assert got == 200 and "done_reason" not in json.loads(raw), raw  # nothing loaded
        assert len(loads) == 3


class _Fake:
    """What the manager reads of a loaded chat model, without an engine."""

    max_concurrency = 1

    def footprint(self, slots: int | None = None) -> Any:
        """One sequence at a time, counted as its files' estimate (as an engine's)."""
        from localrun.backends.base import Footprint
        from localrun.server.sizing import estimate_loaded

        est = estimate_loaded(self.info, None)
        return Footprint(1, est.total_bytes if est is not None else 0, 0, 0)

    def __init__(self, path: str, context: int) -> None:
        from localrun.types import ModelInfo

        self.info = ModelInfo(backend="llama.cpp", engine_version="test", format="gguf",
                              quantization="Q4_1", path=path, context_length=context,
                              trained_context_length=8192, device="cpu")
        self.closed = False

    def limit_concurrency(self, n: int) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_an_unload_while_requests_run_takes_effect_when_they_end(home: Path) -> None:
    """Ollama's way: a model asked to unload while it answers goes when its last
    request ends ("unloading"), unless a request asks for it again first."""
    import asyncio

    from localrun.formats.detect import detect
    from tests.models import test_model

    path = str(test_model("gguf-q4_1"))
    loads: list[str] = []

    def load(name: str, config: Any, context: int | None, target: Any = None) -> _Fake:
        loads.append(name)
        return _Fake(detect(name).path, context or config.context)

    config = ServerConfig(backend="llama.cpp", parallel=1, context=512,
                          allow_local_paths=True)

    async def run() -> None:
        mgr = ModelManager(config, Metrics(), loader=load, available_memory=lambda: 2**40)
        await mgr.start()
        try:
            lease = await mgr.acquire(path)
            out = await mgr.unload(path)
            assert out and out.closing == [lease.loaded] and not out.unloaded
            assert len(mgr.models) == 1  # still answering
            lease.release()
            await asyncio.sleep(0.2)
            assert mgr.models == {} and lease.loaded.handle.closed
            lease = await mgr.acquire(path)
            await mgr.unload(path)
            again = asyncio.ensure_future(mgr.acquire(path))  # waits for the slot
            await asyncio.sleep(0.05)
            lease.release()
            (await again).release()
            await asyncio.sleep(0.2)
            assert len(mgr.models) == 1 and len(loads) == 2  # asked again: it stays
            out = await mgr.unload(path)
            assert out.unloaded and out.freed > 0 and mgr.models == {}
        finally:
            await mgr.stop()

    asyncio.run(run())


# -- /api/delete of a pulled model: localrun rm's rules ----------------------------------------

@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    from tests.hubserver import start

    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))
    yield from start(monkeypatch, tmp_path)


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_delete_of_a_pulled_model_follows_rms_rules(fake: Any) -> None:
    import huggingface_hub

    from localrun import hub
    from localrun.hub import pulls
    from tests.hubserver import BASE as HF_BASE

    alias = "qwen2.5:0.5b"
    gguf = hub.fetch(hub.plan_fetch(alias, backend="llama.cpp"))
    direct = Path(huggingface_hub.snapshot_download(HF_BASE))  # as transformers would
    base_dir = fake.home / "hub" / ("models--" + HF_BASE.replace("/", "--"))
    base_before = _tree(base_dir)
    assert gguf.is_file() and direct.is_dir()
    with serve(ServerConfig()) as s:  # no flag, no key: model files stay
        got, _, raw = request("DELETE", s.url + "/api/delete", {"model": alias})
        assert got == 403 and "--allow-delete" in json.loads(raw)["error"], raw
        assert gguf.is_file()
    with serve(ServerConfig(allow_delete=True)) as s:
        # a repo huggingface_hub downloaded itself: not localrun's to delete over the API
        got, _, raw = request("DELETE", s.url + "/api/delete", {"model": HF_BASE})
        assert got == 409, raw
        assert f"localrun rm {HF_BASE}" in json.loads(raw)["error"]
        assert _tree(base_dir) == base_before
        got, _, raw = request("DELETE", s.url + "/api/delete", {"model": "/etc/passwd"})
        assert got == 400 and "deletes only what it pulled" in json.loads(raw)["error"]
        got, _, raw = request("DELETE", s.url + "/api/delete", {"model": "nobody/Nothing"})
        assert got == 404, raw
        # what localrun pulled as the alias goes; the base repo stays, every byte
        got, _, raw = request("DELETE", s.url + "/api/delete", {"model": alias})
        assert got == 200, raw
        out = json.loads(raw)
        assert (out["deleted"], out["files"]) == ("model", 1) and out["freed_bytes"] > 0
        assert not gguf.exists() and _tree(base_dir) == base_before
        assert alias not in {r.display for r in pulls.load(fake.home / "hub")}
        got, _, raw = request("DELETE", s.url + "/api/delete", {"model": alias})
        assert got == 404, raw  # nothing pulled as it any more
    with serve(ServerConfig(api_key="k3y")) as s:  # a key allows it too
        got, _, raw = request("DELETE", s.url + "/api/delete", {"model": HF_BASE},
                              headers={"Authorization": "Bearer k3y"})
        assert got == 409 and _tree(base_dir) == base_before, raw


def test_pull_of_a_preset_pulls_its_model(fake: Any) -> None:
    from localrun import hub

    presets.save(presets.make("remote", "qwen2.5:0.5b"))
    with serve(ServerConfig()) as s:
        got, _, raw = request("POST", s.url + "/api/pull", {"model": "remote",
                                                             "stream": False})
        assert got == 403 and "localrun pull qwen2.5:0.5b" in json.loads(raw)["error"], raw
    with serve(ServerConfig(allow_pull=True)) as s:
        got, _, raw = request("POST", s.url + "/api/pull", {"model": "remote",
                                                             "stream": False})
        assert got == 200 and json.loads(raw) == {"status": "success"}, raw
    assert any("qwen2.5:0.5b" in m.pulled_as for m in hub.cached_models())


# -- localrun serve PRESET, found through LOCALRUN_HOST ----------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@requires_llama
def test_serve_a_preset_at_localrun_host_and_ps_shows_it_pinned(
        home: Path, counts: dict[str, int]) -> None:
    save_hook()
    port = _free_port()
    env = {**os.environ, "LOCALRUN_HOST": f"127.0.0.1:{port}", "COLUMNS": "200"}
    env.pop("LOCALRUN_API_KEY", None)
    proc = subprocess.Popen([*localrun_cmd(), "serve", "hook", "--backend", "llama.cpp",
                             "--context", "2048", "--parallel", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline and not (lines and lines[-1].startswith("Ctrl-C")):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        text = "".join(lines)
        url = f"http://127.0.0.1:{port}"
        assert f"· {url}" in text and f"model {BASE} (preset hook)" in text, text
        assert openai_tokens(url, "hook") == counts["hook"]
        assert openai_tokens(url, BASE) == counts["plain"]
        r = subprocess.run([*localrun_cmd(), "ps"], capture_output=True, text=True,
                           env=env, timeout=WAIT)
        assert r.returncode == 0, r.stderr
        (row,) = [x for x in r.stdout.splitlines() if x.lstrip().startswith(BASE)]
        assert "(preset hook)" in row and "never (pinned)" in row, r.stdout
        r = subprocess.run([*localrun_cmd(), "ps", "--json"], capture_output=True,
                           text=True, env=env, timeout=WAIT)
        (model,) = map(json.loads, r.stdout.splitlines())
        assert (model["pinned"], model["presets"]) == (True, ["hook"])
        r = subprocess.run([*localrun_cmd(), "stop", "hook"], capture_output=True,
                           text=True, env=env, timeout=WAIT)
        assert r.returncode == 1 and "hook stays loaded" in r.stderr, r.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(WAIT)
