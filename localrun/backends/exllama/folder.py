"""What an EXL2/EXL3 model folder says besides the weights: config.json,
generation_config.json and tokenizer.json, whether raw text starts with BOS, every
end-of-sequence id, the quant label and the weights' size. The chat template is read by
:func:`localrun.backends.hf_config.read_chat_template`, as for every HF-style folder."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from localrun.backends.hf_config import ChatTemplate, eos_ids, read_json


def read_model_json(folder: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """config.json (required), generation_config.json and tokenizer.json (optional)."""
    return (read_json(folder / "config.json", required=True),
            read_json(folder / "generation_config.json"), read_json(folder / "tokenizer.json"))


def adds_bos(template: ChatTemplate, tokenizer_json: Mapping[str, Any]) -> bool:
    """Whether raw text (no chat template) starts with BOS, as ``tokenizer(text)`` does.

    tokenizer_config.json's ``add_bos_token`` decides when present; else the fast
    tokenizer's post-processor adds it (Llama 3 style ``TemplateProcessing``).
    """
    if template.add_bos_token is not None:
        return template.add_bos_token
    post = tokenizer_json.get("post_processor")
    if not isinstance(post, dict) or not template.bos_token:
        return False
    processors = post.get("processors") if post.get("type") == "Sequence" else [post]
    for proc in processors if isinstance(processors, list) else []:
        if not isinstance(proc, dict) or proc.get("type") != "TemplateProcessing":
            continue
        for item in proc.get("single") or []:
            special = item.get("SpecialToken") if isinstance(item, dict) else None
            if isinstance(special, dict) and special.get("id") == template.bos_token:
                return True
    return False


def stop_token_ids(generation_config: Mapping[str, Any], config: Mapping[str, Any],
                   tokenizer_eos: int | None) -> list[int]:
    """Every end-of-sequence id: generation_config.json and config.json (an int or a
    list in either) plus the tokenizer's own EOS. The engines keep only one of them
    (``cfg.eos_token_id`` is the list's first entry), and a job without
    ``stop_conditions`` never stops on EOS."""
    ids = eos_ids(generation_config, config)
    text = config.get("text_config")
    if isinstance(text, dict):
        ids |= eos_ids({}, text)
    if isinstance(tokenizer_eos, int) and not isinstance(tokenizer_eos, bool) \
            and tokenizer_eos >= 0:
        ids.add(tokenizer_eos)
    return sorted(ids)


def quant_label(config: Mapping[str, Any]) -> str | None:
    """``4.0bpw`` for EXL2/EXL3 (``quantization_config.bits``), ``4bit`` for GPTQ."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    bits = qc.get("bits")
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        return None
    if str(qc.get("quant_method", "")).lower() in ("exl2", "exl3"):
        return f"{float(bits):.2f}bpw".replace(".00bpw", ".0bpw")
    return f"{int(bits)}bit"


def weights_bytes(folder: Path) -> int:
    """Size of the model's safetensors files (what has to go to VRAM)."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors") if f.is_file())


def model_name(config: Mapping[str, Any], folder: Path) -> str:
    name = config.get("_name_or_path")
    return name if isinstance(name, str) and name else folder.name
