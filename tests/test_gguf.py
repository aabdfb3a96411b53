"""The GGUF reader on the real embedded model and on damaged copies of it."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from localrun.errors import ModelFileError
from localrun.formats.gguf import metadata_from_bytes, read_gguf
from tests.hubserver import gguf_bytes


def test_reads_real_model(default_gguf: Path) -> None:
    info = read_gguf(default_gguf)
    assert info.architecture == "llama"
    assert info.quantization == "Q4_1"
    assert info.context_length == 8192
    assert (info.n_layers, info.n_kv_heads, info.head_dim) == (30, 3, 64)
    assert info.expected_size == info.file_size == default_gguf.stat().st_size
    assert info.chat_template and "<|im_start|>" in info.chat_template


def _copy_prefix(src: Path, dst: Path, n: int) -> Path:
    with open(src, "rb") as f:
        dst.write_bytes(f.read(n))
    return dst


def test_truncated_file_reports_both_sizes(default_gguf: Path, tmp_path: Path) -> None:
    size = default_gguf.stat().st_size
    bad = _copy_prefix(default_gguf, tmp_path / "cut.gguf", size // 2)
    with pytest.raises(ModelFileError) as info:
        read_gguf(bad)
    msg = str(info.value)
    assert "truncated" in msg and f"{size // 2:,}" in msg and f"{size:,}" in msg


def test_header_cut_short(default_gguf: Path, tmp_path: Path) -> None:
    bad = _copy_prefix(default_gguf, tmp_path / "head.gguf", 4096)
    with pytest.raises(ModelFileError, match="damaged or truncated"):
        read_gguf(bad)


@pytest.mark.parametrize(
    "content",
    [b"", b"GGUF", b"not a model at all, just text" * 10, b"GGUF\x03\x00\x00\x00" + b"\xff" * 64],
)
def test_garbage_is_a_typed_error(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(content)
    with pytest.raises(ModelFileError):
        read_gguf(bad)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="No such file"):
        read_gguf(tmp_path / "nope.gguf")


# -- one reader for every caller (issue 12) ---------------------------------------------


def test_tensor_table_facts(default_gguf: Path) -> None:
    """The parameter count and the quant's group size come from the same parse."""
    info = read_gguf(default_gguf)
    assert info.parameters == 134_515_008  # SmolLM2-135M, as its config.json counts it
    assert info.group_size == 32  # Q4_1 blocks
    assert sum(info.bytes_by_type.values()) == info.tensor_bytes


def test_metadata_from_the_head_of_a_file(default_gguf: Path) -> None:
    """A file's first bytes (a Hub range request): EOFError until the metadata is all
    there (a 49,152-token vocabulary included), then what read_gguf reads."""
    with default_gguf.open("rb") as f:
        head = f.read(4 << 20)
    whole = read_gguf(default_gguf).metadata
    assert metadata_from_bytes(head) == whole
    assert "tokenizer.ggml.tokens" not in whole  # long arrays are left out
    for cut in (4, 12, 24, 100, 5_000, 200_000, 600_000):
        with pytest.raises(EOFError):
            metadata_from_bytes(head[:cut])
    with pytest.raises(ValueError, match="not a GGUF"):
        metadata_from_bytes(b"PK\x03\x04" + head[4:100])
    with pytest.raises(ValueError, match="unsupported GGUF version 7"):
        metadata_from_bytes(b"GGUF\x07\x00\x00\x00" + head[8:100])


def test_one_load_parses_the_header_once(default_gguf: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """detect, its integrity check, the catalog's identification and the engine all read
    the header: one parse serves them while the file is unchanged."""
    from localrun.formats import gguf
    from localrun.formats.detect import detect
    from localrun.naming import identity

    parses: list[str] = []
    real = gguf._parse

    def counting(*args: Any) -> gguf.GGUFInfo:
        parses.append(str(args[0]))
        return real(*args)

    monkeypatch.setattr(gguf, "_parse", counting)
    gguf._read_version.cache_clear()
    found = detect(default_gguf)  # the format, then the integrity check
    identity.names(found)
    read_gguf(found.path)  # what llama_cpp.py does at load
    assert parses == [str(default_gguf)]


def test_a_file_changed_in_place_is_read_again(default_gguf: Path, tmp_path: Path) -> None:
    """The memo is per version of the file: cut short in place, it is refused; rewritten
    with other metadata, the new metadata is read."""
    import os

    info = read_gguf(default_gguf)
    model = tmp_path / "sparse.gguf"
    with default_gguf.open("rb") as src, model.open("wb") as dst:
        dst.write(src.read(4 << 20))  # the header and the tensor table (about 1.5 MB)
        dst.truncate(info.file_size)  # the weights: a hole of the right size
    assert read_gguf(model).parameters == info.parameters
    with model.open("r+b") as f:
        f.truncate(info.file_size - 1)
    with pytest.raises(ModelFileError, match="truncated"):
        read_gguf(model)

    small = tmp_path / "small.gguf"
    small.write_bytes(gguf_bytes(layers=24))
    assert read_gguf(small).n_layers == 24
    before = small.stat().st_mtime_ns
    small.write_bytes(gguf_bytes(layers=25))  # same size, same inode
    os.utime(small, ns=(before + 10**6, before + 10**6))  # a write a moment later
    assert read_gguf(small).n_layers == 25


# -- arrays of arrays nested past any real file (issue 24, item 7) -----------------------


def deep_array_gguf(depth: int) -> bytes:
    """A GGUF v3 header, no tensors, two keys: the architecture, and an array of an array
    of ... ``depth`` deep around one uint32 (7)."""
    def text(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    arch = text(b"general.architecture") + struct.pack("<I", 8) + text(b"llama")
    deep = text(b"test.deep") + struct.pack("<I", 9) \
        + struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQI", 4, 1, 7)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + arch + deep + b"\0" * 32


def test_gguf_arrays_nested_too_deep_are_a_damaged_file(tmp_path: Path) -> None:
    from localrun.formats.gguf import MAX_ARRAY_DEPTH

    ok = tmp_path / "ok.gguf"
    ok.write_bytes(deep_array_gguf(MAX_ARRAY_DEPTH))
    value: Any = read_gguf(ok, check_size=False).metadata["test.deep"]
    for _ in range(MAX_ARRAY_DEPTH):
        value = value[0]
    assert value == 7
    bad = tmp_path / "deep.gguf"
    bad.write_bytes(deep_array_gguf(5000))
    with pytest.raises(ModelFileError, match=f"nested more than {MAX_ARRAY_DEPTH} deep"):
        read_gguf(bad)
    with pytest.raises(ValueError, match="nested"):
        metadata_from_bytes(bad.read_bytes())
