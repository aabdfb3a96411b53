"""`localrun list --path NAME`: the path of a model on disk, for `localrun run "$(...)"` (the
README's local-file example) — by the name `list` shows or a name it was pulled as."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hubserver import BASE, HubFixture, start

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    yield from start(monkeypatch, tmp_path)


def _cli(fake: HubFixture, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from localrun.cli import main; main()", *args],
                          cwd=ROOT, env=fake.env(), capture_output=True, text=True, timeout=120)


def test_path_of_the_embedded_model(fake: HubFixture) -> None:
    from localrun.naming.stores import default_model

    stored = default_model()
    if stored is None:
        pytest.skip("the embedded default model is not on this machine yet")
    r = _cli(fake, "list", "--path", "smollm2:135m")
    assert r.returncode == 0, r.stderr
    assert r.stdout == stored.path + "\n"  # the path alone: usable in "$(...)"


def test_path_of_a_pulled_name_and_of_its_repo_name(fake: HubFixture) -> None:
    pulled = _cli(fake, "pull", "qwen2.5:0.5b", "--backend", "llama.cpp")
    assert pulled.returncode == 0, pulled.stderr
    path = pulled.stdout.strip().splitlines()[-1]
    for name in ("qwen2.5:0.5b", f"{BASE}-GGUF:Q4_K_M"):
        r = _cli(fake, "list", "--path", name)
        assert (r.returncode, r.stdout) == (0, path + "\n"), (name, r.stderr)


def test_a_name_not_on_disk_is_one_line_and_a_hint(fake: HubFixture) -> None:
    r = _cli(fake, "list", "--path", "qwen2.5:0.5b")
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: No model named 'qwen2.5:0.5b' on disk")
    assert "localrun pull qwen2.5:0.5b" in lines[1] and lines[1].lstrip().startswith("hint:")
