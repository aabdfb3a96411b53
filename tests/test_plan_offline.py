"""`localrun plan` without the Hub still says how much memory a model needs, what the
figure rests on, and whether it fits (issue 25, item 3); `--hardware` takes the name of
an example machine shipped with localrun (item 2).

The CLI runs with HF_HUB_OFFLINE=1 and an empty private cache; the plan made from an
earlier download runs in process against the stand-in Hub (tests/hubserver.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from localrun.hardware import HardwareProfile
from localrun.hardware.profile import PROFILES, profile_names
from localrun.hub import pulls
from tests.conftest import localrun_cmd
from tests.hubserver import BASE, SMOLLM2, HubFixture, add_smollm2, start

GiB = 2**30
EXL2_72B = "bartowski/Qwen2.5-72B-Instruct-exl2"


@pytest.fixture
def offline_env(tmp_path: Path) -> dict[str, str]:
    """HF_HUB_OFFLINE=1 over an empty Hugging Face cache and pull records of its own."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGING", "LOCALRUN_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               LOCALRUN_HOME=str(tmp_path / "lr"))
    return env


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*localrun_cmd(), *args], capture_output=True, text=True,
                          timeout=120, env=env)


def _plan(env: dict[str, str], *args: str) -> dict[str, object]:
    r = cli(env, "plan", *args, "--json")
    assert r.returncode == 0, r.stderr
    plan: dict[str, object] = json.loads(r.stdout)
    return plan


# -- a model on disk: its own files ---------------------------------------------------------

def test_a_local_gguf_gets_memory_and_fit_offline(offline_env: dict[str, str],
                                                  default_gguf: Path) -> None:
    plan = _plan(offline_env, str(default_gguf), "--hardware", "epyc-cpu")
    mem = plan["memory"]
    assert isinstance(mem, dict), plan
    assert mem["weights_bytes"] == default_gguf.stat().st_size
    assert mem["kv_known"] and mem["kv_cache_bytes"] > 0  # the shape in the GGUF header
    assert mem["context"] == 8192 and mem["fits"] is True
    assert str(default_gguf) in mem["estimated_from"]
    assert "GGUF header" in mem["estimated_from"]
    out = cli(offline_env, "plan", str(default_gguf), "--hardware", "epyc-cpu").stdout
    assert "Memory: weights 0.09 GiB, kv cache 0.18 GiB" in out
    assert f"Estimated from: the files of {default_gguf}" in out
    assert "Fit: fits: needs 0.33 GiB of " in out


def test_the_embedded_default_is_sized_too(offline_env: dict[str, str]) -> None:
    mem = _plan(offline_env)["memory"]
    assert isinstance(mem, dict) and mem["fits"] is True and mem["kv_known"] is True


# -- a Hub name, the Hub out of reach: what the catalog or the name says ---------------------

def test_a_72b_exl2_on_an_rtx_4090_does_not_fit(offline_env: dict[str, str]) -> None:
    plan = _plan(offline_env, EXL2_72B, "--hardware", "rtx4090")
    assert plan["backend"] == "exllamav2"
    mem = plan["memory"]
    assert isinstance(mem, dict) and mem["fits"] is False
    assert mem["weights_bytes"] == 72e9 * 4.0 / 8  # 72B at the plan's 4.0 bpw
    assert "72B" in mem["estimated_from"] and "4.0bpw" in mem["estimated_from"]
    out = cli(offline_env, "plan", EXL2_72B, "--hardware", "rtx4090").stdout
    assert "Fit: does NOT fit: needs at least 35.45 GiB of 22.80 GiB" in out
    assert "warning: the model does not fit this device's memory" in out
    assert "Estimated from: the parameter count in its name (72B) at 4.0bpw" in out


def test_the_offline_note_names_hf_endpoint_not_a_pull(offline_env: dict[str, str]) -> None:
    """A pull needs the Hub too, and plans for this machine, not a described one."""
    plan = _plan(offline_env, "qwen2.5:7b", "--hardware", "mac-m2-16gb")
    notes = " ".join(str(n) for n in plan["notes"])  # type: ignore[attr-defined]
    assert "HF_ENDPOINT" in notes and "mirror or proxy" in notes
    assert "localrun pull" not in notes
    mem = plan["memory"]
    assert isinstance(mem, dict) and mem["fits"] is True  # 7B at 4 bits in 11.2 GiB
    assert "the parameter count in its name (7B) at 4bit" in mem["estimated_from"]


def test_pull_offline_does_not_say_pull_first(offline_env: dict[str, str]) -> None:
    r = cli(offline_env, "pull", "qwen2.5:7b")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: HF_HUB_OFFLINE=1 is set")
    assert "localrun pull" not in r.stderr
    assert lines[1] == ("  hint: a download needs the Hub: unset HF_HUB_OFFLINE, or set "
                        "HF_ENDPOINT=URL to use a mirror or proxy of it, and run this "
                        "command again")


def test_the_catalog_sizes_a_model_its_name_does_not(offline_env: dict[str, str]) -> None:
    mem = _plan(offline_env, "phi4-mini", "--hardware", "epyc-cpu")["memory"]
    assert isinstance(mem, dict)
    assert "the catalog's parameter count (3.8B)" in mem["estimated_from"]
    assert mem["weights_bytes"] == int(3.8e9 * 4.85 / 8)  # Q4_K_M


# -- a Hub name downloaded earlier (for another engine): its files ---------------------------

@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    monkeypatch.delenv(pulls.HOME_ENV, raising=False)
    yield from start(monkeypatch, tmp_path)


def test_a_model_pulled_for_this_machine_sizes_the_plan_for_a_mac(
        fake: HubFixture, default_gguf: Path) -> None:
    from localrun import hub
    from localrun.planning.plan import plan

    add_smollm2(fake.hub, default_gguf)
    hub.fetch(hub.plan_fetch(SMOLLM2, backend="llama.cpp"))
    fake.offline()
    mac = HardwareProfile.find("mac-m2-16gb")
    p = plan(SMOLLM2, hardware=mac, installed={"mlx": "test"})
    assert p.backend == "mlx" and p.memory is not None
    source = p.memory["estimated_from"]
    assert "135M parameters counted in smollm2-135m-instruct-q4_1.gguf" in source
    assert "the shape in the GGUF header of smollm2-135m-instruct-q4_1.gguf" in source
    assert p.memory["kv_known"] is True
    from localrun.formats.gguf import read_gguf

    assert p.memory["weights_bytes"] == int(read_gguf(default_gguf).parameters * 4.0 / 8)


def test_a_pulled_gguf_without_tensors_still_gives_the_shape(fake: HubFixture) -> None:
    """The stand-in Hub's GGUFs are headers only: the count comes from the name
    (Qwen2.5-0.5B), the KV cache from the pulled header (24 layers, 2 KV heads of 64)."""
    from localrun import hub
    from localrun.planning.plan import plan

    hub.fetch(hub.plan_fetch(BASE, backend="llama.cpp"))
    fake.offline()
    p = plan(BASE, hardware=HardwareProfile.find("mac-m2-16gb"),
             installed={"mlx": "test"})
    assert p.memory is not None and p.memory["kv_known"] is True
    assert p.memory["kv_cache_bytes"] == 24 * 2 * 64 * 2 * 2 * 8192  # mlx: the model's f16
    assert "the parameter count in its name (500M)" in p.memory["estimated_from"]


# -- --hardware NAME ---------------------------------------------------------------------------

def test_hardware_takes_a_shipped_profile_by_name(offline_env: dict[str, str]) -> None:
    assert {"mac-m2-16gb", "rtx4090", "epyc-cpu"} <= set(profile_names())
    by_name = _plan(offline_env, "qwen2.5:7b", "--hardware", "rtx4090", "--no-hub")
    by_path = _plan(offline_env, "qwen2.5:7b", "--hardware", str(PROFILES / "rtx4090.json"),
                    "--no-hub")
    assert by_name == by_path and by_name["backend"] == "exllamav2"
    assert HardwareProfile.find("mac-m2-16gb.json") == HardwareProfile.find("mac-m2-16gb")


def test_an_unknown_profile_name_lists_the_known_ones(offline_env: dict[str, str]) -> None:
    r = cli(offline_env, "plan", "qwen2.5:7b", "--hardware", "mac16")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: No hardware profile 'mac16'")
    assert all(name in lines[1] for name in profile_names())
    assert "model file" not in r.stderr.lower()


def test_plan_help_lists_the_profile_names() -> None:
    r = subprocess.run([*localrun_cmd(), "plan", "--help"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "COLUMNS": "250"})
    text = " ".join(r.stdout.split())
    assert all(name in text for name in profile_names())
