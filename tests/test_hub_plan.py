"""`localrun plan` and `localrun run` with Hub names, against the fake Hub (no internet)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hubserver import BASE, HubFixture, start

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "tests" / "profiles"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    yield from start(monkeypatch, tmp_path)


def _cli(fake: HubFixture, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from localrun.cli import main; main()", *args],
                          cwd=ROOT, env=fake.env(), capture_output=True, text=True, timeout=120)


def test_plan_for_a_mac_names_the_mlx_4bit_repo(fake: HubFixture) -> None:
    r = _cli(fake, "plan", BASE, "--hardware", str(PROFILES / "mac-m2-16gb.json"), "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert (plan["backend"], plan["format"]) == ("mlx", "mlx")
    assert plan["repo"] == "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
    assert plan["memory"]["fits"] is True and plan["files"]
    # a plan reads config.json for the KV-cache size, and downloads no weights
    fetched = [r["path"] for r in fake.hub.resolve_requests("GET")]
    assert not [p for p in fetched if p.endswith((".safetensors", ".gguf"))], fetched


def test_plan_on_this_cpu_host_names_the_gguf_file_and_fit(fake: HubFixture) -> None:
    r = _cli(fake, "plan", BASE, "--hardware", str(PROFILES / "epyc-cpu.json"))
    assert r.returncode == 0, r.stderr
    assert "llama.cpp" in r.stdout
    assert "qwen2.5-0.5b-instruct-q4_k_m.gguf" in r.stdout
    assert "Fit" in r.stdout and "fits" in r.stdout


def test_plan_shows_a_model_too_large_with_numbers(fake: HubFixture) -> None:
    r = _cli(fake, "plan", "bigorg/Huge-70B-GGUF", "--hardware",
             str(PROFILES / "mac-m1-8gb.json"), "--backend", "llama.cpp", "--json")
    assert r.returncode == 0, r.stderr
    mem = json.loads(r.stdout)["memory"]
    assert mem["fits"] is False and "does NOT fit" in mem["verdict"]
    assert mem["total_bytes"] > mem["budget"]


def test_run_refuses_a_model_too_large_before_downloading(fake: HubFixture) -> None:
    r = _cli(fake, "run", "bigorg/Huge-70B-GGUF", "hi")
    assert r.returncode == 1
    assert "error:" in r.stderr and "available" in r.stderr and "Traceback" not in r.stderr
    assert fake.hub.resolve_requests("GET") == []
