"""The code base stays typed (mypy --strict) and lint-clean (ruff)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (pip install -e '.[dev]')")
def test_ruff() -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "localrun", "tests", "scripts"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install -e '.[dev]')")
def test_mypy() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", "localrun"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
