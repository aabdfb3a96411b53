"""What the backends read from a Hugging Face style model folder's JSON files.

A Hugging Face style folder keeps the architecture in ``config.json``, the
model's own generation defaults and end-of-sequence ids in ``generation_config.json``
and its chat template and special tokens beside the tokenizer
(:func:`read_chat_template`). Nothing here imports an engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localrun.errors import ModelFileError

# the one JSON reader of a model's files is formats.detect's; the engines read it from here
from localrun.formats.detect import read_json as read_json

#: generation_config.json key -> localrun sampling option
GENERATION_KEYS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def require_files(folder: Path, names: Iterable[str], *, what: str, hint: str | None = None
                  ) -> None:
    """Raise ModelFileError naming every file of ``names`` that is not in ``folder``."""
    if not folder.is_dir():
        raise ModelFileError(str(folder), "no such folder" if not folder.exists()
                             else f"{what} models are folders, not single files")
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise ModelFileError(str(folder), f"{what} model is incomplete, missing: "
                             + ", ".join(missing), hint=hint)
    empty = [n for n in names if (folder / n).stat().st_size == 0]
    if empty:
        raise ModelFileError(str(folder), "empty (truncated) file: " + ", ".join(empty), hint=hint)


def sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The model's own sampling defaults in localrun's terms.

    ``do_sample: false`` means the authors want greedy decoding, so it maps to
    temperature 0 and the sampling fields (which transformers ignores then) are dropped.
    Values localrun cannot read are dropped later by :func:`localrun.sampling.resolve`.
    """
    if generation_config.get("do_sample") is False:
        return {"temperature": 0.0}
    return {ours: generation_config[theirs] for theirs, ours in GENERATION_KEYS.items()
            if generation_config.get(theirs) is not None}


def token_ids(value: object) -> set[int]:
    """``eos_token_id`` as a set: configs store one id or a list of them."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def eos_ids(generation_config: Mapping[str, Any], config: Mapping[str, Any]) -> set[int]:
    """Every end-of-sequence id the model declares (generation_config first)."""
    return token_ids(generation_config.get("eos_token_id")) | token_ids(
        config.get("eos_token_id"))


def trained_context(config: Mapping[str, Any]) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    text = config.get("text_config")
    if isinstance(text, dict):
        return trained_context(text)
    return None


def architecture(config: Mapping[str, Any]) -> str | None:
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    mt = config.get("model_type")
    return mt if isinstance(mt, str) else None


@dataclass(frozen=True)
class ChatTemplate:
    template: str | None  # None: the model ships none (localrun falls back to ChatML)
    bos_token: str = ""
    eos_token: str = ""
    add_bos_token: bool | None = None  # None: not said (the tokenizer's post-processor decides)


def _token_text(value: object) -> str:
    """tokenizer_config.json keeps special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, dict) else None
    if isinstance(content, str):
        return content
    return ""


def _pick_template(value: object) -> str | None:
    """``chat_template`` is a string, or a list of ``{"name", "template"}`` (use "default")."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    return None


def read_chat_template(folder: Path) -> ChatTemplate:
    """The model's chat template and special tokens, as transformers would find them.

    transformers >= 4.43 may save the template as ``chat_template.jinja`` (and older
    releases as ``chat_template.json``) rather than inside ``tokenizer_config.json``;
    the first one found wins, in that order. The ExLlama converters copy every
    non-tensor file to the quantized folder, so these survive quantization.
    """
    tc = read_json(folder / "tokenizer_config.json")
    template: str | None = None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            template = jinja.read_text(encoding="utf-8") or None
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFileError(str(jinja), f"unreadable ({e})") from e
    if template is None:
        template = _pick_template(read_json(folder / "chat_template.json").get("chat_template"))
    if template is None:
        template = _pick_template(tc.get("chat_template"))
    add_bos = tc.get("add_bos_token")
    return ChatTemplate(template, _token_text(tc.get("bos_token")),
                        _token_text(tc.get("eos_token")),
                        add_bos if isinstance(add_bos, bool) else None)
