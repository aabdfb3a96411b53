"""Which catalog model a local file or folder is, from what its files say about it.

The same model comes in many files: a GGUF of any quant, an MLX, OpenVINO or ONNX
conversion, a folder in the Hugging Face cache. What localrun knows about the model
beyond its files (its model card's sampling) must reach every one of them, so the
model is recognised by the names it carries, never by where one copy of it lives:

- a Hugging Face cache path: ``models--ORG--NAME`` is the repo it came from;
- GGUF metadata: ``general.repo_url`` / ``general.source.*``, ``general.name``, and
  ``general.basename`` + ``size_label`` + ``finetune`` (``SmolLM2``-``135M``-``Instruct``);
  ``general.base_model.*`` is the model this one was made from, not this one;
- config.json: ``_name_or_path`` (``_model_name_or_path`` when transformers read a GGUF);
- a converted folder's README front matter: ``base_model`` (mlx_lm, optimum-intel and
  the ONNX builders write the source repo there; for original weights it is the parent).

Plain file reads, no engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from localrun.errors import ModelFileError
from localrun.formats.detect import DetectedModel, read_json
from localrun.naming.catalog import CatalogEntry, for_model_name

_CACHE_DIR = re.compile(r"^models--([^/]+?)--(.+)$")
#: formats made by converting another repo: their README's base_model is their source
CONVERTED = frozenset({"mlx", "openvino", "onnx", "exl2", "exl3"})
_GGUF_URL_KEYS = ("general.repo_url", "general.source.repo_url", "general.source.url",
                  "general.source.huggingface.repository", "general.url")


def names(found: DetectedModel) -> list[str]:
    """The names the model goes by, most specific first (duplicates removed)."""
    out: list[str] = []
    for name in _names(found):
        if name and name not in out:
            out.append(name)
    return out


def identify(found: DetectedModel) -> CatalogEntry | None:
    """The catalog entry of the model in ``found``, or None when nothing names one."""
    for name in names(found):
        entry = for_model_name(name)
        if entry is not None:
            return entry
    return None


def card_sampling(found: DetectedModel) -> dict[str, Any]:
    """The sampling the model's card recommends, when the model is in the catalog."""
    entry = identify(found)
    return dict(entry.sampling) if entry is not None else {}


def _names(found: DetectedModel) -> Iterator[str]:
    path = Path(found.path)
    for part in reversed(path.parts):
        m = _CACHE_DIR.match(part)
        if m:
            yield f"{m.group(1)}/{m.group(2)}"
            break
    if found.format == "gguf":
        yield from _gguf_names(path)
        return
    folder = path if path.is_dir() else path.parent
    config = _json(folder / "config.json")
    for key in ("_name_or_path", "_model_name_or_path"):
        value = config.get(key)
        # a local path there says where it was converted, not what it is
        if isinstance(value, str) and not value.startswith(("/", ".", "~")) \
                and not re.match(r"^[A-Za-z]:\\", value):
            yield value
    if found.format in CONVERTED:
        yield from _readme_base_models(folder / "README.md")


def _gguf_names(path: Path) -> Iterator[str]:
    from localrun.formats.gguf import read_gguf

    try:
        info = read_gguf(path, check_size=False)  # the header detect() read: no new parse
    except ModelFileError:
        return
    meta = info.metadata
    for key in _GGUF_URL_KEYS:
        value = meta.get(key)
        if isinstance(value, str) and "huggingface.co/" in value:
            yield value
    if info.name:
        yield info.name
    parts = [meta.get(f"general.{k}") for k in ("basename", "size_label", "finetune")]
    if isinstance(parts[0], str):
        yield "-".join(p for p in parts if isinstance(p, str))
        org = meta.get("general.organization")
        if isinstance(org, str):
            yield org.replace(" ", "") + "/" + "-".join(p for p in parts if isinstance(p, str))


def _json(path: Path) -> dict[str, Any]:
    """A model's JSON file (:func:`~localrun.formats.detect.read_json`); ``{}`` when it
    is absent or unreadable: identification is best effort."""
    try:
        return read_json(path)
    except ModelFileError:
        return {}


def _readme_base_models(path: Path) -> Iterator[str]:
    """``base_model`` from YAML front matter: ``base_model: org/x`` or a ``- org/x`` list."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return
    if not text.startswith("---"):
        return
    head = text[3:].split("\n---", 1)[0]
    in_list = False
    for line in head.splitlines():
        key, sep, value = line.partition(":")
        if sep and not line.startswith((" ", "-", "\t")):
            in_list = key.strip() == "base_model" and not value.strip()
            if key.strip() == "base_model" and value.strip():
                yield value.strip().strip("'\"")
        elif in_list and line.strip().startswith("-"):
            yield line.strip()[1:].strip().strip("'\"")
