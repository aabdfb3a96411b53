"""The catalog meets the Hub (issue 19): a stale catalog entry never stops a pull, and a
repo holding several models resolves to the requested one. Against tests/hubserver.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from localrun import hub
from localrun.errors import NoVariantError
from localrun.hub import pulls
from localrun.naming import catalog
from localrun.naming.catalog import CatalogEntry, Variant
from tests.conftest import requires_llama
from tests.hubserver import (
    BASE,
    DEEPSEEK_ONNX,
    FakeFile,
    FakeRepo,
    HubFixture,
    _blob,
    _json_file,
    _text,
    add_deepseek_onnx,
    add_two_model_gguf,
    start,
)
from tests.models import test_model

ROOT = Path(__file__).resolve().parent.parent
INTEL = str(ROOT / "tests" / "profiles" / "xeon-cpu.json")
GGUF_REPO = f"{BASE}-GGUF"
DS_15 = "deepseek-r1-distill-qwen-1.5B/cpu_and_mobile/cpu-int4-rtn-block-32-acc-level-4"
DS_7 = "deepseek-r1-distill-qwen-7B/cpu_and_mobile/cpu-int4-rtn-block-32-acc-level-4"
DS_7_GPU = "deepseek-r1-distill-qwen-7B/gpu/gpu-int4-rtn-block-32"
GiB = 2**30


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    monkeypatch.delenv(pulls.HOME_ENV, raising=False)
    yield from start(monkeypatch, tmp_path)


def patch_variants(monkeypatch: pytest.MonkeyPatch, alias: str, fmt: str,
                   variants: list[Variant]) -> None:
    """Replace one alias's ``fmt`` variants in the catalog (what a stale catalog holds)."""
    entry = catalog.lookup(alias)
    assert entry is not None
    patched = replace(entry, variants=(
        *variants, *(v for v in entry.variants if v.format != fmt)))
    index = {k: (patched if e.alias == alias else e) for k, e in catalog._index().items()}
    table: dict[str, CatalogEntry] = {**catalog.entries(), alias: patched}
    monkeypatch.setattr(catalog, "_index", lambda: index)
    monkeypatch.setattr(catalog, "entries", lambda: table)


def _cli(fake: HubFixture, *args: str, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from localrun.cli import main; main()", *args],
                          cwd=ROOT, env=env or fake.env(), capture_output=True, text=True,
                          timeout=300)


def _folder(path: Path) -> dict[str, FakeFile]:
    """A real model folder, served as a repo's files."""
    return {p.name: FakeFile(p.read_bytes(), lfs=p.stat().st_size > 1024)
            for p in sorted(path.iterdir()) if p.is_file()}


# --- several models in one repo ---------------------------------------------------------------

def test_deepseek_r1_1_5b_on_onnx_is_the_1_5b_folder(fake: HubFixture) -> None:
    add_deepseek_onnx(fake.hub)
    plan = hub.plan_fetch("deepseek-r1:1.5b", backend="onnx", memory_budget_bytes=8 * GiB)
    assert (plan.repo, plan.subfolder) == (DEEPSEEK_ONNX, DS_15)
    assert all(f.path.startswith(DS_15 + "/") for f in plan.files)
    # On a CUDA host the 7B's GPU build would win on device alone: never another model.
    cuda = hub.plan_fetch("deepseek-r1:1.5b", backend="onnx", device="cuda")
    assert cuda.subfolder == DS_15
    assert any("also holds other models (7B)" in line for line in cuda.reasons), cuda.reasons
    # And the 7B alias gets the 7B (its CPU build on a CPU, its GPU build on CUDA).
    assert hub.plan_fetch("deepseek-r1:7b", backend="onnx").subfolder == DS_7
    assert hub.plan_fetch("deepseek-r1:7b", backend="onnx", device="cuda").subfolder \
        == DS_7_GPU
    path = hub.fetch(plan)
    assert path.name == DS_15.rsplit("/", 1)[-1] and "1.5B" in str(path)
    assert (path / "genai_config.json").is_file()


def test_deepseek_from_the_model_tree_alone_keeps_the_size(fake: HubFixture) -> None:
    """No catalog folder (as before the correction): discovery still never picks the 7B."""
    add_deepseek_onnx(fake.hub)
    patch_variants(fake.monkeypatch, "deepseek-r1:1.5b", "onnx", [])
    plan = hub.plan_fetch("deepseek-r1:1.5b", backend="onnx", device="cuda")
    assert plan.subfolder == DS_15


def test_pull_deepseek_r1_1_5b_for_onnx(fake: HubFixture) -> None:
    add_deepseek_onnx(fake.hub)
    r = _cli(fake, "pull", "deepseek-r1:1.5b", "--backend", "onnx", "--hardware", INTEL)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip().splitlines()[-1])
    assert path.as_posix().endswith(DS_15) and (path / "model.onnx.data").is_file()
    assert not any("7B" in p.as_posix() for p in path.parents[2].rglob("*"))  # nothing else


@pytest.mark.parametrize(("base", "file"), [
    ("multiorg/Multi-7B-Instruct", "Multi-7B-Instruct-Q4_K_M.gguf"),
    ("multiorg/Multi-1.5B-Instruct", "Multi-1.5B-Instruct-Q4_K_M.gguf"),
])
def test_two_models_in_one_gguf_repo(fake: HubFixture, base: str, file: str) -> None:
    add_two_model_gguf(fake.hub)
    plan = hub.plan_fetch(base, backend="llama.cpp")
    assert (plan.repo, plan.primary) == ("quantfolk/Multi-Instruct-GGUF", file)
    q8 = hub.plan_fetch(base, backend="llama.cpp", quant="Q8_0")
    assert q8.primary == file.replace("Q4_K_M", "Q8_0")


def test_exl_branches_per_bpw_and_the_catalog_branch(fake: HubFixture) -> None:
    td = "turboderp/Llama-3.2-1B-Instruct-exl2"
    # The repo lists its branches: the quant asked for, else the largest that fits.
    assert hub.plan_fetch("llama3.2:1b:6.0bpw", backend="exllamav2").revision == "6.0bpw"
    assert hub.plan_fetch("llama3.2:1b", backend="exllamav2").revision == "8.0bpw"
    # The Hub lists no refs (an error): the catalog's branch still resolves the alias.
    fake.hub.fail_paths.add(f"^/api/models/{td}/refs$")
    plan = hub.plan_fetch("llama3.2:1b", backend="exllamav2")
    assert (plan.repo, plan.revision) == (td, "4.0bpw")
    assert all(f.path != "README.md" for f in plan.files)


def test_a_stale_catalog_branch_is_one_line(fake: HubFixture) -> None:
    td = "turboderp/Llama-3.2-1B-Instruct-exl2"
    patch_variants(fake.monkeypatch, "llama3.2:1b", "exl2",
                   [Variant(td, "exl2", "V", branch="5.0bpw")])
    plan = hub.plan_fetch("llama3.2:1b", backend="exllamav2")
    assert plan.revision == "8.0bpw"
    assert any(f"catalog entry {td}@5.0bpw has no branch" in line for line in plan.reasons)


# --- a stale catalog entry never stops a pull ---------------------------------------------------

def test_stale_catalog_entries_are_passed_over_with_one_line_each(fake: HubFixture) -> None:
    fake.hub.add(FakeRepo("emptyorg/Qwen2.5-0.5B-Instruct-GGUF",
                          {"main": {"README.md": _text("weights moved")}}))
    fake.hub.repos[GGUF_REPO].gated = "manual"  # the own org's repo asks for a licence
    patch_variants(fake.monkeypatch, "qwen2.5:0.5b", "gguf", [
        Variant("ghost/Qwen2.5-0.5B-Instruct-GGUF", "gguf", "V"),
        Variant("emptyorg/Qwen2.5-0.5B-Instruct-GGUF", "gguf", "R"),
        Variant(GGUF_REPO, "gguf", "R", file="qwen2.5-0.5b-instruct-q4_k_m.gguf"),
        Variant("bartowski/Qwen2.5-0.5B-Instruct-GGUF", "gguf", "R",
                file="Qwen2.5-0.5B-Instruct-Q4_K_L.gguf"),  # renamed since
    ])
    plan = hub.plan_fetch("qwen2.5:0.5b", backend="llama.cpp", memory_budget_bytes=8 * GiB)
    assert plan.repo == "bartowski/Qwen2.5-0.5B-Instruct-GGUF" and plan.quant == "Q4_K_M"
    text = "\n".join(plan.reasons)
    assert "catalog entry ghost/Qwen2.5-0.5B-Instruct-GGUF is not on the Hub (404)" in text
    assert "catalog entry emptyorg/Qwen2.5-0.5B-Instruct-GGUF holds no GGUF weights" in text
    assert f"{GGUF_REPO} gated and no HF_TOKEN is set" in text
    assert "catalog file Qwen2.5-0.5B-Instruct-Q4_K_L.gguf is not in bartowski/" in text
    assert hub.fetch(plan).is_file()  # no licence needed for what was chosen


def test_an_openvino_repo_without_tokenizer_irs_is_not_usable(fake: HubFixture) -> None:
    ov = fake.hub.repos["OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov"].branches["main"]
    del ov["openvino_tokenizer.xml"], ov["openvino_detokenizer.xml"]
    plan = hub.plan_fetch("qwen2.5:0.5b", backend="openvino")
    assert plan.repo == "OpenVINO/Qwen2.5-0.5B-Instruct-int8-ov"
    with pytest.raises(NoVariantError, match="openvino") as err:
        hub.plan_fetch("OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov", backend="openvino")
    assert "openvino_tokenizer.xml" in (err.value.hint or "")


def test_gemma3_4b_openvino_variant_by_device(fake: HubFixture) -> None:
    files = {"openvino_language_model.xml": _text("<n/>"),
             "openvino_language_model.bin": _blob(3000, 5),
             "openvino_tokenizer.xml": _text("<t/>"), "openvino_tokenizer.bin": _blob(1100, 6),
             "openvino_detokenizer.xml": _text("<d/>"),
             "openvino_detokenizer.bin": _blob(1100, 7),
             "config.json": _json_file({"model_type": "gemma3"})}
    for name in ("OpenVINO/gemma-3-4b-it-int4-ov", "OpenVINO/gemma-3-4b-it-int4-cw-ov"):
        fake.hub.add(FakeRepo(name, {"main": dict(files)}, tags=["openvino"]))
    assert hub.plan_fetch("gemma3:4b", backend="openvino", device="GPU.0").repo \
        == "OpenVINO/gemma-3-4b-it-int4-ov"
    assert hub.plan_fetch("gemma3:4b", backend="openvino", device="CPU").repo \
        == "OpenVINO/gemma-3-4b-it-int4-ov"
    assert hub.plan_fetch("gemma3:4b", backend="openvino", device="NPU").repo \
        == "OpenVINO/gemma-3-4b-it-int4-cw-ov"


# --- issue 19, "Done when": qwen2.5:0.5b on an Intel host without OpenVINO's 0.5B IR ------

def _intel_hub_without_the_ov_int4(fake: HubFixture) -> None:
    """The stand-in Hub as issue 19 found the real one: no OpenVINO/…-int4-ov."""
    del fake.hub.repos["OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov"]


@requires_llama
def test_intel_pull_qwen_falls_back_to_the_next_engine_and_runs(
        fake: HubFixture, default_gguf: Path) -> None:
    """No usable OpenVINO variant at all: the catalog's community IR lacks its tokenizer
    IRs (and is passed over, one line), the int8 IR is gone too; the plan says so and
    pulls GGUF for llama.cpp, the next engine in the Intel host's order; it answers."""
    _intel_hub_without_the_ov_int4(fake)
    del fake.hub.repos["OpenVINO/Qwen2.5-0.5B-Instruct-int8-ov"]
    del fake.hub.repos["bartowski/Qwen2.5-0.5B-Instruct-GGUF"]
    fake.hub.add(FakeRepo("llmware/qwen2.5-0.5b-instruct-ov", {"main": {
        "openvino_model.xml": _text("<net/>"), "openvino_model.bin": _blob(3000, 5),
        "config.json": _json_file({"model_type": "qwen2"})}},
        tags=["openvino", f"base_model:quantized:{BASE}"]))
    # A real model behind the GGUF name (SmolLM2-135M; the test is about what is chosen).
    fake.hub.repos[GGUF_REPO].branches["main"] = {
        "qwen2.5-0.5b-instruct-q4_1.gguf": FakeFile(default_gguf.read_bytes(), lfs=True)}

    pulled = _cli(fake, "pull", "qwen2.5:0.5b", "--hardware", INTEL)
    assert pulled.returncode == 0, pulled.stderr
    err = " ".join(pulled.stderr.split())  # rich wraps long lines
    assert "catalog entry llmware/qwen2.5-0.5b-instruct-ov lacks openvino_tokenizer.xml" in err
    assert "Found no openvino variant of qwen2.5:0.5b" in err and "using llama.cpp" in err
    gguf = Path(pulled.stdout.strip().splitlines()[-1])
    assert gguf.name == "qwen2.5-0.5b-instruct-q4_1.gguf" and gguf.is_file()

    answer = _cli(fake, "run", "qwen2.5:0.5b", "What is 2+2?", "--max-tokens", "8",
                  "--temperature", "0", "--json", env={**fake.env(), "HF_HUB_OFFLINE": "1"})
    assert answer.returncode == 0, answer.stderr
    out = json.loads(answer.stdout)
    assert out["text"].strip() and out["info"]["path"] == str(gguf)


def test_intel_pull_qwen_takes_another_openvino_variant_and_runs(fake: HubFixture) -> None:
    """The int8 IR is there: the plan explains the catalog entry it passed over and the
    variant it chose, and OpenVINO GenAI runs what was pulled."""
    pytest.importorskip("openvino_genai", reason="OpenVINO GenAI is not installed "
                        "(pip install -e '.[openvino]')")
    ir = test_model("openvino-int4")
    _intel_hub_without_the_ov_int4(fake)
    # A real IR behind the int8 name (SmolLM2-135M; the test is about what is chosen).
    fake.hub.repos["OpenVINO/Qwen2.5-0.5B-Instruct-int8-ov"].branches["main"] = _folder(ir)

    pulled = _cli(fake, "pull", "qwen2.5:0.5b", "--hardware", INTEL)
    assert pulled.returncode == 0, pulled.stderr
    err = " ".join(pulled.stderr.split())
    assert "catalog entry llmware/qwen2.5-0.5b-instruct-ov is not on the Hub (404)" in err
    assert "chose OpenVINO/Qwen2.5-0.5B-Instruct-int8-ov:int8" in err
    folder = Path(pulled.stdout.strip().splitlines()[-1])
    assert (folder / "openvino_model.bin").is_file()

    answer = _cli(fake, "run", "qwen2.5:0.5b", "What is 2+2?", "--backend", "openvino",
                  "--max-tokens", "8", "--temperature", "0", "--json",
                  env={**fake.env(), "HF_HUB_OFFLINE": "1"})
    assert answer.returncode == 0, answer.stderr
    out = json.loads(answer.stdout)
    assert out["text"].strip() and out["info"]["backend"] == "openvino"
