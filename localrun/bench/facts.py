"""What a benchmark report says of a model beyond its engine: parameters, the quant's
group size and the bytes of weights a decoded token reads (the roofline's numerator)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from localrun.formats.detect import DetectedModel


def gguf_facts(path: str) -> tuple[int, int | None]:
    """(parameter count, elements per block of the dominant quant type) from the
    GGUF tensor table."""
    from localrun.formats.gguf import read_gguf

    info = read_gguf(path)
    return info.parameters, info.group_size


def config_parameters(config: dict[str, Any]) -> int | None:
    """Parameters of a dense decoder (llama/qwen/mistral shape) from config.json."""
    try:
        h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        vocab, inter = int(config["vocab_size"]), int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        hd = int(config.get("head_dim") or h // heads)
    except (KeyError, TypeError, ValueError):
        return None
    attn = h * heads * hd * 2 + h * kv * hd * 2
    if config.get("attention_bias") or config.get("model_type") == "qwen2":
        attn += heads * hd + 2 * kv * hd
    per_layer = attn + 3 * h * inter + 2 * h
    tied = config.get("tie_word_embeddings", True)
    return vocab * h * (1 if tied else 2) + layers * per_layer + h


def _json_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def model_facts(found: DetectedModel) -> tuple[int | None, str, int | None, int | None]:
    """(parameters, where that came from, quant group size, weight bytes)."""
    if found.format == "gguf":
        from localrun.formats.gguf import read_gguf

        info = read_gguf(found.path)
        return (info.parameters or None, "gguf tensor table" if info.parameters else "unknown",
                info.group_size, info.tensor_bytes or None)
    folder = Path(found.path)
    config = _json_file(folder / "config.json")
    params = config_parameters(config) if config else None
    source = "config.json (dense estimate)" if params else "unknown"
    raw: Any = None
    if found.format == "mlx":
        q = config.get("quantization")
        raw = q.get("group_size") if isinstance(q, dict) else None
    elif found.format == "openvino":
        qc = _json_file(folder / "openvino_config.json").get("quantization_config")
        raw = qc.get("group_size") if isinstance(qc, dict) else None
    if raw is None and found.format in ("onnx", "openvino"):
        m = re.search(r"(?:block|group)[-_]?(?:size[-_]?)?(\d+)", str(folder).lower())
        raw = int(m.group(1)) if m else None
    fgroup = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    return params, source, fgroup, _weight_bytes(folder, found)


def _weight_bytes(folder: Path, found: DetectedModel) -> int | None:
    if found.format == "openvino":
        xml = str(found.details.get("model_file", "openvino_model.xml"))
        files = [folder / (xml[:-4] + ".bin")]
    elif found.format == "onnx":
        files = [f for f in folder.iterdir() if f.name.endswith((".onnx", ".onnx.data", ".data"))]
    else:
        files = list(folder.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files if f.is_file())
    return total or None
