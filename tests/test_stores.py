"""Models other tools downloaded are found and used in place (Ollama, LM Studio)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from localrun.naming import stores
from tests.conftest import requires_llama
from tests.hubserver import gguf_bytes


def _ollama(root: Path, name: str, tag: str, data: bytes) -> Path:
    digest = hashlib.sha256(data).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00"},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
         "size": len(data)}]}))
    return blob


@pytest.fixture
def ollama(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    root = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    monkeypatch.setenv("LMSTUDIO_MODELS_DIR", str(tmp_path / "lms"))
    return root


def test_ollama_manifest_found_in_place(ollama: Path) -> None:
    blob = _ollama(ollama, "qwen2.5", "0.5b", gguf_bytes(quant="Q4_K_M", pad=100))
    found = stores.find_ollama("qwen2.5:0.5b")
    assert found is not None and Path(found.path) == blob
    assert (found.format, found.quant, found.store) == ("gguf", "Q4_K_M", "ollama")
    assert stores.find_ollama("qwen2.5:7b") is None
    assert [m.name for m in stores.ollama_models()] == ["ollama:qwen2.5:0.5b"]


def test_alias_plans_from_ollama_without_download(ollama: Path) -> None:
    from localrun import hub

    blob = _ollama(ollama, "qwen2.5", "0.5b", gguf_bytes(quant="Q4_K_M", pad=100))
    plan = hub.plan_fetch("qwen2.5:0.5b", backend="llama.cpp", memory_budget_bytes=2**33)
    assert plan.source == "ollama" and plan.files == () and plan.fits
    assert plan.memory.kv_known
    assert hub.fetch(plan) == blob  # no copy, no network
    explicit = hub.plan_fetch("ollama:qwen2.5:0.5b", backend="llama.cpp")
    assert explicit.local_path == str(blob)


def test_lmstudio_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = tmp_path / "lms"
    monkeypatch.setenv("LMSTUDIO_MODELS_DIR", str(root))
    d = root / "lmstudio-community" / "Qwen2.5-7B-Instruct-GGUF"
    d.mkdir(parents=True)
    (d / "Qwen2.5-7B-Instruct-Q4_K_M.gguf").write_bytes(gguf_bytes(quant="Q4_K_M"))
    (d / "mmproj-model-f16.gguf").write_bytes(gguf_bytes(quant="F16"))
    models = stores.lmstudio_models()
    repo = "lmstudio-community/Qwen2.5-7B-Instruct-GGUF"
    assert [m.name for m in models] == [f"lmstudio:{repo}:Q4_K_M"]
    hit = stores.find_lmstudio("lmstudio-community/Qwen2.5-7B-Instruct-GGUF")
    assert hit is not None and hit.path.endswith("Q4_K_M.gguf")
    assert stores.find_lmstudio("lmstudio-community/Qwen2.5-7B-Instruct-GGUF", "Q8_0") is None


# -- real models, loaded in place from each store ----------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, str]:
    """The real SmolLM2-135M GGUF fixture and its sha256 (Ollama names blobs by it)."""
    from tests.models import test_model

    path = test_model("gguf-q4_1")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return path, digest.hexdigest()


def _chat_in_place(name: str, expected_path: Path) -> None:
    import localrun

    with localrun.load(name, context=512) as model:
        assert Path(model.info.path) == expected_path  # used where the store keeps it
        assert (model.info.backend, model.info.format, model.info.quantization) == (
            "llama.cpp", "gguf", "Q4_1")
        reply = model.chat("What is 2+2?", temperature=0, max_tokens=12)
        assert reply.usage.completion_tokens >= 1 and reply.text.strip()
        # the same model in another file: its model card's defaults still apply
        assert (model.defaults.temperature, model.defaults.top_p) == (0.2, 0.9)


@requires_llama
def test_ollama_model_loads_and_chats(ollama: Path, smollm2: tuple[Path, str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # nothing may be downloaded
    src, digest = smollm2
    blob = ollama / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True)
    blob.symlink_to(src)  # Ollama's blob: the GGUF itself, named by its sha256
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00"},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
         "size": src.stat().st_size}]}))
    assert [m.name for m in stores.ollama_models()] == ["ollama:smollm2:135m"]
    _chat_in_place("ollama:smollm2:135m", blob)


@requires_llama
def test_lmstudio_model_loads_and_chats(ollama: Path, tmp_path: Path,
                                        smollm2: tuple[Path, str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    src, _ = smollm2
    folder = tmp_path / "lms" / "HuggingFaceTB" / "SmolLM2-135M-Instruct-GGUF"
    folder.mkdir(parents=True)
    gguf = folder / "SmolLM2-135M-Instruct-Q4_1.gguf"
    gguf.symlink_to(src)
    (folder / "mmproj-SmolLM2-f16.gguf").write_bytes(gguf_bytes(quant="F16"))  # not a model
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
    assert [m.name for m in stores.lmstudio_models()] == [f"lmstudio:{repo}:Q4_1"]
    _chat_in_place(f"lmstudio:{repo}", gguf)
    _chat_in_place(f"lmstudio:{repo}:Q4_1", gguf)
