"""Shared fixtures. Engine tests use the real engine and the real embedded model."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
requires_llama = pytest.mark.skipif(
    not HAVE_LLAMA, reason="llama-cpp-python is not installed (pip install -e '.[llama-cpp]')"
)


def localrun_cmd() -> list[str]:
    """The installed console script, falling back to `python -m localrun`."""
    exe = Path(sys.executable).with_name("localrun")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("localrun")
    return [found] if found else [sys.executable, "-m", "localrun"]


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    from localrun.naming.stores import default_model_path

    try:
        return default_model_path()
    except Exception as e:  # pragma: no cover - depends on the install
        pytest.skip(f"the embedded default model is not installed ({e})")


@pytest.fixture(scope="session")
def llama_model(default_gguf: Path) -> Iterator[object]:
    """One real llama.cpp Model for the whole session (loading costs ~0.3 s)."""
    if not HAVE_LLAMA:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llama-cpp]')")
    import localrun

    with localrun.load(str(default_gguf), backend="llama.cpp", context=2048,
                       exact=True) as m:
        yield m


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LOCALRUN_DEBUG", None)
    env["HF_HUB_OFFLINE"] = "1"
    return env
