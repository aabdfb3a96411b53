"""Images for tests, written with the standard library (and Pillow where it is asked for)."""

from __future__ import annotations

import base64
import io
import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def png(width: int, height: int, seed: int = 0) -> bytes:
    """An RGB gradient PNG (``seed`` shifts its colours)."""
    rows = b"".join(
        b"\x00" + b"".join(bytes(((x * 255 // max(width - 1, 1) + seed) & 255,
                                  (y * 255 // max(height - 1, 1) + 3 * seed) & 255,
                                  (x * 7 + y * 13 + 5 * seed) & 255)) for x in range(width))
        for y in range(height))
    return (b"\x89PNG\r\n\x1a\n"
            + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(rows)) + _chunk(b"IEND", b""))


def black_png(width: int, height: int) -> bytes:
    """A valid all-black PNG of any size, compressed row by row (a 50-megapixel one is
    ~150 KB and never held whole in memory here)."""
    comp = zlib.compressobj(9)
    row = b"\x00" * (1 + width * 3)
    body = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    return (b"\x89PNG\r\n\x1a\n"
            + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", body) + _chunk(b"IEND", b""))


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def pillow(fmt: str, width: int = 40, height: int = 30) -> bytes:
    """The gradient as ``fmt`` (JPEG, WEBP, GIF, PNG) through Pillow."""
    from PIL import Image

    img = Image.open(io.BytesIO(png(width, height)))
    out = io.BytesIO()
    img.save(out, format=fmt)
    return out.getvalue()
