"""`localrun pull / list / rm` end to end, in a subprocess pointed at the fake Hub."""

from __future__ import annotations

import json
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


def _cli(fake: HubFixture, *args: str, input: str | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from localrun.cli import main; main()", *args],
                          cwd=ROOT, env=fake.env(), capture_output=True, text=True,
                          timeout=120, input=input)


def test_pull_base_repo_fetches_gguf_q4_k_m(fake: HubFixture) -> None:
    r = _cli(fake, "pull", BASE, "--memory-gb", "8", "--hardware",
             str(ROOT / "tests" / "profiles" / "epyc-cpu.json"))
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip().splitlines()[-1])
    assert path.name == "qwen2.5-0.5b-instruct-q4_k_m.gguf" and path.is_file()
    assert str(fake.home) in str(path)
    assert "Qwen/Qwen2.5-0.5B-Instruct-GGUF" in r.stderr and "fits" in r.stderr
    listed = [json.loads(line) for line in _cli(fake, "list", "--json").stdout.splitlines()]
    row = next(m for m in listed if m["name"] == "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
    assert (row["format"], row["quant"], row["engines"]) == ("gguf", "Q4_K_M", ["llama.cpp"])
    assert Path(row["path"]) == path
    assert "Q4_K_M" in _cli(fake, "list").stdout
    no = _cli(fake, "rm", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", input="n\n")
    assert no.returncode == 1 and path.is_file()
    yes = _cli(fake, "rm", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "--yes")
    assert yes.returncode == 0, yes.stderr
    assert not path.exists()


def test_pull_refuses_too_large_before_download(fake: HubFixture) -> None:
    r = _cli(fake, "pull", "bigorg/Huge-70B-GGUF", "--memory-gb", "16")
    assert r.returncode == 1
    assert "error:" in r.stderr and "16.00 GiB is available" in r.stderr
    assert fake.hub.resolve_requests() == []
