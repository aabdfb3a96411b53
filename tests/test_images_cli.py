"""``localrun run MODEL PROMPT --image FILE`` and ``/image PATH`` in ``localrun chat``, on
the vl-gguf fixture (llama.cpp), checked against the Python API; bad images and a
text-only model are one line and a hint, with a non-zero exit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import requires_llama
from tests.imageutil import png
from tests.models import test_model
from tests.test_cli import _PtyChat, cli, pty_chat  # noqa: F401 - pty_chat is a fixture

pytest.importorskip("PIL", reason="Pillow is not installed (pip install -e '.[llama-cpp]')")
pytestmark = requires_llama

IMG = png(112, 84)
TEXT = "Describe this."
FLAGS = ("--backend", "llama.cpp", "--context", "2048", "--temperature", "0",
         "--max-tokens", "12")


@pytest.fixture(scope="module")
def want() -> Any:
    import localrun

    with localrun.load(str(test_model("vl-gguf")), backend="llama.cpp", context=2048,
                       threads=1) as m:
        return m.chat([{"role": "user", "content": TEXT, "images": [IMG]}], temperature=0,
                      max_tokens=12)


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "photo.png").write_bytes(IMG)
    (tmp_path / "notes.txt").write_text("not a picture")
    return {"png": tmp_path / "photo.png", "txt": tmp_path / "notes.txt"}


def test_run_with_an_image_prints_the_python_apis_reply(want: Any, files: dict[str, Path],
                                                        clean_env: dict[str, str]) -> None:
    r = cli("run", str(test_model("vl-gguf")), TEXT, "--image", str(files["png"]), *FLAGS,
            env=clean_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want.text + "\n"


def test_run_with_a_bad_image_or_a_text_model_is_one_line(files: dict[str, Path],
                                                          clean_env: dict[str, str]) -> None:
    r = cli("run", str(test_model("vl-gguf")), TEXT, "--image", str(files["txt"]), *FLAGS,
            env=clean_env)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert lines[0] == (f"error: --image {files['txt']}: not a PNG, JPEG, WebP or GIF image "
                        "(its first bytes are b'not a pi')")
    assert lines[1].startswith("  hint: ") and len(lines) == 2
    r = cli("run", str(test_model("gguf-q4_1")), TEXT, "--image", str(files["png"]), *FLAGS,
            env=clean_env)
    assert r.returncode == 1 and "images is not available on llama.cpp" in r.stderr
    assert "Traceback" not in r.stderr and "mmproj" in r.stderr


def test_chat_image_command(want: Any, files: dict[str, Path], clean_env: dict[str, str],
                            pty_chat: Callable[..., _PtyChat]) -> None:  # noqa: F811
    chat = pty_chat(clean_env, str(test_model("vl-gguf")), *FLAGS)
    assert "/image PATH" in chat.send("/help")
    assert "error: /image" in chat.send(f"/image {files['txt']}")
    assert "Image attached (PNG, 112x84)" in chat.send(f"/image {files['png']}")
    assert want.text in chat.send(TEXT)
    assert chat.stats() == (want.usage.prompt_tokens, want.usage.completion_tokens)
