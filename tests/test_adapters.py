"""LoRA adapters (issue 31 item 4), on the real engines and the real server.

llama.cpp: GGUF adapters at load with a scale, and per request by name/scale without a
reload (the single path and the batcher, the KV cache reused only under the same set);
MLX: an adapter folder at load; the refusals (another architecture, no file, an adapter
not loaded, a scale out of range, an engine that loads none); the plan counts adapters;
``localrun serve --lora`` and the ``lora`` field of the OpenAI routes, listed in
/v1/models. The fixtures: lora-gguf(-b) (random adapters for SmolLM2-135M, different
greedy replies), lora-mlx, lora-peft (scripts/fixtures_lora_vl.py).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import localrun
from localrun.adapters import (
    Adapter,
    AdapterError,
    AdapterMismatchError,
    AdapterNotLoadedError,
    normalize,
    parse_adapter,
)
from localrun.errors import InvalidSamplingError, UnsupportedFeatureError
from tests.conftest import requires_llama
from tests.models import test_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ASK = {"temperature": 0.0, "max_tokens": 12}


def _base() -> Path:
    return test_model("gguf-q8_0")


def _reply(model: Any, **kw: Any) -> str:
    return str(model.chat(QUESTION, **ASK, **kw).text)


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    """The greedy reply of the base model and of each adapter at scale 1, each from a
    model loaded with that adapter alone (what a per-request switch must match)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llama-cpp]')")
    out = {}
    for name, adapters in (("", None), ("a", [test_model("lora-gguf")]),
                           ("b", [test_model("lora-gguf-b")])):
        with localrun.load(str(_base()), backend="llama.cpp", context=512, threads=1,
                           adapters=adapters) as m:
            out[name] = _reply(m)
    assert len(set(out.values())) == 3, out  # base, a and b all differ
    return out


@pytest.fixture(scope="module")
def both() -> Iterator[Any]:
    """The base model with both adapters loaded: a on, b loaded at scale 0 (off)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llama-cpp]')")
    with localrun.load(str(_base()), backend="llama.cpp", context=512, threads=1,
                       adapters=[f"a={test_model('lora-gguf')}",
                                 f"b={test_model('lora-gguf-b')}:0"]) as m:
        yield m


# -- llama.cpp through localrun.load ----------------------------------------------------------

@requires_llama
def test_the_lora_gguf_changes_the_greedy_reply_at_scale_1_and_not_at_0(
        expected: dict[str, str]) -> None:
    lora = test_model("lora-gguf")
    with localrun.load(str(_base()), context=512, threads=1, adapters=[f"{lora}:0"]) as m:
        assert _reply(m) == expected[""]
        assert [(a.label, a.scale) for a in m.info.adapters] == [(lora.stem, 0.0)]
    assert expected["a"] != expected[""]  # scale 1 (the fixture's own load)


@requires_llama
def test_two_adapters_interleave_per_request_on_one_loaded_model(
        both: Any, expected: dict[str, str]) -> None:
    session = both._session
    assert [(a.label, a.scale) for a in both.info.adapters] == [("a", 1.0), ("b", 0.0)]
    assert _reply(both) == expected["a"]  # the load-time set: a on, b off
    # the same prompt each time: its KV cells, kept between calls, must not be reused
    # under another adapter set
    for name in ("b", "", "a", "b", "a", ""):
        chosen = {name: 1.0} if name else []
        assert _reply(both, adapters=chosen) == expected[name], name
    assert _reply(both, adapters=[1]) == expected["b"]  # by index
    assert _reply(both, adapters=[{"name": "a", "scale": 0}]) == expected[""]
    assert both._session is session  # one loaded model throughout


@requires_llama
def test_a_batch_with_different_adapters_runs_together_each_under_its_own(
        both: Any, expected: dict[str, str]) -> None:
    """Through the batcher (several sequences in one context): sequences under different
    sets decode apart, and a slot's cells serve only a sequence under the same set."""
    from localrun.batch import BatchItem

    names = ["a", "b", "", "b", "a", ""]
    items = [BatchItem(QUESTION, {"adapters": [n] if n else []}) for n in names]
    got = both.batch(items, max_concurrency=3, **ASK)
    assert [c.text for c in got] == [expected[n] for n in names]
    assert both.max_concurrency >= 2  # it did batch
    # again with one decode for all the generating sequences wherever it can (on this
    # CPU the calibration may choose a decode each; both compute the same logits)
    batcher = both._session._batcher
    batcher.together = 2
    got = both.batch(items, max_concurrency=3, **ASK)
    assert [c.text for c in got] == [expected[n] for n in names]


@requires_llama
def test_per_request_refusals_name_what_is_loaded(both: Any) -> None:
    with pytest.raises(AdapterNotLoadedError, match=r"No adapter 'c'.*'a', 'b'"):
        _reply(both, adapters=["c"])
    with pytest.raises(AdapterNotLoadedError, match=r"#5"):
        _reply(both, adapters=[5])
    with pytest.raises(InvalidSamplingError, match=r"adapters.*-4 to 4"):
        _reply(both, adapters={"a": 9.0})
    with pytest.raises(InvalidSamplingError, match="adapters"):
        _reply(both, adapters=[{"name": "a", "weight": 1}])


@requires_llama
def test_load_refuses_another_architecture_naming_both(tmp_path: Path) -> None:
    qwen = test_model("vl-gguf") / "Tiny-Qwen2.5-VL.F16.gguf"
    lora = test_model("lora-gguf")
    with pytest.raises(AdapterMismatchError) as e:
        localrun.load(str(qwen), backend="llama.cpp", context=512, adapters=[lora])
    assert "'llama'" in e.value.message and "'qwen2vl'" in e.value.message
    assert e.value.adapter_arch == "llama" and e.value.model_arch == "qwen2vl"


@requires_llama
def test_load_refuses_bad_adapters_with_the_reason(tmp_path: Path) -> None:
    base, lora = str(_base()), test_model("lora-gguf")
    with pytest.raises(AdapterError, match="No adapter at"):
        localrun.load(base, adapters=[str(tmp_path / "nope.gguf")])
    with pytest.raises(AdapterError, match=r"scale 9\.0 is out of range"):
        localrun.load(base, adapters=[f"{lora}:9"])
    with pytest.raises(AdapterError, match="Two adapters are named"):
        localrun.load(base, adapters=[lora, lora])
    with pytest.raises(AdapterError, match="is not a LoRA adapter"):
        localrun.load(base, adapters=[base])  # a model, not an adapter
    with pytest.raises(AdapterError, match=r"PEFT adapter folder.*GGUF adapter") as e:
        localrun.load(base, adapters=[test_model("lora-peft")])
    assert "convert_lora_to_gguf" in (e.value.hint or "")


def test_engines_without_adapters_refuse_them_naming_those_that_load_them() -> None:
    pytest.importorskip("openvino_genai", reason="OpenVINO GenAI is not installed")
    with pytest.raises(UnsupportedFeatureError) as e:
        localrun.load(str(test_model("openvino-int4")), backend="openvino",
                      adapters=[test_model("lora-peft")])
    assert e.value.option == "adapters"
    assert set(e.value.supported_by) == {"llama.cpp", "mlx", "vllm"}
    assert "'llama.cpp'" in (e.value.hint or "")


def test_adapter_text_forms() -> None:
    assert parse_adapter("x.gguf") == Adapter("x.gguf", 1.0)
    assert parse_adapter("style=./a/x.gguf:0.5") == Adapter("./a/x.gguf", 0.5, "style")
    assert parse_adapter("/a/b.F16.gguf").label == "b.F16"
    with pytest.raises(AdapterError, match="out of range"):
        parse_adapter("x.gguf:-7")


def test_the_plan_counts_adapters(tmp_path: Path) -> None:
    base, lora = str(_base()), test_model("lora-gguf")
    plain = localrun.plan(base, backend="llama.cpp", hub=False).memory
    adapted = localrun.plan(base, backend="llama.cpp", hub=False, adapters=[lora]).memory
    assert plain is not None and adapted is not None
    size = lora.stat().st_size
    assert adapted["adapter_bytes"] == size > 0
    assert adapted["total_bytes"] == plain["total_bytes"] + size
    with pytest.raises(AdapterError, match=r"llama\.cpp loads a GGUF adapter file"):
        localrun.plan(base, backend="llama.cpp", hub=False, adapters=[test_model("lora-peft")])


def test_load_counts_adapters_in_its_fit_before_downloading(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, default_gguf: Path) -> None:
    """``load()``'s own fit check (the download's, before a byte of the weights moves)
    counts the adapters' files as the plan does: at a budget the model alone fits with
    half the adapter to spare, loading it with the adapter is refused with the numbers
    (the adapter in the breakdown) and nothing is downloaded; the plan says the same."""
    from localrun.errors import ModelTooLargeError
    from tests.hubserver import SMOLLM2, add_smollm2, start

    fake_hub = start(monkeypatch, tmp_path)
    fake = next(fake_hub)
    try:
        add_smollm2(fake.hub, default_gguf)
        lora = test_model("lora-gguf")
        size = lora.stat().st_size
        seen: list[Any] = []

        class Planned(Exception):
            pass

        def stop(plan: Any, fp: Any) -> None:  # on_plan: before any download
            seen.append(fp)
            raise Planned

        budget = [64 * 2**30]
        monkeypatch.setattr("localrun.planning.plan.memory_budget",
                            lambda *a, **k: budget[0])
        with pytest.raises(Planned):
            localrun.load(SMOLLM2, backend="llama.cpp", context=512, on_plan=stop)
        need = seen[-1].memory.total_bytes
        budget[0] = need + size // 2
        with pytest.raises(Planned):  # the model alone fits
            localrun.load(SMOLLM2, backend="llama.cpp", context=512, on_plan=stop)
        assert seen[-1].fits and seen[-1].memory.total_bytes == need
        with pytest.raises(ModelTooLargeError) as e:
            localrun.load(SMOLLM2, backend="llama.cpp", context=512, adapters=[str(lora)])
        assert (e.value.needed_bytes, e.value.available_bytes) == (need + size, budget[0])
        assert "+ adapters " in str(e.value)  # the breakdown names them
        assert not [r for r in fake.hub.cdn_requests("GET")
                    if not any(k.lower() == "range" for k in r["headers"])]
        planned = localrun.plan(SMOLLM2, backend="llama.cpp", context=512, adapters=[lora])
        assert planned.memory is not None and planned.memory["fits"] is False
        assert planned.memory["total_bytes"] == need + size
    finally:
        fake_hub.close()


# -- MLX --------------------------------------------------------------------------------------

def test_mlx_loads_an_adapter_folder_at_load() -> None:
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install -e '.[mlx]')")
    folder, lora = str(test_model("mlx-4bit")), test_model("lora-mlx")
    with localrun.load(folder, backend="mlx") as m:
        plain = _reply(m)
    with localrun.load(folder, backend="mlx", adapters=[lora]) as m:
        adapted = _reply(m)
        assert _reply(m, adapters=[lora.name]) == adapted  # the loaded set: fine
        with pytest.raises(UnsupportedFeatureError, match="applies its adapters at load"):
            _reply(m, adapters=[])
    assert adapted.strip() and adapted != plain
    with localrun.load(folder, backend="mlx", adapters=[f"{lora}:0"]) as m:
        assert _reply(m) == plain
    with pytest.raises(AdapterError, match="mlx loads an mlx-lm adapter folder"):
        localrun.load(folder, backend="mlx", adapters=[test_model("lora-gguf")])


# -- presets ----------------------------------------------------------------------------------

@requires_llama
def test_a_preset_loads_its_adapter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                    expected: dict[str, str]) -> None:
    from localrun.naming import presets

    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))
    presets.save(presets.make("styled", str(_base()), backend="llama.cpp", context=512,
                              adapters=[parse_adapter(f"{test_model('lora-gguf')}:1")]))
    with localrun.load("styled", threads=1) as m:
        assert _reply(m) == expected["a"]
        assert m.info.adapters[0].path == str(test_model("lora-gguf"))


# -- the server -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_server(expected: dict[str, str]) -> Iterator[tuple[Any, list[str]]]:
    """``localrun serve BASE --lora a=A --lora b=B:0`` in this process; the loads it made."""
    from localrun.server.config import ServerConfig
    from localrun.server.manager import ModelManager
    from localrun.server.metrics import Metrics
    from tests.serverutil import serve

    config = ServerConfig(models=(str(_base()),), backend="llama.cpp", context=512,
                          adapters=normalize([f"a={test_model('lora-gguf')}",
                                              f"b={test_model('lora-gguf-b')}:0"]))
    manager = ModelManager(config, Metrics())
    loads: list[str] = []
    real = manager._loader

    def counted(name: str, *args: Any) -> Any:
        loads.append(name)
        return real(name, *args)

    manager._loader = counted  # type: ignore[method-assign]
    manager.preload(config.models)
    try:
        with serve(config, manager=manager) as s:
            yield s, loads
    finally:
        for m in list(manager.models.values()):
            m.handle.close()


@requires_llama
def test_the_server_switches_adapters_per_request_without_a_reload(
        lora_server: tuple[Any, list[str]], expected: dict[str, str]) -> None:
    pytest.importorskip("openai", reason="the openai SDK is not installed")
    from openai import OpenAI

    s, loads = lora_server
    client = OpenAI(base_url=s.v1, api_key="x", max_retries=0)
    model = str(_base())

    def ask(lora: Any = None) -> str:
        extra = {"lora": lora} if lora is not None else None
        r = client.chat.completions.create(model=model, messages=QUESTION,  # type: ignore
                                           extra_body=extra, **ASK)
        return str(r.choices[0].message.content)

    assert ask() == expected["a"]  # --lora a (on), b:0 (off)
    for name in ("b", "", "a", "b", ""):
        lora = [{"name": name, "scale": 1.0}] if name else []
        assert ask(lora) == expected[name], name
    assert ask([{"id": 1, "scale": 1}]) == expected["b"]
    r = client.completions.create(model=model, prompt="The capital of France is",
                                  max_tokens=6, temperature=0,
                                  extra_body={"lora": [{"name": "b"}]})
    r0 = client.completions.create(model=model, prompt="The capital of France is",
                                   max_tokens=6, temperature=0, extra_body={"lora": []})
    assert r.choices[0].text != r0.choices[0].text
    assert loads == [model]  # one load: the command line's
    assert len(s.manager.models) == 1


@requires_llama
def test_the_server_lists_adapters_and_refuses_bad_lora(
        lora_server: tuple[Any, list[str]]) -> None:
    from tests.serverutil import request

    s, _ = lora_server
    status, _, raw = request("GET", s.v1 + "/models")
    assert status == 200
    entry = next(e for e in json.loads(raw)["data"] if e.get("loaded"))
    assert [(a["id"], a["name"], a["scale"]) for a in entry["adapters"]] == [
        (0, "a", 1.0), (1, "b", 0.0)]
    body = {"model": str(_base()), "messages": QUESTION, "max_tokens": 2}
    for lora, needle in (([{"name": "c"}], "No adapter 'c'"), ([{"id": 7}], "#7"),
                         ([{"name": "a", "scale": 50}], "-4 to 4"),
                         ([{"name": "a", "id": 0}], "one of id or name"),
                         ("a", "lora")):
        status, _, raw = request("POST", s.v1 + "/chat/completions", {**body, "lora": lora})
        assert status == 400, raw
        err = json.loads(raw)["error"]
        assert needle in err["message"] and err["param"] == "lora", err
    assert "'a', 'b'" in json.loads(request("POST", s.v1 + "/chat/completions", {
        **body, "lora": [{"name": "zz"}]})[2])["error"]["message"]


# -- vLLM (its flags and per-request routing; the engine itself is not run here) ---------------

def test_vllm_serves_peft_adapters_and_routes_a_request_to_one() -> None:
    """``vllm serve``'s LoRA flags (vLLM 0.32: --enable-lora, --lora-modules NAME=PATH,
    --max-lora-rank from its choices, --max-loras) and the ``model`` a request names.
    vLLM itself is not started here: tests/test_vllm.py::test_real_vllm_lora_per_request
    runs these flags and requests on the real vLLM (its CPU build). A path with a comma
    goes in vLLM's JSON form (NAME=PATH would be read as JSON, and refused)."""
    from localrun.adapters import for_engine
    from localrun.backends.vllm.adapters import lora_flags, module, served_adapter

    a, b = normalize([f"a={test_model('lora-peft')}", f"b={test_model('lora-peft-b')}:0"])
    for_engine((a, b), "vllm")  # PEFT folders, one on
    assert lora_flags((a, b)) == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                                  "--lora-modules", f"a={a.path}", f"b={b.path}"]
    assert json.loads(module(Adapter("/m/a,b", 1.0, "c"))) == {"name": "c", "path": "/m/a,b"}
    assert served_adapter("base", None, (a, b)) == "a"  # the load-time set
    assert served_adapter("base", (("b", 1.0),), (a, b)) == "b"
    assert served_adapter("base", (), (a, b)) == "base"
    with pytest.raises(AdapterError, match="one adapter"):
        served_adapter("base", (("a", 1.0), ("b", 1.0)), (a, b))
    with pytest.raises(AdapterError, match="scale 1 only"):
        served_adapter("base", (("a", 0.5),), (a, b))
    with pytest.raises(AdapterError, match="scale 1 only"):
        for_engine(normalize([f"{test_model('lora-peft')}:0.5"]), "vllm")
    with pytest.raises(AdapterError, match="one adapter at a time"):
        for_engine(normalize([f"a={test_model('lora-peft')}", f"b={test_model('lora-peft-b')}"]),
                   "vllm")


def _cli(*args: str, stdin: str | None = None) -> Any:
    import subprocess

    from tests.conftest import localrun_cmd

    return subprocess.run([*localrun_cmd(), *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


@requires_llama
def test_run_and_chat_take_adapter(tmp_path: Path) -> None:
    """``localrun run/chat MODEL --adapter PATH[:SCALE]`` load the adapter with the model:
    the greedy reply changes at scale 1, not at scale 0, the same in run and chat."""
    base, lora = str(_base()), test_model("lora-gguf")
    q = QUESTION[0]["content"]
    flags = ["--backend", "llama.cpp", "--context", "512", "--temperature", "0",
             "--max-tokens", "12"]
    plain = _cli("run", base, q, *flags)
    adapted = _cli("run", base, q, *flags, "--adapter", str(lora))
    off = _cli("run", base, q, *flags, "--adapter", f"{lora}:0")
    chatted = _cli("chat", base, *flags, "--adapter", f"style={lora}", stdin=q + "\n")
    for r in (plain, adapted, off, chatted):
        assert r.returncode == 0, r.stderr
    assert plain.stdout.strip() and adapted.stdout.strip() != plain.stdout.strip()
    assert off.stdout.strip() == plain.stdout.strip()
    assert chatted.stdout.strip() == adapted.stdout.strip()


@pytest.mark.parametrize("command", ["run", "chat"])
def test_run_and_chat_refuse_bad_adapters_in_one_line(tmp_path: Path, command: str) -> None:
    """A missing file and a scale out of range: one line and a hint, exit 1, before the
    model loads."""
    base, lora = str(_base()), test_model("lora-gguf")
    for value, said in ((str(tmp_path / "nope.gguf"), "No adapter at"),
                        (f"{lora}:9", "scale 9.0 is out of range")):
        r = _cli(command, base, *(["Hi"] if command == "run" else []), "--adapter", value,
                 stdin="Hi\n")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert said in lines[0] and len(lines) <= 2, r.stderr  # the error, its hint
        assert r.stdout == ""


def test_serve_lora_flags_are_read_and_checked(tmp_path: Path) -> None:
    from localrun.cli.serve import _adapters

    lora = test_model("lora-gguf")
    got = _adapters([f"style={lora}:0.5", str(lora)])
    assert [(a.label, a.scale) for a in got] == [("style", 0.5), (lora.stem, 1.0)]
    with pytest.raises(AdapterError, match="No adapter at"):
        _adapters([str(tmp_path / "x.gguf")])
