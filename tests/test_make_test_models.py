"""scripts/make_test_models.py: its cache key, its manifest, and the models it lists."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from localrun.formats.detect import detect
from tests.models import FORMATS, SCRIPT, models_root, read_manifest, test_model


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_test_models", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_test_models", mod)
    spec.loader.exec_module(mod)
    return mod


mtm = _load_script()

PINS = {"torch": "torch==2.13.0", "transformers": "transformers==5.24.0",
        "mlx-lm": "mlx-lm==0.32.2", "llama-cpp-python-sdist": "0.3.36"}


# --- the cache key -----------------------------------------------------------------------

def test_key_is_stable_and_order_free() -> None:
    k = mtm.build_key("ab" * 32, PINS, 1)
    assert k == mtm.build_key("ab" * 32, dict(reversed(list(PINS.items()))), 1)
    assert len(k) == 16 and mtm.KEY_RE.match(k)


@pytest.mark.parametrize("name", sorted(PINS))
def test_key_changes_with_any_converter_version(name: str) -> None:
    before = mtm.build_key("ab" * 32, PINS, 1)
    changed = {**PINS, name: PINS[name] + ".1"}
    assert mtm.build_key("ab" * 32, changed, 1) != before


def test_key_changes_with_source_recipe_and_new_converter() -> None:
    k = mtm.build_key("ab" * 32, PINS, 1)
    assert mtm.build_key("cd" * 32, PINS, 1) != k
    assert mtm.build_key("ab" * 32, PINS, 2) != k
    assert mtm.build_key("ab" * 32, {**PINS, "onnx-ir": "onnx-ir==1.1.0"}, 1) != k


def test_pins_come_from_the_fixtures_extra() -> None:
    reqs = mtm.fixture_requirements()
    pins = mtm.converter_pins(reqs)
    # exact pins: the key must name the converter versions, not ranges
    assert pins["torch"] == "torch==2.13.0"  # the CPU build on disk, never a CUDA one
    for name in ("transformers", "mlx-lm", "onnxruntime-genai", "openvino-genai", "onnx"):
        assert "==" in pins[name], pins[name]
    assert "torchvision" not in pins
    assert pins["llama-cpp-python-sdist"] == mtm.LLAMA_CPP_SDIST


def test_runtime_extras_never_pull_torch() -> None:
    import tomllib

    extras = tomllib.loads((SCRIPT.parent.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    runtime = [name for name in extras if name != "fixtures"]  # every extra a user installs
    assert {"llama-cpp", "mlx", "openvino", "onnx", "serve", "dev"} <= set(runtime)
    for name in runtime:
        assert not any(r.startswith("torch") for r in extras[name]), name


def test_only_adds_what_a_format_is_built_from() -> None:
    assert mtm.with_needs(["mlx-4bit"]) == ["hf", "mlx-4bit"]
    assert mtm.with_needs(["openvino-int4"]) == ["openvino-int4"]
    assert mtm.parse_only("onnx-int4,hf") == ["hf", "onnx-int4"]
    with pytest.raises(SystemExit):
        mtm.parse_only("safetensors")


def test_lora_and_vl_fixtures_are_built_by_default_and_selectable() -> None:
    new = ("lora-peft", "lora-peft-b", "lora-gguf", "lora-gguf-b", "lora-mlx", "vl-hf",
           "vl-gguf", "vl-openvino")
    assert set(new) <= set(mtm.parse_only(None))  # the default run (CI's) builds them
    assert mtm.with_needs(["lora-gguf"]) == ["hf", "lora-peft", "lora-gguf"]
    assert mtm.with_needs(["lora-gguf-b"]) == ["hf", "lora-peft-b", "lora-gguf-b"]
    assert mtm.with_needs(["lora-mlx"]) == ["hf", "lora-peft", "lora-mlx"]
    assert mtm.with_needs(["vl-openvino"]) == ["hf", "vl-hf", "vl-openvino"]
    assert mtm.parse_only("vl-gguf,lora-gguf-b") == ["lora-gguf-b", "vl-gguf"]
    for fmt in new:  # every input is built before what it feeds
        assert all(mtm.FORMATS.index(n) < mtm.FORMATS.index(fmt) for n in mtm.NEEDS[fmt])


@pytest.mark.parametrize(("fmt", "change"), [
    ("lora-gguf", {"lora": {**mtm.extra.LORA, "seeds": {"lora-peft": 3, "lora-peft-b": 2}}}),
    ("lora-peft", {"lora": {**mtm.extra.LORA, "rank": 16}}),
    ("lora-mlx", {"lora": {**mtm.extra.LORA, "std_b": 0.1}}),
    ("vl-hf", {"vl": {**mtm.extra.VL, "seed": 1}}),
    ("vl-gguf", {"vl": {**mtm.extra.VL, "vision": {**mtm.extra.VL["vision"], "depth": 5}}}),
    ("vl-openvino", {"optimum": ("optimum-intel==2.3.0",)}),
])
def test_fixture_key_changes_with_its_recipe(fmt: str, change: dict[str, object]) -> None:
    key = mtm.extra.fixture_key(fmt, "0123456789abcdef")
    assert mtm.KEY_RE.match(key)
    assert mtm.extra.fixture_key(fmt, "0123456789abcdef", **change) != key
    assert mtm.extra.fixture_key(fmt, "fedcba9876543210") != key  # source or converters


def test_fixture_key_ignores_other_recipes() -> None:
    key = mtm.extra.fixture_key("vl-gguf", "0123456789abcdef")
    assert mtm.extra.fixture_key("vl-gguf", "0123456789abcdef",
                                 lora={**mtm.extra.LORA, "rank": 4}) == key
    assert mtm.extra.fixture_key("vl-gguf", "0123456789abcdef", optimum=("x==1",)) == key


def test_a_fixture_with_a_stale_recipe_is_not_built(tmp_path: Path) -> None:
    key_dir = tmp_path / "0123456789abcdef"
    folder = key_dir / "lora-peft"
    folder.mkdir(parents=True)
    for m in mtm.MARKERS["lora-peft"]:
        (folder / m).write_text("{}")
    src = tmp_path / "src.gguf"
    src.write_bytes(b"GGUF")
    assert not mtm.is_built(key_dir, "lora-peft", src)  # no fixture.json
    mtm.extra.write_stamp(folder, "lora-peft", key_dir.name)
    assert mtm.is_built(key_dir, "lora-peft", src)
    stamp = json.loads((folder / "fixture.json").read_text())
    (folder / "fixture.json").write_text(json.dumps({**stamp, "key": "0" * 16}))
    assert not mtm.is_built(key_dir, "lora-peft", src)  # another recipe's: rebuilt
    assert mtm.model_path(key_dir, "lora-gguf", src).name.endswith(".gguf")


def test_check_on_an_empty_cache_fails_and_builds_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "LOCALRUN_TEST_MODELS": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "missing" in proc.stdout
    assert not (tmp_path / "venv-tools").exists()
    assert not (tmp_path / "manifest.json").exists()


def test_interrupted_builds_never_look_done(tmp_path: Path) -> None:
    key_dir = tmp_path / "0123456789abcdef"
    (key_dir / ".tmp-hf-xyz" / "model").mkdir(parents=True)
    (key_dir / ".tmp-hf-xyz" / "model" / "config.json").write_text("{}")
    src = tmp_path / "src.gguf"
    src.write_bytes(b"GGUF")
    assert not mtm.is_built(key_dir, "hf", src)
    (key_dir / "hf").mkdir()
    (key_dir / "hf" / "config.json").write_text("{}")  # markers incomplete
    assert not mtm.is_built(key_dir, "hf", src)
    assert mtm.is_built(key_dir, "gguf-q4_1", src)


# --- the built models (skipped until the script has run) ---------------------------------

EXPECTED = {
    "gguf-q4_1": ("gguf", "Q4_1"),
    "gguf-q8_0": ("gguf", "Q8_0"),
    "gguf-f32": ("gguf", "F32"),
    "hf": ("hf", None),
    "mlx-4bit": ("mlx", "4bit"),
    "openvino-int4": ("openvino", None),
    "onnx-int4": ("onnx", "int4"),
    "minilm-gguf": ("gguf", "F16"),
    "minilm-openvino": ("openvino", None),
    "vl-hf": ("hf", None),
    "vl-gguf": ("gguf", "F16"),  # the folder: its text model (the mmproj beside it)
    "vl-openvino": ("openvino", None),
}
#: adapters, not models (tests/test_fixtures_lora_vl.py checks them on the engines)
ADAPTERS = ("lora-peft", "lora-peft-b", "lora-gguf", "lora-gguf-b", "lora-mlx")


def test_every_fixture_is_a_model_or_an_adapter() -> None:
    assert sorted([*EXPECTED, *ADAPTERS]) == sorted(FORMATS)


@pytest.mark.parametrize("fmt", list(EXPECTED))
def test_fixture_model_detects_as_its_format(fmt: str) -> None:
    path = test_model(fmt)
    found = detect(path)
    want_format, want_quant = EXPECTED[fmt]
    assert found.format == want_format, found
    if want_quant is not None:
        assert found.quantization == want_quant, found
    if fmt != "openvino-int4":  # the GGUF->IR export writes no config.json
        assert found.architecture, found


def test_manifest_lists_every_model_with_its_versions() -> None:
    test_model("hf")  # skips when nothing is built
    manifest = read_manifest()
    assert manifest is not None
    assert mtm.KEY_RE.match(manifest["key"])
    for fmt, value in manifest["models"].items():
        assert fmt in FORMATS
        if fmt == "gguf-q4_1":
            # the source file of the environment that wrote the manifest (virtual
            # environments can share the cache, CI's and a developer's): this one's is
            # found through its own localrun (localrun/naming/embedded.py)
            assert Path(value).name == test_model(fmt).name, value
            continue
        assert Path(value).exists(), value
        assert Path(value).is_relative_to(models_root() / manifest["key"]), value
    versions = manifest["versions"]
    for name in ("torch", "transformers", "mlx-lm", "onnxruntime-genai", "openvino-genai"):
        assert name in versions
    assert versions["torch"].startswith("2.13.0")
    assert "recipe" in versions and "source_sha256" in versions


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f in mtm.extra.FORMATS])
def test_lora_and_vl_fixtures_are_listed_with_their_recipe(fmt: str) -> None:
    path = test_model(fmt)
    manifest = read_manifest()
    assert manifest is not None
    folder = path if path.is_dir() else path.parent
    assert folder == models_root() / manifest["key"] / fmt
    stamp = json.loads((folder / "fixture.json").read_text())
    assert stamp["format"] == fmt
    assert stamp["key"] == mtm.extra.fixture_key(fmt, manifest["key"])
    assert all((folder / m).is_file() for m in mtm.MARKERS[fmt])
    if fmt == "vl-openvino":
        assert manifest["versions"]["vl-openvino exporter (venv-optimum)"] == " ".join(
            mtm.extra.OPTIMUM_REQUIREMENTS)


def test_warm_run_does_nothing_quickly() -> None:
    test_model("hf")
    manifest = read_manifest()
    assert manifest is not None
    if set(manifest["models"]) != set(FORMATS):
        pytest.skip("not every fixture model is built: a run would build them")
    # The manifest names the source GGUF inside the environment that ran the script
    # last; a first run from this environment may update that one path.
    subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    before = json.loads((models_root() / "manifest.json").read_text())
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "up to date" in proc.stdout
    # the script's own timing (< 2 s as promised); the wall clock also counts the
    # interpreter's start, which a loaded machine can slow down
    m = re.search(r"\((\d+\.\d+) s\)", proc.stdout)
    assert m and float(m.group(1)) < 2.0, proc.stdout
    assert elapsed < 10.0, elapsed
    assert json.loads((models_root() / "manifest.json").read_text()) == before
    check = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True)
    assert check.returncode == 0
