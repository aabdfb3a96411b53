"""Tell a model's format from its files, without any engine."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.errors import ModelFileError
from localrun.formats.gguf import is_gguf, read_gguf

#: quantization_config.quant_method -> format
QUANT_METHODS: dict[str, str] = {
    "exl2": "exl2", "exl3": "exl3", "gptq": "gptq", "awq": "awq", "fp8": "fp8",
    "compressed-tensors": "compressed-tensors", "bitsandbytes": "bitsandbytes",
}


@dataclass(frozen=True)
class DetectedModel:
    format: str
    path: str  # the file or folder an engine should be given
    quantization: str | None = None
    architecture: str | None = None
    context_length: int | None = None
    details: dict[str, Any] = field(default_factory=dict)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(str(path), f"unreadable JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelFileError(str(path), "expected a JSON object")
    return data


def detect(path: str | os.PathLike[str]) -> DetectedModel:
    """Detect the format of a model file or folder; raise ModelFileError if unusable."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(str(p), "no such file or folder")
    if p.is_file():
        if p.suffix.lower() == ".gguf" or is_gguf(p):
            info = read_gguf(p)
            return DetectedModel("gguf", str(p), info.quantization, info.architecture,
                                 info.context_length)
        raise ModelFileError(str(p), "not a model file localrun knows (expected a .gguf file "
                             "or a model folder)")
    return _detect_dir(p)


def _detect_dir(p: Path) -> DetectedModel:
    names = {c.name for c in p.iterdir()}
    if "genai_config.json" in names:
        return DetectedModel("onnx", str(p), _onnx_quant(p))
    if "openvino_model.xml" in names or "openvino_language_model.xml" in names:
        return DetectedModel("openvino", str(p), None)
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf") and not n.startswith("mmproj"))
    config = _json(p / "config.json") if "config.json" in names else None
    if config is not None:
        arch = (config.get("architectures") or [None])[0]
        ctx = config.get("max_position_embeddings")
        qc = config.get("quantization_config")
        if isinstance(qc, dict) and isinstance(qc.get("quant_method"), str):
            method = qc["quant_method"].lower()
            fmt = QUANT_METHODS.get(method, method)
            bits = qc.get("bits")
            quant = f"{bits}bpw" if fmt in ("exl2", "exl3") and bits else (
                f"{bits}bit" if bits else None)
            return DetectedModel(fmt, str(p), quant, arch, ctx)
        mlxq = config.get("quantization")
        if isinstance(mlxq, dict) and "bits" in mlxq:
            return DetectedModel("mlx", str(p), f"{mlxq['bits']}bit", arch, ctx,
                                 {"group_size": mlxq.get("group_size")})
        if any(n.endswith(".safetensors") for n in names):
            dtype = config.get("torch_dtype") or config.get("dtype")
            return DetectedModel("hf", str(p), str(dtype) if dtype else None, arch, ctx)
    if len(ggufs) >= 1:
        first = p / ggufs[0]
        info = read_gguf(first)
        return DetectedModel("gguf", str(first), info.quantization, info.architecture,
                             info.context_length)
    raise ModelFileError(str(p), "no model files found (looked for *.gguf, config.json, "
                         "genai_config.json, openvino_model.xml)")


def _onnx_quant(p: Path) -> str | None:
    cfg = _json(p / "genai_config.json")
    model = cfg.get("model")
    if not isinstance(model, dict):
        raise ModelFileError(str(p / "genai_config.json"), "no 'model' section")
    return None
