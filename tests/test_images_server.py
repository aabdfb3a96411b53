"""Images through ``localrun serve`` with the official clients (openai, ollama, anthropic;
the Responses API through openai), on llama.cpp with the vl-gguf fixture; bad images are
400s naming the reason, and an image URL is fetched only with --allow-image-urls (a
local HTTP server records every request it gets)."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import HAVE_LLAMA
from tests.imageutil import black_png, data_uri, png
from tests.models import test_model
from tests.serverutil import Running, request, serve

pytest.importorskip("PIL", reason="Pillow is not installed (pip install -e '.[llama-cpp]')")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
ollama = pytest.importorskip("ollama", reason="the ollama client is not installed")
anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed "
                                "(pip install -e '.[clients]')")
pytestmark = pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not installed "
                                "(pip install -e '.[llama-cpp]')")

from localrun.server.config import ServerConfig  # noqa: E402

IMG = png(112, 84)
TEXT = "Describe this."


def ask(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": TEXT}]}]


@pytest.fixture(scope="module")
def models() -> Iterator[dict[str, Any]]:
    import localrun

    with localrun.load(str(test_model("vl-gguf")), backend="llama.cpp", context=2048,
                       threads=1) as vl, \
            localrun.load(str(test_model("gguf-q4_1")), backend="llama.cpp", context=512,
                          threads=1) as text:
        yield {"vl": vl, "text": text}


@pytest.fixture(scope="module")
def srv(models: dict[str, Any]) -> Iterator[Running]:
    with serve(ServerConfig(), preload=models) as s:
        yield s


@pytest.fixture(scope="module")
def fetching(models: dict[str, Any]) -> Iterator[Running]:
    with serve(ServerConfig(allow_image_urls=True), preload=models) as s:
        yield s


@pytest.fixture(scope="module")
def want(models: dict[str, Any]) -> Any:
    return models["vl"].chat(ask(data_uri(IMG)), temperature=0, max_tokens=12)


@pytest.fixture()
def recorder() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server that serves IMG at /img.png (404 elsewhere) and records paths."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            if self.path != "/img.png":
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(IMG)))
            self.end_headers()
            self.wfile.write(IMG)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", hits
    finally:
        server.shutdown()
        thread.join(10)


def oa(s: Running) -> Any:
    return openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=120)


def test_openai_client_data_uri_is_the_python_apis_reply(srv: Running, want: Any) -> None:
    r = oa(srv).chat.completions.create(model="vl", messages=ask(data_uri(IMG)),
                                        temperature=0, max_tokens=12)
    assert r.choices[0].message.content == want.text
    assert r.usage is not None and r.usage.prompt_tokens == want.usage.prompt_tokens


def test_openai_stream_with_an_image(srv: Running, want: Any) -> None:
    stream = oa(srv).chat.completions.create(
        model="vl", messages=ask(data_uri(IMG)), temperature=0, max_tokens=12,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens


def test_ollama_client_images(srv: Running, want: Any) -> None:
    client = ollama.Client(host=srv.url)
    r = client.chat(model="vl", messages=[{"role": "user", "content": TEXT,
                                           "images": [IMG]}],
                    options={"temperature": 0, "num_predict": 12})
    assert r.message.content == want.text
    assert r.prompt_eval_count == want.usage.prompt_tokens
    g = client.generate(model="vl", prompt=TEXT, images=[IMG],
                        options={"temperature": 0, "num_predict": 12})
    assert g.response == want.text


def test_anthropic_image_block(srv: Running, want: Any) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0,
                                 timeout=120)
    r = client.messages.create(model="vl", max_tokens=12, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(IMG).decode()}},
            {"type": "text", "text": TEXT}]}])
    assert r.content[0].text == want.text
    assert r.usage.input_tokens == want.usage.prompt_tokens


def test_responses_input_image(srv: Running, want: Any) -> None:
    r = oa(srv).responses.create(model="vl", temperature=0, max_output_tokens=12, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_uri(IMG),
                                      "detail": "auto"},
                                     {"type": "input_text", "text": TEXT}]}])
    assert r.output_text == want.text


@pytest.fixture()
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every image the server decodes (its byte count), counted where localrun decodes."""
    import localrun.images

    seen: list[int] = []
    real = localrun.images.decode_image

    def counting(data: bytes, where: str = "the image") -> Any:
        seen.append(len(data))
        return real(data, where)

    monkeypatch.setattr(localrun.images, "decode_image", counting)
    return seen


def test_each_dialect_decodes_an_image_once(srv: Running, want: Any,
                                            decodes: list[int]) -> None:
    """The dialect layer's check decodes the image and the model gets it decoded (before:
    twice per request, once to check it and again for the engine)."""
    r = oa(srv).chat.completions.create(model="vl", messages=ask(data_uri(IMG)),
                                        temperature=0, max_tokens=12)
    assert r.choices[0].message.content == want.text
    assert decodes == [len(IMG)]
    ollama.Client(host=srv.url).chat(model="vl", messages=[
        {"role": "user", "content": TEXT, "images": [IMG]}],
        options={"temperature": 0, "num_predict": 2})
    anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0,
                        timeout=120).messages.create(model="vl", max_tokens=2, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(IMG).decode()}},
            {"type": "text", "text": TEXT}]}])
    oa(srv).responses.create(model="vl", max_output_tokens=2, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_uri(IMG),
                                      "detail": "auto"},
                                     {"type": "input_text", "text": TEXT}]}])
    assert decodes == [len(IMG)] * 4


@pytest.mark.parametrize(("data", "words"), [
    (b"hello, not an image", "not a PNG, JPEG, WebP or GIF image"),
    (IMG[: len(IMG) // 2], "damaged or cut-short PNG image (112x84"),
    (black_png(10_000, 5_000), "10000x5000 is 50.0 megapixels, over localrun's limit"),
])
def test_bad_images_are_400s_naming_the_reason(srv: Running, data: bytes, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oa(srv).chat.completions.create(model="vl", messages=ask(data_uri(data)),
                                        max_tokens=2)
    assert words in e.value.body["message"]
    assert "\n" not in e.value.body["message"]
    with pytest.raises(ollama.ResponseError) as o:
        ollama.Client(host=srv.url).chat(model="vl", messages=[
            {"role": "user", "content": TEXT, "images": [data]}])
    assert o.value.status_code == 400 and words in o.value.error


def test_an_image_to_a_text_only_model_is_a_400_naming_what_can(srv: Running) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oa(srv).chat.completions.create(model="text", messages=ask(data_uri(IMG)),
                                        max_tokens=2)
    message = e.value.body["message"]
    assert "images is not available on llama.cpp" in message and "mmproj" in message


def test_an_image_url_is_refused_without_the_flag_and_nothing_is_fetched(
        srv: Running, recorder: tuple[str, list[str]]) -> None:
    base, hits = recorder
    with pytest.raises(openai.BadRequestError) as e:
        oa(srv).chat.completions.create(model="vl", messages=ask(base + "/img.png"),
                                        max_tokens=2)
    assert e.value.body["code"] == "image_url_not_allowed"
    assert "--allow-image-urls" in e.value.body["message"]
    status, _, body = request("POST", srv.url + "/v1/messages", {
        "model": "vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": base + "/img.png"}},
            {"type": "text", "text": TEXT}]}]})
    assert status == 400 and b"--allow-image-urls" in body
    assert hits == []


def test_with_the_flag_an_image_url_is_fetched_once(
        fetching: Running, recorder: tuple[str, list[str]], want: Any) -> None:
    base, hits = recorder
    r = oa(fetching).chat.completions.create(model="vl", messages=ask(base + "/img.png"),
                                             temperature=0, max_tokens=12)
    assert r.choices[0].message.content == want.text
    assert hits == ["/img.png"]
    with pytest.raises(openai.BadRequestError) as e:
        oa(fetching).chat.completions.create(model="vl", messages=ask(base + "/gone.png"),
                                             max_tokens=2)
    assert "answered HTTP 404" in e.value.body["message"]


def test_a_file_url_is_never_read(srv: Running) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oa(srv).chat.completions.create(model="vl", messages=ask("file:///etc/passwd"),
                                        max_tokens=2)
    assert "data: URI" in e.value.body["message"]


def test_ollama_show_lists_vision_for_a_vision_model(srv: Running) -> None:
    client = ollama.Client(host=srv.url)
    assert "vision" in (client.show("vl").capabilities or [])
    assert "vision" not in (client.show("text").capabilities or [])


def test_a_vision_model_on_disk_has_the_vision_capability() -> None:
    from localrun.formats.projector import sees_images

    folder = test_model("vl-gguf")
    assert sees_images(folder / "Tiny-Qwen2.5-VL.F16.gguf")
    assert sees_images(test_model("vl-openvino"))
    assert not sees_images(test_model("gguf-q4_1"))
    assert not sees_images(test_model("openvino-int4"))
