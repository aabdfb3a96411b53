"""From a Hub name to a loaded engine (issue 18, item 3): ``localrun.load("org/name")``
plans for this host, shows the plan to ``on_plan`` before any byte of the weights moves,
reports ``progress`` while the real SmolLM2-135M files come from the stand-in Hub (through
its CDN redirect), and chats — for the GGUF, OpenVINO IR and ONNX GenAI variants.
(The CLI's pull-then-run-offline is in tests/test_hub_pulls.py.)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import localrun
from localrun import hub
from tests.hubserver import (
    SMOLLM2,
    SMOLLM2_ONNX,
    SMOLLM2_ONNX_DIR,
    SMOLLM2_OV,
    HubFixture,
    add_smollm2,
    start,
)
from tests.models import test_model

#: backend -> (engine module, the variant repo the plan must pick, the fixture folder)
VARIANTS: dict[str, tuple[str, str, str | None]] = {
    "llama.cpp": ("llama_cpp", f"{SMOLLM2}-GGUF", None),
    "openvino": ("openvino_genai", SMOLLM2_OV, "openvino-int4"),
    "onnx": ("onnxruntime_genai", SMOLLM2_ONNX, "onnx-int4"),
}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    monkeypatch.delenv("LOCALRUN_HOME", raising=False)
    yield from start(monkeypatch, tmp_path)


def _serve(fake: HubFixture, backend: str, gguf: Path) -> str:
    module, repo, fixture = VARIANTS[backend]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{backend} is not installed (pip install -e '.[{backend}]')")
    folder = test_model(fixture) if fixture else None  # skips, naming the build command
    add_smollm2(fake.hub, gguf, openvino=folder if backend == "openvino" else None,
                onnx=folder if backend == "onnx" else None)
    return repo


class _Watch:
    """Records on_plan and progress calls, and what the Hub had served at each."""

    def __init__(self, fake: HubFixture) -> None:
        self.fake = fake
        self.events: list[tuple[str, Any]] = []

    def weight_gets(self) -> list[str]:
        """Whole-file GETs of the CDN (Range reads of a GGUF header are planning)."""
        return [r["path"] for r in self.fake.hub.cdn_requests("GET")
                if not any(k.lower() == "range" for k in r["headers"])]

    def on_plan(self, plan: Any, fetch_plan: hub.Download) -> None:
        self.events.append(("plan", (plan, fetch_plan, self.weight_gets())))

    def progress(self, p: hub.DownloadProgress) -> None:
        self.events.append(("progress", p))

    def plans(self) -> list[tuple[Any, hub.Download, list[str]]]:
        return [e[1] for e in self.events if e[0] == "plan"]

    def reports(self) -> list[hub.DownloadProgress]:
        return [e[1] for e in self.events if e[0] == "progress"]


@pytest.mark.parametrize("backend", list(VARIANTS))
def test_load_a_hub_name_plans_reports_progress_and_chats(fake: HubFixture, default_gguf: Path,
                                                          backend: str) -> None:
    repo = _serve(fake, backend, default_gguf)
    watch = _Watch(fake)
    with localrun.load(SMOLLM2, backend=backend, context=512, on_plan=watch.on_plan,
                       progress=watch.progress) as model:
        reply = model.chat("What is 2+2?", max_tokens=8, temperature=0)
        info = model.info
    assert reply.text.strip(), "no answer"

    # on_plan: once, first, before any weight file was asked for, naming what comes.
    (plan, fp, served_then) = watch.plans()[0]
    assert len(watch.plans()) == 1 and watch.events[0][0] == "plan"
    assert served_then == []
    assert (plan.backend, fp.backend, fp.repo, fp.source) == (backend, backend, repo, "hub")
    # (planning may have fetched a small config the KV-cache size comes from)
    fresh = {f.path: f.size for f in fp.files if not f.cached}
    assert fp.fits and fp.download_bytes == sum(fresh.values()) > 50 * 2**20
    if backend == "onnx":
        assert fp.subfolder == SMOLLM2_ONNX_DIR

    # progress: every planned byte, once, in order, file by file, ending at the total.
    reports = watch.reports()
    assert reports, "no progress reported"
    assert all(r.delta > 0 for r in reports)
    assert [r.done for r in reports] == sorted(r.done for r in reports)
    assert reports[-1].done == reports[-1].total == fp.download_bytes
    finished = {r.file: r.file_done for r in reports}
    assert finished == {p: s for p, s in fresh.items() if s}  # empty files report nothing
    assert {r.count for r in reports} == {len(fresh)}
    assert all(r.file_total == fresh[r.file] for r in reports)
    assert len(watch.weight_gets()) >= 1

    # The engine runs what was downloaded, from the HF cache.
    assert str(fake.home) in str(info.path) and info.backend == backend


def test_a_second_load_downloads_nothing(fake: HubFixture, default_gguf: Path) -> None:
    _serve(fake, "llama.cpp", default_gguf)
    with localrun.load(SMOLLM2, backend="llama.cpp", context=512):
        pass
    fake.hub.requests.clear()
    watch = _Watch(fake)
    with localrun.load(SMOLLM2, backend="llama.cpp", context=512, on_plan=watch.on_plan,
                       progress=watch.progress) as model:
        assert model.chat("Hi", max_tokens=4, temperature=0).text is not None
    (_, fp, _), = watch.plans()
    assert fp.download_bytes == 0 and all(f.cached for f in fp.files)
    assert watch.reports() == [] and watch.weight_gets() == []
