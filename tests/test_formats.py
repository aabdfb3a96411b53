"""Format detection on real files and folders (made here), damaged inputs, and refusals."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from localrun.backends import BACKENDS
from localrun.errors import FormatMismatchError, ModelFileError
from localrun.formats import compat
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
