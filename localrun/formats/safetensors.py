"""A strict safetensors header reader: u64 little-endian length + JSON header, no numpy.

Reads tensor names, dtypes and the ``__metadata__`` block, and checks that the file
is as long as its header says, so a truncated download is caught with the numbers.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.errors import ModelFileError

#: A larger header is not a safetensors file (the format caps it at 100 MB).
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    tensors: dict[str, str]  # name -> dtype
    metadata: dict[str, str] = field(default_factory=dict)
    data_bytes: int = 0

    @property
    def main_dtype(self) -> str | None:
        """The dtype holding the most tensors (BF16, F16, F32, I32, U8 ...)."""
        if not self.tensors:
            return None
        return Counter(self.tensors.values()).most_common(1)[0][0]

    def has_suffix(self, *suffixes: str) -> bool:
        return any(name.endswith(suffixes) for name in self.tensors)


def read_safetensors_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read a safetensors header; raise ModelFileError for damaged or truncated files."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFileError(str(p), f"file is only {size} bytes, too short to be "
                                     "a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or n + 8 > size:
                raise ModelFileError(
                    str(p), f"safetensors header is damaged or truncated: it claims {n:,} "
                    f"bytes of header, the file has {size:,} bytes")
            raw = f.read(n)
    except OSError as e:
        if isinstance(e, ModelFileError):
            raise
        raise ModelFileError(str(p), e.strerror or str(e)) from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(str(p), f"safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise ModelFileError(str(p), "safetensors header is not a JSON object")
    meta_raw = header.pop("__metadata__", None) or {}
    metadata = {str(k): str(v) for k, v in meta_raw.items()} if isinstance(meta_raw, dict) \
        else {}
    tensors: dict[str, str] = {}
    end = 0
    for name, info in header.items():
        if not isinstance(info, dict) or "dtype" not in info:
            raise ModelFileError(str(p), f"safetensors entry {name!r} has no dtype")
        tensors[name] = str(info["dtype"])
        offsets = info.get("data_offsets")
        if isinstance(offsets, list) and len(offsets) == 2 and isinstance(offsets[1], int):
            end = max(end, offsets[1])
    if 8 + n + end > size:
        raise ModelFileError(
            str(p), f"file is truncated: {size:,} bytes on disk, its header needs "
            f"{8 + n + end:,}")
    return SafetensorsHeader(str(p), tensors, metadata, end)


def write_safetensors_header(path: str | os.PathLike[str], tensors: dict[str, Any],
                             metadata: dict[str, str] | None = None) -> None:
    """Write a valid safetensors file of zero-filled tensors (for tests and fixtures).

    ``tensors`` maps name -> (dtype, shape).
    """
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I16": 2, "U8": 1, "I8": 1,
             "F8_E4M3": 1, "I64": 8}
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset,
                                                                              offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.write(b"\0" * offset)
