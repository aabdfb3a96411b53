"""Selection for realistic machines (tests/profiles/*.json): backend, device, and the why."""

from __future__ import annotations

from pathlib import Path

import pytest

from localrun.backends import BACKENDS
from localrun.errors import FormatMismatchError, NoSuitableEngineError
from localrun.hardware import HardwareProfile
from localrun.install import pip_install
from localrun.planning.selection import Plan, PlanRequest, select

PROFILES = Path(__file__).parent / "profiles"
ALL = {name: "1.0" for name in BACKENDS}


def profile(name: str) -> HardwareProfile:
    return HardwareProfile.load(PROFILES / f"{name}.json")


def text(plan: Plan) -> str:
    return "\n".join(plan.reasons + plan.notes)


# (profile, backend, device, host kind, words the reasons must contain)
EXPECTED = [
    ("mac-m1-8gb", "mlx", "metal", "apple", ["Apple M1", "Apple Silicon"]),
    ("mac-m2-16gb", "mlx", "metal", "apple", ["16.0 GiB unified memory"]),
    ("mac-m3max-64gb", "mlx", "metal", "apple", ["Apple M3 Max"]),
    ("mac-m2ultra-128gb", "mlx", "metal", "apple", ["128.0 GiB"]),
    ("rtx3060", "exllamav2", "cuda:0", "nvidia", ["RTX 3060", "one NVIDIA GPU"]),
    ("rtx4090", "exllamav2", "cuda:0", "nvidia",
     ["compute capability 8.9",
      "discrete NVIDIA GeForce RTX 4090 is preferred over the integrated"]),
    ("rtx5090", "exllamav2", "cuda:0", "nvidia", ["RTX 5090", "32.0 GiB"]),
    ("dual-rtx3090", "exllamav3", "cuda:0,1", "nvidia-multi", ["splits over 2 GPUs",
                                                               "two or more NVIDIA GPUs"]),
    ("core-ultra-arc-npu", "openvino", "GPU.1", "intel",
     ["discrete GPU Intel Arc A770", "NPU (Meteor Lake) not chosen"]),
    ("xeon-cpu", "openvino", "CPU", "intel", ["no Intel GPU found", "Xeon"]),
    ("epyc-cpu", "llama.cpp", "cpu", "cpu", ["CPU only", "EPYC", "96"]),
    ("raspberry-pi5", "llama.cpp", "cpu", "cpu", ["aarch64", "neon"]),
    # a 7B model fits on one H100 / MI300X: vLLM with tensor_parallel_size=1
    ("8xh100", "vllm", "cuda:0", "datacenter", ["vLLM or SGLang", "8 ×",
                                                "tensor_parallel_size=1", "uses 1 of the 8"]),
    ("mi300x8", "vllm", "rocm:0", "datacenter", ["vLLM or SGLang", "MI300X",
                                                 "tensor_parallel_size=1"]),
    ("nvidia-libs-no-gpu", "llama.cpp", "cpu", "cpu", ["no GPU"]),
    ("gtx1080ti-pascal-x2", "exllamav2", "cuda:0,1", "nvidia-multi",
     ["compute capability 6.1; exllamav3 needs >= 8.0"]),
    ("gtx-titan-kepler", "llama.cpp", "cpu", "nvidia",
     ["compute capability 3.5; exllamav2 needs >= 6.0", "llama.cpp needs >= 5.0"]),
    ("mac-rosetta", "llama.cpp", "cpu", "apple", ["Rosetta", "arm64 Python"]),
]


@pytest.mark.parametrize(("name", "backend", "device", "host", "words"), EXPECTED,
                         ids=[e[0] for e in EXPECTED])
def test_profile_picks_expected_backend(name: str, backend: str, device: str, host: str,
                                        words: list[str]) -> None:
    plan = select(profile(name), ALL, PlanRequest(model="qwen2.5:7b"))
    assert (plan.backend, plan.device, plan.host) == (backend, device, host)
    assert plan.installed and plan.install_hint is None
    why = text(plan)
    assert f"chose {backend}" in why
    for w in words:
        assert w in why, f"{w!r} missing from:\n{why}"
    # every backend passed over appears in the reasons with its why
    for b, w in plan.passed_over:
        assert f"passed over {b}: {w}" in plan.reasons


def test_at_least_twelve_profiles() -> None:
    assert len(list(PROFILES.glob("*.json"))) >= 12
    assert {e[0] for e in EXPECTED} == {p.stem for p in PROFILES.glob("*.json")}


@pytest.mark.parametrize(("name", "installed", "backend", "extra"), [
    ("rtx4090", {"llama.cpp": "0.3"}, "llama.cpp", "exllamav2"),
    ("dual-rtx3090", {"exllamav2": "0.3", "llama.cpp": "0.3"}, "exllamav2", "exllamav3"),
    ("mac-m2-16gb", {"llama.cpp": "0.3"}, "llama.cpp", "mlx"),
    ("xeon-cpu", {"llama.cpp": "0.3"}, "llama.cpp", "openvino"),
])
def test_preferred_engine_missing_falls_back_with_install_hint(
        name: str, installed: dict[str, str], backend: str, extra: str) -> None:
    plan = select(profile(name), installed, PlanRequest())
    assert plan.backend == backend and plan.installed
    assert plan.install_hint is not None and pip_install(extra) in plan.install_hint
    assert (extra, f"not installed ({pip_install(extra)})") in plan.passed_over


def test_nothing_installed_still_plans_and_says_what_to_install() -> None:
    plan = select(profile("rtx4090"), {}, PlanRequest())
    assert plan.backend == "exllamav2" and not plan.installed
    assert plan.install_hint and pip_install("exllamav2") in plan.install_hint


def test_local_format_limits_candidates_to_native_engines() -> None:
    plan = select(profile("rtx4090"), ALL, PlanRequest(model="m.gguf", format="gguf",
                                                        quantization="Q4_K_M"))
    assert plan.backend == "llama.cpp" and plan.device == "cuda:0"
    assert plan.quantization == "Q4_K_M" and plan.format == "gguf"
    assert "only engines that run GGUF natively are candidates" in text(plan)
    assert ("exllamav2", "cannot run GGUF (runs it natively: llama.cpp)") in plan.passed_over
    assert "DGGML_CUDA=on" in text(plan)


def test_auto_never_picks_a_loads_pairing() -> None:
    # OpenVINO loads some GGUF files, but auto mode must not pick it on an Intel host.
    plan = select(profile("core-ultra-arc-npu"), ALL,
                  PlanRequest(format="gguf", architecture="llama", quantization="Q4_0"))
    assert plan.backend == "llama.cpp" and plan.support == "native"
    assert any(b == "openvino" and "never picks a non-native" in w for b, w in plan.passed_over)


def test_mlx_model_on_linux_uses_mlx_cpu() -> None:
    plan = select(profile("epyc-cpu"), ALL, PlanRequest(format="mlx", quantization="4bit"))
    assert (plan.backend, plan.device) == ("mlx", "cpu")
    assert "slow" in text(plan)


def test_exl2_on_a_mac_has_no_engine_and_says_why() -> None:
    with pytest.raises(NoSuitableEngineError) as info:
        select(profile("mac-m2-16gb"), ALL, PlanRequest(format="exl2"))
    msg = str(info.value)
    assert "EXL2" in msg and "exllamav2: needs an NVIDIA GPU" in msg
    assert "localrun plan" in (info.value.hint or "")


def test_too_small_gpu_for_model_is_passed_over_with_numbers() -> None:
    plan = select(profile("rtx3060"), ALL, PlanRequest(weights_bytes=20 * 1024**3))
    assert plan.backend == "llama.cpp"
    why = dict(plan.passed_over)["exllamav2"]
    assert "23.0 GiB" in why and "12.0 GiB" in why


def test_embed_preference_puts_onnx_first() -> None:
    # with the CUDA build of ONNX Runtime GenAI installed (engine_version labels it)
    plan = select(profile("rtx4090"), {**ALL, "onnx": "0.18.0+cuda"}, PlanRequest(prefer="embed"))
    assert (plan.backend, plan.device) == ("onnx", "cuda")
    plan = select(profile("epyc-cpu"), ALL, PlanRequest(prefer="embed"))
    assert (plan.backend, plan.device) == ("onnx", "cpu")
    assert "app embedding" in text(plan)


def test_explicit_backend_wins_but_is_compat_checked() -> None:
    plan = select(profile("rtx4090"), ALL, PlanRequest(backend="llama.cpp"))
    assert plan.backend == "llama.cpp" and plan.device == "cuda:0"
    assert "auto mode would pick exllamav2" in text(plan)
    with pytest.raises(FormatMismatchError) as info:
        select(profile("rtx4090"), ALL, PlanRequest(model="m.gguf", backend="mlx",
                                                    format="gguf"))
    assert "--backend llama.cpp" in (info.value.hint or "")


def test_explicit_backend_that_cannot_run_here_is_planned_with_a_warning() -> None:
    plan = select(profile("epyc-cpu"), ALL, PlanRequest(backend="exllamav2"))
    assert plan.backend == "exllamav2"
    assert any("needs an NVIDIA GPU" in n and "will fail" in n for n in plan.notes)


def test_plan_serializes() -> None:
    plan = select(profile("dual-rtx3090"), ALL, PlanRequest(model="x"))
    d = plan.to_dict()
    assert d["backend"] == "exllamav3" and d["repo"] is None and d["memory"] is None
    assert isinstance(d["reasons"], list)
    assert '"backend": "exllamav3"' in plan.to_json()


@pytest.mark.parametrize(("model", "weights", "tp"), [
    ("Qwen/Qwen2.5-72B-Instruct", None, 4),  # ~145 GB bf16 from the name: 4 × 80 GB
    ("qwen2.5:7b", None, 1),
    ("org/big", 400 * 10**9, 8),
])
def test_datacenter_plans_vllm_with_a_tensor_parallel_size_that_fits(
        model: str, weights: int | None, tp: int) -> None:
    plan = select(profile("8xh100"), ALL, PlanRequest(model=model, weights_bytes=weights))
    assert plan.backend == "vllm" and plan.format == "hf"
    assert plan.device == "cuda:" + ",".join(map(str, range(tp)))
    assert f"tensor_parallel_size={tp}" in text(plan)
    # without vLLM installed: today's local plan, with vLLM as the install hint
    local = select(profile("8xh100"), {k: v for k, v in ALL.items() if k != "vllm"},
                   PlanRequest(model=model, weights_bytes=weights))
    assert local.backend != "vllm" and "LOCALRUN_VLLM_PYTHON" in str(local.install_hint)


def test_too_big_for_the_node_passes_vllm_over() -> None:
    plan = select(profile("8xh100"), ALL, PlanRequest(model="org/huge",
                                                      weights_bytes=2000 * 10**9))
    assert plan.backend != "vllm"
    assert any(b == "vllm" and "pipeline_parallel_size" in w for b, w in plan.passed_over)


def test_explicit_vllm_on_a_cpu_host() -> None:
    plan = select(profile("epyc-cpu"), ALL, PlanRequest(model="m", backend="vllm",
                                                        format="hf"))
    assert (plan.backend, plan.device) == ("vllm", "cpu")
