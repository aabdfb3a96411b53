"""`localrun doctor` and `localrun plan` through the real console script."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from localrun.hardware import HardwareProfile, detect_hardware
from tests.conftest import localrun_cmd

PROFILES = Path(__file__).parent / "profiles"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*localrun_cmd(), *args], capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k != "LOCALRUN_DEBUG"},
                               "HF_HUB_OFFLINE": "1"})


def test_doctor_json_round_trips() -> None:
    r = cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    p = HardwareProfile.from_json(r.stdout)
    here = detect_hardware()
    assert (p.cpu.model, p.cpu.logical_cores, p.arch) == (here.cpu.model,
                                                          here.cpu.logical_cores, here.arch)
    assert HardwareProfile.from_json(p.to_json()) == p


def _cpu_vendor_by_hand() -> str | None:
    """vendor_id from /proc/cpuinfo with plain string operations (not localrun's parser)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return None


def _has_accelerator_device() -> bool:
    """Any GPU/NPU device node: then the host is not the CPU-only case below."""
    dev = Path("/dev")
    return any(dev.glob("nvidia[0-9]*")) or (dev / "dri").exists() or (dev / "kfd").exists() \
        or any(dev.glob("accel*"))


def _engine_installed(dist: str) -> bool:
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_doctor_reports_hardware_engines_choice_and_probes() -> None:
    """doctor's choice is what README's rule table says for this host, named outright."""
    vendor = _cpu_vendor_by_hand()
    if sys.platform != "linux" or vendor is None or _has_accelerator_device():
        pytest.skip("states the CPU-only rows of the rule table: needs a Linux host without "
                    "GPU/NPU device nodes (other hosts are covered by tests/profiles)")
    r = cli("doctor")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    model = next(line.partition(":")[2].strip() for line in
                 Path("/proc/cpuinfo").read_text().splitlines()
                 if line.partition(":")[0].strip() in ("model name", "Model"))
    assert f"CPU: {model} ({vendor})" in out
    assert "GPUs: none" in out
    for dist, name in (("llama-cpp-python", "llama.cpp"), ("openvino-genai", "openvino"),
                       ("onnxruntime-genai", "onnx"), ("mlx-lm", "mlx")):
        if _engine_installed(dist):
            assert re.search(rf"✓ {re.escape(name)} .* {re.escape(metadata.version(dist))}",
                             out), (name, out)
        else:
            assert f"✗ {name}" in out and "not installed: pip install" in out
    # README: "Intel CPU / Arc / NPU → OpenVINO GenAI …, then llama.cpp";
    # "any other CPU → llama.cpp" (GGUF Q4_K_M)
    if vendor == "GenuineIntel":
        assert "Host kind: intel" in out
        if _engine_installed("openvino-genai"):
            assert "Auto mode: openvino on CPU, openvino int4" in out, out
        else:
            assert "Auto mode: llama.cpp on cpu, gguf Q4_K_M" in out, out
            assert re.search(r"Better engine: pip install (-e )?'\S*\[openvino\]'", out), out
    else:
        assert "Host kind: cpu" in out
        assert "rule: CPU only → llama.cpp" in out
        expected = "llama.cpp" + ("" if _engine_installed("llama-cpp-python")
                                  else " (not installed)")
        assert f"Auto mode: {expected} on cpu, gguf Q4_K_M" in out, out
    assert "Probes" in out


def test_plan_for_described_machines() -> None:
    for name, backend in [("mac-m2-16gb", "mlx"), ("rtx4090", "exllamav2"),
                          ("dual-rtx3090", "exllamav3"), ("epyc-cpu", "llama.cpp")]:
        r = cli("plan", "qwen2.5:7b", "--hardware", str(PROFILES / f"{name}.json"), "--json")
        assert r.returncode == 0, r.stderr
        plan = json.loads(r.stdout)
        assert plan["backend"] == backend, (name, plan)
        assert any(f"chose {backend}" in x for x in plan["reasons"])


def test_plan_human_output_and_engines_flag() -> None:
    r = cli("plan", "qwen2.5:7b", "--hardware", str(PROFILES / "rtx4090.json"),
            "--engines", "llama.cpp")
    assert r.returncode == 0, r.stderr
    assert "Plan: llama.cpp on cuda:0" in r.stdout
    assert re.search(r"pip install (-e )?'\S*\[exllamav2\]'", r.stdout), r.stdout


def test_plan_local_gguf_with_wrong_backend_fails_with_fix(default_gguf: Path) -> None:
    r = cli("plan", str(default_gguf), "--backend", "mlx")
    assert r.returncode == 1
    assert "mlx cannot run GGUF" in r.stderr
    assert f"localrun run {default_gguf} --backend llama.cpp" in r.stderr


def test_plan_default_model_is_gguf() -> None:
    r = cli("plan", "smollm2:135m", "--json", "--engines", "llama.cpp")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert (plan["backend"], plan["format"], plan["quantization"]) == ("llama.cpp", "gguf",
                                                                       "Q4_1")
