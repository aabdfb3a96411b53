"""Pull by a name, run by the same name offline (issue 11, item 2).

What a download resolved a name to (alias or base repo id, engine, quant -> repo,
commit, subfolder, files) is written down next to the HF cache (localrun.hub.pulls) and
planned from when the Hub is out of reach. In-process tests use the standard fake Hub;
the end-to-end tests pull a real SmolLM2 GGUF from it and answer with llama.cpp.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from localrun import hub
from localrun.errors import OfflineMissingError
from localrun.hardware import HardwareProfile
from localrun.hub import pulls
from tests.conftest import requires_llama
from tests.hubserver import BASE, SMOLLM2, FakeFile, HubFixture, add_smollm2, hub_env, start

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "tests" / "profiles"
GGUF_REPO = f"{BASE}-GGUF"
GiB = 2**30


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    monkeypatch.delenv(pulls.HOME_ENV, raising=False)
    yield from start(monkeypatch, tmp_path)


def _records(fake: HubFixture) -> list[pulls.PullRecord]:
    return pulls.load(fake.home / "hub")


# --- in process: the record, and plans made from it ------------------------------------------

def test_download_records_what_the_name_resolved_to(fake: HubFixture) -> None:
    path = hub.fetch(hub.plan_fetch(BASE, backend="llama.cpp"))
    (rec,) = _records(fake)
    assert (rec.name, rec.backend, rec.quant) == (BASE, "llama.cpp", None)
    assert (rec.repo, rec.format, rec.variant_quant) == (GGUF_REPO, "gguf", "Q4_K_M")
    assert rec.commit and rec.primary == path.name and rec.files == (path.name,)
    # Next to the cache it describes (HF_HOME/hub -> HF_HOME/localrun/pulls.json).
    stored = fake.home / "localrun" / "pulls.json"
    assert pulls.records_path(fake.home / "hub") == stored
    assert json.loads(stored.read_text())["pulls"][0]["repo"] == GGUF_REPO
    assert not list(stored.parent.glob(".pulls-*"))  # the temporary file was renamed


def test_localrun_home_moves_the_records(fake: HubFixture, tmp_path: Path) -> None:
    fake.monkeypatch.setenv(pulls.HOME_ENV, str(tmp_path / "lr"))
    hub.fetch(hub.plan_fetch("qwen2.5:0.5b:Q8_0", backend="llama.cpp"))
    assert (tmp_path / "lr" / "pulls.json").is_file()
    assert not (fake.home / "localrun").exists()
    (rec,) = _records(fake)
    assert rec.display == "qwen2.5:0.5b:Q8_0" and rec.variant_quant == "Q8_0"


@pytest.mark.parametrize(("backend", "repo"), [
    ("llama.cpp", GGUF_REPO),
    ("openvino", "OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov"),
    ("mlx", "mlx-community/Qwen2.5-0.5B-Instruct-4bit"),
])
def test_base_repo_plans_offline_from_what_was_pulled(fake: HubFixture, backend: str,
                                                      repo: str) -> None:
    online = hub.fetch(hub.plan_fetch(BASE, backend=backend))
    fake.offline()
    fake.hub.requests.clear()
    plan = hub.plan_fetch(BASE, backend=backend, memory_budget_bytes=8 * GiB)
    assert (plan.source, plan.repo, plan.backend) == ("cache", repo, backend)
    assert any("was downloaded for" in line for line in plan.reasons), plan.reasons
    assert hub.fetch(plan) == online
    assert fake.hub.requests == []


def test_base_repo_offline_without_a_record_is_derived_from_the_cache(
        fake: HubFixture) -> None:
    # Pulled under another name (the variant repo itself): the base still finds it.
    online = hub.fetch(hub.plan_fetch(f"{GGUF_REPO}:Q4_K_M", backend="llama.cpp"))
    fake.offline()
    plan = hub.plan_fetch(BASE, backend="llama.cpp")
    assert plan.repo == GGUF_REPO and hub.fetch(plan) == online
    # An explicit variant repo is never stood in for by another publisher's.
    with pytest.raises(OfflineMissingError):
        hub.plan_fetch("bartowski/Qwen2.5-0.5B-Instruct-GGUF", backend="llama.cpp")


def test_offline_quant_must_match_what_was_pulled(fake: HubFixture) -> None:
    hub.fetch(hub.plan_fetch("qwen2.5:0.5b", backend="llama.cpp", quant="Q8_0"))
    fake.offline()
    plan = hub.plan_fetch("qwen2.5:0.5b", backend="llama.cpp")  # no quant: what was pulled
    assert plan.quant == "Q8_0"
    assert hub.plan_fetch("qwen2.5:0.5b:q8_0", backend="llama.cpp").quant == "Q8_0"
    with pytest.raises(OfflineMissingError, match="Q5_K_M"):
        hub.plan_fetch("qwen2.5:0.5b:Q5_K_M", backend="llama.cpp")


def test_removing_the_files_drops_the_record(fake: HubFixture) -> None:
    hub.fetch(hub.plan_fetch(BASE, backend="llama.cpp"))
    # `localrun rm BASE` finds the variant the base resolved to (no catalog names it).
    removal = hub.plan_removal(BASE)
    assert removal.repos == (GGUF_REPO,)
    hub.remove(removal)
    assert _records(fake) == []
    fake.offline()
    with pytest.raises(OfflineMissingError):
        hub.plan_fetch(BASE, backend="llama.cpp")


def test_list_shows_the_pulled_names(fake: HubFixture) -> None:
    hub.fetch(hub.plan_fetch(BASE, backend="llama.cpp"))
    hub.fetch(hub.plan_fetch("qwen2.5:0.5b", backend="llama.cpp"))
    rows = {m.name: m for m in hub.cached_models()}
    assert set(rows[f"{GGUF_REPO}:Q4_K_M"].pulled_as) == {BASE, "qwen2.5:0.5b"}


def test_auto_mode_offline_uses_the_engine_the_name_was_pulled_for(fake: HubFixture) -> None:
    """On an Intel host auto mode picks OpenVINO; the name was pulled for llama.cpp."""
    from localrun.planning.plan import plan_model

    intel = HardwareProfile.load(PROFILES / "xeon-cpu.json")
    engines = {"openvino": "test", "llama.cpp": "test"}
    hub.fetch(hub.plan_fetch(BASE, backend="llama.cpp"))
    fake.offline()
    planned = plan_model(BASE, hardware=intel, installed=engines)
    chosen, fp = planned.plan, planned.download
    assert fp is not None and (chosen.backend, fp.repo) == ("llama.cpp", GGUF_REPO)
    assert any("downloaded for llama.cpp" in line for line in fp.reasons), fp.reasons
    # An explicit engine keeps its word: nothing cached for OpenVINO is an error.
    with pytest.raises(OfflineMissingError):
        plan_model(BASE, hardware=intel, installed=engines, backend="openvino")


def test_default_name_with_another_quant_is_the_catalog_alias(fake: HubFixture) -> None:
    """smollm2:135m is the packaged GGUF (Q4_1); asked for with another quant, the alias."""
    from localrun.planning.plan import plan_model
    from tests.hubserver import FakeRepo, gguf_bytes

    fake.hub.add(FakeRepo("bartowski/SmolLM2-135M-Instruct-GGUF", {"main": {
        f"SmolLM2-135M-Instruct-{q}.gguf": FakeFile(gguf_bytes(quant=q, arch="llama",
                                                               pad=2000), lfs=True)
        for q in ("Q4_K_M", "Q8_0")}}, tags=["gguf", f"base_model:quantized:{SMOLLM2}"]))
    plan = hub.plan_fetch("smollm2:135m", backend="llama.cpp", quant="Q8_0")
    assert (plan.repo, plan.quant, plan.source) == (
        "bartowski/SmolLM2-135M-Instruct-GGUF", "Q8_0", "hub")
    fp = plan_model("smollm2:135m", quant="Q8_0", installed={"llama.cpp": "test"},
                    hardware=HardwareProfile.load(PROFILES / "epyc-cpu.json")).download
    assert fp is not None and fp.repo == plan.repo and fp.quant == "Q8_0"
    # Its own quant, or none: the packaged file, nothing to download.
    for quant in (None, "q4_1"):
        local = hub.plan_fetch("smollm2:135m", backend="llama.cpp", quant=quant)
        assert local.source == "local" and local.local_path


# --- end to end: the CLI, a real model, the real engine -----------------------------------------

def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from localrun.cli import main; main()", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _ask(env: dict[str, str], name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return _cli(env, "run", name, "What is 2+2?", "--max-tokens", "8", "--temperature", "0",
                *extra)


@pytest.fixture
def smol(fake: HubFixture, default_gguf: Path) -> HubFixture:
    """The fake Hub serving the real SmolLM2-135M-Instruct GGUF (Q4_1) as a Hub variant."""
    add_smollm2(fake.hub, default_gguf)
    return fake


@requires_llama
@pytest.mark.parametrize("name", [SMOLLM2, "smollm2:135m:Q4_1"],
                         ids=["repo-id", "alias-with-quant"])
def test_pull_then_run_by_the_same_name_offline(smol: HubFixture, name: str) -> None:
    pulled = _cli(smol.env(), "pull", name, "--backend", "llama.cpp")
    assert pulled.returncode == 0, pulled.stderr
    gguf = Path(pulled.stdout.strip().splitlines()[-1])
    assert gguf.is_file() and str(smol.home) in str(gguf)

    offline = {**smol.env(), "HF_HUB_OFFLINE": "1"}
    answer = _ask(offline, name)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip(), "no answer"
    assert "Traceback" not in answer.stderr

    # The Hub unreachable and HF_HUB_OFFLINE unset: the same.
    dead = hub_env("http://127.0.0.1:9", smol.home)
    answer = _ask(dead, name, "--json")
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout)["info"]["backend"] == "llama.cpp"

    listed = [json.loads(line) for line in _cli(offline, "list", "--json").stdout.splitlines()]
    row = next(m for m in listed if m["path"] == str(gguf))
    assert row["pulled_as"] == [name]
    assert name in _cli({**offline, "COLUMNS": "250"}, "list").stdout
