"""A small, strict GGUF header reader: no engine, no numpy.

It reads the metadata and the tensor table, and checks that the file is as long as
its tensor table says. A truncated download or a garbage file is caught here, with
the numbers, before any engine sees it (llama.cpp reports only "Failed to load model
from file", and some damage it does not notice until generation).

This is localrun's only GGUF parser: :func:`read_gguf` reads a file on disk (memoized
per file version, so the several steps of one load share one read), and
:func:`metadata_from_bytes` reads the metadata from the first bytes of a file that is
not here yet (a Hub range request).
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.errors import ModelFileError

MAGIC = b"GGUF"

# GGUF metadata value types -> their struct (scalars only).
_SCALARS: dict[int, struct.Struct] = {t: struct.Struct(f) for t, f in {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
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
#: How deep arrays of arrays may nest in GGUF metadata. Files that llama.cpp's tools
#: write nest at most two (none of its keys is deeper); a deeper one is a damaged or
#: crafted file, refused before the reader's recursion reaches Python's limit.
MAX_ARRAY_DEPTH = 16


class ModelKeys:
    """The model's facts among a GGUF file's metadata (``metadata``), most of them
    under its architecture's prefix (``llama.block_count``)."""

    metadata: Mapping[str, Any]

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


class GGUFMetadata(ModelKeys):
    """:class:`ModelKeys` over metadata alone (:func:`metadata_from_bytes`)."""

    def __init__(self, metadata: Mapping[str, Any]) -> None:
        self.metadata = metadata


@dataclass(frozen=True)
class GGUFInfo(ModelKeys):
    """A GGUF file's header. :func:`read_gguf` hands the same one to every caller while
    the file is unchanged: treat it, its dicts included, as read-only."""

    path: str
    version: int
    n_tensors: int
    metadata: dict[str, Any]
    file_size: int
    expected_size: int | None
    tensor_bytes: int
    chat_template: str | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    #: elements in all tensors (the parameter count)
    parameters: int = 0
    #: ggml tensor type -> bytes of tensors of that type, in tensor-table order
    bytes_by_type: dict[int, int] = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        """Is the file shorter than its tensor table says?"""
        return self.expected_size is not None and self.file_size < self.expected_size

    @property
    def group_size(self) -> int | None:
        """Elements per block of the quantized type that holds the most bytes (the
        quant's group size); None when no tensor is block-quantized."""
        quantized = {t: b for t, b in self.bytes_by_type.items() if GGML_TYPES[t][1] > 1}
        if not quantized:
            return None
        return GGML_TYPES[max(quantized, key=lambda t: quantized[t])][1]


class _Reader:
    """Reads GGUF values from ``buf``. Past its end: struct.error for a whole file (it is
    damaged), EOFError for the ``partial`` head of one (read more and try again)."""

    __slots__ = ("buf", "partial", "pos")

    def __init__(self, buf: Any, pos: int = 0, *, partial: bool = False) -> None:
        self.buf = buf
        self.pos = pos
        self.partial = partial

    def _need(self, end: int, what: str) -> None:
        if end > len(self.buf):
            if self.partial:
                raise EOFError("GGUF metadata continues past the bytes read")
            raise struct.error(f"{what} past end of file")

    def scalar(self, fmt: struct.Struct) -> Any:
        end = self.pos + fmt.size
        self._need(end, "value")
        v = fmt.unpack_from(self.buf, self.pos)[0]
        self.pos = end
        return v

    def string(self) -> str:
        n = self.scalar(_U64)
        end = self.pos + n
        self._need(end, "string")
        s = bytes(self.buf[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return s

    def skip_string(self) -> None:
        n = self.scalar(_U64)
        self._need(self.pos + n, "string")
        self.pos += n

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise ValueError(f"metadata arrays nested more than {MAX_ARRAY_DEPTH} deep")
            etype = self.scalar(_U32)
            count = self.scalar(_U64)
            if count > len(self.buf) - self.pos:  # every item takes a byte at least
                if self.partial:
                    raise EOFError("GGUF metadata continues past the bytes read")
                raise ValueError(f"array of {count} items cannot fit in the file")
            if count > _MAX_KEPT_ARRAY:
                self._skip_array(etype, count, depth + 1)
                return _SkippedArray(count)
            return [self.value(etype, depth + 1) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    def _skip_array(self, etype: int, count: int, depth: int) -> None:
        if etype in _SCALARS:
            end = self.pos + _SCALARS[etype].size * count
            self._need(end, "array")
            self.pos = end
        elif etype == _STRING:
            # A vocabulary is 30k to 250k strings: the loop is kept tight.
            buf, pos, size, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
            for _ in range(count):
                if pos + 8 > size:
                    self._need(pos + 8, "string")
                pos += 8 + unpack(buf, pos)[0]
            self._need(pos, "string")
            self.pos = pos
        else:
            for _ in range(count):
                self.value(etype, depth)


@dataclass(frozen=True)
class _SkippedArray:
    length: int


def is_gguf(path: str | os.PathLike[str]) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


class _VersionError(ValueError):
    def __init__(self, version: int) -> None:
        super().__init__(f"unsupported GGUF version {version} (expected 2 or 3)")


def metadata_from_bytes(buf: bytes) -> dict[str, Any]:
    """Key/value metadata from the first bytes of a GGUF file (arrays of more than 64
    items are left out: token lists, merges).

    Raises ValueError if ``buf`` is not a GGUF header, and EOFError if it ends before
    the metadata does (read more bytes and try again).
    """
    if buf[:4] != MAGIC:
        raise ValueError("not a GGUF file")
    _, _, meta = _metadata(_Reader(buf, 4, partial=True), limit=None)
    return meta


def read_gguf(path: str | os.PathLike[str], *, check_size: bool = True) -> GGUFInfo:
    """Read a GGUF file's header; raise ModelFileError if it is not a sound GGUF
    (``check_size``: nor shorter than its tensor table says)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise ModelFileError(str(p), e.strerror or str(e)) from e
    # One load reads the header in several steps (detect, the integrity check, the
    # catalog's identification, the engine): the parse is kept per version of the file.
    info = _read_version(p, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if check_size and info.truncated:
        raise ModelFileError(
            str(p),
            f"file is truncated: {info.file_size:,} bytes on disk, the tensor table needs "
            f"{info.expected_size:,}",
        )
    return info


@functools.lru_cache(maxsize=16)
def _read_version(p: Path, dev: int, ino: int, size: int, mtime_ns: int,
                  ctime_ns: int) -> GGUFInfo:
    """The header of ``p`` as it is while its inode, size and times are these (the
    arguments after ``p`` are the cache key: a rewritten file is read again)."""
    try:
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
                return _parse(p, mm, size)
            except _VersionError as e:
                raise ModelFileError(str(p), str(e)) from e
            except (struct.error, ValueError, UnicodeDecodeError) as e:
                raise ModelFileError(
                    str(p), f"GGUF header is damaged or truncated ({size:,} bytes on disk): {e}"
                ) from e


def _metadata(r: _Reader, limit: int | None) -> tuple[int, int, dict[str, Any]]:
    """(version, tensor count, metadata) from the header at ``r.pos`` (after the magic);
    ``limit``: no count may exceed it (the file's size)."""
    version = r.scalar(_U32)
    if version not in (2, 3):
        raise _VersionError(version)
    n_tensors = r.scalar(_U64)
    n_kv = r.scalar(_U64)
    if limit is not None and (n_kv > limit or n_tensors > limit):
        raise ValueError(f"header claims {n_kv} keys and {n_tensors} tensors")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        vtype = r.scalar(_U32)
        meta[key] = r.value(vtype)
    return version, n_tensors, {k: v for k, v in meta.items() if not isinstance(v, _SkippedArray)}


def _parse(p: Path, mm: mmap.mmap, size: int) -> GGUFInfo:
    r = _Reader(mm, 4)
    version, n_tensors, meta = _metadata(r, limit=size)
    tensor_end = 0
    tensor_bytes = 0
    parameters = 0
    bytes_by_type: dict[int, int] = {}
    sizes_known = True
    for _ in range(n_tensors):
        r.skip_string()
        n_dims = r.scalar(_U32)
        if n_dims > 8:
            raise ValueError(f"tensor with {n_dims} dimensions")
        n_el = 1
        for _ in range(n_dims):
            n_el *= r.scalar(_U64)
        ttype = r.scalar(_U32)
        offset = r.scalar(_U64)
        parameters += n_el
        traits = GGML_TYPES.get(ttype)
        if traits is None:
            sizes_known = False
            continue
        _, block, type_size = traits
        nbytes = n_el // block * type_size
        tensor_bytes += nbytes
        bytes_by_type[ttype] = bytes_by_type.get(ttype, 0) + nbytes
        tensor_end = max(tensor_end, offset + nbytes)
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0:
        align = 32
    data_start = (r.pos + align - 1) // align * align
    expected = data_start + tensor_end if sizes_known and n_tensors else None
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
        parameters=parameters,
        bytes_by_type=bytes_by_type,
    )
