"""`localrun doctor` and `localrun plan` through the real console script."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from localrun.backends import installed_backends
from localrun.hardware import HardwareProfile, detect_hardware
from localrun.selection import PlanRequest, select
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


def test_doctor_reports_hardware_engines_choice_and_probes() -> None:
    r = cli("doctor")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    here = detect_hardware()
    assert here.cpu.model and here.cpu.model in out
    assert "Engines" in out
    for name, version in installed_backends().items():
        assert name in out and version in out
    expected = select(here, installed_backends(), PlanRequest())
    assert f"Auto mode: {expected.backend}" in out
    for note in here.notes:
        assert note in out


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
    assert "pip install 'localrun[exllamav2]'" in r.stdout


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
