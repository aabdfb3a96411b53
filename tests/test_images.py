"""Images in messages (localrun.images): localrun reads, checks and decodes every image
itself; what is not a usable image is a one-line ImageError naming the reason and the
numbers. No engine here (tests/test_images_llama.py, test_images_openvino.py and
test_images_server.py run them)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("PIL", reason="Pillow is not installed (pip install -e '.[llama-cpp]')")

from localrun.images import (
    MARKER,
    Image,
    ImageError,
    ImagesUnsupportedError,
    read_image,
)
from localrun.templates import normalize_messages
from tests.imageutil import black_png, data_uri, pillow, png


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_decodes_to_rgb(fmt: str) -> None:
    im = read_image(pillow(fmt, 40, 30))
    assert (im.width, im.height, im.format) == (40, 30, fmt.lower())
    assert len(im.rgb) == 40 * 30 * 3
    assert im.array().shape == (1, 30, 40, 3)


def test_bytes_path_file_uri_and_data_uri_are_the_same_image(tmp_path: Path) -> None:
    data = png(16, 12)
    f = tmp_path / "a.png"
    f.write_bytes(data)
    images = [read_image(v) for v in (data, str(f), f, "file://" + str(f), data_uri(data))]
    assert {im.rgb for im in images} == {images[0].rgb}


def test_not_an_image_names_what_it_is() -> None:
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP or GIF image \\(a PDF"):
        read_image(b"%PDF-1.7\n...")
    with pytest.raises(ImageError, match="its first bytes are b'hello wo'"):
        read_image(b"hello world")
    with pytest.raises(ImageError, match="it is empty"):
        read_image(b"")


def test_a_truncated_png_is_refused_with_its_size() -> None:
    data = png(64, 64)
    cut = data[: len(data) // 2]
    with pytest.raises(ImageError, match="damaged or cut-short PNG image \\(64x64, "):
        read_image(cut)


def test_a_50_megapixel_image_is_refused_before_it_is_decoded() -> None:
    data = black_png(10_000, 5_000)
    assert len(data) < 1_000_000  # small on the wire: the pixels are what is refused
    with pytest.raises(ImageError, match=r"10000x5000 is 50\.0 megapixels, over "
                       r"localrun's limit of 32 megapixels") as e:
        read_image(data)
    assert e.value.hint == "scale it down first"


def test_an_http_url_is_never_fetched() -> None:
    hits: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(png(8, 8))

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/cat.png"
        with pytest.raises(ImageError, match="localrun does not fetch image URLs"):
            read_image(url)
        with pytest.raises(ImageError, match="does not fetch"):
            normalize_messages([{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}])
    finally:
        server.shutdown()
        thread.join(10)
    assert hits == []


def test_missing_file_and_bad_data_uri() -> None:
    with pytest.raises(ImageError, match=r"cannot read .*nope\.png"):
        read_image("/nonexistent/nope.png")
    with pytest.raises(ImageError, match="must be base64"):
        read_image("data:image/png,abc")
    with pytest.raises(ImageError, match="base64 is invalid"):
        read_image("data:image/png;base64,***")


def test_messages_carry_images_as_markers_in_order() -> None:
    a, b = png(8, 8), png(9, 9)
    [m] = normalize_messages([{"role": "user", "content": [
        {"type": "text", "text": "first "}, {"type": "image_url", "image_url": {
            "url": data_uri(a)}}, " then ", {"type": "image", "image": b}]}])
    assert m["content"] == f"first {MARKER} then {MARKER}"
    assert [(i.width, i.height) for i in m["images"]] == [(8, 8), (9, 9)]
    # Ollama's shape: images before the text; normalizing again changes nothing
    [o] = normalize_messages([{"role": "user", "content": "what?", "images": [a]}])
    assert o["content"] == MARKER + "what?" and len(o["images"]) == 1
    assert normalize_messages([o]) == [o]


def test_bad_parts_and_the_marker_in_text_are_refused() -> None:
    from localrun.errors import LocalrunError

    with pytest.raises(LocalrunError, match="content part localrun does not take"):
        normalize_messages([{"role": "user", "content": [{"type": "audio"}]}])
    with pytest.raises(LocalrunError, match="image marker"):
        normalize_messages([{"role": "user", "content": [f"look {MARKER}"]}])
    with pytest.raises(ImageError, match="message 0, image 2: not a PNG"):
        normalize_messages([{"role": "user", "content": "x", "images": [png(4, 4), b"no"]}])
    with pytest.raises(ImageError, match="17 images, over localrun's limit of 16"):
        normalize_messages([{"role": "user", "content": "x", "images": [png(2, 2)] * 17}])


def test_fit_scales_down_keeping_the_aspect() -> None:
    im = read_image(png(400, 200))
    small = im.fit(20_000)
    assert small.pixels <= 20_000 and abs(small.width / small.height - 2) < 0.05
    assert im.fit(10**6) is im


def test_unsupported_error_names_the_engines_that_take_images() -> None:
    e = ImagesUnsupportedError("onnx", "no vision path")
    assert "images is not available on onnx: no vision path" in str(e)
    assert "llama.cpp" in (e.hint or "") and "OpenVINO" in (e.hint or "")
    assert isinstance(e, ValueError)


@pytest.fixture()
def image_file(tmp_path: Path) -> Iterator[Path]:
    f = tmp_path / "photo.png"
    f.write_bytes(png(32, 24))
    yield f


def test_image_repr_and_source(image_file: Path) -> None:
    im = read_image(image_file)
    assert repr(im) == "<localrun.Image png 32x24>"
    assert read_image(im) is im and isinstance(im, Image)


@pytest.mark.parametrize(("backend", "module", "fixture", "words"), [
    ("onnx", "onnxruntime_genai", "onnx-int4", "makes only the text decoder"),
    ("mlx", "mlx_lm", "mlx-4bit", "mlx-vlm is not wired in"),
])
def test_engines_without_a_vision_path_refuse_saying_why(backend: str, module: str,
                                                         fixture: str, words: str) -> None:
    import importlib.util

    import localrun
    from tests.models import test_model

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[{backend}]')")
    with localrun.load(str(test_model(fixture)), backend=backend, context=512) as m:
        with pytest.raises(ImagesUnsupportedError, match=words) as e:
            m.chat([{"role": "user", "content": "Hi", "images": [png(8, 8)]}], max_tokens=2)
        assert "llama.cpp" in (e.value.hint or "") and "OpenVINO" in (e.value.hint or "")
