"""The planned device reaches the engine, and each engine is told what it needs for it.

Issue 11, items 5, 6 (options), 7 and 9. GPU and NPU hosts are described by the profiles
in tests/profiles; the engine-facing calls run against the real CPU engines where this
machine has them, behind recorders, or against fakes that follow the engines' own API
(named in each test). What a GPU or NPU then does with those calls is untested here.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import localrun
from localrun.backends import (
    BACKENDS,
    ENGINE_OPTIONS,
    engine_options,
    engine_version,
    installed_build,
    is_installed,
)
from localrun.backends.base import LoadRequest, Prompt, Session
from localrun.backends.options import check_options
from localrun.errors import (
    ContextOverflowError,
    EngineUnavailableError,
    InvalidOptionError,
    LocalrunError,
    UnknownOptionError,
)
from localrun.hardware import HardwareProfile
from localrun.install import pip_install
from localrun.memory import gpu_offload, gpu_share, overhead_bytes
from localrun.planning.selection import PlanRequest, select
from localrun.types import ModelInfo
from tests.models import test_model

PROFILES = Path(__file__).parent / "profiles"
GiB = 2**30

requires_openvino = pytest.mark.skipif(
    importlib.util.find_spec("openvino_genai") is None,
    reason="openvino-genai is not installed (pip install -e '.[openvino]')")
requires_onnx = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime_genai") is None,
    reason="onnxruntime-genai is not installed (pip install -e '.[onnx]')")


def profile(name: str) -> HardwareProfile:
    return HardwareProfile.load(PROFILES / f"{name}.json")


# -- a fake engine that records what it was given ---------------------------------------


class RecordingSession(Session):
    def __init__(self, request: LoadRequest) -> None:
        self.request = request
        self.info = ModelInfo(backend="fake", engine_version="0", format=request.format,
                              quantization=None, path=request.path, context_length=256,
                              device=request.device)

    def encode_chat(self, messages: Any) -> Prompt:
        return Prompt([1])

    def encode_text(self, text: str) -> Prompt:
        return Prompt([1])

    def generate(self, *args: Any) -> Iterator[str]:
        yield from ()


@dataclass
class RecordingBackend:
    name: str
    requests: list[LoadRequest]

    def load(self, request: LoadRequest) -> Session:
        self.requests.append(request)
        return RecordingSession(request)


@pytest.fixture()
def host(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make this process believe it runs on a profiled machine with given engines."""
    import localrun.backends
    import localrun.hardware

    requests: list[LoadRequest] = []

    def use(name: str, installed: Mapping[str, str]) -> list[LoadRequest]:
        prof = profile(name)
        monkeypatch.setattr(localrun.hardware, "detect_hardware", lambda **kw: prof)
        monkeypatch.setattr(localrun.backends, "installed_backends", lambda: dict(installed))
        monkeypatch.setattr(localrun.backends, "get_backend",
                            lambda backend: RecordingBackend(backend, requests))
        return requests

    return use


@requires_openvino
def test_plan_and_load_on_an_intel_arc_host_hand_the_engine_the_gpu(host: Any) -> None:
    """`localrun plan` on a Core Ultra with an Arc A770 says GPU.1; load() passes GPU.1."""
    path = test_model("openvino-int4")
    requests = host("core-ultra-arc-npu", {"openvino": "2026.4.1.0", "llama.cpp": "0.3.36"})
    plan = localrun.plan(str(path), hardware=profile("core-ultra-arc-npu"),
                         installed={"openvino": "2026.4.1.0"})
    assert (plan.backend, plan.device) == ("openvino", "GPU.1")
    with localrun.load(str(path)) as m:
        assert requests[-1].device == "GPU.1" and m.info.device == "GPU.1"
    # the caller's device wins over the plan's
    with localrun.load(str(path), device="NPU"):
        assert requests[-1].device == "NPU"
    # an explicit backend gets the device the plan gives that backend here
    with localrun.load(str(path), backend="openvino"):
        assert requests[-1].device == "GPU.1"


@requires_onnx
@pytest.mark.parametrize(("version", "device"), [("0.18.0+cuda", "cuda"), ("0.18.0", "cpu")])
def test_onnx_gets_cuda_only_with_the_cuda_build(host: Any, version: str, device: str) -> None:
    path = test_model("onnx-int4")
    requests = host("rtx4090", {"onnx": version})
    with localrun.load(str(path)):
        assert requests[-1].device == device


# -- llama.cpp on a GPU smaller than the model: the plan says so (item 6) ---------------


def test_offload_share_arithmetic() -> None:
    w, kv = 8 * GiB, 2 * GiB
    over = overhead_bytes(w)  # 256 MiB + 5% of the weights
    assert gpu_share(w, kv, w + kv + over) == 1.0
    assert gpu_share(w, kv, over) == 0.0
    assert gpu_share(w, kv, over + 5 * GiB) == pytest.approx(0.5)
    half = gpu_offload(w, 31, kv, over + 5 * GiB)
    assert (half.layers, half.total, half.full) == (16, 32, False)  # 0.5 x (31 + output)
    assert gpu_offload(w, 31, kv, 100 * GiB).layers == 32
    assert "16 of 32 layers" in half.describe("cuda:0")


def test_plan_for_a_gguf_larger_than_the_free_vram_says_partial_offload() -> None:
    from localrun.memory import ModelShape

    shape = ModelShape(n_layers=48, n_kv_heads=8, head_dim=128, trained_context=32768)
    plan = select(profile("rtx3060"), {"llama.cpp": "0.3.36"},
                  PlanRequest(model="big.gguf", format="gguf", quantization="Q4_K_M",
                              weights_bytes=20 * GiB, shape=shape))
    assert (plan.backend, plan.device) == ("llama.cpp", "cuda:0")
    why = "\n".join(plan.reasons)
    assert "partial offload" in why and "of 49 layers go on the GPU" in why
    # a model that fits says nothing of the kind
    small = select(profile("rtx3060"), {"llama.cpp": "0.3.36"},
                   PlanRequest(model="s.gguf", format="gguf", weights_bytes=2 * GiB,
                               shape=shape))
    assert "partial offload" not in "\n".join(small.reasons)


def test_memory_budget_of_llama_cpp_on_a_gpu_includes_ram() -> None:
    from localrun.planning.plan import memory_budget

    p = profile("rtx3060")
    vram = memory_budget(p, "cuda:0")
    assert vram is not None and vram <= 12 * GiB
    assert memory_budget(p, "cuda:0", "llama.cpp") == vram + (p.ram_available or p.ram_total)
    assert memory_budget(p, "cuda:0", "exllamav2") == vram


# -- ONNX Runtime GenAI builds (item 7) ---------------------------------------------------


class FakeMetadata:
    """importlib.metadata as seen with only the named distributions installed."""

    PackageNotFoundError = metadata.PackageNotFoundError

    def __init__(self, versions: Mapping[str, str]) -> None:
        self.versions = dict(versions)

    def version(self, dist: str) -> str:
        if dist not in self.versions:
            raise metadata.PackageNotFoundError(dist)
        return self.versions[dist]


@pytest.mark.parametrize(("dists", "version"), [
    ({"onnxruntime-genai": "0.18.0"}, "0.18.0"),
    ({"onnxruntime-genai-cuda": "0.18.0"}, "0.18.0+cuda"),
    ({"onnxruntime-genai-directml": "0.17.1"}, "0.17.1+dml"),
    ({}, None),
])
def test_every_onnx_distribution_counts_as_installed(monkeypatch: pytest.MonkeyPatch,
                                                     dists: dict[str, str],
                                                     version: str | None) -> None:
    import localrun.backends
    from localrun.backends import installed

    monkeypatch.setattr(installed, "metadata", FakeMetadata(dists))
    assert engine_version("onnx") == version
    assert is_installed("onnx") is (version is not None)
    assert ("onnx" in localrun.backends.installed_backends()) is (version is not None)
    build = installed_build("onnx")
    assert (build.device if build else None) == (version.partition("+")[2] or None
                                                 if version else None)


def test_extras_for_the_onnx_gpu_builds_are_declared() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11+")
    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    for build in BACKENDS["onnx"].builds:
        assert any(req.startswith(build.dist) for req in extras[build.extra]), build


def test_plan_names_the_cuda_build_when_only_the_cpu_build_is_installed() -> None:
    plan = select(profile("rtx4090"), {"onnx": "0.18.0"}, PlanRequest(prefer="embed"))
    assert (plan.backend, plan.device) == ("onnx", "cpu")
    assert pip_install("onnx-cuda") in "\n".join(plan.reasons)
    nothing = select(profile("rtx4090"), {}, PlanRequest(prefer="embed"))
    assert nothing.install_hint and pip_install("onnx-cuda") in nothing.install_hint


class RecordingConfig:
    """onnxruntime_genai.Config, recording the provider calls before passing them on."""

    def __init__(self, og: Any, path: str, calls: list[tuple[Any, ...]]) -> None:
        self.real = og.Config(path)
        self.calls = calls

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.real, name)

        def record(*args: Any) -> Any:
            self.calls.append((name, *args))
            return method(*args)
        return record


@pytest.fixture()
def onnx_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    og = pytest.importorskip("onnxruntime_genai")
    calls: list[tuple[Any, ...]] = []
    real_config, real_model = og.Config, og.Model
    monkeypatch.setattr(og, "Config", lambda path: RecordingConfig(
        type("og", (), {"Config": real_config}), path, calls))
    monkeypatch.setattr(og, "Model", lambda cfg: real_model(
        cfg.real if isinstance(cfg, RecordingConfig) else cfg))
    return calls


@requires_onnx
def test_onnx_device_index_goes_to_the_provider_options(
        onnx_calls: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch) -> None:
    from localrun.backends import installed
    from localrun.backends.onnx import session as onnx_genai

    path = test_model("onnx-int4")
    # as with onnxruntime-genai-cuda installed; this CPU engine then fails to create the
    # CUDA session, after the provider calls (the engine's own source: SetProviderOption)
    monkeypatch.setattr(installed, "metadata",
                        FakeMetadata({"onnxruntime-genai-cuda": "0.18.0"}))
    with pytest.raises(LocalrunError):
        onnx_genai.BACKEND.load(LoadRequest(str(path), "onnx", device="cuda:1"))
    assert onnx_calls == [("clear_providers",), ("append_provider", "cuda"),
                          ("set_provider_option", "cuda", "device_id", "1")]


@requires_onnx
def test_onnx_cuda_on_the_cpu_build_is_refused_with_the_install_command(
        onnx_calls: list[tuple[Any, ...]]) -> None:
    from localrun.backends.onnx import session as onnx_genai

    assert installed_build("onnx") is None  # this machine has the CPU build
    path = test_model("onnx-int4")
    with pytest.raises(EngineUnavailableError) as info:
        onnx_genai.BACKEND.load(LoadRequest(str(path), "onnx", device="cuda:1"))
    e = info.value
    assert "onnxruntime-genai-cuda" in str(e)
    assert pip_install("onnx-cuda") in (e.hint or "")
    assert not onnx_calls  # refused before the engine was touched


@requires_onnx
def test_onnx_reports_the_device_genai_config_picks(tmp_path: Path) -> None:
    from localrun.backends.onnx import session as onnx_genai

    src = test_model("onnx-int4")
    with localrun.load(str(src), backend="onnx", context=256) as m:
        assert m.info.device == "cpu"  # provider_options is empty: the CPU
    # a folder built for CUDA: genai_config names the provider
    folder = tmp_path / src.name
    folder.mkdir()
    for f in src.iterdir():
        if f.name != "genai_config.json":
            (folder / f.name).symlink_to(f)
    cfg = json.loads((src / "genai_config.json").read_text())
    cfg["model"]["decoder"]["session_options"]["provider_options"] = [
        {"cuda": {"device_id": "1", "enable_cuda_graph": "0"}}]
    (folder / "genai_config.json").write_text(json.dumps(cfg))
    assert onnx_genai.config_device(cfg) == "cuda:1"
    with pytest.raises(EngineUnavailableError, match="device cuda:1 needs"):
        onnx_genai.BACKEND.load(LoadRequest(str(folder), "onnx"))


# -- OpenVINO on the NPU (item 9) ----------------------------------------------------------


def test_npu_lengths_fill_the_context() -> None:
    from localrun.backends.openvino.devices import npu_lengths

    assert npu_lengths(8192, {}) == (7168, 1024)
    assert npu_lengths(4096, {}) == (3072, 1024)
    assert npu_lengths(2048, {}) == (1024, 1024)  # above one chunk, prompts are whole chunks
    assert npu_lengths(256, {}) == (192, 64)
    for ctx in (128, 300, 1000, 3000, 5000, 8192, 32768):
        prompt, response = npu_lengths(ctx, {})
        assert prompt + response <= ctx and prompt % 64 == 0 and response % 64 == 0
        assert prompt <= 1024 or prompt % 1024 == 0
    # given as options, they win (rounded up the way NPUW rounds them)
    assert npu_lengths(8192, {"MAX_PROMPT_LEN": 1000, "MIN_RESPONSE_LEN": 100}) == (1024, 128)
    with pytest.raises(LocalrunError, match="too small for the NPU"):
        npu_lengths(100, {})


@pytest.fixture()
def ov_pipelines(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, dict[str, Any]]]:
    """LLMPipeline records (path, device, properties), then builds the real one on the
    CPU without the NPU-only properties (the CPU plugin rejects them)."""
    og = pytest.importorskip("openvino_genai")
    calls: list[tuple[str, str, dict[str, Any]]] = []
    real = og.LLMPipeline

    def pipeline(path: str, device: str, **props: Any) -> Any:
        calls.append((path, device, dict(props)))
        cpu = {k: v for k, v in props.items() if k not in ("MAX_PROMPT_LEN", "MIN_RESPONSE_LEN")}
        return real(path, "CPU", **cpu)

    monkeypatch.setattr(og, "LLMPipeline", pipeline)
    return calls


@requires_openvino
def test_npu_gets_prompt_and_response_lengths_from_the_context(
        ov_pipelines: list[tuple[str, str, dict[str, Any]]]) -> None:
    path = test_model("openvino-int4")
    with localrun.load(str(path), backend="openvino", device="NPU", context=4096) as m:
        _, device, props = ov_pipelines[-1]
        assert device == "NPU"
        assert (props["MAX_PROMPT_LEN"], props["MIN_RESPONSE_LEN"]) == (3072, 1024)
        assert m.info.context_length == 4096 and m.info.device == "NPU"
        assert m._session.batcher() is None  # no continuous batching on the NPU
        assert m.chat("Hi", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(ContextOverflowError) as info:
            m.chat("word " * 3500)  # < 4096 tokens, > the 3072 the NPU's prefill takes
        assert info.value.context == 3072
    # the default context (the model's, capped) drives them too
    with localrun.load(str(path), backend="openvino", device="npu") as m:
        _, device, props = ov_pipelines[-1]
        assert device == "NPU" and props["MAX_PROMPT_LEN"] + props["MIN_RESPONSE_LEN"] == 8192
        assert m.info.context_length == 8192
    # on other devices they are not set, and as options they are refused
    with localrun.load(str(path), backend="openvino", device="CPU", context=512) as m:
        assert "MAX_PROMPT_LEN" not in m._session.load_properties
    with pytest.raises(LocalrunError, match="NPU only"):
        localrun.load(str(path), backend="openvino", device="CPU", MAX_PROMPT_LEN=2048)


@requires_openvino
def test_openvino_device_names(ov_pipelines: list[tuple[str, str, dict[str, Any]]]) -> None:
    from localrun.backends.openvino.devices import ov_device

    assert [ov_device(d) for d in (None, "cpu", "gpu", "GPU.1", "gpu:1", "npu", "AUTO:GPU,CPU")
            ] == ["CPU", "CPU", "GPU", "GPU.1", "GPU.1", "NPU", "AUTO:GPU,CPU"]
    with pytest.raises(LocalrunError, match="Unknown device 'cuda:0'"):
        ov_device("cuda:0")


# -- engine options: one table, every backend refuses what it does not know -------------


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_backend_lists_its_options(backend: str) -> None:
    opts = engine_options(backend)
    assert isinstance(opts, dict)
    if backend in ENGINE_OPTIONS:
        with pytest.raises(UnknownOptionError) as info:
            check_options(BACKENDS[backend], {"no_such_option": 1})
        hint = info.value.hint or ""
        assert all(name in hint for name in opts) if opts else "takes no engine options" in hint
    else:  # ExLlamaV2/V3 validate with their own table (localrun.backends.exllama.options)
        from localrun.backends.exllama.options import parse_options

        with pytest.raises(InvalidOptionError) as info:
            parse_options(backend, {"no_such_option": 1})
        assert all(name in str(info.value) for name in opts)


@pytest.mark.parametrize(("backend", "fixture", "option"), [
    ("mlx", "mlx-4bit", {"temperature": 0.5}),
    ("openvino", "openvino-int4", {"KV_CACHE_PRECISON": "u8"}),
    ("onnx", "onnx-int4", {"provider": "cuda"}),
])
def test_engines_refuse_unknown_options_before_loading(backend: str, fixture: str,
                                                       option: dict[str, Any]) -> None:
    from localrun.backends import get_backend

    if not is_installed(backend):
        pytest.skip(f"{BACKENDS[backend].title} is not installed")
    path = test_model(fixture)
    fmt = {"mlx-4bit": "mlx", "openvino-int4": "openvino", "onnx-int4": "onnx"}[fixture]
    with pytest.raises(UnknownOptionError) as info:
        get_backend(backend).load(LoadRequest(str(path), fmt, options=option))
    assert next(iter(option)) in str(info.value)
    if backend == "openvino":
        assert "did you mean KV_CACHE_PRECISION" in str(info.value)


def test_llama_kv_cache_choices_are_the_types_it_maps() -> None:
    from localrun.backends.llama_cpp.facts import KV_TYPES

    assert set(ENGINE_OPTIONS["llama.cpp"]["kv_cache"][0]) == set(KV_TYPES)


def test_option_values_are_checked() -> None:
    assert check_options(BACKENDS["llama.cpp"], {"flash_attn": "auto", "kv_cache": "Q8_0",
                                       "tensor_split": (3, 1)}) == {
        "flash_attn": "auto", "kv_cache": "q8_0", "tensor_split": [3.0, 1.0]}
    for bad in ({"flash_attn": "maybe"}, {"kv_cache": "q5"}, {"n_gpu_layers": 1.5},
                {"use_mmap": "yes"}, {"tensor_split": [1, -1]}):
        with pytest.raises(InvalidOptionError):
            check_options(BACKENDS["llama.cpp"], bad)
    assert check_options(BACKENDS["openvino"], {"PERFORMANCE_HINT": "latency"}) == {
        "PERFORMANCE_HINT": "LATENCY"}
