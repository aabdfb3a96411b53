"""The GGUF reader on the real embedded model and on damaged copies of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from localrun.errors import ModelFileError
from localrun.formats.gguf import read_gguf


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
