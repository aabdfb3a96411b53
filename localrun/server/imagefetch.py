"""``http(s)://`` image URLs in a request: refused, or fetched by the server itself.

The library never fetches a URL (:mod:`localrun.images`). A server started with
``--allow-image-urls`` fetches each image URL of a request before the model sees it:
http and https only (redirects too; never ``file:``), at most
:data:`~localrun.images.MAX_IMAGE_BYTES` each, within :data:`FETCH_SECONDS` in all; the
bytes then replace the URL. Without the flag such a request is a 400 that says how to
send the image instead, and nothing is fetched.
"""

from __future__ import annotations

import asyncio
import base64
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from localrun.images import MAX_IMAGE_BYTES
from localrun.server.errors import APIError

#: the whole time a request's image URLs may take to fetch, together (seconds)
FETCH_SECONDS = 10.0
#: most image URLs one request may carry
MAX_URLS = 8


def _is_url(value: Any) -> bool:
    return isinstance(value, str) and value[:8].lower().startswith(("http://", "https://"))


def _url_slots(messages: list[dict[str, Any]]) -> Iterator[tuple[Any, Any]]:
    """(container, key) of every image URL in the library's messages."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    inner = part.get("image_url")
                    if isinstance(inner, dict) and _is_url(inner.get("url")):
                        yield inner, "url"
                    elif _is_url(inner):
                        yield part, "image_url"
        images = m.get("images")
        if isinstance(images, list):
            for k, value in enumerate(images):
                if _is_url(value):
                    yield images, k


def has_image_urls(messages: list[dict[str, Any]] | None) -> bool:
    return messages is not None and next(_url_slots(messages), None) is not None


async def fetch_image_urls(messages: list[dict[str, Any]], allowed: bool,
                           param: str = "messages") -> list[dict[str, Any]]:
    """``messages`` with every image URL replaced by its bytes (as a data: URI), or an
    APIError (400) when the server may not fetch them or one cannot be fetched."""
    import copy

    out = copy.deepcopy(messages)
    slots = list(_url_slots(out))
    if not slots:
        return out
    if not allowed:
        first = slots[0][0][slots[0][1]]
        raise APIError(400, f"Image URLs are not fetched by this server ({first[:80]}): send "
                       "the image itself, as a data: URI or base64 (or start localrun serve "
                       "with --allow-image-urls)", param=param, code="image_url_not_allowed")
    if len(slots) > MAX_URLS:
        raise APIError(400, f"{len(slots)} image URLs in one request, over the limit of "
                       f"{MAX_URLS}", param=param, code="invalid_value")
    deadline = time.monotonic() + FETCH_SECONDS
    for holder, key in slots:
        data = await asyncio.to_thread(fetch, holder[key], deadline)
        holder[key] = "data:image;base64," + base64.b64encode(data).decode("ascii")
    return out


def _opener() -> urllib.request.OpenerDirector:
    """HTTP(S) alone: urllib's default opener also reads file: and ftp: URLs."""
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(),
                    urllib.request.HTTPRedirectHandler(),
                    urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def fetch(url: str, deadline: float) -> bytes:
    """One image URL's bytes, bounded in size and time (an APIError otherwise)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise APIError(400, f"Fetching the request's image URLs took over {FETCH_SECONDS:g} s",
                       code="image_fetch_failed")
    request = urllib.request.Request(url, headers={"User-Agent": "localrun"})
    try:
        with _opener().open(request, timeout=left) as resp:
            chunks: list[bytes] = []
            size = 0
            while chunk := resp.read(65536):
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise APIError(400, f"The image at {url[:80]} is over {MAX_IMAGE_BYTES:,} "
                                   "bytes", code="image_fetch_failed")
                if time.monotonic() > deadline:
                    raise APIError(400, f"Fetching {url[:80]} took over {FETCH_SECONDS:g} s",
                                   code="image_fetch_failed")
                chunks.append(chunk)
            return b"".join(chunks)
    except urllib.error.HTTPError as e:
        raise APIError(400, f"The image URL {url[:80]} answered HTTP {e.code}",
                       code="image_fetch_failed") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise APIError(400, f"Cannot fetch the image URL {url[:80]}: {reason}",
                       code="image_fetch_failed") from None
