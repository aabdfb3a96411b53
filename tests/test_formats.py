"""Format detection on real files and folders (made here), damaged inputs, and refusals."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from localrun.backends import BACKENDS, compat
from localrun.errors import FormatMismatchError, ModelFileError
from localrun.formats.detect import detect
from localrun.formats.safetensors import write_safetensors_header

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}


def folder(tmp: Path, name: str, config: dict[str, object] | None, tensors: dict[str, object],
           metadata: dict[str, str] | None = None) -> Path:
    d = tmp / name
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    if tensors:
        write_safetensors_header(d / "model.safetensors", tensors, metadata)
    return d


W = {"model.layers.0.self_attn.q_proj.weight": ("BF16", (8, 8)),
     "model.embed_tokens.weight": ("BF16", (16, 8))}


def test_gguf_file_and_folder(default_gguf: Path, tmp_path: Path) -> None:
    m = detect(default_gguf)
    assert (m.format, m.quantization, m.architecture, m.context_length) == (
        "gguf", "Q4_1", "llama", 8192)
    d = tmp_path / "g"
    d.mkdir()
    shutil.copy(default_gguf, d / "model.gguf")
    (d / "mmproj-model-f16.gguf").write_bytes(b"GGUF")  # not the model: ignored
    assert detect(d).path == str(d / "model.gguf")


def test_truncated_gguf_is_a_model_file_error(default_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_gguf.read_bytes()[: default_gguf.stat().st_size // 3])
    with pytest.raises(ModelFileError, match="truncated"):
        detect(cut)


def test_gguf_shards_missing(tmp_path: Path, default_gguf: Path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    shutil.copy(default_gguf, d / "m-00001-of-00002.gguf")
    with pytest.raises(ModelFileError, match=re.escape("m-00002-of-00002.gguf")):
        detect(d)


@pytest.mark.parametrize(("qc", "fmt", "quant"), [
    ({"quant_method": "exl2", "bits": 4.0}, "exl2", "4.0bpw"),
    ({"quant_method": "exl3", "bits": 3.5}, "exl3", "3.50bpw"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq", "4bit"),
    ({"quant_method": "awq", "bits": 4}, "awq", "4bit"),
    ({"quant_method": "fp8"}, "fp8", "fp8"),
    ({"quant_method": "compressed-tensors"}, "compressed-tensors", None),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes", "4bit"),
])
def test_quantization_config(tmp_path: Path, qc: dict[str, object], fmt: str,
                             quant: str | None) -> None:
    d = folder(tmp_path, fmt, {**CONFIG, "quantization_config": qc}, W)
    m = detect(d)
    assert (m.format, m.quantization, m.architecture) == (fmt, quant, "LlamaForCausalLM")


@pytest.mark.parametrize(("suffixes", "fmt"), [
    ((".q_weight", ".q_invperm", ".q_scale"), "exl2"),
    ((".trellis", ".suh", ".svh"), "exl3"),
    ((".qweight", ".qzeros", ".scales", ".g_idx"), "gptq"),
])
def test_format_from_tensor_names_when_config_says_nothing(tmp_path: Path,
                                                           suffixes: tuple[str, ...],
                                                           fmt: str) -> None:
    tensors = {f"model.layers.0.mlp.down_proj{s}": ("I32", (4, 4)) for s in suffixes}
    assert detect(folder(tmp_path, fmt, CONFIG, tensors)).format == fmt


def test_mlx_by_config_and_by_metadata(tmp_path: Path) -> None:
    q = folder(tmp_path, "q", {**CONFIG, "quantization": {"group_size": 64, "bits": 4}}, W)
    m = detect(q)
    assert (m.format, m.quantization, m.details["group_size"]) == ("mlx", "4bit", 64)
    meta = folder(tmp_path, "meta", CONFIG, W, {"format": "mlx"})
    assert detect(meta).format == "mlx"


def test_plain_bf16_safetensors(tmp_path: Path) -> None:
    m = detect(folder(tmp_path, "hf", CONFIG, W))
    assert (m.format, m.quantization, m.context_length) == ("hf", "bf16", 8192)


def test_safetensors_damage(tmp_path: Path) -> None:
    d = folder(tmp_path, "bad", CONFIG, W)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-10])
    with pytest.raises(ModelFileError, match="truncated"):
        detect(d)
    f.write_bytes(data[:20])
    with pytest.raises(ModelFileError, match="damaged or truncated"):
        detect(d)
    f.write_bytes((12).to_bytes(8, "little") + b"{not json!!}")
    with pytest.raises(ModelFileError, match="not valid JSON"):
        detect(d)


def test_bad_config_json(tmp_path: Path) -> None:
    d = folder(tmp_path, "c", None, W)
    (d / "config.json").write_text("{oops")
    with pytest.raises(ModelFileError, match="unreadable JSON"):
        detect(d)


def test_missing_shard_named(tmp_path: Path) -> None:
    d = folder(tmp_path, "sh", CONFIG, {})
    write_safetensors_header(d / "model-00001-of-00002.safetensors", W)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelFileError, match=re.escape("model-00002-of-00002.safetensors")):
        detect(d)


def test_openvino_ir_and_missing_tokenizer(tmp_path: Path) -> None:
    d = tmp_path / "ov"
    d.mkdir()
    for n in ("openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml"):
        (d / n).write_text("<net/>")
    (d / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ModelFileError, match=re.escape("openvino_detokenizer.xml")) as info:
        detect(d)
    assert "convert_tokenizer" in (info.value.hint or "")
    (d / "openvino_detokenizer.xml").write_text("<net/>")
    (d / "openvino_config.json").write_text(json.dumps({"quantization_config": {"bits": 4}}))
    m = detect(d)
    assert (m.format, m.quantization, m.architecture) == ("openvino", "int4", "LlamaForCausalLM")


def test_onnx_genai_and_transformers_js(tmp_path: Path) -> None:
    d = tmp_path / "cpu-int4-rtn-block-32"
    d.mkdir()
    cfg = {"model": {"type": "phi3", "context_length": 4096, "decoder": {
        "filename": "model.onnx", "session_options": {"provider_options": [{"cuda": {}}]}}}}
    (d / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=re.escape("model.onnx")):
        detect(d)
    (d / "model.onnx").write_bytes(b"\x08\x07")
    m = detect(d)
    assert (m.format, m.architecture, m.context_length, m.quantization) == (
        "onnx", "phi3", 4096, "int4")
    assert m.details["providers"] == ["cuda"]
    js = tmp_path / "js"
    (js / "onnx").mkdir(parents=True)
    (js / "config.json").write_text(json.dumps(CONFIG))
    (js / "onnx" / "model_q4.onnx").write_bytes(b"\x08")
    with pytest.raises(ModelFileError, match="not an ONNX Runtime GenAI model"):
        detect(js)


def test_missing_and_empty(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such file"):
        detect(tmp_path / "nope")
    with pytest.raises(ModelFileError, match="no model files found"):
        detect(tmp_path)


# -- refusals ---------------------------------------------------------------------------

PAIRS = [(f, b) for f in compat.COMPAT for b in BACKENDS
         if compat.support(f, b) != "native"]


@pytest.mark.parametrize(("fmt", "backend"), PAIRS)
def test_every_refusal_names_format_engine_natives_and_fix(fmt: str, backend: str) -> None:
    with pytest.raises(FormatMismatchError) as info:
        compat.check(fmt, backend, model="./the-model")
    e = info.value
    msg, hint = str(e), e.hint or ""
    assert compat.title(fmt) in msg and backend in msg
    natives = compat.native_backends(fmt)
    assert e.native_backends == natives
    for n in natives:
        assert n in msg
        assert f"localrun run ./the-model --backend {n}" in hint
    assert f"--backend {backend}" in hint  # how to get this engine's own variant
    if compat.support(fmt, backend) == "loads":
        assert "--allow-unoptimized" in hint


def test_loads_pairing_needs_opt_in() -> None:
    assert compat.check("gguf", "openvino", model="m", allow_unoptimized=True,
                        architecture="qwen2", quantization="Q4_0") == "loads"
    with pytest.raises(FormatMismatchError, match="gemma3"):
        compat.check("gguf", "openvino", model="m", allow_unoptimized=True,
                     architecture="gemma3", quantization="Q4_0")


def test_resolve_refuses_before_any_engine_import(default_gguf: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys\nfrom localrun.resolve import resolve_local\n"
        "from localrun.errors import FormatMismatchError\n"
        f"try:\n    resolve_local({str(default_gguf)!r}, backend='mlx')\n"
        "except FormatMismatchError as e:\n    print('REFUSED', e.hint)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'llama_cpp', 'mlx', 'mlx_lm', 'openvino_genai'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert "REFUSED" in out and "--backend llama.cpp" in out
    assert out.strip().endswith("[]")


def test_resolve_warns_on_loads_pairing(default_gguf: Path, tmp_path: Path) -> None:
    from localrun.errors import UnoptimizedFormatWarning
    from localrun.resolve import resolve_local

    with pytest.warns(UnoptimizedFormatWarning, match="openvino runs GGUF"):
        t = resolve_local(str(default_gguf), backend="openvino", allow_unoptimized=True)
    assert t.support == "loads"


# -- sizes from the model's own metadata (formats/integrity.py) --------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _pb(num: int, payload: bytes | int) -> bytes:
    """One protobuf field: an int is a varint (wire type 0), bytes are length-delimited."""
    if isinstance(payload, int):
        return _varint(num << 3) + _varint(payload)
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _tensor(name: str, dims: tuple[int, ...], dtype: int, location: str | None = None,
            offset: int = 0, length: int | None = None, packed: bool = False) -> bytes:
    """An ONNX TensorProto, its data in ``location`` (external) or inline (raw_data)."""
    t = _pb(1, b"".join(_varint(d) for d in dims)) if packed else \
        b"".join(_pb(1, d) for d in dims)
    t += _pb(2, dtype) + _pb(8, name.encode())
    if location is None:
        return t + _pb(9, b"\0" * 64)
    entries = [("location", location), ("offset", str(offset))]
    if length is not None:
        entries.append(("length", str(length)))
    for k, v in entries:
        t += _pb(13, _pb(1, k.encode()) + _pb(2, v.encode()))
    return t + _pb(14, 1)


def _onnx_model(data: str = "model.onnx.data") -> bytes:
    """A ModelProto whose external tensors sit in every place ONNX allows them."""
    body = _pb(5, _tensor("in_if", (4,), 1, data, 4096, 16))  # subgraph initializer
    graph = (_pb(5, _tensor("w", (32, 16), 1, data, 0, 2048))  # float32, 2048 B
             + _pb(5, _tensor("inline", (16,), 1))  # embedded: not a file to check
             + _pb(5, _tensor("q", (100,), 22, data, 2048, packed=True))  # int4, no length
             + _pb(15, _pb(1, _tensor("sv", (8,), 10, data, 2100, 16)))  # sparse values
             + _pb(1, _pb(4, b"Constant") + _pb(5, _pb(1, b"value")
                                                  + _pb(5, _tensor("c", (2,), 7, data, 2200))))
             + _pb(1, _pb(4, b"If") + _pb(5, _pb(1, b"then_branch") + _pb(6, body))))
    return _pb(1, 8) + _pb(7, graph)


def _onnx_folder(tmp: Path, data_bytes: int) -> Path:
    d = tmp / "cpu-int4"
    d.mkdir()
    (d / "genai_config.json").write_text(json.dumps(
        {"model": {"type": "llama", "decoder": {"filename": "model.onnx"}}}))
    (d / "model.onnx").write_bytes(_onnx_model())
    (d / "model.onnx.data").write_bytes(b"\0" * data_bytes)
    return d


def test_onnx_external_data_found_everywhere(tmp_path: Path) -> None:
    from localrun.formats.integrity import ExternalData, onnx_external_data

    d = _onnx_folder(tmp_path, 4112)
    got = onnx_external_data(d / "model.onnx")
    assert sorted(got, key=lambda e: e.offset) == [
        ExternalData("model.onnx.data", 0, 2048),
        ExternalData("model.onnx.data", 2048, 50),  # 100 int4 values, length from dims
        ExternalData("model.onnx.data", 2100, 16),
        ExternalData("model.onnx.data", 2200, 16),  # 2 int64, length from dims
        ExternalData("model.onnx.data", 4096, 16),  # inside the If node's subgraph
    ]
    assert detect(d).format == "onnx"  # 4112 bytes: exactly what the entries need


def test_onnx_truncated_external_data_named_with_sizes(tmp_path: Path) -> None:
    d = _onnx_folder(tmp_path, 4111)  # one byte short of the subgraph's tensor
    with pytest.raises(ModelFileError) as info:
        detect(d)
    msg = str(info.value)
    assert "model.onnx.data" in msg and "4,111 bytes on disk" in msg and "needs 4,112" in msg
    assert info.value.__cause__ is None
    (d / "model.onnx.data").unlink()
    with pytest.raises(ModelFileError, match=re.escape("model.onnx.data, which is missing")):
        detect(d)


def test_onnx_protobuf_cut_short_is_damaged(tmp_path: Path) -> None:
    d = _onnx_folder(tmp_path, 4112)
    raw = _onnx_model()
    (d / "model.onnx").write_bytes(raw[: len(raw) - 7])
    with pytest.raises(ModelFileError, match="ONNX model is damaged or truncated"):
        detect(d)
    (d / "model.onnx").write_bytes(b"")
    with pytest.raises(ModelFileError, match="empty"):
        detect(d)


OV_IR = """<?xml version="1.0"?>
<net name="m" version="11"><layers>
  <layer id="0" name="a" type="Const" version="opset1">
    <data element_type="u4" shape="64" offset="0" size="32"/></layer>
  <layer id="1" name="loop" type="TensorIterator" version="opset1"><body><layers>
    <layer id="2" name="b" type="Const" version="opset1">
      <data element_type="f32" shape="10" offset="32" size="40"/></layer>
  </layers></body></layer>
  <layer id="3" name="p" type="Parameter" version="opset1">
    <data shape="?" element_type="i64" offset="9999" size="9999"/></layer>
</layers></net>
"""


def _ov_folder(tmp: Path, model_bin: int) -> Path:
    d = tmp / "ov-int4"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    for n in ("openvino_model", "openvino_tokenizer", "openvino_detokenizer"):
        (d / f"{n}.xml").write_text(OV_IR)
        (d / f"{n}.bin").write_bytes(b"\0" * 72)
    (d / "openvino_model.bin").write_bytes(b"\0" * model_bin)
    return d


def test_openvino_bin_checked_against_const_layers(tmp_path: Path) -> None:
    from localrun.formats.integrity import openvino_bin_extent

    d = _ov_folder(tmp_path, 72)
    # Const layers only (a Parameter's attributes are not weights), nested bodies included
    assert openvino_bin_extent(d / "openvino_model.xml") == 72
    assert detect(d).format == "openvino"
    (d / "openvino_model.bin").write_bytes(b"\0" * 71)
    with pytest.raises(ModelFileError) as info:
        detect(d)
    msg = str(info.value)
    assert "openvino_model.bin" in msg and "71 bytes on disk" in msg and "needs 72" in msg
    assert info.value.__cause__ is None


def test_openvino_tokenizer_bin_and_xml_damage(tmp_path: Path) -> None:
    d = _ov_folder(tmp_path, 72)
    (d / "openvino_detokenizer.bin").write_bytes(b"\0" * 40)
    with pytest.raises(ModelFileError, match=r"openvino_detokenizer\.bin.*40 bytes on disk"):
        detect(d)
    (d / "openvino_detokenizer.bin").write_bytes(b"\0" * 72)
    (d / "openvino_model.xml").write_text(OV_IR[:200])
    with pytest.raises(ModelFileError, match="OpenVINO IR is damaged or truncated"):
        detect(d)


def test_second_gguf_shard_truncated(tmp_path: Path, default_gguf: Path) -> None:
    """Each shard of a split GGUF has its own tensor table: all are checked, not the first."""
    d = tmp_path / "s"
    d.mkdir()
    data = default_gguf.read_bytes()
    (d / "m-00001-of-00002.gguf").write_bytes(data)
    (d / "m-00002-of-00002.gguf").write_bytes(data[:-1])
    with pytest.raises(ModelFileError) as info:
        detect(d)
    msg = str(info.value)
    assert "m-00002-of-00002.gguf" in msg
    assert f"{len(data) - 1:,} bytes on disk" in msg and f"needs {len(data):,}" in msg


def test_second_safetensors_shard_truncated(tmp_path: Path) -> None:
    d = folder(tmp_path, "sh2", {**CONFIG, "quantization": {"bits": 4, "group_size": 64}}, {})
    for i in (1, 2):
        write_safetensors_header(d / f"model-0000{i}-of-00002.safetensors", W)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert detect(d).format == "mlx"
    last = d / "model-00002-of-00002.safetensors"
    last.write_bytes(last.read_bytes()[:-1])
    with pytest.raises(ModelFileError, match=r"00002-of-00002\.safetensors.*truncated"):
        detect(d)


@pytest.mark.parametrize(("fixture", "weights"), [("onnx-int4", "model.onnx.data"),
                                                  ("openvino-int4", "openvino_model.bin")])
def test_fixture_metadata_reaches_the_last_byte(fixture: str, weights: str) -> None:
    """On the real converted models the reader finds the tensor that ends the file
    (the converters pack weights with no tail), so a cut of one byte is caught."""
    from localrun.formats import integrity
    from tests.models import test_model

    d = test_model(fixture)
    if fixture == "onnx-int4":
        entries = integrity.onnx_external_data(d / "model.onnx")
        assert len(entries) > 100  # every MatMulNBits weight, scale and embedding
        extent = max(e.offset + (e.length or 0) for e in entries)
    else:
        extent = integrity.openvino_bin_extent(d / "openvino_model.xml")
    assert extent == (d / weights).stat().st_size
