"""A small, strict GGUF header reader: no engine, no numpy.

It reads the metadata and the tensor table, and checks that the file is as long as
its tensor table says. A truncated download or a garbage file is caught here, with
the numbers, before any engine sees it (llama.cpp reports only "Failed to load model
from file", and some damage it does not notice until generation).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.errors import ModelFileError

MAGIC = b"GGUF"

# GGUF metadata value types -> struct format (scalars only).
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9

# ggml tensor type -> (elements per block, bytes per block); from ggml's type traits.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}

# general.file_type -> the quant name users know (llama_ftype in llama.h).
FILE_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE",
}

# GGUF general.sampling.* keys (written by recent convert_hf_to_gguf.py from
# generation_config.json) -> localrun sampling option.
SAMPLING_KEYS: dict[str, str] = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}

_MAX_KEPT_ARRAY = 64  # token lists and merges are skipped, not kept


@dataclass(frozen=True)
class GGUFInfo:
    path: str
    version: int
    n_tensors: int
    metadata: dict[str, Any]
    file_size: int
    expected_size: int | None
    tensor_bytes: int
    chat_template: str | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def _arch_key(self, suffix: str) -> Any:
        return self.metadata.get(f"{self.architecture}.{suffix}")

    @property
    def architecture(self) -> str | None:
        v = self.metadata.get("general.architecture")
        return v if isinstance(v, str) else None

    @property
    def name(self) -> str | None:
        v = self.metadata.get("general.name")
        return v if isinstance(v, str) else None

    @property
    def quantization(self) -> str | None:
        ft = self.metadata.get("general.file_type")
        if isinstance(ft, int):
            return FILE_TYPES.get(ft, f"type{ft}")
        return None

    @property
    def context_length(self) -> int | None:
        v = self._arch_key("context_length")
        return int(v) if isinstance(v, int) else None

    @property
    def n_layers(self) -> int | None:
        v = self._arch_key("block_count")
        return int(v) if isinstance(v, int) else None

    @property
    def n_heads(self) -> int | None:
        v = self._arch_key("attention.head_count")
        return int(v) if isinstance(v, int) else None

    @property
    def n_kv_heads(self) -> int | None:
        v = self._arch_key("attention.head_count_kv")
        return int(v) if isinstance(v, int) else self.n_heads

    @property
    def head_dim(self) -> int | None:
        v = self._arch_key("attention.key_length")
        if isinstance(v, int):
            return v
        emb, heads = self._arch_key("embedding_length"), self.n_heads
        return emb // heads if isinstance(emb, int) and heads else None


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise struct.error("string past end of file")
        s = bytes(self.buf[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return s

    def skip_string(self) -> None:
        n = self.scalar("<Q")
        self.pos += n
        if self.pos > len(self.buf):
            raise struct.error("string past end of file")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.scalar("<I")
            count = self.scalar("<Q")
            if count > len(self.buf):
                raise ValueError(f"array of {count} items cannot fit in the file")
            if count > _MAX_KEPT_ARRAY:
                self._skip_array(etype, count)
                return _SkippedArray(count)
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    def _skip_array(self, etype: int, count: int) -> None:
        if etype in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[etype]) * count
        elif etype == _STRING:
            for _ in range(count):
                self.skip_string()
        else:
            for _ in range(count):
                self.value(etype)
        if self.pos > len(self.buf):
            raise struct.error("array past end of file")


@dataclass(frozen=True)
class _SkippedArray:
    length: int


def is_gguf(path: str | os.PathLike[str]) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def read_gguf(path: str | os.PathLike[str], *, check_size: bool = True) -> GGUFInfo:
    """Read a GGUF file's header; raise ModelFileError if it is not a sound GGUF."""
    p = Path(path)
    try:
        size = p.stat().st_size
        fh = open(p, "rb")  # noqa: SIM115 - closed by the with-block below
    except OSError as e:
        raise ModelFileError(str(p), e.strerror or str(e)) from e
    with fh:
        if size < 24:
            raise ModelFileError(str(p), f"file is only {size} bytes, too short to be a GGUF model")
        if fh.read(4) != MAGIC:
            raise ModelFileError(str(p), "not a GGUF file (it does not start with 'GGUF')")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                return _parse(p, mm, size, check_size)
            except (struct.error, ValueError, UnicodeDecodeError) as e:
                raise ModelFileError(
                    str(p), f"GGUF header is damaged or truncated ({size:,} bytes on disk): {e}"
                ) from e


def _parse(p: Path, mm: mmap.mmap, size: int, check_size: bool) -> GGUFInfo:
    r = _Reader(mm)
    r.pos = 4
    version = r.scalar("<I")
    if version not in (2, 3):
        raise ModelFileError(str(p), f"unsupported GGUF version {version} (expected 2 or 3)")
    n_tensors = r.scalar("<Q")
    n_kv = r.scalar("<Q")
    if n_kv > size or n_tensors > size:
        raise ValueError(f"header claims {n_kv} keys and {n_tensors} tensors")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        vtype = r.scalar("<I")
        meta[key] = r.value(vtype)
    tensor_end = 0
    tensor_bytes = 0
    sizes_known = True
    for _ in range(n_tensors):
        r.skip_string()
        n_dims = r.scalar("<I")
        if n_dims > 8:
            raise ValueError(f"tensor with {n_dims} dimensions")
        n_el = 1
        for _ in range(n_dims):
            n_el *= r.scalar("<Q")
        ttype = r.scalar("<I")
        offset = r.scalar("<Q")
        traits = GGML_TYPES.get(ttype)
        if traits is None:
            sizes_known = False
            continue
        _, block, type_size = traits
        nbytes = n_el // block * type_size
        tensor_bytes += nbytes
        tensor_end = max(tensor_end, offset + nbytes)
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0:
        align = 32
    data_start = (r.pos + align - 1) // align * align
    expected = data_start + tensor_end if sizes_known and n_tensors else None
    if check_size and expected is not None and size < expected:
        raise ModelFileError(
            str(p),
            f"file is truncated: {size:,} bytes on disk, the tensor table needs {expected:,}",
        )
    meta = {k: v for k, v in meta.items() if not isinstance(v, _SkippedArray)}
    template = meta.get("tokenizer.chat_template")
    sampling = {opt: meta[key] for key, opt in SAMPLING_KEYS.items() if key in meta}
    return GGUFInfo(
        path=str(p),
        version=version,
        n_tensors=n_tensors,
        metadata=meta,
        file_size=size,
        expected_size=expected,
        tensor_bytes=tensor_bytes,
        chat_template=template if isinstance(template, str) else None,
        sampling_defaults=sampling,
    )
