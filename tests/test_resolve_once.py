"""One load resolves its model once (issue 29, deliverable 1): one plan, the Hub's model
info read once per repo, for ``localrun.load`` of a Hub name and for the server's first
load of one; the device asked for is a planning input (``device="cpu"`` on an NVIDIA host
plans a CPU engine and its quant); what one call computed (the hardware profile, a
schema's grammar, a raw prompt's plan) is not computed again."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import localrun
from localrun.hardware import HardwareProfile
from localrun.hardware.profile import PROFILES
from tests.hubserver import BASE, SMOLLM2, HubFixture, add_smollm2, start

#: A repo's model info: GET /api/models/{org}/{name}[/revision/{rev}] (its tree, refs and
#: file reads are other requests)
MODEL_INFO = re.compile(r"^/api/models/([^/?]+/[^/?]+)(?:/revision/[^/?]+)?(?:\?.*)?$")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    monkeypatch.delenv("LOCALRUN_HOME", raising=False)
    yield from start(monkeypatch, tmp_path)


def model_infos(fake: HubFixture) -> Counter[str]:
    """How often each repo's model info was read."""
    return Counter(m.group(1) for r in fake.hub.requests if r.get("host") != "cdn"
                   and r["method"] == "GET" and (m := MODEL_INFO.match(r["path"])))


def count_plans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every engine selection made from now on (its model), however it is reached."""
    import localrun.planning.plan as planning
    from localrun.planning import selection

    made: list[str] = []
    real: Callable[..., Any] = selection.select

    def select(profile: Any, installed: Any, request: Any = None) -> Any:
        made.append(getattr(request, "model", None) or "?")
        return real(profile, installed, request)

    monkeypatch.setattr(selection, "select", select)
    monkeypatch.setattr(planning, "select", select)
    return made


def test_a_hub_load_plans_once_and_reads_each_model_info_once(
        fake: HubFixture, default_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llama_cpp", reason="llama.cpp is not installed")
    add_smollm2(fake.hub, default_gguf)
    plans = count_plans(monkeypatch)
    with localrun.load(SMOLLM2, backend="llama.cpp", context=512, threads=1) as model:
        assert model.info.backend == "llama.cpp" and str(fake.home) in model.info.path
    infos = model_infos(fake)
    assert infos, "the load read no model info: the stand-in Hub was not asked"
    assert all(n == 1 for n in infos.values()), infos
    assert len(plans) == 1, plans


def test_the_servers_first_load_of_a_hub_name_plans_once(
        fake: HubFixture, default_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llama_cpp", reason="llama.cpp is not installed")
    from localrun.server.config import ServerConfig
    from tests.serverutil import request, serve

    add_smollm2(fake.hub, default_gguf)
    plans = count_plans(monkeypatch)
    config = ServerConfig(backend="llama.cpp", allow_pull=True, context=512, parallel=1)
    with serve(config) as s:
        status, _, body = request("POST", s.url + "/api/generate", {
            "model": SMOLLM2, "prompt": "Hi", "stream": False,
            "options": {"num_predict": 1}})
        assert status == 200, body
        assert len(s.manager.models) == 1
    infos = model_infos(fake)
    assert infos and all(n == 1 for n in infos.values()), infos
    assert len(plans) == 1, plans


def test_device_cpu_on_an_nvidia_host_plans_a_cpu_engine_and_quant(
        fake: HubFixture) -> None:
    """The RTX 4090's own plan is a GPU engine; asked for the CPU, it is one that runs
    there, with the quant and the memory fit of the CPU (RAM, not VRAM)."""
    from localrun.planning.plan import memory_budget
    from localrun.resolve import plan_target

    rtx = HardwareProfile.load(PROFILES / "rtx4090.json")
    both = {"exllamav2": "0.3.2", "llama.cpp": "0.3.36"}
    gpu = localrun.plan("qwen2.5:0.5b", hardware=rtx, installed=both, hub=False)
    assert (gpu.backend, gpu.device) == ("exllamav2", "cuda:0")
    cpu = localrun.plan("qwen2.5:0.5b", hardware=rtx, installed=both, hub=False,
                        device="cpu")
    assert (cpu.backend, cpu.format, cpu.device) == ("llama.cpp", "gguf", "cpu")
    assert cpu.quantization != gpu.quantization  # a GGUF quant, not an EXL2 bpw

    # On the Hub: the variant is chosen against the CPU's budget, and a load gets it.
    on_gpu = localrun.plan(BASE, hardware=rtx, installed=both, context=512)
    on_cpu = localrun.plan(BASE, hardware=rtx, installed=both, context=512, device="cpu")
    assert on_gpu.device.startswith("cuda") and on_cpu.device == "cpu"
    assert on_cpu.backend == "llama.cpp" and on_cpu.format == "gguf"
    assert on_cpu.memory is not None and on_gpu.memory is not None
    assert on_cpu.memory["budget"] == memory_budget(rtx, "cpu", "llama.cpp")
    assert on_cpu.memory["budget"] != on_gpu.memory["budget"]
    target = plan_target(BASE, hardware=rtx, installed=both, context=512, device="cpu")
    assert (target.backend, target.device) == ("llama.cpp", "cpu")
    assert target.load_request().device == "cpu"


def test_a_device_no_engine_plans_for_is_loaded_as_asked() -> None:
    """A device this host does not show: the host's plan, on that device, saying so."""
    cpu_host = HardwareProfile.load(PROFILES / "epyc-cpu.json")
    p = localrun.plan("qwen2.5:0.5b", hardware=cpu_host, installed={"llama.cpp": "0.3.36"},
                      hub=False, device="vulkan")
    assert (p.backend, p.device) == ("llama.cpp", "vulkan")
    assert any("device 'vulkan' was asked for" in n for n in p.notes), p.notes


def test_another_device_of_the_engines_kind_is_planned_for() -> None:
    """OpenVINO's NPU is never its own pick; asked for, it is planned, as asked."""
    npu_host = HardwareProfile.load(PROFILES / "core-ultra-arc-npu.json")
    engines = {"openvino": "2026.4.1", "llama.cpp": "0.3.36"}
    best = localrun.plan("qwen2.5:0.5b", hardware=npu_host, installed=engines, hub=False)
    npu = localrun.plan("qwen2.5:0.5b", hardware=npu_host, installed=engines, hub=False,
                        device="NPU")
    assert best.backend == "openvino" and best.device != "NPU"
    assert (npu.backend, npu.device) == ("openvino", "NPU")
    assert not any("was asked for" in n for n in npu.notes), npu.notes


def test_llama_cpps_free_vram_does_not_probe_the_machine_again() -> None:
    from localrun.backends.llama_cpp.devices import free_vram
    from localrun.hardware import detect_hardware

    detect_hardware()
    before = detect_hardware.cache_info()
    free_vram("cuda", ())
    detect_hardware()
    after = detect_hardware.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 1


def test_a_schema_is_compiled_once_for_the_check_and_the_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    llg = pytest.importorskip("llguidance", reason="llguidance is not installed")
    from localrun.structured.constraint import Constraint
    from localrun.structured.grammar import check_schema, constraint_grammar

    compiled: list[Any] = []
    real = llg.LLMatcher.grammar_from_json_schema

    def counting(schema: Any, **kw: Any) -> Any:
        compiled.append(schema)
        return real(schema, **kw)

    monkeypatch.setattr(llg.LLMatcher, "grammar_from_json_schema", counting)
    schema = {"type": "object", "properties": {"z": {"type": "integer"},
                                               "a": {"type": "string"}},
              "required": ["z", "a"], "x-test": "compiled-once"}
    check_schema(schema)  # the API's argument check
    grammar = constraint_grammar(Constraint.json(schema, "the schema"))  # the engine's
    assert len(compiled) == 1 and grammar
    # the key order is the schema's own: another order is another grammar
    check_schema({"type": "object", "properties": {"a": {"type": "string"},
                                                   "z": {"type": "integer"}},
                  "required": ["z", "a"], "x-test": "compiled-once"})
    assert len(compiled) == 2


def test_a_raw_prompts_structured_plan_is_made_once(llama_model: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import localrun.api as api
    import localrun.driver.sequence as sequence

    made: list[Any] = []
    real = sequence.raw_plan

    def counting(request: Any) -> Any:
        made.append(request)
        return real(request)

    monkeypatch.setattr(api, "raw_plan", counting)
    monkeypatch.setattr(sequence, "raw_plan", counting)
    out = llama_model.complete("The answer as JSON:", max_tokens=32, temperature=0,
                               schema={"type": "object", "properties": {
                                   "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                                   "required": ["n"], "additionalProperties": False})
    assert out.text and len(made) == 1
