"""Image input in each dialect's shape, as the library's content parts.

OpenAI's ``image_url`` parts, Anthropic's ``image`` blocks (a base64 ``source``, or a
``url`` one), the Responses API's ``input_image`` items and Ollama's ``images`` (base64
strings) all become ``{"type": "image_url", "image_url": {"url": ...}}`` parts of the
library's messages (:mod:`localrun.images`): a ``data:`` URI, or an ``http(s)://`` URL
that only ``localrun serve --allow-image-urls`` fetches (:mod:`localrun.server.imagefetch`)
before the library sees it. The library checks and decodes each image; a bad one is a
400 naming the reason.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from localrun.server.protocol.common import Shape, invalid, refused

#: the image types each dialect documents (anything else is refused by its first bytes)
MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")


def image_part(url: str) -> dict[str, Any]:
    """The library's content part for an image URL (``data:`` or ``http(s)://``)."""
    return {"type": "image_url", "image_url": {"url": url}}


def data_uri(b64: str, media_type: str = "image/png") -> str:
    """A base64 payload as a ``data:`` URI (localrun reads the type from the bytes)."""
    return f"data:{media_type};base64,{b64}"


def check_url(url: str, name: str) -> None:
    """A data: URI or an http(s) URL; no other scheme (``file:`` above all)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("data", "http", "https"):
        raise invalid(f"an image URL must be a data: URI (or http(s), where the server "
                      f"fetches them), not {url[:60]!r}", name)


class ImageURL(Shape):
    url: str
    detail: str | None = None

    IGNORED: ClassVar = ("detail",)

    def refuse(self) -> None:
        super().refuse()
        check_url(self.url, "url")


class OpenAIImagePart(Shape):
    """OpenAI Chat Completions' ``image_url`` content part."""

    type: Literal["image_url"]
    image_url: ImageURL

    def to_library(self) -> dict[str, Any]:
        return image_part(self.image_url.url)


class ImageSource(Shape):
    """Anthropic's image source: base64 data with its media type, or a URL."""

    type: Literal["base64", "url", "file"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None
    file_id: str | None = None

    def refuse(self) -> None:
        if self.type == "file":
            raise refused("type", "images uploaded through the Files API are not kept by "
                          "localrun: send the image as base64")
        super().refuse()
        if self.type == "base64":
            if not self.data:
                raise invalid("a base64 image source needs 'data'", "data")
            if self.media_type not in MEDIA_TYPES:
                raise invalid(f"media_type must be one of {', '.join(MEDIA_TYPES)}",
                              "media_type")
        elif not self.url:
            raise invalid("a url image source needs 'url'", "url")
        else:
            check_url(self.url, "url")

    def to_library(self) -> dict[str, Any]:
        if self.type == "base64":
            return image_part(data_uri(self.data or "", self.media_type or "image/png"))
        return image_part(self.url or "")


class AnthropicImageBlock(Shape):
    """Anthropic's ``image`` content block."""

    type: Literal["image"]
    source: ImageSource

    IGNORED: ClassVar = ("cache_control",)

    def to_library(self) -> dict[str, Any]:
        return self.source.to_library()


class InputImage(Shape):
    """The Responses API's ``input_image`` content item."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None

    IGNORED: ClassVar = ("detail",)
    REFUSED: ClassVar = {"file_id": (None, "uploaded files are not kept by localrun: send "
                                     "the image as a data: URI in image_url")}

    def refuse(self) -> None:
        super().refuse()
        if not self.image_url:
            raise invalid("an input_image needs 'image_url' (a data: URI)", "image_url")
        check_url(self.image_url, "image_url")

    def to_library(self) -> dict[str, Any]:
        return image_part(self.image_url or "")


def ollama_images(images: list[str] | None) -> list[str]:
    """Ollama's ``images`` (base64, no prefix; a data: URI is taken too) as data: URIs."""
    return [im if im.startswith("data:") else data_uri(im) for im in images or ()]
