"""Models other tools downloaded are found and used in place (Ollama, LM Studio)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from localrun import stores
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
