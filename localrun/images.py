"""Images in a conversation: read, checked and decoded by localrun, never by an engine.

A message carries images as content parts (OpenAI's shape) or as an ``images`` list
(Ollama's); each image is bytes, a local file's path, a ``data:`` URI or an
:class:`Image`. localrun reads it itself (an engine is never handed a URL: llama-cpp-python
would fetch any ``http://`` or ``file://`` URL it is given), checks its type by its first
bytes (PNG, JPEG, WebP, GIF), its size and its pixels, and decodes it to RGB with Pillow.
An ``http(s)://`` URL is refused here; only ``localrun serve --allow-image-urls`` fetches
one, bounded in bytes and time (:mod:`localrun.server.imagefetch`).

Normalized, a message's ``content`` is a string with :data:`MARKER` where each image goes
and its ``images`` the decoded images in that order: every other part of localrun (chat
templates, presets, tools) keeps handling text, and a vision engine swaps each marker for
the image's embeddings (:meth:`localrun.backends.base.Session.attach_images`).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localrun.errors import LocalrunError, UnsupportedFeatureError

#: Where an image goes in a normalized message's text (llama.cpp mtmd's own marker).
MARKER = "<__media__>"
#: Largest image file or payload localrun reads (bytes).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
#: Largest image localrun decodes (width x height): 32 megapixels (96 MiB as RGB).
MAX_IMAGE_PIXELS = 32_000_000
#: Most images one request may carry.
MAX_IMAGES = 16
#: Most image tokens (embeddings) one image takes by default on every engine with a
#: vision path (the ``image_tokens`` engine option); larger images are scaled down.
DEFAULT_IMAGE_TOKENS = 1024

#: first bytes -> format (what the engines' decoders and Pillow all read)
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpeg"), (b"GIF87a", "gif"),
    (b"GIF89a", "gif"))
#: a few files people send by mistake, to name them
_OTHER: tuple[tuple[bytes, str], ...] = (
    (b"%PDF", "a PDF document"), (b"PK\x03\x04", "a ZIP archive (or an Office document)"),
    (b"<svg", "an SVG drawing"), (b"<?xml", "an XML file"), (b"BM", "a BMP image"),
    (b"II*\x00", "a TIFF image"), (b"MM\x00*", "a TIFF image"))
ENGINES_WITH_IMAGES = ("llama.cpp", "openvino")
#: why an engine without a vision path in localrun has none (its refusal says so)
NO_VISION = {
    "mlx": "mlx-vlm is not wired in (0.7.10 requires transformers, datasets, opencv-python, "
           "mlx-audio and starlette>=1.0.1: no clean extra)",
    "onnx": "ONNX Runtime GenAI runs VLMs, but its model builder makes only the text "
            "decoder (the vision and embedding ONNX files need exporters it does not ship)",
    "vllm": "localrun does not pass images to its vLLM server yet",
    "remote": "localrun does not pass images to a remote server yet",
}
HINT_ENGINES = ("load a vision model on an engine that runs images: llama.cpp (a GGUF with "
                "its mmproj-*.gguf beside it) or OpenVINO GenAI (a VLM's IR folder)")


class ImageError(LocalrunError, ValueError):
    """An image localrun cannot use: not an image, damaged, too large, or a URL it may not
    fetch. ``reason`` says which, with the numbers."""

    def __init__(self, where: str, reason: str, *, hint: str | None = None) -> None:
        self.where = where
        self.reason = reason
        super().__init__(f"{where}: {reason}" if where else reason,
                         hint=hint or "send a PNG, JPEG, WebP or GIF image (bytes, a file's "
                         "path or a data: URI)")


class ImagesUnsupportedError(UnsupportedFeatureError):
    """Images sent to a model or engine that has no vision path."""

    def __init__(self, backend: str, reason: str, *, hint: str | None = None) -> None:
        super().__init__(backend, "images", reason, supported_by=ENGINES_WITH_IMAGES)
        self.hint = hint or HINT_ENGINES


@dataclass(frozen=True, eq=False)
class Image:
    """A decoded image: ``rgb`` holds ``height`` rows of ``width`` RGB pixels."""

    rgb: bytes
    width: int
    height: int
    format: str  # "png", "jpeg", "webp", "gif"

    @property
    def pixels(self) -> int:
        return self.width * self.height

    def array(self) -> Any:
        """The pixels as a numpy uint8 array of shape [1, height, width, 3]."""
        import numpy as np

        return np.frombuffer(self.rgb, np.uint8).reshape(1, self.height, self.width, 3)

    def fit(self, max_pixels: int) -> Image:
        """This image, scaled down (aspect kept) to at most ``max_pixels`` pixels."""
        if self.pixels <= max_pixels:
            return self
        from PIL import Image as PILImage

        scale = (max_pixels / self.pixels) ** 0.5
        w, h = max(1, int(self.width * scale)), max(1, int(self.height * scale))
        img = PILImage.frombytes("RGB", (self.width, self.height), self.rgb)
        img = img.resize((w, h), PILImage.Resampling.BICUBIC)
        return Image(img.tobytes(), w, h, self.format)

    def __repr__(self) -> str:
        return f"<localrun.Image {self.format} {self.width}x{self.height}>"


def image_format(data: bytes) -> str | None:
    """"png", "jpeg", "gif" or "webp" by the first bytes; None for anything else."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return next((fmt for magic, fmt in _MAGIC if data.startswith(magic)), None)


def decode_image(data: bytes, where: str = "the image") -> Image:
    """Check ``data`` (type by its first bytes, size, pixels) and decode it to RGB."""
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(where, f"{len(data):,} bytes is over localrun's limit of "
                         f"{MAX_IMAGE_BYTES:,} bytes", hint="send a smaller image")
    fmt = image_format(data)
    if fmt is None:
        other = next((what for magic, what in _OTHER if data.lstrip()[:8].startswith(magic)),
                     None)
        seen = other or (f"its first bytes are {data[:8]!r}" if data else "it is empty")
        raise ImageError(where, f"not a PNG, JPEG, WebP or GIF image ({seen})")
    try:
        from PIL import Image as PILImage
    except ImportError as e:
        raise LocalrunError("Images need Pillow, which is not installed",
                            hint="pip install pillow") from e
    try:
        img = PILImage.open(io.BytesIO(data))
        width, height = img.size
    except Exception as e:  # Pillow's errors for a header it cannot read are many
        raise ImageError(where, f"a damaged {fmt.upper()} image (its header cannot be "
                         f"read: {e})") from e
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(where, f"{width}x{height} is {width * height / 1e6:.1f} megapixels, "
                         f"over localrun's limit of {MAX_IMAGE_PIXELS / 1e6:.0f} megapixels",
                         hint="scale it down first")
    try:
        img.load()
        rgb = img if img.mode == "RGB" else img.convert("RGB")  # no copy when RGB
    except Exception as e:  # "image file is truncated", a bad CRC, a broken stream
        raise ImageError(where, f"a damaged or cut-short {fmt.upper()} image "
                         f"({width}x{height}, {len(data):,} bytes): {e}") from e
    return Image(rgb.tobytes(), width, height, fmt)


def read_image(value: Any, where: str = "the image") -> Image:
    """One image from bytes, a local path (str, ``file://`` or PathLike), a ``data:``
    URI or an :class:`Image`; never from the network."""
    if isinstance(value, Image):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return decode_image(bytes(value), where)
    if isinstance(value, str) and value.startswith("data:"):
        return decode_image(data_uri_bytes(value, where), where)
    if isinstance(value, str) and value.split(":", 1)[0].lower() in ("http", "https"):
        raise ImageError(where, f"localrun does not fetch image URLs ({value[:80]})",
                         hint="download it and pass its path or bytes, or a data: URI "
                         "(localrun serve fetches http(s) URLs only with --allow-image-urls)")
    if isinstance(value, str) and value.startswith("file://"):
        value = value[len("file://"):]
    if isinstance(value, (str, os.PathLike)):
        return decode_image(_read_file(Path(value), where), where)
    raise ImageError(where, f"an image must be bytes, a file's path or a data: URI, "
                     f"not {type(value).__name__}")


def data_uri_bytes(uri: str, where: str = "the image") -> bytes:
    """The payload of a base64 ``data:`` URI."""
    head, sep, payload = uri.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImageError(where, "a data: URI must be base64 (data:image/png;base64,...)")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(where, f"the data: URI holds over {MAX_IMAGE_BYTES:,} bytes",
                         hint="send a smaller image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(where, f"the data: URI's base64 is invalid ({e})") from e


def _read_file(path: Path, where: str) -> bytes:
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise ImageError(where, f"{path} is {size:,} bytes, over localrun's limit of "
                             f"{MAX_IMAGE_BYTES:,} bytes", hint="send a smaller image")
        return path.read_bytes()
    except OSError as e:
        raise ImageError(where, f"cannot read {path}: {e.strerror or e}",
                         hint="pass an image file that exists") from e


# -- messages -------------------------------------------------------------------------

def message_content(i: int, content: Sequence[Any], extra: Iterable[Any] = ()
                    ) -> tuple[str, list[Image]]:
    """A message's content parts (and Ollama-style ``images``, placed first) as its text
    with :data:`MARKER` where each image goes, and the decoded images in order."""
    text: list[str] = []
    images: list[Image] = []

    def add(value: Any) -> None:
        images.append(read_image(value, f"message {i}, image {len(images) + 1}"))
        text.append(MARKER)

    for value in extra:
        add(value)
    for part in content:
        if isinstance(part, str):
            text.append(_text(i, part))
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):  # type: ignore[union-attr]
            text.append(_text(i, part["text"]))  # type: ignore[index]
        elif kind == "image_url":
            url = part.get("image_url")  # type: ignore[union-attr]
            add(url.get("url") if isinstance(url, Mapping) else url)
        elif kind == "image":
            add(part.get("image"))  # type: ignore[union-attr]
        else:
            raise LocalrunError(f"Message {i} has a content part localrun does not take: "
                                f"{part!r}"[:200],
                                hint="content parts are {'type': 'text', 'text': ...}, "
                                "{'type': 'image_url', 'image_url': {'url': 'data:...'}} or "
                                "{'type': 'image', 'image': bytes or a path}")
    if len(images) > MAX_IMAGES:
        raise ImageError(f"message {i}", f"{len(images)} images, over localrun's limit of "
                         f"{MAX_IMAGES} a request", hint="send fewer images")
    return "".join(text), images


def normalized_content(i: int, content: Any, images: Sequence[Any] | None
                       ) -> tuple[str, list[Image]]:
    """A message's content and images as :func:`message_content` makes them; a message
    normalized already (its text holds one :data:`MARKER` per decoded image) as it is."""
    if isinstance(content, str) and images and all(isinstance(x, Image) for x in images) \
            and content.count(MARKER) == len(images):
        return content, list(images)
    parts = content if isinstance(content, list) else [content or ""]
    return message_content(i, parts, images or ())


def _text(i: int, text: str) -> str:
    if MARKER in text:
        raise LocalrunError(f"Message {i}'s text holds {MARKER}, localrun's image marker",
                            hint="send images as image parts, not as that marker")
    return text


def message_images(messages: Sequence[Mapping[str, Any]] | None) -> list[Image]:
    """Every image of a normalized conversation, in order."""
    out: list[Image] = []
    for m in messages or ():
        out += m.get("images") or ()
    if len(out) > MAX_IMAGES:
        raise ImageError("", f"{len(out)} images in one request, over localrun's limit of "
                         f"{MAX_IMAGES}", hint="send fewer images")
    return out
