"""Model files checked against their own metadata before any engine opens them.

Each format says how long its weight files must be: a GGUF's tensor table, a
safetensors header, an OpenVINO IR's Const layers (offset + size into the ``.bin``), an
ONNX model's external-data entries (location, offset, length). A file shorter than
that is a truncated download; it is refused here with both numbers, so the engine
never opens it (their own errors name neither the file nor the sizes, and some damage
they notice only when a generation reads the missing weights).

No engine and no ``onnx`` package: the XML is read with ElementTree and the ONNX
protobuf with the small reader below, which walks only the fields that can point
into external data and skips everything else (embedded weights are never copied).
"""

from __future__ import annotations

import mmap
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from localrun.errors import ModelFileError
from localrun.formats.gguf import read_gguf
from localrun.formats.safetensors import read_safetensors_header

_GGUF_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)


def check_model_files(path: str | os.PathLike[str], fmt: str) -> None:
    """Raise ModelFileError if a weight file of the model at ``path`` (as detected, in
    format ``fmt``) is shorter than the model's own metadata says it must be."""
    p = Path(path)
    if fmt == "gguf":
        for shard in _gguf_shards(p):
            read_gguf(shard)  # checks the file against its tensor table
    elif fmt == "openvino":
        check_openvino_ir(p)
    elif fmt == "onnx":
        check_onnx_genai(p)
    elif p.is_dir():  # MLX, EXL2/EXL3, GPTQ, AWQ, plain HF: safetensors headers
        for f in sorted(p.glob("*.safetensors")):
            read_safetensors_header(f)


def _gguf_shards(first: Path) -> list[Path]:
    m = _GGUF_SHARD.search(first.name)
    if not m:
        return [first]
    stem, total = first.name[: m.start()], int(m.group(2))
    return [first.with_name(f"{stem}-{i:05d}-of-{total:05d}.gguf") for i in range(1, total + 1)]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise ModelFileError(str(path), e.strerror or str(e)) from e


def _truncated(path: Path, actual: int, expected: int, by: str) -> ModelFileError:
    return ModelFileError(
        str(path), f"file is truncated: {actual:,} bytes on disk, {by} needs {expected:,}")


# --- OpenVINO IR ---------------------------------------------------------------------------

def openvino_bin_extent(xml: Path) -> int:
    """The bytes of the ``.bin`` beside ``xml`` that its Const layers read:
    max(offset + size) over them (0 when the IR holds no weights)."""
    end = 0
    try:
        for _, el in ET.iterparse(xml):
            if el.tag != "layer":
                continue
            data = el.find("data") if el.get("type") == "Const" else None
            if data is not None and data.get("offset") is not None:
                end = max(end, int(data.get("offset") or 0) + int(data.get("size") or 0))
            el.clear()  # keep memory flat on large IRs
    except ET.ParseError as e:
        raise ModelFileError(str(xml), f"OpenVINO IR is damaged or truncated ({e})") from e
    except ValueError as e:
        raise ModelFileError(str(xml), f"OpenVINO IR has a bad Const offset or size ({e})") \
            from e
    except OSError as e:
        raise ModelFileError(str(xml), e.strerror or str(e)) from e
    return end


def check_openvino_ir(folder: Path) -> None:
    """Every ``*.xml`` IR in ``folder`` (model, tokenizer, detokenizer, ...) against its
    ``.bin``: the weights its Const layers read must be in the file."""
    for xml in sorted(folder.glob("*.xml")):
        extent = openvino_bin_extent(xml)
        if extent == 0:
            continue
        binary = xml.with_suffix(".bin")
        if not binary.is_file():
            raise ModelFileError(str(folder), f"{xml.name} reads {extent:,} bytes of "
                                 f"weights from {binary.name}, which is missing")
        actual = _size(binary)
        if actual < extent:
            raise _truncated(binary, actual, extent, xml.name)


# --- ONNX (external data) ------------------------------------------------------------------

#: ONNX TensorProto.DataType -> bits per element (only used when an entry has no length).
_ONNX_BITS: dict[int, int] = {
    1: 32, 2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 9: 8, 10: 16, 11: 64, 12: 32, 13: 64,
    14: 64, 15: 128, 16: 16, 17: 8, 18: 8, 19: 8, 20: 8, 21: 4, 22: 4, 23: 4,
}
_MAX_GRAPH_DEPTH = 64  # subgraphs (If/Loop/Scan bodies) nest; a deeper file is corrupt


@dataclass(frozen=True)
class ExternalData:
    """One tensor's bytes in another file: ``location`` relative to the model's folder."""

    location: str
    offset: int
    length: int | None  # None: the entry gave no length and the dtype's size is unknown


class _Damaged(Exception):
    pass


class _Proto:
    """Protocol-buffer wire format over a buffer: only what walking messages needs."""

    __slots__ = ("buf",)

    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf = buf

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            if pos >= end or shift > 63:
                raise _Damaged("varint runs past its message")
            b = self.buf[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value, pos
            shift += 7

    def fields(self, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
        """(field number, wire type, value or payload start, payload end) per field."""
        pos = start
        while pos < end:
            key, pos = self.varint(pos, end)
            num, wire = key >> 3, key & 7
            if wire == 0:
                v, pos = self.varint(pos, end)
                yield num, wire, v, pos
                continue
            if wire == 2:
                n, pos = self.varint(pos, end)
            elif wire in (1, 5):
                n = 8 if wire == 1 else 4
            else:
                raise _Damaged(f"unknown wire type {wire}")
            if pos + n > end:
                raise _Damaged("a field runs past the end of its message")
            yield num, wire, pos, pos + n
            pos += n

    def text(self, start: int, end: int) -> str:
        return bytes(self.buf[start:end]).decode("utf-8", errors="replace")


def onnx_external_data(model: Path) -> list[ExternalData]:
    """The external-data entries of every tensor in an ONNX model: initializers,
    sparse initializers, and tensors held by node attributes, subgraphs included."""
    size = _size(model)
    if size == 0:
        raise ModelFileError(str(model), "file is empty (0 bytes)")
    try:
        with open(model, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pb = _Proto(mm)
            out: list[ExternalData] = []
            for num, wire, a, b in pb.fields(0, size):
                if num == 7 and wire == 2:  # ModelProto.graph
                    _graph(pb, a, b, out, 0)
            return out
    except _Damaged as e:
        raise ModelFileError(str(model), f"ONNX model is damaged or truncated ({size:,} bytes "
                             f"on disk): {e}") from None
    except (OSError, ValueError) as e:
        raise ModelFileError(str(model), f"unreadable ({e})") from e


def _graph(pb: _Proto, start: int, end: int, out: list[ExternalData], depth: int) -> None:
    if depth > _MAX_GRAPH_DEPTH:
        raise _Damaged("subgraphs nest too deep")
    for num, wire, a, b in pb.fields(start, end):
        if wire != 2:
            continue
        if num == 5:  # GraphProto.initializer
            _tensor(pb, a, b, out)
        elif num == 15:  # GraphProto.sparse_initializer
            _sparse(pb, a, b, out)
        elif num == 1:  # GraphProto.node
            for n, w, x, y in pb.fields(a, b):
                if n == 5 and w == 2:  # NodeProto.attribute
                    _attribute(pb, x, y, out, depth)


def _attribute(pb: _Proto, start: int, end: int, out: list[ExternalData], depth: int) -> None:
    for num, wire, a, b in pb.fields(start, end):
        if wire != 2:
            continue
        if num in (5, 10):  # AttributeProto.t, .tensors
            _tensor(pb, a, b, out)
        elif num in (6, 11):  # AttributeProto.g, .graphs
            _graph(pb, a, b, out, depth + 1)
        elif num in (22, 23):  # AttributeProto.sparse_tensor, .sparse_tensors
            _sparse(pb, a, b, out)


def _sparse(pb: _Proto, start: int, end: int, out: list[ExternalData]) -> None:
    for num, wire, a, b in pb.fields(start, end):
        if num in (1, 2) and wire == 2:  # SparseTensorProto.values, .indices
            _tensor(pb, a, b, out)


def _tensor(pb: _Proto, start: int, end: int, out: list[ExternalData]) -> None:
    dims: list[int] = []
    dtype = 0
    external = False
    entries: dict[str, str] = {}
    for num, wire, a, b in pb.fields(start, end):
        if num == 1 and wire == 0:  # TensorProto.dims
            dims.append(a)
        elif num == 1 and wire == 2:  # dims, packed
            pos = a
            while pos < b:
                v, pos = pb.varint(pos, b)
                dims.append(v)
        elif num == 2 and wire == 0:  # TensorProto.data_type
            dtype = a
        elif num == 14 and wire == 0:  # TensorProto.data_location (1 = EXTERNAL)
            external = a == 1
        elif num == 13 and wire == 2:  # TensorProto.external_data: key = 1, value = 2
            key = value = ""
            for n, w, x, y in pb.fields(a, b):
                if w == 2 and n == 1:
                    key = pb.text(x, y)
                elif w == 2 and n == 2:
                    value = pb.text(x, y)
            entries[key] = value
    if not external and not entries:
        return
    location = entries.get("location")
    if not location:
        raise _Damaged("a tensor stored externally names no location")
    try:
        offset = int(entries.get("offset") or 0)
        length = int(entries["length"]) if entries.get("length") else None
    except ValueError as e:
        raise _Damaged(f"bad external-data offset or length ({e})") from None
    if length is None and dtype in _ONNX_BITS:
        n = 1
        for d in dims:
            n *= d
        length = (n * _ONNX_BITS[dtype] + 7) // 8
    out.append(ExternalData(location, offset, length))


def check_onnx_model(model: Path) -> None:
    """An ONNX model's external-data files hold every byte its tensors point at."""
    need: dict[str, int] = {}
    for e in onnx_external_data(model):
        need[e.location] = max(need.get(e.location, 0), e.offset + (e.length or 0))
    for location, extent in sorted(need.items()):
        data = model.parent / location
        if not data.is_file():
            raise ModelFileError(str(model.parent), f"{model.name} keeps weights in "
                                 f"{location}, which is missing")
        actual = _size(data)
        if actual < extent:
            raise _truncated(data, actual, extent, model.name)


def check_onnx_genai(folder: Path) -> None:
    """Every ONNX file genai_config.json names (decoder, and the vision / embedding /
    speech parts of multimodal models) against its external data."""
    import json

    try:
        cfg = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(str(folder / "genai_config.json"), f"unreadable JSON ({e})") from e
    model = cfg.get("model") if isinstance(cfg, dict) else None
    names: list[str] = []
    for part in model.values() if isinstance(model, dict) else ():
        filename = part.get("filename") if isinstance(part, dict) else None
        if isinstance(filename, str) and filename not in names:
            names.append(filename)
    for name in names:
        path = folder / name
        if not path.is_file():
            raise ModelFileError(str(folder), f"genai_config.json names {name}, which is "
                                 "missing")
        check_onnx_model(path)
