"""A vision GGUF on the Hub is its text model and its projector: the plan downloads the
pair (the F16 projector where there are several), sizes both, and the loaded model takes
images. The stand-in Hub (tests/hubserver.py) serves the vl-gguf fixture's real files;
the memory of a model on disk counts the projector beside it too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import localrun
from tests.conftest import HAVE_LLAMA
from tests.hubserver import FakeFile, FakeRepo, HubFixture, _text, start
from tests.imageutil import data_uri, png
from tests.models import test_model

REPO = "tiny/Tiny-Qwen2.5-VL-GGUF"
TEXT, PROJ = "Tiny-Qwen2.5-VL.F16.gguf", "mmproj-Tiny-Qwen2.5-VL.F16.gguf"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubFixture]:
    monkeypatch.delenv("LOCALRUN_HOME", raising=False)
    yield from start(monkeypatch, tmp_path)


def _serve(fake: HubFixture) -> None:
    folder = test_model("vl-gguf")
    fake.hub.add(FakeRepo(REPO, {"main": {
        TEXT: FakeFile((folder / TEXT).read_bytes(), lfs=True),
        PROJ: FakeFile((folder / PROJ).read_bytes(), lfs=True),
        # another type of the same projector: never downloaded (F16 is preferred)
        "mmproj-Tiny-Qwen2.5-VL.F32.gguf": FakeFile(None, size=420_000),
        "README.md": _text("# Tiny Qwen2.5-VL")}},
        tags=["gguf", "image-text-to-text"], downloads=10))


def test_the_plan_downloads_the_model_and_its_projector(fake: HubFixture) -> None:
    if not HAVE_LLAMA:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llama-cpp]')")
    pytest.importorskip("PIL", reason="Pillow is not installed (pip install pillow)")
    _serve(fake)
    plans: list[Any] = []
    folder = test_model("vl-gguf")
    with localrun.load(REPO, backend="llama.cpp", context=512, threads=1,
                       on_plan=lambda plan, download: plans.append(download)) as m:
        assert m._session.accepts_images
        reply = m.chat([{"role": "user", "content": "Describe this.",
                         "images": [data_uri(png(112, 84))]}], temperature=0, max_tokens=8)
        text = m.chat("Describe this.", temperature=0, max_tokens=8)
    assert reply.text.strip() and reply.usage.prompt_tokens == text.usage.prompt_tokens + 14
    [download] = plans
    sizes = {f.path: f.size for f in download.files}
    assert sizes == {TEXT: (folder / TEXT).stat().st_size,
                     PROJ: (folder / PROJ).stat().st_size}
    gets = [r for r in fake.hub.requests if "mmproj-Tiny-Qwen2.5-VL.F32" in r.get("path", "")
            and r.get("method") == "GET"]
    assert gets == []


def test_local_memory_counts_the_projector_beside_a_gguf(tmp_path: Path) -> None:
    from localrun.memory import local_weights_bytes

    folder = test_model("vl-gguf")
    text, proj = folder / TEXT, folder / PROJ
    assert local_weights_bytes(text) == text.stat().st_size + proj.stat().st_size
    alone = tmp_path / "model.gguf"
    alone.symlink_to(text)
    assert local_weights_bytes(alone) == text.stat().st_size


def test_the_plan_shows_the_projector_and_the_image_token_budget(fake: HubFixture) -> None:
    """`localrun plan` of a vision model names its projector and the image-token budget
    (per image, per request); a text-only model's plan has no image part."""
    import subprocess
    import sys

    from localrun.images import DEFAULT_IMAGE_TOKENS, MAX_IMAGES

    folder = test_model("vl-gguf")
    want = {"projector": PROJ, "projector_bytes": (folder / PROJ).stat().st_size,
            "tokens_per_image": DEFAULT_IMAGE_TOKENS, "images_per_request": MAX_IMAGES,
            "tokens_per_request": DEFAULT_IMAGE_TOKENS * MAX_IMAGES}
    for model in (folder, folder / TEXT):
        p = localrun.plan(str(model), backend="llama.cpp", hub=False)
        assert p.images == want, (model, p.images)
        assert p.to_dict()["images"] == want
    assert localrun.plan(str(test_model("gguf-q8_0")), backend="llama.cpp",
                         hub=False).images is None
    _serve(fake)
    hub = localrun.plan(REPO, backend="llama.cpp")
    assert hub.images is not None and hub.images["projector"] == PROJ, hub
    out = subprocess.run([sys.executable, "-m", "localrun", "plan", str(folder / TEXT),
                          "--backend", "llama.cpp", "--no-hub"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("Images:"))
    assert PROJ in line and f"at most {DEFAULT_IMAGE_TOKENS} tokens an image" in line, line
    assert f"at most {MAX_IMAGES} images a request" in line, line
